//! iopath: run every path a VM's device accesses take, side by side on KVM,
//! and measure each.
//!
//!   iopath bench [exits] [--vs qemu] [--json PATH]   the exit-cost table
//!   iopath bench nvme|floor [OPTIONS]                the NVMe controller, the ring floor
//!   iopath bench spdk [OPTIONS]                      SPDK's perf: iopath serve against nvmf_tgt
//!   iopath bench reconnect [--kills N]               the pause each kill -9 of a device process causes
//!   iopath bench all --out DIR [--quick]             everything, with report.md, CSV, JSON, SVG plots
//!   iopath report --from results.json --out DIR      the report again from its results.json
//!   iopath run [--workload exits] [--append ARGS]    boot the guest, show its console
//!   iopath image --out PATH                          write the guest image (for QEMU)
//!   iopath serve DEVICE --transport T --socket PATH  a device process (mpqemu, vfio-user, ioregionfd, vhost-user)
//!   iopath ctl PATH list|stats|inject RULE|remove ID|clear|attach NSID|detach NSID   a device process's control socket

mod all;
mod bench;
mod ctl;
mod logging;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use iopath_bench::exits::{exit_devices, run_exits};
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
    /// Run a benchmark (default: exits) and print a table (and JSON with --json);
    /// `bench all --out DIR` runs them all and writes a report.
    Bench(Box<bench::BenchCmd>),
    /// Boot the guest image in iopath's VMM and show its console.
    Run(RunArgs),
    /// Write the guest image (an ELF32 multiboot kernel) to a file.
    Image {
        #[arg(long, short)]
        out: PathBuf,
    },
    /// Render report.md, results.csv and the plots again from a results.json
    /// that `bench all` wrote (e.g. into another directory).
    Report {
        /// The results.json to read.
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// Directory for the report (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Serve a device model from this process to a VMM (iopath's, or QEMU's
    /// x-pci-proxy-dev for mpqemu) over a UNIX socket.
    Serve(Box<ServeArgs>),
    /// Talk to a device process's control socket (`serve ... --control PATH`):
    /// list, add and remove error injection rules while it runs, read its counters.
    Ctl(ctl::CtlArgs),
}

#[derive(Args)]
struct ServeArgs {
    // Every device and option, from the devices' tables.
    #[arg(help = serve_device_help(), next_line_help = true)]
    device: iopath_devices::DeviceConfig,
    /// The transport (ioregionfd: vfio-user control and a region fd for each
    /// BAR; ioregionfd-posted: the same with writes posted; vhost-user:
    /// virtio-blk's queues to a vhost-user frontend, notify=ioeventfd|poll,
    /// the disk kept across frontends, --keep-state has nothing more to keep).
    #[arg(long, default_value = "vfio-user",
          value_parser = clap::builder::PossibleValuesParser::new(iopath_protocols::TRANSPORTS.iter().map(|t| t.name())))]
    transport: String,
    /// Listen on this UNIX socket path: nothing may be there but a stale
    /// socket (replaced); any other file, or a socket a live server listens
    /// on, is refused and left alone. Removed when the process ends. One
    /// client at a time; one that comes while another is served is refused
    /// (vfio-user answers EBUSY). Between clients the device is reset, unless
    /// --keep-state. With --controllers N > 1 the path holds a {}, replaced
    /// by 0..N-1: a socket per controller.
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
    /// A control socket at PATH (bound as --socket's is): `iopath ctl PATH
    /// list|stats|inject RULE|remove ID|clear` changes the device's error
    /// injection while it runs (JSON lines; see `iopath ctl --help`). With
    /// --controllers N > 1 the path holds a {}, replaced by 0..N-1: a control
    /// socket per controller, on its rules only.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Poll the socket this long for the next request before sleeping.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
    /// Serve N controllers (1..=64), each a device of its own built from the
    /// same options (its own namespace data) on its own socket (--socket's
    /// {} replaced by its index), each with its own client. Not with --fd
    /// or vhost-user.
    #[arg(long, default_value_t = 1, value_name = "N")]
    controllers: usize,
    /// nvme with doorbell=shm or bar: M poller threads (1..=64) serve the
    /// queue groups of every controller of the process (a thread serves
    /// several; one whose queues are all idle sleeps). Without it every
    /// queue group has a poller thread of its own.
    #[arg(long, value_name = "M")]
    pollers: Option<usize>,
    /// Do not confine the process once it is set up (otherwise Landlock
    /// refuses every file access by path, and seccomp ends the process with
    /// SIGSYS at a system call its thread's role does not make).
    #[arg(long)]
    no_seccomp: bool,
    /// nvme: one namespace, in the device-option syntax
    /// (backend=ram,size_mb=64,lba=4096,create=on); repeatable, NSIDs in
    /// order of appearance (the first is namespace 1, replacing the device's
    /// backend=, size_mb=, lba=, create=). Without it: the device's namespaces.
    #[arg(long = "namespace", value_name = "SPEC")]
    namespaces: Vec<String>,
}

