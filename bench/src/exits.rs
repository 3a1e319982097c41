//! `iopath bench exits`: the exit-cost table (kvm-unit-tests x86/vmexit style)
//! for every path that needs no second process, on iopath's VMM, on the bare
//! KVM_RUN floor, and optionally on QEMU, interleaved round by round.
//!
//! Each run's routing is verified from counters before its figures are used:
//! the device's own counters in iopath, pci-testdev's `count` register under
//! QEMU, the VMM's unclaimed-access counters for the rows that exit on purpose.

use crate::host::{host_info, HostInfo};
use crate::record::{GuestOutput, Row};
use crate::stats::{ns, summarize, Summary};
use indicatif::{ProgressBar, ProgressStyle};
use iopath_devices::doorbell::Doorbell;
use iopath_devices::testdev::PciTestDev;
use iopath_devices::SharedDevice;
use iopath_vmm::vcpu::ExitStats;
use iopath_vmm::vm::RunReport;
use iopath_vmm::{run, VmConfig};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
            transports: iopath_protocols::TRANSPORTS.iter().map(|t| t.name().to_string()).collect(),
            iopath_exe: None,
            spin_us: 0,
            contend: 0,
        }
    }
}

/// Where one run of the exit rows runs. Out-of-process targets come from the
/// transport registry: a transport added there is a bench target too.
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
        v.extend(iopath_protocols::TRANSPORTS.iter().map(|t| Target::Remote(t.name())));
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

/// A routing verdict for one row of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Routing {
    pub ok: bool,
    pub detail: String,
}

fn ok(detail: String) -> Routing {
    Routing { ok: true, detail }
}
fn bad(detail: String) -> Routing {
    Routing { ok: false, detail }
}

/// Checks each row of an iopath run against the device and VMM counters.
pub fn verify_iopath(out: &GuestOutput, run: &RunReport) -> BTreeMap<String, Routing> {
    let counter = |dev: &str, name: &str| -> Option<u64> {
        run.devices.iter().find(|d| d.name == dev)?.counters.iter().find(|c| c.name == name).map(|c| c.value)
    };
    let acc = |name: &str| out.row(name).map(|r| r.accesses).unwrap_or(0);
    let e = &run.exits;
    let mut v = BTreeMap::new();
    for r in &out.rows {
        let verdict = match (r.group.as_str(), r.status()) {
            (_, Some(s)) if s != "ok" => {
                bad(format!("guest reported status={s} {}", r.extra.get("reason").cloned().unwrap_or_default()))
            }
            ("pci-testdev", _) if r.name.contains("-read:") => {
                // Reads of `data`: the row's, plus a few from the guest's test scan.
                let ty = r.name.split('-').next().unwrap_or("");
                let reads = counter("pci-testdev", &format!("{ty}.data-reads"));
                let d = format!("data-reads={} of {} reads", fmt_opt(reads), r.accesses);
                match reads {
                    Some(n) if n >= r.accesses && n <= r.accesses + 64 => ok(d),
                    _ => bad(d),
                }
            }
            ("pci-testdev", _) => {
                let test = r.name.split(':').next().unwrap_or("");
                let (exits, kicks) = (
                    counter("pci-testdev", &format!("{test}.exits")),
                    counter("pci-testdev", &format!("{test}.kicks")),
                );
                let count = r.get_u64("count");
                let want_exit = test.contains("no-eventfd");
                let (we, wk) = if want_exit { (r.accesses, 0) } else { (0, r.accesses) };
                let detail = format!(
                    "count={} exits={} kicks={} of {} writes",
                    fmt_opt(count),
                    fmt_opt(exits),
                    fmt_opt(kicks),
                    r.accesses
                );
                if count == Some(we) && exits == Some(we) && kicks == Some(wk) {
                    ok(detail)
                } else {
                    bad(detail)
                }
            }
            ("doorbell", _) => {
                let (x, k, p) = (r.get_u64("exits"), r.get_u64("kicks"), r.get_u64("polls"));
                let a = r.accesses;
                let want = match r.name.rsplit(':').next().unwrap_or("") {
                    s if s.starts_with("exit") => (a, 0, 0),
                    s if s.starts_with("ioeventfd") => (0, a, 0),
                    _ => (0, 0, a),
                };
                let detail = format!("exits={} kicks={} polls={} of {a} doorbells", fmt_opt(x), fmt_opt(k), fmt_opt(p));
                if (x, k, p) == (Some(want.0), Some(want.1), Some(want.2)) {
                    ok(detail)
                } else {
                    bad(detail)
                }
            }
            ("vmm", _) => {
                let (seen, what) = match r.name.as_str() {
                    "outl_to_vmm" => (e.unclaimed_pio_write, "unclaimed PIO writes"),
                    "inl_from_vmm" => (e.unclaimed_pio_read, "unclaimed PIO reads"),
                    _ => (e.unclaimed_mmio_write, "unclaimed MMIO writes"),
                };
                let d = format!("{what}={seen} >= {}", r.accesses);
                if seen >= r.accesses {
                    ok(d)
                } else {
                    bad(d)
                }
            }
            ("kernel", _) => {
                // Had KVM passed port 0x4d0 to the VMM, it would be unclaimed there too.
                let (seen, vmm_row) = if r.name.starts_with("inl") {
                    (e.unclaimed_pio_read, "inl_from_vmm")
                } else {
                    (e.unclaimed_pio_write, "outl_to_vmm")
                };
                let d = format!("VMM saw {} of its {} accesses", seen.saturating_sub(acc(vmm_row)), r.accesses);
                if seen < acc(vmm_row) + r.accesses {
                    ok(d)
                } else {
                    bad(d)
                }
            }
            _ => ok("-".into()),
        };
        v.insert(r.name.clone(), verdict);
    }
    v
}

