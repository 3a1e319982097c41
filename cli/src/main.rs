//! iopath: run every path a VM's device accesses take, side by side on KVM,
//! and measure each.
//!
//!   iopath bench [exits] [--vs qemu] [--json PATH]   the exit-cost table
//!   iopath run [--workload exits] [--append ARGS]    boot the guest, show its console
//!   iopath image --out PATH                          write the guest image (for QEMU)
//!   iopath serve DEVICE --transport T --socket PATH  a device process (mpqemu, vfio-user, ioregionfd)

mod logging;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use iopath_bench::exits::{exit_devices, run_exits, ExitsOptions};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "iopath",
    version,
    about = "Every path from a VM's device accesses to a device model, side by side on KVM, measured"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a benchmark (default: exits) and print a table (and JSON with --json).
    Bench(Box<BenchArgs>),
    /// Boot the guest image in iopath's VMM and show its console.
    Run(RunArgs),
    /// Write the guest image (an ELF32 multiboot kernel) to a file.
    Image {
        #[arg(long, short)]
        out: PathBuf,
    },
    /// Serve a device model from this process to a VMM (iopath's, or QEMU's
    /// x-pci-proxy-dev for mpqemu) over a UNIX socket.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// The device model and its options: pci-testdev, iopath-doorbell,
    /// nvme[,doorbell=adaptive|shm|bar|ioeventfd|mmio][,backend=null|ram|file:PATH][,size_mb=N][,lba=512|4096][,pollers=N]
    /// (a `,` or `@` inside a value is written twice).
    device: iopath_devices::DeviceConfig,
    /// The transport (ioregionfd: vfio-user control and a region fd for each
    /// BAR; ioregionfd-posted: the same with writes posted).
    #[arg(long, default_value = "vfio-user",
          value_parser = clap::builder::PossibleValuesParser::new(iopath_protocols::TRANSPORTS.iter().map(|t| t.name())))]
    transport: String,
    /// Listen on this UNIX socket path (one client at a time; one that comes
    /// while another is served is refused: vfio-user answers EBUSY). Between
    /// clients the device is reset, unless --keep-state.
    #[arg(long, value_name = "PATH", conflicts_with = "fd", required_unless_present = "fd")]
    socket: Option<PathBuf>,
    /// Serve the connected socket inherited as this fd, then exit.
    #[arg(long, value_name = "N")]
    fd: Option<i32>,
    /// With --socket: exit after the first client served (a connection that
    /// sends nothing within 10 s, or is refused as busy, does not count).
    #[arg(long)]
    once: bool,
    /// Keep the device state (registers, queues, PCI header) from one client
    /// to the next instead of resetting the device when a client leaves: for
    /// a client that reconnects and goes on where it was (the vfio-user
    /// spec's live reconnect). Off by default: a new client finds a reset
    /// device, not the queues and DMA of the last one.
    #[arg(long)]
    keep_state: bool,
    /// Poll the socket this long for the next request before sleeping.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
    /// Do not confine the process with seccomp once it is set up (a
    /// forbidden system call otherwise ends it with SIGSYS).
    #[arg(long)]
    no_seccomp: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum Which {
    /// The exit-cost table: cpu, in-kernel, VMM exits, pci-testdev, doorbell round trips.
    Exits,
    /// The guest's polled NVMe driver against iopath's NVMe controller (and QEMU's with --vs qemu).
    Nvme,
    /// The polled SQ/CQ ring between two host threads at QD 1/16/64: the floor under `bench nvme`.
    Floor,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Peer {
    /// QEMU + KVM with its own pci-testdev, same guest image, interleaved.
    Qemu,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(value_enum, default_value = "exits")]
    which: Which,
    /// Also run the same workload on this peer, in the same run, interleaved.
    #[arg(long, value_enum)]
    vs: Option<Peer>,
    /// Write the results as JSON to PATH ("-" for standard output).
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Rounds; each round runs every target once (A/B interleaving).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Timed batches per row and round.
    #[arg(long, default_value_t = 9)]
    batches: u32,
    /// Target length of one batch, in microseconds.
    #[arg(long, default_value_t = 20_000)]
    batch_us: u64,
    /// Only rows whose names start with one of these (comma-separated).
    #[arg(long)]
    only: Option<String>,
    /// Skip the bare KVM_RUN floor.
    #[arg(long)]
    no_floor: bool,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// A short run: 1 round, 5 batches of 5 ms.
    #[arg(long)]
    quick: bool,
    /// floor: milliseconds per queue depth and round.
    #[arg(long, default_value_t = 1000, value_name = "T")]
    time_ms: u64,
    /// Out-of-process transports to run pci-testdev over, comma-separated
    /// (mpqemu, vfio-user, ioregionfd, ioregionfd-posted), or "none".
    #[arg(long, default_value = "mpqemu,vfio-user,ioregionfd,ioregionfd-posted")]
    transports: String,
    /// Poll a socket this long for a reply or request before sleeping
    /// (client and the device processes it starts); 0 sleeps at once, as QEMU.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
    /// Run N busy threads (at most 64) during the measured runs, QEMU's included.
    #[arg(long, default_value_t = 0, value_name = "N")]
    contend: u32,
    /// nvme, floor: thread placement. auto: the guest vCPU (the floor's
    /// submitter) on the first allowed CPU, the device threads (the floor's
    /// poller) on the others; off: the scheduler's; or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pin: iopath_bench::pin::PinChoice,
    #[command(flatten)]
    nvme: NvmeArgs,
}

