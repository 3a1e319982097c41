//! adaptive's forecast end to end: a guest with a steady think time. In a
//! test binary of its own, so that no other test's VM loads the host while
//! it runs (the forecast turns itself off on a host too loaded to wake in
//! time).

mod common;
use common::kvm;
use common::nvmeperf::{num, nvmeperf};

#[test]
fn a_think_time_spaces_the_io_and_the_adaptive_poller_forecasts_each_command_or_is_woken_by_it() {
    kvm();
    let job = "rw=randread bs=4096 iodepth=1 thinktime_us=2000 time_ms=300";
    let (rec, c, _) = nvmeperf("nvme,doorbell=adaptive,backend=null,forecast=off", job);
    let ios = num(&rec, "ios");
    assert_eq!(num(&rec, "thinktime_us"), 2000);
    // 2 ms between a completion and the next command: at most 150 in 300 ms (and the last in flight).
    assert!(ios > 0 && ios <= 151, "{ios} I/Os");
    // Each pause is longer than ADAPTIVE_IDLE: the poller sleeps in it and the next command's
    // doorbell (the EventIdx rule asks for it) wakes it.
    assert!(c["adaptive.wakeups"] + 2 >= ios, "{ios} I/Os, {c:?}");
    assert_eq!(c["adaptive.forecasts"], 0, "{c:?}");
    assert_eq!(num(&rec, "io_doorbell_writes"), c["ioeventfd.kicks"], "{c:?}");
    // With the forecast (the default): the pauses are steady, so after a few the poller wakes
    // on a timer just before each command is due and finds it polling, unrung. Each command
    // either woke the poller or ended a forecast's gap. The forecast needs the poller to wake in time:
    // on a host loaded by the other tests (or by anything else: CI machines are shared) it may
    // miss whole runs, so up to six, each retry said on stderr with the host's load.
    let mut hits = 0;
    for run in 1..=6 {
        let (rec, c, _) = nvmeperf("nvme,doorbell=adaptive,backend=null", job);
        let ios = num(&rec, "ios");
        assert!(ios > 0 && ios <= 151 && num(&rec, "errors") == 0, "{ios} I/Os");
        hits = c["adaptive.forecast-hits"];
        // (A command found at the first look after the timer came before it: a forecast, no hit.)
        assert!(c["adaptive.wakeups"] + c["adaptive.forecasts"] + 2 >= ios, "{ios} I/Os, {c:?}");
        assert!(hits <= c["adaptive.forecasts"], "{c:?}");
        assert_eq!(num(&rec, "io_doorbell_writes"), c["ioeventfd.kicks"], "{c:?}");
        if hits > ios / 4 {
            break;
        }
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!(
            "forecast run {run}: {hits} hits of {} forecasts for {ios} I/Os; retrying (load average {})",
            c["adaptive.forecasts"],
            load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
        );
    }
    if hits == 0 {
        // Whether a forecast's timer wakes the poller before the command is due is the
        // scheduler's to decide: on a host with more runnable work than CPUs it may never be in
        // time (the forecast model itself is checked without timing in devices' unit tests).
        // So a miss fails the test only on a host that was not loaded, and says so otherwise.
        let load: f64 = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .and_then(|l| l.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        assert!(load >= cpus, "no command was forecast in six runs, on a host with load {load} for {cpus} CPUs");
        eprintln!("NOT CHECKED: no forecast hit in six runs, the host too loaded (load {load} for {cpus} CPUs)");
    }
}
