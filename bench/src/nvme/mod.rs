//! `iopath bench nvme`: the guest's polled NVMe driver (nvmeperf) against
//! iopath's NVMe controller in each doorbell mode, and against QEMU's
//! `-device nvme` on the same kind of backend (`--vs qemu`: null-co for
//! null, a file in /dev/shm for ram, the same file for `file:`; see
//! `crate::qemu::QemuDrive`), interleaved round by round. A `file:` backend
//! also gets fio on the host on that file in each round (`crate::fio`).
//!
//! Each iopath run is checked against the controller's own counters (every
//! guest I/O is a controller command; every MMIO doorbell write the guest
//! made is one the controller saw); every run, QEMU's too, against the
//! guest's own (I/Os done, no I/O error, verify clean). Exits per I/O count
//! the guest's timed window only (`@nvme-window` marks; setup apart).
//! Latency percentiles over rounds come from the rounds' merged histograms
//! (`hist`). IoFigures the ring floor says cannot be true, or rounds that
//! disagree, are marked and their target run again (`guard`).

use crate::host::HostInfo;
use iopath_devices::block::StorageKind;
use iopath_devices::nvme::{DoorbellMode, InPlace, NvmeConfig};
use iopath_protocols::vfio_user::StateMemoryMode;
use iopath_protocols::FunctionTransport;
use serde::Serialize;
use std::time::Duration;

mod args;
pub mod controllers;
mod guard;
pub mod hist;
mod run;
pub mod split;
mod state;
mod table;
pub mod timing;

pub use args::NvmeArgs;
pub use hist::LatHist;
pub use split::IoFigures;

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
    /// fio's rwmixread: the percentage of reads in a randrw job (0..=100).
    pub rwmixread: u32,
    /// fio's iodepth_batch_submit: the guest rings its doorbells after every
    /// this many commands issued while reaping (0: once per reaping pass).
    pub batch_submit: u32,
    /// The guest waits for completions as an interrupt-driven driver does:
    /// a pass that finds none halts its vCPU until a CQ's MSI-X message
    /// (nvmeperf's `irq=wait`). false: it polls its CQs.
    pub irq_wait: bool,
}

impl Job {
    /// A random-read job of `bs` bytes at `iodepth` on one queue (the other
    /// fields at their defaults: no verify, no think time, fio's rwmixread 50,
    /// one doorbell per reaping pass).
    pub fn randread(bs: u64, iodepth: u32) -> Job {
        Job {
            rw: "randread".into(),
            bs,
            iodepth,
            queues: 1,
            verify: false,
            thinktime_us: 0,
            rwmixread: 50,
            batch_submit: 0,
            irq_wait: false,
        }
    }

    pub fn label(&self) -> String {
        let mut l = self.base_label();
        if self.batch_submit > 0 {
            l = format!("{l} batch {}", self.batch_submit);
        }
        if self.irq_wait {
            l = format!("{l} irq");
        }
        l
    }

    /// Whether the job's reads and writes are counted apart: randrw (a
    /// verify job writes, then reads back: one set).
    pub fn split(&self) -> bool {
        self.rw == "randrw" && !self.verify
    }

