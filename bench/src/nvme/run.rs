//! One run of one target (iopath's controller in a mode, QEMU's nvme, the
//! host's fio) for one job and round, and what the guest's output says.

use super::{
    busy_threads, cmdline, contenders, pinner, IoFigures, Job, LatHist, NvmeOptions, NvmeRun, FIO_BUSY_TARGET,
    FIO_TARGET, IDLE_WINDOW,
};
use crate::cpu::{Window, WindowCpu, NVME_DEVICE_THREADS};
use crate::host::{host_info, HostInfo};
use crate::pin::{QEMU_DEVICE_THREADS, VCPU_THREADS};
use crate::qemu::QemuBacking;
use indicatif::ProgressBar;
use iopath_devices::block::StorageKind;
use iopath_devices::nvme::{DoorbellMode, InPlace, NvmeConfig};
use iopath_devices::DeviceConfig;
use iopath_protocols::attach::{instantiate_with, Device, DeviceSpec, Endpoint, Programs};
use iopath_protocols::vfio_user::{ProxyConfig, StateMemoryMode};
use iopath_protocols::FunctionTransport;
use iopath_vmm::vcpu::ExitMark;
use iopath_vmm::{run, RamKind, VmConfig};
use std::path::PathBuf;
use std::time::Duration;

/// The guest's lines around its timed window.
pub const WINDOW_START: &str = "@nvme-window start";
pub const WINDOW_END: &str = "@nvme-window end";

/// iopath's controller as a target sets it up.
#[derive(Clone, Copy)]
pub struct Setup {
    pub db: DoorbellMode,
    pub pollers: u8,
    /// adaptive's forecast.
    pub forecast: bool,
    /// A file namespace's transfers in place (`in_place=`).
    pub in_place: InPlace,
    /// A file namespace's operations to the kernel every N (`submit_batch=`).
    pub submit_batch: u16,
    /// The guest driver asks for shadow doorbells (nvmeperf's `dbbuf=1`).
    pub dbbuf: bool,
    /// With the options' device timing model (`--timing`; `-timed`).
    pub timing: bool,
    /// The proxy offers state memory (`--state-memory`; `-nostate` off).
    pub state: StateMemoryMode,
}

impl Setup {
    /// `db`, one poller, forecast on, in place and submission as the device defaults.
    pub fn plain(db: DoorbellMode) -> Setup {
        Setup {
            db,
            pollers: 1,
            forecast: true,
            in_place: InPlace::Auto,
            submit_batch: 0,
            dbbuf: true,
            timing: false,
            state: StateMemoryMode::On,
        }
    }
}

/// What runs.
#[derive(Clone, Copy)]
pub enum Kind {
    /// iopath's controller: in the VMM (None) or a device process, set up so.
    Iopath(Option<&'static dyn FunctionTransport>, Setup),
    Qemu,
    /// The host's fio on the file; `busy`: beside one busy thread on the
    /// vCPU's CPU, fio on the device threads' ([`FIO_BUSY_TARGET`]).
    Fio {
        busy: bool,
    },
}

#[derive(Clone)]
pub struct Target {
    pub name: String,
    pub kind: Kind,
    /// Busy threads during its runs (`--contend`).
    pub contend: u32,
}

impl Target {
    pub fn is_fio(&self) -> bool {
        matches!(self.kind, Kind::Fio { .. })
    }
}

/// A combination the controller refuses: in a device process the modes whose
/// doorbells are kicks (ioeventfd, adaptive) serve only drivers with shadow
/// doorbells (Create I/O SQ is refused before Doorbell Buffer Config: a kick
/// carries no value).
fn refused(t: Option<&'static dyn FunctionTransport>, s: &Setup) -> bool {
    t.is_some() && s.db.kicked() && !s.dbbuf
}

/// Everything a run needs, found once.
pub struct Ctx<'a> {
    pub o: &'a NvmeOptions,
    pub host: HostInfo,
    pub tsc_khz: u64,
    image: PathBuf,
    progs: Programs,
    qemu: Option<(PathBuf, QemuBacking)>,
    fio: Option<PathBuf>,
    ns_size: u64,
    /// Rows not run, with the reason.
    pub skipped: Vec<String>,
}