/// `bench nvme` options. Without --rw/--bs/--iodepth/--queues the two
/// reference jobs run: randread 512 B at iodepth 16 and 4 KiB at iodepth 1.
#[derive(Args)]
struct NvmeArgs {
    /// Doorbell modes of iopath's controller, comma-separated (shm, bar, ioeventfd, adaptive, mmio).
    #[arg(long, default_value = "shm,bar,ioeventfd,adaptive,mmio")]
    doorbell: String,
    /// null, ram, or file:PATH.
    #[arg(long, default_value = "ram")]
    backend: String,
    /// Where the controller runs, comma-separated, each in every round:
    /// vmm (in iopath's VMM), or a device process over vfio-user, mpqemu,
    /// ioregionfd (e.g. vmm,vfio-user compares the two in one run).
    #[arg(long, default_value = "vmm")]
    transport: String,
    /// read, write, randread, randwrite, randrw.
    #[arg(long)]
    rw: Option<String>,
    /// Block size in bytes (512 .. 131072).
    #[arg(long)]
    bs: Option<u64>,
    #[arg(long)]
    iodepth: Option<u32>,
    /// I/O queue pairs (numjobs).
    #[arg(long)]
    queues: Option<u32>,
    /// fio's thinktime: microseconds the guest waits after a completion
    /// before the slot's next command (at iodepth 1: each I/O wakes an idle
    /// controller; at most 1000000).
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    thinktime: Option<u64>,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    time: f64,
    /// LBA size: 512 or 4096.
    #[arg(long, default_value_t = 512)]
    lba: u32,
    /// Write a pattern over the namespace and read it back (data check, not a speed run).
    #[arg(long)]
    verify: bool,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    mem: u64,
    /// Controller poller counts, comma-separated (1..=16; more than 1 only in shm, bar and adaptive modes).
    #[arg(long, default_value = "1")]
    pollers: String,
}

#[derive(Args)]
struct RunArgs {
    /// Guest workload.
    #[arg(long, default_value = "exits")]
    workload: String,
    /// More guest command-line words (batches=N batch_us=N only=...).
    #[arg(long, default_value = "")]
    append: String,
    /// Leave BAR assignment to the guest instead of placing BARs in the VMM.
    #[arg(long)]
    guest_bars: bool,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 64)]
    mem: u64,
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Devices (repeatable): NAME, NAME@TRANSPORT (a device process the VMM
    /// starts), NAME@TRANSPORT:PATH (one serving on PATH),
    /// pci-testdev@mpqemu:qemu (QEMU's own model in -machine x-remote), or
    /// vfio-user:PATH: whatever device the vfio-user server on PATH serves,
    /// iopath's or not (libvfio-user's samples, SPDK's NVMe target, QEMU's
    /// x-vfio-user-server...); its identity, BARs and capabilities come from
    /// the server. NAME: pci-testdev, iopath-doorbell,
    /// nvme[,doorbell=..][,backend=..][,size_mb=N][,lba=N].
    /// Default: pci-testdev and iopath-doorbell in the VMM.
    #[arg(long = "device", value_name = "SPEC")]
    devices: Vec<iopath_protocols::attach::DeviceSpec>,
    /// Poll a socket this long for a reply or request before sleeping
    /// (client and the device processes it starts); 0 sleeps at once, as QEMU.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
}