    fn base_label(&self) -> String {
        let bs = if self.bs.is_multiple_of(1024) { format!("{}k", self.bs / 1024) } else { format!("{}", self.bs) };
        if self.verify {
            format!("verify {bs} qd{} x{}", self.iodepth, self.queues)
        } else if self.rw == "randrw" {
            format!("randrw {bs} qd{} x{} {}% reads", self.iodepth, self.queues, self.rwmixread)
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

fn transport_names<S: serde::Serializer>(
    t: &[Option<&'static dyn FunctionTransport>],
    s: S,
) -> Result<S::Ok, S::Error> {
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
    /// adaptive's forecast (`forecast=`): on, off, or both as two targets
    /// (`iopath-adaptive`, `iopath-adaptive-noforecast`).
    pub forecast: Vec<bool>,
    /// The guest driver's doorbells (nvmeperf's `dbbuf=`): true, shadow
    /// doorbells where the controller offers them (as Linux); false, every
    /// doorbell a register store (as SPDK). Each value its own target
    /// (`-dbbuf0` for false; true keeps the name).
    pub dbbuf: Vec<bool>,
    /// A file namespace's transfers in place (`in_place=`): each value its
    /// own target (`-inplace` for on, `-bounce` for off; auto keeps the name).
    #[serde(serialize_with = "as_strings")]
    pub in_place: Vec<InPlace>,
    /// A file namespace's operations to the kernel every N (`submit_batch=`;
    /// 0: per queue pass): each value its own target (`-sbN`; 0 keeps the name).
    pub submit_batch: Vec<u16>,
    /// State keeping of a controller in a device process whose transport
    /// offers state memory (vfio-user, ioregionfd): each value its own
    /// target (`-nostate` for off; on keeps the name). In the VMM or over
    /// mpqemu there is none to turn off: those run once.
    #[serde(serialize_with = "as_strings")]
    pub state_memory: Vec<StateMemoryMode>,
    #[serde(serialize_with = "as_string")]
    pub backend: StorageKind,
    /// Where the controller runs, each in every round, interleaved: None in
    /// the VMM, or a device process over that transport.
    #[serde(serialize_with = "transport_names")]
    pub transports: Vec<Option<&'static dyn FunctionTransport>>,
    pub lba: u32,
    /// The namespace size in MiB on a null or ram backend (None: the
    /// controller's default); a file backend's is the file's.
    pub size_mb: Option<u64>,
    pub time_ms: u64,
    pub rounds: u32,
    pub vs_qemu: bool,
    pub mem_mb: u64,
    /// How the VMM backs guest RAM (`--ram`); `auto` is a memfd when some
    /// run puts the controller in a device process, else anonymous memory.
    #[serde(serialize_with = "as_string")]
    pub ram: iopath_vmm::RamKind,
    pub timeout_s: u64,
    pub progress: bool,
    /// Busy threads during the measured runs, QEMU's and fio's included
    /// (`--contend N[,M..]`): every target runs once per level, each level
    /// right after the one before it, so that a contended run and its quiet
    /// twin (level 0) see the same placement; with several levels a level
    /// above 0 shows in the target's name ([`contend_suffix`]).
    pub contend: Vec<u32>,
    /// Where the vCPU, the device threads and the floor's threads run
    /// (`--pin`); None leaves them to the scheduler.
    pub pin: Option<crate::pin::Placement>,
    /// Length of each ring-floor run (`crate::floor`), per queue depth and round.
    pub floor_ms: u64,
    #[serde(skip)]
    pub iopath_exe: Option<std::path::PathBuf>,
    /// The guard's thresholds and re-run budget (in the JSON as `guard`).
    #[serde(skip)]
    pub guard: crate::guard::GuardConfig,
    /// The controller's device timing model (`--timing`): each iopath
    /// target also runs with it (`-timed`), right after itself; `timing.rs`.
    #[serde(serialize_with = "opt_string")]
    pub timing: Option<iopath_devices::block::timing::TimingSpec>,
}

fn opt_string<T: std::fmt::Display, S: serde::Serializer>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_str(&v.to_string()),
        None => s.serialize_none(),
    }
}

impl Default for NvmeOptions {
    fn default() -> Self {
        NvmeOptions {
            jobs: vec![Job::randread(512, 16), Job::randread(4096, 1)],
            doorbells: vec![
                DoorbellMode::Auto,
                DoorbellMode::Shm,
                DoorbellMode::Bar,
                DoorbellMode::Ioeventfd,
                DoorbellMode::Adaptive,
                DoorbellMode::BarAdaptive,
                DoorbellMode::Mmio,
            ],
            pollers: vec![1],
            forecast: vec![true],
            dbbuf: vec![true],
            in_place: vec![InPlace::Auto],
            submit_batch: vec![0],
            state_memory: vec![StateMemoryMode::On],
            backend: StorageKind::Ram,
            transports: vec![None],
            lba: 512,
            size_mb: None,
            time_ms: 2000,
            rounds: 1,
            vs_qemu: false,
            mem_mb: 256,
            ram: iopath_vmm::RamKind::Auto,
            timeout_s: 120,
            progress: true,
            contend: vec![0],
            pin: None,
            floor_ms: 300,
            iopath_exe: None,
            guard: crate::guard::GuardConfig::default(),
            timing: None,
        }
    }
}

/// One guest run's `@nvme` record, with the host's view.
#[derive(Clone, Debug, Serialize)]
pub struct NvmeRun {
    pub target: String,
    /// What the run's device stood on, for ratio lines: "iopath ram",
    /// "qemu ram(/dev/shm)", "fio io_uring O_DIRECT".
    pub setup: String,
    /// The controller's poller threads (1 for QEMU).
    pub pollers: u8,
    /// I/O commands each poller served (`poller{k}.ios`), with several.
    pub poller_ios: Vec<u64>,
    pub job: usize,
    pub round: u32,
    /// 0 for the run of the round; for a re-run, its attempt's number (1, 2, ..:
    /// one per re-run in the bench, whatever its target, so that runs of the
    /// same number ran together: a target, its twins and fio).
    pub attempt: u32,
    /// The window's length in guest TSC cycles (nvmeperf's `cycles`).
    pub cycles: u64,
    /// The run's figures, both directions together (its JSON has them at
    /// its top level).
    #[serde(flatten)]
    pub io: IoFigures,
    /// A randrw run's reads and writes apart (`split`); None for other jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read: Option<IoFigures>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write: Option<IoFigures>,
    pub errors: u64,
    pub mismatches: Option<u64>,
    pub verified_blocks: Option<u64>,
    /// MMIO doorbell writes the guest made for I/O queues.
    pub io_doorbell_writes: u64,
    /// VMM exits of the whole run, where the VMM is iopath's.
    pub vm_exits: Option<u64>,
    /// Of these, the ones in the guest's timed window, and the others (setup, output).
    pub window_exits: Option<u64>,
    pub setup_exits: Option<u64>,
    /// Window exits per I/O.
    pub exits_per_io: Option<f64>,
    pub routing: String,
    pub routing_ok: bool,
    /// Device threads (nvme-poller, nvme-adaptive, nvme-ioeventfd, nvme-uring; QEMU's main
    /// loop and workers) seen in the measured window; none in mmio mode without io_uring.
    pub device_threads: usize,
    /// Their CPU time in the guest's timed window, per I/O. Work done in the
    /// vCPU's exits (mmio doorbells) is in `vcpu_ns_per_io` instead.
    pub cpu_ns_per_io: Option<f64>,
    /// The guest vCPU thread's CPU time in the window, per I/O: the guest's
    /// driver, its exits and their handling (a polling guest spins: then it
    /// is the window's length over the I/Os).
    pub vcpu_ns_per_io: Option<f64>,
    /// Their CPU share (100 = one core) in a pause with no I/O after the window.
    pub idle_cpu_pct: Option<f64>,
    /// The device threads' run-queue wait in the window, as a share of it
    /// (100 = one thread runnable and not running throughout): what the
    /// host's other threads took from them, in the same run.
    pub device_waited_pct: Option<f64>,
    /// The same of the vCPU thread.
    pub vcpu_waited_pct: Option<f64>,
    /// The guest driver's share of its timed window spent in passes that
    /// found no completion (its `wait_cycles` over `cycles`): near 0 the
    /// guest's own work per I/O is the bottleneck, higher the device is.
    pub guest_wait_pct: Option<f64>,
    /// Whether the guest's driver used shadow doorbells (its record's
    /// `dbbuf`): asked for and offered by the controller's mode.
    pub guest_dbbuf: Option<bool>,
    /// irq_wait jobs: the guest's halts until an interrupt (`sleeps`), and
    /// the interrupts it took (`irqs`); a polling guest takes none.
    pub guest_sleeps: Option<u64>,
    pub guest_irqs: Option<u64>,
    /// The ring floor this run is judged against: ops/s and p50 at the job's
    /// queue depth, measured just before this run (this host moves between
    /// faster and slower placements within a round; a floor measured beside
    /// the run is in the same one far more often than the round's first).
    pub floor_ops_s: Option<f64>,
    pub floor_p50_ns: Option<f64>,
    /// IOPS over `floor_ops_s`.
    pub floor_ratio: Option<f64>,
    /// File backend: IOPS over fio's on the host, same file and job, same round.
    pub fio_ratio: Option<f64>,
    /// The same over the host's fio beside a busy CPU ([`FIO_BUSY_TARGET`]).
    pub fio_busy_ratio: Option<f64>,
    /// The wake-up floor's p50 of the round, with a think-time job.
    pub wake_p50_ns: Option<f64>,
    /// A job with a think time: p50 latency over `wake_p50_ns` (each I/O
    /// then meets an idle controller).
    pub wake_ratio: Option<f64>,
    /// A QD1 job: the guest line floor measured just before this run
    /// (`guestline.rs`), a mean round trip of one line between the guest
    /// and a host thread.
    pub guest_line_ns: Option<f64>,
    /// p50 latency over `guest_line_ns`.
    pub guest_line_ratio: Option<f64>,
    /// Out of process (`...@transport`): IOPS over the same mode's in the
    /// VMM, same job and round (with `--transport vmm,...`).
    pub vmm_ratio: Option<f64>,
    /// The same over each run's own floor: `floor_ratio` over the in-VMM
    /// run's, so that a placement change between the two runs cancels out.
    pub vmm_floor_ratio: Option<f64>,
    /// Busy threads that ran beside it (`--contend`).
    pub contend: u32,
    /// A run beside busy threads: IOPS over its quiet twin's (the same target
    /// at level 0, same job, round and attempt), with `--contend 0,N`.
    pub quiet_ratio: Option<f64>,
    /// The same over each run's own floor (`floor_ratio` over the twin's),
    /// pairing the rounds of the same number whatever their attempts.
    pub quiet_floor_ratio: Option<f64>,
    /// `--timing`, a `-timed` run: the device's own view of its timing
    /// model (its `timing.*` counters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_timing: Option<timing::DeviceTiming>,
    /// The guard's marks on this run (its own against the floor, and its
    /// target's spread over rounds), as `guard::marks_json`.
    #[serde(serialize_with = "marks_ser")]
    pub marks: Vec<crate::guard::Mark>,
}

fn marks_ser<S: serde::Serializer>(m: &[crate::guard::Mark], s: S) -> Result<S::Ok, S::Error> {
    crate::guard::marks_json(m).serialize(s)
}

impl NvmeRun {
    /// A run with `ios` in `cycles` at `tsc_khz` and nothing else known yet.
    pub(crate) fn new(target: &str, setup: &str, job: usize, round: u32, ios: u64, cycles: u64) -> NvmeRun {
        NvmeRun {
            target: target.into(),
            setup: setup.into(),
            pollers: 1,
            poller_ios: Vec::new(),
            job,
            round,
            attempt: 0,
            cycles,
            io: IoFigures {
                ios,
                iops: f64::NAN,
                mb_s: f64::NAN,
                lat_avg_ns: f64::NAN,
                lat_min_ns: None,
                lat_max_ns: None,
                p50_ns: f64::NAN,
                p90_ns: f64::NAN,
                p99_ns: f64::NAN,
                p999_ns: f64::NAN,
                hist: Vec::new(),
                lat: None,
            },
            read: None,
            write: None,
            errors: 0,
            mismatches: None,
            verified_blocks: None,
            io_doorbell_writes: 0,
            vm_exits: None,
            window_exits: None,
            setup_exits: None,
            exits_per_io: None,
            routing: String::new(),
            routing_ok: true,
            device_threads: 0,
            cpu_ns_per_io: None,
            vcpu_ns_per_io: None,
            idle_cpu_pct: None,
            device_waited_pct: None,
            vcpu_waited_pct: None,
            guest_wait_pct: None,
            guest_dbbuf: None,
            guest_sleeps: None,
            guest_irqs: None,
            floor_ops_s: None,
            floor_p50_ns: None,
            floor_ratio: None,
            fio_ratio: None,
            fio_busy_ratio: None,
            wake_p50_ns: None,
            wake_ratio: None,
            guest_line_ns: None,
            guest_line_ratio: None,
            device_timing: None,
            vmm_ratio: None,
            vmm_floor_ratio: None,
            contend: 0,
            quiet_ratio: None,
            quiet_floor_ratio: None,
            marks: Vec::new(),
        }
    }

    /// floor_ratio and wake_ratio from the floors this run is judged against.
    fn fill_floor_ratios(&mut self, j: &Job) {
        self.floor_ratio = self.floor_ops_s.filter(|&f| f > 0.0).map(|f| self.io.iops / f);
        self.wake_ratio =
            if j.thinktime_us > 0 { self.wake_p50_ns.filter(|&w| w > 0.0).map(|w| self.io.p50_ns / w) } else { None };
    }
}

/// The pause after a run's window in which device threads' idle CPU is measured.
const IDLE_WINDOW: Duration = Duration::from_millis(200);

/// Places the run's threads while it is held (nothing when unpinned).
fn pinner(o: &NvmeOptions) -> Option<crate::pin::Pinner> {
    o.pin.map(|p| crate::pin::Pinner::start(p, crate::cpu::NVME_DEVICE_THREADS))
}

/// The placement, for tables and JSON.
fn placement(o: &NvmeOptions) -> String {
    o.pin.map_or_else(|| crate::floor::UNPINNED.to_string(), |p| p.to_string())
}

/// `n` contenders for one run: they stop by themselves well after its timeout.
fn contenders(o: &NvmeOptions, n: u32) -> anyhow::Result<crate::contend::Contention> {
    busy_threads(o, n, None)
}

/// What a target's name carries for contention level `n`: nothing at 0 or
/// when only one level runs (the table's header says which), else
/// `+contend{n}`, before any `@transport`.
/// The suffix of a target whose controller keeps no state (`--state-memory off`).
pub const NOSTATE: &str = "-nostate";

pub fn contend_suffix(o: &NvmeOptions, n: u32) -> String {
    if n == 0 || o.contend.len() < 2 {
        String::new()
    } else {
        format!("+contend{n}")
    }
}

/// A run's target name without its contention level: what its quiet twin
/// and its fio rows are called.
pub(super) fn base_target(r: &NvmeRun) -> String {
    r.target.replacen(&format!("+contend{}", r.contend), "", 1)
}

/// `n` busy threads (pinned to `cpu` if given) for one run, stopping by
/// themselves well after its timeout.
fn busy_threads(o: &NvmeOptions, n: u32, cpu: Option<usize>) -> anyhow::Result<crate::contend::Contention> {
    crate::contend::Contention::start_on(n, cpu, Duration::from_secs(o.timeout_s.saturating_add(60)))
        .map_err(|e| anyhow::anyhow!("cannot start {n} busy threads: {e}"))
}

pub struct NvmeResult {
    /// Ctrl-C stopped the bench (`crate::interrupt`): these are the runs
    /// measured before it, with no re-run of the guard's.
    pub partial: bool,
    pub host: HostInfo,
    pub options: NvmeOptions,
    pub tsc_khz: u64,
    /// The runs that stand: for a re-run target, its last attempt's.
    pub runs: Vec<NvmeRun>,
    /// Runs of earlier attempts of re-run targets, kept for the record.
    pub superseded: Vec<NvmeRun>,
    /// The ring floor, measured at the start of every round.
    pub floor: Vec<crate::floor::FloorRun>,
    /// The ring floor measured before each re-run round (its `attempt`).
    pub refloor: Vec<crate::floor::FloorRun>,
    /// The wake-up floor of every round, with a think-time job.
    pub wake: Vec<crate::wake::WakeRun>,
    /// The guest line floor, measured before every QD1 run.
    pub guest_line: Vec<crate::guestline::GuestLineRun>,
    /// Targets the guard ran again: (job, target, attempts, marks that stayed).
    pub reruns: Vec<(usize, String, u32, Vec<crate::guard::Mark>)>,
    pub errors: Vec<String>,
    /// Rows not run, with the reason (fio missing, a verify job).
    pub skipped: Vec<String>,
}

/// The target name of the host's own fio row.
pub const FIO_TARGET: &str = "fio (host)";
/// The same fio with one busy thread where the guest's vCPU runs (and fio
/// where the device threads run): what the host's own I/O stack gets beside
/// a polling vCPU. On a host whose disk is served by CPUs its vCPUs share
/// (a VM's virtual disk), a busy CPU slows the disk itself.
pub const FIO_BUSY_TARGET: &str = "fio (host, busy CPU)";

/// Whether `target` is one of the host's fio rows: the file's own floors,
/// judged against no ring floor and not re-run by the guard.
pub fn is_fio_target(target: &str) -> bool {
    let t = target.split_once("+contend").map_or(target, |t| t.0);
    t == FIO_TARGET || t == FIO_BUSY_TARGET
}

/// The disk size in bytes, for `bench nvme` and `bench blk` alike: a file
/// backend's is the file's (or the block device's), in whole MiB (a device process gets it as
/// size_mb), so that the guest, fio and QEMU all range over the same bytes;
/// where the file is missing or < 1 MiB, `size_mb` or the default (what
/// `--create` lays out; a file there that is shorter is refused). Null and ram: `size_mb` or the default.
/// At most 1 TiB.
pub fn namespace_size(backend: &StorageKind, size_mb: Option<u64>) -> u64 {
    let asked = size_mb.filter(|&m| m > 0).map_or(NvmeConfig::default().size, |m| m.min(1 << 20) << 20);
    let len = match backend {
        StorageKind::File(p) => iopath_devices::block::path_bytes(p) >> 20 << 20,
        _ => asked,
    };
    if len > 0 {
        len.min(1 << 40)
    } else {
        asked
    }
}

/// The ring floor's queue depth for a job: all its outstanding I/Os.
fn floor_qd(j: &Job) -> u32 {
    j.iodepth.saturating_mul(j.queues).clamp(1, crate::floor::MAX_QD)
}

/// A job whose p50 is given over the guest line floor: one command out at
/// a time, each meeting a polling controller (with a think time its
/// latency is the wake-up's, given over the wake-up floor instead).
fn guest_line_job(j: &Job) -> bool {
    floor_qd(j) == 1 && j.thinktime_us == 0
}

fn cmdline(j: &Job, o: &NvmeOptions, tsc_khz: u64) -> String {
    format!(
        "workload=nvme rw={} bs={} iodepth={} queues={} time_ms={} verify={} thinktime_us={} rwmixread={} batch_submit={} irq={} tsc_khz={tsc_khz}",
        j.rw,
        j.bs,
        j.iodepth,
        j.queues,
        o.time_ms,
        j.verify as u8,
        j.thinktime_us,
        j.rwmixread.min(100),
        j.batch_submit,
        if j.irq_wait { "wait" } else { "0" }
    )
}

/// Single runs of iopath's controller in the VMM, for a bench that runs them
/// beside other devices (`bench blk`): the same run, routing checks and
/// window exit count as `bench nvme`'s own.
pub struct Runner<'a>(run::Ctx<'a>);

impl<'a> Runner<'a> {
    pub fn new(o: &'a NvmeOptions) -> anyhow::Result<Runner<'a>> {
        run::Ctx::new(o).map(Runner)
    }

    /// One run of job `ji` of the options with doorbell mode `db`, one poller.
    pub fn run(&self, db: DoorbellMode, ji: usize, round: u32) -> anyhow::Result<NvmeRun> {
        let kind = run::Kind::Iopath(None, run::Setup::plain(db));
        let t = run::Target { name: format!("iopath-{db}"), kind, contend: 0 };
        self.0.run_target(&t, ji, round)
    }

    pub fn tsc_khz(&self) -> u64 {
        self.0.tsc_khz
    }
}

pub use run::window_exits_between;

/// The targets in the order round `round` runs them: as given in even
/// rounds, reversed in odd ones (a contended target stays next to its
/// quiet twin).
fn round_order(targets: &[run::Target], round: u32) -> Vec<&run::Target> {
    match round % 2 {
        0 => targets.iter().collect(),
        _ => targets.iter().rev().collect(),
    }
}

pub fn run_nvme(o: &NvmeOptions) -> anyhow::Result<NvmeResult> {
    let ctx = run::Ctx::new(o)?;
    let targets = ctx.targets();
    let per_round: u64 = o.jobs.iter().map(|j| targets.iter().filter(|t| ctx.runs_job(t, j)).count() as u64).sum();
    let pb = ctx.progress(per_round * o.rounds as u64);
    let (mut runs, mut errors) = (Vec::new(), Vec::new());
    let (mut floor, mut wake, mut guest_line) = (Vec::new(), Vec::new(), Vec::new());
    let mut skipped = ctx.skipped.clone();
    let interrupted = crate::interrupt::interrupted;
    'rounds: for round in 0..o.rounds {
        // The ring floor first, in this round, at the jobs' queue depths.
        pb.set_message(format!("round {}/{} ring floor", round + 1, o.rounds));
        let mut depths: Vec<u32> = o.jobs.iter().map(floor_qd).collect();
        depths.sort_unstable();
        depths.dedup();
        if interrupted() {
            break;
        }
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
            // Odd rounds run the targets in reverse (A B, then B A): what
            // drifts during a run (a disk cache that warms, a host that
            // throttles a disk after its burst) falls on every target alike.
            for t in round_order(&targets, round) {
                if interrupted() {
                    break 'rounds;
                }
                if !ctx.runs_job(t, j) {
                    if round == 0 && t.is_fio() {
                        skipped.push(format!("{} {}: a verify job is not a speed run", t.name, j.label()));
                    }
                    continue;
                }
                // The floor at the job's depth just before the run (not fio's: it is judged against none).
                let beside = if t.is_fio() {
                    None
                } else {
                    pb.set_message(format!("round {}/{} ring floor before {}", round + 1, o.rounds, t.name));
                    let (f, e) =
                        crate::floor::measure_round(&[floor_qd(j)], round, o.floor_ms, o.pin.map(|p| p.pair()));
                    errors.extend(e);
                    f.into_iter().next()
                };
                // A QD1 job's guest line floor, also just before the run.
                if !t.is_fio() && guest_line_job(j) {
                    pb.set_message(format!("round {}/{} guest line floor before {}", round + 1, o.rounds, t.name));
                    match crate::guestline::run_guest_line(ctx.tsc_khz, o.pin, round, &t.name) {
                        Ok(g) => guest_line.push(g),
                        Err(_) if interrupted() => break 'rounds,
                        Err(e) => errors.push(format!("guest line floor before {} round {round}: {e}", t.name)),
                    }
                }
                pb.set_message(format!("round {}/{} {} {}", round + 1, o.rounds, j.label(), t.name));
                match ctx.run_target(t, ji, round) {
                    Ok(mut r) => {
                        if let Some(f) = beside {
                            r.floor_ops_s = Some(f.ops_s);
                            r.floor_p50_ns = Some(f.p50_ns).filter(|p| p.is_finite());
                        }
                        runs.push(r)
                    }
                    Err(_) if interrupted() => break 'rounds,
                    Err(e) => errors.push(format!("{} {} round {round}: {e}", t.name, j.label())),
                }
                pb.inc(1);
            }
        }
    }
    // Each run against the floor measured beside it (else its round's).
    for r in runs.iter_mut().filter(|r| !is_fio_target(&r.target)) {
        let j = &o.jobs[r.job];
        if r.floor_ops_s.is_none() {
            r.floor_ops_s = crate::floor::ops_s_of(&floor, r.round, floor_qd(j));
            r.floor_p50_ns = crate::floor::p50_of(&floor, r.round, floor_qd(j));
        }
        r.wake_p50_ns = wake.iter().find(|w| w.round == r.round).map(|w| w.p50_ns);
        r.fill_floor_ratios(j);
    }
    // The guard: a marked target runs again, its rounds and their floors.
    let g = guard::apply(&ctx, &targets, runs, &pb);
    pb.finish_and_clear();
    let mut runs = g.runs;
    errors.extend(g.errors);
    for r in runs.iter_mut().filter(|r| !is_fio_target(&r.target) && guest_line_job(&o.jobs[r.job])) {
        r.guest_line_ns = crate::guestline::of_run(&guest_line, r.round, &r.target);
        r.guest_line_ratio = r.guest_line_ns.map(|g| r.io.p50_ns / g);
    }
    relate(&mut runs);
    for r in &runs {
        if !r.routing_ok {
            errors.push(format!("{} job {}: wrong: {}", r.target, r.job, r.routing));
        }
        if r.errors > 0 || r.mismatches.unwrap_or(0) > 0 {
            errors.push(format!("{} job {}: {} I/O errors, {:?} mismatches", r.target, r.job, r.errors, r.mismatches));
        }
    }
    Ok(NvmeResult {
        partial: interrupted(),
        host: ctx.host.clone(),
        options: o.clone(),
        tsc_khz: ctx.tsc_khz,
        runs,
        superseded: g.superseded,
        floor,
        refloor: g.floor,
        wake,
        guest_line,
        reruns: g.reruns,
        errors,
        skipped,
    })
}