impl<'a> Ctx<'a> {
    pub fn new(o: &'a NvmeOptions) -> anyhow::Result<Ctx<'a>> {
        let tsc_khz = crate::exits::tsc_khz_of_host()?;
        let ns_size = super::namespace_size(&o.backend, o.size_mb);
        let qemu = match o.vs_qemu {
            true => {
                let q = crate::qemu::find()?;
                let backing =
                    QemuBacking::for_backend(&o.backend, ns_size, std::path::Path::new(crate::qemu::SHM_DIR))?;
                Some((q, backing))
            }
            false => None,
        };
        let mut skipped = Vec::new();
        let fio = match &o.backend {
            StorageKind::File(_) => match crate::fio::find() {
                Some(f) => Some(f),
                None => {
                    skipped.push(format!("{FIO_TARGET}: {}", crate::fio::missing_reason()));
                    None
                }
            },
            _ => None,
        };
        if o.dbbuf.contains(&false) {
            for t in o.transports.iter().flatten() {
                for &db in
                    o.doorbells.iter().filter(|d| refused(Some(*t), &Setup { dbbuf: false, ..Setup::plain(**d) }))
                {
                    skipped.push(format!(
                        "iopath-{db}-dbbuf0@{}: a device process serves {db} only to drivers with shadow doorbells",
                        t.name()
                    ));
                }
            }
        }
        let progs = Programs {
            iopath: match &o.iopath_exe {
                Some(p) => p.clone(),
                None => std::env::current_exe()?,
            },
            qemu: qemu.as_ref().map(|q| q.0.clone()),
            serve_args: Vec::new(),
        };
        Ok(Ctx {
            o,
            host: host_info(tsc_khz),
            tsc_khz,
            image: iopath_guest::image_file()?,
            progs,
            qemu,
            fio,
            ns_size,
            skipped,
        })
    }

    /// Every target, in the order each round runs them for a job: each at
    /// every contention level, one right after the other.
    pub fn targets(&self) -> Vec<Target> {
        let o = self.o;
        let mut t: Vec<(String, Option<&'static dyn FunctionTransport>, Kind)> = o
            .transports
            .iter()
            .flat_map(|&t| o.doorbells.iter().flat_map(move |&db| o.pollers.iter().map(move |&p| (t, db, p))))
            .filter(|&(_, db, p)| p == 1 || db.polled())
            .flat_map(|(t, db, p)| {
                // Only adaptive forecasts: the other modes run once.
                let f: &[bool] = if db == DoorbellMode::Adaptive { &o.forecast } else { &[true] };
                f.iter().map(move |&f| (t, db, p, f))
            })
            .flat_map(|(t, db, p, f)| {
                // State keeping can be turned off only where state memory is offered.
                let keeps = t.is_some_and(|t| t.offers_state_memory());
                let st: &[StateMemoryMode] = if keeps { &o.state_memory } else { &[StateMemoryMode::On] };
                st.iter().map(move |&state| (t, db, p, f, state))
            })
            .flat_map(|(t, db, pollers, forecast, state)| {
                o.in_place.iter().flat_map(move |&in_place| {
                    o.submit_batch.iter().flat_map(move |&submit_batch| {
                        o.dbbuf.iter().flat_map(move |&dbbuf| {
                            // With --timing each target runs as itself and with the model, in turn.
                            let timed: &[bool] = if o.timing.is_some() { &[false, true] } else { &[false] };
                            timed.iter().map(move |&timing| {
                                let s = Setup { db, pollers, forecast, in_place, submit_batch, dbbuf, timing, state };
                                (t, s)
                            })
                        })
                    })
                })
            })
            .filter(|(t, s)| !refused(*t, s))
            .map(|(tr, s)| {
                // One poller keeps the plain name; more show in it, as does a
                // forecast turned off and in-place transfers not left to the device.
                let db = s.db;
                let name = if s.pollers == 1 { format!("iopath-{db}") } else { format!("iopath-{db}-p{}", s.pollers) };
                let name = if s.forecast { name } else { format!("{name}-noforecast") };
                let name = match s.in_place {
                    InPlace::Auto => name,
                    InPlace::On => format!("{name}-inplace"),
                    InPlace::Off => format!("{name}-bounce"),
                };
                let name = if s.submit_batch == 0 { name } else { format!("{name}-sb{}", s.submit_batch) };
                let name = if s.dbbuf { name } else { format!("{name}-dbbuf0") };
                let name = if s.state.on() { name } else { format!("{name}{}", super::NOSTATE) };
                let name = if s.timing { format!("{name}{}", super::timing::TIMED) } else { name };
                (name, tr, Kind::Iopath(tr, s))
            })
            .collect();
        if self.fio.is_some() {
            t.push((FIO_TARGET.into(), None, Kind::Fio { busy: false }));
            t.push((FIO_BUSY_TARGET.into(), None, Kind::Fio { busy: true }));
        }
        if self.qemu.is_some() {
            t.push(("qemu".into(), None, Kind::Qemu));
        }
        t.into_iter()
            .flat_map(|(name, tr, kind)| {
                o.contend.iter().map(move |&n| {
                    let name = format!("{name}{}", super::contend_suffix(o, n));
                    let name = match tr.map(|t| t.name()) {
                        Some(t) => format!("{name}@{t}"),
                        None => name,
                    };
                    Target { name, kind, contend: n }
                })
            })
            .collect()
    }

    /// Whether `t` runs job `j` (fio runs no verify job).
    pub fn runs_job(&self, t: &Target, j: &Job) -> bool {
        !(t.is_fio() && j.verify)
    }

    pub fn progress(&self, len: u64) -> ProgressBar {
        crate::progress::bar(self.o.progress, len)
    }

    /// The setup of a target's device, for ratio lines.
    pub fn setup(&self, t: &Target) -> String {
        match (&t.kind, &self.qemu) {
            (Kind::Iopath(_, s), _) if matches!(self.o.backend, StorageKind::File(_)) => {
                let sb = if s.submit_batch == 0 { String::new() } else { format!(" submit_batch={}", s.submit_batch) };
                format!("iopath {} in_place={}{sb}{}", self.o.backend, s.in_place, self.ram_label())
            }
            (Kind::Iopath(..), _) => format!("iopath {}{}", self.o.backend, self.ram_label()),
            (Kind::Qemu, Some((_, b))) => format!("qemu {}", b.short()),
            (Kind::Qemu, None) => "qemu".into(),
            (Kind::Fio { busy: false }, _) => "fio io_uring O_DIRECT".into(),
            (Kind::Fio { busy: true }, _) => "fio io_uring O_DIRECT beside a busy CPU".into(),
        }
    }

    /// How the VMM backs guest RAM: as `--ram` says, and `auto` is a memfd
    /// in every iopath run, the VMM's too, when some run puts the
    /// controller in a device process (which needs the fd): the
    /// out-of-process ratio then compares transports, not memories (the
    /// VMM's own RAM is otherwise anonymous, in huge pages).
    fn ram(&self) -> RamKind {
        match self.o.ram {
            RamKind::Auto if self.o.transports.iter().any(|t| t.is_some()) => RamKind::Memfd,
            k => k,
        }
    }

    /// How the setup line names the guest RAM, where it is not the default.
    fn ram_label(&self) -> String {
        match self.ram() {
            RamKind::Auto => String::new(),
            k => format!(" ram={k}"),
        }
    }

    /// One run of `t` for job `ji` in `round`.
    pub fn run_target(&self, t: &Target, ji: usize, round: u32) -> anyhow::Result<NvmeRun> {
        // The busy threads stop (joined) when the run returns.
        let mut r = match t.kind {
            Kind::Iopath(tr, s) => self.iopath(&t.name, tr, s, t.contend, ji, round),
            Kind::Qemu => self.qemu(&t.name, t.contend, ji, round),
            Kind::Fio { busy } => self.fio(&t.name, t.contend, ji, round, busy),
        }?;
        r.setup = self.setup(t);
        r.contend = t.contend;
        Ok(r)
    }

    fn iopath(
        &self,
        target: &str,
        tr: Option<&'static dyn FunctionTransport>,
        Setup { db, pollers, forecast, in_place, submit_batch, dbbuf, timing, state }: Setup,
        contend: u32,
        ji: usize,
        round: u32,
    ) -> anyhow::Result<NvmeRun> {
        let (o, j) = (self.o, &self.o.jobs[ji]);
        let config = NvmeConfig {
            doorbell: db,
            backend: o.backend.clone(),
            lba_size: o.lba,
            size: self.ns_size,
            pollers,
            forecast,
            in_place,
            submit_batch,
            timing: o.timing.clone().filter(|_| timing).map(Box::new),
            ..NvmeConfig::default()
        };
        let spec = DeviceSpec {
            device: Device::Model(DeviceConfig::Nvme(config)),
            remote: tr.map(|t| (t.into(), Endpoint::Spawn)),
        };
        let _contention = contenders(o, contend)?;
        let _pinned = pinner(o);
        let window = Window::new(NVME_DEVICE_THREADS, WINDOW_START, WINDOW_END, IDLE_WINDOW);
        let vcpu = Window::new(VCPU_THREADS, WINDOW_START, WINDOW_END, Duration::ZERO);
        let (w, v) = (window.clone(), vcpu.clone());
        let line = format!("{} dbbuf={}", cmdline(j, o, self.tsc_khz), dbbuf as u8);
        let mut cfg = VmConfig::new(iopath_guest::IMAGE, &line);
        let proxy = ProxyConfig { state_memory: state };
        cfg.devices = vec![instantiate_with(&spec, &self.progs, &proxy)?];
        cfg.mem_size = o.mem_mb << 20;
        cfg.timeout = Duration::from_secs(o.timeout_s);
        cfg.cancel = Some(&crate::interrupt::FLAG);
        cfg.ram = self.ram();
        // The vCPU's window closes first: the device one then holds the vCPU for its idle pause.
        cfg.on_line = Some(Box::new(move |l| {
            v.on_line(l);
            w.on_line(l)
        }));
        cfg.exit_marks = vec![WINDOW_START.into(), WINDOW_END.into()];
        let rep = run(cfg)?;
        let mut r = to_run(target, ji, round, j, &rep.lines, self.tsc_khz)?;
        r.pollers = pollers;
        if let Some((w, ns)) = per_io(&window, r.io.ios) {
            r.device_threads = w.threads;
            r.cpu_ns_per_io = Some(ns);
            r.idle_cpu_pct = Some(w.idle_pct);
            r.device_waited_pct = Some(w.waited_pct);
        }
        let v = per_io(&vcpu, r.io.ios);
        r.vcpu_ns_per_io = v.map(|(_, ns)| ns);
        r.vcpu_waited_pct = v.map(|(w, _)| w.waited_pct);
        let dev = rep.devices.first().ok_or_else(|| anyhow::anyhow!("no device report"))?;
        let c = |n: &str| dev.counters.iter().find(|c| c.name == n).map(|c| c.value);
        let exits = rep.exits.mmio_write + rep.exits.mmio_read + rep.exits.io_out + rep.exits.io_in;
        let in_window = window_exits(&rep.marks)
            .ok_or_else(|| anyhow::anyhow!("the guest printed no {WINDOW_START} / {WINDOW_END} lines"))?;
        r.vm_exits = Some(exits);
        r.window_exits = Some(in_window);
        r.setup_exits = Some(exits.saturating_sub(in_window));
        r.exits_per_io = Some(in_window as f64 / r.io.ios.max(1) as f64);
        if pollers > 1 {
            r.poller_ios = (0..pollers).filter_map(|k| c(&format!("poller{k}.ios"))).collect();
        }
        r.device_timing = super::timing::DeviceTiming::from_counters(c);
        let (cmds, dbw, admin) = (c("io.commands"), c("doorbell.writes"), c("admin.commands"));
        // The guest's I/O doorbell writes either exited (the
        // controller saw them as MMIO) or were KVM ioeventfd kicks.
        let io_exits = dbw.zip(admin).map(|(d, a)| d.saturating_sub(2 * a));
        let kicks = c("ioeventfd.kicks").unwrap_or(0);
        r.routing = format!(
            "controller io.commands={} of {} guest I/Os; guest doorbell writes {} = {} exits + {kicks} ioeventfd kicks",
            fmt_opt(cmds),
            r.io.ios,
            r.io_doorbell_writes,
            fmt_opt(io_exits),
        );
        // bar: the guest's doorbell stores land in the page mapped over BAR0, so
        // none of them may reach the controller as an exit or a kick.
        // A transport without ioeventfds (ioeventfd) or shared BAR pages (bar) carries
        // these doorbells as messages: checked, and labelled, as exits.
        let exits_only = tr.and_then(|t| match db {
            DoorbellMode::Ioeventfd | DoorbellMode::Adaptive => (!t.announces_ioeventfds()).then_some("ioeventfds"),
            DoorbellMode::Bar | DoorbellMode::BarAdaptive | DoorbellMode::Auto => {
                (!t.shares_bar_pages()).then_some("shared BAR pages")
            }
            _ => None,
        });
        if let (Some(what), Some(t)) = (exits_only, tr) {
            // adaptive: only the doorbells that wake the poller exit; the rest are polled.
            let which = if db == DoorbellMode::Adaptive { "wake-up doorbells exit" } else { "exits" };
            r.routing = format!("{which} ({} has no {what}): {}", t.name(), r.routing);
        }
        let bar_page = db.bar_page() && exits_only.is_none();
        let dbs_ok = bar_page || io_exits.map(|x| x + kicks) == Some(r.io_doorbell_writes);
        // The guest's driver must be the kind the target names: shadow
        // doorbells where asked and offered, else register stores, which
        // exit unless they land in the shared page.
        let want_dbbuf = dbbuf && db.shadowed();
        let driver_ok = r.guest_dbbuf == Some(want_dbbuf);
        if !driver_ok {
            r.routing =
                format!("guest dbbuf={:?}, the target's driver dbbuf={want_dbbuf}: {}", r.guest_dbbuf, r.routing);
        }
        // Register stores exit, unless they land in the shared page.
        let registers = r.guest_dbbuf == Some(false) && !bar_page;
        let want_exits =
            if db == DoorbellMode::Mmio || exits_only.is_some() || registers { r.io_doorbell_writes } else { 0 };
        let exits_ok = if bar_page && matches!(db, DoorbellMode::BarAdaptive | DoorbellMode::Auto) {
            // Stores land in the page except while the idle poller has it
            // trapped: each exit wakes it, and at most one kick per queue (its
            // CQ head and SQ tail) can exit before the page is back; admin
            // doorbells exit the same way, two per command.
            let woke = c("adaptive.wakeups").unwrap_or(0);
            let bound = 2 * j.queues.max(1) as u64 * woke + 2 * admin.unwrap_or(0);
            r.routing = format!(
                "{}; doorbell exits {} <= {bound} (2 x queues x wake-ups + 2 x admin)",
                r.routing,
                fmt_opt(dbw)
            );
            dbw.is_some_and(|x| x <= bound)
        } else {
            io_exits == Some(want_exits)
        };
        // randrw: the guest's reads and writes are the controller's.
        let split_ok = match (&r.read, &r.write) {
            (Some(rd), Some(wr)) => {
                let (reads, writes) = (c("io.reads"), c("io.writes"));
                r.routing = format!(
                    "{}; controller io.reads={} io.writes={} of {} and {} guest reads and writes",
                    r.routing,
                    fmt_opt(reads),
                    fmt_opt(writes),
                    rd.ios,
                    wr.ios
                );
                (reads, writes) == (Some(rd.ios), Some(wr.ios))
            }
            _ => true,
        };
        r.routing_ok = cmds == Some(r.io.ios) && dbs_ok && exits_ok && driver_ok && split_ok;
        guest_checks(&mut r, j);
        if rep.status != 1 {
            anyhow::bail!("{}; routing: {}", crate::record::exit_failure(rep.status, &rep.lines), r.routing);
        }
        Ok(r)
    }

    fn qemu(&self, target: &str, contend: u32, ji: usize, round: u32) -> anyhow::Result<NvmeRun> {
        let (o, j) = (self.o, &self.o.jobs[ji]);
        let (q, backing) = self.qemu.as_ref().ok_or_else(|| anyhow::anyhow!("no QEMU"))?;
        // QEMU's device threads and its vCPU in the guest's timed window. The
        // lines come from QEMU's output, not from a held vCPU: no idle pause.
        let device = Window::new(QEMU_DEVICE_THREADS, WINDOW_START, WINDOW_END, Duration::ZERO);
        let vcpu = Window::new(VCPU_THREADS, WINDOW_START, WINDOW_END, Duration::ZERO);
        let (qr, drive) = {
            let _c = contenders(o, contend)?;
            // QEMU's vCPU where iopath's goes, its main loop where the device threads go.
            let _pinned = o.pin.map(|p| crate::pin::Pinner::start(p, crate::pin::QEMU_DEVICE_THREADS));
            let timeout = Duration::from_secs(o.timeout_s);
            let line = &mut |l: &str| {
                device.on_line(l);
                vcpu.on_line(l)
            };
            crate::qemu::run_nvme(
                q,
                &self.image,
                &cmdline(j, o, self.tsc_khz),
                o.mem_mb,
                backing,
                o.lba,
                timeout,
                line,
            )?
        };
        let mut r = to_run(target, ji, round, j, &qr.lines, self.tsc_khz)
            .map_err(|e| anyhow::anyhow!("{e}; stderr: {}", qr.stderr.trim()))?;
        r.routing = format!("QEMU nvme on {drive}");
        if let Some((w, ns)) = per_io(&device, r.io.ios) {
            r.device_threads = w.threads;
            r.cpu_ns_per_io = Some(ns);
        }
        r.vcpu_ns_per_io = per_io(&vcpu, r.io.ios).map(|(_, ns)| ns);
        // Not on its exit status alone: the guest's own counts too.
        r.routing_ok = qr.status == Some(1);
        if qr.status != Some(1) {
            r.routing = format!("QEMU exit status {:?}: {}", qr.status, r.routing);
        }
        guest_checks(&mut r, j);
        Ok(r)
    }

    /// fio on the host on the namespace's file: job `j`'s rw, bs and run time;
    /// one fio job per queue pair, each at the job's iodepth (see `crate::fio`).
    /// `busy`: one more busy thread runs where the guest's vCPU would (as a
    /// polling vCPU does), and fio where the device threads would.
    fn fio(&self, target: &str, contend: u32, ji: usize, round: u32, busy: bool) -> anyhow::Result<NvmeRun> {
        let (o, j) = (self.o, &self.o.jobs[ji]);
        let (Some(fio), StorageKind::File(path)) = (&self.fio, &o.backend) else { anyhow::bail!("no fio") };
        let fj = crate::fio::FioJob {
            path: path.into(),
            rw: j.rw.clone(),
            bs: j.bs,
            iodepth: j.iodepth,
            numjobs: j.queues.max(1),
            runtime_ms: o.time_ms,
            size: self.ns_size,
            rwmixread: j.rwmixread,
            batch_submit: j.batch_submit,
            cpu: o.pin.filter(|_| busy).map(|p| p.device),
        };
        let _c = contenders(o, contend)?;
        let vcpu = o.pin.map(|p| p.vcpu);
        let _vcpu = busy.then(|| busy_threads(o, 1, vcpu)).transpose()?;
        let f = crate::fio::run(fio, &fj, Duration::from_secs(o.timeout_s))?;
        let mut r = NvmeRun::new(target, "", ji, round, f.io.ios, 0);
        // fio's bins in the guest's buckets: its row's percentiles over rounds merge as the guest's do.
        r.io = IoFigures::from_fio(&f.io, &f.lat_bins, self.tsc_khz);
        r.errors = f.errors;
        if j.split() {
            let d = |d: &crate::fio::FioDir| Some(IoFigures::from_fio(&d.io, &d.lat_bins, self.tsc_khz));
            (r.read, r.write) = (d(&f.read), d(&f.write));
        }
        r.routing = format!(
            "fio on the host: io_uring, O_DIRECT, buffers in huge pages, numjobs={} x iodepth={}",
            fj.numjobs, fj.iodepth
        );
        if busy {
            let on = |c: Option<usize>| c.map_or("unpinned".to_string(), |c| format!("on CPU {c}"));
            r.routing = format!("{}; one busy thread {} (the vCPU's), fio {}", r.routing, on(vcpu), on(fj.cpu));
        }
        // fio's own threads, for the CPU table beside the controller's.
        r.device_threads = if f.cpu_ns_per_io.is_some() { fj.numjobs as usize } else { 0 };
        r.cpu_ns_per_io = f.cpu_ns_per_io;
        Ok(r)
    }
}

fn fmt_opt(v: Option<u64>) -> String {
    v.map_or("?".into(), |v| v.to_string())
}

/// Exits in the guest's timed window: the counts at `WINDOW_END` less
/// those at the first `WINDOW_START` before it, less the PIO writes of the
/// end line itself (one per byte). None without both marks.
pub fn window_exits(marks: &[ExitMark]) -> Option<u64> {
    window_exits_between(marks, WINDOW_START, WINDOW_END)
}

/// `window_exits` between any guest's window lines (`@vblk-window start|end`).
pub fn window_exits_between(marks: &[ExitMark], start: &str, end: &str) -> Option<u64> {
    let s = marks.iter().position(|m| m.line == start)?;
    let e = marks[s..].iter().find(|m| m.line == end)?;
    let (a, b) = (&marks[s].exits, &e.exits);
    let d = |x: u64, y: u64| y.saturating_sub(x);
    let io_out = d(a.io_out, b.io_out).saturating_sub(e.bytes);
    Some(d(a.mmio_write, b.mmio_write) + d(a.mmio_read, b.mmio_read) + d(a.io_in, b.io_in) + io_out)
}

/// The guest's own verdict on a run, iopath's or QEMU's: it did I/O, none
/// failed, and a verify job read back every block clean. A failed check
/// makes the run's check wrong and says why.
pub fn guest_checks(r: &mut NvmeRun, j: &Job) {
    let mut bad = Vec::new();
    if r.io.ios == 0 {
        bad.push("the guest did no I/O".to_string());
    }
    if r.errors > 0 {
        bad.push(format!("{} I/O errors", r.errors));
    }
    if j.verify {
        match (r.verified_blocks, r.mismatches) {
            (Some(v), Some(0)) if v > 0 => {}
            (v, m) => bad.push(format!("verify: {v:?} blocks read back, {m:?} mismatches")),
        }
    }
    // Interrupts: each halt of an irq_wait guest ends on one it takes (a
    // message may merge with one still pending); a polling guest takes none.
    let irqs = match (j.irq_wait, r.guest_sleeps, r.guest_irqs) {
        (true, Some(s), Some(i)) if i >= s => format!(", {s} halts, {i} interrupts taken"),
        (false, _, None | Some(0)) => String::new(),
        (w, s, i) => {
            bad.push(format!("irq_wait={w}: {s:?} halts, {i:?} interrupts taken"));
            String::new()
        }
    };
    if bad.is_empty() {
        r.routing = format!("{}; guest: {} I/Os, 0 errors{irqs}", r.routing, r.io.ios);
    } else {
        r.routing_ok = false;
        r.routing = format!("{}; guest: {}", r.routing, bad.join(", "));
    }
}

/// A run from the guest's `@nvme` record and `@nvme-hist` lines.
pub fn to_run(
    target: &str,
    job: usize,
    round: u32,
    j: &Job,
    lines: &[String],
    tsc_khz: u64,
) -> anyhow::Result<NvmeRun> {
    let f = crate::record::find_record(lines, "nvme").ok_or_else(|| {
        let errs: Vec<&String> = lines.iter().filter(|l| l.contains("error") || l.starts_with("@fault")).collect();
        anyhow::anyhow!("no @nvme record; {errs:?}")
    })?;
    let g = |k: &str| {
        f.get(k).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| anyhow::anyhow!("@nvme record without {k}"))
    };
    let ios = g("ios")?;
    let cycles = g("cycles")?;
    anyhow::ensure!(cycles > 0, "@nvme record with cycles=0");
    let lat = LatHist::parse(lines, ios)?.ok_or_else(|| anyhow::anyhow!("no @nvme-hist lines"))?;
    let secs = cycles as f64 / (tsc_khz as f64 * 1000.0);
    let ns = |c: u64| crate::stats::ns(c as f64, tsc_khz);
    let mut r = NvmeRun::new(target, "", job, round, ios, cycles);
    r.io.iops = ios as f64 / secs;
    r.io.mb_s = ios as f64 * j.bs as f64 / secs / 1e6;
    r.io.lat_avg_ns = ns(g("lat_sum")?) / ios.max(1) as f64;
    if ios > 0 {
        (r.io.lat_min_ns, r.io.lat_max_ns) = (g("lat_min").ok().map(ns), g("lat_max").ok().map(ns));
    }
    r.io.p50_ns = lat.quantile_ns(0.5, tsc_khz);
    r.io.p90_ns = lat.quantile_ns(0.9, tsc_khz);
    r.io.p99_ns = lat.quantile_ns(0.99, tsc_khz);
    r.io.p999_ns = lat.quantile_ns(0.999, tsc_khz);
    r.io.hist = lat.pairs_ns(tsc_khz);
    r.io.lat = Some(lat);
    if j.split() {
        let [read, write] = super::split::from_guest(lines, "nvme", (ios, g("lat_sum")?), j.bs, secs, tsc_khz)?;
        (r.read, r.write) = (Some(read), Some(write));
    }
    r.errors = g("errors")?;
    r.mismatches = g("mismatches").ok();
    r.verified_blocks = g("verified_blocks").ok();
    r.io_doorbell_writes = g("io_doorbell_writes").unwrap_or(0);
    r.guest_wait_pct = g("wait_cycles").ok().map(|w| 100.0 * w as f64 / cycles as f64);
    r.guest_dbbuf = g("dbbuf").ok().map(|v| v != 0);
    r.guest_sleeps = g("sleeps").ok();
    r.guest_irqs = g("irqs").ok();
    Ok(r)
}

/// A window's figures and its threads' CPU time per I/O (None if the window
/// or its threads were not seen).
fn per_io(w: &Window, ios: u64) -> Option<(WindowCpu, f64)> {
    w.result().filter(|w| w.threads > 0).map(|w| (w, w.busy_ns as f64 / ios.max(1) as f64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_vmm::vcpu::ExitStats;

    fn mark(line: &str, bytes: u64, io_out: u64, mmio_write: u64) -> ExitMark {
        ExitMark { line: line.into(), bytes, exits: ExitStats { io_out, mmio_write, ..Default::default() } }
    }

    #[test]
    fn window_exits_leave_out_setup_and_the_end_line() {
        // 500 exits of setup and the start line; 7 doorbell exits in the window;
        // the end line's 17 bytes.
        let m = [mark(WINDOW_START, 19, 400, 100), mark(WINDOW_END, 17, 417, 107)];
        assert_eq!(window_exits(&m), Some(7));
        assert_eq!(window_exits(&m[..1]), None);
        assert_eq!(window_exits(&m[1..]), None, "an end without a start");
        // Marks out of order (a hostile guest): no underflow, no panic.
        let m = [mark(WINDOW_START, 19, 400, 100), mark(WINDOW_END, 99, 10, 0)];
        assert_eq!(window_exits(&m), Some(0));
    }

    fn job(verify: bool) -> Job {
        Job { verify, ..Job::randread(4096, 1) }
    }

    fn lines(s: &[&str]) -> Vec<String> {
        s.iter().map(|l| l.to_string()).collect()
    }

    #[test]
    fn a_run_keeps_ios_cycles_and_the_histogram() {
        let l = lines(&[
            "@nvme rw=randread ios=4 cycles=2000000 wait_cycles=500000 lat_sum=4000 p50=1 p90=1 p99=1 p999=1 errors=0",
            "@nvme-hist 548:4",
            "@nvme-hist-end buckets=1 lines=1",
        ]);
        // 1 GHz: 2 M cycles are 2 ms.
        let r = to_run("qemu", 0, 0, &job(false), &l, 1_000_000).unwrap();
        assert_eq!((r.io.ios, r.cycles, r.io.iops), (4, 2_000_000, 2000.0));
        assert_eq!(r.guest_wait_pct, Some(25.0), "a quarter of the window found nothing to reap");
        assert_eq!(r.io.hist, vec![(403.0, 4)]);
        // The record's own p50 (1 cycle, a bucket's upper edge) is not used: the host's, interpolated.
        assert_eq!(r.io.p50_ns, 401.5);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["hist"], serde_json::json!([[403.0, 4]]));
        assert_eq!((v["ios"].as_u64(), v["cycles"].as_u64()), (Some(4), Some(2_000_000)));
        assert_eq!(v["marks"], serde_json::json!([]));
    }

    /// A randrw run from fixed guest records: its JSON as the bench writes it
    /// (through `serde_json::Value`, keys sorted), the text taken before the
    /// direction's figures became one struct.
    fn golden_run() -> NvmeRun {
        let l = lines(&[
            "@nvme rw=randrw ios=6 cycles=3000000 wait_cycles=600000 lat_sum=9000 lat_min=700 lat_max=2600 errors=0 io_doorbell_writes=9",
            "@nvme-hist 548:4 600:2",
            "@nvme-hist-end buckets=2 lines=1",
            "@nvme-read ios=4 lat_sum=5000 lat_min=700 lat_max=1900",
            "@nvme-read-hist 548:3 600:1",
            "@nvme-read-hist-end buckets=2 lines=1",
            "@nvme-write ios=2 lat_sum=4000 lat_min=1500 lat_max=2600",
            "@nvme-write-hist 548:1 600:1",
            "@nvme-write-hist-end buckets=2 lines=1",
        ]);
        let j = Job { rw: "randrw".into(), rwmixread: 70, ..Job::randread(4096, 2) };
        to_run("iopath-shm", 1, 0, &j, &l, 1_500_000).unwrap()
    }

    #[test]
    fn a_runs_json_is_the_text_it_always_was() {
        let r = golden_run();
        let text = serde_json::to_string(&serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(text, GOLDEN);
    }

    const GOLDEN: &str = concat!(
        r#"{"attempt":0,"contend":0,"cpu_ns_per_io":null,"cycles":3000000,"device_threads":0"#,
        r#","device_waited_pct":null,"errors":0,"exits_per_io":null,"fio_busy_ratio":null,"fio_ratio":null"#,
        r#","floor_ops_s":null,"floor_p50_ns":null,"floor_ratio":null,"guest_dbbuf":null,"guest_irqs":null"#,
        r#","guest_line_ns":null,"guest_line_ratio":null,"guest_sleeps":null,"guest_wait_pct":20.0"#,
        r#","hist":[[268.6666666666667,4],[474.0,2]],"idle_cpu_pct":null,"io_doorbell_writes":9,"iops":3000.0"#,
        r#","ios":6,"job":1,"lat_avg_ns":1000.0,"lat_max_ns":1733.3333333333333,"lat_min_ns":466.6666666666667"#,
        r#","marks":[],"mb_s":12.288,"mismatches":null,"p50_ns":268.1666666666667,"p90_ns":472.6"#,
        r#","p999_ns":473.986,"p99_ns":473.86,"poller_ios":[],"pollers":1,"quiet_floor_ratio":null"#,
        r#","quiet_ratio":null,"read":{"hist":[[268.6666666666667,3],[474.0,1]],"iops":2000.0,"ios":4"#,
        r#","lat_avg_ns":833.3333333333334,"lat_max_ns":1266.6666666666667,"lat_min_ns":466.6666666666667"#,
        r#","mb_s":8.192,"p50_ns":268.0,"p90_ns":472.1333333333333,"p999_ns":473.98133333333334"#,
        r#","p99_ns":473.81333333333333},"round":0,"routing":"","routing_ok":true,"setup":"","setup_exits":null"#,
        r#","target":"iopath-shm","vcpu_ns_per_io":null,"vcpu_waited_pct":null,"verified_blocks":null"#,
        r#","vm_exits":null,"vmm_floor_ratio":null,"vmm_ratio":null,"wake_p50_ns":null,"wake_ratio":null"#,
        r#","window_exits":null,"write":{"hist":[[268.6666666666667,1],[474.0,1]],"iops":1000.0,"ios":2"#,
        r#","lat_avg_ns":1333.3333333333333,"lat_max_ns":1733.3333333333333,"lat_min_ns":1000.0,"mb_s":4.096"#,
        r#","p50_ns":268.6666666666667,"p90_ns":473.06666666666666,"p999_ns":473.99066666666664"#,
        r#","p99_ns":473.9066666666667}}"#,
    );

    #[test]
    fn a_record_without_a_good_histogram_is_an_error() {
        let rec = "@nvme ios=4 cycles=2000 lat_sum=4000 errors=0";
        for bad in [
            lines(&[rec]),
            lines(&[rec, "@nvme-hist 548:3", "@nvme-hist-end buckets=1 lines=1"]),
            lines(&[rec, "@nvme-hist 548:4"]),
            lines(&["@nvme ios=4 cycles=0 lat_sum=4 errors=0", "@nvme-hist 548:4", "@nvme-hist-end buckets=1 lines=1"]),
            lines(&["@nvme ios=x cycles=1"]),
        ] {
            assert!(to_run("t", 0, 0, &job(false), &bad, 1_000_000).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_guests_counts_decide_a_run_not_its_exit_status_alone() {
        let ok = |ios, errors, verified: Option<u64>, mismatches: Option<u64>, verify| {
            let mut r = NvmeRun::new("qemu", "", 0, 0, ios, 1);
            (r.errors, r.verified_blocks, r.mismatches) = (errors, verified, mismatches);
            r.routing = "QEMU nvme on null-co".into();
            guest_checks(&mut r, &job(verify));
            (r.routing_ok, r.routing)
        };
        assert!(ok(10, 0, None, None, false).0);
        assert!(!ok(0, 0, None, None, false).0, "no I/O");
        let (good, why) = ok(10, 2, None, None, false);
        assert!(!good && why.contains("2 I/O errors"), "{why}");
        assert!(ok(10, 0, Some(8), Some(0), true).0);
        assert!(!ok(10, 0, Some(8), Some(1), true).0, "a mismatch");
        assert!(!ok(10, 0, None, None, true).0, "a verify job without its counts");
        assert!(!ok(10, 0, Some(0), Some(0), true).0, "nothing read back");
    }

    #[test]
    fn an_irq_wait_guest_takes_an_interrupt_for_each_halt_and_a_polling_one_takes_none() {
        let ok = |irq_wait, sleeps: Option<u64>, irqs: Option<u64>| {
            let mut r = NvmeRun::new("iopath-shm", "", 0, 0, 10, 1);
            (r.guest_sleeps, r.guest_irqs) = (sleeps, irqs);
            guest_checks(&mut r, &Job { irq_wait, ..job(false) });
            (r.routing_ok, r.routing)
        };
        let (good, why) = ok(true, Some(4), Some(5));
        assert!(good && why.contains("4 halts, 5 interrupts taken"), "{why}");
        assert!(!ok(true, Some(5), Some(4)).0, "a halt that no interrupt ended");
        assert!(!ok(true, None, None).0, "a guest without the counts");
        assert!(ok(false, Some(0), Some(0)).0 && ok(false, None, None).0);
        let (good, why) = ok(false, Some(0), Some(3));
        assert!(!good && why.contains("3"), "a polling guest took interrupts: {why}");
    }
}
