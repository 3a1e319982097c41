//! `iopath bench exits`: the exit-cost table (kvm-unit-tests x86/vmexit style)
//! for every path that needs no second process, on iopath's VMM, on the bare
//! KVM_RUN floor, and optionally on QEMU, interleaved round by round; the
//! VMM and its floor at each guest privilege level asked for (`cpls`).
//!
//! Each run's routing is verified from counters before its figures are used
//! (`verify.rs`): the devices' own counters and the VMM's in iopath, the bare
//! loop's exit counts for the floor, pci-testdev's `count` register under
//! QEMU. Figures below their floor or rounds that disagree are marked and
//! their rows run again (`rerun.rs`); `report.rs` makes the table and JSON.

mod args;
mod report;
mod rerun;
mod verify;

pub use args::ExitsArgs;
pub(crate) use report::fmt_ns;
pub use report::{RowStats, TargetStats};
pub use rerun::{guard_rows, marks};
pub(crate) use verify::fmt_opt;
pub use verify::{verify_floor, verify_iopath, verify_qemu, Routing};

use crate::guard::GuardConfig;
use crate::host::{host_info, HostInfo};
use crate::record::GuestOutput;
use indicatif::ProgressBar;
use iopath_devices::doorbell::Doorbell;
use iopath_devices::testdev::PciTestDev;
use iopath_devices::SharedDevice;
use iopath_protocols::attach::Programs;
use iopath_vmm::vcpu::ExitStats;
use iopath_vmm::{run, VmConfig};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Debug, Serialize)]
pub struct ExitsOptions {
    pub rounds: u32,
    pub batches: u32,
    pub batch_us: u64,
    /// Row-name prefixes, comma-separated (guest `only=`).
    pub only: Option<String>,
    pub vs_qemu: bool,
    pub floor: bool,
    pub timeout_s: u64,
    pub progress: bool,
    /// Out-of-process transports to run pci-testdev over (mpqemu,
    /// vfio-user, ioregionfd, ioregionfd-posted); with `vs_qemu`, QEMU's
    /// x-remote joins as the mpqemu device process.
    pub transports: Vec<String>,
    /// Socket polling budget of the VMM and its device processes, in us.
    pub spin_us: u64,
    /// Busy threads run for the whole bench, every target's runs included (`--contend N`).
    pub contend: u32,
    /// The iopath binary that serves device processes (default: this one).
    #[serde(skip)]
    pub iopath_exe: Option<std::path::PathBuf>,
    /// Guest privilege levels the access loops of the VMM and floor runs run
    /// at, each a run of its own per round: 3 (native on every host) and/or
    /// 0 (emulated on kvm_pvm). QEMU and the device processes run at 3.
    pub cpls: Vec<u8>,
    /// Marks and re-runs for figures below their floor or rounds that disagree.
    #[serde(skip)]
    pub guard: GuardConfig,
}

impl Default for ExitsOptions {
    fn default() -> Self {
        ExitsOptions {
            rounds: 3,
            batches: 9,
            batch_us: 20_000,
            only: None,
            vs_qemu: false,
            floor: true,
            timeout_s: 300,
            progress: true,
            transports: iopath_protocols::function_transports().map(|t| t.name().to_string()).collect(),
            iopath_exe: None,
            spin_us: 0,
            contend: 0,
            cpls: vec![3],
            guard: GuardConfig::default(),
        }
    }
}

/// Where one run of the exit rows runs. Out-of-process targets come from the
/// registry's function transports: a function transport added there is a bench target too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Iopath,
    Floor,
    Qemu,
    /// pci-testdev in an `iopath serve` device process, over the transport of this name.
    Remote(&'static str),
    /// QEMU's pci-testdev in `qemu-system-x86_64 -machine x-remote`, iopath's VMM as the mpqemu proxy.
    QemuRemote,
}

impl Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl Target {
    /// Every target, in table order: the VMM, its floor, QEMU, each transport, QEMU's x-remote.
    pub fn all() -> Vec<Target> {
        let mut v = vec![Target::Iopath, Target::Floor, Target::Qemu];
        v.extend(iopath_protocols::function_transports().map(|t| Target::Remote(t.name())));
        v.push(Target::QemuRemote);
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Target::Iopath => "iopath",
            Target::Floor => "floor",
            Target::Qemu => "qemu",
            Target::Remote(t) => t,
            Target::QemuRemote => "qemu-x-remote",
        }
    }
}

