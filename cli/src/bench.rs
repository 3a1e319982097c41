//! `iopath bench [exits|nvme|floor|all]`: each benchmark's own options (fio's
//! names where fio has one), turned into the bench crate's option structs.

use clap::{Args, Subcommand, ValueEnum};
use iopath_bench::exits::ExitsOptions;
use iopath_bench::floor::{FloorOptions, DEPTHS};
use iopath_bench::nvme::{Job, NvmeOptions};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
pub enum Peer {
    /// QEMU + KVM with its own devices, same guest image, interleaved.
    Qemu,
}

/// `iopath bench`: with no subcommand, the exit-cost table (`bench exits`).
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchCmd {
    #[command(subcommand)]
    pub which: Option<Which>,
    #[command(flatten)]
    pub exits: ExitsArgs,
}

#[derive(Subcommand, Debug)]
pub enum Which {
    /// The exit-cost table: cpu, in-kernel, VMM exits, pci-testdev, doorbell round trips, transports.
    Exits(ExitsArgs),
    /// The guest's polled NVMe driver against iopath's NVMe controller (and QEMU's with --vs qemu).
    Nvme(Box<NvmeArgs>),
    /// One block workload on every path to a guest's disk: NVMe, virtio-blk (exit, ioeventfd,
    /// poll), vfio-user, vhost-user, QEMU's virtio-blk-pci and vhost-user-blk-pci, same backend.
    Blk(BlkArgs),
    /// The polled SQ/CQ ring between two host threads at QD 1/16/64: the floor under `bench nvme`.
    Floor(FloorArgs),
    /// SPDK's stock spdk_nvme_perf against `iopath serve nvme` (default doorbell mode) and against
    /// SPDK's own nvmf_tgt VFIOUSER target, side by side, rounds interleaved.
    Spdk(SpdkArgs),
    /// Every benchmark in its default matrix; writes report.md, results.json, results.csv and SVG plots to --out.
    All(AllArgs),
}

/// Options every benchmark has.
#[derive(Args, Debug)]
pub struct Output {
    /// Write the results as JSON to PATH ("-" for standard output).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// No progress lines: the table only (nothing but the JSON with --json -).
    #[arg(long, short)]
    pub quiet: bool,
}

/// `--output-format` of the benches that run I/O (fio's option).
#[derive(Args, Debug)]
pub struct FioFormat {
    /// normal: the table; json, json+: fio's JSON on standard output (json+ with
    /// the latency histograms' bins), the table on standard error (none with --quiet).
    #[arg(long = "output-format", visible_alias = "output_format", default_value = "normal",
          value_parser = clap::builder::TypedValueParser::map(
              clap::builder::PossibleValuesParser::new(iopath_bench::fioout::FORMATS),
              |s| s.parse::<iopath_bench::fioout::Format>().unwrap_or(iopath_bench::fioout::Format::Normal)))]
    pub output_format: iopath_bench::fioout::Format,
}

