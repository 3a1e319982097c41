//! `iopath bench reconnect` (issue 37): the pause each `kill -9` of a
//! device process causes the guest, from the kill to the first completion
//! after it, over `--kills` kills per target.
//!
//! Each target runs the guest's verify workload (every 512-byte block of a
//! file written once with its pattern, then read back and compared, 16 in
//! flight) on a file in a temp dir of the bench's own, sized from a short
//! calibration run so that the window holds the kills, and kills the device
//! process the VMM started every `--every` ([`kills::under_kills`]),
//! noting each kill's CLOCK_MONOTONIC time. A resumed NVMe device process
//! logs the CLOCK_MONOTONIC time of the first completion it posts (once
//! per resume, on the VMM's stderr, which it shares): each kill's pause is
//! from the kill to the first such time after it and before the next kill
//! ([`kills::kill_pauses`]); the goal is judged on these. A kill with none
//! (the window ended first) is counted as unmatched; so does virtio-blk's
//! over vfio-user. vhost-user's backend logs no such time (it resumes from
//! QEMU's or iopath's in-flight region, not state memory): its row has no
//! pause figures. The guest's 32 longest
//! gaps between consecutive completions (its record's `gaps=`, TSC cycles)
//! are a second view ("guest gap"): the `kills` longest, which include the
//! host's own stalls (a run without kills has some, "quiet max"). The VMM's
//! own log of each reconnect is shown beside them. A row fails unless the
//! VMM counted one reconnect per kill, the guest saw no error or mismatch
//! and verified every block, and the file read back holds the pattern.

pub mod kills;

use crate::args::Output;
use anyhow::{anyhow, bail};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The seed of the guest's pattern.
const SEED: u64 = 37;

/// A device process the VMM starts and resumes after its death, on a file backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// NVMe over vfio-user, doorbell=mmio (state memory, proxy reconnect).
    #[value(name = "nvme-vfio-user-mmio")]
    NvmeMmio,
    /// NVMe over vfio-user, doorbell=ioeventfd.
    #[value(name = "nvme-vfio-user-ioeventfd")]
    NvmeIoeventfd,
    /// NVMe over vfio-user, doorbell=shm.
    #[value(name = "nvme-vfio-user-shm")]
    NvmeShm,
    /// NVMe over vfio-user, doorbell=adaptive.
    #[value(name = "nvme-vfio-user-adaptive")]
    NvmeAdaptive,
    /// NVMe over vfio-user, doorbell=bar (BAR0's doorbell page mapped into the guest).
    #[value(name = "nvme-vfio-user-bar")]
    NvmeBar,
    /// NVMe over vfio-user, doorbell=bar-adaptive.
    #[value(name = "nvme-vfio-user-bar-adaptive")]
    NvmeBarAdaptive,
    /// NVMe over vfio-user, doorbell=auto (the default).
    #[value(name = "nvme-vfio-user-auto")]
    NvmeAuto,
    /// virtio-blk over vfio-user (state memory, proxy reconnect).
    #[value(name = "vblk-vfio-user")]
    VblkVfioUser,
    /// virtio-blk over vhost-user (in-flight tracking, frontend reconnect).
    #[value(name = "vblk-vhost-user")]
    VblkVhostUser,
}

impl Target {
    pub const ALL: [Target; 9] = [
        Target::NvmeMmio,
        Target::NvmeIoeventfd,
        Target::NvmeShm,
        Target::NvmeAdaptive,
        Target::NvmeBar,
        Target::NvmeBarAdaptive,
        Target::NvmeAuto,
        Target::VblkVfioUser,
        Target::VblkVhostUser,
    ];

    pub fn name(self) -> String {
        self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
    }