/// Under QEMU only pci-testdev's `count` register tells the route.
pub fn verify_qemu(out: &GuestOutput) -> BTreeMap<String, Routing> {
    let mut v = BTreeMap::new();
    for r in &out.rows {
        let verdict = match (r.group.as_str(), r.status()) {
            (_, Some(s)) if s != "ok" => bad(format!("guest reported status={s}")),
            ("pci-testdev", _) if r.name.contains("-read:") => ok("reads: QEMU's pci-testdev counts none".into()),
            ("pci-testdev", _) => {
                let want = if r.name.contains("no-eventfd") { r.accesses } else { 0 };
                let c = r.get_u64("count");
                let d = format!("count={} of {} writes", fmt_opt(c), r.accesses);
                if c == Some(want) {
                    ok(d)
                } else {
                    bad(d)
                }
            }
            _ => ok("-".into()),
        };
        v.insert(r.name.clone(), verdict);
    }
    v
}

pub(crate) fn fmt_opt(v: Option<u64>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "?".into())
}

/// One guest run of one target.
pub struct TargetRun {
    pub target: Target,
    pub round: u32,
    pub out: GuestOutput,
    pub routing: BTreeMap<String, Routing>,
    pub exits: Option<ExitStats>,
    pub wall_s: f64,
}

pub struct ExitsResult {
    pub host: HostInfo,
    pub options: ExitsOptions,
    pub tsc_khz: u64,
    pub runs: Vec<TargetRun>,
    pub errors: Vec<String>,
    /// Host-side request/reply round trips per transport, ns per batch.
    pub rtt_ns: BTreeMap<String, Vec<f64>>,
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
    let r = run(cfg).map_err(|e| anyhow::anyhow!("iopath VMM: {e}"))?;
    Ok(r.tsc_khz as u64)
}