fn serve(a: ServeArgs) -> anyhow::Result<i32> {
    use iopath_protocols::serve::{Listen, ServeOptions, Timeouts};
    let transport = iopath_protocols::transport(&a.transport)?;
    let listen = match (a.fd, a.socket) {
        (Some(fd), _) => Listen::Fd(fd),
        (None, Some(p)) => Listen::Socket(p),
        (None, None) => anyhow::bail!("give --socket PATH or --fd N"),
    };
    iopath_protocols::socket::set_spin(Duration::from_micros(a.spin_us));
    let o = ServeOptions {
        device: a.device,
        transport,
        listen,
        once: a.once,
        keep_state: a.keep_state,
        timeouts: Timeouts::default(),
        seccomp: !a.no_seccomp,
    };
    iopath_protocols::serve::run(&o)?;
    Ok(0)
}

/// The devices `--device` specs name, started or connected.
fn devices_of(
    specs: &[iopath_protocols::attach::DeviceSpec],
    spin_us: u64,
) -> anyhow::Result<Vec<iopath_devices::SharedDevice>> {
    use iopath_protocols::attach::{instantiate, Programs};
    if specs.is_empty() {
        return Ok(exit_devices());
    }
    let qemu = iopath_bench::qemu::find().ok();
    let mut progs = Programs::current(qemu).map_err(anyhow::Error::msg)?;
    iopath_protocols::socket::set_spin(Duration::from_micros(spin_us));
    progs.serve_args = vec!["--spin-us".into(), spin_us.to_string()];
    specs.iter().map(|spec| instantiate(spec, &progs).map_err(anyhow::Error::msg)).collect()
}

fn bench_nvme(a: BenchArgs) -> anyhow::Result<i32> {
    use iopath_bench::nvme::{run_nvme, Job, NvmeOptions};
    let n = a.nvme;
    let mut o = NvmeOptions {
        doorbells: n.doorbell.split(',').filter(|s| !s.is_empty()).map(|d| d.parse()).collect::<Result<_, _>>()?,
        backend: n.backend.parse()?,
        transports: n
            .transport
            .split(',')
            .map(|t| match t.trim() {
                "vmm" => Ok(None),
                t => iopath_protocols::transport(t).map(Some),
            })
            .collect::<Result<_, _>>()?,
        lba: n.lba,
        time_ms: (n.time * 1000.0).max(10.0) as u64,
        rounds: a.rounds.max(1),
        vs_qemu: a.vs == Some(Peer::Qemu),
        mem_mb: n.mem,
        timeout_s: a.timeout,
        contend: a.contend,
        pin: a.pin.placement(),
        pollers: n
            .pollers
            .split(',')
            .map(|p| match p.trim().parse::<u8>() {
                Ok(v @ 1..=16) => Ok(v),
                _ => Err(anyhow::anyhow!("--pollers: {p:?} is not a poller count (1..=16)")),
            })
            .collect::<anyhow::Result<_>>()?,
        ..NvmeOptions::default()
    };
    let custom = n.rw.is_some() || n.bs.is_some() || n.iodepth.is_some() || n.queues.is_some();
    if custom || n.verify || n.thinktime.is_some() {
        o.jobs = vec![Job {
            rw: n.rw.unwrap_or_else(|| "randread".into()),
            bs: n.bs.unwrap_or(4096),
            iodepth: n.iodepth.unwrap_or(16),
            queues: n.queues.unwrap_or(1),
            verify: n.verify,
            thinktime_us: n.thinktime.unwrap_or(0),
        }];
    }
    if a.quick {
        o.rounds = 1;
        o.time_ms = 500;
    }
    let r = run_nvme(&o)?;
    emit(&r.table(), &r.json(), a.json.as_deref())?;
    Ok(if r.errors.is_empty() { 0 } else { 1 })
}