    /// The guest workload that drives it.
    fn workload(self) -> &'static str {
        match self.doorbell() {
            Some(_) => "nvme",
            None => "vblk",
        }
    }

    /// An NVMe target's `doorbell=` (None: virtio-blk).
    fn doorbell(self) -> Option<&'static str> {
        Some(match self {
            Target::NvmeMmio => "mmio",
            Target::NvmeIoeventfd => "ioeventfd",
            Target::NvmeShm => "shm",
            Target::NvmeAdaptive => "adaptive",
            Target::NvmeBar => "bar",
            Target::NvmeBarAdaptive => "bar-adaptive",
            Target::NvmeAuto => "auto",
            Target::VblkVfioUser | Target::VblkVhostUser => return None,
        })
    }

    /// `iopath run --device` for a file of `size_mb` MiB.
    fn spec(self, img: &Path, size_mb: u64) -> String {
        let img = img.display();
        let transport = if self.vfio_user() { "vfio-user" } else { "vhost-user" };
        match self.doorbell() {
            Some(mode) => format!("nvme,doorbell={mode},backend=file:{img},size_mb={size_mb}@{transport}"),
            None => format!("virtio-blk,backend=file:{img},size_mb={size_mb},queues=1@{transport}"),
        }
    }

    /// The VMM's reconnect counter for it (`iopath run`'s device counters).
    fn counter(self) -> &'static str {
        if self == Target::VblkVhostUser {
            "reconnects"
        } else {
            "vfio-user.reconnects"
        }
    }

    fn vfio_user(self) -> bool {
        self != Target::VblkVhostUser
    }

    /// Its device process logs its first completion after each resume
    /// (over vfio-user; vhost-user's backend keeps no state memory).
    fn logs_first_completion(self) -> bool {
        self.vfio_user()
    }
}

/// The vfio-user proxy's bound: a reconnect past `MAX_BURST` within
/// `BURST_WINDOW` (8 within 10 s) stops the run.
const PROXY_BURST: u32 = iopath_protocols::vfio_user::MAX_BURST as u32;
const PROXY_WINDOW: Duration = iopath_protocols::vfio_user::BURST_WINDOW;

/// `iopath bench reconnect`'s options.
#[derive(Args, Debug)]
pub struct ReconnectArgs {
    /// Kills per target; the pause percentiles are over these (the guest keeps its 32 longest gaps).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=32))]
    pub kills: u64,
    /// Time between kills (e.g. 1.5s, 2s). vfio-user reconnects at most 8 times within 10 s,
    /// so NVMe targets need more than 1.25 s (plus the aim, a quarter of it).
    #[arg(long, default_value = "1.5s", value_parser = parse_every)]
    pub every: Duration,
    /// Targets, comma-separated (default: all).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "TARGET,..")]
    pub target: Vec<Target>,
    #[command(flatten)]
    pub out: Output,
}

