//! The kill loop of the device-process survival tests, on the bench's own
//! (`iopath_bench::reconnect::kills`, which `iopath bench reconnect` runs):
//! `iopath run` of the guest's verify workload while the test kills the
//! device process with SIGKILL every 2 s, and the oracles every transport
//! shares (the guest's record, the file read back against the pattern the
//! host computes), as assertions.

#[allow(unused_imports)] // not every test binary uses each
pub use bench::{counter, in_io, live_children, percentile};
use iopath_bench::reconnect::kills as bench;
use std::time::Duration;

pub const SEED: u64 = 11;
/// After this much of each period the kill is aimed (for the rest of it)
/// at a moment the backend is inside a disk read or write, so that some
/// kills find a request taken and not completed.
pub const AIM_AFTER: Duration = Duration::from_millis(1500);
pub const KILL_EVERY: Duration = Duration::from_secs(2);

/// The guest's verify pattern (guest/c/load.c) with the tests' seed.
pub fn pattern_word(o: u64) -> u64 {
    bench::pattern_word(SEED, o)
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
    seen: bench::Outcome,
}

/// `iopath run` of the guest's verify workload `workload` (vblk, nvme) over
/// `size_mb` MiB of the disk `spec` names, killing the device process
/// `backend()` finds every 2 s while the guest's window runs; `after_kill`
/// gets each killed pid. The run must succeed.
pub fn under_kills(
    workload: &str,
    spec: &str,
    size_mb: u64,
    backend: impl FnMut(u32, &[u32]) -> Option<u32>,
    after_kill: impl FnMut(u32),
) -> Outcome {
    under_kills_aimed(KILL_EVERY - AIM_AFTER, workload, spec, size_mb, backend, after_kill)
}

/// `under_kills` with each kill aimed for `aim` (the first one `aim` less
/// 0.1 s into the guest's window, if that is more than nothing): a ram
/// disk's window can be over in 0.4 s, before the first kill of a 0.5 s aim.
pub fn under_kills_aimed(
    aim: Duration,
    workload: &str,
    spec: &str,
    size_mb: u64,
    mut backend: impl FnMut(u32, &[u32]) -> Option<u32>,
    after_kill: impl FnMut(u32),
) -> Outcome {
    let mut plan =
        bench::Plan::every_2_s(std::path::Path::new(env!("CARGO_BIN_EXE_iopath")), workload, spec, size_mb, SEED);
    plan.aim = aim;
    let o = bench::under_kills(&plan, |vmm, killed| Ok(backend(vmm, killed)), after_kill)
        .unwrap_or_else(|e| panic!("the kill loop: {e:#}"));
    assert!(o.success, "the run failed:\n{}\n{}", o.stderr, bench::tail(&o.stdout));
    Outcome {
        kills: o.kills,
        aimed: o.aimed,
        killed: o.killed.clone(),
        end_after_last_kill: o.end_after_last_kill,
        stdout: o.stdout.clone(),
        stderr: o.stderr.clone(),
        seen: o,
    }
}

/// The file holds what the guest wrote and got acknowledged: every word of
/// the range, recomputed here.
pub fn check_file(img: &std::path::Path, size_mb: u64) {
    bench::check_file(img, size_mb, SEED).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("file read back: {size_mb} MiB, every word the guest's pattern");
}

impl Outcome {
    /// How many reconnects the kills must have caused (`bench::Outcome::needed_reconnects`).
    pub fn needed_reconnects(&self, reconnects: u64) -> u64 {
        let n = self.seen.needed_reconnects(reconnects);
        if n != self.kills {
            eprintln!(
                "the last kill came {:?} before the guest's window end was seen, with no reconnect: \
                 the guest needed the device no more",
                self.end_after_last_kill
            );
        }
        n
    }

    /// The guest's oracle: its record of `workload` says every block of
    /// `size_mb` MiB written once and read back verified, no error, no
    /// mismatch; returns the record.
    pub fn guest(&self, workload: &str, size_mb: u64) -> String {
        let g = self.seen.guest(workload, size_mb).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!((g.errors, g.mismatches), (0, 0), "{}\n{}", g.record, self.stdout);
        g.record
    }
}

/// Field `k` of a guest record.
pub fn record(rec: &str, k: &str) -> u64 {
    rec.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}=")).and_then(|v| v.parse().ok())).unwrap()
}
