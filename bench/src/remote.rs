//! The out-of-process rows of `iopath bench exits`: pci-testdev served by
//! an `iopath serve` device process over mpqemu, vfio-user and ioregionfd
//! (sync and posted), and QEMU's pci-testdev in `-machine x-remote` with
//! iopath's VMM as the mpqemu proxy. Each run's routing is verified from
//! the device process's own counters (its report when the client leaves)
//! and the proxy's message counters. The socket round trip of each
//! transport is measured on the host in the same round, without a VM, so
//! that an out-of-process access can be set against exit + round trip.

use crate::exits::{
    fmt_ns, fmt_opt, guest_cmdline, marks, progress_callback, ExitsOptions, ExitsResult, Routing, RowStats, Target,
    TargetRun,
};
use crate::guard::{marks_label, Mark};
use crate::record::GuestOutput;
use crate::stats::{ns, summarize};
use indicatif::ProgressBar;
use iopath_protocols::attach::{instantiate, Device, DeviceSpec, Endpoint, Programs};
use iopath_protocols::{function_transports, FunctionTransport};
use iopath_vmm::{run, VmConfig};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// Rows each out-of-process target runs: every access that reaches the
/// device process synchronously, plus the ioeventfds where its transport
/// announces them.
fn rows_of(t: Target) -> &'static [&'static str] {
    const SYNC: &[&str] = &["mmio-no-eventfd:", "portio-no-eventfd:", "mmio-read:", "portio-read:"];
    const VFIO: &[&str] = &[
        "mmio-no-eventfd:",
        "portio-no-eventfd:",
        "mmio-read:",
        "portio-read:",
        "mmio-wildcard-eventfd:",
        "mmio-datamatch-eventfd:",
        "portio-wildcard-eventfd:",
        "portio-datamatch-eventfd:",
    ];
    if transport_of(t).is_some_and(|x| x.announces_ioeventfds()) {
        VFIO
    } else {
        SYNC
    }
}

/// The transport a target runs pci-testdev over: the one of the same name,
/// or for QEMU's x-remote the one QEMU speaks.
fn transport_of(t: Target) -> Option<&'static dyn FunctionTransport> {
    if t == Target::QemuRemote {
        return function_transports().find(|x| x.qemu_speaks());
    }
    match t {
        Target::Remote(name) => function_transports().find(|x| x.name() == name),
        _ => None,
    }
}

/// The out-of-process targets the options ask for.
pub fn targets(o: &ExitsOptions, with_qemu: bool) -> anyhow::Result<Vec<Target>> {
    let mut v = Vec::new();
    for name in &o.transports {
        // pci-testdev is a whole PCI function: a queue transport is refused.
        v.push(Target::Remote(iopath_protocols::transport(name)?.function_for("pci-testdev")?.name()));
    }
    if with_qemu && !o.transports.is_empty() {
        v.push(Target::QemuRemote);
    }
    v.retain(|t| !selected_rows(o, *t).is_empty());
    Ok(v)
}

/// The target's rows, narrowed by `--only`.
fn selected_rows(o: &ExitsOptions, t: Target) -> Vec<&'static str> {
    rows_of(t)
        .iter()
        .copied()
        .filter(|r| match &o.only {
            None => true,
            Some(only) => only.split(',').any(|p| r.starts_with(p) || p.starts_with(r.trim_end_matches(':'))),
        })
        .collect()
}

/// The proxy's count of messages (or region commands) it sent.
fn transport_messages(t: Target, run: &iopath_vmm::vm::RunReport) -> Option<u64> {
    let d = run.devices.iter().find(|d| d.name == "pci-testdev")?;
    let (counter, _) = transport_of(t)?.crossings();
    d.counters.iter().find(|c| c.name == counter).map(|c| c.value)
}

pub struct Round<'a> {
    pub o: &'a ExitsOptions,
    pub round: u32,
    pub tsc_khz: u64,
    pub pb: &'a ProgressBar,
    pub progs: &'a Programs,
}

