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
//! not asserted (the machine is shared).

mod common;
use common::TempDir;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The disk and the range the guest verifies, in MiB: at 512-byte blocks
/// the write and read-back passes take long enough (about 30 s here) for
/// a kill every 2 s to land in both.
const SIZE_MB: u64 = 320;
const SEED: u64 = 11;
const KILL_EVERY: Duration = Duration::from_secs(2);

/// The guest's verify pattern (guest/c/load.c) recomputed: the 8 bytes at
/// byte `o` are `(o / 512) * K ^ (o % 512) ^ s`, s = the seed's xorshift state.
fn pattern_word(o: u64) -> u64 {
    const K: u64 = 0x9e3779b97f4a7c15;
    let s = SEED.wrapping_mul(K) | 1;
    (o / 512).wrapping_mul(K) ^ (o % 512) ^ s
}

/// A counter from `iopath run`'s report (`name=value`; 0 is not printed).
fn counter(stderr: &str, name: &str) -> u64 {
    stderr
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The processes `pid` started that still run (not zombies).
fn live_children(pid: u32) -> Vec<u32> {
    common::children(pid)
        .into_iter()
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid)).unwrap_or_default();
            let state = stat.rfind(')').and_then(|c| stat[c + 1..].split_whitespace().next().map(str::to_string));
            state.is_some_and(|s| s != "Z")
        })
        .map(|p| p.pid)
        .collect()
}

fn collect(r: impl Read + Send + 'static) -> (Arc<Mutex<String>>, std::thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(String::new()));
    let b = buf.clone();
    let h = std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(r);
        let mut line = String::new();
        while matches!(std::io::BufRead::read_line(&mut r, &mut line), Ok(n) if n > 0) {
            b.lock().unwrap().push_str(&line);
            line.clear();
        }
    });
    (buf, h)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[test]
fn the_guest_verify_workload_survives_kill_9_of_its_vhost_user_blk_backend_every_2_s() {
    common::kvm();
    let dir = TempDir::new("vu-reconnect");
    let img = dir.join("disk.img");
    std::fs::File::create(&img).unwrap().set_len(SIZE_MB << 20).unwrap();
    let device = format!("virtio-blk,backend=file:{},size_mb={SIZE_MB},queues=1@vhost-user", img.display());
    let append = format!("verify=1 bs=512 iodepth=16 size_mb={SIZE_MB} seed={SEED}");
    let mut run = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["run", "--workload", "vblk", "--device", &device, "--append", &append, "--timeout", "600"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, out_h) = collect(run.stdout.take().unwrap());
    let (err, err_h) = collect(run.stderr.take().unwrap());
    let vmm = run.id();

    // Kill the backend every 2 s while the guest's window runs, each a new process.
    let t0 = Instant::now();
    let (mut killed, mut kills) = (Vec::<u32>::new(), 0u64);
    loop {
        std::thread::sleep(KILL_EVERY);
        let text = out.lock().unwrap().clone();
        if text.contains("@vblk-window end") || run.try_wait().unwrap().is_some() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(500), "the guest never ended its window:\n{text}");
        if !text.contains("@vblk-window start") {
            continue;
        }
        let backends: Vec<u32> = live_children(vmm).into_iter().filter(|p| !killed.contains(p)).collect();
        assert_eq!(backends.len(), 1, "one backend process runs: {backends:?}\n{}", err.lock().unwrap());
        // SAFETY: kill(2) of a child of the VMM this test started.
        assert_eq!(unsafe { libc::kill(backends[0] as i32, libc::SIGKILL) }, 0);
        killed.push(backends[0]);
        kills += 1;
    }
    let status = run.wait().unwrap();
    out_h.join().unwrap();
    err_h.join().unwrap();
    let (stdout, stderr) = (out.lock().unwrap().clone(), err.lock().unwrap().clone());
    let rec =
        stdout.lines().find(|l| l.starts_with("@vblk ")).unwrap_or_else(|| panic!("no @vblk:\n{stdout}\n{stderr}"));
    let num = |k: &str| -> u64 {
        rec.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}=")).and_then(|v| v.parse().ok())).unwrap()
    };

    // The pauses the frontend measured, and what the new backends resubmitted.
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
    eprintln!(
        "kills={kills} reconnects={} guest: ios={} errors={} verified_blocks={} mismatches={}\n\
         in-flight requests resubmitted by new backends: {resubmitted}\n\
         pause from the death to the first completion over {} kills: p50={:.1} ms p99={:.1} ms max={:.1} ms\n{report}",
        counter(&stderr, "reconnects"),
        num("ios"),
        num("errors"),
        num("verified_blocks"),
        num("mismatches"),
        pauses.len(),
        percentile(&pauses, 50.0),
        percentile(&pauses, 99.0),
        pauses.last().copied().unwrap_or(f64::NAN),
    );

    assert!(status.success(), "the run failed ({status}):\n{stderr}\n{}", &stdout[..stdout.len().min(4000)]);
    assert!(kills >= 5, "only {kills} kills landed in the guest's window");
    assert!(!stdout.contains("@vblk-error") && !stdout.contains("mismatch lba"), "{stdout}");
    let blocks = (SIZE_MB << 20) / 512;
    assert_eq!((num("errors"), num("mismatches"), num("verified_blocks")), (0, 0, blocks), "{rec}");
    assert_eq!(num("ios"), 2 * blocks, "each block written once and read once: {rec}");
    assert_eq!(counter(&stderr, "reconnects"), kills, "one reconnect per kill:\n{stderr}");
    assert_eq!(counter(&stderr, "inflight_shmfd"), 1, "{stderr}");
    for (i, pid) in killed.iter().enumerate() {
        let line = format!("device process {pid} ended: signal: 9 (SIGKILL); reconnect {}:", i + 1);
        assert!(stderr.contains(&line), "no log of kill {} ({line}):\n{stderr}", i + 1);
    }

    // The file holds what the guest wrote and got acknowledged: every word of
    // the range, recomputed here.
    let data = std::fs::read(&img).unwrap();
    assert_eq!(data.len() as u64, SIZE_MB << 20);
    let bad: Vec<u64> = (0..data.len())
        .step_by(8)
        .filter(|&o| u64::from_le_bytes(data[o..o + 8].try_into().unwrap()) != pattern_word(o as u64))
        .map(|o| o as u64)
        .take(5)
        .collect();
    assert!(bad.is_empty(), "the file differs from the pattern at byte offsets {bad:?}");
    eprintln!("file read back: {} MiB, every word the guest's pattern", SIZE_MB);
}