fn parse_every(s: &str) -> Result<Duration, String> {
    let secs = crate::args::parse_runtime(s)?;
    if secs < 0.2 {
        return Err(format!("{s:?}: a kill at most every 200 ms (a reconnect needs the time)"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// What `bench reconnect` runs.
#[derive(Clone, Debug)]
pub struct ReconnectOptions {
    pub kills: u64,
    pub every: Duration,
    pub targets: Vec<Target>,
    pub progress: bool,
    /// The iopath binary whose `run` the bench starts (the CLI's own).
    pub exe: PathBuf,
}

impl ReconnectArgs {
    pub fn options(&self, exe: PathBuf) -> anyhow::Result<ReconnectOptions> {
        let targets = if self.target.is_empty() {
            Target::ALL.to_vec()
        } else {
            crate::args::each_once("--target", self.target.clone(), |t| t.name())?
        };
        let o = ReconnectOptions { kills: self.kills, every: self.every, targets, progress: !self.out.quiet, exe };
        if o.targets.iter().any(|t| t.vfio_user()) && o.kills > PROXY_BURST as u64 {
            // The 9th kill after the 1st: 8 periods less the aim, with 0.5 s to spare.
            let span = o.every * PROXY_BURST;
            if span < PROXY_WINDOW + o.aim() + Duration::from_millis(500) {
                bail!(
                    "--every {:?}: vfio-user reconnects at most {PROXY_BURST} times within {PROXY_WINDOW:?}, \
                     so {} kills need one every 1.4 s at least",
                    o.every,
                    o.kills
                );
            }
        }
        Ok(o)
    }
}

impl ReconnectOptions {
    /// The last part of each period a kill waits (at most) for the device process to be inside a disk I/O.
    fn aim(&self) -> Duration {
        self.every / 4
    }
}

/// One target's figures.
#[derive(Clone, Debug)]
pub struct Row {
    pub target: String,
    pub size_mb: u64,
    /// Runs under kills: 2 when the first one's window ended before its kills did.
    pub runs: u32,
    pub kills: u64,
    /// Kills that found the device process inside a disk read or write.
    pub aimed: u64,
    pub reconnects: Option<u64>,
    pub errors: Option<u64>,
    pub mismatches: Option<u64>,
    /// The file read back held the pattern (None: not checked).
    pub file_ok: Option<bool>,
    pub tsc_khz: Option<u64>,
    /// Each kill's pause, ms, in kill order: to the device's first
    /// completion after it (None: none came before the window ended or the
    /// next kill). Empty: the device logs no such time (vhost-user).
    pub kill_pause_ms: Vec<Option<f64>>,
    /// The `kills` longest gaps between the guest's completions, ms, ascending.
    pub gap_ms: Vec<f64>,
    /// The longest gap between completions of a short run without kills, ms.
    pub quiet_gap_ms: f64,
    /// The VMM log's time of each reconnect, ms, ascending.
    pub vmm_ms: Vec<f64>,
    /// Why the row failed (empty: it passed).
    pub failures: Vec<String>,
}

impl Default for Row {
    fn default() -> Row {
        Row {
            target: String::new(),
            size_mb: 0,
            runs: 0,
            kills: 0,
            aimed: 0,
            reconnects: None,
            errors: None,
            mismatches: None,
            file_ok: None,
            tsc_khz: None,
            kill_pause_ms: Vec::new(),
            gap_ms: Vec::new(),
            quiet_gap_ms: f64::NAN,
            vmm_ms: Vec::new(),
            failures: Vec::new(),
        }
    }
}

impl Row {
    /// Issue 37's goal, on the kills' own pauses: p50 <= 100 ms, p99 <= 1 s
    /// (None: no pause figures).
    pub fn goal_met(&self) -> Option<bool> {
        (!self.pauses().is_empty()).then(|| self.p(50.0) <= 100.0 && self.p(99.0) <= 1000.0)
    }

    /// The matched kills' pauses, ms, ascending.
    pub fn pauses(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.kill_pause_ms.iter().flatten().copied().collect();
        v.sort_by(f64::total_cmp);
        v
    }

    /// Kills with no completion after them (None: the device logs none).
    pub fn unmatched(&self) -> Option<usize> {
        (!self.kill_pause_ms.is_empty()).then(|| self.kill_pause_ms.iter().filter(|p| p.is_none()).count())
    }

    fn p(&self, q: f64) -> f64 {
        kills::percentile(&self.pauses(), q)
    }

    fn gap(&self, q: f64) -> f64 {
        kills::percentile(&self.gap_ms, q)
    }
}

/// Every target's row.
#[derive(Clone, Debug)]
pub struct Report {
    pub kills: u64,
    pub every: Duration,
    pub rows: Vec<Row>,
}

/// A directory of the bench's own under the system temp dir, removed with
/// everything in it when dropped: only the bench's files are ever there.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Scratch> {
        let base = std::env::temp_dir();
        for n in 0..100 {
            let d = base.join(format!("iopath-bench-reconnect-{}-{n}", std::process::id()));
            match std::fs::create_dir(&d) {
                Ok(()) => return Ok(Scratch(d)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => bail!("creating {}: {e}", d.display()),
            }
        }
        bail!("no free temp dir name under {}", base.display())
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A new file of `size_mb` MiB (sparse) in the scratch dir.
fn new_file(dir: &Scratch, name: &str, size_mb: u64) -> anyhow::Result<PathBuf> {
    let p = dir.0.join(name);
    let f = std::fs::OpenOptions::new().write(true).create_new(true).open(&p)?;
    f.set_len(size_mb << 20)?;
    Ok(p)
}

/// A run of the verify workload on `t` without kills: its MiB per second
/// and its longest gap between completions in ms (the host's own noise,
/// beside which the pauses the kills cause are read).
fn calibrate(o: &ReconnectOptions, t: Target, dir: &Scratch) -> anyhow::Result<(f64, f64)> {
    const MB: u64 = 4;
    let img = new_file(dir, &format!("{}-calibrate.img", t.name()), MB)?;
    let plan = kills::Plan { max_kills: Some(0), timeout: Duration::from_secs(120), ..plan(o, t, &img, MB) };
    let out = kills::under_kills(&plan, kills::spawned_backend, |_| ())?;
    std::fs::remove_file(&img)?;
    if !out.success {
        bail!("the calibration run failed:\n{}", kills::tail(&out.stderr));
    }
    let khz = kills::tsc_khz(&out.stderr).ok_or_else(|| anyhow!("the run printed no TSC frequency"))?;
    let g = out.guest(t.workload(), MB)?;
    if g.errors + g.mismatches > 0 {
        bail!("the calibration run, without kills, saw errors: {}", g.record);
    }
    let cycles: u64 = crate::record::fields(&g.record)
        .get("cycles")
        .and_then(|c| c.parse().ok())
        .filter(|&c| c > 0)
        .ok_or_else(|| anyhow!("the calibration run's record has no cycles: {}", g.record))?;
    let max_gap = g.gaps.first().map_or(f64::NAN, |&c| c as f64 / khz as f64);
    Ok((MB as f64 / (cycles as f64 / (khz as f64 * 1e3)), max_gap))
}

fn plan(o: &ReconnectOptions, t: Target, img: &Path, size_mb: u64) -> kills::Plan {
    kills::Plan {
        exe: o.exe.clone(),
        workload: t.workload().into(),
        spec: t.spec(img, size_mb),
        size_mb,
        seed: SEED,
        every: o.every,
        aim: o.aim(),
        max_kills: Some(o.kills),
        timeout: Duration::from_secs(600),
    }
}

/// The VMM log's reconnect times, ms: vfio-user's "reconnected in 12.3ms",
/// vhost-user's "first completion 4.5 ms after the death".
pub fn vmm_times(stderr: &str) -> Vec<f64> {
    let mut v: Vec<f64> = stderr
        .lines()
        .filter_map(|l| {
            if let Some(d) = l.split(": reconnected in ").nth(1) {
                return debug_ms(d.split(' ').next()?);
            }
            l.split("first completion ").nth(1)?.split(" ms after the death").next()?.parse().ok()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v
}

/// A `Duration`'s `{:?}` (`12.3ms`, `950µs`, `1.2s`) in ms.
fn debug_ms(d: &str) -> Option<f64> {
    let unit = d.find(|c: char| c.is_alphabetic() || c == 'µ')?;
    let v: f64 = d[..unit].parse().ok()?;
    Some(match &d[unit..] {
        "ns" => v / 1e6,
        "µs" => v / 1e3,
        "ms" => v,
        "s" => v * 1e3,
        _ => return None,
    })
}

/// One target: calibrate, size the file, run under kills, judge.
/// `step(n)`: n progress steps done (see [`steps`]).
fn run_target(o: &ReconnectOptions, t: Target, step: &mut dyn FnMut(u64)) -> anyhow::Result<Row> {
    let dir = Scratch::new()?;
    let (rate, quiet_gap_ms) = calibrate(o, t, &dir)?;
    step(2);
    // The window must outlast the last kill: the kills' span, 3 s more, half again to spare
    // (the pauses themselves only lengthen it). A host that got slower than the calibration
    // saw may still end it first: then once more with twice the file.
    let want = (o.every * o.kills as u32 + Duration::from_secs(3)).as_secs_f64() * 1.5;
    let mut size_mb = ((rate * want).ceil() as u64).clamp(8, 16 << 10);
    let mut runs = 0;
    let (img, out) = loop {
        runs += 1;
        log::info!("{}: {rate:.1} MiB/s of verify: a {size_mb} MiB file", t.name());
        let img = new_file(&dir, &format!("{}-{runs}.img", t.name()), size_mb)?;
        let out = kills::under_kills(&plan(o, t, &img, size_mb), kills::spawned_backend, |_| step(1))?;
        if out.kills >= o.kills || !out.success || runs == 2 || size_mb >= 16 << 10 {
            break (img, out);
        }
        std::fs::remove_file(&img)?;
        size_mb *= 2;
    };
    let mut row =
        Row { target: t.name(), size_mb, runs, kills: out.kills, aimed: out.aimed, quiet_gap_ms, ..Row::default() };
    let f = &mut row.failures;
    if out.kills < o.kills {
        f.push(format!("only {} of {} kills landed in the guest's window", out.kills, o.kills));
    }
    if !out.success {
        f.push(format!("the run failed: {}", kills::tail(&out.stderr).lines().last().unwrap_or("")));
    }
    let reconnects = kills::counter(&out.stderr, t.counter());
    row.reconnects = Some(reconnects);
    if reconnects != out.kills {
        f.push(format!("{reconnects} reconnects for {} kills", out.kills));
    }
    row.tsc_khz = kills::tsc_khz(&out.stderr);
    match out.guest(t.workload(), size_mb) {
        Ok(g) => {
            row.errors = Some(g.errors);
            row.mismatches = Some(g.mismatches);
            if g.errors + g.mismatches > 0 {
                f.push(format!("the guest saw {} errors, {} mismatches", g.errors, g.mismatches));
            }
            match row.tsc_khz {
                Some(khz) => {
                    row.gap_ms = g.gaps.iter().take(o.kills as usize).map(|&c| c as f64 / khz as f64).collect();
                    row.gap_ms.sort_by(f64::total_cmp);
                }
                None => f.push("the run printed no TSC frequency".into()),
            }
        }
        Err(e) => f.push(format!("guest: {e}")),
    }
    row.vmm_ms = vmm_times(&out.stderr);
    if t.logs_first_completion() {
        row.kill_pause_ms = kills::kill_pauses(&out.kill_ns, &kills::first_completions(&out.stderr));
    }
    match kills::check_file(&img, size_mb, SEED) {
        Ok(()) => row.file_ok = Some(true),
        Err(e) => {
            row.file_ok = Some(false);
            row.failures.push(e.to_string());
        }
    }
    step(1);
    Ok(row)
}

/// Progress steps per target: the calibration run (2, about two kill
/// periods), each kill (1), the window's end and the file read back (1).
fn steps(o: &ReconnectOptions) -> u64 {
    o.kills + 3
}

/// Runs every target in turn; a target that could not run is a failed row.
/// Ctrl-C stops it with [`crate::interrupt::Interrupted`], its files removed.
pub fn run_reconnect(o: &ReconnectOptions) -> anyhow::Result<Report> {
    let pb = crate::progress::bar(o.progress, o.targets.len() as u64 * steps(o));
    let mut rows = Vec::new();
    for (i, &t) in o.targets.iter().enumerate() {
        pb.set_position(i as u64 * steps(o));
        pb.set_message(format!("{}: {} kills every {:?}", t.name(), o.kills, o.every));
        let mut step = |n| pb.inc(n);
        let row = match run_target(o, t, &mut step) {
            Ok(r) => r,
            Err(e) => {
                let e = crate::interrupt::or_interrupted(e);
                if e.is::<crate::interrupt::Interrupted>() {
                    return Err(e);
                }
                Row { target: t.name(), failures: vec![format!("{e:#}")], ..Row::default() }
            }
        };
        if o.progress {
            pb.suspend(|| eprintln!("{}: {}", row.target, row.summary()));
        }
        rows.push(row);
    }
    pb.finish_and_clear();
    Ok(Report { kills: o.kills, every: o.every, rows })
}

fn ms(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "-".into()
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or("-".into(), |v| v.to_string())
}

impl Row {
    fn summary(&self) -> String {
        let verdict =
            if self.failures.is_empty() { "ok".to_string() } else { format!("FAILED: {}", self.failures.join("; ")) };
        format!(
            "kills={} reconnects={} pause p50={} p99={} max={} ms (unmatched {}); guest gap p50={} max={} ms; {verdict}",
            self.kills,
            opt(self.reconnects),
            ms(self.p(50.0)),
            ms(self.p(99.0)),
            ms(self.p(100.0)),
            opt(self.unmatched().map(|n| n as u64)),
            ms(self.gap(50.0)),
            ms(self.gap(100.0))
        )
    }
}

impl Report {
    /// Targets that failed, each with its reasons.
    pub fn errors(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| !r.failures.is_empty())
            .map(|r| format!("{}: {}", r.target, r.failures.join("; ")))
            .collect()
    }

    pub fn table(&self) -> String {
        let mut s = format!(
            "kill -9 of the device process: {} kills, one every {:?}; pause = each kill to the device's first \
             completion after it (CLOCK_MONOTONIC)\n",
            self.kills, self.every
        );
        let head = |c: [&str; 17]| {
            format!(
                "{:<25} {:>5} {:>5} {:>5} {:>8} {:>4} {:>8} {:>8} {:>8} {:>5} {:>4} {:>9} {:>9} {:>9} {:>8} {:>8}  {}\n",
                c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13], c[14], c[15], c[16]
            )
        };
        s += &head([
            "target",
            "MiB",
            "kills",
            "recon",
            "err/mism",
            "file",
            "p50 ms",
            "p99 ms",
            "max ms",
            "unmat",
            "goal",
            "gap p50",
            "gap max",
            "quiet max",
            "vmm p50",
            "vmm max",
            "status",
        ]);
        for r in &self.rows {
            let em = match (r.errors, r.mismatches) {
                (Some(e), Some(m)) => format!("{e}/{m}"),
                _ => "-".into(),
            };
            let file = match r.file_ok {
                Some(true) => "ok",
                Some(false) => "BAD",
                None => "-",
            };
            let status =
                if r.failures.is_empty() { "ok".to_string() } else { format!("FAILED: {}", r.failures.join("; ")) };
            let goal = match r.goal_met() {
                Some(true) => "met",
                Some(false) => "NO",
                None => "-",
            };
            s += &head([
                &r.target,
                &r.size_mb.to_string(),
                &r.kills.to_string(),
                &opt(r.reconnects),
                &em,
                file,
                &ms(r.p(50.0)),
                &ms(r.p(99.0)),
                &ms(r.p(100.0)),
                &opt(r.unmatched().map(|n| n as u64)),
                goal,
                &ms(r.gap(50.0)),
                &ms(r.gap(100.0)),
                &ms(r.quiet_gap_ms),
                &ms(kills::percentile(&r.vmm_ms, 50.0)),
                &ms(kills::percentile(&r.vmm_ms, 100.0)),
                &status,
            ]);
        }
        s += "goal (issue 37): pause p50 <= 100 ms, p99 <= 1000 ms, over the matched kills; unmat: kills with no \
              completion after them before the next kill or the window's end (not in the percentiles). A device that \
              logs no first completion (vhost-user) has no pause figures.\nguest gap: the guest's longest gaps \
              between completions, as many as kills (host stalls included); quiet max: the longest of a short run \
              without kills (the host's own stalls).\nvmm: the VMM log's time per reconnect (vfio-user: death seen \
              to session replayed; vhost-user: death seen to first completion). status: reconnects = kills, no guest \
              error or mismatch, every block verified, the file read back holds the pattern\n";
        s
    }

    pub fn json(&self) -> Value {
        let num = |v: f64| if v.is_finite() { json!(v) } else { Value::Null };
        let rows: Vec<Value> = self
            .rows
            .iter()
            .map(|r| {
                json!({
                    "target": r.target,
                    "size_mb": r.size_mb,
                    "runs": r.runs,
                    "kills": r.kills,
                    "aimed": r.aimed,
                    "reconnects": r.reconnects,
                    "errors": r.errors,
                    "mismatches": r.mismatches,
                    "file_ok": r.file_ok,
                    "tsc_khz": r.tsc_khz,
                    "pause_ms": {"p50": num(r.p(50.0)), "p99": num(r.p(99.0)), "max": num(r.p(100.0)), "samples": r.pauses()},
                    "kill_pause_ms": r.kill_pause_ms,
                    "unmatched_kills": r.unmatched(),
                    "goal_met": r.goal_met(),
                    "guest_gap_ms": {"p50": num(r.gap(50.0)), "max": num(r.gap(100.0)), "samples": r.gap_ms},
                    "quiet_max_gap_ms": num(r.quiet_gap_ms),
                    "vmm_reconnect_ms": {"p50": num(kills::percentile(&r.vmm_ms, 50.0)), "max": num(kills::percentile(&r.vmm_ms, 100.0)), "samples": r.vmm_ms},
                    "failed": !r.failures.is_empty(),
                    "failures": r.failures,
                })
            })
            .collect();
        json!({
            "schema_version": crate::guard::JSON_SCHEMA_VERSION,
            "benchmark": "reconnect",
            "options": {"kills": self.kills, "every_ms": self.every.as_millis() as u64},
            "rows": rows,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_name_their_device_specs() {
        let img = Path::new("/d/x.img");
        assert_eq!(
            Target::NvmeAdaptive.spec(img, 8),
            "nvme,doorbell=adaptive,backend=file:/d/x.img,size_mb=8@vfio-user"
        );
        assert_eq!(Target::NvmeMmio.name(), "nvme-vfio-user-mmio");
        assert_eq!(
            Target::NvmeBarAdaptive.spec(img, 8),
            "nvme,doorbell=bar-adaptive,backend=file:/d/x.img,size_mb=8@vfio-user"
        );
        assert_eq!(Target::VblkVfioUser.spec(img, 8), "virtio-blk,backend=file:/d/x.img,size_mb=8,queues=1@vfio-user");
        assert_eq!(Target::VblkVfioUser.counter(), "vfio-user.reconnects");
        assert!(Target::VblkVfioUser.logs_first_completion() && !Target::VblkVhostUser.logs_first_completion());
        assert_eq!(
            Target::VblkVhostUser.spec(img, 8),
            "virtio-blk,backend=file:/d/x.img,size_mb=8,queues=1@vhost-user"
        );
        assert_eq!(
            (Target::VblkVhostUser.counter(), Target::NvmeShm.counter()),
            ("reconnects", "vfio-user.reconnects")
        );
    }

    #[test]
    fn the_vmm_log_times_are_read_from_both_transports() {
        let log = "nvme: reconnected in 12.5ms (cause known after 1ms) after x\n\
                   vu: reconnect 2: first completion 4.5 ms after the death\nnvme: reconnected in 950µs (c) after y\n";
        assert_eq!(vmm_times(log), vec![0.95, 4.5, 12.5]);
    }

    #[derive(clap::Parser, Debug)]
    struct T {
        #[command(flatten)]
        a: ReconnectArgs,
    }

    fn opts(args: &[&str]) -> anyhow::Result<ReconnectOptions> {
        use clap::Parser;
        let t = T::try_parse_from([&["reconnect"], args].concat()).map_err(|e| anyhow!("{e}"))?;
        t.a.options(PathBuf::from("/x/iopath"))
    }

    #[test]
    fn options_take_kills_every_and_targets_and_refuse_a_burst_vfio_user_stops() {
        let o = opts(&[]).unwrap();
        assert_eq!((o.kills, o.every, o.targets.len()), (20, Duration::from_millis(1500), 9));
        let o = opts(&["--kills", "2", "--every", "500ms", "--target", "nvme-vfio-user-shm,vblk-vhost-user"]).unwrap();
        assert_eq!((o.kills, o.targets), (2, vec![Target::NvmeShm, Target::VblkVhostUser]));
        // 20 kills a second apart: the 9th vfio-user reconnect within 10 s would stop the run.
        assert!(opts(&["--every", "1s"]).unwrap_err().to_string().contains("at most 8"));
        assert!(opts(&["--every", "1s", "--target", "vblk-vhost-user"]).is_ok());
        assert!(opts(&["--kills", "33"]).is_err(), "the guest keeps 32 gaps");
        assert!(opts(&["--kills", "0"]).is_err());
        assert!(opts(&["--every", "100ms"]).is_err());
        assert!(opts(&["--target", "nvme-vfio-user-bar-adaptive,nvme-vfio-user-auto"]).is_ok());
        assert!(opts(&["--target", "nvme-vfio-user-doorbell"]).is_err());
        assert!(opts(&["--target", "vblk-vhost-user,vblk-vhost-user"]).is_err());
    }

    #[test]
    fn a_row_that_failed_says_why_in_the_table_and_the_json() {
        let ok = Row {
            target: "nvme-vfio-user-shm".into(),
            kills: 2,
            reconnects: Some(2),
            errors: Some(0),
            mismatches: Some(0),
            file_ok: Some(true),
            kill_pause_ms: vec![Some(30.0), Some(10.0), None],
            gap_ms: vec![12.0, 900.0],
            ..Row::default()
        };
        let bad =
            Row { target: "vblk-vhost-user".into(), failures: vec!["1 reconnects for 2 kills".into()], ..ok.clone() };
        let r = Report { kills: 2, every: Duration::from_secs(2), rows: vec![ok, bad] };
        let t = r.table();
        assert!(t.contains("FAILED: 1 reconnects for 2 kills"), "{t}");
        let j = r.json();
        assert_eq!(j["rows"][0]["pause_ms"]["max"], 30.0);
        assert_eq!(j["rows"][0]["pause_ms"]["samples"], json!([10.0, 30.0]));
        assert_eq!(j["rows"][0]["kill_pause_ms"], json!([30.0, 10.0, null]));
        assert_eq!(j["rows"][0]["unmatched_kills"], 1);
        assert_eq!(j["rows"][0]["guest_gap_ms"]["max"], 900.0);
        assert_eq!(j["rows"][0]["goal_met"], true, "judged on the kills' pauses, not the guest's gaps");
        let none = Row { kill_pause_ms: vec![], ..r.rows[0].clone() };
        assert_eq!((none.unmatched(), none.goal_met()), (None, None));
        assert_eq!((j["rows"][0]["failed"].clone(), j["rows"][1]["failed"].clone()), (json!(false), json!(true)));
        assert_eq!(r.errors().len(), 1);
    }
}
