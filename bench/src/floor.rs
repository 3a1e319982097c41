//! `iopath bench floor`: what a polled NVMe-style queue pair costs between two
//! host threads with no VM and no device model, the floor under every
//! `bench nvme` figure. One thread plays the guest's driver on the vCPU: it
//! writes 64-byte submission entries into a ring, publishes the SQ tail and
//! reaps 16-byte completions by their phase tag. The other plays the
//! controller's poller: it polls the tail, copies and "executes" each entry
//! and posts its completion. QD = entries outstanding. The host moves threads
//! between cores that do and do not share caches, so the floor means
//! something only beside the runs it is compared with: `bench nvme` measures
//! it in every round, before that round's NVMe runs.

use crate::host::{host_info, HostInfo};
use crate::stats::{summarize, Summary};
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Queue depths `bench floor` runs by default.
pub const DEPTHS: [u32; 3] = [1, 16, 64];
/// The deepest queue: NVMe's 4096-entry maximum less the slot that tells a
/// full ring from an empty one.
pub const MAX_QD: u32 = 4095;
/// Where the threads run when not pinned, and why.
pub const UNPINNED: &str = "unpinned (--pin off, or one CPU): the scheduler places the vCPU, device and floor threads";

/// Ring size for `qd`: what the guest's nvmeperf creates (4 x iodepth, 32 to 4096).
pub fn ring_entries(qd: u32) -> u32 {
    (qd.saturating_mul(4)).clamp(32, 4096)
}

/// `bench floor` options.
#[derive(Clone, Debug, Serialize)]
pub struct FloorOptions {
    /// Queue depths, each one run per round (1..=MAX_QD).
    pub depths: Vec<u32>,
    pub rounds: u32,
    /// Length of one run (one queue depth, one round).
    pub time_ms: u64,
    /// Pin the submitting (vCPU-like) and the polling thread to these CPUs;
    /// None runs them unpinned, as iopath's own threads run.
    pub cpus: Option<(usize, usize)>,
    pub progress: bool,
}

impl Default for FloorOptions {
    fn default() -> Self {
        FloorOptions { depths: DEPTHS.to_vec(), rounds: 3, time_ms: 1000, cpus: None, progress: true }
    }
}

/// One run of the ring at one queue depth.
#[derive(Clone, Debug, Serialize)]
pub struct FloorRun {
    pub round: u32,
    /// 0 in a round; k before the k-th re-run of a target `bench nvme`'s guard marked.
    pub attempt: u32,
    pub qd: u32,
    pub ring_entries: u32,
    /// Commands completed.
    pub ops: u64,
    pub secs: f64,
    pub ops_s: f64,
    /// Submission to reaped completion, median.
    pub p50_ns: f64,
    /// Completions that did not match their command (lost, duplicated,
    /// reordered or wrong status): a broken ring, never a slow one.
    pub errors: u64,
    /// Most entries the poller ever found outstanding in the SQ.
    pub max_outstanding: u32,
    /// CPUs the submitter and the poller were on when the run ended.
    pub cpus: [i32; 2],
}

/// A submission queue entry: the NVMe command layout, 8 quadwords.
#[derive(Default)]
#[repr(C, align(64))]
struct Sqe([AtomicU64; 8]);

/// A completion queue entry: DW0/DW1, then SQHD, SQID, CID and status with the phase tag in bit 0.
#[derive(Default)]
#[repr(C, align(16))]
struct Cqe([AtomicU64; 2]);

/// A doorbell word alone on its cache line.
#[derive(Default)]
#[repr(align(64))]
struct Line(AtomicU32);

/// The shared memory: both rings and the two doorbells.
struct Ring {
    sq: Box<[Sqe]>,
    cq: Box<[Cqe]>,
    sq_tail: Line,
    cq_head: Line,
    stop: AtomicBool,
    entries: u32,
    /// How long the submitter waits for a completion before it gives up.
    stall: Duration,
}

const OPC_READ: u64 = 0x02;
const NSID: u64 = 1;

impl Ring {
    fn new(entries: u32) -> Ring {
        Ring {
            sq: (0..entries).map(|_| Sqe::default()).collect(),
            cq: (0..entries).map(|_| Cqe::default()).collect(),
            sq_tail: Line::default(),
            cq_head: Line::default(),
            stop: AtomicBool::new(false),
            entries,
            stall: STALL,
        }
    }
}