impl Round<'_> {
    fn spec(&self, t: Target) -> anyhow::Result<DeviceSpec> {
        let ep = if t == Target::QemuRemote { Endpoint::Qemu } else { Endpoint::Spawn };
        let transport = transport_of(t).ok_or_else(|| anyhow::anyhow!("{} is not out of process", t.name()))?;
        Ok(DeviceSpec {
            device: Device::Model(iopath_devices::DeviceConfig::PciTestDev),
            remote: Some((transport.into(), ep)),
        })
    }

    /// One guest run with pci-testdev behind `t`: the target's rows, or
    /// only the row `only` (a re-run of a marked row).
    pub(crate) fn guest_run(&self, t: Target, label: &str, only: Option<&str>) -> anyhow::Result<TargetRun> {
        let mut o = self.o.clone();
        o.only = Some(only.map_or_else(|| selected_rows(self.o, t).join(","), str::to_string));
        let mut cfg = VmConfig::new(iopath_guest::IMAGE, &guest_cmdline(&o, "exits", self.tsc_khz, ""));
        cfg.devices = vec![instantiate(&self.spec(t)?, self.progs)?];
        cfg.timeout = Duration::from_secs(self.o.timeout_s);
        cfg.cancel = Some(&crate::interrupt::FLAG);
        cfg.on_line = Some(progress_callback(self.pb, label.to_string()));
        let t0 = Instant::now();
        let r = run(cfg)?;
        let out = GuestOutput::parse(&r.lines);
        if r.status != 1 {
            anyhow::bail!("{}", crate::record::exit_failure(r.status, &r.lines));
        }
        let mut routing = if t == Target::QemuRemote {
            crate::exits::verify_qemu(&out)
        } else {
            crate::exits::verify_iopath(&out, &r)
        };
        // Every access that exits must have crossed the transport.
        let crossing: u64 = out
            .rows
            .iter()
            .filter(|x| !x.name.contains("-eventfd:") || x.name.contains("no-eventfd"))
            .map(|x| x.accesses)
            .sum();
        let sent = transport_messages(t, &r);
        let enough = sent.is_some_and(|n| n >= crossing);
        for v in routing.values_mut() {
            v.detail = format!("{} [{} {} >= {crossing} accesses]", v.detail, fmt_opt(sent), transport_word(t));
            if !enough {
                v.ok = false;
            }
        }
        Ok(TargetRun {
            target: t,
            round: self.round,
            cpl: 3,
            attempt: 0,
            out,
            routing,
            exits: Some(r.exits),
            wall_s: t0.elapsed().as_secs_f64(),
        })
    }

    /// Host-side request/reply round trips through the device process: a
    /// 4-byte read of pci-testdev's `data` register, no VM involved.
    pub(crate) fn round_trip(&self, t: Target) -> anyhow::Result<Vec<f64>> {
        let dev = instantiate(&self.spec(t)?, self.progs)?;
        dev.config_write(0x10, &0xfe00_0000u32.to_le_bytes());
        dev.config_write(0x04, &2u16.to_le_bytes());
        let mut b = [0u8; 4];
        for _ in 0..200 {
            dev.bar_read(0, 8, &mut b);
        }
        let per_batch = 1000;
        let mut v = Vec::new();
        for _ in 0..self.o.batches.max(3) {
            let t0 = Instant::now();
            for _ in 0..per_batch {
                dev.bar_read(0, 8, &mut b);
            }
            v.push(t0.elapsed().as_nanos() as f64 / per_batch as f64);
        }
        if b == [0xff; 4] {
            anyhow::bail!("the device process did not answer");
        }
        dev.quiesce();
        Ok(v)
    }
}

fn transport_word(t: Target) -> &'static str {
    transport_of(t).map_or("msgs", |x| x.crossings().1)
}

/// The median of a cpl 3 row (out-of-process targets run at cpl 3 only).
fn median_ns(r: &ExitsResult, row: &str, t: Target) -> Option<f64> {
    let rs = r.rows();
    let x = rs.iter().find(|x| x.name == row && x.cpl == 3)?;
    row_ns(r, x, t)
}

fn row_ns(r: &ExitsResult, x: &RowStats, t: Target) -> Option<f64> {
    Some(ns(x.targets.get(&t)?.cycles?.median, r.tsc_khz))
}

/// The rows whose out-of-process write must cost at least the in-VMM exit
/// plus the transport's socket round trip (a posted write need not wait).
const EXIT_PLUS_RTT_ROWS: [&str; 2] = ["mmio-no-eventfd:pci-mem", "portio-no-eventfd:pci-io"];

/// Marks an out-of-process write cheaper than exit + socket round trip.
pub(crate) fn floor_mark(r: &ExitsResult, row: &RowStats, t: Target) -> Option<Mark> {
    let Target::Remote(name) = t else { return None };
    if row.cpl != 3 || name == "ioregionfd-posted" || !EXIT_PLUS_RTT_ROWS.contains(&row.name.as_str()) {
        return None;
    }
    let (x, exit, rt) = (row_ns(r, row, t)?, row_ns(r, row, Target::Iopath)?, rtt_median(r, t)?);
    r.options.guard.below_floor(x, exit + rt, "exit + socket round trip")
}

fn rtt_median(r: &ExitsResult, t: Target) -> Option<f64> {
    summarize(r.rtt_ns.get(t.name())?).map(|s| s.median)
}

