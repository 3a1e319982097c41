//! iopath's vhost-user-blk backend (`iopath serve virtio-blk --transport
//! vhost-user`) under QEMU's own frontend, `vhost-user-blk-pci`: QEMU 7.2 +
//! KVM with iopath's guest, whose virtio-blk driver (`workload=vblk`)
//! writes a pattern and reads it back, in both notify modes; and QEMU 11
//! (TCG, from `harness/linux/`) with a stock Linux guest: its virtio_blk
//! driver, fio verify, mkfs/mount/fsck. Independent frontends and drivers,
//! so the backend is checked apart from iopath's VMM. Needs /dev/kvm,
//! qemu-system-x86_64 and root (the harness).

mod common;
#[path = "common/vblk.rs"]
mod vblk_record;
use common::{kvm, programs};
use vblk_record::num;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
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
        if t0.elapsed() > Duration::from_secs(60) {
            // Where each of its threads waits, to tell a stuck backend from a peer that did not leave.
            let tasks = std::fs::read_dir(format!("/proc/{}/task", s.0.id())).map(|d| {
                d.filter_map(|t| t.ok())
                    .map(|t| {
                        let f = |n: &str| std::fs::read_to_string(t.path().join(n)).unwrap_or_default();
                        format!("{} {} {}", f("comm").trim(), f("wchan"), f("syscall").trim())
                    })
                    .collect::<Vec<_>>()
            });
            let peers = std::process::Command::new("pgrep").args(["-a", "qemu-system"]).output();
            let peers = peers.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
            panic!("iopath serve did not exit after its frontend: threads {tasks:?}; QEMUs running: {peers}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (mut out, mut err) = (String::new(), String::new());
    s.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    s.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (out, err)
}

/// QEMU's arguments: guest RAM a shared memfd (vhost-user maps it), the
/// backend's socket as a chardev, vhost-user-blk-pci (modern only) on it.
/// `hugetlb`: 32 MiB of guest RAM in 2 MiB hugetlbfs pages (16 of this machine's pool).
fn qemu_args(chardev: &str, cmdline: &str, hugetlb: bool) -> Vec<String> {
    let image = iopath_guest::image_file().unwrap();
    let (mem, backend) = if hugetlb {
        (32, "memory-backend-memfd,id=mem,size=32M,share=on,hugetlb=on,hugetlbsize=2M")
    } else {
        (256, "memory-backend-memfd,id=mem,size=256M,share=on")
    };
    let extra: Vec<String> =
        ["-object", backend, "-numa", "node,memdev=mem", "-chardev", chardev].iter().map(|s| s.to_string()).collect();
    let dev = ["vhost-user-blk-pci,chardev=c0,num-queues=1,disable-legacy=on"];
    iopath_bench::qemu::args_with(&image, cmdline, mem, &extra, &dev)
}

fn qemu() -> PathBuf {
    kvm();
    programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)")
}

/// One verify run of the guest through iopath's backend in `notify` mode,
/// the backend on a listening socket or (`fd`) an inherited one.
fn verify_through_backend(notify: &str, fd: bool) {
    verify_through_backend_in(notify, fd, false)
}

