//! iopath's vhost-user-blk backend (`iopath serve virtio-blk --transport
//! vhost-user`) under QEMU 7.2's own frontend, `vhost-user-blk-pci`: the
//! guest's virtio-blk driver (`workload=vblk`) writes a pattern and reads
//! it back through it, in both notify modes. An independent frontend, so
//! the backend is checked apart from iopath's VMM. Needs /dev/kvm and
//! qemu-system-x86_64.

mod common;
#[path = "common/vblk.rs"]
mod vblk_record;
use common::{kvm, programs};
use vblk_record::num;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The device process, killed if the test ends before it exits.
struct Serve(Child);
impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How the device process gets its frontend.
enum Via {
    /// `--socket PATH --once`; QEMU connects to PATH.
    Socket(PathBuf),
    /// `--fd 3`, one end of a socket pair; QEMU gets the other as its fd 3.
    Fd(OwnedFd),
}

/// Starts `iopath serve SPEC --transport vhost-user` with `via` and waits
/// (bounded) for its socket.
fn serve(spec: &str, via: &Via) -> Serve {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iopath"));
    cmd.args(["serve", spec, "--transport", "vhost-user"]);
    match via {
        Via::Socket(sock) => {
            let _ = std::fs::remove_file(sock);
            cmd.args(["--once", "--socket"]).arg(sock);
        }
        Via::Fd(fd) => {
            iopath_protocols::process::inherit_as_fd3(&mut cmd, fd);
            cmd.args(["--fd", "3"]);
        }
    }
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let s = Serve(child);
    let t0 = Instant::now();
    while matches!(via, Via::Socket(p) if !p.exists()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "iopath serve made no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    s
}

/// Waits (bounded) for the device process to exit; its stdout and stderr.
fn finish(mut s: Serve) -> (String, String) {
    let t0 = Instant::now();
    while s.0.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(20), "iopath serve --once did not exit after QEMU");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut out, mut err) = (String::new(), String::new());
    s.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    s.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (out, err)
}

/// QEMU's arguments: guest RAM a shared memfd (vhost-user maps it), the
/// backend's socket as a chardev, vhost-user-blk-pci (modern only) on it.
fn qemu_args(chardev: &str, cmdline: &str) -> Vec<String> {
    let image = iopath_guest::image_file().unwrap();
    let extra: Vec<String> =
        ["-object", "memory-backend-memfd,id=mem,size=256M,share=on", "-numa", "node,memdev=mem", "-chardev", chardev]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let dev = ["vhost-user-blk-pci,chardev=c0,num-queues=1,disable-legacy=on"];
    iopath_bench::qemu::args_with(&image, cmdline, 256, &extra, &dev)
}

fn qemu() -> PathBuf {
    kvm();
    programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)")
}

/// One verify run of the guest through iopath's backend in `notify` mode,
/// the backend on a listening socket or (`fd`) an inherited one.
fn verify_through_backend(notify: &str, fd: bool) {
    let qemu = qemu();
    let spec = format!("virtio-blk,backend=ram,size_mb=64,notify={notify}");
    let sock = std::env::temp_dir().join(format!("iopath-vublk-{notify}-{fd}-{}.sock", std::process::id()));
    let (via, fd3, chardev) = if fd {
        let (a, b) = UnixStream::pair().unwrap();
        (Via::Fd(b.into()), Some(OwnedFd::from(a)), "socket,id=c0,fd=3".to_string())
    } else {
        (Via::Socket(sock.clone()), None, format!("socket,id=c0,path={}", sock.display()))
    };
    let s = serve(&spec, &via);
    drop(via); // the device process holds its end
    let cmdline = "workload=vblk verify=1 bs=4096 iodepth=8 size_mb=4";
    let args = qemu_args(&chardev, cmdline);
    let how = if fd { "--fd 3".to_string() } else { format!("--once --socket {}", sock.display()) };
    println!("iopath serve {spec} --transport vhost-user {how}");
    println!("{} {}", qemu.display(), args.join(" "));
    let q = iopath_bench::qemu::run_args(&qemu, args, fd3, Duration::from_secs(120), |_| {}).unwrap();
    for l in q.lines.iter().filter(|l| l.starts_with("@vblk") && !l.starts_with("@vblk-hist")) {
        println!("{l}");
    }
    let rec = vblk_record::record(&q, &spec);
    let (out, err) = finish(s);
    let _ = std::fs::remove_file(&sock);
    assert_eq!(rec["rw"], "verify");
    assert_eq!(num(&rec, "mismatches"), 0, "{rec:?}");
    assert_eq!(num(&rec, "verified_blocks"), 1024, "{rec:?}");
    let ios = num(&rec, "ios");
    assert!(ios > 0, "{rec:?}");
    // The requests went through iopath's backend: its counters saw them.
    let line = out.lines().find(|l| iopath_protocols::process::parse_report(l).is_some());
    let line = line.unwrap_or_else(|| panic!("no counters line from iopath serve: {out}\n{err}"));
    println!("backend: {line}");
    let c = iopath_protocols::process::parse_report(line).unwrap();
    let get = |n: &str| c.iter().find(|x| x.name == n).map(|x| x.value).unwrap_or_else(|| panic!("{n} in {line}"));
    assert!(get("requests") >= ios, "the backend served {} requests for {ios} guest I/Os: {line}", get("requests"));
    assert_eq!(get("errors"), 0, "{line}");
    assert_eq!(get("ring_errors"), 0, "{line}");
    assert_eq!(get("refused"), 0, "{line}\n{err}");
    assert!(get("kicks") > 0, "{line}");
    // The mode asked for is the one that ran: only the poller sleeps (once
    // idle, at the latest after the last request).
    if notify == "poll" {
        assert!(get("sleeps") > 0, "{line}");
    } else {
        assert_eq!(get("sleeps"), 0, "{line}");
    }
    assert!(!err.contains("closing its channel") && !err.contains("seccomp"), "{err}");
}

#[test]
fn qemu_vhost_user_blk_pci_verifies_through_iopaths_backend_notify_ioeventfd() {
    verify_through_backend("ioeventfd", false);
}

#[test]
fn qemu_vhost_user_blk_pci_verifies_through_iopaths_backend_notify_poll() {
    verify_through_backend("poll", false);
}

/// The VMM's spawn path: `iopath serve ... --fd 3` on one end of a socket
/// pair (QEMU takes the other as `-chardev socket,fd=3`); the process
/// serves that one frontend and exits.
#[test]
fn qemu_vhost_user_blk_pci_verifies_through_iopaths_backend_on_an_inherited_fd() {
    verify_through_backend("ioeventfd", true);
}
