//! The kill loop of issue 37, shared by `iopath bench reconnect` and the
//! device-process survival tests (cli/tests/common/kills.rs calls it):
//! `iopath run` of the guest's verify workload while the loop kills the
//! device process with SIGKILL every `every`, and the oracles every
//! transport shares (the guest's record, the file read back against the
//! pattern recomputed here).

use anyhow::{anyhow, bail, Context};
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The guest's verify pattern (guest/c/load.c, bs=512) recomputed: the 8
/// bytes at byte `o` are `(o / 512) * K ^ (o % 512) ^ s`, s = the seed's
/// xorshift state.
pub fn pattern_word(seed: u64, o: u64) -> u64 {
    const K: u64 = 0x9e3779b97f4a7c15;
    let s = seed.wrapping_mul(K) | 1;
    (o / 512).wrapping_mul(K) ^ (o % 512) ^ s
}

/// The file holds what the guest wrote with `seed` and got acknowledged:
/// every word of its `size_mb` MiB, recomputed here. The error names the
/// first differing offsets (at most 5).
pub fn check_file(img: &Path, size_mb: u64, seed: u64) -> anyhow::Result<()> {
    let mut f = std::fs::File::open(img).with_context(|| format!("reading {} back", img.display()))?;
    let len = f.metadata()?.len();
    if len != size_mb << 20 {
        bail!("{} holds {len} bytes, not {size_mb} MiB", img.display());
    }
    let (mut buf, mut bad) = (vec![0u8; 1 << 20], Vec::new());
    for mib in 0..size_mb {
        f.read_exact(&mut buf).with_context(|| format!("reading {} back", img.display()))?;
        let base = mib << 20;
        for (i, w) in buf.chunks_exact(8).enumerate() {
            let o = base + i as u64 * 8;
            if bad.len() < 5 && u64::from_le_bytes(w.try_into().unwrap_or_default()) != pattern_word(seed, o) {
                bad.push(o);
            }
        }
    }
    if !bad.is_empty() {
        bail!("the file differs from the pattern at byte offsets {bad:?}");
    }
    Ok(())
}

/// A counter from `iopath run`'s report (`name=value`; 0 is not printed).
pub fn counter(stderr: &str, name: &str) -> u64 {
    stderr
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// The guest's TSC frequency `iopath run` printed ("..., TSC N kHz").
pub fn tsc_khz(stderr: &str) -> Option<u64> {
    stderr.lines().find_map(|l| l.split(", TSC ").nth(1)?.strip_suffix(" kHz")?.parse().ok()).filter(|&k| k > 0)
}

/// The processes `pid` started that still run (not zombies).
pub fn live_children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses, the last ')' ends it.
            let mut f = stat.rfind(')').map(|c| stat[c + 1..].split_whitespace()).into_iter().flatten();
            let (state, ppid) = (f.next(), f.next().and_then(|x| x.parse::<u32>().ok()));
            ppid == Some(pid) && state.is_some_and(|s| s != "Z")
        })
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

/// A reader's lines, gathered by a thread.
fn collect(r: impl Read + Send + 'static) -> (Arc<Mutex<String>>, std::thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(String::new()));
    let b = buf.clone();
    let h = std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(r);
        let mut line = String::new();
        while matches!(std::io::BufRead::read_line(&mut r, &mut line), Ok(n) if n > 0) {
            b.lock().unwrap_or_else(|p| p.into_inner()).push_str(&line);
            line.clear();
        }
    });
    (buf, h)
}

fn text(b: &Mutex<String>) -> String {
    b.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Nearest-rank percentile `p` (0..100) of sorted values; NaN when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// One kill loop: the run and when its kills come.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The iopath binary.
    pub exe: std::path::PathBuf,
    /// The guest workload: nvme or vblk.
    pub workload: String,
    /// `--device`.
    pub spec: String,
    pub size_mb: u64,
    pub seed: u64,
    /// A kill this often while the guest's window runs.
    pub every: Duration,
    /// The last `aim` of each period the kill waits (at most) for the
    /// device process to be inside a disk read or write, so that some
    /// kills find a request taken and not completed.
    pub aim: Duration,
    /// Stop killing after this many (None: until the window ends).
    pub max_kills: Option<u64>,
    /// The run's `--timeout` and the loop's bound on the window.
    pub timeout: Duration,
}

impl Plan {
    /// The tests' loop: a kill every 2 s, aimed during its last 0.5 s.
    pub fn every_2_s(exe: &Path, workload: &str, spec: &str, size_mb: u64, seed: u64) -> Plan {
        Plan {
            exe: exe.to_path_buf(),
            workload: workload.into(),
            spec: spec.into(),
            size_mb,
            seed,
            every: Duration::from_secs(2),
            aim: Duration::from_millis(500),
            max_kills: None,
            timeout: Duration::from_secs(600),
        }
    }