/// The same, guest RAM in hugetlb pages if `hugetlb`.
fn verify_through_backend_in(notify: &str, fd: bool, hugetlb: bool) {
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
    let args = qemu_args(&chardev, cmdline, hugetlb);
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

/// QEMU's hugetlb guest RAM: SET_MEM_TABLE's region above 1 MiB starts at
/// offset 0x100000 of the memfd, inside a huge page; the backend maps the
/// whole pages around it.
#[test]
fn qemu_vhost_user_blk_pci_with_hugetlb_guest_ram_verifies_through_iopaths_backend() {
    verify_through_backend_in("ioeventfd", false, true);
}

/// The VMM's spawn path: `iopath serve ... --fd 3` on one end of a socket
/// pair (QEMU takes the other as `-chardev socket,fd=3`); the process
/// serves that one frontend and exits.
#[test]
fn qemu_vhost_user_blk_pci_verifies_through_iopaths_backend_on_an_inherited_fd() {
    verify_through_backend("ioeventfd", true);
}

/// One Linux guest at a time (TCG needs the cores).
static LINUX: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A stock Linux guest (trixie kernel, QEMU 11 TCG; `harness/linux/run-linux.sh
/// --vhost-user`) runs `guest-vblk.sh` on the disk iopath's backend serves.
fn linux_through_backend(notify: &str, vcpus: u32) {
    let _one = LINUX.lock().unwrap_or_else(|p| p.into_inner());
    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/linux");
    let sock = std::env::temp_dir().join(format!("iopath-vublk-linux-{notify}-{vcpus}-{}.sock", std::process::id()));
    let spec = format!("virtio-blk,backend=ram,size_mb=64,notify={notify}");
    let s = serve(&spec, &Via::Socket(sock.clone()));
    let out = Command::new("bash")
        .arg(harness.join("run-linux.sh"))
        .arg("--vhost-user")
        .arg(&sock)
        .args(["--timeout", "300", "--quiet", "--smp", &vcpus.to_string(), "--append"])
        .arg(format!("harness.vblk_sectors=131072 harness.vblk_queues={vcpus}"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.code() != Some(0) {
        drop(s);
        panic!("run-linux.sh failed ({:?}):\n{text}", out.status.code());
    }
    let (sout, serr) = finish(s);
    let _ = std::fs::remove_file(&sock);
    // The console log holds the checks; run-linux.sh names it.
    let log = text
        .lines()
        .find_map(|l| l.split("console log: ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let checks: Vec<&str> = log
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .filter(|l| l.starts_with("@check ") || l.starts_with("@done "))
        .collect();
    println!("{}", checks.join("\n"));
    assert_eq!(
        out.status.code(),
        Some(0),
        "Linux guest checks failed:\n{text}\n{}\n--- iopath serve ---\n{serr}",
        checks.join("\n")
    );
    for want in common::LINUX_VBLK_CHECKS {
        assert!(checks.iter().any(|l| l.starts_with(&format!("@check {want} ok"))), "{want}: {checks:?}");
    }
    let line = sout.lines().find(|l| iopath_protocols::process::parse_report(l).is_some());
    let line = line.unwrap_or_else(|| panic!("no counters line from iopath serve: {sout}\n{serr}"));
    println!("backend: {line}");
    let c = iopath_protocols::process::parse_report(line).unwrap();
    let get = |n: &str| c.iter().find(|x| x.name == n).map(|x| x.value).unwrap_or_else(|| panic!("{n} in {line}"));
    // fio alone moved 2 x 16 MiB in 4 KiB requests through the backend, and Linux waits for interrupts.
    assert!(get("requests") >= 8192, "{line}");
    assert!(get("interrupts") > 0, "{line}");
    assert_eq!((get("errors"), get("ring_errors"), get("refused")), (0, 0, 0), "{line}\n{serr}");
    // Every request was served on one of the queues the guest has, none on another.
    let per_queue: u64 = (0..vcpus).map(|q| get(&format!("q{q}.requests"))).sum();
    assert_eq!(per_queue, get("requests"), "{line}");
}

#[test]
fn linux_virtio_blk_driver_through_iopaths_backend_notify_ioeventfd() {
    linux_through_backend("ioeventfd", 1);
}

/// Two vCPUs: QEMU asks for two queues (GET_QUEUE_NUM allows 4), the
/// driver sets up two (VIRTIO_BLK_F_MQ, num_queues), each ring has its thread.
#[test]
fn linux_virtio_blk_driver_on_two_queues_through_iopaths_backend() {
    linux_through_backend("ioeventfd", 2);
}

#[test]
fn linux_virtio_blk_driver_through_iopaths_backend_notify_poll() {
    linux_through_backend("poll", 1);
}

/// `--keep-state` means nothing to a vhost-user backend: refused with a
/// clear error, not ignored.
#[test]
fn keep_state_is_refused_with_vhost_user() {
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "virtio-blk", "--transport", "vhost-user", "--socket", "/nonexistent/iopath-ks.sock"])
        .arg("--keep-state")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--keep-state does not apply to --transport vhost-user"), "{err}");
}
