//! `iopath bench nvme`: the guest's polled NVMe driver (nvmeperf) against
//! iopath's NVMe controller in each doorbell mode, and against QEMU's
//! `-device nvme` on `null-co` (or on the same file, for a `file:` backend)
//! in the same run (`--vs qemu`), interleaved round by round. A `file:`
//! backend also gets fio on the host on that file in each round
//! (`crate::fio`). Each iopath run is checked against the controller's own
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
    /// fio's thinktime: the guest waits this long after a completion before
    /// the slot's next command (0: none). At iodepth 1 each command then
    /// meets an idle controller: its latency is the wake-up's.
    pub thinktime_us: u64,
}

impl Job {
    pub fn label(&self) -> String {
        let bs = if self.bs.is_multiple_of(1024) { format!("{}k", self.bs / 1024) } else { format!("{}", self.bs) };
        if self.verify {
            format!("verify {bs} qd{} x{}", self.iodepth, self.queues)
        } else if self.thinktime_us > 0 {
            format!("{} {bs} qd{} x{} think {}us", self.rw, self.iodepth, self.queues, self.thinktime_us)
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

fn transport_names<S: serde::Serializer>(t: &[Option<&'static dyn Transport>], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(t.iter().map(|t| t.map_or("vmm", |t| t.name())))
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
    /// Where the controller runs, each in every round, interleaved: None in
    /// the VMM, or a device process over that transport.
    #[serde(serialize_with = "transport_names")]
    pub transports: Vec<Option<&'static dyn Transport>>,
    pub lba: u32,
    pub time_ms: u64,
    pub rounds: u32,
    pub vs_qemu: bool,
    pub mem_mb: u64,
    pub timeout_s: u64,
    pub progress: bool,
    /// Busy threads run during every measured run, QEMU's included (`--contend N`).
    pub contend: u32,
    /// Where the vCPU, the device threads and the floor's threads run
    /// (`--pin`); None leaves them to the scheduler.
    pub pin: Option<crate::pin::Placement>,
    /// Length of each ring-floor run (`crate::floor`), per queue depth and round.
    pub floor_ms: u64,
    #[serde(skip)]
    pub iopath_exe: Option<std::path::PathBuf>,
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            jobs: vec![
                Job { rw: "randread".into(), bs: 512, iodepth: 16, queues: 1, verify: false, thinktime_us: 0 },
                Job { rw: "randread".into(), bs: 4096, iodepth: 1, queues: 1, verify: false, thinktime_us: 0 },
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
            transports: vec![None],
            lba: 512,
            time_ms: 2000,
            rounds: 1,
            vs_qemu: false,
            mem_mb: 256,
            timeout_s: 120,
            progress: true,
            contend: 0,
            pin: None,
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
    /// File backend: IOPS over fio's on the host, same file and job, same round.
    pub fio_ratio: Option<f64>,
    /// A job with a think time: p50 latency over the same round's wake-up
    /// floor p50 (each I/O then meets an idle controller).
    pub wake_ratio: Option<f64>,
    /// Out of process (`...@transport`): IOPS over the same mode's in the
    /// VMM, same job and round (with `--transport vmm,...`).
    pub vmm_ratio: Option<f64>,
}

/// The pause after a run's record in which device threads' idle CPU is measured.
const IDLE_WINDOW: Duration = Duration::from_millis(200);

/// Places the run's threads while it is held (nothing when unpinned).
fn pinner(o: &NvmeOptions) -> Option<crate::pin::Pinner> {
    o.pin.map(|p| crate::pin::Pinner::start(p, NVME_DEVICE_THREADS))
}

/// The placement, for tables and JSON.
fn placement(o: &NvmeOptions) -> String {
    o.pin.map_or_else(|| crate::floor::UNPINNED.to_string(), |p| p.to_string())
}

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
    /// The wake-up floor of every round, with a think-time job.
    pub wake: Vec<crate::wake::WakeRun>,
    pub errors: Vec<String>,
    /// Rows not run, with the reason (fio missing, a verify job).
    pub skipped: Vec<String>,
}

/// The target name of the host's own fio row.
pub const FIO_TARGET: &str = "fio (host)";

/// The namespace size for a file backend: the file's, in whole MiB (a device
/// process gets it as size_mb), so that the guest, fio and QEMU all range
/// over the same bytes; the default where the file is missing or < 1 MiB.
fn namespace_size(backend: &BackendKind) -> u64 {
    let len = match backend {
        BackendKind::File(p) => std::fs::metadata(p).map_or(0, |m| m.len()) >> 20 << 20,
        _ => 0,
    };
    if len > 0 {
        len.min(1 << 40)
    } else {
        NvmeConfig::default().size
    }
}

/// The ring floor's queue depth for a job: all its outstanding I/Os.
fn floor_qd(j: &Job) -> u32 {
    j.iodepth.saturating_mul(j.queues).clamp(1, crate::floor::MAX_QD)
}

fn cmdline(j: &Job, o: &NvmeOptions, tsc_khz: u64) -> String {
    format!(
        "workload=nvme rw={} bs={} iodepth={} queues={} time_ms={} verify={} thinktime_us={} tsc_khz={tsc_khz}",
        j.rw, j.bs, j.iodepth, j.queues, o.time_ms, j.verify as u8, j.thinktime_us
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
        fio_ratio: None,
        wake_ratio: None,
        vmm_ratio: None,
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
    // (where, mode, pollers) the controller serves.
    let combos: Vec<(Option<&'static dyn Transport>, DoorbellMode, u8)> = o
        .transports
        .iter()
        .flat_map(|&t| o.doorbells.iter().flat_map(move |&db| o.pollers.iter().map(move |&p| (t, db, p))))
        .filter(|&(_, db, p)| p == 1 || db.polled())
        .collect();
    let per_round = o.jobs.len() as u64 * (combos.len() as u64 + qemu.is_some() as u64);
    let pb = if o.progress { ProgressBar::new(per_round * o.rounds as u64) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "),
    );
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    let timeout = Duration::from_secs(o.timeout_s);
    let (mut floor, mut wake) = (Vec::new(), Vec::new());
    let mut skipped = Vec::new();
    let ns_size = namespace_size(&o.backend);
    let fio = match &o.backend {
        BackendKind::File(_) => crate::fio::find().ok_or_else(crate::fio::missing_reason).map(Some),
        _ => Ok(None),
    };
    if let Err(e) = &fio {
        skipped.push(format!("{FIO_TARGET}: {e}"));
    }
    for round in 0..o.rounds {
        // The ring floor first, in this round, at the jobs' queue depths.
        pb.set_message(format!("round {}/{} ring floor", round + 1, o.rounds));
        let mut depths: Vec<u32> = o.jobs.iter().map(floor_qd).collect();
        depths.sort_unstable();
        depths.dedup();
        let (f, e) = crate::floor::measure_round(&depths, round, o.floor_ms, o.pin.map(|p| p.pair()));
        floor.extend(f);
        errors.extend(e);
        if o.jobs.iter().any(|j| j.thinktime_us > 0) {
            pb.set_message(format!("round {}/{} wake-up floor", round + 1, o.rounds));
            match crate::wake::run_wake(crate::wake::WAKES, crate::wake::IDLE, o.pin.map(|p| p.pair()), round) {
                Ok(w) => wake.push(w),
                Err(e) => errors.push(format!("wake round {round}: {e}")),
            }
        }
        for (ji, j) in o.jobs.iter().enumerate() {
            for &(tr, db, pollers) in &combos {
                // One poller keeps the plain name; more show in it.
                let name = if pollers == 1 { format!("iopath-{db}") } else { format!("iopath-{db}-p{pollers}") };
                let target = match tr.map(|t| t.name()) {
                    Some(t) => format!("{name}@{t}"),
                    None => name,
                };
                pb.set_message(format!("round {}/{} {} {target}", round + 1, o.rounds, j.label()));
                let config =
                    NvmeConfig { doorbell: db, backend: o.backend.clone(), lba_size: o.lba, size: ns_size, pollers };
                let spec = DeviceSpec {
                    device: Device::Model(DeviceConfig::Nvme(config)),
                    remote: tr.map(|t| (t, Endpoint::Spawn)),
                };
                let r = (|| -> anyhow::Result<NvmeRun> {
                    let _contention = contenders(o)?;
                    let _pinned = pinner(o);
                    let window = Window::new(NVME_DEVICE_THREADS, "@nvme-ctrl ", "@nvme ", IDLE_WINDOW);
                    let w = window.clone();
                    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &cmdline(j, o, tsc_khz));
                    cfg.devices = vec![instantiate(&spec, &progs)?];
                    cfg.mem_size = o.mem_mb << 20;
                    cfg.timeout = timeout;
                    cfg.on_line = Some(Box::new(move |l| w.on_line(l)));
                    let rep = run(cfg)?;
                    let mut r = to_run(&target, ji, round, j, &rep.lines, tsc_khz)?;
                    r.pollers = pollers;
                    if let Some(w) = window.result().filter(|w| w.threads > 0) {
                        r.device_threads = w.threads;
                        r.cpu_ns_per_io = Some(w.busy_ns as f64 / r.ios.max(1) as f64);
                        r.idle_cpu_pct = Some(w.idle_pct);
                    }
                    let dev = rep.devices.first().ok_or_else(|| anyhow::anyhow!("no device report"))?;
                    let c = |n: &str| dev.counters.iter().find(|c| c.name == n).map(|c| c.value);
                    let exits = rep.exits.mmio_write + rep.exits.mmio_read + rep.exits.io_out + rep.exits.io_in;
                    r.vm_exits = Some(exits);
                    if pollers > 1 {
                        r.poller_ios = (0..pollers).filter_map(|k| c(&format!("poller{k}.ios"))).collect();
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
                    let exits_only = tr.and_then(|t| match db {
                        DoorbellMode::Ioeventfd | DoorbellMode::Adaptive => {
                            (!t.announces_ioeventfds()).then_some("ioeventfds")
                        }
                        DoorbellMode::Bar => (!t.shares_bar_pages()).then_some("shared BAR pages"),
                        _ => None,
                    });
                    if let (Some(what), Some(t)) = (exits_only, tr) {
                        // adaptive: only the doorbells that wake the poller exit; the rest are polled.
                        let which = if db == DoorbellMode::Adaptive { "wake-up doorbells exit" } else { "exits" };
                        r.routing = format!("{which} ({} has no {what}): {}", t.name(), r.routing);
                    }
                    let bar_page = db == DoorbellMode::Bar && exits_only.is_none();
                    let dbs_ok = bar_page || io_exits.map(|x| x + kicks) == Some(r.io_doorbell_writes);
                    let want_exits =
                        if db == DoorbellMode::Mmio || exits_only.is_some() { r.io_doorbell_writes } else { 0 };
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
            if let (Ok(Some(fio)), BackendKind::File(path)) = (&fio, &o.backend) {
                if j.verify {
                    if round == 0 {
                        skipped.push(format!("{FIO_TARGET} {}: a verify job is not a speed run", j.label()));
                    }
                } else {
                    pb.set_message(format!("round {}/{} {} fio", round + 1, o.rounds, j.label()));
                    match contenders(o).and_then(|_c| fio_run(fio, path, j, o, ns_size, ji, round)) {
                        Ok(r) => runs.push(r),
                        Err(e) => errors.push(format!("{FIO_TARGET} {} round {round}: {e}", j.label())),
                    }
                }
            }
            if let Some(q) = &qemu {
                pb.set_message(format!("round {}/{} {} qemu", round + 1, o.rounds, j.label()));
                let qr = contenders(o).and_then(|_c| {
                    let _pinned = pinner(o);
                    crate::qemu::run_nvme(q, &image, &cmdline(j, o, tsc_khz), o.mem_mb, &o.backend, o.lba, timeout)
                });
                match qr {
                    Ok((qr, drive)) => match to_run("qemu", ji, round, j, &qr.lines, tsc_khz) {
                        Ok(mut r) => {
                            r.routing = format!("QEMU nvme on {drive}");
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
    for r in runs.iter_mut().filter(|r| r.target != FIO_TARGET) {
        let f = crate::floor::ops_s_of(&floor, r.round, floor_qd(&o.jobs[r.job]));
        r.floor_ratio = f.map(|f| r.iops / f);
        if o.jobs[r.job].thinktime_us > 0 {
            let w = wake.iter().find(|w| w.round == r.round).map(|w| w.p50_ns);
            r.wake_ratio = w.filter(|&w| w > 0.0).map(|w| r.p50_ns / w);
        }
    }
    // Each file-backed row (iopath's, QEMU's) over the host's fio of its job and round.
    let fio_iops: Vec<(usize, u32, f64)> =
        runs.iter().filter(|r| r.target == FIO_TARGET).map(|r| (r.job, r.round, r.iops)).collect();
    for r in runs.iter_mut().filter(|r| r.target != FIO_TARGET) {
        let f = fio_iops.iter().find(|f| (f.0, f.1) == (r.job, r.round)).map(|f| f.2);
        r.fio_ratio = f.filter(|&f| f > 0.0).map(|f| r.iops / f);
    }
    // Each out-of-process row over its in-VMM twin of the same job and round.
    let in_vmm: Vec<(usize, u32, String, f64)> = runs
        .iter()
        .filter(|r| r.target.starts_with("iopath-") && !r.target.contains('@'))
        .map(|r| (r.job, r.round, r.target.clone(), r.iops))
        .collect();
    for r in runs.iter_mut() {
        let Some((base, _)) = r.target.split_once('@') else { continue };
        let v = in_vmm.iter().find(|v| (v.0, v.1, v.2.as_str()) == (r.job, r.round, base)).map(|v| v.3);
        r.vmm_ratio = v.filter(|&v| v > 0.0).map(|v| r.iops / v);
    }
    for r in &runs {
        if !r.routing_ok {
            errors.push(format!("{} job {}: routing wrong: {}", r.target, r.job, r.routing));
        }
        if r.errors > 0 || r.mismatches.unwrap_or(0) > 0 {
            errors.push(format!("{} job {}: {} I/O errors, {:?} mismatches", r.target, r.job, r.errors, r.mismatches));
        }
    }
    Ok(NvmeResult { host, options: o.clone(), tsc_khz, runs, floor, wake, errors, skipped })
}

/// fio on the host on the namespace's file: job `j`'s rw, bs and run time;
/// one fio job per queue pair, each at the job's iodepth (see `crate::fio`).
fn fio_run(
    fio: &std::path::Path,
    path: &std::path::Path,
    j: &Job,
    o: &NvmeOptions,
    size: u64,
    job: usize,
    round: u32,
) -> anyhow::Result<NvmeRun> {
    let fj = crate::fio::FioJob {
        path: path.into(),
        rw: j.rw.clone(),
        bs: j.bs,
        iodepth: j.iodepth,
        numjobs: j.queues.max(1),
        runtime_ms: o.time_ms,
        size,
    };
    let f = crate::fio::run(fio, &fj, Duration::from_secs(o.timeout_s))?;
    Ok(NvmeRun {
        target: FIO_TARGET.into(),
        pollers: 1,
        poller_ios: Vec::new(),
        job,
        round,
        ios: f.ios,
        iops: f.iops,
        mb_s: f.mb_s,
        lat_avg_ns: f.lat_avg_ns,
        p50_ns: f.p50_ns,
        p90_ns: f.p90_ns,
        p99_ns: f.p99_ns,
        p999_ns: f.p999_ns,
        errors: f.errors,
        mismatches: None,
        io_doorbell_writes: 0,
        vm_exits: None,
        exits_per_io: None,
        routing: format!("fio on the host: io_uring, O_DIRECT, numjobs={} x iodepth={}", fj.numjobs, fj.iodepth),
        routing_ok: true,
        // fio's own threads, for the CPU table beside the controller's.
        device_threads: if f.cpu_ns_per_io.is_some() { fj.numjobs as usize } else { 0 },
        cpu_ns_per_io: f.cpu_ns_per_io,
        idle_cpu_pct: None,
        floor_ratio: None,
        fio_ratio: None,
        wake_ratio: None,
        vmm_ratio: None,
    })
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
            "nvme: backend {}, LBA {} B, {} s per run, {} round(s); median over rounds; 1 guest vCPU; controller pollers {:?}; contend: {}; {}",
            o.backend,
            o.lba,
            o.time_ms as f64 / 1000.0,
            o.rounds,
            o.pollers,
            o.contend,
            placement(o)
        );
        let _ = writeln!(
            s,
            "ring floor, measured first in each round ({}):",
            crate::floor::placement(self.options.pin.map(|p| p.pair()))
        );
        s.push_str(&crate::floor::floor_rows(&self.floor));
        s.push_str(&crate::wake::rows(&self.wake));
        let _ = writeln!(s);
        let hdr = format!(
            "{:<24} {:<22} {:>7} {:>9} {:>11} {:>17} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}  {}",
            "job",
            "target",
            "pollers",
            "IOPS",
            "/floor",
            "/fio [min..max]",
            "MB/s",
            "lat avg",
            "p50",
            "p99",
            "p99.9",
            "exits/IO",
            "check"
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
            // With a think time the I/Os meet an idle controller: their p50 over the wake-up floor's.
            let wr = summarize(&rs.iter().filter_map(|r| r.wake_ratio).collect::<Vec<_>>());
            let fr = if j.thinktime_us > 0 { wr.map_or("-".into(), |x| format!("{:.2}x wake", x.median)) } else { fr };
            // The same over the host's fio on the same file (file backend).
            let ff = rs.iter().filter_map(|r| r.fio_ratio).collect::<Vec<_>>();
            let ff = summarize(&ff)
                .map(|x| format!("{:.2} [{:.2}..{:.2}]", x.median, x.min, x.max))
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(
                s,
                "{:<24} {:<22} {:>7} {:>9} {:>11} {:>17} {:>9.0} {:>9} {:>9} {:>9} {:>9} {:>11}  {ok} {}",
                j.label(),
                target,
                rs[0].pollers,
                fmt_rate(Self::median(&rs, |r| r.iops)),
                fr,
                ff,
                Self::median(&rs, |r| r.mb_s),
                fmt_ns(Self::median(&rs, |r| r.lat_avg_ns)),
                fmt_ns(Self::median(&rs, |r| r.p50_ns)),
                fmt_ns(Self::median(&rs, |r| r.p99_ns)),
                fmt_ns(Self::median(&rs, |r| r.p999_ns)),
                epi,
                rs[0].routing
            );
        }
        self.vmm_table(&mut s);
        self.cpu_table(&mut s);
        for (ji, j) in o.jobs.iter().enumerate() {
            let iops = |t: &str| {
                let rs: Vec<&NvmeRun> = self.runs.iter().filter(|r| r.job == ji && r.target == t).collect();
                (!rs.is_empty()).then(|| Self::median(&rs, |r| r.iops))
            };
            if let (Some(a), Some(q)) = (iops("iopath-shm"), iops("qemu")) {
                let _ = writeln!(s, "{}: iopath-shm / qemu IOPS = {:.2}x", j.label(), a / q);
            }
            if let (Some(a), Some(f)) = (iops("iopath-shm"), iops(FIO_TARGET)) {
                let _ = writeln!(s, "{}: iopath-shm / {FIO_TARGET} IOPS = {:.2}x", j.label(), a / f);
            }
        }
        if !self.skipped.is_empty() {
            let _ = writeln!(s, "\nskipped:");
            for e in &self.skipped {
                let _ = writeln!(s, "  {e}");
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

    /// Out-of-process rows over their in-VMM twins, round by round.
    fn vmm_table(&self, s: &mut String) {
        let groups: Vec<_> =
            self.groups().into_iter().filter(|(_, rs)| rs.iter().any(|r| r.vmm_ratio.is_some())).collect();
        if groups.is_empty() {
            return;
        }
        let _ = writeln!(s, "\nout of process over in the VMM (IOPS, same mode, job and round): median [min .. max]");
        for ((ji, target), rs) in groups {
            let v = summarize(&rs.iter().filter_map(|r| r.vmm_ratio).collect::<Vec<_>>());
            if let Some(v) = v {
                let label = self.options.jobs[ji].label();
                let _ = writeln!(s, "{label:<24} {target:<24} {:.2}x [{:.2} .. {:.2}]", v.median, v.min, v.max);
            }
        }
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
            "\ndevice threads' CPU ({}; fio's own for {FIO_TARGET}), median over rounds; contend: {}",
            crate::cpu::NVME_DEVICE_THREADS.join(", "),
            self.options.contend
        );
        let _ = writeln!(s, "{:<24} {:<22} {:>7} {:>11} {:>9}", "job", "target", "threads", "CPU/IO", "idle CPU");
        for ((ji, target), rs) in groups {
            let med = |f: fn(&NvmeRun) -> Option<f64>| {
                summarize(&rs.iter().filter_map(|r| f(r)).collect::<Vec<_>>()).map(|x| x.median)
            };
            let _ = writeln!(
                s,
                "{:<24} {:<22} {:>7} {:>11} {:>9}",
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
            "floor": {"placement": crate::floor::placement(self.options.pin.map(|p| p.pair())), "runs": self.floor, "wake": self.wake},
            "errors": self.errors,
            "skipped": self.skipped,
        })
    }
}