/// How long the submitter goes on.
#[derive(Clone, Copy, Debug)]
pub enum Limit {
    Time(Duration),
    Ops(u64),
}

#[cfg(target_arch = "x86_64")]
fn ticks() -> u64 {
    // SAFETY: RDTSC has no preconditions; every x86-64 CPU has it.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn ticks() -> u64 {
    static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    T0.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Pins the calling thread to `cpu`.
fn pin(cpu: usize) -> anyhow::Result<()> {
    crate::pin::set_affinity(0, cpu).map_err(|e| anyhow::anyhow!("pinning to CPU {cpu}: {e}"))
}

fn cpu_now() -> i32 {
    // SAFETY: no arguments; returns -1 on failure.
    unsafe { libc::sched_getcpu() }
}

/// Submission-to-completion latencies in ticks: 32 linear buckets per power
/// of two (about 3 % resolution), fixed size whatever the run's length.
struct Hist {
    counts: Vec<u64>,
    n: u64,
}

const SUB: u64 = 32;
const SUB_BITS: u32 = 5;

impl Hist {
    fn new() -> Hist {
        Hist { counts: vec![0; (SUB as usize) * (64 - SUB_BITS as usize + 1)], n: 0 }
    }

    fn index(v: u64) -> usize {
        if v < SUB {
            return v as usize;
        }
        let e = 63 - v.leading_zeros();
        let m = (v >> (e - SUB_BITS)) & (SUB - 1);
        (SUB + (e - SUB_BITS) as u64 * SUB + m) as usize
    }

    /// The lowest value of bucket `i`.
    fn value(i: usize) -> u64 {
        let i = i as u64;
        if i < SUB {
            return i;
        }
        let (e, m) = ((i - SUB) / SUB, (i - SUB) % SUB);
        (SUB + m) << e
    }

    fn add(&mut self, v: u64, n: u64) {
        self.counts[Self::index(v)] += n;
        self.n += n;
    }

    /// The value at quantile `q` (0..1), or None when empty.
    fn quantile(&self, q: f64) -> Option<u64> {
        let want = ((self.n as f64 * q).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if *c > 0 && seen >= want {
                return Some(Self::value(i));
            }
        }
        None
    }
}

/// What the poller thread saw.
struct PollerStats {
    executed: u64,
    max_outstanding: u32,
    cpu: i32,
}

/// The controller's poller: copies each new SQ entry, checks it, posts its completion.
fn poller(ring: &Ring) -> PollerStats {
    let n = ring.entries;
    let (mut head, mut ctail, mut phase) = (0u32, 0u32, 1u64);
    let (mut executed, mut max_outstanding, mut idle) = (0u64, 0u32, 0u32);
    while !ring.stop.load(Ordering::Relaxed) {
        let tail = ring.sq_tail.0.load(Ordering::Acquire);
        if tail >= n || tail == head {
            // Nothing new (or a tail out of range, which this ring's
            // submitter never writes): idle as iopath's poller does.
            idle = idle.saturating_add(1);
            if idle > 4096 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        idle = 0;
        max_outstanding = max_outstanding.max((tail + n - head) % n);
        while head != tail {
            let mut cmd = [0u64; 8];
            for (w, q) in cmd.iter_mut().zip(ring.sq[head as usize].0.iter()) {
                *w = q.load(Ordering::Relaxed);
            }
            head = (head + 1) % n;
            let (opc, cid, nsid) = (cmd[0] & 0xff, (cmd[0] >> 16) & 0xffff, cmd[0] >> 32);
            // "Execute": a read of one block at SLBA (cdw10/11) into PRP1, which
            // this ring's submitter always sets to SLBA * 4096; DW0 echoes the
            // low half of the tag in cdw2/3. A torn or stale entry fails (status 1).
            let ok = opc == OPC_READ && nsid == NSID && cmd[3] == cmd[5] << 12 && cmd[1] == cmd[5];
            let status: u64 = if ok { 0 } else { 1 };
            let dw0 = cmd[1] & 0xffff_ffff;
            // The CQ has room: the submitter never has more than QD < entries outstanding; wait anyway, as a controller must.
            while (ctail + 1) % n == ring.cq_head.0.load(Ordering::Acquire) {
                if ring.stop.load(Ordering::Relaxed) {
                    return PollerStats { executed, max_outstanding, cpu: cpu_now() };
                }
                std::hint::spin_loop();
            }
            let e = &ring.cq[ctail as usize].0;
            e[0].store(dw0, Ordering::Relaxed);
            // SQHD, SQID 1, CID, then status<<1 | phase: published last.
            e[1].store(head as u64 | 1 << 16 | cid << 32 | (status << 1 | phase) << 48, Ordering::Release);
            executed += 1;
            ctail += 1;
            if ctail == n {
                ctail = 0;
                phase ^= 1;
            }
        }
    }
    PollerStats { executed, max_outstanding, cpu: cpu_now() }
}

/// How long the submitter waits for a poller that stopped completing.
const STALL: Duration = Duration::from_secs(10);

/// What the submitter counted.
struct SubmitterStats {
    submitted: u64,
    completed: u64,
    errors: u64,
    secs: f64,
    hist: Hist,
    ns_per_tick: f64,
    cpu: i32,
}

/// The guest's driver: keeps `qd` commands outstanding, reaps by phase tag,
/// checks each completion against the command it answers.
fn submitter(ring: &Ring, qd: u32, limit: Limit) -> SubmitterStats {
    let n = ring.entries;
    let (mut tail, mut head, mut phase) = (0u32, 0u32, 1u64);
    // seq: commands submitted; done: completed (the oldest outstanding is `done`).
    let (mut seq, mut done, mut errors, mut idle) = (0u64, 0u64, 0u64, 0u32);
    let mut stamps = vec![0u64; n as usize];
    let mut hist = Hist::new();
    let (t0, k0) = (Instant::now(), ticks());
    let (mut drain_since, mut stalled_since): (Option<Instant>, Option<Instant>) = (None, None);
    let mut iter = 0u64;
    loop {
        // Submit up to QD outstanding, then ring the SQ tail doorbell once.
        let cap = match limit {
            Limit::Ops(max) => max,
            Limit::Time(_) if drain_since.is_none() => u64::MAX,
            Limit::Time(_) => seq,
        };
        if seq < cap && seq - done < qd as u64 {
            let now = ticks();
            while seq < cap && seq - done < qd as u64 {
                let q = &ring.sq[tail as usize].0;
                q[0].store(OPC_READ | (seq & 0xffff) << 16 | NSID << 32, Ordering::Relaxed);
                q[1].store(seq, Ordering::Relaxed);
                q[3].store(seq << 12, Ordering::Relaxed);
                q[5].store(seq, Ordering::Relaxed);
                stamps[tail as usize] = now;
                tail = (tail + 1) % n;
                seq += 1;
            }
            ring.sq_tail.0.store(tail, Ordering::Release);
        }
        let mut got = 0u64;
        let mut now = 0;
        loop {
            let e = &ring.cq[head as usize].0;
            let w1 = e[1].load(Ordering::Acquire);
            if (w1 >> 48) & 1 != phase {
                break;
            }
            if got == 0 {
                now = ticks();
            }
            let dw0 = e[0].load(Ordering::Relaxed);
            // The completion answers the oldest outstanding command (one
            // queue, in order): its slot, tag, DW0 and a success status.
            let slot = (done % n as u64) as u32;
            let (sqhd, cid, status) = ((w1 & 0xffff) as u32, (w1 >> 32) & 0xffff, (w1 >> 49) & 0x7fff);
            let want_dw0 = done & 0xffff_ffff;
            if done >= seq {
                // A completion for nothing outstanding (a duplicate): count it, reap the slot.
                errors += 1;
            } else {
                if cid != done & 0xffff || sqhd != (slot + 1) % n || status != 0 || dw0 != want_dw0 {
                    errors += 1;
                }
                hist.add(now.wrapping_sub(stamps[slot as usize]), 1);
                done += 1;
            }
            got += 1;
            head += 1;
            if head == n {
                head = 0;
                phase ^= 1;
            }
        }
        if got > 0 {
            ring.cq_head.0.store(head, Ordering::Release);
            idle = 0;
            stalled_since = None;
        } else {
            idle = idle.saturating_add(1);
            // Both threads on one CPU: give the poller a turn now and then.
            if idle > 1 << 16 {
                std::thread::yield_now();
                idle = 0;
                // A poller that stopped answering: give up after generous
                // seconds, counting what it never completed as errors.
                let since = *stalled_since.get_or_insert_with(Instant::now);
                if seq > done && since.elapsed() > ring.stall {
                    errors += seq - done;
                    break;
                }
            } else {
                std::hint::spin_loop();
            }
        }
        iter += 1;
        if let Limit::Time(d) = limit {
            if drain_since.is_none() && iter.is_multiple_of(256) && t0.elapsed() >= d {
                drain_since = Some(Instant::now());
            }
        }
        let finished = match limit {
            Limit::Ops(max) => seq >= max,
            Limit::Time(_) => drain_since.is_some(),
        };
        if finished && done == seq {
            break;
        }
    }
    let (secs, k1) = (t0.elapsed().as_secs_f64(), ticks());
    let ns_per_tick = secs * 1e9 / (k1.wrapping_sub(k0)).max(1) as f64;
    SubmitterStats { submitted: seq, completed: done, errors, secs, hist, ns_per_tick, cpu: cpu_now() }
}

/// Sets the flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// One run of the ring at `qd` (1..=MAX_QD) with its two threads, pinned to
/// `cpus` (submitter, poller) if given.
pub fn run_ring(qd: u32, limit: Limit, cpus: Option<(usize, usize)>) -> anyhow::Result<FloorRun> {
    anyhow::ensure!((1..=MAX_QD).contains(&qd), "queue depth {qd} is outside 1..={MAX_QD}");
    run_on(Arc::new(Ring::new(ring_entries(qd))), qd, limit, cpus)
}

/// One run on `ring` (qd < ring.entries).
fn run_on(ring: Arc<Ring>, qd: u32, limit: Limit, cpus: Option<(usize, usize)>) -> anyhow::Result<FloorRun> {
    // Both threads start measuring once both are placed.
    let ready = Arc::new(Barrier::new(2));
    let placed = |cpu: Option<usize>| cpu.map(pin).transpose();
    let (r2, b2) = (ring.clone(), ready.clone());
    let poll = std::thread::Builder::new().name("floor-poller".into()).spawn(move || {
        let p = placed(cpus.map(|c| c.1));
        b2.wait();
        p.map(|_| poller(&r2))
    })?;
    let (r3, b3) = (ring.clone(), ready);
    let sub = std::thread::Builder::new().name("floor-vcpu".into()).spawn(move || {
        // The poller stops when the submitter ends, even by a panic.
        let _stop = StopOnDrop(&r3.stop);
        let p = placed(cpus.map(|c| c.0));
        b3.wait();
        p.map(|_| submitter(&r3, qd, limit))
    });
    let sub = match sub {
        Ok(h) => h.join(),
        Err(e) => {
            ring.stop.store(true, Ordering::Relaxed);
            let _ = poll.join();
            return Err(e.into());
        }
    };
    let poll = poll.join();
    let (s, p) = match (sub, poll) {
        (Ok(s), Ok(p)) => (s?, p?),
        _ => anyhow::bail!("a ring thread panicked"),
    };
    let mut errors = s.errors;
    // Every command submitted was executed once and completed once.
    if p.executed != s.submitted || s.completed != s.submitted {
        errors += 1;
    }
    let p50 = s.hist.quantile(0.5).map_or(f64::NAN, |t| t as f64 * s.ns_per_tick);
    Ok(FloorRun {
        round: 0,
        attempt: 0,
        qd,
        ring_entries: ring.entries,
        ops: s.completed,
        secs: s.secs,
        ops_s: s.completed as f64 / s.secs.max(1e-9),
        p50_ns: p50,
        errors,
        max_outstanding: p.max_outstanding,
        cpus: [s.cpu, p.cpu],
    })
}

/// The floor at each of `depths` for one round, `time_ms` each; a depth
/// beyond MAX_QD runs at MAX_QD. Failures become error strings.
pub fn measure_round(
    depths: &[u32],
    round: u32,
    time_ms: u64,
    cpus: Option<(usize, usize)>,
) -> (Vec<FloorRun>, Vec<String>) {
    let (mut runs, mut errors) = (Vec::new(), Vec::new());
    for &qd in depths {
        match run_ring(qd.clamp(1, MAX_QD), Limit::Time(Duration::from_millis(time_ms.max(1))), cpus) {
            Ok(mut r) => {
                r.round = round;
                if r.errors > 0 {
                    errors.push(format!("floor qd{qd} round {round}: {} completions did not match", r.errors));
                }
                runs.push(r);
            }
            Err(e) => errors.push(format!("floor qd{qd} round {round}: {e}")),
        }
    }
    (runs, errors)
}

/// The floor's run of `round` (its first attempt) at `qd`, from `runs`.
fn run_of(runs: &[FloorRun], round: u32, qd: u32) -> Option<&FloorRun> {
    runs.iter().find(|r| r.round == round && r.attempt == 0 && r.qd == qd.clamp(1, MAX_QD))
}

/// The floor's ops/s in `round` at `qd`, from `runs`.
pub fn ops_s_of(runs: &[FloorRun], round: u32, qd: u32) -> Option<f64> {
    run_of(runs, round, qd).map(|r| r.ops_s)
}

/// The floor's p50 in `round` at `qd`, from `runs`.
pub fn p50_of(runs: &[FloorRun], round: u32, qd: u32) -> Option<f64> {
    run_of(runs, round, qd).map(|r| r.p50_ns).filter(|p| p.is_finite())
}

/// How the floor's threads were placed, for tables and JSON.
pub fn placement(cpus: Option<(usize, usize)>) -> String {
    match cpus {
        Some((a, b)) => format!("pinned: submitter on CPU {a}, poller on CPU {b}"),
        None => UNPINNED.into(),
    }
}

pub struct FloorResult {
    /// Ctrl-C stopped the bench (`crate::interrupt`): the runs measured before it.
    pub partial: bool,
    pub host: HostInfo,
    pub options: FloorOptions,
    pub runs: Vec<FloorRun>,
    /// The wake-up floor of each round (`wake.rs`).
    pub wake: Vec<crate::wake::WakeRun>,
    pub errors: Vec<String>,
}

/// `bench floor`: every depth in every round, interleaved round by round.
pub fn run_floor(o: &FloorOptions) -> anyhow::Result<FloorResult> {
    for &qd in &o.depths {
        anyhow::ensure!((1..=MAX_QD).contains(&qd), "queue depth {qd} is outside 1..={MAX_QD}");
    }
    let total = o.depths.len() as u64 * o.rounds as u64;
    let pb = crate::progress::bar(o.progress, total);
    let (mut runs, mut errors, mut wake) = (Vec::new(), Vec::new(), Vec::new());
    let (k0, t0) = (ticks(), Instant::now());
    let interrupted = crate::interrupt::interrupted;
    'rounds: for round in 0..o.rounds {
        if interrupted() {
            break;
        }
        pb.set_message(format!("round {}/{} wake-up", round + 1, o.rounds));
        match crate::wake::run_wake(crate::wake::WAKES, crate::wake::IDLE, o.cpus, round) {
            Ok(w) => wake.push(w),
            Err(e) => errors.push(format!("wake round {round}: {e}")),
        }
        for &qd in &o.depths {
            if interrupted() {
                break 'rounds;
            }
            pb.set_message(format!("round {}/{} qd{qd}", round + 1, o.rounds));
            let (r, e) = measure_round(&[qd], round, o.time_ms, o.cpus);
            runs.extend(r);
            errors.extend(e);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    // No VM here: the TSC rate is what the clock saw it count.
    let tsc_khz = (ticks().wrapping_sub(k0) as f64 / t0.elapsed().as_secs_f64().max(1e-9) / 1e3) as u64;
    Ok(FloorResult { partial: interrupted(), host: host_info(tsc_khz), options: o.clone(), runs, wake, errors })
}

/// Per-depth medians with min and max over rounds: (qd, ops/s, p50 ns).
pub fn summaries(runs: &[FloorRun]) -> Vec<(u32, Summary, Option<Summary>)> {
    let mut depths: Vec<u32> = runs.iter().map(|r| r.qd).collect();
    depths.sort_unstable();
    depths.dedup();
    depths
        .into_iter()
        .filter_map(|qd| {
            let rs: Vec<&FloorRun> = runs.iter().filter(|r| r.qd == qd).collect();
            let ops = summarize(&rs.iter().map(|r| r.ops_s).collect::<Vec<_>>())?;
            Some((qd, ops, summarize(&rs.iter().map(|r| r.p50_ns).collect::<Vec<_>>())))
        })
        .collect()
}

fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.1} k", v / 1e3)
    }
}