/// Which runs pair up: job, round, attempt and contention level.
type RunKey = (usize, u32, u32, u32);

/// A run as a possible twin: its key, target, IOPS and floor ratio.
type Twin = (RunKey, String, f64, Option<f64>);

/// Run `r`'s ratios to its twin named `base` among `pool`, same job and
/// round: IOPS over the twin's of the same attempt, and `floor_ratio` over
/// the twin's whatever their attempts.
fn over_twin(pool: &[Twin], base: &str, r: &NvmeRun) -> (Option<f64>, Option<f64>) {
    let twin = |same_attempt: bool| {
        pool.iter()
            .find(|t| t.1 == base && (t.0 .0, t.0 .1) == (r.job, r.round) && (!same_attempt || t.0 .2 == r.attempt))
    };
    let iops = twin(true).map(|t| t.2).filter(|&v| v > 0.0).map(|v| r.io.iops / v);
    let own = twin(false).and_then(|t| t.3).filter(|&f| f > 0.0);
    (iops, own.zip(r.floor_ratio).map(|(t, f)| f / t))
}

/// Ratios between targets of the same job, round and attempt: each
/// file-backed row over the host's fio rows (alone and beside a busy CPU)
/// of its contention level, each out-of-process row over its in-VMM twin,
/// each contended row over its quiet twin. A re-run row has no partner of
/// its attempt: no IOPS ratio. The `*_floor_ratio`s compare each run over
/// its own floor, so they pair the rounds of the same number whatever
/// their attempts. (A twin's name carries the contention level wherever
/// several run, so an in-VMM twin is always at the run's own level.)
fn relate(runs: &mut [NvmeRun]) {
    let key = |r: &NvmeRun| -> RunKey { (r.job, r.round, r.attempt, r.contend) };
    let of = |t: &str| runs.iter().filter(|r| base_target(r) == t).map(|r| (key(r), r.io.iops)).collect::<Vec<_>>();
    let (fio, fio_busy) = (of(FIO_TARGET), of(FIO_BUSY_TARGET));
    let twins = |keep: &dyn Fn(&NvmeRun) -> bool| -> Vec<Twin> {
        runs.iter().filter(|r| keep(r)).map(|r| (key(r), r.target.clone(), r.io.iops, r.floor_ratio)).collect()
    };
    let in_vmm = twins(&|r| r.target.starts_with("iopath-") && !r.target.contains('@'));
    let quiet = twins(&|r| r.contend == 0);
    for r in runs.iter_mut() {
        if !is_fio_target(&r.target) {
            let over = |f: &[(RunKey, f64)]| {
                f.iter().find(|f| f.0 == key(r)).map(|f| f.1).filter(|&f| f > 0.0).map(|f| r.io.iops / f)
            };
            (r.fio_ratio, r.fio_busy_ratio) = (over(&fio), over(&fio_busy));
        }
        if let Some((base, _)) = r.target.split_once('@') {
            (r.vmm_ratio, r.vmm_floor_ratio) = over_twin(&in_vmm, base, r);
        }
        if r.contend > 0 {
            (r.quiet_ratio, r.quiet_floor_ratio) = over_twin(&quiet, &base_target(r), r);
        }
    }
}