pub fn run_exits(o: &ExitsOptions) -> anyhow::Result<ExitsResult> {
    let qemu = if o.vs_qemu { Some(crate::qemu::find()?) } else { None };
    let image_path = iopath_guest::image_file()?;
    let tsc_khz = tsc_khz_of_host()?;
    let host = host_info(tsc_khz);
    let remote_targets = crate::remote::targets(o, qemu.is_some())?;
    let per_round = 1 + o.floor as u64 + qemu.is_some() as u64 + remote_targets.len() as u64;
    let pb = if o.progress { ProgressBar::new(o.rounds as u64 * per_round) } else { ProgressBar::hidden() };
    pb.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").unwrap().progress_chars("=> "),
    );
    let timeout = Duration::from_secs(o.timeout_s);
    let mut runs = Vec::new();
    let mut errors = Vec::new();
    let mut rtt_ns = BTreeMap::new();
    let progs = iopath_protocols::attach::Programs {
        iopath: match &o.iopath_exe {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        },
        qemu: qemu.clone(),
        serve_args: vec!["--spin-us".into(), o.spin_us.to_string()],
    };
    iopath_protocols::socket::set_spin(Duration::from_micros(o.spin_us));
    // One set of contenders for all rounds (joined when this returns); they
    // stop by themselves once every run could have timed out.
    let limit = timeout.saturating_mul(o.rounds.saturating_mul(per_round as u32).saturating_add(1));
    let _contention = crate::contend::Contention::start(o.contend, limit)
        .map_err(|e| anyhow::anyhow!("cannot start {} contenders: {e}", o.contend))?;
    for round in 0..o.rounds {
        // iopath's VMM with pci-testdev and iopath-doorbell.
        let mut cfg = VmConfig::new(iopath_guest::IMAGE, &guest_cmdline(o, "exits", tsc_khz, ""));
        cfg.devices = exit_devices();
        cfg.timeout = timeout;
        cfg.on_line = Some(progress_callback(&pb, format!("round {}/{} iopath", round + 1, o.rounds)));
        let t0 = std::time::Instant::now();
        let (td_mmio, td_pio) = match run(cfg) {
            Ok(r) => {
                let out = GuestOutput::parse(&r.lines);
                if r.status != 1 {
                    errors.push(format!(
                        "iopath round {round}: guest exit status {} {}",
                        r.status,
                        out.fault.clone().unwrap_or_default()
                    ));
                }
                let routing = verify_iopath(&out, &r);
                let addr = |n: &str| {
                    out.row(n)
                        .and_then(|r| r.extra.get("addr"))
                        .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
                };
                let td = (addr("mmio-no-eventfd:pci-mem"), addr("portio-no-eventfd:pci-io"));
                runs.push(TargetRun {
                    target: Target::Iopath,
                    round,
                    out,
                    routing,
                    exits: Some(r.exits),
                    wall_s: t0.elapsed().as_secs_f64(),
                });
                td
            }
            Err(e) => {
                errors.push(format!("iopath round {round}: {e}"));
                (None, None)
            }
        };
        pb.inc(1);
        if o.floor {
            let mut extra = String::new();
            if let Some(a) = td_mmio {
                extra.push_str(&format!("td_mmio={a} "));
            }
            if let Some(a) = td_pio {
                extra.push_str(&format!("td_pio={a}"));
            }
            pb.set_message(format!("round {}/{} bare KVM_RUN floor", round + 1, o.rounds));
            let t0 = std::time::Instant::now();
            match iopath_vmm::bare::run_bare(
                iopath_guest::IMAGE,
                &guest_cmdline(o, "floor", tsc_khz, extra.trim()),
                64 << 20,
                timeout,
            ) {
                Ok(r) => {
                    let out = GuestOutput::parse(&r.lines);
                    let routing = out.rows.iter().map(|r| (r.name.clone(), ok("bare loop".into()))).collect();
                    runs.push(TargetRun {
                        target: Target::Floor,
                        round,
                        out,
                        routing,
                        exits: Some(r.exits),
                        wall_s: t0.elapsed().as_secs_f64(),
                    });
                }
                Err(e) => errors.push(format!("floor round {round}: {e}")),
            }
            pb.inc(1);
        }
        if let Some(q) = &qemu {
            let t0 = std::time::Instant::now();
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
                        out,
                        routing,
                        exits: None,
                        wall_s: t0.elapsed().as_secs_f64(),
                    });
                }
                Err(e) => errors.push(format!("qemu round {round}: {e}")),
            }
            pb.inc(1);
        }
        let mut ctx = crate::remote::Round { o, round, tsc_khz, pb: &pb, progs: &progs };
        for t in &remote_targets {
            ctx.run(*t, &mut runs, &mut errors, &mut rtt_ns);
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    for r in &runs {
        for (row, v) in &r.routing {
            if !v.ok {
                errors.push(format!("{} round {}: {row}: routing wrong: {}", r.target.name(), r.round, v.detail));
            }
        }
    }
    Ok(ExitsResult { host, options: o.clone(), tsc_khz, runs, errors, rtt_ns })
}