/// The table on stdout (stderr when JSON goes to stdout) and the JSON.
fn emit(table: &str, json: &serde_json::Value, path: Option<&std::path::Path>) -> anyhow::Result<()> {
    if path == Some(std::path::Path::new("-")) {
        eprint!("{table}");
        println!("{}", serde_json::to_string_pretty(json)?);
    } else {
        print!("{table}");
        if let Some(p) = path {
            std::fs::write(p, serde_json::to_string_pretty(json)?)
                .with_context(|| format!("writing {}", p.display()))?;
            println!("JSON written to {}", p.display());
        }
    }
    Ok(())
}

fn bench_floor(a: BenchArgs) -> anyhow::Result<i32> {
    use iopath_bench::floor::{run_floor, FloorOptions, DEPTHS};
    let o = FloorOptions {
        depths: a.nvme.iodepth.map_or(DEPTHS.to_vec(), |d| vec![d]),
        rounds: if a.quick { 1 } else { a.rounds.max(1) },
        time_ms: if a.quick { 100 } else { a.time_ms.max(1) },
        cpus: a.pin.placement().map(|p| p.pair()),
        ..FloorOptions::default()
    };
    let r = run_floor(&o)?;
    emit(&r.table(), &r.json(), a.json.as_deref())?;
    Ok(if r.errors.is_empty() { 0 } else { 1 })
}

fn bench(a: BenchArgs) -> anyhow::Result<i32> {
    match a.which {
        Which::Nvme => return bench_nvme(a),
        Which::Floor => return bench_floor(a),
        Which::Exits => {}
    }
    let mut o = ExitsOptions {
        rounds: a.rounds.max(1),
        batches: a.batches.clamp(1, 64),
        batch_us: a.batch_us.max(10),
        only: a.only,
        vs_qemu: a.vs == Some(Peer::Qemu),
        floor: !a.no_floor,
        timeout_s: a.timeout,
        progress: true,
        transports: a.transports.split(',').filter(|t| !t.is_empty() && *t != "none").map(String::from).collect(),
        iopath_exe: None,
        spin_us: a.spin_us,
        contend: a.contend,
        ..Default::default()
    };
    if a.quick {
        o.rounds = 1;
        o.batches = 5;
        o.batch_us = 5000;
    }
    let r = run_exits(&o)?;
    emit(&r.table(), &r.json(), a.json.as_deref())?;
    Ok(if r.errors.is_empty() { 0 } else { 1 })
}

fn run_guest(a: RunArgs) -> anyhow::Result<i32> {
    let cmdline = format!("workload={} {}", a.workload, a.append).trim().to_string();
    let mut cfg = iopath_vmm::VmConfig::new(iopath_guest::IMAGE, &cmdline);
    cfg.devices = devices_of(&a.devices, a.spin_us)?;
    cfg.place_bars = !a.guest_bars;
    cfg.mem_size = a.mem << 20;
    cfg.timeout = Duration::from_secs(a.timeout);
    cfg.on_line = Some(Box::new(|l: &str| {
        println!("{l}");
        let _ = std::io::stdout().flush();
    }));
    let r = iopath_vmm::run(cfg)?;
    eprintln!("guest exit status {} (isa-debug-exit), {:.2} s, TSC {} kHz", r.status, r.wall.as_secs_f64(), r.tsc_khz);
    eprintln!("vm exits: {}", r.exits.fields().iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
    for d in &r.devices {
        let bars: Vec<String> = d
            .bars
            .iter()
            .map(|b| format!("BAR{}={:?}@{:#x}+{:#x}", b.spec.index, b.spec.kind, b.addr, b.spec.size))
            .collect();
        eprintln!("00:{:02x}.0 {} {}", d.slot, d.name, bars.join(" "));
        eprintln!(
            "  {}",
            d.counters.iter().filter(|c| c.value > 0).map(|c| c.to_string()).collect::<Vec<_>>().join(" ")
        );
    }
    Ok(if r.status == 1 { 0 } else { 1 })
}

fn main() {
    logging::init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(a) => bench(*a),
        Cmd::Run(a) => run_guest(a),
        Cmd::Serve(a) => serve(a),
        Cmd::Image { out } => {
            iopath_guest::write_image(&out).map(|_| 0).with_context(|| format!("writing {}", out.display()))
        }
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("iopath: {e:#}");
            std::process::exit(2);
        }
    }
}
