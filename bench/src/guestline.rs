//! The guest's line floor: one cache line handed from iopath's guest (ring
//! 3, on the vCPU's CPU) to a host thread polling guest memory (on the
//! device threads' CPU) and back, the `doorbell-rtt:shm` row of `bench
//! exits`. The ring floor (`floor.rs`) is two host threads; on this
//! project's nested hosts a line the guest takes part in can cost more
//! than a host thread's, so a polled NVMe command at QD1 (at least three
//! such lines: the tail, the entry, the completion) may not reach the ring
//! floor however little the device does. `bench nvme` measures this one
//! just before each QD1 run, as it does the ring floor (this host changes
//! its placement within a round), and gives the run its p50 over it.

use crate::exits::{exit_devices, guest_cmdline, verify_iopath, ExitsOptions};
use crate::pin::Placement;
use crate::record::GuestOutput;
use crate::stats::summarize;
use serde::Serialize;
use std::time::Duration;

/// The row of the exits guest that measures it.
pub const ROW: &str = "doorbell-rtt:shm";

/// The host thread that answers the guest (the doorbell device's poller).
const POLLER: &[&str] = &["doorbell-poll"];

/// One measurement: the guest's timed batches of round trips.
#[derive(Clone, Debug, Serialize)]
pub struct GuestLineRun {
    pub round: u32,
    /// The run it was measured before.
    pub target: String,
    /// Round trips over all batches.
    pub round_trips: u64,
    /// Mean round trip of the median batch, and of the fastest.
    pub rtt_ns: f64,
    pub min_ns: f64,
    /// The doorbell device's counters against the guest's: every round
    /// trip went through guest memory, none through an exit or eventfd.
    pub routing: String,
}

/// Runs the exits guest's shm round-trip row once (about 0.2 s of batches);
/// the vCPU and the host poller placed by `pin` as `bench nvme` places the
/// vCPU and the controller's pollers.
pub fn run_guest_line(tsc_khz: u64, pin: Option<Placement>, round: u32, target: &str) -> anyhow::Result<GuestLineRun> {
    let o = ExitsOptions { only: Some(ROW.into()), ..ExitsOptions::default() };
    let mut cfg = iopath_vmm::VmConfig::new(iopath_guest::IMAGE, &guest_cmdline(&o, "exits", tsc_khz, "cpl=3"));
    cfg.devices = exit_devices();
    cfg.timeout = Duration::from_secs(o.timeout_s);
    cfg.cancel = Some(&crate::interrupt::FLAG);
    let r = {
        let _pinned = pin.map(|p| crate::pin::Pinner::start(p, POLLER));
        iopath_vmm::run(cfg)?
    };
    let out = GuestOutput::parse(&r.lines);
    anyhow::ensure!(r.status == 1, "{}", crate::record::exit_failure(r.status, &r.lines));
    let row = out.row(ROW).ok_or_else(|| anyhow::anyhow!("the guest printed no {ROW} row"))?;
    let routing = verify_iopath(&out, &r).remove(ROW).ok_or_else(|| anyhow::anyhow!("{ROW}: no routing verdict"))?;
    anyhow::ensure!(routing.ok, "{ROW}: {}", routing.detail);
    let per = summarize(&row.per_access()).ok_or_else(|| anyhow::anyhow!("{ROW}: no timed batch"))?;
    let ns = |cycles: f64| cycles * 1e6 / tsc_khz.max(1) as f64;
    Ok(GuestLineRun {
        round,
        target: target.to_string(),
        round_trips: row.accesses,
        rtt_ns: ns(per.median),
        min_ns: ns(per.min),
        routing: routing.detail,
    })
}

/// The table line: the measurements' round trips, median [min .. max].
pub fn rows(runs: &[GuestLineRun]) -> String {
    let Some(s) = summarize(&runs.iter().map(|r| r.rtt_ns).collect::<Vec<_>>()) else { return String::new() };
    format!(
        "guest line floor ({ROW}: the guest stores a word, a host thread polling guest memory answers; QD1 p50 \
         is given over it): {:.0} ns [{:.0} .. {:.0}]\n",
        s.median, s.min, s.max
    )
}

/// The guest line floor measured before `target`'s run in `round` (a
/// re-run the guard made keeps it).
pub fn of_run(runs: &[GuestLineRun], round: u32, target: &str) -> Option<f64> {
    runs.iter().find(|r| r.round == round && r.target == target).map(|r| r.rtt_ns).filter(|&v| v > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(round: u32, target: &str, rtt_ns: f64) -> GuestLineRun {
        let target = target.to_string();
        GuestLineRun { round, target, round_trips: 100, rtt_ns, min_ns: rtt_ns, routing: String::new() }
    }

    #[test]
    fn a_run_has_the_floor_measured_before_it_and_the_line_summarises_them_all() {
        let runs = [run(0, "a", 120.0), run(0, "b", 80.0), run(1, "a", 0.0), run(1, "b", 90.0)];
        assert_eq!(of_run(&runs, 0, "a"), Some(120.0));
        assert_eq!(of_run(&runs, 0, "b"), Some(80.0));
        assert_eq!(of_run(&runs, 1, "a"), None, "an empty measurement is no floor");
        assert_eq!(of_run(&runs, 1, "b"), Some(90.0));
        assert_eq!(of_run(&runs, 2, "a"), None);
        let line = rows(&runs[..2]);
        assert!(line.contains("100 ns [80 .. 120]"), "{line}");
        assert!(rows(&[]).is_empty());
    }
}