#[derive(Args)]
struct RunArgs {
    /// Guest workload: exits, floor, nvme, vblk or pci (their options go in --append).
    #[arg(long, default_value = "exits", value_parser = ["exits", "floor", "nvme", "vblk", "pci"])]
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
    /// How guest RAM is backed: auto (anonymous, in transparent huge pages;
    /// a memfd when a device process shares it), memfd, or hugetlb (a memfd
    /// in 2 MiB pages from the host's pool, vm.nr_hugepages: --mem/2 free pages).
    #[arg(long, default_value = "auto", value_name = "auto|memfd|hugetlb")]
    ram: iopath_vmm::RamKind,
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    // Every device and option, from the devices' tables.
    #[arg(long = "device", value_name = "SPEC", help = run_device_help())]
    devices: Vec<iopath_protocols::attach::DeviceSpec>,
    /// Poll a socket this long for a reply or request before sleeping
    /// (client and the device processes it starts); 0 sleeps at once, as QEMU.
    #[arg(long, default_value_t = 0, value_name = "US")]
    spin_us: u64,
    /// How long a device on an external socket (`...@vfio-user:PATH`,
    /// `vfio-user:PATH`, `vhost-user-blk:PATH`) is waited for when its
    /// server dies or its socket breaks: the client reconnects and replays
    /// its session; 0 (the default) stops the run instead. A device process
    /// the VMM starts itself is always started again.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    reconnect_ms: u64,
    /// State keeping of a device process over vfio-user or ioregionfd: on
    /// offers it state memory (`iopath_state_memory`), so that NVMe keeps
    /// its state there and a new process resumes it after a death; off
    /// offers none: the device keeps no state, and a death stops the run.
    #[arg(long, default_value = "on", value_name = "on|off")]
    state_memory: iopath_protocols::vfio_user::StateMemoryMode,
}

/// `serve`'s DEVICE help: every device and option (`iopath_devices::spec::help`).
fn serve_device_help() -> String {
    format!("The device model and its options, NAME[,KEY=VALUE...]:\n{}", iopath_devices::spec::help())
}

/// `run --device`'s help: the forms of a spec, then every device and option.
fn run_device_help() -> String {
    format!(
        "Devices (repeatable): NAME, NAME@TRANSPORT (a device process the VMM starts), NAME@TRANSPORT:PATH \
         (one serving on PATH), pci-testdev@mpqemu:qemu (QEMU's own model in -machine x-remote), or \
         vfio-user:PATH: whatever device the vfio-user server on PATH serves, iopath's or not (libvfio-user's \
         samples, SPDK's NVMe target, QEMU's x-vfio-user-server...); its identity, BARs and capabilities come \
         from the server. Default: pci-testdev and iopath-doorbell in the VMM. NAME[,KEY=VALUE...]:\n{}",
        iopath_devices::spec::help()
    )
}

