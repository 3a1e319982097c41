//! iopath's VMM as a vhost-user-blk frontend (`--device vhost-user-blk:PATH`),
//! end to end on the real /dev/kvm: against an independent backend
//! (qemu-storage-daemon's vhost-user-blk export of a file), and against
//! fake backends written here that answer nothing, garbage, a huge
//! configuration, or stop answering at DRIVER_OK.

mod common;
use common::TempDir;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Waits (bounded, for liveness only) until `path` exists.
fn wait_for(path: &Path) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `iopath run --workload vblk` with `spec`.
fn run(spec: &str, args: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["run", "--workload", "vblk", "--device", spec, "--append", args, "--timeout", "60"])
        .output()
        .unwrap()
}

/// The guest's `@vblk` record as numbers.
fn vblk_record(stdout: &str) -> std::collections::BTreeMap<String, u64> {
    let rec = stdout.lines().find(|l| l.starts_with("@vblk ")).unwrap_or_else(|| panic!("no @vblk record:\n{stdout}"));
    rec.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// A device counter from `iopath run`'s report (`name=value`; a counter
/// that is 0 is not printed).
fn counter(stderr: &str, name: &str) -> u64 {
    stderr
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The guest's verify pattern (guest/c/load.c): the 8 bytes at byte `o` of
/// the disk are `(o / 512) * K ^ (o % 512) ^ seed`, one seed per run.
fn holds_the_verify_pattern(img: &[u8]) -> bool {
    const K: u64 = 0x9e3779b97f4a7c15;
    let word = |o: usize| u64::from_le_bytes(img[o..o + 8].try_into().unwrap());
    let seed = word(0);
    (0..img.len()).step_by(8).all(|o| word(o) ^ (o as u64 / 512).wrapping_mul(K) ^ (o as u64 % 512) == seed)
}

#[test]
fn the_vmm_drives_qemu_storage_daemons_vhost_user_blk_export() {
    common::kvm();
    // This host has it (COMMON.md): a missing one is a failure, not a skip.
    let qsd = which("qemu-storage-daemon").unwrap_or_else(|()| panic!("qemu-storage-daemon is not on PATH"));
    let dir = TempDir::new("vu-qsd");
    let (img, sock) = (dir.join("disk.img"), dir.join("vu.sock"));
    std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
    let daemon = Daemon(
        Command::new(qsd)
            .arg("--blockdev")
            .arg(format!("driver=file,node-name=f0,filename={}", img.display()))
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on",
                sock.display()
            ))
            .spawn()
            .unwrap(),
    );
    wait_for(&sock);

    // The guest writes a pattern over 4 MiB and reads it back, asking for an
    // interrupt at each completion (intr=1), which the VMM relays (no vector).
    let out = run(&format!("vhost-user-blk:{}", sock.display()), "verify=1 bs=4096 iodepth=4 size_mb=4 intr=1");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    for l in stdout.lines().filter(|l| l.starts_with("@vblk") && !l.starts_with("@vblk-hist")) {
        println!("{l}");
    }
    println!("{}", stderr.lines().last().unwrap_or(""));
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let r = vblk_record(&stdout);
    assert!(r["ios"] > 0, "{r:?}");
    assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{r:?}");
    // The path: every notification the driver wrote was the KVM ioeventfd
    // the backend is kicked through (none exited to the VMM); one DRIVER_OK
    // set the ring up; the backend never failed a request. This guest does
    // not enable MSI-X (it polls, and keeps used_event current with
    // EVENT_IDX), so the backend's calls reach the VMM's relay, never an
    // irqfd, and each became an INTx.
    assert!(r["notifies"] > 0, "{r:?}");
    assert_eq!(counter(&stderr, "kick_ioeventfd"), 1, "{stderr}");
    assert_eq!((counter(&stderr, "notifies"), counter(&stderr, "kicks_forwarded")), (0, 0), "{stderr}");
    assert_eq!(counter(&stderr, "activations"), 1, "{stderr}");
    assert!(counter(&stderr, "backend_msgs") >= 12, "{stderr}");
    assert_eq!((counter(&stderr, "backend_errors"), counter(&stderr, "ring_errors")), (0, 0), "{stderr}");
    assert!(counter(&stderr, "calls_relayed") > 0, "{stderr}");
    assert_eq!(counter(&stderr, "call_irqfd"), 0, "{stderr}");
    assert_eq!(counter(&stderr, "calls_relayed"), counter(&stderr, "interrupts"), "{stderr}");
    drop(daemon);

    // The data is in qemu-storage-daemon's file, not anywhere in iopath.
    let data = std::fs::read(&img).unwrap();
    assert!(holds_the_verify_pattern(&data[..4 << 20]), "the guest's pattern is not in the image");
    assert!(data[4 << 20..].iter().all(|&b| b == 0), "nothing was written past the 4 MiB the guest wrote");
}