    /// The guest's command line (`--append`).
    pub fn append(&self) -> String {
        format!("verify=1 bs=512 iodepth=16 size_mb={} seed={}", self.size_mb, self.seed)
    }
}

/// What the kill loop saw.
#[derive(Debug)]
pub struct Outcome {
    pub kills: u64,
    /// Kills that found the device process inside a disk read or write.
    pub aimed: u64,
    pub killed: Vec<u32>,
    /// When each kill was sent: CLOCK_MONOTONIC ns, taken just before kill(2).
    pub kill_ns: Vec<u64>,
    /// From the last kill to the loop seeing the guest's window end.
    pub end_after_last_kill: Option<Duration>,
    /// The run's exit status said success (the guest's rc 0).
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// `iopath run`, stopped with the device processes it started (SIGKILL)
/// and reaped when dropped before it ended: an error or Ctrl-C leaves
/// nothing running.
struct Run(Child);

impl Drop for Run {
    fn drop(&mut self) {
        if !matches!(self.0.try_wait(), Ok(None)) {
            return;
        }
        let pid = self.0.id() as i32;
        // SAFETY: kill(2) of our own child, by its pid (not reaped: try_wait saw it run).
        // Stopped first, it starts no new device process while its children are listed and killed.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        for c in live_children(pid as u32) {
            // SAFETY: kill(2) of a child of our stopped child.
            unsafe { libc::kill(c as i32, libc::SIGKILL) };
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `plan`: `iopath run` of the guest's verify workload, killing the
/// device process `backend(vmm pid, killed so far)` finds once per
/// `plan.every` while the guest's window runs; `after_kill` gets each
/// killed pid. Stops (an error) on Ctrl-C (`crate::interrupt`) or on a
/// window longer than `plan.timeout`; a run that failed is `success: false`.
pub fn under_kills(
    plan: &Plan,
    mut backend: impl FnMut(u32, &[u32]) -> anyhow::Result<Option<u32>>,
    mut after_kill: impl FnMut(u32),
) -> anyhow::Result<Outcome> {
    let w = &plan.workload;
    let mut child = Command::new(&plan.exe)
        .args(["run", "--workload", w, "--device", &plan.spec, "--append", &plan.append()])
        .args(["--timeout", &plan.timeout.as_secs().max(1).to_string()])
        .args(["--reconnect-ms", "10000"]) // an external server is waited for (a spawned one is always started again)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} run", plan.exe.display()))?;
    let (out, out_h) = collect(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
    let (err, err_h) = collect(child.stderr.take().ok_or_else(|| anyhow!("no stderr"))?);
    let mut run = Run(child);
    let vmm = run.0.id();
    let t0 = Instant::now();
    let (mut killed, mut kills, mut aimed) = (Vec::<u32>::new(), 0u64, 0u64);
    let mut kill_ns = Vec::new();
    let mut last_kill: Option<Instant> = None;
    // The first kill `aim` into the guest's window (less 0.1 s), then one every `every`.
    let mut next = None;
    let (start, end) = (format!("@{w}-window start"), format!("@{w}-window end"));
    loop {
        std::thread::sleep(Duration::from_millis(20));
        crate::interrupt::check()?;
        let text = text(&out);
        if text.contains(&end) || run.0.try_wait()?.is_some() {
            break;
        }
        if t0.elapsed() > plan.timeout {
            bail!("the guest never ended its window in {:?}:\n{}", plan.timeout, tail(&text));
        }
        if !text.contains(&start) || plan.max_kills.is_some_and(|m| kills >= m) {
            continue;
        }
        let due = *next.get_or_insert_with(|| Instant::now() + plan.aim.saturating_sub(Duration::from_millis(100)));
        if Instant::now() < due {
            continue;
        }
        next = Some(due + plan.every);
        // None: no device process now (the run is ending).
        let Some(pid) = backend(vmm, &killed)? else { continue };
        let aim = Instant::now();
        let mut hit = false;
        while aim.elapsed() < plan.aim && !hit {
            hit = in_io(pid);
        }
        let at = monotonic_ns();
        // SAFETY: kill(2) of the backend process of this loop's VMM.
        if unsafe { libc::kill(pid as i32, libc::SIGKILL) } != 0 {
            // Gone already: the guest's window ended while the kill was aimed and the run is
            // ending. Not a kill of ours; a death of its own would show as one reconnect more
            // than the kills, which the callers check.
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                bail!("kill {pid}: {e}");
            }
            continue;
        }
        killed.push(pid);
        kill_ns.push(at);
        last_kill = Some(Instant::now());
        kills += 1;
        aimed += hit as u64;
        after_kill(pid);
    }
    let end_after_last_kill = last_kill.map(|k| k.elapsed());
    let status = loop {
        if let Some(s) = run.0.try_wait()? {
            break s;
        }
        crate::interrupt::check()?;
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = (out_h.join(), err_h.join());
    let (stdout, stderr) = (text(&out), text(&err));
    Ok(Outcome { kills, aimed, killed, kill_ns, end_after_last_kill, success: status.success(), stdout, stderr })
}

/// CLOCK_MONOTONIC now, in ns: the clock the device process stamps its
/// first completion after a resume with (devices/src/nvme/controller.rs).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The device processes' times of their first completion after a resume,
/// CLOCK_MONOTONIC ns, ascending: NVMe and virtio-blk over vfio-user log
/// "resumed: first completion posted at CLOCK_MONOTONIC N ns" once per
/// resume (to the VMM's stderr, which the device process shares).
pub fn first_completions(stderr: &str) -> Vec<u64> {
    use iopath_devices::state::RESUMED_FIRST_COMPLETION;
    let mut v: Vec<u64> = stderr
        .lines()
        .filter_map(|l| l.split(RESUMED_FIRST_COMPLETION).nth(1)?.strip_suffix(" ns")?.parse().ok())
        .collect();
    v.sort_unstable();
    v
}

/// Each kill's pause, ms: from the kill to the first completion a device
/// process posted after it and before the next kill (the process that
/// resumed after it; it cannot post once killed). A kill with none (the
/// window ended, or the next kill came first) is `None`.
pub fn kill_pauses(kill_ns: &[u64], firsts: &[u64]) -> Vec<Option<f64>> {
    kill_ns
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            let next = kill_ns.get(i + 1).copied().unwrap_or(u64::MAX);
            firsts.iter().find(|&&c| c > k && c < next).map(|&c| (c - k) as f64 / 1e6)
        })
        .collect()
}

/// The last 4000 bytes of a text (on a char boundary).
pub fn tail(s: &str) -> &str {
    let mut i = s.len().saturating_sub(4000);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// The device process of a VMM that starts one: its one live child not
/// killed yet (None: none runs now); more than one is an error.
pub fn spawned_backend(vmm: u32, killed: &[u32]) -> anyhow::Result<Option<u32>> {
    let b: Vec<u32> = live_children(vmm).into_iter().filter(|p| !killed.contains(p)).collect();
    if b.len() > 1 {
        bail!("more than one device process runs: {b:?}");
    }
    Ok(b.first().copied())
}

/// The guest's verify record, checked: every block of `size_mb` MiB written once
/// and read back verified, no error, no mismatch.
#[derive(Clone, Debug, PartialEq)]
pub struct GuestVerify {
    pub record: String,
    pub errors: u64,
    pub mismatches: u64,
    /// The longest gaps between completions, in TSC cycles, longest first.
    pub gaps: Vec<u64>,
}

impl Outcome {
    /// The guest's record of `workload` and its counts; an error if it is
    /// missing or malformed, or says a block was lost or not verified (a
    /// nonzero error or mismatch count is returned, for the caller to judge).
    pub fn guest(&self, workload: &str, size_mb: u64) -> anyhow::Result<GuestVerify> {
        let rec = self
            .stdout
            .lines()
            .find(|l| l.starts_with(&format!("@{workload} ")))
            .ok_or_else(|| anyhow!("no @{workload} record:\n{}\n{}", tail(&self.stdout), tail(&self.stderr)))?;
        let f = crate::record::fields(rec);
        let num = |k: &str| {
            f.get(k).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| anyhow!("@{workload} record without {k}: {rec}"))
        };
        let (errors, mismatches) = (num("errors")?, num("mismatches")?);
        let error_lines = self.stdout.contains(&format!("@{workload}-error")) || self.stdout.contains("mismatch lba");
        let blocks = (size_mb << 20) / 512;
        if (errors, mismatches) == (0, 0) && error_lines {
            bail!("error lines beside a clean record:\n{}", tail(&self.stdout));
        }
        if num("verified_blocks")? != blocks || num("ios")? != 2 * blocks {
            bail!("not each of the {blocks} blocks written once and read back once: {rec}");
        }
        let gaps = f
            .get("gaps")
            .ok_or_else(|| anyhow!("@{workload} record without gaps (an older guest image?): {rec}"))?
            .split(',')
            .map(|g| g.parse::<u64>().map_err(|_| anyhow!("bad gap {g:?}: {rec}")))
            .collect::<anyhow::Result<Vec<u64>>>()?;
        Ok(GuestVerify { record: rec.to_string(), errors, mismatches, gaps })
    }

    /// How many reconnects the kills must have caused: one per kill, but the
    /// last kill may land after the guest's last I/O, as its window ends (seen
    /// here within a second of it): the run then ends without needing the
    /// device again. A kill that found I/O pending and was not reconnected
    /// would leave the guest waiting, and its own oracle fails.
    pub fn needed_reconnects(&self, reconnects: u64) -> u64 {
        let late = self.end_after_last_kill.is_some_and(|d| d < Duration::from_secs(1));
        if late && reconnects + 1 == self.kills {
            return reconnects;
        }
        self.kills
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_is_the_guests_and_a_changed_word_is_found() {
        // guest/c/load.c with seed 11: block 0's first word is the seed's state alone.
        let s = 11u64.wrapping_mul(0x9e3779b97f4a7c15) | 1;
        assert_eq!(pattern_word(11, 0), s);
        assert_eq!(pattern_word(11, 520), 0x9e3779b97f4a7c15 ^ 8 ^ s);
        let dir = std::env::temp_dir().join(format!("iopath-kills-unit-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        let f = dir.join("img");
        let mut data: Vec<u8> = (0..(1u64 << 20) / 8).flat_map(|i| pattern_word(5, i * 8).to_le_bytes()).collect();
        std::fs::write(&f, &data).unwrap();
        assert!(check_file(&f, 1, 5).is_ok());
        assert!(check_file(&f, 1, 6).is_err(), "another seed's pattern");
        data[4096 + 3] ^= 1;
        std::fs::write(&f, &data).unwrap();
        let e = check_file(&f, 1, 5).unwrap_err().to_string();
        assert!(e.contains("[4096]"), "{e}");
        assert!(check_file(&f, 2, 5).is_err(), "a short file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn counters_tsc_and_the_record_are_read_by_name() {
        let err = "guest exit status 1 (ok), 3.20 s, TSC 2999998 kHz\n  vfio-user.reconnects=3 reconnects=2\n";
        assert_eq!((counter(err, "reconnects"), counter(err, "vfio-user.reconnects")), (2, 3));
        assert_eq!(counter(err, "kicks"), 0);
        assert_eq!(tsc_khz(err), Some(2999998));
        assert_eq!(tsc_khz("TSC 0 kHz"), None);
        let o = |stdout: &str| Outcome {
            kills: 2,
            aimed: 0,
            killed: vec![],
            kill_ns: vec![],
            end_after_last_kill: None,
            success: true,
            stdout: stdout.into(),
            stderr: String::new(),
        };
        let good = "@vblk rw=verify ios=4096 errors=0 verified_blocks=2048 mismatches=0 gaps=900,30,7\n";
        let g = o(good).guest("vblk", 1).unwrap();
        assert_eq!((g.errors, g.mismatches, g.gaps), (0, 0, vec![900, 30, 7]));
        let lost = good.replace("verified_blocks=2048", "verified_blocks=2047");
        assert!(o(&lost).guest("vblk", 1).is_err());
        assert!(o(&good.replace(" gaps=900,30,7", "")).guest("vblk", 1).is_err());
        assert!(o(&good.replace("gaps=900", "gaps=x")).guest("vblk", 1).is_err());
        assert!(o(good).guest("nvme", 1).is_err());
        let bad = good.replace("errors=0", "errors=2");
        assert_eq!(o(&bad).guest("vblk", 1).unwrap().errors, 2);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 50.0), 2.0);
    }

    #[test]
    fn each_kill_is_matched_to_the_first_completion_before_the_next_kill() {
        let log = "[W nvme] nvme: resumed: first completion posted at CLOCK_MONOTONIC 5031000000 ns\n\
                   x: reconnected in 3ms\n[W nvme] nvme: resumed: first completion posted at CLOCK_MONOTONIC 2040000000 ns\n\
                   nvme: resumed: first completion posted at CLOCK_MONOTONIC 12 ms\n";
        let firsts = first_completions(log);
        assert_eq!(firsts, vec![2_040_000_000, 5_031_000_000]);
        // Kill 2 (at 3.5 s) saw no completion before kill 3; the last saw none at all.
        let kills = [2_000_000_000, 3_500_000_000, 5_000_000_000, 6_500_000_000];
        assert_eq!(kill_pauses(&kills, &firsts), vec![Some(40.0), None, Some(31.0), None]);
        // A completion before the kill is not its.
        assert_eq!(kill_pauses(&[2_050_000_000], &firsts), vec![Some(2981.0)]);
        assert!(monotonic_ns() > 0);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
