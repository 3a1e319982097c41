//! `iopath bench nvme`: the guest's polled NVMe driver (nvmeperf) against
//! iopath's NVMe controller in each doorbell mode, and against QEMU's
//! `-device nvme` on `null-co` in the same run (`--vs qemu`), interleaved
//! round by round. Each iopath run is checked against the controller's own
//! counters (every guest I/O is a controller command; every MMIO doorbell
//! write the guest made is one the controller saw) and the VMM's exit
//! counters give exits per I/O.

use crate::cpu::{Window, NVME_DEVICE_THREADS};
use crate::host::{host_info, HostInfo};
use crate::stats::summarize;
use indicatif::{ProgressBar, ProgressStyle};
use iopath_devices::nvme::backend::BackendKind;
use iopath_devices::nvme::{DoorbellMode, NvmeConfig};
use iopath_devices::DeviceConfig;
use iopath_protocols::attach::{instantiate, Device, DeviceSpec, Endpoint, Programs};
use iopath_protocols::Transport;
use iopath_vmm::{run, VmConfig};
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::Duration;

#[derive(Clone, Debug, Serialize)]
pub struct Job {
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
    pub queues: u32,
    pub verify: bool,
}

impl Job {
    pub fn label(&self) -> String {
        let bs = if self.bs.is_multiple_of(1024) { format!("{}k", self.bs / 1024) } else { format!("{}", self.bs) };
        if self.verify {
            format!("verify {bs} qd{} x{}", self.iodepth, self.queues)
        } else {
            format!("{} {bs} qd{} x{}", self.rw, self.iodepth, self.queues)
        }
    }
}

fn as_string<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn as_strings<T: std::fmt::Display, S: serde::Serializer>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|x| x.to_string()))
}

fn transport_name<S: serde::Serializer>(t: &Option<&'static dyn Transport>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(t.name()),
        None => s.serialize_none(),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct NvmeOptions {
    pub jobs: Vec<Job>,
    /// Doorbell modes of iopath's controller to run.
    #[serde(serialize_with = "as_strings")]
    pub doorbells: Vec<DoorbellMode>,
    /// Poller counts of the controller to run (`pollers=`); more than one only
    /// in the modes that serve it (shm, bar, adaptive): other combinations are skipped.
    pub pollers: Vec<u8>,
    #[serde(serialize_with = "as_string")]
    pub backend: BackendKind,
    /// The controller in a device process over this transport (None: in the VMM).
    #[serde(serialize_with = "transport_name")]
    pub transport: Option<&'static dyn Transport>,
    pub lba: u32,
    pub time_ms: u64,
    pub rounds: u32,
    pub vs_qemu: bool,
    pub mem_mb: u64,
    pub timeout_s: u64,
    pub progress: bool,
    /// Busy threads run during every measured run, QEMU's included (`--contend N`).
    pub contend: u32,
    /// Length of each ring-floor run (`crate::floor`), per queue depth and round.
    pub floor_ms: u64,
    #[serde(skip)]
    pub iopath_exe: Option<std::path::PathBuf>,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            jobs: vec![
                Job { rw: "randread".into(), bs: 512, iodepth: 16, queues: 1, verify: false },
                Job { rw: "randread".into(), bs: 4096, iodepth: 1, queues: 1, verify: false },
            ],
            doorbells: vec![
                DoorbellMode::Shm,
                DoorbellMode::Bar,
                DoorbellMode::Ioeventfd,
                DoorbellMode::Adaptive,
                DoorbellMode::Mmio,
            ],
            pollers: vec![1],
            backend: BackendKind::Ram,
            transport: None,
            lba: 512,
            time_ms: 2000,
            rounds: 1,
            vs_qemu: false,
            mem_mb: 256,
            timeout_s: 120,
            progress: true,
            contend: 0,
            floor_ms: 300,
            iopath_exe: None,
        }
    }
}