#[test]
fn the_vmm_drives_iopaths_own_vhost_user_blk_backend_in_a_device_process_it_starts() {
    common::kvm();
    // `@vhost-user`: the VMM starts `iopath serve virtio-blk,... --transport
    // vhost-user --fd 3` on a socketpair and is its frontend.
    let out = run("virtio-blk,backend=ram,size_mb=64@vhost-user", "verify=1 bs=4096 iodepth=4 size_mb=4");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{}", stderr.lines().last().unwrap_or(""));
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let r = vblk_record(&stdout);
    assert!(r["ios"] > 0, "{r:?}");
    assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{r:?}");
    // Every request the guest completed was served by the backend process,
    // which counted it; no notification exited to the VMM (the notify
    // address is the ioeventfd the backend is kicked through).
    assert_eq!(counter(&stderr, "backend.requests"), r["ios"], "{stderr}");
    assert_eq!(counter(&stderr, "notifies"), 0, "{stderr}");
    assert_eq!((counter(&stderr, "kick_ioeventfd"), counter(&stderr, "activations")), (1, 1), "{stderr}");
    assert_eq!((counter(&stderr, "backend_errors"), counter(&stderr, "ring_errors")), (0, 0), "{stderr}");
}

#[test]
fn the_vmm_asks_a_backend_for_two_queues_and_starts_the_one_its_driver_enables() {
    common::kvm();
    // iopath's backend with queues=2, and qemu-storage-daemon's export with num-queues=2: the
    // function has 2 queues (GET_QUEUE_NUM said so); the guest's one-queue driver enables
    // queue 0, the only ring the VMM starts, which serves every request.
    let out = run("virtio-blk,backend=ram,size_mb=64,queues=2@vhost-user", "verify=1 bs=4096 iodepth=4 size_mb=4");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}\n{stdout}");
    let r = vblk_record(&stdout);
    assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{r:?}");
    assert_eq!(counter(&stderr, "backend.q0.requests"), r["ios"], "{stderr}");
    assert_eq!(counter(&stderr, "backend.q1.requests"), 0, "{stderr}");
    assert_eq!((counter(&stderr, "kick_ioeventfd"), counter(&stderr, "activations")), (1, 1), "{stderr}");
    assert_eq!((counter(&stderr, "backend_errors"), counter(&stderr, "ring_errors")), (0, 0), "{stderr}");

    let qsd = which("qemu-storage-daemon").unwrap_or_else(|()| panic!("qemu-storage-daemon is not on PATH"));
    for (num_queues, ok) in [(2, true), (1, false)] {
        let dir = TempDir::new(&format!("vu-qsd-mq{num_queues}"));
        let (img, sock) = (dir.join("disk.img"), dir.join("vu.sock"));
        std::fs::File::create(&img).unwrap().set_len(64 << 20).unwrap();
        let daemon = Daemon(
            Command::new(&qsd)
                .arg("--blockdev")
                .arg(format!("driver=file,node-name=f0,filename={}", img.display()))
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path={},writable=on,num-queues={num_queues}",
                    sock.display()
                ))
                .spawn()
                .unwrap(),
        );
        wait_for(&sock);
        let out =
            run(&format!("virtio-blk,queues=2@vhost-user:{}", sock.display()), "verify=1 bs=4096 iodepth=4 size_mb=4");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if ok {
            assert!(out.status.success(), "{stderr}\n{stdout}");
            let r = vblk_record(&stdout);
            assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{r:?}");
            assert_eq!((counter(&stderr, "activations"), counter(&stderr, "backend_errors")), (1, 0), "{stderr}");
        } else {
            // Asked for more queues than the backend has: the run does not start, and says why.
            assert!(!out.status.success(), "{stderr}\n{stdout}");
            assert!(stderr.contains("2 queues asked, and the backend has 1"), "{stderr}");
        }
        drop(daemon);
    }
}

fn which(name: &str) -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|f| f.is_file()))
        .ok_or(())
}

/// How a fake backend misbehaves.
#[derive(Clone, Copy, Debug)]
enum Fake {
    /// Reads requests and answers none.
    Silent,
    /// Answers each request with bytes that are no vhost-user reply.
    Garbage,
    /// A proper handshake, then a GET_CONFIG reply that claims 1 GiB.
    HugeConfig,
    /// A proper handshake (with REPLY_ACK), then no answer from DRIVER_OK's first request on.
    StallAtDriverOk,
}

const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const GET_PROTOCOL_FEATURES: u32 = 15;
const GET_CONFIG: u32 = 24;
const NEED_REPLY: u32 = 0x8;
const REPLY: u32 = 0x4 | 0x1;

