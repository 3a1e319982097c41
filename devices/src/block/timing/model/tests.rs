//! The model against its configuration: sampled quantiles, channels by an
//! event sweep, the ceilings over sliding windows of a closed loop driven
//! through the [`TimerWheel`], determinism.

use super::*;
use crate::block::timing::TimerWheel;

fn spec(s: &str) -> TimingSpec {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// The q-quantile of sorted `v` (the smallest value with at least q·n at or below).
fn quantile(v: &[u64], q: f64) -> u64 {
    v[((q * v.len() as f64).ceil() as usize).max(1) - 1]
}

fn rel(got: f64, want: f64) -> f64 {
    (got - want).abs() / want
}

/// Service times of `n` reads arriving 1 s apart (nothing queues).
fn draws(s: &str, n: usize) -> Vec<u64> {
    let mut m = TimingModel::new(&spec(s));
    let mut v: Vec<u64> = (0..n as u64)
        .map(|i| {
            let a = m.admit_full(i * 1_000_000_000, OpKind::Read, 4096);
            assert_eq!((a.start_ns, a.due_ns), (a.arrival_ns, a.arrival_ns + a.service_ns));
            a.service_ns
        })
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn constant_is_exact() {
    assert!(draws("read:10us", 200_000).iter().all(|&d| d == 10_000));
    // An operation with no latency takes none.
    let mut m = TimingModel::new(&spec("read:10us"));
    assert_eq!(m.admit(500, OpKind::Write, 4096), 500);
    assert_eq!(m.admit(600, OpKind::Flush, 0), 600);
}

#[test]
fn uniform_covers_its_range_with_its_mean() {
    let v = draws("read:u:50us:150us", 200_000);
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    eprintln!("uniform 50..150us: min {} max {} mean {mean:.1} p50 {}", v[0], v[v.len() - 1], quantile(&v, 0.5));
    assert!(v[0] >= 50_000 && v[v.len() - 1] <= 150_000);
    assert!(v[0] < 50_100 && v[v.len() - 1] > 149_900, "the ends are reached");
    assert!(rel(mean, 100_000.0) < 0.002, "mean {mean}");
    assert!(rel(quantile(&v, 0.5) as f64, 100_000.0) < 0.005);
}

#[test]
fn lognormal_quantiles_match_p50_and_p99() {
    for (p50, p99) in [(80_000u64, 300_000u64), (10_000, 11_000), (1_000, 1_000_000)] {
        let v = draws(&format!("read:ln:{p50}ns:{p99}ns"), 1_000_000);
        let (g50, g99) = (quantile(&v, 0.5), quantile(&v, 0.99));
        eprintln!("lognormal {p50}/{p99} ns: measured p50 {g50} p99 {g99}");
        assert!(rel(g50 as f64, p50 as f64) < 0.01, "p50 {g50} vs {p50}");
        assert!(rel(g99 as f64, p99 as f64) < 0.01, "p99 {g99} vs {p99}");
    }
}

/// Open-loop arrivals at `rate` per second (exponential gaps, seeded).
fn poisson(rate: f64, n: usize, seed: u64) -> Vec<u64> {
    let mut r = SplitMix64(seed);
    let mut t = 0f64;
    (0..n)
        .map(|_| {
            t += -r.unit().ln() / rate * 1e9;
            t as u64
        })
        .collect()
}

#[test]
fn channels_hold_at_most_n_and_never_idle_while_one_waits() {
    for s in ["read:10us+channels:4", "read:u:5us:15us+channels:8", "read:ln:8us:30us+channels:3"] {
        let n: usize = s.rsplit(':').next().unwrap().parse().unwrap();
        let mut m = TimingModel::new(&spec(s));
        // Arrivals at twice what the channels can serve (mean service ~10 us).
        let arrivals = poisson(2.0 * n as f64 / 10e-6, 20_000, 3);
        let adm: Vec<Admission> = arrivals.iter().map(|&t| m.admit_full(t, OpKind::Read, 4096)).collect();
        let mut starts: Vec<u64> = adm.iter().map(|a| a.start_ns).collect();
        let mut ends: Vec<u64> = adm.iter().map(|a| a.start_ns + a.service_ns).collect();
        starts.sort_unstable();
        ends.sort_unstable();
        // In service at x: started at or before x, not ended at or before x.
        let busy = |x: u64| starts.partition_point(|&s| s <= x) - ends.partition_point(|&e| e <= x);
        let mut waited = 0;
        for a in &adm {
            assert!(a.start_ns >= a.arrival_ns && a.due_ns >= a.arrival_ns + a.service_ns);
            assert_eq!(a.due_ns, a.start_ns + a.service_ns, "no ceiling: due at the end of service");
            assert!(busy(a.start_ns) <= n, "{s}: more than {n} in service at {}", a.start_ns);
            if a.start_ns > a.arrival_ns {
                waited += 1;
                assert_eq!(busy(a.start_ns - 1), n, "{s}: waited while a channel was free");
            }
        }
        assert!(waited > adm.len() / 2, "{s}: the load queued ({waited} waited)");
    }
}

/// A closed loop of `qd` commands through the model and a wheel: each
/// completion (in due order) brings the next arrival at its due time.
/// Returns (completion time, bytes) in completion order.
fn closed_loop(m: &mut TimingModel, qd: usize, n: usize, size: impl Fn(usize) -> u64) -> Vec<(u64, u64)> {
    let mut wheel: TimerWheel<u32> = TimerWheel::new(qd);
    let mut issue = |now: u64, id: usize, wheel: &mut TimerWheel<u32>| {
        let a = m.admit_full(now, OpKind::Read, size(id));
        assert!(a.start_ns >= now && a.due_ns >= a.start_ns + a.service_ns, "{a:?}");
        let due = a.due_ns;
        wheel.insert(due, id as u32).unwrap();
    };
    for id in 0..qd {
        issue(0, id, &mut wheel);
    }
    let (mut done, mut out) = (Vec::with_capacity(n), Vec::new());
    while done.len() < n {
        let now = wheel.next_due().unwrap();
        out.clear();
        wheel.expire(now, &mut out);
        assert!(!out.is_empty());
        for &id in &out {
            done.push((now, size(id as usize)));
            issue(now, qd + done.len() - 1, &mut wheel);
        }
    }
    done
}

/// The lowest and highest rate over every window of `k` consecutive
/// completions: (per-second rate of completions, bytes per second); the
/// lowest only once the first 1000 are past (the loop starts with all
/// its commands issued at once: the ceiling is a bound from the first
/// completion, a rate reached once the backlog has formed).
fn window_rates(done: &[(u64, u64)], k: usize) -> ((f64, f64), (f64, f64)) {
    // prefix[j]: the bytes of completions 0..j.
    let mut prefix = vec![0u64];
    for d in done {
        prefix.push(prefix[prefix.len() - 1] + d.1);
    }
    let (mut iops, mut bw) = ((f64::MAX, 0f64), (f64::MAX, 0f64));
    for i in 0..done.len() + 1 - k {
        let j = i + k - 1;
        // The k-1 completions after the window's first, over its span.
        let span = (done[j].0 - done[i].0) as f64 / 1e9;
        let (r, b) = ((k - 1) as f64 / span, (prefix[j + 1] - prefix[i + 1]) as f64 / span);
        let warm = i >= 1000;
        iops = (if warm { iops.0.min(r) } else { iops.0 }, iops.1.max(r));
        bw = (if warm { bw.0.min(b) } else { bw.0 }, bw.1.max(b));
    }
    (iops, bw)
}

#[test]
fn iops_ceiling_holds_over_every_window_of_1000() {
    for (s, ceiling) in
        [("read:ln:80us:300us+iops:500k", 500e3), ("read:2us+iops:1m+channels:16", 1e6), ("iops:3m", 3e6)]
    {
        let mut m = TimingModel::new(&spec(s));
        let done = closed_loop(&mut m, 256, 200_000, |_| 4096);
        let ((lo, hi), _) = window_rates(&done, 1000);
        eprintln!("{s}: windows of 1000 completions: {lo:.0} ..= {hi:.0} IOPS (ceiling {ceiling})");
        assert!(hi <= ceiling * 1.02 && lo >= ceiling * 0.98, "{s}: {lo} ..= {hi}");
        let l = m.iops.as_ref().unwrap().0.len();
        assert!(l <= 256, "the IOPS line holds {l} intervals for 256 in flight");
    }
}

#[test]
fn at_qd1_the_iops_ceiling_is_an_absolute_schedule() {
    // Each command arrives 5 us after the previous one's due time (the
    // path's time): due exactly one slot (1 ms) after it, not 1.005 ms.
    let mut m = TimingModel::new(&spec("read:20us+iops:1k"));
    let mut due = m.admit(0, OpKind::Read, 4096);
    assert_eq!(due, 1_000_000, "the first slot starts at 0");
    for k in 0..1000 {
        let next = m.admit(due + 5_000, OpKind::Read, 4096);
        assert_eq!(next - due, 1_000_000, "command {k}");
        due = next;
    }
    // An idle second is not banked: the next two are a slot apart.
    let a = m.admit(due + 1_000_000_000, OpKind::Read, 4096);
    let b = m.admit(due + 1_000_000_000, OpKind::Read, 4096);
    assert_eq!(b - a, 1_000_000);
    assert!(a >= due + 1_000_000_000 + 20_000, "not before its arrival + service");
}

#[test]
fn bandwidth_ceiling_holds_over_every_window_of_1000() {
    let sizes = [4096u64, 16384, 65536, 131072];
    for (s, ceiling) in [("read:20us+bw:3g", 3e9), ("read:ln:30us:90us+bw:1500m+channels:32", 1.5e9)] {
        let mut m = TimingModel::new(&spec(s));
        let mut r = SplitMix64(9);
        let pick: Vec<u64> = (0..100_000 + 64).map(|_| sizes[r.below(4) as usize]).collect();
        let done = closed_loop(&mut m, 64, 100_000, |i| pick[i]);
        let (_, (lo, hi)) = window_rates(&done, 1000);
        eprintln!("{s}: windows of 1000 completions: {:.4} ..= {:.4} GB/s", lo / 1e9, hi / 1e9);
        assert!(hi <= ceiling * 1.02 && lo >= ceiling * 0.98, "{s}: {lo} ..= {hi}");
    }
}

#[test]
fn both_ceilings_the_lower_one_binds() {
    // 200k IOPS of 8 KiB is 1.64 GB/s: the 1 GB/s ceiling binds (122k IOPS).
    let mut m = TimingModel::new(&spec("read:10us+iops:200k+bw:1g"));
    let done = closed_loop(&mut m, 64, 100_000, |_| 8192);
    let ((ilo, ihi), (lo, hi)) = window_rates(&done, 1000);
    eprintln!("iops:200k+bw:1g, 8 KiB: {ilo:.0} ..= {ihi:.0} IOPS, {lo:.0} ..= {hi:.0} B/s");
    assert!(hi <= 1.02e9 && lo >= 0.98e9 && ihi <= 200e3);
    // 4 KiB: 200k IOPS is 819 MB/s, under 1 GB/s: the IOPS ceiling binds.
    let mut m = TimingModel::new(&spec("read:10us+iops:200k+bw:1g"));
    let done = closed_loop(&mut m, 64, 100_000, |_| 4096);
    let ((lo, hi), (_, bhi)) = window_rates(&done, 1000);
    assert!(hi <= 204e3 && lo >= 196e3 && bhi <= 1.02e9, "{lo} ..= {hi}");
}

#[test]
fn latency_below_the_ceilings_stays_as_configured() {
    // From 1k to 1M IOPS offered (open loop), 20% of the 5m ceiling at most.
    for rate in [1e3, 1e5, 1e6] {
        let s = "read:ln:80us:300us+iops:5m+bw:100g";
        let mut m = TimingModel::new(&spec(s));
        let mut lat: Vec<u64> = poisson(rate, 300_000, 5).iter().map(|&t| m.admit(t, OpKind::Read, 4096) - t).collect();
        lat.sort_unstable();
        let (p50, p99) = (quantile(&lat, 0.5), quantile(&lat, 0.99));
        eprintln!("{s} at {rate} IOPS: p50 {p50} ns p99 {p99} ns");
        assert!(rel(p50 as f64, 80e3) < 0.02 && rel(p99 as f64, 300e3) < 0.02, "{p50} {p99}");
    }
}

#[test]
fn a_seed_replays_exactly() {
    let run = |s: &str| {
        let mut m = TimingModel::new(&spec(s));
        poisson(500e3, 5000, 1).iter().map(|&t| m.admit(t, OpKind::Read, 4096)).collect::<Vec<u64>>()
    };
    let a = "read:ln:80us:300us+write:u:10us:30us+channels:8+iops:400k+bw:2g+seed:42";
    assert_eq!(run(a), run(a));
    assert_ne!(run(a), run(&a.replace("seed:42", "seed:43")));
}

#[test]
fn an_arrival_back_in_time_counts_as_the_latest() {
    let mut m = TimingModel::new(&spec("read:10us"));
    assert_eq!(m.admit(1000, OpKind::Read, 0), 11_000);
    let a = m.admit_full(400, OpKind::Read, 0);
    assert_eq!((a.arrival_ns, a.due_ns), (1000, 11_000));
}

#[test]
fn line_fits_the_first_gap_and_merges() {
    let mut l = Line::new(1);
    l.reserve(10, 20);
    l.reserve(30, 40);
    assert_eq!(l.fit(15, 5, 0), 25, "after [10,20)");
    assert_eq!(l.fit(25, 5, 0), 25, "[20,25) is free");
    assert_eq!(l.fit(26, 15, 0), 55, "the 10-wide gap is too small");
    assert_eq!(l.fit(5, 5, 0), 5);
    assert_eq!(l.fit(5, 5, 3), 8, "not before the floor");
    l.reserve(20, 30);
    assert_eq!(l.len(), 1, "touching intervals merge");
    assert_eq!(l.fit(0, 1, 0), 1);
    assert_eq!(l.fit(11, 1, 0), 41);
    l.forget_before(40);
    assert_eq!(l.len(), 0);
    // Gaps narrower than min_gap merge: [0,10) [14,24) [30,40) with min_gap 5.
    let mut l = Line::new(5);
    l.reserve(0, 10);
    l.reserve(30, 40);
    assert_eq!(l.len(), 2, "a 20-wide gap stays");
    l.reserve(14, 24);
    assert_eq!(l.len(), 2, "the 4-wide gap merges ([0,24)), the 6-wide one stays");
    assert_eq!(l.fit(0, 5, 0), 29, "[24,29) is the first free 5");
    assert_eq!(l.fit(0, 7, 0), 47, "after [30,40)");
}

/// Not a test: the cost of `admit` and of a wheel's insert and expire per
/// command (`cargo test -p iopath-devices --release microbench -- --ignored --nocapture`).
#[test]
#[ignore]
fn microbench_admit_and_wheel() {
    let n = 2_000_000;
    for s in [
        "read:10us",
        "read:ln:80us:300us+channels:8",
        "read:ln:80us:300us+channels:8+iops:500k",
        "read:ln:80us:300us+channels:8+bw:3g",
        "read:ln:80us:300us+iops:500k+bw:3g",
        "read:ln:80us:300us+channels:8+iops:500k+bw:3g",
    ] {
        let mut m = TimingModel::new(&spec(s));
        let t0 = std::time::Instant::now();
        let done = closed_loop(&mut m, 128, n, |_| 4096);
        let per = t0.elapsed().as_nanos() as f64 / n as f64;
        eprintln!("{s}: {per:.0} ns per command (admit + insert + expire), {} completions", done.len());
    }
}