impl FioFormat {
    /// Refuses `--json -` beside fio's JSON: both would go to standard output.
    pub fn check(&self, out: &Output) -> anyhow::Result<()> {
        if self.output_format != iopath_bench::fioout::Format::Normal
            && out.json.as_deref() == Some(std::path::Path::new("-"))
        {
            anyhow::bail!("--json - and --output-format json both write to standard output: give --json a file");
        }
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct ExitsArgs {
    /// Also run the same workload on this peer, in the same run, interleaved.
    #[arg(long, value_enum)]
    pub vs: Option<Peer>,
    /// Rounds; each round runs every target once (A/B interleaving).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Timed batches per row and round (1..=64).
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub batches: u32,
    /// Target length of one batch, in microseconds.
    #[arg(long, default_value_t = 20_000)]
    pub batch_us: u64,
    /// Only rows whose names start with one of these (comma-separated).
    #[arg(long)]
    pub only: Option<String>,
    /// Skip the bare KVM_RUN floor.
    #[arg(long)]
    pub no_floor: bool,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// A short run: 1 round, 5 batches of 5 ms.
    #[arg(long, conflicts_with_all = ["rounds", "batches", "batch_us"])]
    pub quick: bool,
    /// Out-of-process transports to run pci-testdev over, comma-separated
    /// (mpqemu, vfio-user, ioregionfd, ioregionfd-posted), or "none".
    #[arg(long, default_value = "mpqemu,vfio-user,ioregionfd,ioregionfd-posted")]
    pub transports: String,
    /// Poll a socket this long for a reply or request before sleeping
    /// (client and the device processes it starts); 0 sleeps at once, as QEMU.
    #[arg(long, default_value_t = 0, value_name = "US")]
    pub spin_us: u64,
    /// Run N busy threads (at most 64) during the measured runs, QEMU's included.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub contend: u32,
    /// Guest privilege levels to run the access loops at, comma-separated:
    /// 3 (ring 3, the default), 0 (ring 0), or 0,3 (both, with the r0/r3 ratio).
    /// The QEMU and device-process targets run at 3.
    #[arg(long, default_value = "3", value_delimiter = ',', value_parser = clap::value_parser!(u8).range(0..=3))]
    pub cpl: Vec<u8>,
    #[command(flatten)]
    pub guard: GuardArgs,
    #[command(flatten)]
    pub out: Output,
}

/// The guard on figures (bench exits and nvme).
#[derive(Args, Debug)]
pub struct GuardArgs {
    /// A row marked by the guard (a figure below its floor, or rounds spread
    /// over --max-spread) is run again up to this many times before the mark stays.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(0..=5))]
    pub reruns: u32,
    /// The guard marks rows whose rounds' max/min is above this.
    #[arg(long, default_value_t = 2.0)]
    pub max_spread: f64,
}

impl GuardArgs {
    pub fn config(&self) -> iopath_bench::guard::GuardConfig {
        iopath_bench::guard::GuardConfig { reruns: self.reruns, max_spread: self.max_spread, ..Default::default() }
    }
}

impl ExitsArgs {
    pub fn options(&self) -> anyhow::Result<ExitsOptions> {
        let (rounds, batches, batch_us) =
            if self.quick { (1, 5, 5000) } else { (self.rounds.max(1), self.batches, self.batch_us.max(10)) };
        let transports: Vec<String> = self
            .transports
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty() && *t != "none")
            .map(String::from)
            .collect();
        Ok(ExitsOptions {
            rounds,
            batches,
            batch_us,
            only: self.only.clone(),
            vs_qemu: self.vs == Some(Peer::Qemu),
            floor: !self.no_floor,
            timeout_s: self.timeout,
            progress: !self.out.quiet,
            // "none" alone is no transport; a list may not repeat one.
            transports: if transports.is_empty() {
                transports
            } else {
                each_once("--transports", transports, |t: &String| t.clone())?
            },
            spin_us: self.spin_us,
            contend: self.contend,
            cpls: each_once("--cpl", self.cpl.clone(), |&c| c)?,
            guard: self.guard.config(),
            ..ExitsOptions::default()
        })
    }
}

/// A list option's values, each once, in the order given: a value given
/// twice would run the same target twice under one name. `key` is how the
/// option spells a value.
fn each_once<T, K: PartialEq + std::fmt::Display>(
    opt: &str,
    v: Vec<T>,
    key: impl Fn(&T) -> K,
) -> anyhow::Result<Vec<T>> {
    for (i, x) in v.iter().enumerate() {
        if v[..i].iter().any(|y| key(y) == key(x)) {
            anyhow::bail!("{opt} {} given twice", key(x));
        }
    }
    if v.is_empty() {
        anyhow::bail!("{opt}: no value");
    }
    Ok(v)
}

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
          value_parser = clap::value_parser!(u32).range(0..=iopath_bench::contend::MAX_CONTENDERS as i64))]
    pub contend: Vec<u32>,
    /// Thread placement. auto: the guest vCPU on the first allowed CPU, the
    /// device threads on the others; off: the scheduler's; or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: iopath_bench::pin::PinChoice,
    #[command(flatten)]
    pub guard: GuardArgs,
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
            guard: self.guard.config(),
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
        if !file && o.submit_batch != [0] {
            anyhow::bail!("--submit-batch needs --backend file:PATH (only a file namespace submits to the kernel)");
        }
        Ok(o)
    }
}

/// `bench blk`: seq/rand read/write for throughput (128 KiB at --iodepth) and
/// latency (4 KiB at QD1) on each target, interleaved round by round.
#[derive(Args, Debug)]
pub struct BlkArgs {
    /// Targets, comma-separated (default: all): nvme-mmio, nvme-shm, nvme-bar, virtio-exit,
    /// virtio-ioeventfd, virtio-poll, virtio@vfio-user, vhost-user, qemu-virtio-blk-pci,
    /// qemu-vhost-user-blk-pci.
    #[arg(long)]
    pub targets: Option<String>,
    /// The backend every target stands on: null, ram, or file:PATH (QEMU: null-co, a /dev/shm image, the file;
    /// PATH an existing file of at least 1 MiB or a block device, a missing one only with --create).
    #[arg(long, default_value = "null")]
    pub backend: String,
    /// With --backend file:PATH: make PATH if it is missing (--size-mb),
    /// every byte written before it is measured (as fio lays out its files).
    /// Without it a missing PATH is an error; an existing file or block
    /// device is never created over, truncated or extended.
    #[arg(long)]
    pub create: bool,
    /// Disk size in MiB (null and ram backends, and the file --create lays out; default 64).
    #[arg(long, visible_alias = "size_mb", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub size_mb: Option<u64>,
    /// The disk size as fio's size (whole MiB: 64m, 1g), instead of --size-mb.
    #[arg(long, value_parser = parse_size_mb, conflicts_with = "size_mb")]
    pub size: Option<u64>,
    /// Queue depth of the throughput jobs (1..=64; the latency jobs run at 1).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub iodepth: u32,
    /// Block size of every job (512 .. 128k, a multiple of 512; fio's suffixes).
    /// Without it: 128k for the throughput jobs, 4k for the latency jobs.
    #[arg(long, value_parser = parse_bs)]
    pub bs: Option<u64>,
    /// Length of each run: seconds, or with a suffix (500ms, 2s, 1m).
    #[arg(long, alias = "time", value_parser = parse_runtime, default_value = "2")]
    pub runtime: f64,
    /// Rounds; each round runs every target once per job (interleaved).
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// A short run: 1 round of 0.3 s runs.
    #[arg(long, conflicts_with_all = ["rounds", "runtime"])]
    pub quick: bool,
    /// The target the ratio column divides by.
    #[arg(long, default_value_t = iopath_bench::blk::DEFAULT_REFERENCE.to_string())]
    pub reference: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub mem: u64,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Thread placement (see `bench nvme --pin`): auto, off, or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: iopath_bench::pin::PinChoice,
    #[command(flatten)]
    pub format: FioFormat,
    #[command(flatten)]
    pub out: Output,
}