fn dur(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} us", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// The floor's rows: QD, ops/s and p50 with [min .. max] over rounds.
pub fn floor_rows(runs: &[FloorRun]) -> String {
    let mut s = String::new();
    let hdr = format!(
        "{:<5} {:>7} {:>10} {:>22} {:>10} {:>24}  cpus (submitter/poller, at the end)",
        "QD", "entries", "ops/s", "[min .. max]", "p50", "[min .. max]"
    );
    let _ = writeln!(s, "{hdr}");
    let _ = writeln!(s, "{}", "-".repeat(hdr.len()));
    for (qd, ops, p50) in summaries(runs) {
        let mut cpus: Vec<String> =
            runs.iter().filter(|r| r.qd == qd).map(|r| format!("{}/{}", r.cpus[0], r.cpus[1])).collect();
        cpus.dedup();
        let (p, pr) = match p50 {
            Some(p) => (dur(p.median), format!("[{} .. {}]", dur(p.min), dur(p.max))),
            None => ("-".into(), String::new()),
        };
        let _ = writeln!(
            s,
            "{qd:<5} {:>7} {:>10} {:>22} {p:>10} {pr:>24}  {}",
            ring_entries(qd),
            rate(ops.median),
            format!("[{} .. {}]", rate(ops.min), rate(ops.max)),
            cpus.join(" ")
        );
    }
    s
}