#[cfg(test)]
mod relate_tests {
    use super::*;

    fn run(target: &str, round: u32, iops: f64, floor_ratio: Option<f64>) -> NvmeRun {
        let mut r = NvmeRun::new(target, "", 0, round, 1000, 1000);
        (r.io.iops, r.floor_ratio) = (iops, floor_ratio);
        r
    }

    #[test]
    fn out_of_process_runs_are_related_to_their_in_vmm_twin_by_iops_and_by_their_own_floors() {
        // Round 0: both in one placement. Round 1: the device process ran in a slower one,
        // which its own floor saw too.
        let mut runs = vec![
            run("iopath-bar", 0, 4.0e6, Some(0.5)),
            run("iopath-bar@vfio-user", 0, 3.8e6, Some(0.475)),
            run("iopath-bar", 1, 4.0e6, Some(0.5)),
            run("iopath-bar@vfio-user", 1, 1.0e6, Some(0.5)),
            run("iopath-shm@vfio-user", 1, 1.0e6, None),
        ];
        relate(&mut runs);
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(near(runs[1].vmm_ratio, 0.95) && near(runs[1].vmm_floor_ratio, 0.95));
        assert!(near(runs[3].vmm_ratio, 0.25) && near(runs[3].vmm_floor_ratio, 1.0));
        assert_eq!((runs[0].vmm_ratio, runs[0].vmm_floor_ratio), (None, None), "in the VMM: no twin");
        assert_eq!((runs[4].vmm_ratio, runs[4].vmm_floor_ratio), (None, None), "no in-VMM shm run");
        // The in-VMM twin was run again (attempt 1): no IOPS ratio across attempts, the floor one stays.
        runs[2].attempt = 1;
        relate(&mut runs);
        assert!(runs[3].vmm_ratio.is_none() && near(runs[3].vmm_floor_ratio, 1.0));
    }