/// One guest run's `@nvme` record, with the host's view.
#[derive(Clone, Debug, Serialize)]
pub struct NvmeRun {
    pub target: String,
    /// The controller's poller threads (1 for QEMU).
    pub pollers: u8,
    /// I/O commands each poller served (`poller{k}.ios`), with several.
    pub poller_ios: Vec<u64>,
    pub job: usize,
    pub round: u32,
    pub ios: u64,
    pub iops: f64,
    pub mb_s: f64,
    pub lat_avg_ns: f64,
    pub p50_ns: f64,
    pub p90_ns: f64,
    pub p99_ns: f64,
    pub p999_ns: f64,
    pub errors: u64,
    pub mismatches: Option<u64>,
    /// MMIO doorbell writes the guest made for I/O queues.
    pub io_doorbell_writes: u64,
    /// VMM exits of the whole run (setup included), where the VMM is iopath's.
    pub vm_exits: Option<u64>,
    pub exits_per_io: Option<f64>,
    pub routing: String,
    pub routing_ok: bool,
    /// Device threads (nvme-poller, nvme-adaptive, nvme-ioeventfd, nvme-uring) seen in the
    /// measured window; none in mmio mode without io_uring, and for QEMU.
    pub device_threads: usize,
    /// Their CPU time from the `@nvme-ctrl` line to the `@nvme` record, per I/O.
    pub cpu_ns_per_io: Option<f64>,
    /// Their CPU share (100 = one core) in a pause with no I/O after the record.
    pub idle_cpu_pct: Option<f64>,
    /// IOPS over the ring floor's ops/s at the job's queue depth in the same round.
    pub floor_ratio: Option<f64>,
}

/// The pause after a run's record in which device threads' idle CPU is measured.
const IDLE_WINDOW: Duration = Duration::from_millis(200);

/// Contenders for one run: they stop by themselves well after its timeout.
fn contenders(o: &NvmeOptions) -> anyhow::Result<crate::contend::Contention> {
    crate::contend::Contention::start(o.contend, Duration::from_secs(o.timeout_s.saturating_add(60)))
        .map_err(|e| anyhow::anyhow!("cannot start {} contenders: {e}", o.contend))
}

pub struct NvmeResult {
    pub host: HostInfo,
    pub options: NvmeOptions,
    pub tsc_khz: u64,
    pub runs: Vec<NvmeRun>,
    /// The ring floor, measured at the start of every round.
    pub floor: Vec<crate::floor::FloorRun>,
    pub errors: Vec<String>,
}

/// The ring floor's queue depth for a job: all its outstanding I/Os.
fn floor_qd(j: &Job) -> u32 {
    j.iodepth.saturating_mul(j.queues).clamp(1, crate::floor::MAX_QD)
}

fn cmdline(j: &Job, o: &NvmeOptions, tsc_khz: u64) -> String {
    format!(
        "workload=nvme rw={} bs={} iodepth={} queues={} time_ms={} verify={} tsc_khz={tsc_khz}",
        j.rw, j.bs, j.iodepth, j.queues, o.time_ms, j.verify as u8
    )
}

fn to_run(target: &str, job: usize, round: u32, j: &Job, lines: &[String], tsc_khz: u64) -> anyhow::Result<NvmeRun> {
    let f = crate::record::find_record(lines, "nvme").ok_or_else(|| {
        let errs: Vec<&String> = lines.iter().filter(|l| l.contains("error") || l.starts_with("@fault")).collect();
        anyhow::anyhow!("no @nvme record; {errs:?}")
    })?;
    let g = |k: &str| {
        f.get(k).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| anyhow::anyhow!("@nvme record without {k}"))
    };
    let ios = g("ios")?;
    let cycles = g("cycles")?.max(1);
    let secs = cycles as f64 / (tsc_khz as f64 * 1000.0);
    let ns = |c: u64| c as f64 * 1e6 / tsc_khz as f64;
    Ok(NvmeRun {
        target: target.into(),
        pollers: 1,
        poller_ios: Vec::new(),
        job,
        round,
        ios,
        iops: ios as f64 / secs,
        mb_s: ios as f64 * j.bs as f64 / secs / 1e6,
        lat_avg_ns: ns(g("lat_sum")?) / ios.max(1) as f64,
        p50_ns: ns(g("p50")?),
        p90_ns: ns(g("p90")?),
        p99_ns: ns(g("p99")?),
        p999_ns: ns(g("p999")?),
        errors: g("errors")?,
        mismatches: g("mismatches").ok(),
        io_doorbell_writes: g("io_doorbell_writes").unwrap_or(0),
        vm_exits: None,
        exits_per_io: None,
        routing: String::new(),
        routing_ok: true,
        device_threads: 0,
        cpu_ns_per_io: None,
        idle_cpu_pct: None,
        floor_ratio: None,
    })
}