fn reply(s: &mut UnixStream, req: u32, body: &[u8]) {
    let mut m = Vec::new();
    for v in [req, REPLY, body.len() as u32] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    m.extend_from_slice(body);
    let _ = s.write_all(&m);
}

/// Serves one frontend on `listener` the way `mode` says, until it hangs up.
fn fake_backend(listener: UnixListener, mode: Fake) {
    let Ok((mut s, _)) = listener.accept() else { return };
    let features: u64 = (1 << 32) | (1 << 30) | (1 << 29) | (1 << 2);
    let protocol: u64 = 0x200 | 0x8; // CONFIG, REPLY_ACK
    loop {
        let mut hdr = [0u8; 12];
        if s.read_exact(&mut hdr).is_err() {
            return;
        }
        let field = |i: usize| u32::from_le_bytes(hdr[4 * i..4 * i + 4].try_into().unwrap());
        let (req, flags, size) = (field(0), field(1), field(2));
        let mut body = vec![0u8; size.min(4096) as usize];
        if s.read_exact(&mut body).is_err() {
            return;
        }
        match (mode, req) {
            (Fake::Silent, _) => {}
            (Fake::Garbage, _) => {
                let _ = s.write_all(&[0xff; 20]);
            }
            (Fake::StallAtDriverOk, SET_FEATURES) => {
                // Keep the socket open and answer nothing more.
                let _ = s.read_to_end(&mut Vec::new());
                return;
            }
            (_, GET_FEATURES) => reply(&mut s, req, &features.to_le_bytes()),
            (_, GET_PROTOCOL_FEATURES) => reply(&mut s, req, &protocol.to_le_bytes()),
            (Fake::HugeConfig, GET_CONFIG) => {
                let mut m = Vec::new();
                for v in [req, REPLY, 1 << 30] {
                    m.extend_from_slice(&v.to_le_bytes());
                }
                m.extend_from_slice(&body[..12.min(body.len())]);
                m.extend_from_slice(&[0xab; 4096]);
                let _ = s.write_all(&m);
            }
            (_, GET_CONFIG) => {
                let mut b = body[..12].to_vec();
                let mut cfg = vec![0u8; body.len() - 12];
                cfg[..8].copy_from_slice(&(64u64 << 11).to_le_bytes()); // 64 MiB in sectors
                b.extend_from_slice(&cfg);
                reply(&mut s, req, &b);
            }
            _ if flags & NEED_REPLY != 0 => reply(&mut s, req, &0u64.to_le_bytes()),
            _ => {}
        }
    }
}

/// Runs the guest against a fake backend; the run must fail, without a
/// panic, within a bound, with `want` in what it says.
fn a_bad_backend_fails_the_run(mode: Fake, want: &[&str]) {
    common::kvm();
    let dir = TempDir::new(&format!("vu-{mode:?}"));
    let sock = dir.join("fake.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || fake_backend(listener, mode));
    let t = Instant::now();
    let out = run(&format!("vhost-user-blk:{}", sock.display()), "verify=1 bs=4096 iodepth=4 size_mb=1");
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{mode:?} after {:?}: {}", t.elapsed(), stderr.trim_end());
    assert!(!out.status.success(), "{mode:?}: the run succeeded: {stderr}");
    assert_ne!(out.status.code(), Some(101), "{mode:?}: iopath panicked: {stderr}");
    assert!(!stderr.contains("panicked"), "{mode:?}: {stderr}");
    for w in want {
        assert!(stderr.contains(w), "{mode:?}: {w:?} not in: {stderr}");
    }
    // Liveness only: the frontend waits 5 s per reply; the guest's own 60 s watchdog must not be what ended it.
    assert!(t.elapsed() < Duration::from_secs(45), "{mode:?}: took {:?}", t.elapsed());
}

#[test]
fn a_backend_that_never_answers_fails_the_run_with_a_timeout() {
    a_bad_backend_fails_the_run(Fake::Silent, &["vhost-user-blk:", "GET_FEATURES", "timed out"]);
}

#[test]
fn a_backend_that_answers_garbage_fails_the_run() {
    a_bad_backend_fails_the_run(Fake::Garbage, &["vhost-user-blk:", "GET_FEATURES"]);
}

#[test]
fn a_backend_with_a_huge_configuration_fails_the_run() {
    a_bad_backend_fails_the_run(Fake::HugeConfig, &["vhost-user-blk:", "GET_CONFIG"]);
}

#[test]
fn a_backend_that_stops_answering_at_driver_ok_needs_reset_and_stops_the_run() {
    a_bad_backend_fails_the_run(Fake::StallAtDriverOk, &["SET_FEATURES", "timed out", "needs reset"]);
}