/// Per-row, per-target statistics over every batch of every round.
pub struct RowStats {
    pub name: String,
    pub group: String,
    pub targets: BTreeMap<Target, TargetStats>,
}

pub struct TargetStats {
    pub cycles: Option<Summary>,
    pub per_round_median: Vec<f64>,
    pub status: Option<String>,
    pub routing: Vec<Routing>,
}

impl ExitsResult {
    pub fn rows(&self) -> Vec<RowStats> {
        let mut order: Vec<(String, String)> = Vec::new();
        for r in &self.runs {
            for row in &r.out.rows {
                if !order.iter().any(|(n, _)| *n == row.name) {
                    order.push((row.name.clone(), row.group.clone()));
                }
            }
        }
        order
            .into_iter()
            .map(|(name, group)| {
                let mut targets = BTreeMap::new();
                for t in Target::all() {
                    let rows: Vec<(&TargetRun, &Row)> = self
                        .runs
                        .iter()
                        .filter(|r| r.target == t)
                        .filter_map(|r| r.out.row(&name).map(|x| (r, x)))
                        .collect();
                    if rows.is_empty() {
                        continue;
                    }
                    let all: Vec<f64> = rows.iter().flat_map(|(_, r)| r.per_access()).collect();
                    let per_round_median =
                        rows.iter().filter_map(|(_, r)| summarize(&r.per_access()).map(|s| s.median)).collect();
                    let status = rows.iter().find_map(|(_, r)| r.status().map(|s| s.to_string()));
                    let routing = rows.iter().filter_map(|(run, _)| run.routing.get(&name).cloned()).collect();
                    targets.insert(t, TargetStats { cycles: summarize(&all), per_round_median, status, routing });
                }
                RowStats { name, group, targets }
            })
            .collect()
    }