fn serve(a: ServeArgs) -> anyhow::Result<i32> {
    use iopath_protocols::serve::{Listen, ServeOptions, Timeouts};
    let listen = match (a.fd, a.socket) {
        (Some(fd), _) => Listen::Fd(fd),
        (None, Some(p)) => Listen::Socket(p),
        (None, None) => anyhow::bail!("give --socket PATH or --fd N"),
    };
    let transport = iopath_protocols::transport(&a.transport)?;
    if a.spin_us != 0 && matches!(transport, iopath_protocols::Transport::Queues(_)) {
        // Not an error: the VMM's spawn path (`virtio-blk@vhost-user`)
        // passes its own --spin-us to every device process it starts.
        eprintln!("iopath serve: --spin-us has no effect with --transport {transport} (the rings are served by their own threads)");
    }
    iopath_protocols::socket::set_spin(Duration::from_micros(a.spin_us));
    let device = match a.device {
        iopath_devices::DeviceConfig::Nvme(c) => iopath_devices::DeviceConfig::Nvme(c.with_namespaces(&a.namespaces)?),
        d if a.namespaces.is_empty() => d,
        d => anyhow::bail!("--namespace is an nvme option, not {}'s", d.name()),
    };
    let o = ServeOptions {
        device,
        transport,
        listen,
        once: a.once,
        keep_state: a.keep_state,
        timeouts: Timeouts::default(),
        seccomp: !a.no_seccomp,
        control: a.control,
        controllers: a.controllers,
        pollers: a.pollers,
    };
    iopath_protocols::serve::run(&o)?;
    Ok(0)
}

/// The devices `--device` specs name, started or connected.
fn devices_of(
    specs: &[iopath_protocols::attach::DeviceSpec],
    spin_us: u64,
    proxy: &iopath_protocols::vfio_user::ProxyConfig,
) -> anyhow::Result<Vec<iopath_devices::SharedDevice>> {
    use iopath_protocols::attach::{instantiate_with, Programs};
    if specs.is_empty() {
        return Ok(exit_devices());
    }
    let qemu = iopath_bench::qemu::find().ok();
    let mut progs = Programs::current(qemu).map_err(anyhow::Error::msg)?;
    iopath_protocols::socket::set_spin(Duration::from_micros(spin_us));
    progs.serve_args = vec!["--spin-us".into(), spin_us.to_string()];
    specs.iter().map(|spec| instantiate_with(spec, &progs, proxy).map_err(anyhow::Error::msg)).collect()
}

/// The table on stdout (stderr when JSON goes to stdout; nothing then with
/// --quiet) and the JSON.
fn emit(table: &str, json: &serde_json::Value, out: &bench::Output) -> anyhow::Result<()> {
    emit_io(table, json, None, out)
}

/// `emit`, or with fio's JSON (`--output-format json|json+`): that on
/// standard output, the table on standard error (none with --quiet), the
/// bench's own JSON only to a --json file.
fn emit_io(
    table: &str,
    json: &serde_json::Value,
    fio: Option<iopath_bench::fioout::Output>,
    out: &bench::Output,
) -> anyhow::Result<()> {
    let path = out.json.as_deref();
    if let Some(f) = fio {
        if !out.quiet {
            eprint!("{table}");
        }
        print!("{}", iopath_bench::fioout::to_text(&f));
        if let Some(p) = path {
            std::fs::write(p, serde_json::to_string_pretty(json)?)
                .with_context(|| format!("writing {}", p.display()))?;
            if !out.quiet {
                eprintln!("JSON written to {}", p.display());
            }
        }
    } else if path == Some(std::path::Path::new("-")) {
        if !out.quiet {
            eprint!("{table}");
        }
        println!("{}", serde_json::to_string_pretty(json)?);
    } else {
        print!("{table}");
        if let Some(p) = path {
            std::fs::write(p, serde_json::to_string_pretty(json)?)
                .with_context(|| format!("writing {}", p.display()))?;
            if !out.quiet {
                println!("JSON written to {}", p.display());
            }
        }
    }
    Ok(())
}

/// Exit status of a bench: 130 if a signal stopped it (its results are
/// partial), else 1 if it found errors (a wrong route, a lost completion).
pub(crate) fn status(errors: &[String]) -> i32 {
    if iopath_bench::interrupt::interrupted() {
        eprintln!("iopath: {}; the results above are partial", iopath_bench::interrupt::Interrupted);
        130
    } else if errors.is_empty() {
        0
    } else {
        1
    }
}