/// One guest run of one target.
pub struct TargetRun {
    pub target: Target,
    pub round: u32,
    /// The privilege level the guest ran the access loops at.
    pub cpl: u8,
    /// 0 for the bench's own rounds; k for the k-th re-run of a marked row.
    pub attempt: u32,
    pub out: GuestOutput,
    pub routing: BTreeMap<String, Routing>,
    pub exits: Option<ExitStats>,
    pub wall_s: f64,
}

pub struct ExitsResult {
    /// Ctrl-C stopped the bench: the runs measured before it, no re-runs.
    pub partial: bool,
    pub host: HostInfo,
    pub options: ExitsOptions,
    pub tsc_khz: u64,
    pub runs: Vec<TargetRun>,
    pub errors: Vec<String>,
    /// Host-side request/reply round trips per transport, ns per batch.
    pub rtt_ns: BTreeMap<String, Vec<f64>>,
    /// Attempts a marked (row, cpl, target) took (1 + its re-runs).
    pub attempts: BTreeMap<(String, u8, Target), u32>,
}

pub(crate) fn guest_cmdline(o: &ExitsOptions, workload: &str, tsc_khz: u64, extra: &str) -> String {
    let mut c = format!("workload={workload} batches={} batch_us={} tsc_khz={tsc_khz}", o.batches, o.batch_us);
    if let Some(only) = &o.only {
        c.push_str(&format!(" only={only}"));
    }
    if !extra.is_empty() {
        c.push(' ');
        c.push_str(extra);
    }
    c
}

pub(crate) fn progress_callback(pb: &ProgressBar, label: String) -> Box<dyn FnMut(&str) + Send> {
    let pb = pb.clone();
    Box::new(move |l: &str| {
        if let Some(r) = crate::record::parse_row(l) {
            pb.set_message(format!("{label}: {}", r.name));
        }
    })
}

/// The devices of an exits run.
pub fn exit_devices() -> Vec<SharedDevice> {
    vec![Arc::new(Mutex::new(PciTestDev::new())), Arc::new(Mutex::new(Doorbell::new()))]
}

/// The TSC rate KVM reports (KVM_GET_TSC_KHZ), from one tiny guest run that
/// also proves the VMM works before the long runs start.
pub(crate) fn tsc_khz_of_host() -> anyhow::Result<u64> {
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, "workload=exits only=none batches=1 batch_us=1");
    cfg.devices = Vec::new();
    cfg.timeout = Duration::from_secs(60);
    cfg.cancel = Some(&crate::interrupt::FLAG);
    let r = run(cfg).map_err(|e| anyhow::anyhow!("iopath VMM: {e}"))?;
    Ok(r.tsc_khz as u64)
}

/// Runs one target once: the bench's rounds and the guard's re-runs both go
/// through here.
pub(crate) struct Runner<'a> {
    pub o: &'a ExitsOptions,
    pub tsc_khz: u64,
    pub pb: &'a ProgressBar,
    pub progs: &'a Programs,
    /// pci-testdev's BAR addresses from the last VMM run at each cpl, for the floor.
    td: BTreeMap<u8, (Option<u64>, Option<u64>)>,
}