    pub fn ratio(&self, r: &RowStats, a: Target, b: Target) -> Option<f64> {
        let x = r.targets.get(&a)?.cycles?.median;
        let y = r.targets.get(&b)?.cycles?.median;
        (y > 0.0).then_some(x / y)
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{}", self.host);
        let _ = writeln!(
            s,
            "exit-cost table: {} rounds x {} batches of ~{} us each, median [min..max] cycles per access; ns at the TSC rate; contend: {}",
            self.options.rounds, self.options.batches, self.options.batch_us, self.options.contend
        );
        let have_floor = self.runs.iter().any(|r| r.target == Target::Floor);
        let have_qemu = self.runs.iter().any(|r| r.target == Target::Qemu);
        let mut hdr = format!("{:<32} {:>26} {:>10}", "row", "iopath cycles [min..max]", "ns");
        if have_floor {
            let _ = write!(hdr, " {:>10} {:>8}", "floor ns", "/floor");
        }
        if have_qemu {
            let _ = write!(hdr, " {:>26} {:>10} {:>8}", "qemu cycles [min..max]", "qemu ns", "/qemu");
        }
        let _ = write!(hdr, "  routing");
        let _ = writeln!(s, "{hdr}");
        let _ = writeln!(s, "{}", "-".repeat(hdr.len() + 20));
        let cyc = |t: Option<&TargetStats>| match t {
            Some(TargetStats { cycles: Some(c), .. }) => format!("{:.0} [{:.0}..{:.0}]", c.median, c.min, c.max),
            Some(TargetStats { status: Some(st), .. }) => st.clone(),
            _ => "-".into(),
        };
        let nsf = |t: Option<&TargetStats>| match t {
            Some(TargetStats { cycles: Some(c), .. }) => fmt_ns(ns(c.median, self.tsc_khz)),
            _ => "-".into(),
        };
        let rat = |x: Option<f64>| x.map(|v| format!("{v:.2}x")).unwrap_or_else(|| "-".into());
        for r in self.rows() {
            let io = r.targets.get(&Target::Iopath);
            let mut line = format!("{:<32} {:>26} {:>10}", r.name, cyc(io), nsf(io));
            if have_floor {
                let fl = r.targets.get(&Target::Floor);
                let _ = write!(line, " {:>10} {:>8}", nsf(fl), rat(self.ratio(&r, Target::Iopath, Target::Floor)));
            }
            if have_qemu {
                let q = r.targets.get(&Target::Qemu);
                let _ = write!(
                    line,
                    " {:>26} {:>10} {:>8}",
                    cyc(q),
                    nsf(q),
                    rat(self.ratio(&r, Target::Iopath, Target::Qemu))
                );
            }
            let routing: Vec<&Routing> = r.targets.values().flat_map(|t| t.routing.iter()).collect();
            let verdict = if routing.iter().any(|v| !v.ok) {
                format!("WRONG: {}", routing.iter().find(|v| !v.ok).unwrap().detail)
            } else {
                io.and_then(|t| t.routing.first()).map(|v| format!("ok {}", v.detail)).unwrap_or_else(|| "ok".into())
            };
            let _ = writeln!(s, "{line}  {verdict}");
        }
        s.push_str(&crate::remote::table(self));
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nerrors:");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        s
    }

    pub fn json(&self) -> Value {
        let rows: Vec<Value> = self
            .rows()
            .iter()
            .map(|r| {
                let mut t = serde_json::Map::new();
                for (target, st) in &r.targets {
                    t.insert(
                        target.name().into(),
                        json!({
                            "cycles": st.cycles,
                            "ns": st.cycles.map(|c| json!({"median": ns(c.median, self.tsc_khz), "min": ns(c.min, self.tsc_khz), "max": ns(c.max, self.tsc_khz)})),
                            "per_round_median_cycles": st.per_round_median,
                            "status": st.status,
                            "routing": st.routing,
                        }),
                    );
                }
                json!({
                    "name": r.name,
                    "group": r.group,
                    "targets": t,
                    "ratio_iopath_over_floor": self.ratio(r, Target::Iopath, Target::Floor),
                    "ratio_iopath_over_qemu": self.ratio(r, Target::Iopath, Target::Qemu),
                })
            })
            .collect();
        let runs: Vec<Value> = self
            .runs
            .iter()
            .map(|r| {
                json!({
                    "target": r.target.name(), "round": r.round, "wall_s": r.wall_s,
                    "guest": r.out.guest, "pci": r.out.pci,
                    "vmm_exits": r.exits.map(|e| e.fields().iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>()),
                })
            })
            .collect();
        json!({
            "benchmark": "exits",
            "out_of_process": crate::remote::json(self),
            "host": self.host,
            "options": self.options,
            "tsc_khz": self.tsc_khz,
            "rows": rows,
            "runs": runs,
            "errors": self.errors,
        })
    }
}

pub(crate) fn fmt_ns(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1000.0 {
        format!("{:.2} us", v / 1000.0)
    } else {
        format!("{v:.1} ns")
    }
}