/// Runs a bench with Ctrl-C, SIGTERM and SIGHUP caught (`iopath_bench::interrupt`):
/// its children stopped and reaped, its files removed, what it measured
/// printed marked partial, exit status 130.
fn bench(b: bench::BenchCmd) -> anyhow::Result<i32> {
    let _signals = iopath_bench::interrupt::SignalGuard::install()?;
    match bench_caught(b) {
        Err(e) if e.is::<iopath_bench::interrupt::Interrupted>() || iopath_bench::interrupt::interrupted() => {
            eprintln!("iopath: {}", iopath_bench::interrupt::Interrupted);
            Ok(130)
        }
        r => r,
    }
}

fn bench_caught(b: bench::BenchCmd) -> anyhow::Result<i32> {
    use bench::Which;
    use iopath_bench::fioout::Format;
    match b.which {
        None => bench_exits(&b.exits),
        Some(Which::Exits(a)) => bench_exits(&a),
        Some(Which::Nvme(a)) if a.controllers.is_some() => {
            let o = a.options()?;
            let counts = iopath_bench::nvme::controllers::parse_counts(a.controllers.as_deref().unwrap_or("1"))?;
            let r = iopath_bench::nvme::controllers::run_controllers(
                &o,
                &counts,
                a.pool_pollers as usize,
                a.controllers_vs_spdk.as_deref(),
            )?;
            emit(&r.table(), &r.json(), &a.out)?;
            Ok(status(&r.failures()))
        }
        Some(Which::Nvme(a)) => {
            let o = a.options()?;
            a.format.check(&a.out)?;
            let bytes = iopath_bench::nvme::namespace_size(&o.backend, o.size_mb);
            iopath_bench::backing::prepare(&o.backend, bytes, a.create)?;
            let r = iopath_bench::nvme::run_nvme(&o)?;
            let fio = (a.format.output_format != Format::Normal)
                .then(|| r.fio_output(a.format.output_format == Format::JsonPlus));
            emit_io(&r.table(), &r.json(), fio, &a.out)?;
            Ok(status(&r.errors))
        }
        Some(Which::Floor(a)) => {
            let r = iopath_bench::floor::run_floor(&a.options())?;
            emit(&r.table(), &r.json(), &a.out)?;
            Ok(status(&r.errors))
        }
        Some(Which::Blk(a)) => bench::blk(&a, |t, j, f| emit_io(t, j, f, &a.out)),
        Some(Which::Spdk(a)) => {
            let o = a.options()?;
            a.format.check(&a.out)?;
            let r = iopath_bench::spdk::run_spdk(&o)?;
            // perf prints no histogram: json+ has no bins to add.
            let fio = (a.format.output_format != Format::Normal).then(|| r.fio_output());
            emit_io(&r.table(), &r.json(), fio, &a.out)?;
            Ok(status(&r.errors))
        }
        Some(Which::Reconnect(a)) => {
            let o = a.options(std::env::current_exe().context("the iopath binary's path")?)?;
            let r = iopath_bench::reconnect::run_reconnect(&o)?;
            emit(&r.table(), &r.json(), &a.out)?;
            Ok(status(&r.errors()))
        }
        Some(Which::All(a)) => all::run(&a).map(|code| if iopath_bench::interrupt::interrupted() { 130 } else { code }),
    }
}

fn bench_exits(a: &bench::ExitsArgs) -> anyhow::Result<i32> {
    let r = run_exits(&a.options()?)?;
    emit(&r.table(), &r.json(), &a.out)?;
    Ok(status(&r.errors))
}