impl BlkArgs {
    pub fn options(&self) -> anyhow::Result<iopath_bench::blk::BlkOptions> {
        let d = iopath_bench::blk::BlkOptions::default();
        let backend = self.backend.parse()?;
        let size_mb = self.size.or(self.size_mb);
        size_fits_backend(size_mb, &backend)?;
        Ok(iopath_bench::blk::BlkOptions {
            targets: match &self.targets {
                Some(t) => iopath_bench::blk::parse_targets(t).map_err(|e| anyhow::anyhow!("--targets: {e}"))?,
                None => d.targets.clone(),
            },
            backend,
            size_mb: size_mb.unwrap_or(d.size_mb),
            tput_bs: self.bs.unwrap_or(d.tput_bs),
            lat_bs: self.bs.unwrap_or(d.lat_bs),
            tput_qd: self.iodepth,
            time_ms: if self.quick { 300 } else { (self.runtime * 1000.0).max(10.0) as u64 },
            rounds: if self.quick { 1 } else { self.rounds.max(1) },
            reference: match iopath_bench::blk::parse_targets(&self.reference) {
                Ok(t) if t.len() == 1 => t[0],
                _ => anyhow::bail!(
                    "--reference: {:?} is not one target of {}",
                    self.reference,
                    iopath_bench::blk::Target::all().iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
                ),
            },
            mem_mb: self.mem,
            timeout_s: self.timeout,
            progress: !self.out.quiet,
            pin: self.pin.placement(),
            ..d
        })
    }
}

/// `iopath bench blk`: runs it and hands its table, JSON and fio's JSON (if
/// asked for) to `emit`; the exit status (1 if a target failed or a routing
/// check did not hold).
pub fn blk(
    a: &BlkArgs,
    emit: impl FnOnce(&str, &serde_json::Value, Option<iopath_bench::fioout::Output>) -> anyhow::Result<()>,
) -> anyhow::Result<i32> {
    use iopath_bench::fioout::Format;
    let o = a.options()?;
    a.format.check(&a.out)?;
    let bytes = iopath_bench::nvme::namespace_size(&o.backend, Some(o.size_mb));
    iopath_bench::backing::prepare(&o.backend, bytes, a.create)?;
    let r = iopath_bench::blk::run_blk(&o)?;
    let fio =
        (a.format.output_format != Format::Normal).then(|| r.fio_output(a.format.output_format == Format::JsonPlus));
    emit(&r.table(), &r.json(), fio)?;
    Ok(crate::status(&r.errors))
}

/// `bench spdk`: spdk_nvme_perf's jobs (one qpair each), every --rw x --bs x --iodepth.
#[derive(Args, Debug)]
pub struct SpdkArgs {
    /// perf's patterns, comma-separated: randread, randwrite, read, write.
    #[arg(long, default_value = "randread", value_delimiter = ',',
          value_parser = ["read", "write", "randread", "randwrite"])]
    pub rw: Vec<String>,
    /// Block sizes, comma-separated: bytes or with fio's suffixes (512 .. 128k, a multiple of the LBA).
    #[arg(long, default_value = "4k,512", value_delimiter = ',', value_parser = parse_bs)]
    pub bs: Vec<u64>,
    /// Queue depths, comma-separated (1..=1024).
    #[arg(long, default_value = "1,16,64,128", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub iodepth: Vec<u32>,
    /// Length of each perf run in whole seconds (perf's -t).
    #[arg(long, alias = "time", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub runtime: u64,
    /// Rounds; each runs every job against both targets (even rounds iopath first, odd rounds nvmf_tgt first).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// A short run: 1 round of 1 s runs.
    #[arg(long, conflicts_with_all = ["rounds", "runtime"])]
    pub quick: bool,
    /// Namespace size in MiB, the same on both targets.
    #[arg(long, visible_alias = "size_mb", default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub size_mb: u64,
    /// The namespace size as fio's size (whole MiB: 64m, 1g), instead of --size-mb.
    #[arg(long, value_parser = parse_size_mb, conflicts_with = "size_mb")]
    pub size: Option<u64>,
    /// LBA size: 512 or 4096, the same on both targets.
    #[arg(long, default_value_t = 512,
          value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["512", "4096"]), |s| s.parse::<u32>().unwrap_or(512)))]
    pub lba: u32,
    /// iopath serve's doorbell mode (`doorbell=`); without it none is given: the controller's
    /// default, auto.
    #[arg(long, value_name = "MODE")]
    pub doorbell: Option<iopath_devices::nvme::DoorbellMode>,
    /// Where perf (-c) and the targets (iopath serve's affinity, nvmf_tgt's -m) run: auto (perf
    /// on the first allowed CPU, the targets on the second) or PERF,TARGET. SPDK pins its own
    /// threads, so there is no off.
    #[arg(long, default_value = "auto", value_name = "auto|PERF,TARGET")]
    pub pin: iopath_bench::pin::PinChoice,
    /// The SPDK install directory harness/spdk/build.sh printed (bin/spdk_nvme_perf, bin/nvmf_tgt,
    /// bin/rpc.py); default: run harness/spdk/build.sh of this source tree (cached; builds if missing).
    #[arg(long, value_name = "DIR")]
    pub spdk: Option<PathBuf>,
    #[command(flatten)]
    pub format: FioFormat,
    #[command(flatten)]
    pub out: Output,
}

