//! `bench nvme`'s command line (see `crate::args`).

use super::{Job, NvmeOptions};
use crate::args::{each_once, parse_bs, parse_runtime, parse_size_mb, size_fits_backend, FioFormat, Output, Peer};
use crate::guard::GuardConfig;
use clap::Args;

/// `bench nvme` options, named as fio names them. Without --rw/--bs/--iodepth/--numjobs
/// the two reference jobs run: randread 512 B at iodepth 16 and 4 KiB at iodepth 1.
/// (No --ramp_time: nvmeperf has no warm-up phase to map it to.)
#[derive(Args, Debug)]
pub struct NvmeArgs {
    /// Also run the jobs under QEMU's nvme on the backend kind iopath runs on
    /// (null: null-co; ram: a /dev/shm image; file: the same file), interleaved.
    #[arg(long, value_enum)]
    pub vs: Option<Peer>,
    /// Doorbell modes of iopath's controller, comma-separated (auto, shm, bar, ioeventfd, adaptive, bar-adaptive, mmio).
    #[arg(long, default_value = "auto,shm,bar,ioeventfd,adaptive,bar-adaptive,mmio")]
    pub doorbell: String,
    /// null, ram, or file:PATH (an existing file of at least 1 MiB or a
    /// block device; a missing one only with --create).
    #[arg(long, default_value = "ram")]
    pub backend: String,
    /// With --backend file:PATH: make PATH if it is missing (64 MiB),
    /// every byte written before it is measured (as fio lays out its files).
    /// Without it a missing PATH is an error; an existing file or block
    /// device is never created over, truncated or extended.
    #[arg(long)]
    pub create: bool,
    /// Where the controller runs, comma-separated, each in every round:
    /// vmm (in iopath's VMM), or a device process over vfio-user, mpqemu,
    /// ioregionfd (e.g. vmm,vfio-user compares the two in one run).
    #[arg(long, default_value = "vmm")]
    pub transport: String,
    /// read, write, randread, randwrite, randrw.
    #[arg(long, value_parser = ["read", "write", "randread", "randwrite", "randrw"])]
    pub rw: Option<String>,
    /// Block size: bytes, or with a suffix as fio takes it (512, 4k, 64k, 128k; 512 .. 128k, a multiple of 512).
    #[arg(long, value_parser = parse_bs)]
    pub bs: Option<u64>,
    /// Commands in flight per queue (1..=1024).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub iodepth: Option<u32>,
    /// The bytes the I/O ranges over, as fio's size (whole MiB, e.g. 64m, 1g):
    /// the namespace's size on a null or ram backend, and the file --create
    /// lays out (an existing file's namespace is the whole file). Default 64m.
    #[arg(long, value_parser = parse_size_mb)]
    pub size: Option<u64>,
    /// I/O queue pairs, each with its own submitter slot set (1..=16).
    #[arg(long, alias = "queues", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub numjobs: Option<u32>,
    /// randrw: the percentage of reads (0..=100; default 50, as fio); the
    /// guest counts and times reads and writes apart.
    #[arg(long, visible_alias = "rwmix-read", value_parser = clap::value_parser!(u32).range(0..=100))]
    pub rwmixread: Option<u32>,
    /// fio's iodepth_batch_submit: the guest driver rings its CQ head and SQ
    /// tail doorbells after every N commands it issues while reaping, so the
    /// controller starts on them while it reaps on (0..=1024). Without it (or
    /// 0) it rings once per reaping pass; fio's own default, 1, is a ring per command.
    #[arg(long = "iodepth_batch_submit", visible_alias = "iodepth-batch-submit",
          value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub iodepth_batch_submit: Option<u32>,
    /// The guest driver waits for completions on interrupts, as Linux's
    /// nvme driver does: a pass that finds none halts its vCPU until a CQ's
    /// MSI-X message (QEMU's nvme gets the same guest). Without it, it polls.
    #[arg(long, visible_alias = "irq_wait")]
    pub irq_wait: bool,
    /// fio's thinktime: microseconds the guest waits after a completion
    /// before the slot's next command (at iodepth 1: each I/O wakes an idle
    /// controller; at most 1000000).
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub thinktime: Option<u64>,
    /// Length of each run: seconds, or with a suffix (500ms, 2s, 1m).
    #[arg(long, alias = "time", value_parser = parse_runtime, default_value = "2")]
    pub runtime: f64,
    /// Rounds; each round runs every target once (A/B interleaving; odd rounds in reverse order, A B then B A).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// N guests at once, each with its own controller, all N in one device
    /// process (`iopath serve --controllers N --pollers M`), for each N
    /// given (e.g. 1,2,4,8,16): total IOPS and CPU per I/O (`controllers.rs`).
    /// Runs that scenario instead of the targets.
    #[arg(long, value_name = "N[,N..]")]
    pub controllers: Option<String>,
    /// With --controllers: the device process's poller threads (its --pollers M).
    #[arg(long, default_value_t = 1, value_name = "M",
          value_parser = clap::value_parser!(u64).range(1..=iopath_devices::nvme::pool::MAX_THREADS as u64))]
    pub pool_pollers: u64,
    /// With --controllers: also each N against one SPDK nvmf_tgt with N
    /// subsystems (VFIOUSER, null bdevs), from this install directory of
    /// harness/spdk/build.sh (bin/nvmf_tgt, bin/rpc.py).
    #[arg(long, value_name = "DIR", requires = "controllers")]
    pub controllers_vs_spdk: Option<std::path::PathBuf>,
    /// A short run: 1 round of 0.5 s runs.
    #[arg(long, conflicts_with_all = ["rounds", "runtime"])]
    pub quick: bool,
    /// LBA size: 512 or 4096.
    #[arg(long, default_value_t = 512,
          value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["512", "4096"]), |s| s.parse::<u32>().unwrap_or(512)))]
    pub lba: u32,
    /// Write a pattern over the namespace and read it back (data check, not a speed run).
    #[arg(long)]
    pub verify: bool,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// How the VMM backs guest RAM: auto (anonymous, in transparent huge
    /// pages; a memfd when a --transport names a device process), memfd,
    /// or hugetlb (a memfd in 2 MiB pages from the host's pool,
    /// vm.nr_hugepages: --mem/2 free pages).
    #[arg(long, default_value = "auto", value_name = "auto|memfd|hugetlb")]
    pub ram: iopath_vmm::RamKind,
    /// Controller poller counts, comma-separated (1..=16; more than 1 only in shm, bar and adaptive modes).
    #[arg(long, default_value = "1")]
    pub pollers: String,
    /// adaptive's forecast of steady gaps: on, off, or on,off (both, as two targets).
    #[arg(long, default_value = "on", value_name = "on|off|on,off")]
    pub forecast: String,
    /// State keeping of a controller in a device process over vfio-user (or
    /// ioregionfd): on (state memory offered: the controller records every
    /// command and a death is survived), off (none: a death stops the run),
    /// or on,off as targets of their own (`-nostate`), to measure its cost.
    #[arg(long = "state-memory", default_value = "on", value_name = "on|off|on,off", value_delimiter = ',')]
    pub state_memory: Vec<iopath_protocols::vfio_user::StateMemoryMode>,
    /// The guest driver's doorbells: 1, shadow doorbells where the mode offers them (Doorbell
    /// Buffer Config, as Linux's driver); 0, every doorbell a register store (as SPDK's); 0,1
    /// runs both as targets of their own (`-dbbuf0`).
    #[arg(long, default_value = "1", value_name = "0|1|0,1", value_delimiter = ',',
          value_parser = clap::value_parser!(u8).range(0..=1))]
    pub dbbuf: Vec<u8>,
    /// A file namespace's reads and writes on the guest's pages in place:
    /// auto (those within one page), on (all), off (none: bounce buffers),
    /// several (on,off) as targets of their own.
    #[arg(long = "in-place", visible_alias = "in_place", default_value = "auto", value_name = "auto|on|off[,..]")]
    pub in_place: String,
    /// A file namespace's operations go to the kernel every N (the device's
    /// side of a batch, as fio's iodepth_batch_submit is the submitter's; 0: all
    /// a queue pass fetched at once), several (0,1) as targets of their own (`-sbN`).
    #[arg(long = "submit-batch", visible_alias = "submit_batch", default_value = "0", value_name = "N[,M..]")]
    pub submit_batch: String,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Run N busy threads (at most 64) during every run, QEMU's and fio's
    /// included; several levels (0,2) run every target at each, one right
    /// after the other, with each contended row's ratio to its quiet twin.
    #[arg(long, default_value = "0", value_name = "N[,M..]", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(0..=crate::contend::MAX_CONTENDERS as i64))]
    pub contend: Vec<u32>,
    /// Thread placement. auto: the guest vCPU on the first allowed CPU, the
    /// device threads on the others; off: the scheduler's; or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: crate::pin::PinChoice,
    /// The controller's device timing model (its `timing=`, e.g. read:10us,
    /// read:ln:80us:300us+channels:32, read:20us+iops:100k): each iopath target
    /// also runs with it (`-timed`) right after itself, and a table sets the
    /// configured latency against the observed one (the timed run's
    /// percentiles less its twin's p1) and the ceilings against the IOPS.
    #[arg(long, value_name = "SPEC")]
    pub timing: Option<iopath_devices::block::timing::TimingSpec>,
    #[command(flatten)]
    pub guard: GuardConfig,
    #[command(flatten)]
    pub format: FioFormat,
    #[command(flatten)]
    pub out: Output,
}