fn run_guest(a: RunArgs) -> anyhow::Result<i32> {
    let cmdline = format!("workload={} {}", a.workload, a.append).trim().to_string();
    let mut cfg = iopath_vmm::VmConfig::new(iopath_guest::IMAGE, &cmdline);
    iopath_protocols::respawn::set_socket_wait(Duration::from_millis(a.reconnect_ms));
    let proxy = iopath_protocols::vfio_user::ProxyConfig { state_memory: a.state_memory };
    cfg.devices = devices_of(&a.devices, a.spin_us, &proxy)?;
    cfg.place_bars = !a.guest_bars;
    cfg.mem_size = a.mem << 20;
    cfg.ram = a.ram;
    cfg.timeout = Duration::from_secs(a.timeout);
    cfg.on_line = Some(Box::new(|l: &str| {
        println!("{l}");
        let _ = std::io::stdout().flush();
    }));
    let r = iopath_vmm::run(cfg)?;
    let said = if r.status == 1 {
        "isa-debug-exit's (rc << 1) | 1: the guest's rc 0, success".to_string()
    } else {
        iopath_bench::record::exit_failure(r.status, &r.lines)
    };
    eprintln!("guest exit status {} ({said}), {:.2} s, TSC {} kHz", r.status, r.wall.as_secs_f64(), r.tsc_khz);
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

/// A panic in any thread is a bug, and the state it was changing (a
/// device's registers, a queue, a VM's bus) may be half updated: the process
/// ends rather than go on serving or running on it. The default hook prints
/// the message (and a backtrace with RUST_BACKTRACE), then the process ends
/// with 101, the status of a panicking `main`, without unwinding or running
/// destructors (which would act on that state). A mutex is therefore only
/// seen poisoned after a panic in the same process, which is ending:
/// `iopath_devices::lock` takes it as it is. `iopath serve`'s seccomp setup
/// replaces this hook with one that prints no backtrace and ends the same way.
fn end_on_panic() {
    let print = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        print(info);
        // SAFETY: _exit(2) ends the process at once; it touches no memory
        // of ours and is async-signal-safe.
        unsafe { libc::_exit(101) };
    }));
}

fn main() {
    end_on_panic();
    logging::init();
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(a) => bench(*a),
        Cmd::Run(a) => run_guest(a),
        Cmd::Serve(a) => serve(*a),
        Cmd::Ctl(a) => ctl::ctl(a),
        Cmd::Report { from, out } => all::rerender(&from, &out),
        Cmd::Image { out } => {
            iopath_guest::write_image(&out).map(|_| 0).with_context(|| format!("writing {}", out.display()))
        }
    };
    // No device process outlives iopath, whatever still held one (a run
    // cut short by a signal).
    let left = iopath_protocols::process::kill_leftovers();
    if !left.is_empty() {
        log::warn!("killed {} device process(es) still running at exit: {left:?}", left.len());
    }
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("iopath: {}", error_text(&e));
            std::process::exit(2);
        }
    }
}

/// An error and its causes, each once. The crates' error types put their
/// source in their own text (`"{context}: {source}"`) and also return it as
/// their source, so `{:#}` repeats it (a missing file's "No such file or
/// directory" three times); a cause whose text ends what is written already
/// is left out.
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let t = cause.to_string();
        if out.ends_with(&t) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&t);
    }
    out
}

#[cfg(test)]
mod help_tests {
    //! Each `--help`'s listed values against what the parser takes.
    use super::Cli;
    use clap::CommandFactory;

    /// The long help of `iopath PATH...`.
    fn help(path: &[&str]) -> String {
        let mut c = Cli::command();
        for p in path {
            c = c.find_subcommand(p).unwrap_or_else(|| panic!("no subcommand {p}")).clone();
        }
        c.render_long_help().to_string()
    }

    /// The keys an error of the parser lists as the options it knows.
    fn known_keys(spec: &str) -> Vec<String> {
        let e = spec.parse::<iopath_devices::DeviceConfig>().unwrap_err().to_string();
        let list = e.rsplit_once('(').and_then(|(_, l)| l.split_once(')')).map(|(l, _)| l).expect(&e);
        list.split(',').map(|k| k.trim().to_string()).collect()
    }