impl Runner<'_> {
    /// One guest run of `t` at `cpl`; `only` narrows the rows (a re-run).
    pub fn run(
        &mut self,
        t: Target,
        cpl: u8,
        only: Option<&str>,
        round: u32,
        attempt: u32,
    ) -> anyhow::Result<TargetRun> {
        let mut o = self.o.clone();
        if let Some(row) = only {
            o.only = Some(row.to_string());
        }
        let again = if attempt > 0 { format!(" re-run {attempt}") } else { String::new() };
        let label = format!("round {}/{} {} cpl{cpl}{again}", round + 1, o.rounds, t.name());
        self.pb.set_message(label.clone());
        let t0 = Instant::now();
        let mut run = match t {
            Target::Iopath => self.iopath(&o, cpl, label)?,
            Target::Floor => self.floor(&o, cpl)?,
            Target::Remote(_) | Target::QemuRemote => {
                let ctx = crate::remote::Round { o: &o, round, tsc_khz: self.tsc_khz, pb: self.pb, progs: self.progs };
                ctx.guest_run(t, &label, only)?
            }
            Target::Qemu => anyhow::bail!("QEMU runs are not re-run"),
        };
        verify::check_cpl(&run.out, cpl, &mut run.routing);
        run.round = round;
        run.cpl = cpl;
        run.attempt = attempt;
        run.wall_s = t0.elapsed().as_secs_f64();
        Ok(run)
    }

    fn iopath(&mut self, o: &ExitsOptions, cpl: u8, label: String) -> anyhow::Result<TargetRun> {
        let mut cfg =
            VmConfig::new(iopath_guest::IMAGE, &guest_cmdline(o, "exits", self.tsc_khz, &format!("cpl={cpl}")));
        cfg.devices = exit_devices();
        cfg.timeout = Duration::from_secs(o.timeout_s);
        cfg.cancel = Some(&crate::interrupt::FLAG);
        cfg.on_line = Some(progress_callback(self.pb, label));
        let r = run(cfg)?;
        let out = GuestOutput::parse(&r.lines);
        if r.status != 1 {
            anyhow::bail!("{}", crate::record::exit_failure(r.status, &r.lines));
        }
        let addr = |n: &str| {
            out.row(n)
                .and_then(|r| r.extra.get("addr"))
                .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
        };
        let td = self.td.entry(cpl).or_default();
        td.0 = addr("mmio-no-eventfd:pci-mem").or(td.0);
        td.1 = addr("portio-no-eventfd:pci-io").or(td.1);
        let routing = verify_iopath(&out, &r);
        Ok(TargetRun {
            target: Target::Iopath,
            round: 0,
            cpl,
            attempt: 0,
            out,
            routing,
            exits: Some(r.exits),
            wall_s: 0.0,
        })
    }

    fn floor(&mut self, o: &ExitsOptions, cpl: u8) -> anyhow::Result<TargetRun> {
        let mut extra = format!("cpl={cpl}");
        let (td_mmio, td_pio) = self.td.get(&cpl).copied().unwrap_or_default();
        if let Some(a) = td_mmio {
            extra.push_str(&format!(" td_mmio={a}"));
        }
        if let Some(a) = td_pio {
            extra.push_str(&format!(" td_pio={a}"));
        }
        let r = iopath_vmm::bare::run_bare(
            iopath_guest::IMAGE,
            &guest_cmdline(o, "floor", self.tsc_khz, &extra),
            64 << 20,
            Duration::from_secs(o.timeout_s),
        )?;
        let out = GuestOutput::parse(&r.lines);
        if r.status != 1 {
            anyhow::bail!("{}", crate::record::exit_failure(r.status, &r.lines));
        }
        // The loop kept one byte per serial OUT; `lines` dropped each '\n'.
        let serial: u64 = r.lines.iter().map(|l| l.len() as u64 + 1).sum();
        let routing = verify_floor(&out, serial, &r.exits);
        Ok(TargetRun {
            target: Target::Floor,
            round: 0,
            cpl,
            attempt: 0,
            out,
            routing,
            exits: Some(r.exits),
            wall_s: 0.0,
        })
    }
}