pub fn run_nvme(o: &NvmeOptions) -> anyhow::Result<NvmeResult> {
    let qemu = if o.vs_qemu { Some(crate::qemu::find()?) } else { None };
    let tsc_khz = crate::exits::tsc_khz_of_host()?;
    let host = host_info(tsc_khz);
    let image = iopath_guest::image_file()?;
    let progs = Programs {
        iopath: match &o.iopath_exe {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        },
        qemu: qemu.clone(),
        serve_args: Vec::new(),
    };
    // (mode, pollers) pairs the controller serves.
    let combos: Vec<(DoorbellMode, u8)> = o
        .doorbells
        .iter()
        .flat_map(|&db| o.pollers.iter().map(move |&p| (db, p)))
        .filter(|&(db, p)| p == 1 || matches!(db, DoorbellMode::Shm | DoorbellMode::Bar | DoorbellMode::Adaptive))
        .collect();
    let per_round = o.jobs.len() as u64 * (combos.len() as u64 + qemu.is_some() as u64);
    let pb = if o.progress { ProgressBar::new(per_round * o.rounds as u64) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "),
    );
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(o.timeout_s);
    let mut floor = Vec::new();
    for round in 0..o.rounds {
        // The ring floor first, in this round, at the jobs' queue depths.
        pb.set_message(format!("round {}/{} ring floor", round + 1, o.rounds));
        let mut depths: Vec<u32> = o.jobs.iter().map(floor_qd).collect();
        depths.sort_unstable();
        depths.dedup();
        let (f, e) = crate::floor::measure_round(&depths, round, o.floor_ms, None);
        floor.extend(f);
        errors.extend(e);
        for (ji, j) in o.jobs.iter().enumerate() {
            for (db, pollers) in &combos {
                // One poller keeps the plain name; more show in it.
                let name = if *pollers == 1 { format!("iopath-{db}") } else { format!("iopath-{db}-p{pollers}") };
                let target = match o.transport.map(|t| t.name()) {
                    Some(t) => format!("{name}@{t}"),
                    None => name,
                };
                pb.set_message(format!("round {}/{} {} {target}", round + 1, o.rounds, j.label()));
                let config = NvmeConfig {
                    doorbell: *db,
                    backend: o.backend.clone(),
                    lba_size: o.lba,
                    pollers: *pollers,
                    ..Default::default()
                };
                let spec = DeviceSpec {
                    device: Device::Model(DeviceConfig::Nvme(config)),
                    remote: o.transport.map(|t| (t, Endpoint::Spawn)),
                };
                let r = (|| -> anyhow::Result<NvmeRun> {
                    let _contention = contenders(o)?;
                    let window = Window::new(NVME_DEVICE_THREADS, "@nvme-ctrl ", "@nvme ", IDLE_WINDOW);
                    let w = window.clone();
                    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &cmdline(j, o, tsc_khz));
                    cfg.devices = vec![instantiate(&spec, &progs)?];
                    cfg.mem_size = o.mem_mb << 20;
                    cfg.timeout = timeout;
                    cfg.on_line = Some(Box::new(move |l| w.on_line(l)));
                    let rep = run(cfg)?;
                    let mut r = to_run(&target, ji, round, j, &rep.lines, tsc_khz)?;
                    r.pollers = *pollers;
                    if let Some(w) = window.result().filter(|w| w.threads > 0) {
                        r.device_threads = w.threads;
                        r.cpu_ns_per_io = Some(w.busy_ns as f64 / r.ios.max(1) as f64);
                        r.idle_cpu_pct = Some(w.idle_pct);
                    }
                    let dev = rep.devices.first().ok_or_else(|| anyhow::anyhow!("no device report"))?;
                    let c = |n: &str| dev.counters.iter().find(|c| c.name == n).map(|c| c.value);
                    let exits = rep.exits.mmio_write + rep.exits.mmio_read + rep.exits.io_out + rep.exits.io_in;
                    r.vm_exits = Some(exits);
                    if *pollers > 1 {
                        r.poller_ios = (0..*pollers).filter_map(|k| c(&format!("poller{k}.ios"))).collect();
                    }
                    r.exits_per_io = Some(exits as f64 / r.ios.max(1) as f64);
                    let (cmds, dbw, admin) = (c("io.commands"), c("doorbell.writes"), c("admin.commands"));
                    // The guest's I/O doorbell writes either exited (the
                    // controller saw them as MMIO) or were KVM ioeventfd kicks.
                    let io_exits = dbw.zip(admin).map(|(d, a)| d.saturating_sub(2 * a));
                    let kicks = c("ioeventfd.kicks").unwrap_or(0);
                    r.routing = format!(
                        "controller io.commands={} of {} guest I/Os; guest doorbell writes {} = {} exits + {kicks} ioeventfd kicks",
                        cmds.map_or("?".into(), |v| v.to_string()),
                        r.ios,
                        r.io_doorbell_writes,
                        io_exits.map_or("?".into(), |v| v.to_string()),
                    );
                    // bar: the guest's doorbell stores land in the page mapped over BAR0, so
                    // none of them may reach the controller as an exit or a kick.
                    // A transport without ioeventfds (ioeventfd) or shared BAR pages (bar) carries
                    // these doorbells as messages: checked, and labelled, as exits.
                    let exits_only = o.transport.and_then(|t| match db {
                        DoorbellMode::Ioeventfd | DoorbellMode::Adaptive => {
                            (!t.announces_ioeventfds()).then_some("ioeventfds")
                        }
                        DoorbellMode::Bar => (!t.shares_bar_pages()).then_some("shared BAR pages"),
                        _ => None,
                    });
                    if let (Some(what), Some(t)) = (exits_only, o.transport) {
                        r.routing = format!("exits ({} has no {what}): {}", t.name(), r.routing);
                    }
                    let bar_page = *db == DoorbellMode::Bar && exits_only.is_none();
                    let dbs_ok = bar_page || io_exits.map(|x| x + kicks) == Some(r.io_doorbell_writes);
                    let want_exits =
                        if *db == DoorbellMode::Mmio || exits_only.is_some() { r.io_doorbell_writes } else { 0 };
                    r.routing_ok = cmds == Some(r.ios) && dbs_ok && io_exits == Some(want_exits);
                    if rep.status != 1 {
                        anyhow::bail!("guest exit status {}: {}", rep.status, r.routing);
                    }
                    Ok(r)
                })();
                match r {
                    Ok(r) => runs.push(r),
                    Err(e) => errors.push(format!("{target} {} round {round}: {e}", j.label())),
                }
                pb.inc(1);
            }
            if let Some(q) = &qemu {
                pb.set_message(format!("round {}/{} {} qemu", round + 1, o.rounds, j.label()));
                let drive = "driver=null-co,size=64M,if=none,id=nvm0";
                let args = crate::qemu::nvme_args(&image, &cmdline(j, o, tsc_khz), o.mem_mb, drive, o.lba);
                let qr = contenders(o).and_then(|_c| crate::qemu::run_args(q, args, None, timeout, |_| {}));
                match qr {
                    Ok(qr) => match to_run("qemu", ji, round, j, &qr.lines, tsc_khz) {
                        Ok(mut r) => {
                            r.routing = "QEMU nvme on null-co".into();
                            r.routing_ok = qr.status == Some(1);
                            runs.push(r)
                        }
                        Err(e) => {
                            errors.push(format!("qemu {} round {round}: {e}; stderr: {}", j.label(), qr.stderr.trim()))
                        }
                    },
                    Err(e) => errors.push(format!("qemu {} round {round}: {e}", j.label())),
                }
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    for r in runs.iter_mut() {
        let f = crate::floor::ops_s_of(&floor, r.round, floor_qd(&o.jobs[r.job]));
        r.floor_ratio = f.map(|f| r.iops / f);
    }
    for r in &runs {
        if !r.routing_ok {
            errors.push(format!("{} job {}: routing wrong: {}", r.target, r.job, r.routing));
        }
        if r.errors > 0 || r.mismatches.unwrap_or(0) > 0 {
            errors.push(format!("{} job {}: {} I/O errors, {:?} mismatches", r.target, r.job, r.errors, r.mismatches));
        }
    }
    Ok(NvmeResult { host, options: o.clone(), tsc_khz, runs, floor, errors })
}

fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else {
        format!("{:.1} k", v / 1e3)
    }
}

fn fmt_ns(v: f64) -> String {
    if v >= 1000.0 {
        format!("{:.2} us", v / 1000.0)
    } else {
        format!("{v:.0} ns")
    }
}

impl NvmeResult {
    /// (job, target) -> runs, in first-seen order.
    fn groups(&self) -> Vec<((usize, String), Vec<&NvmeRun>)> {
        let mut g: Vec<((usize, String), Vec<&NvmeRun>)> = Vec::new();
        for r in &self.runs {
            let k = (r.job, r.target.clone());
            match g.iter_mut().find(|(x, _)| *x == k) {
                Some((_, v)) => v.push(r),
                None => g.push((k, vec![r])),
            }
        }
        g.sort_by_key(|a| a.0 .0);
        g
    }

    fn median(rs: &[&NvmeRun], f: impl Fn(&NvmeRun) -> f64) -> f64 {
        summarize(&rs.iter().map(|r| f(r)).collect::<Vec<_>>()).map(|s| s.median).unwrap_or(f64::NAN)
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.host);
        let o = &self.options;
        let _ = writeln!(
            s,
            "nvme: backend {}, LBA {} B, {} s per run, {} round(s); median over rounds; 1 guest vCPU; controller pollers {:?}; contend: {}",
            o.backend,
            o.lba,
            o.time_ms as f64 / 1000.0,
            o.rounds,
            o.pollers,
            o.contend
        );
        let _ = writeln!(s, "ring floor, measured first in each round ({}):", crate::floor::placement(None));
        s.push_str(&crate::floor::floor_rows(&self.floor));
        let _ = writeln!(s);
        let hdr = format!(
            "{:<24} {:<18} {:>7} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}  {}",
            "job", "target", "pollers", "IOPS", "/floor", "MB/s", "lat avg", "p50", "p99", "p99.9", "exits/IO", "check"
        );
        let _ = writeln!(s, "{hdr}");
        let _ = writeln!(s, "{}", "-".repeat(hdr.len() + 30));
        for ((ji, target), rs) in self.groups() {
            let j = &o.jobs[ji];
            let epi = rs.iter().filter_map(|r| r.exits_per_io).collect::<Vec<_>>();
            let epi = summarize(&epi).map(|x| format!("{:.6}", x.median)).unwrap_or_else(|| "-".into());
            let ok = if rs.iter().all(|r| r.routing_ok) { "ok" } else { "WRONG" };
            // The median over rounds of each round's IOPS / that round's floor.
            let fr = rs.iter().filter_map(|r| r.floor_ratio).collect::<Vec<_>>();
            let fr = summarize(&fr).map(|x| format!("{:.2}x floor", x.median)).unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "{:<24} {:<18} {:>7} {:>9} {:>11} {:>9.0} {:>9} {:>9} {:>9} {:>9} {:>11}  {ok} {}",
                j.label(),
                target,
                rs[0].pollers,
                fmt_rate(Self::median(&rs, |r| r.iops)),
                fr,
                Self::median(&rs, |r| r.mb_s),
                fmt_ns(Self::median(&rs, |r| r.lat_avg_ns)),
                fmt_ns(Self::median(&rs, |r| r.p50_ns)),
                fmt_ns(Self::median(&rs, |r| r.p99_ns)),
                fmt_ns(Self::median(&rs, |r| r.p999_ns)),
                epi,
                rs[0].routing
            );
        }
        self.cpu_table(&mut s);
        for (ji, j) in o.jobs.iter().enumerate() {
            let iops = |t: &str| {
                let rs: Vec<&NvmeRun> = self.runs.iter().filter(|r| r.job == ji && r.target == t).collect();
                (!rs.is_empty()).then(|| Self::median(&rs, |r| r.iops))
            };
            if let (Some(a), Some(q)) = (iops("iopath-shm"), iops("qemu")) {
                let _ = writeln!(s, "{}: iopath-shm / qemu IOPS = {:.2}x", j.label(), a / q);
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors:");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    /// Device threads' CPU per group: per I/O in the window, and idle.
    fn cpu_table(&self, s: &mut String) {
        let groups: Vec<_> =
            self.groups().into_iter().filter(|(_, rs)| rs.iter().any(|r| r.device_threads > 0)).collect();
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(
            s,
            "\ndevice threads' CPU ({}), median over rounds; contend: {}",
            crate::cpu::NVME_DEVICE_THREADS.join(", "),
            self.options.contend
        );
        let _ = writeln!(s, "{:<24} {:<18} {:>7} {:>11} {:>9}", "job", "target", "threads", "CPU/IO", "idle CPU");
        for ((ji, target), rs) in groups {
            let med = |f: fn(&NvmeRun) -> Option<f64>| {
                summarize(&rs.iter().filter_map(|r| f(r)).collect::<Vec<_>>()).map(|x| x.median)
            };
            let _ = writeln!(
                s,
                "{:<24} {:<18} {:>7} {:>11} {:>9}",
                self.options.jobs[ji].label(),
                target,
                rs.iter().map(|r| r.device_threads).max().unwrap_or(0),
                med(|r| r.cpu_ns_per_io).map_or("-".into(), fmt_ns),
                med(|r| r.idle_cpu_pct).map_or("-".into(), |p| format!("{p:.1} %")),
            );
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "benchmark": "nvme",
            "host": self.host,
            "options": self.options,
            "tsc_khz": self.tsc_khz,
            "runs": self.runs,
            "floor": {"placement": crate::floor::placement(None), "runs": self.floor},
            "errors": self.errors,
        })
    }
}