    #[test]
    fn run_takes_state_memory_on_or_off_on_by_default() {
        use super::Cmd;
        use clap::Parser;
        use iopath_protocols::vfio_user::StateMemoryMode;
        let run = |args: &[&str]| match Cli::try_parse_from([&["iopath", "run"], args].concat()) {
            Ok(Cli { cmd: Cmd::Run(a) }) => Ok(a.state_memory),
            Ok(_) => panic!("not run"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(run(&[]), Ok(StateMemoryMode::On));
        assert_eq!(run(&["--state-memory", "off"]), Ok(StateMemoryMode::Off));
        let e = run(&["--state-memory", "maybe"]).unwrap_err();
        assert!(e.contains("is not on or off"), "{e}");
        assert!(help(&["run"]).contains("--state-memory <on|off>"));
    }

    #[test]
    fn serve_lists_every_device_option_and_doorbell_mode_the_parser_takes() {
        let h = help(&["serve"]);
        for (device, keys) in [("nvme", known_keys("nvme,zz=1")), ("virtio-blk", known_keys("virtio-blk,zz=1"))] {
            assert!(keys.len() >= 4, "{keys:?}");
            for k in keys {
                // The key is one the parser takes (a bad value, not an unknown option)...
                let e =
                    format!("{device},{k}=%bad%").parse::<iopath_devices::DeviceConfig>().err().map(|e| e.to_string());
                assert!(!e.unwrap_or_default().contains("unknown option"), "{device} {k}");
                // ...and the help names it.
                assert!(h.contains(&format!("[,{k}=")), "serve --help lacks {device}'s {k}=");
            }
        }
        let modes: Vec<String> = iopath_devices::nvme::DoorbellMode::ALL.iter().map(|m| m.to_string()).collect();
        assert!(h.contains(&format!("doorbell={}", modes.join("|"))), "serve --help's doorbell modes");
        assert!(h.contains("forecast=on|off") && h.contains("bar-adaptive"));
        let nvme = help(&["bench", "nvme"]);
        for m in &modes {
            assert!(nvme.contains(m.as_str()), "bench nvme --help lacks {m}");
            assert!(m.parse::<iopath_devices::nvme::DoorbellMode>().is_ok());
        }
    }

    #[test]
    fn serve_and_run_list_every_device_and_option_of_the_tables() {
        for path in [&["serve"][..], &["run"]] {
            let h = help(path);
            for d in iopath_devices::spec::DEVICES {
                assert!(h.contains(d.name) && h.contains(d.summary), "{path:?} --help lacks {}", d.name);
                for o in d.options.map(|o| o.docs()).unwrap_or_default() {
                    assert!(
                        h.contains(&format!("[,{}={}]", o.key, o.values)),
                        "{path:?} --help: {}'s {}",
                        d.name,
                        o.key
                    );
                    assert!(
                        h.contains(&format!("{}: {}", o.key, o.help)),
                        "{path:?} --help: {}'s {} help",
                        d.name,
                        o.key
                    );
                }
            }
        }
    }

    #[test]
    fn run_lists_the_workloads_the_guest_dispatches() {
        // The guest's own dispatch (guest/c/main.c): `strncmp(workload, "NAME", N)`.
        let src = include_str!("../../guest/c/main.c");
        let names: Vec<&str> = src.split("strncmp(workload, \"").skip(1).filter_map(|s| s.split('"').next()).collect();
        assert_eq!(names.len(), 5, "{names:?}");
        let h = help(&["run"]);
        for n in &names {
            assert!(h.contains(n), "run --help lacks workload {n}");
            assert!(Cli::try_parse_from_args(&["iopath", "run", "--workload", n]), "{n}");
        }
        assert!(!Cli::try_parse_from_args(&["iopath", "run", "--workload", "nvmee"]));
    }

    #[test]
    fn bench_helps_state_what_runs() {
        let blk = help(&["bench", "blk"]);
        for t in iopath_bench::blk::Target::all() {
            assert!(blk.contains(&t.to_string()), "bench blk --help lacks target {t}");
        }
        let serve = help(&["serve"]);
        for t in iopath_protocols::TRANSPORTS {
            assert!(serve.contains(t.name()), "serve --help lacks transport {t}");
        }
        let all = help(&["bench", "all"]);
        let quick: Vec<String> = crate::all::SWEEP_QUICK.iter().map(|d| d.to_string()).collect();
        assert!(all.contains(&format!("iodepths {}", quick.join(", "))), "bench all --help: the quick sweep");
        for b in ["nvme", "blk", "spdk"] {
            let h = help(&["bench", b]);
            for f in iopath_bench::fioout::FORMATS {
                assert!(h.contains(f), "bench {b} --help lacks --output-format {f}");
            }
        }
        let transports = help(&["bench", "exits"]);
        for t in iopath_protocols::function_transports() {
            assert!(transports.contains(t.name()), "bench exits --help lacks transport {}", t.name());
        }
    }

    impl Cli {
        fn try_parse_from_args(a: &[&str]) -> bool {
            <Cli as clap::Parser>::try_parse_from(a).is_ok()
        }
    }
}