impl SpdkArgs {
    pub fn options(&self) -> anyhow::Result<iopath_bench::spdk::SpdkOptions> {
        use iopath_bench::pin::PinChoice;
        use iopath_bench::spdk::{perf::PerfJob, SpdkOptions};
        let pin = match self.pin {
            PinChoice::Off => anyhow::bail!(
                "--pin off: SPDK's perf and nvmf_tgt always pin their threads to the cores of their masks; give auto or PERF,TARGET"
            ),
            p => p.placement().ok_or_else(|| anyhow::anyhow!("--pin auto needs two CPUs this process may use"))?,
        };
        let rw = each_once("--rw", self.rw.clone(), |r| r.clone())?;
        let bs = each_once("--bs", self.bs.clone(), |&b| b)?;
        let qd = each_once("--iodepth", self.iodepth.clone(), |&q| q)?;
        let mut jobs = Vec::new();
        for rw in &rw {
            for &bs in &bs {
                jobs.extend(qd.iter().map(|&iodepth| PerfJob { rw: rw.clone(), bs, iodepth }));
            }
        }
        Ok(SpdkOptions {
            jobs,
            runtime_s: if self.quick { 1 } else { self.runtime },
            rounds: if self.quick { 1 } else { self.rounds },
            size_mb: match self.size {
                Some(m) if m > 65536 => anyhow::bail!("--size: at most 64g (65536 MiB)"),
                Some(m) => m,
                None => self.size_mb,
            },
            lba: self.lba,
            doorbell: self.doorbell,
            pin,
            spdk: self.spdk.clone(),
            iopath_exe: None,
            progress: !self.out.quiet,
        })
    }
}

#[derive(Args, Debug)]
pub struct FloorArgs {
    /// Rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Milliseconds per queue depth and round.
    #[arg(long, default_value_t = 1000, value_name = "T")]
    pub time_ms: u64,
    /// One queue depth instead of 1, 16 and 64.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub iodepth: Option<u32>,
    /// A short run: 1 round of 100 ms per queue depth.
    #[arg(long, conflicts_with_all = ["rounds", "time_ms"])]
    pub quick: bool,
    /// Thread placement: auto (submitter on the first allowed CPU, poller on
    /// the next), off (the scheduler's), or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: iopath_bench::pin::PinChoice,
    #[command(flatten)]
    pub out: Output,
}

impl FloorArgs {
    // `..default()` sets whatever fields FloorOptions gains later.
    #[allow(clippy::needless_update)]
    pub fn options(&self) -> FloorOptions {
        FloorOptions {
            depths: self.iodepth.map_or(DEPTHS.to_vec(), |d| vec![d]),
            rounds: if self.quick { 1 } else { self.rounds.max(1) },
            time_ms: if self.quick { 100 } else { self.time_ms.max(1) },
            cpus: self.pin.placement().map(|p| p.pair()),
            progress: !self.out.quiet,
            ..FloorOptions::default()
        }
    }
}

#[derive(Args, Debug)]
pub struct AllArgs {
    /// Directory for report.md, results.json, results.csv and the SVG plots (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A short matrix: 1 round, short runs, the NVMe sweep at iodepths 1, 4, 16 (not 64).
    #[arg(long, conflicts_with_all = ["rounds"])]
    pub quick: bool,
    /// Rounds of every benchmark.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Leave QEMU out even where it is installed.
    #[arg(long)]
    pub no_qemu: bool,
    /// Only a few exit rows over one out-of-process transport, NVMe shm and
    /// mmio at iodepths 1 and 16 in the VMM and over vfio-user, and blk on two
    /// virtio-blk targets: a smoke run of the whole pipeline (tests use it).
    #[arg(long, requires = "quick")]
    pub smoke: bool,
    /// No progress bar, no tables: only the files.
    #[arg(long, short)]
    pub quiet: bool,
    /// Thread placement for nvme and floor (see `bench nvme --pin`).
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: iopath_bench::pin::PinChoice,
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

/// A size as fio writes one: a number of bytes with an optional binary
/// suffix (k, kb, kib = 1024; m, mb, mib = 1024^2; g, gb, gib = 1024^3), any case.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, suffix) = t.split_at(digits);
    let n: u64 = n.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512, 4k, 64k)"))?;
    let unit: u64 = match suffix {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown size suffix {suffix:?} (k, m, g)")),
    };
    n.checked_mul(unit).ok_or_else(|| format!("{s:?} is too large"))
}