impl NvmeArgs {
    pub fn options(&self) -> anyhow::Result<NvmeOptions> {
        let mut o = NvmeOptions {
            doorbells: each_once(
                "--doorbell",
                self.doorbell.split(',').filter(|s| !s.is_empty()).map(|d| d.parse()).collect::<Result<_, _>>()?,
                |d: &iopath_devices::nvme::DoorbellMode| d.to_string(),
            )?,
            backend: self.backend.parse()?,
            size_mb: self.size,
            transports: parse_transports(&self.transport)?,
            lba: self.lba,
            time_ms: if self.quick { 500 } else { (self.runtime * 1000.0).max(10.0) as u64 },
            rounds: if self.quick { 1 } else { self.rounds.max(1) },
            vs_qemu: self.vs == Some(Peer::Qemu),
            mem_mb: self.mem,
            ram: self.ram,
            timeout_s: self.timeout,
            contend: each_once("--contend", self.contend.clone(), |&n| n)?,
            pin: self.pin.placement(),
            progress: !self.out.quiet,
            pollers: parse_pollers(&self.pollers)?,
            forecast: parse_forecast(&self.forecast)?,
            dbbuf: each_once("--dbbuf", self.dbbuf.clone(), |&d| d)?.into_iter().map(|d| d == 1).collect(),
            in_place: parse_in_place(&self.in_place)?,
            submit_batch: parse_submit_batch(&self.submit_batch)?,
            state_memory: each_once("--state-memory", self.state_memory.clone(), |m| m.to_string())?,
            guard: self.guard,
            timing: self.timing.clone(),
            ..NvmeOptions::default()
        };
        let custom = self.rw.is_some()
            || self.bs.is_some()
            || self.iodepth.is_some()
            || self.numjobs.is_some()
            || self.rwmixread.is_some()
            || self.iodepth_batch_submit.is_some()
            || self.irq_wait;
        if custom || self.verify || self.thinktime.is_some() {
            o.jobs = vec![Job {
                rw: self.rw.clone().unwrap_or_else(|| "randread".into()),
                bs: self.bs.unwrap_or(4096),
                iodepth: self.iodepth.unwrap_or(16),
                queues: self.numjobs.unwrap_or(1),
                verify: self.verify,
                thinktime_us: self.thinktime.unwrap_or(0),
                rwmixread: self.rwmixread.unwrap_or(50),
                batch_submit: self.iodepth_batch_submit.unwrap_or(0),
                irq_wait: self.irq_wait,
            }];
        }
        if self.rwmixread.is_some() && self.rw.as_deref() != Some("randrw") {
            anyhow::bail!("--rwmixread is the share of reads of --rw randrw");
        }
        size_fits_backend(self.size, &o.backend)?;
        let file = matches!(o.backend, iopath_devices::block::StorageKind::File(_));
        if !file && o.in_place != [iopath_devices::nvme::InPlace::Auto] {
            anyhow::bail!("--in-place needs --backend file:PATH (only a file namespace bounces transfers)");
        }
        let offers = o.transports.iter().flatten().any(|t| t.offers_state_memory());
        if o.state_memory != [iopath_protocols::vfio_user::StateMemoryMode::On] && !offers {
            anyhow::bail!(
                "--state-memory {}: only a controller in a device process over vfio-user (or ioregionfd) keeps state \
                 in state memory; give --transport vfio-user (in the VMM and over mpqemu there is none to turn off)",
                self.state_memory.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(",")
            );
        }
        if !file && o.submit_batch != [0] {
            anyhow::bail!("--submit-batch needs --backend file:PATH (only a file namespace submits to the kernel)");
        }
        Ok(o)
    }
}

