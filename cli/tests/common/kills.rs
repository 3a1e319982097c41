//! The kill loop of the device-process survival tests: `iopath run` of the
//! guest's verify workload while the test kills the device process with
//! SIGKILL every 2 s, and the oracles every transport shares (the guest's
//! record, the file read back against the pattern the host computes).

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SEED: u64 = 11;
/// After this much of each period the kill is aimed (for the rest of it)
/// at a moment the backend is inside a disk read or write, so that some
/// kills find a request taken and not completed.
pub const AIM_AFTER: Duration = Duration::from_millis(1500);
pub const KILL_EVERY: Duration = Duration::from_secs(2);

/// The guest's verify pattern (guest/c/load.c) recomputed: the 8 bytes at
/// byte `o` are `(o / 512) * K ^ (o % 512) ^ s`, s = the seed's xorshift state.
pub fn pattern_word(o: u64) -> u64 {
    const K: u64 = 0x9e3779b97f4a7c15;
    let s = SEED.wrapping_mul(K) | 1;
    (o / 512).wrapping_mul(K) ^ (o % 512) ^ s
}

/// A counter from `iopath run`'s report (`name=value`; 0 is not printed).
pub fn counter(stderr: &str, name: &str) -> u64 {
    stderr
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The processes `pid` started that still run (not zombies).
pub fn live_children(pid: u32) -> Vec<u32> {
    super::children(pid)
        .into_iter()
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid)).unwrap_or_default();
            let state = stat.rfind(')').and_then(|c| stat[c + 1..].split_whitespace().next().map(str::to_string));
            state.is_some_and(|s| s != "Z")
        })
        .map(|p| p.pid)
        .collect()
}

/// True if a thread of `pid` runs (in user space: taking, parsing or
/// completing a request) or is inside a read or write of the disk (pread64,
/// pwrite64, readv, writev, preadv, pwritev, preadv2, pwritev2), not
/// waiting for a kick: a SIGKILL now may land with a request taken and not
/// completed.
pub fn in_io(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.filter_map(Result::ok).any(|t| {
        let s = std::fs::read_to_string(t.path().join("syscall")).unwrap_or_default();
        matches!(s.split(' ').next(), Some("running" | "17" | "18" | "19" | "20" | "295" | "296" | "327" | "328"))
    })
}

pub fn collect(r: impl Read + Send + 'static) -> (Arc<Mutex<String>>, std::thread::JoinHandle<()>) {
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

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// What the kill loop saw.
pub struct Outcome {
    pub kills: u64,
    pub aimed: u64,
    pub killed: Vec<u32>,
    /// From the last kill to the loop seeing the guest's window end.
    pub end_after_last_kill: Option<Duration>,
    pub stdout: String,
    pub stderr: String,
}

/// `iopath run` of the guest's verify workload `workload` (vblk, nvme) over
/// `size_mb` MiB of the disk `spec` names, killing the device process
/// `backend()` finds every 2 s while the guest's window runs; `after_kill`
/// gets each killed pid.
pub fn under_kills(
    workload: &str,
    spec: &str,
    size_mb: u64,
    mut backend: impl FnMut(u32, &[u32]) -> Option<u32>,
    mut after_kill: impl FnMut(u32),
) -> Outcome {
    let append = format!("verify=1 bs=512 iodepth=16 size_mb={size_mb} seed={SEED}");
    let mut run = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["run", "--workload", workload, "--device", spec, "--append", &append, "--timeout", "600"])
        .args(["--reconnect-ms", "10000"]) // an external server is waited for (a spawned one is always started again)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, out_h) = collect(run.stdout.take().unwrap());
    let (err, err_h) = collect(run.stderr.take().unwrap());
    let vmm = run.id();
    let t0 = Instant::now();
    let (mut killed, mut kills, mut aimed) = (Vec::<u32>::new(), 0u64, 0u64);
    let mut last_kill: Option<Instant> = None;
    // The first kill half a second into the guest's window (a fast host runs the window in a
    // few seconds), then one every KILL_EVERY.
    let mut next = None;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let text = out.lock().unwrap().clone();
        if text.contains(&format!("@{workload}-window end")) || run.try_wait().unwrap().is_some() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(500), "the guest never ended its window:\n{text}");
        if !text.contains(&format!("@{workload}-window start")) {
            continue;
        }
        let due = *next.get_or_insert_with(|| Instant::now() + KILL_EVERY - AIM_AFTER - Duration::from_millis(100));
        if Instant::now() < due {
            continue;
        }
        next = Some(due + KILL_EVERY);
        // None: no device process now (the run is ending).
        let Some(pid) = backend(vmm, &killed) else { continue };
        let aim = Instant::now();
        let mut hit = false;
        while aim.elapsed() < KILL_EVERY - AIM_AFTER && !hit {
            hit = in_io(pid);
        }
        // SAFETY: kill(2) of the backend process of this test's VMM.
        if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
            // Gone already: the guest's window ended while the kill was aimed and the run is
            // ending. Not a kill of ours; a death of its own would show as one reconnect more
            // than the kills, which the callers check.
            let e = std::io::Error::last_os_error();
            assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "kill {pid}: {e}");
            continue;
        }
        killed.push(pid);
        last_kill = Some(Instant::now());
        kills += 1;
        aimed += hit as u64;
        after_kill(pid);
    }
    let end_after_last_kill = last_kill.map(|k| k.elapsed());
    let status = run.wait().unwrap();
    out_h.join().unwrap();
    err_h.join().unwrap();
    let (stdout, stderr) = (out.lock().unwrap().clone(), err.lock().unwrap().clone());
    assert!(status.success(), "the run failed ({status}):\n{stderr}\n{}", &stdout[..stdout.len().min(4000)]);
    Outcome { kills, aimed, killed, end_after_last_kill, stdout, stderr }
}