/// The second table: pci-testdev rows per transport, against the in-VMM exit.
pub fn table(r: &ExitsResult) -> String {
    let present: Vec<Target> = Target::all()
        .into_iter()
        .filter(|t| matches!(t, Target::Remote(_) | Target::QemuRemote) && r.runs.iter().any(|x| x.target == *t))
        .collect();
    if present.is_empty() {
        return String::new();
    }
    let mut s = String::new();
    let spin = match r.options.spin_us {
        0 => "receivers sleep at once".to_string(),
        n => format!("receivers poll {n} us before sleeping"),
    };
    let _ = writeln!(s, "\nout of process: pci-testdev in a device process ({spin}); median ns per access (x in-VMM)");
    let mut hdr = format!("{:<32} {:>10}", "row", "in-VMM");
    for t in &present {
        let _ = write!(hdr, " {:>20}", t.name());
    }
    let _ = writeln!(s, "{hdr}");
    let _ = writeln!(s, "{}", "-".repeat(hdr.len()));
    let mut marked = Vec::new();
    for row in r.rows() {
        if row.cpl != 3 || !present.iter().any(|t| row.targets.contains_key(t)) {
            continue;
        }
        let base = median_ns(r, &row.name, Target::Iopath);
        let mut line = format!("{:<32} {:>10}", row.name, base.map(fmt_ns).unwrap_or_else(|| "-".into()));
        for t in &present {
            let cell = match (median_ns(r, &row.name, *t), base) {
                (Some(v), Some(b)) if b > 0.0 => format!("{} {:.2}x", fmt_ns(v), v / b),
                (Some(v), _) => fmt_ns(v),
                _ => "-".into(),
            };
            let routing: Vec<&Routing> = row.targets.get(t).map(|x| x.routing.iter().collect()).unwrap_or_default();
            let m = marks(r, &row, *t);
            let mark = match (routing.iter().any(|v| !v.ok), m.is_empty()) {
                (true, _) => "!",
                (false, false) => "*",
                _ => "",
            };
            if !m.is_empty() {
                marked.push(format!("{} {}: {}", t.name(), row.name, marks_label(&m)));
            }
            let _ = write!(line, " {:>20}", format!("{cell}{mark}"));
        }
        let _ = writeln!(s, "{line}");
    }
    let mut line = format!("{:<32} {:>10}", "socket round trip (host, no VM)", "-");
    for t in &present {
        let _ = write!(line, " {:>20}", rtt_median(r, *t).map(fmt_ns).unwrap_or_else(|| "-".into()));
    }
    let _ = writeln!(s, "{line}");
    let _ = writeln!(s, "(! = routing check failed; see errors. * = marked, below)");
    for m in marked {
        let _ = writeln!(s, "marked: {m}");
    }
    if present.iter().any(|t| t.name().starts_with("ioregionfd")) {
        let k = kvm_ioctls::Kvm::new().map_err(|e| e.to_string());
        let why = k.and_then(|k| {
            iopath_vmm::kvm::ioregionfd_support(&k).map(|c| format!("kernel capability {c}")).map_err(|e| e.to_string())
        });
        let _ = writeln!(s, "ioregionfd: {}", why.unwrap_or_else(|e| e));
    }
    for (k, v) in targets_report(r) {
        let _ = writeln!(s, "{k}: {v}");
    }
    s
}

/// The questions this table answers, as ratios from this run: does a
/// synchronous out-of-process access cost exit + round trip (every
/// transport); is a posted ioregionfd write as cheap as an exit; does
/// ioregionfd beat mpqemu, as its RFC claimed.
fn targets_report(r: &ExitsResult) -> Vec<(String, String)> {
    const MPQEMU: Target = Target::Remote("mpqemu");
    const IOREGIONFD: Target = Target::Remote("ioregionfd");
    const POSTED: Target = Target::Remote("ioregionfd-posted");
    let mut v = Vec::new();
    for row in ["mmio-no-eventfd:pci-mem", "portio-no-eventfd:pci-io"] {
        let Some(exit) = median_ns(r, row, Target::Iopath) else { continue };
        for t in Target::all().into_iter().filter(|t| matches!(t, Target::Remote(_)) && *t != POSTED) {
            if let (Some(x), Some(rt)) = (median_ns(r, row, t), rtt_median(r, t)) {
                let below = r.options.guard.below_floor(x, exit + rt, "exit + socket round trip");
                v.push((
                    format!("{} {row} vs exit + round trip", t.name()),
                    format!(
                        "{} / ({} + {}) = {:.2}{}",
                        fmt_ns(x),
                        fmt_ns(exit),
                        fmt_ns(rt),
                        x / (exit + rt),
                        if below.is_some() { " (marked: below its floor)" } else { "" }
                    ),
                ));
            }
        }
        if let Some(p) = median_ns(r, row, POSTED) {
            v.push((format!("ioregionfd-posted {row} vs in-VMM exit"), format!("{:.2}x", p / exit)));
        }
        if let (Some(a), Some(b)) = (median_ns(r, row, IOREGIONFD), median_ns(r, row, MPQEMU)) {
            v.push((format!("ioregionfd / mpqemu {row}"), format!("{:.2}x", a / b)));
        }
    }
    v
}

pub fn json(r: &ExitsResult) -> Value {
    let rtt: serde_json::Map<String, Value> =
        r.rtt_ns.iter().map(|(k, v)| (k.clone(), json!({"ns": summarize(v), "batches": v.len()}))).collect();
    let targets: serde_json::Map<String, Value> =
        targets_report(r).into_iter().map(|(k, v)| (k, Value::String(v))).collect();
    json!({"socket_round_trip": rtt, "targets": targets})
}