    #[test]
    fn contended_rows_are_related_to_their_quiet_twin_and_to_fio_at_their_level() {
        let busy = |target: &str, round: u32, iops: f64, floor_ratio: Option<f64>| {
            let mut r = run(target, round, iops, floor_ratio);
            r.contend = 2;
            r
        };
        let mut runs = vec![
            run("iopath-adaptive", 0, 10e6, Some(0.5)),
            busy("iopath-adaptive+contend2", 0, 4e6, Some(0.4)),
            run("iopath-adaptive@vfio-user", 0, 9e6, Some(0.45)),
            busy("iopath-adaptive+contend2@vfio-user", 0, 2e6, Some(0.2)),
            run(FIO_TARGET, 0, 100e3, None),
            busy("fio (host)+contend2", 0, 50e3, None),
            busy("qemu+contend2", 1, 1e3, None),
        ];
        relate(&mut runs);
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(near(runs[1].quiet_ratio, 0.4) && near(runs[1].quiet_floor_ratio, 0.8), "{:?}", runs[1].quiet_ratio);
        // Out of process: its quiet twin is out of process too, its in-VMM one contended too.
        assert!(near(runs[3].quiet_ratio, 2.0 / 9.0) && near(runs[3].quiet_floor_ratio, 0.2 / 0.45));
        assert!(near(runs[3].vmm_ratio, 0.5) && near(runs[3].vmm_floor_ratio, 0.5));
        // fio at the same level: the quiet one for quiet rows, the busy one for busy rows.
        assert!(near(runs[0].fio_ratio, 100.0) && near(runs[1].fio_ratio, 80.0));
        assert!(is_fio_target(&runs[5].target) && runs[5].fio_ratio.is_none());
        assert!(near(runs[5].quiet_ratio, 0.5), "fio has a quiet twin too");
        for i in [0, 2, 4] {
            assert_eq!((runs[i].quiet_ratio, runs[i].quiet_floor_ratio), (None, None), "{} is quiet", runs[i].target);
        }
        assert_eq!(runs[6].quiet_ratio, None, "no quiet QEMU run");
        // The quiet twin was run again (attempt 1): no IOPS ratio across attempts, the floor one stays.
        runs[0].attempt = 1;
        relate(&mut runs);
        assert!(runs[1].quiet_ratio.is_none() && near(runs[1].quiet_floor_ratio, 0.8));
    }