/// `--size`: fio's size, in whole MiB (1 MiB .. 1 TiB).
fn parse_size_mb(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v == 0 || !v.is_multiple_of(1 << 20) || v > 1 << 40 {
        return Err(format!("{s:?} = {v} bytes: the size must be whole MiB (e.g. 64m, 1g), 1m .. 1024g"));
    }
    Ok(v >> 20)
}

/// `--size` is a null or ram disk's size, or the size of the file `--create`
/// lays out: with an existing file the namespace is the whole file, and a
/// size given there would be ignored, so it is an error.
fn size_fits_backend(size_mb: Option<u64>, backend: &iopath_devices::block::StorageKind) -> anyhow::Result<()> {
    if let (Some(_), iopath_devices::block::StorageKind::File(p)) = (size_mb, backend) {
        if p.exists() {
            anyhow::bail!(
                "--size: {} exists, and its namespace is the whole file or device; a size applies to a null or \
                 ram backend, or to a missing file that --create lays out",
                p.display()
            );
        }
    }
    Ok(())
}

/// `--bs`: a size nvmeperf can issue: 512 .. 128 KiB (the controller's MDTS), a multiple of 512.
fn parse_bs(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if !(512..=131_072).contains(&v) || !v.is_multiple_of(512) {
        return Err(format!("{s:?} = {v} bytes: the block size must be 512 .. 131072 (128k), a multiple of 512"));
    }
    Ok(v)
}

