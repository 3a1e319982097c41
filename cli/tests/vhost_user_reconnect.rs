//! iopath's VMM survives `kill -9` of the vhost-user-blk backend it
//! started (`--device virtio-blk,backend=file:...@vhost-user`): the guest's
//! verify workload (every block written with a pattern, then read back and
//! compared) runs while the test kills the backend process with SIGKILL
//! every 2 s; the frontend starts a new one and replays the session with
//! the kept in-flight region, which the new backend resubmits.
//!
//! Oracles: the guest's own (no I/O error, no mismatch, every block read
//! back), the VMM's counter (one reconnect per kill), and the file itself
//! after the run, read back and compared word by word with the pattern the
//! host computes on its own. The pause each kill caused (the frontend's
//! log: from the death seen to the first completion after it) is printed,
//! not asserted (the machine is shared). The same with an external backend
//! (`vhost-user-blk:PATH`, `iopath serve ... --socket PATH`) that the test
//! kills and starts again on the same socket, which the VMM waits for.

mod common;
use common::kills::*;
use common::TempDir;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The disk and the range the guest verifies, in MiB: at 512-byte blocks
/// the write and read-back passes take long enough (about 30 s here) for
/// a kill every 2 s to land in both.
const SIZE_MB: u64 = 320;

/// Prints the numbers and checks the guest's and the VMM's oracles.
fn check(o: &Outcome, size_mb: u64) {
    let Outcome { kills, aimed, stderr, .. } = o;
    let rec = o.guest("vblk", size_mb);
    let mut pauses: Vec<f64> = stderr
        .lines()
        .filter_map(|l| l.split("first completion ").nth(1)?.split(" ms after the death").next()?.parse().ok())
        .collect();
    pauses.sort_by(|a, b| a.total_cmp(b));
    let resubmitted: u64 = stderr
        .lines()
        .filter_map(|l| l.split("resubmitting ").nth(1)?.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    let report = stderr.lines().rev().find(|l| l.contains("reconnects=")).unwrap_or("");
    for l in stderr.lines().filter(|l| l.contains("reconnect try")) {
        eprintln!("{l}");
    }
    eprintln!(
        "kills={kills} ({aimed} aimed at a busy backend) reconnects={} guest: {rec}\n\
         in-flight requests resubmitted by new backends (their log): {resubmitted}\n\
         pause from the death to the first completion over {} kills: p50={:.1} ms p99={:.1} ms max={:.1} ms\n{report}",
        counter(stderr, "reconnects"),
        pauses.len(),
        percentile(&pauses, 50.0),
        percentile(&pauses, 99.0),
        pauses.last().copied().unwrap_or(f64::NAN),
    );
    assert!(*kills >= 2, "only {kills} kills landed in the guest's window");
    let reconnects = counter(stderr, "reconnects");
    assert_eq!(reconnects, o.needed_reconnects(reconnects), "one reconnect per kill:\n{stderr}");
    assert_eq!(counter(stderr, "inflight_shmfd"), 1, "{stderr}");
}

/// A server process, killed and reaped when dropped (also when a test fails).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `iopath serve DEVICE --transport vhost-user --socket SOCK` (a stale socket replaced), once it
/// listens; its stderr to `stderr`.
fn serve(device: &str, sock: &std::path::Path, stderr: Stdio) -> std::process::Child {
    let _ = std::fs::remove_file(sock);
    let c = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", device, "--transport", "vhost-user", "--socket"])
        .arg(sock)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("iopath serve");
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "iopath serve never made its socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    c
}

#[test]
fn the_guest_verify_workload_survives_kill_9_of_its_vhost_user_blk_backend_every_2_s() {
    common::kvm();
    let dir = TempDir::new("vu-reconnect");
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(SIZE_MB << 20).unwrap();
    let spec = format!("virtio-blk,backend=file:{},size_mb={SIZE_MB},queues=1@vhost-user", img.display());
    // The backend is the VMM's one live child that was not killed yet.
    let find = |vmm: u32, killed: &[u32]| {
        let b: Vec<u32> = live_children(vmm).into_iter().filter(|p| !killed.contains(p)).collect();
        assert!(b.len() <= 1, "one backend process runs: {b:?}");
        b.first().copied()
    };
    let o = under_kills("vblk", &spec, SIZE_MB, find, |_| ());
    check(&o, SIZE_MB);
    // Each death was logged with its cause, and numbered.
    let reconnected = o.needed_reconnects(counter(&o.stderr, "reconnects")) as usize;
    for (i, pid) in o.killed.iter().take(reconnected).enumerate() {
        let line = format!("device process {pid} ended: signal: 9 (SIGKILL); reconnect {}:", i + 1);
        assert!(o.stderr.contains(&line), "no log of kill {} ({line}):\n{}", i + 1, o.stderr);
    }
    // Some kill found a request taken and not completed, which the next backend resubmitted.
    if o.aimed > 0 {
        assert!(o.stderr.contains("resubmitting"), "{} kills inside a disk I/O, none resubmitted", o.aimed);
    }
    check_file(&img, SIZE_MB);
}

/// An external backend, killed and started again by the test on the same
/// socket (after 200 ms): the VMM waits for it and replays the session.
#[test]
fn the_guest_verify_workload_survives_kill_9_of_an_external_vhost_user_blk_backend() {
    const MB: u64 = 256;
    common::kvm();
    let dir = TempDir::new("vu-reconnect-ext");
    let (img, sock) = (dir.join("disk.img"), dir.join("vu.sock"));
    std::fs::File::create(&img).unwrap().set_len(MB << 20).unwrap();
    let device = format!("virtio-blk,backend=file:{},size_mb={MB},queues=1", img.display());
    let start = || serve(&device, &sock, Stdio::inherit());
    let backend = std::cell::RefCell::new(Reaped(start()));
    let o = under_kills(
        "vblk",
        &format!("vhost-user-blk:{}", sock.display()),
        MB,
        |_, _| Some(backend.borrow().0.id()),
        |_| {
            let _ = backend.borrow_mut().0.wait();
            std::thread::sleep(Duration::from_millis(200));
            backend.borrow_mut().0 = start();
        },
    );
    check(&o, MB);
    let reconnects = o.stderr.matches("an external server closed its socket; reconnect").count() as u64;
    assert_eq!(reconnects, o.needed_reconnects(reconnects));
    drop(backend);
    check_file(&img, MB);
}

/// QEMU 7.2's `vhost-user-blk-pci` on a chardev with `reconnect=1` (7.2's
/// option, in seconds) and iopath's guest (KVM), against iopath's backend on
/// a socket that the test kills every 2 s and starts again: QEMU reconnects
/// and hands the kept in-flight region to the new backend. The same oracles
/// (the guest's verify, the file read back); the pause is QEMU's (up to its
/// 1 s reconnect period), not measured here.
#[test]
fn qemu_vhost_user_blk_pci_with_reconnect_survives_kill_9_of_iopaths_backend() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    const MB: u64 = 128;
    common::kvm();
    let qemu = common::programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let dir = TempDir::new("vu-reconnect-qemu");
    let (img, sock) = (dir.join("disk.img"), dir.join("vu.sock"));
    std::fs::File::create(&img).unwrap().set_len(MB << 20).unwrap();
    let device = format!("virtio-blk,backend=file:{},size_mb={MB},queues=1", img.display());
    let start = {
        let (device, sock) = (device.clone(), sock.clone());
        move || serve(&device, &sock, Stdio::piped())
    };
    let first = start();
    let (window, done, kills) =
        (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
    let (w, dn, k) = (window.clone(), done.clone(), kills.clone());
    let killer = std::thread::spawn(move || {
        let mut backend = first;
        let mut logs = Vec::new();
        // As under_kills: the first kill soon after the window starts, then every KILL_EVERY.
        let mut next = None;
        loop {
            std::thread::sleep(Duration::from_millis(50));
            if dn.load(Ordering::Acquire) {
                break;
            }
            if !w.load(Ordering::Acquire) {
                continue;
            }
            let due = *next.get_or_insert_with(|| Instant::now() + KILL_EVERY - AIM_AFTER - Duration::from_millis(100));
            if Instant::now() < due {
                continue;
            }
            next = Some(due + KILL_EVERY);
            let aim = Instant::now();
            while aim.elapsed() < KILL_EVERY - AIM_AFTER && !in_io(backend.id()) {}
            let _ = backend.kill();
            let _ = backend.wait();
            let mut e = String::new();
            let _ = backend.stderr.take().unwrap().read_to_string(&mut e);
            logs.push(e);
            k.fetch_add(1, Ordering::AcqRel);
            backend = start();
        }
        (backend, logs)
    });
    let image = iopath_guest::image_file().unwrap();
    let cmdline = format!("workload=vblk verify=1 bs=512 iodepth=16 size_mb={MB} seed={SEED}");
    let extra: Vec<String> = [
        "-object",
        "memory-backend-memfd,id=mem,size=256M,share=on",
        "-numa",
        "node,memdev=mem",
        "-chardev",
        &format!("socket,id=c0,path={},reconnect=1", sock.display()),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args = iopath_bench::qemu::args_with(
        &image,
        &cmdline,
        256,
        &extra,
        &["vhost-user-blk-pci,chardev=c0,num-queues=1,disable-legacy=on"],
    );
    let w = window.clone();
    let q = iopath_bench::qemu::run_args(&qemu, args, None, Duration::from_secs(400), |l| {
        if l.starts_with("@vblk-window start") {
            w.store(true, Ordering::Release);
        }
        if l.starts_with("@vblk-window end") {
            w.store(false, Ordering::Release);
        }
    });
    done.store(true, Ordering::Release);
    let (mut last, logs) = killer.join().unwrap();
    let _ = last.kill();
    let _ = last.wait();
    let q = q.unwrap();
    let kills = kills.load(Ordering::Acquire) as u64;
    let rec = q.lines.iter().find(|l| l.starts_with("@vblk ")).unwrap_or_else(|| panic!("no @vblk: {:?}", q.lines));
    let num = |k: &str| -> u64 {
        rec.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}=")).and_then(|v| v.parse().ok())).unwrap()
    };
    let resubmitted: u64 = logs
        .iter()
        .flat_map(|e| e.lines())
        .filter_map(|l| l.split("resubmitting ").nth(1)?.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    eprintln!(
        "QEMU 7.2 vhost-user-blk-pci reconnect=1: kills={kills} guest: ios={} errors={} verified_blocks={} \
         mismatches={}; resubmitted by restarted backends (the logs of those killed later): {resubmitted}",
        num("ios"),
        num("errors"),
        num("verified_blocks"),
        num("mismatches")
    );
    assert!(kills >= 2, "only {kills} kills landed in the guest's window");
    assert!(!q.lines.iter().any(|l| l.starts_with("@vblk-error") || l.contains("mismatch lba")), "{:?}", q.lines);
    let blocks = (MB << 20) / 512;
    assert_eq!((num("errors"), num("mismatches"), num("verified_blocks")), (0, 0, blocks), "{rec}");
    check_file(&img, MB);
}