pub fn run_exits(o: &ExitsOptions) -> anyhow::Result<ExitsResult> {
    if o.cpls.is_empty() || o.cpls.iter().any(|c| *c != 0 && *c != 3) {
        anyhow::bail!("cpls must be 0 and/or 3, not {:?}", o.cpls);
    }
    let qemu = if o.vs_qemu { Some(crate::qemu::find()?) } else { None };
    let image_path = iopath_guest::image_file()?;
    let tsc_khz = tsc_khz_of_host()?;
    let host = host_info(tsc_khz);
    let remote_targets = crate::remote::targets(o, qemu.is_some())?;
    let ncpl = o.cpls.len() as u64;
    let per_round = ncpl * (1 + o.floor as u64) + qemu.is_some() as u64 + remote_targets.len() as u64;
    let pb = crate::progress::bar(o.progress, o.rounds as u64 * per_round);
    let timeout = Duration::from_secs(o.timeout_s);
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    let mut rtt_ns: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let progs = Programs {
        iopath: match &o.iopath_exe {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        },
        qemu: qemu.clone(),
        serve_args: vec!["--spin-us".into(), o.spin_us.to_string()],
    };
    iopath_protocols::socket::set_spin(Duration::from_micros(o.spin_us));
    // One set of contenders for all rounds and re-runs (joined when this
    // returns); they stop by themselves once every run could have timed out.
    let runs_bound = o.rounds.saturating_mul(per_round as u32).saturating_mul(1 + o.guard.reruns).saturating_add(1);
    let _contention = crate::contend::Contention::start(o.contend, timeout.saturating_mul(runs_bound))
        .map_err(|e| anyhow::anyhow!("cannot start {} contenders: {e}", o.contend))?;
    let mut runner = Runner { o, tsc_khz, pb: &pb, progs: &progs, td: BTreeMap::new() };
    let interrupted = crate::interrupt::interrupted;
    'rounds: for round in 0..o.rounds {
        for &cpl in &o.cpls {
            // iopath's VMM with pci-testdev and iopath-doorbell, then its floor.
            let mut targets = vec![Target::Iopath];
            if o.floor {
                targets.push(Target::Floor);
            }
            for t in targets {
                match runner.run(t, cpl, None, round, 0) {
                    Ok(r) => runs.push(r),
                    Err(_) if interrupted() => break 'rounds,
                    Err(e) => errors.push(format!("{} cpl{cpl} round {round}: {e}", t.name())),
                }
                pb.inc(1);
            }
        }
        if let Some(q) = &qemu {
            let t0 = Instant::now();
            let mut cb = progress_callback(&pb, format!("round {}/{} qemu", round + 1, o.rounds));
            match crate::qemu::run(
                q,
                &image_path,
                &guest_cmdline(o, "exits", tsc_khz, ""),
                &["pci-testdev"],
                timeout,
                |l| cb(l),
            ) {
                Ok(r) => {
                    let out = GuestOutput::parse(&r.lines);
                    if r.status != Some(1) {
                        errors.push(format!(
                            "qemu round {round}: exit status {:?}; stderr: {}",
                            r.status,
                            r.stderr.trim()
                        ));
                    }
                    let routing = verify_qemu(&out);
                    runs.push(TargetRun {
                        target: Target::Qemu,
                        round,
                        cpl: 3,
                        attempt: 0,
                        out,
                        routing,
                        exits: None,
                        wall_s: t0.elapsed().as_secs_f64(),
                    });
                }
                Err(_) if interrupted() => break 'rounds,
                Err(e) => errors.push(format!("qemu round {round}: {e}")),
            }
            pb.inc(1);
        }
        for t in &remote_targets {
            match runner.run(*t, 3, None, round, 0) {
                Ok(r) => runs.push(r),
                Err(_) if interrupted() => break 'rounds,
                Err(e) => errors.push(format!("{} round {round}: {e}", t.name())),
            }
            if *t != Target::QemuRemote {
                pb.set_message(format!("round {}/{} {}: socket round trip", round + 1, o.rounds, t.name()));
                let ctx = crate::remote::Round { o, round, tsc_khz, pb: &pb, progs: &progs };
                match ctx.round_trip(*t) {
                    Ok(v) => rtt_ns.entry(t.name().to_string()).or_default().extend(v),
                    Err(_) if interrupted() => break 'rounds,
                    Err(e) => errors.push(format!("{} round {round}: round trip: {e}", t.name())),
                }
            }
            pb.inc(1);
        }
    }
    let mut result = ExitsResult {
        partial: interrupted(),
        host,
        options: o.clone(),
        tsc_khz,
        runs,
        errors,
        rtt_ns,
        attempts: BTreeMap::new(),
    };
    // Marked rows run again, all their rounds, before a mark stays (not after Ctrl-C).
    if !result.partial {
        // A re-run's rounds join the bar when its first round starts (for
        // each target it runs), so the ETA counts them.
        guard_rows(&mut result, &mut |t, cpl, row, round, attempt| {
            if round == 0 {
                pb.inc_length(o.rounds as u64);
            }
            let run = runner.run(t, cpl, Some(row), round, attempt);
            pb.inc(1);
            run
        });
    }
    pb.finish_and_clear();
    let mut wrong = Vec::new();
    for r in &result.runs {
        for (row, v) in &r.routing {
            if !v.ok {
                wrong.push(format!(
                    "{} cpl{} round {}{}: {row}: routing wrong: {}",
                    r.target.name(),
                    r.cpl,
                    r.round,
                    if r.attempt > 0 { format!(" re-run {}", r.attempt) } else { String::new() },
                    v.detail
                ));
            }
        }
    }
    result.errors.extend(wrong);
    Ok(result)
}