/// `--runtime`: seconds, or a number with ms, s or m (fio's time suffixes); 0.01 .. 3600 s.
pub fn parse_runtime(s: &str) -> Result<f64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t.as_str(), 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("{s:?} is not a run time (e.g. 2, 500ms, 10s)"))?;
    let secs = v * scale;
    if !(0.01..=3600.0).contains(&secs) {
        return Err(format!("{s:?}: the run time must be 10ms .. 3600s"));
    }
    Ok(secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(subcommand)]
        cmd: Top,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Top {
        Bench(BenchCmd),
    }

    fn parse(args: &[&str]) -> Result<BenchCmd, clap::Error> {
        let mut v = vec!["iopath", "bench"];
        v.extend_from_slice(args);
        T::try_parse_from(v).map(|t| match t.cmd {
            Top::Bench(b) => b,
        })
    }

    fn nvme(args: &[&str]) -> NvmeArgs {
        let mut v = vec!["nvme"];
        v.extend_from_slice(args);
        match parse(&v).unwrap().which {
            Some(Which::Nvme(n)) => *n,
            w => panic!("not nvme: {w:?}"),
        }
    }

    #[test]
    fn exits_takes_cpl_lists_and_the_guards_budget() {
        let e = |args: &[&str]| {
            let mut v = vec!["exits"];
            v.extend_from_slice(args);
            match parse(&v).unwrap().which {
                Some(Which::Exits(e)) => e.options().unwrap(),
                w => panic!("not exits: {w:?}"),
            }
        };
        assert_eq!(e(&[]).cpls, vec![3]);
        assert_eq!(e(&["--cpl", "0,3"]).cpls, vec![0, 3]);
        let o = e(&["--reruns", "0", "--max-spread", "1.5"]);
        assert_eq!((o.guard.reruns, o.guard.max_spread, o.guard.min_floor_ratio), (0, 1.5, 0.95));
        let j = &nvme(&["--rw", "randrw", "--rwmixread", "70"]).options().unwrap().jobs[0];
        assert_eq!((j.rw.as_str(), j.rwmixread, j.label()), ("randrw", 70, "randrw 4k qd16 x1 70% reads".to_string()));
        assert!(parse(&["nvme", "--rwmixread", "101"]).is_err());
        let j = &nvme(&["--rw", "randrw", "--rwmix-read", "0"]).options().unwrap().jobs[0];
        assert_eq!(j.rwmixread, 0, "fio's spelling and the hyphenated one");
        let e = nvme(&["--rw", "randread", "--rwmixread", "70"]).options().unwrap_err();
        assert!(e.to_string().contains("--rw randrw"), "{e}");
        assert!(nvme(&["--rwmixread", "70"]).options().is_err(), "randread by default");
        let j = &nvme(&["--bs", "512", "--iodepth_batch_submit", "4"]).options().unwrap().jobs[0];
        assert_eq!((j.batch_submit, j.label()), (4, "randread 512 qd16 x1 batch 4".to_string()));
        let o = nvme(&["--backend", "file:/x", "--submit-batch", "0,1"]).options().unwrap();
        assert_eq!(o.submit_batch, [0, 1]);
        for bad in [
            &["--submit-batch", "1"][..],
            &["--backend", "file:/x", "--submit-batch", "257"],
            &["--backend", "file:/x", "--submit-batch", "1,1"],
        ] {
            assert!(nvme(bad).options().is_err(), "{bad:?}");
        }
        let n = nvme(&["--reruns", "1"]).options().unwrap();
        assert_eq!((n.guard.reruns, n.guard.max_spread), (1, 2.0));
        assert!(parse(&["exits", "--cpl", "7"]).is_err());
        assert!(parse(&["exits", "--reruns", "9"]).is_err());
    }

    #[test]
    fn list_options_take_each_value_once() {
        let o = nvme(&["--doorbell", "shm,adaptive", "--pollers", "1,2", "--forecast", "on,off"]).options().unwrap();
        assert_eq!((o.doorbells.len(), o.pollers, o.forecast), (2, vec![1, 2], vec![true, false]));
        assert_eq!(nvme(&["--transport", "vmm,vfio-user"]).options().unwrap().transports.len(), 2);
        assert_eq!(nvme(&["--contend", "2,0"]).options().unwrap().contend, vec![2, 0]);
        assert_eq!(nvme(&["--dbbuf", "0,1"]).options().unwrap().dbbuf, [false, true]);
        assert_eq!(nvme(&[]).options().unwrap().dbbuf, [true]);
        assert!(parse(&["nvme", "--dbbuf", "2"]).is_err());
        let o = nvme(&["--backend", "file:/x", "--in-place", "on,off"]).options().unwrap();
        assert_eq!(o.in_place, [iopath_devices::nvme::InPlace::On, iopath_devices::nvme::InPlace::Off]);
        let e = nvme(&["--in-place", "on"]).options().unwrap_err().to_string();
        assert!(e.contains("--backend file:PATH"), "{e}");
        assert!(nvme(&["--backend", "file:/x", "--in-place", "sometimes"]).options().is_err());
        let exits = |args: &[&str]| match parse(&[&["exits"], args].concat()).unwrap().which {
            Some(Which::Exits(e)) => e.options(),
            w => panic!("not exits: {w:?}"),
        };
        assert_eq!(exits(&["--cpl", "0,3"]).unwrap().cpls, vec![0, 3]);
        assert_eq!(exits(&["--cpl", "3,3"]).unwrap_err().to_string(), "--cpl 3 given twice");
        let e = exits(&["--transports", "mpqemu,vfio-user,mpqemu"]).unwrap_err().to_string();
        assert_eq!(e, "--transports mpqemu given twice");
        assert!(exits(&["--transports", "none"]).unwrap().transports.is_empty());
        for (opt, v, said) in [
            ("--doorbell", "shm,bar,shm", "--doorbell shm given twice"),
            ("--pollers", "2,2", "--pollers 2 given twice"),
            ("--forecast", "on,on", "--forecast on given twice"),
            ("--in-place", "off,auto,off", "--in-place off given twice"),
            ("--transport", "vfio-user,vmm,vfio-user", "--transport vfio-user given twice"),
            ("--contend", "0,0", "--contend 0 given twice"),
            ("--dbbuf", "1,1", "--dbbuf 1 given twice"),
            ("--doorbell", ",", "--doorbell: no value"),
        ] {
            let e = nvme(&[opt, v]).options().expect_err(v).to_string();
            assert_eq!(e, said);
        }
    }

    #[test]
    fn sizes_take_fio_suffixes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert!(parse_size("4x").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999999999999k").is_err());
        assert_eq!(nvme(&["--bs", "64k"]).bs, Some(65536));
        assert_eq!(nvme(&["--bs", "512"]).bs, Some(512));
        // 1m is a size, but past the controller's 128 KiB transfer limit.
        assert!(parse(&["nvme", "--bs", "1m"]).is_err());
        assert!(parse(&["nvme", "--bs", "1000"]).is_err());
    }

    #[test]
    fn fio_spellings_and_hyphenated_ones_are_the_same_option() {
        for (a, b) in [
            ("--iodepth_batch_submit", "--iodepth-batch-submit"),
            ("--submit-batch", "--submit_batch"),
            ("--in-place", "--in_place"),
            ("--irq-wait", "--irq_wait"),
        ] {
            let value: &[&str] = match a {
                "--iodepth_batch_submit" => &["4"],
                "--submit-batch" => &["0,1"],
                "--in-place" => &["on"],
                _ => &[],
            };
            let args = |o: &'static str| [&["--backend", "file:/x", o][..], value].concat();
            let (x, y) = (nvme(&args(a)).options().unwrap(), nvme(&args(b)).options().unwrap());
            assert_eq!(format!("{:?}", x.jobs), format!("{:?}", y.jobs), "{a} {b}");
            assert_eq!((x.submit_batch, x.in_place), (y.submit_batch, y.in_place), "{a} {b}");
        }
        assert_eq!(nvme(&["--iodepth-batch-submit", "3"]).options().unwrap().jobs[0].batch_submit, 3);
        let blk = |args: &[&str]| match parse(&[&["blk"], args].concat()) {
            Ok(BenchCmd { which: Some(Which::Blk(b)), .. }) => b.options(),
            Ok(w) => panic!("not blk: {w:?}"),
            Err(e) => Err(anyhow::anyhow!("{e}")),
        };
        assert_eq!(blk(&["--size_mb", "32"]).unwrap().size_mb, 32);
        assert_eq!(blk(&["--size", "1g"]).unwrap().size_mb, 1024);
        assert!(blk(&["--size", "1g", "--size-mb", "3"]).is_err());
    }

    #[test]
    fn size_is_the_namespace_of_a_null_ram_or_created_disk_never_an_ignored_one() {
        assert_eq!(nvme(&["--size", "128m"]).options().unwrap().size_mb, Some(128));
        assert_eq!(nvme(&[]).options().unwrap().size_mb, None);
        for bad in ["100k", "0", "1m1", "2048g"] {
            assert!(parse(&["nvme", "--size", bad]).is_err(), "{bad}");
        }
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        // An existing file is its own size: --size there would be ignored.
        let f = std::env::temp_dir().join(format!("iopath-size-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let backend = format!("file:{}", f.display());
        let e = nvme(&["--backend", &backend, "--size", "8m"]).options().unwrap_err().to_string();
        assert!(e.contains("exists"), "{e}");
        let blk = match parse(&["blk", "--backend", &backend, "--size-mb", "8"]).unwrap().which {
            Some(Which::Blk(b)) => b,
            w => panic!("{w:?}"),
        };
        assert!(blk.options().is_err());
        std::fs::remove_file(&f).unwrap();
        // A missing one (--create lays it out at that size) takes it.
        assert_eq!(nvme(&["--backend", &backend, "--size", "8m"]).options().unwrap().size_mb, Some(8));
    }

    #[test]
    fn blk_bs_is_every_jobs_block_size() {
        let b = match parse(&["blk", "--bs", "64k"]).unwrap().which {
            Some(Which::Blk(b)) => b.options().unwrap(),
            w => panic!("{w:?}"),
        };
        assert_eq!((b.tput_bs, b.lat_bs), (65536, 65536));
        assert!(b.jobs().iter().all(|j| j.job.bs == 65536 && j.name.contains("64k")));
        let d = match parse(&["blk"]).unwrap().which {
            Some(Which::Blk(b)) => b.options().unwrap(),
            w => panic!("{w:?}"),
        };
        assert_eq!((d.tput_bs, d.lat_bs), (128 << 10, 4096));
        assert!(parse(&["blk", "--bs", "256k"]).is_err());
    }

    #[test]
    fn runtime_takes_seconds_and_suffixes_and_time_is_its_alias() {
        assert_eq!(parse_runtime("2"), Ok(2.0));
        assert_eq!(parse_runtime("500ms"), Ok(0.5));
        assert_eq!(parse_runtime("1m"), Ok(60.0));
        assert!(parse_runtime("0").is_err());
        assert!(parse_runtime("fast").is_err());
        assert_eq!(nvme(&["--time", "0.3"]).options().unwrap().time_ms, 300);
        assert_eq!(nvme(&["--runtime", "750ms"]).options().unwrap().time_ms, 750);
    }

    #[test]
    fn numjobs_is_the_queue_count_and_queues_its_alias() {
        let o = nvme(&["--numjobs", "4"]).options().unwrap();
        assert_eq!(o.jobs.len(), 1);
        assert_eq!(o.jobs[0].queues, 4);
        assert_eq!(nvme(&["--queues", "2"]).numjobs, Some(2));
        assert!(parse(&["nvme", "--numjobs", "17"]).is_err());
    }

    #[test]
    fn quick_conflicts_with_an_explicit_runtime_or_rounds() {
        for extra in [&["--runtime", "3"][..], &["--time", "3"], &["--rounds", "2"]] {
            let mut a = vec!["nvme", "--quick"];
            a.extend_from_slice(extra);
            let e = parse(&a).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{a:?}");
        }
        let e = parse(&["exits", "--quick", "--batches", "3"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let e = parse(&["floor", "--quick", "--time-ms", "5"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let o = nvme(&["--quick"]).options().unwrap();
        assert_eq!((o.rounds, o.time_ms), (1, 500));
    }

    #[test]
    fn each_bench_takes_only_its_own_options() {
        // nvme has no exit-row options, exits no block size, floor neither.
        assert!(parse(&["nvme", "--transports", "vfio-user"]).is_err());
        assert!(parse(&["nvme", "--only", "cpuid"]).is_err());
        assert!(parse(&["nvme", "--batches", "3"]).is_err());
        assert!(parse(&["exits", "--bs", "4k"]).is_err());
        assert!(parse(&["floor", "--doorbell", "shm"]).is_err());
        assert!(parse(&["floor", "--vs", "qemu"]).is_err());
    }

    #[test]
    fn bare_bench_is_exits_with_its_options() {
        let b = parse(&["--quick", "--vs", "qemu"]).unwrap();
        assert!(b.which.is_none());
        let o = b.exits.options().unwrap();
        assert!(o.vs_qemu);
        assert_eq!((o.rounds, o.batches, o.batch_us), (1, 5, 5000));
        let o = parse(&["exits", "--transports", "none", "--quiet"]).unwrap();
        match o.which {
            Some(Which::Exits(e)) => {
                let o = e.options().unwrap();
                assert!(o.transports.is_empty());
                assert!(!o.progress);
            }
            w => panic!("{w:?}"),
        }
    }

    #[test]
    fn blk_takes_targets_a_backend_and_quick() {
        let blk = |args: &[&str]| {
            let mut v = vec!["blk"];
            v.extend_from_slice(args);
            match parse(&v).unwrap().which {
                Some(Which::Blk(b)) => b.options(),
                w => panic!("not blk: {w:?}"),
            }
        };
        let o = blk(&[]).unwrap();
        assert_eq!(
            (o.targets.len(), o.rounds, o.time_ms, o.tput_qd),
            (iopath_bench::blk::Target::all().len(), 3, 2000, 16)
        );
        assert_eq!(o.reference.to_string(), "virtio-ioeventfd");
        assert_eq!(o.backend.to_string(), "null");
        let o = blk(&["--quick", "--targets", "nvme-bar,virtio-poll", "--backend", "ram", "--iodepth", "8"]).unwrap();
        let names: Vec<String> = o.targets.iter().map(|t| t.to_string()).collect();
        assert_eq!((names, o.rounds, o.time_ms, o.tput_qd), (vec!["nvme-bar".into(), "virtio-poll".into()], 1, 300, 8));
        assert!(blk(&["--targets", "nvme-foo"]).unwrap_err().to_string().contains("nvme-foo"));
        let o = blk(&["--targets", "vhost-user,virtio@vfio-user,qemu-vhost-user-blk-pci"]).unwrap();
        let names: Vec<String> = o.targets.iter().map(|t| t.to_string()).collect();
        assert_eq!(names, ["vhost-user", "virtio@vfio-user", "qemu-vhost-user-blk-pci"], "the spellings users type");
        assert_eq!(blk(&["--reference", "nvme-bar"]).unwrap().reference.to_string(), "nvme-bar");
        assert!(blk(&["--reference", "nvme-bar,virtio-poll"]).is_err());
        assert!(blk(&["--reference", "qemu"]).is_err());
        assert!(parse(&["blk", "--quick", "--rounds", "2"]).is_err());
        assert!(parse(&["blk", "--iodepth", "65"]).is_err());
    }

    #[test]
    fn spdk_takes_lists_of_patterns_sizes_and_depths_and_no_unpinned_run() {
        let spdk = |args: &[&str]| match parse(&[&["spdk"], args].concat()) {
            Ok(BenchCmd { which: Some(Which::Spdk(s)), .. }) => s.options(),
            Ok(w) => panic!("not spdk: {w:?}"),
            Err(e) => Err(anyhow::anyhow!("{e}")),
        };
        let o = spdk(&["--pin", "0,1"]).unwrap();
        assert_eq!(o.jobs.len(), 8);
        assert_eq!((o.jobs[0].label(), o.jobs[7].label()), ("randread 4k qd1".into(), "randread 512 qd128".into()));
        assert_eq!((o.rounds, o.runtime_s, o.size_mb, o.lba, o.doorbell), (3, 2, 64, 512, None));
        let o = spdk(&["--pin", "0,1", "--doorbell", "bar"]).unwrap();
        assert_eq!(o.doorbell, Some(iopath_devices::nvme::DoorbellMode::Bar));
        assert!(spdk(&["--doorbell", "fast"]).is_err());
        let o =
            spdk(&["--pin", "1,0", "--quick", "--bs", "4k", "--iodepth", "16", "--rw", "randread,randwrite"]).unwrap();
        assert_eq!((o.rounds, o.runtime_s, o.jobs.len()), (1, 1, 2));
        assert_eq!((o.pin.vcpu, o.pin.device), (1, 0));
        assert!(spdk(&["--pin", "off"]).unwrap_err().to_string().contains("--pin off"));
        assert_eq!(spdk(&["--pin", "0,1", "--iodepth", "1,1"]).unwrap_err().to_string(), "--iodepth 1 given twice");
        assert!(spdk(&["--quick", "--rounds", "2"]).is_err());
        assert!(spdk(&["--rw", "randrw"]).is_err());
        assert!(spdk(&["--runtime", "0"]).is_err());
    }

    #[test]
    fn all_needs_a_directory_and_smoke_needs_quick() {
        assert!(parse(&["all"]).is_err());
        assert!(parse(&["all", "--out", "/tmp/x", "--smoke"]).is_err());
        assert!(parse(&["all", "--out", "/tmp/x", "--quick", "--rounds", "2"]).is_err());
        assert!(matches!(parse(&["all", "--out", "/tmp/x", "--quick", "--smoke"]).unwrap().which, Some(Which::All(_))));
    }
}