fn parse_transports(s: &str) -> anyhow::Result<Vec<Option<&'static dyn iopath_protocols::FunctionTransport>>> {
    let v = s
        .split(',')
        .map(|t| match t.trim() {
            "vmm" => Ok(None),
            // The controller is a whole PCI function: a queue transport is refused.
            t => iopath_protocols::transport(t)
                .and_then(|t| t.function_for("nvme"))
                .map(Some)
                .map_err(anyhow::Error::from),
        })
        .collect::<anyhow::Result<_>>()?;
    each_once("--transport", v, |t| t.map_or("vmm", |t| t.name()))
}

fn parse_forecast(s: &str) -> anyhow::Result<Vec<bool>> {
    let v = s
        .split(',')
        .map(|f| match f.trim() {
            "on" => Ok(true),
            "off" => Ok(false),
            _ => Err(anyhow::anyhow!("--forecast: {f:?} is not on or off")),
        })
        .collect::<anyhow::Result<_>>()?;
    each_once("--forecast", v, |&f| if f { "on" } else { "off" })
}

fn parse_in_place(s: &str) -> anyhow::Result<Vec<iopath_devices::nvme::InPlace>> {
    let v = s
        .split(',')
        .map(|f| f.trim().parse().map_err(|e| anyhow::anyhow!("--in-place: {e}")))
        .collect::<anyhow::Result<_>>()?;
    each_once("--in-place", v, |f: &iopath_devices::nvme::InPlace| f.to_string())
}

fn parse_submit_batch(s: &str) -> anyhow::Result<Vec<u16>> {
    let max = iopath_devices::nvme::MAX_SUBMIT_BATCH;
    let v = s
        .split(',')
        .map(|n| match n.trim().parse::<u16>() {
            Ok(v) if v <= max => Ok(v),
            _ => Err(anyhow::anyhow!("--submit-batch: {n:?} is not an operation count (0..={max})")),
        })
        .collect::<anyhow::Result<_>>()?;
    each_once("--submit-batch", v, |&n| n)
}

fn parse_pollers(s: &str) -> anyhow::Result<Vec<u8>> {
    let v = s
        .split(',')
        .map(|p| match p.trim().parse::<u8>() {
            Ok(v @ 1..=16) => Ok(v),
            _ => Err(anyhow::anyhow!("--pollers: {p:?} is not a poller count (1..=16)")),
        })
        .collect::<anyhow::Result<_>>()?;
    each_once("--pollers", v, |&p| p)
}