    #[test]
    fn a_level_shows_in_names_only_beside_others() {
        let mut o = NvmeOptions { contend: vec![2], ..Default::default() };
        assert_eq!(contend_suffix(&o, 2), "");
        o.contend = vec![0, 2];
        assert_eq!((contend_suffix(&o, 0), contend_suffix(&o, 2)), (String::new(), "+contend2".into()));
        let mut r = run("iopath-shm+contend2@vfio-user", 0, 1.0, None);
        r.contend = 2;
        assert_eq!(base_target(&r), "iopath-shm@vfio-user");
    }

    #[test]
    fn file_rows_are_related_to_both_fio_rows_of_their_round_and_the_fio_rows_to_none() {
        let mut runs = vec![
            run("iopath-shm", 0, 60e3, None),
            run(FIO_TARGET, 0, 100e3, None),
            run(FIO_BUSY_TARGET, 0, 50e3, None),
            run("iopath-shm", 1, 70e3, None),
            run(FIO_TARGET, 1, 0.0, None),
        ];
        relate(&mut runs);
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(near(runs[0].fio_ratio, 0.6) && near(runs[0].fio_busy_ratio, 1.2));
        assert_eq!((runs[3].fio_ratio, runs[3].fio_busy_ratio), (None, None), "fio did nothing, and no busy row");
        for r in &runs[1..3] {
            assert_eq!((r.fio_ratio, r.fio_busy_ratio), (None, None), "{} is no file row", r.target);
            assert!(is_fio_target(&r.target));
        }
        assert!(!is_fio_target("iopath-shm") && !is_fio_target("qemu"));
    }
}

#[cfg(test)]
mod order_tests {
    use super::round_order;
    use super::run::{Kind, Target};

    #[test]
    fn odd_rounds_run_the_targets_in_reverse_and_twins_stay_together() {
        let t = |name: &str, contend| Target { name: name.into(), kind: Kind::Qemu, contend };
        let targets = [t("a", 0), t("a+2", 2), t("b", 0), t("b+2", 2)];
        let names = |r| round_order(&targets, r).iter().map(|t| t.name.as_str()).collect::<Vec<_>>();
        assert_eq!(names(0), ["a", "a+2", "b", "b+2"]);
        assert_eq!(names(1), ["b+2", "b", "a+2", "a"]);
        assert_eq!(names(2), names(0));
    }
}