/// The file holds what the guest wrote and got acknowledged: every word of
/// the range, recomputed here.
pub fn check_file(img: &std::path::Path, size_mb: u64) {
    let data = std::fs::read(img).unwrap();
    assert_eq!(data.len() as u64, size_mb << 20);
    let bad: Vec<u64> = (0..data.len())
        .step_by(8)
        .filter(|&o| u64::from_le_bytes(data[o..o + 8].try_into().unwrap()) != pattern_word(o as u64))
        .map(|o| o as u64)
        .take(5)
        .collect();
    assert!(bad.is_empty(), "the file differs from the pattern at byte offsets {bad:?}");
    eprintln!("file read back: {size_mb} MiB, every word the guest's pattern");
}

impl Outcome {
    /// How many reconnects the kills must have caused: one per kill, but the
    /// last kill may land after the guest's last I/O, as its window ends (seen
    /// here within a second of it): the run then ends without needing the
    /// device again. A kill that found I/O pending and was not reconnected
    /// would leave the guest waiting, and its own oracle fails.
    pub fn needed_reconnects(&self, reconnects: u64) -> u64 {
        let late = self.end_after_last_kill.is_some_and(|d| d < Duration::from_secs(1));
        if late && reconnects + 1 == self.kills {
            eprintln!(
                "the last kill came {:?} before the guest's window end was seen, with no reconnect: \
                 the guest needed the device no more",
                self.end_after_last_kill.unwrap()
            );
            return reconnects;
        }
        self.kills
    }

    /// The guest's oracle: its record of `workload` says every block of
    /// `size_mb` MiB written once and read back verified, no error, no
    /// mismatch; returns the record.
    pub fn guest(&self, workload: &str, size_mb: u64) -> String {
        let (stdout, stderr) = (&self.stdout, &self.stderr);
        let rec = stdout
            .lines()
            .find(|l| l.starts_with(&format!("@{workload} ")))
            .unwrap_or_else(|| panic!("no @{workload}:\n{stdout}\n{stderr}"));
        let num = |k: &str| record(rec, k);
        assert!(!stdout.contains(&format!("@{workload}-error")) && !stdout.contains("mismatch lba"), "{stdout}");
        let blocks = (size_mb << 20) / 512;
        assert_eq!((num("errors"), num("mismatches"), num("verified_blocks")), (0, 0, blocks), "{rec}");
        assert_eq!(num("ios"), 2 * blocks, "each block written once and read once: {rec}");
        rec.to_string()
    }
}

/// Field `k` of a guest record.
pub fn record(rec: &str, k: &str) -> u64 {
    rec.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}=")).and_then(|v| v.parse().ok())).unwrap()
}