impl FloorResult {
    pub fn table(&self) -> String {
        let mut s = String::new();
        let o = &self.options;
        if self.partial {
            let _ = writeln!(s, "{}", crate::interrupt::partial_line(self.runs.len()));
        }
        let _ = writeln!(s, "{}", self.host);
        let _ = writeln!(
            s,
            "ring floor: one SQ/CQ pair (64 B commands, 16 B completions with phase tags) polled between two threads; \
             {} s per run, {} round(s); median [min .. max] over rounds",
            o.time_ms as f64 / 1000.0,
            o.rounds
        );
        let _ = writeln!(s, "placement: {}", placement(o.cpus));
        s.push_str(&floor_rows(&self.runs));
        s.push_str(&crate::wake::rows(&self.wake));
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors:");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    pub fn json(&self) -> Value {
        let summary: Vec<Value> = summaries(&self.runs)
            .into_iter()
            .map(|(qd, ops, p50)| json!({"qd": qd, "ring_entries": ring_entries(qd), "ops_s": ops, "p50_ns": p50}))
            .collect();
        json!({
            "schema_version": crate::guard::JSON_SCHEMA_VERSION,
            "benchmark": "floor",
            "partial": self.partial,
            "host": self.host,
            "options": self.options,
            "placement": placement(self.options.cpus),
            "summary": summary,
            "runs": self.runs,
            "wake": self.wake,
            "errors": self.errors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_completes_once_in_order_through_many_phase_wraps() {
        // Small rings wrap, and flip the phase, thousands of times; at QD
        // entries - 1 the ring is as full as it can be (the CQ too).
        for (entries, qd) in [(32, 1), (32, 7), (8, 7), (2, 1)] {
            let r = run_on(Arc::new(Ring::new(entries)), qd, Limit::Ops(20_000), None).unwrap();
            assert_eq!(r.ring_entries, entries);
            assert_eq!(r.ops, 20_000, "qd {qd}");
            assert_eq!(r.errors, 0, "qd {qd}: lost, duplicated or mismatched completions");
            assert!(r.max_outstanding >= 1 && r.max_outstanding <= qd, "qd {qd}: the poller saw {}", r.max_outstanding);
            assert!(r.ops_s > 0.0 && r.p50_ns > 0.0, "{r:?}");
        }
    }

    #[test]
    fn a_timed_run_drains_what_it_submitted() {
        let r = run_ring(64, Limit::Time(Duration::from_millis(30)), None).unwrap();
        assert_eq!((r.ring_entries, r.errors), (256, 0));
        assert!(r.ops > 0 && r.max_outstanding <= 64, "{r:?}");
    }

    #[test]
    fn a_completion_with_a_stale_phase_is_not_reaped() {
        // The poller never runs: CQ entries written with the old phase (0,
        // as at reset) or a wrong tag must not count as completions.
        let ring = Ring::new(32);
        ring.cq[0].0[1].store(1 << 32, Ordering::Release); // cid 0, phase 0
        ring.stop.store(true, Ordering::Relaxed);
        let s = std::thread::scope(|t| {
            let h = t.spawn(|| submitter(&ring, 1, Limit::Ops(1)));
            // Let it poll the stale entry, then post the right one by hand.
            std::thread::sleep(Duration::from_millis(20));
            ring.cq[0].0[0].store(0, Ordering::Relaxed);
            ring.cq[0].0[1].store(1 | 1 << 16 | 1 << 48, Ordering::Release); // sqhd 1, cid 0, phase 1
            h.join().unwrap()
        });
        assert_eq!((s.submitted, s.completed, s.errors), (1, 1, 0));
        // A wrong tag with the right phase is reaped but counted as an error.
        let ring = Ring::new(32);
        let s = std::thread::scope(|t| {
            let h = t.spawn(|| submitter(&ring, 1, Limit::Ops(1)));
            ring.cq[0].0[1].store(1 | 7 << 32 | 1 << 48, Ordering::Release);
            h.join().unwrap()
        });
        assert_eq!((s.completed, s.errors), (1, 1));
    }

    #[test]
    fn a_poller_that_never_answers_ends_the_run_with_errors() {
        let mut ring = Ring::new(32);
        ring.stall = Duration::from_millis(50);
        let s = submitter(&ring, 4, Limit::Ops(100));
        assert_eq!((s.submitted, s.completed, s.errors), (4, 0, 4));
    }

    #[test]
    fn the_json_carries_the_schema_version() {
        let r = FloorResult {
            partial: false,
            host: host_info(1_000_000),
            options: FloorOptions::default(),
            runs: Vec::new(),
            wake: Vec::new(),
            errors: Vec::new(),
        };
        assert_eq!(r.json()["schema_version"], crate::guard::JSON_SCHEMA_VERSION);
    }

    #[test]
    fn ring_sizes_and_depth_bounds() {
        assert_eq!([ring_entries(1), ring_entries(16), ring_entries(64), ring_entries(MAX_QD)], [32, 64, 256, 4096]);
        assert!(run_ring(0, Limit::Ops(1), None).is_err());
        assert!(run_ring(MAX_QD + 1, Limit::Ops(1), None).is_err());
        assert!(run_floor(&FloorOptions { depths: vec![5000], ..Default::default() }).is_err());
    }

    #[test]
    fn pinned_runs_report_their_cpus() {
        // Both on one CPU (the one this test runs on): slow, but it must work.
        let c = cpu_now();
        let r = run_ring(4, Limit::Ops(2000), Some((c as usize, c as usize))).unwrap();
        assert_eq!((r.cpus, r.errors), ([c, c], 0));
        assert!(run_ring(4, Limit::Ops(10), Some((1 << 20, 0))).is_err());
    }

    #[test]
    fn histogram_buckets_and_quantiles() {
        for v in [0u64, 1, 31, 32, 33, 100, 1000, 123_456, u64::MAX] {
            let lo = Hist::value(Hist::index(v));
            assert!(lo <= v && v - lo <= v / 32, "{v}: bucket starts at {lo}");
        }
        let mut h = Hist::new();
        assert_eq!(h.quantile(0.5), None);
        for v in 1..=99 {
            h.add(v * 10, 1);
        }
        let p50 = h.quantile(0.5).unwrap();
        assert!((480..=500).contains(&p50), "{p50}");
    }

    #[test]
    fn a_round_gives_a_row_per_depth_and_ratios_find_it() {
        let (runs, errors) = measure_round(&[1, 16], 2, 20, None);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(runs.iter().map(|r| (r.round, r.qd)).collect::<Vec<_>>(), [(2, 1), (2, 16)]);
        assert!(ops_s_of(&runs, 2, 16).unwrap() > 0.0);
        assert!(ops_s_of(&runs, 1, 16).is_none());
        let t = floor_rows(&runs);
        assert!(t.lines().count() == 4, "{t}");
    }
}
