//! The report of `iopath bench all`: report.md, results.json, results.csv and
//! SVG plots, made from the benches' JSON documents alone (so it is tested
//! without KVM, from synthetic documents).

mod blk;
mod markdown;
pub mod plot;

use crate::stats::{summarize, Summary};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where the figures came from: what `host` in the documents does not say.
#[derive(Clone, Debug, Default)]
pub struct Meta {
    /// iopath's version, with its git commit where known.
    pub version: String,
    /// `qemu-system-x86_64 --version`'s first line, or why there is none.
    pub qemu: String,
    /// The KVM modules /sys/module lists (kvm_intel, kvm_amd, kvm_pvm...), each with its parameters.
    pub kvm_modules: String,
    /// The command that made the report.
    pub command: String,
    /// Wall time of the whole run, seconds.
    pub wall_s: f64,
}

/// The benches' documents (each bench's `json()`) and, where given, their text tables.
#[derive(Clone, Debug, Default)]
pub struct Input {
    pub meta: Meta,
    pub docs: Vec<Value>,
    /// (bench, table) as the bench printed it.
    pub tables: Vec<(String, String)>,
}

impl Input {
    /// The input back from a results.json `render` wrote: `iopath report` re-renders it.
    pub fn from_results(v: &Value) -> Input {
        let m = &v["meta"];
        let text = |k: &str| m[k].as_str().unwrap_or_default().to_string();
        Input {
            meta: Meta {
                version: text("version"),
                qemu: text("qemu"),
                kvm_modules: text("kvm_modules"),
                command: text("command"),
                wall_s: f(&m["wall_s"]).unwrap_or(0.0),
            },
            docs: v["benchmarks"].as_array().cloned().unwrap_or_default(),
            tables: v["tables"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| Some((t[0].as_str()?.to_string(), t[1].as_str()?.to_string())))
                .collect(),
        }
    }
}

/// The rendered report: file name -> contents.
pub struct Report {
    pub markdown: String,
    pub csv: String,
    pub json: Value,
    /// (file name, SVG text).
    pub svgs: Vec<(String, String)>,
}

/// One measured figure: a CSV row.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub bench: String,
    pub row: String,
    pub metric: String,
    pub s: Summary,
    pub unit: String,
    /// Why the figure is not to be taken at face value: the bench's own
    /// marks and the report's (`crate::guard`: a round 100x from the
    /// others, one round only, below a same-run floor); empty when none.
    pub marks: Vec<String>,
}

pub(crate) fn f(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

/// A `{median, min, max}` object (Summary's JSON).
pub(crate) fn summary_of(v: &Value) -> Option<Summary> {
    Some(Summary {
        median: f(&v["median"])?,
        min: f(&v["min"])?,
        max: f(&v["max"])?,
        n: v["n"].as_u64().unwrap_or(1) as usize,
    })
}

/// The documents of one bench.
pub(crate) fn docs<'a>(input: &'a Input, bench: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    input.docs.iter().filter(move |d| d["benchmark"] == bench)
}

/// An exits row's ns per access on a target; where rows come at both CPLs
/// (`cpl`), the CPL3 one (the guest's workloads run at CPL3 by default).
pub(crate) fn exits_ns(doc: &Value, row: &str, target: &str) -> Option<Summary> {
    let rows = doc["rows"].as_array()?;
    let r = rows
        .iter()
        .find(|r| r["name"] == row && (r["cpl"].is_null() || r["cpl"] == 3))
        .or_else(|| rows.iter().find(|r| r["name"] == row))?;
    summary_of(&r["targets"][target]["ns"])
}

/// An exits row's name, with its CPL where the document gives one.
fn exits_row_name(r: &Value) -> String {
    let name = r["name"].as_str().unwrap_or("?");
    match r["cpl"].as_u64() {
        Some(c) => format!("{name} cpl{c}"),
        None => name.to_string(),
    }
}

/// A `marks` array (`guard::marks_json`) as text: "below_floor ratio=0.8 floor=... ; spread ...".
pub(crate) fn marks_text(v: &Value) -> Option<String> {
    let marks = v.as_array().filter(|m| !m.is_empty())?;
    let one = |m: &Value| {
        let mut s = m["kind"].as_str().unwrap_or("mark").to_string();
        for (k, x) in m.as_object().into_iter().flatten().filter(|(k, _)| *k != "kind") {
            let x = x.as_f64().map_or_else(|| x.as_str().map_or(x.to_string(), String::from), |f| format!("{f:.2}"));
            s.push_str(&format!(" {k}={x}"));
        }
        s
    };
    Some(marks.iter().map(one).collect::<Vec<_>>().join("; "))
}

/// Every marked figure: (bench, row, marks).
pub fn marked(input: &Input) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for d in docs(input, "exits") {
        for r in d["rows"].as_array().into_iter().flatten() {
            if let Some(m) = marks_text(&r["marks"]) {
                out.push(("exits".into(), exits_row_name(r), m));
            }
        }
    }
    for d in docs(input, "nvme") {
        let jobs = d["options"]["jobs"].as_array().cloned().unwrap_or_default();
        for r in d["runs"].as_array().into_iter().flatten() {
            if let Some(m) = marks_text(&r["marks"]) {
                let job = r["job"].as_u64().and_then(|j| jobs.get(j as usize)).map(job_label).unwrap_or_default();
                out.push((
                    "nvme".into(),
                    format!("{} {job} round {}", r["target"].as_str().unwrap_or("?"), r["round"]),
                    m,
                ));
            }
        }
    }
    out
}

/// An nvme job's label, as the bench writes it.
pub(crate) fn job_label(j: &Value) -> String {
    let bs = j["bs"].as_u64().unwrap_or(0);
    let bs = if bs.is_multiple_of(1024) { format!("{}k", bs / 1024) } else { bs.to_string() };
    let (rw, qd, q) =
        (j["rw"].as_str().unwrap_or("?"), j["iodepth"].as_u64().unwrap_or(0), j["queues"].as_u64().unwrap_or(1));
    match j["thinktime_us"].as_u64().unwrap_or(0) {
        _ if j["verify"] == true => format!("verify {bs} qd{qd} x{q}"),
        0 => format!("{rw} {bs} qd{qd} x{q}"),
        t => format!("{rw} {bs} qd{qd} x{q} think {t}us"),
    }
}

/// nvme runs grouped by (job index, target), over rounds.
pub(crate) struct NvmeGroup<'a> {
    pub job: usize,
    pub target: String,
    pub runs: Vec<&'a Value>,
    /// The bench's own summary of this (job, target): its percentiles come
    /// from the rounds' merged histogram.
    pub summary: Option<&'a Value>,
}

/// Latency percentiles: taken from the merged histogram, not as medians of rounds.
const PERCENTILES: [&str; 3] = ["p50_ns", "p99_ns", "p999_ns"];

impl NvmeGroup<'_> {
    /// Median, min and max of `key` over the rounds; for a latency percentile
    /// the "median" is the bench summary's percentile of the merged histogram
    /// (min and max stay the per-round range).
    pub fn stat(&self, key: &str) -> Option<Summary> {
        let s = summarize(&self.runs.iter().filter_map(|r| f(&r[key])).collect::<Vec<_>>());
        match (PERCENTILES.contains(&key), self.summary.and_then(|m| f(&m[key]))) {
            (true, Some(merged)) => s.map(|s| Summary { median: merged, ..s }),
            _ => s,
        }
    }

    /// The latency histogram over all rounds: (upper edge ns, count), by edge.
    pub fn hist(&self) -> Vec<(f64, u64)> {
        let mut m: BTreeMap<u64, u64> = BTreeMap::new();
        for r in &self.runs {
            for p in r["hist"].as_array().into_iter().flatten() {
                if let (Some(e), Some(c)) = (p[0].as_f64(), p[1].as_u64()) {
                    if e.is_finite() && e >= 0.0 {
                        let n = m.entry(e as u64).or_default();
                        *n = n.saturating_add(c);
                    }
                }
            }
        }
        m.into_iter().map(|(e, c)| (e as f64, c)).collect()
    }
}

pub(crate) fn nvme_groups(doc: &Value) -> Vec<NvmeGroup<'_>> {
    let mut g: Vec<NvmeGroup> = Vec::new();
    for r in doc["runs"].as_array().into_iter().flatten() {
        let (job, target) = (r["job"].as_u64().unwrap_or(0) as usize, r["target"].as_str().unwrap_or("?").to_string());
        match g.iter_mut().find(|x| x.job == job && x.target == target) {
            Some(x) => x.runs.push(r),
            None => {
                let summary =
                    doc["summary"].as_array().into_iter().flatten().find(|s| {
                        s["job"].as_u64() == Some(job as u64) && s["target"].as_str() == Some(target.as_str())
                    });
                g.push(NvmeGroup { job, target, runs: vec![r], summary })
            }
        }
    }
    g
}

/// The values of `key` in each element of `v` (a JSON array), in order.
pub(crate) fn values(v: &Value, key: &str) -> Vec<f64> {
    v.as_array().into_iter().flatten().filter_map(|x| f(&x[key])).collect()
}

/// The report's marks on a figure from its rounds (`guard::GuardConfig::rounds`)
/// and the bench's own (`doc_marks`, a JSON `marks` array).
fn marks_of(rounds: &[f64], doc_marks: &Value) -> Vec<String> {
    let mut m: Vec<String> = guard().rounds(rounds).iter().map(crate::guard::Mark::label).collect();
    m.extend(marks_text(doc_marks).map(|t| format!("bench: {t}")));
    m
}

/// The report's thresholds: the benches' defaults.
pub(crate) fn guard() -> crate::guard::GuardConfig {
    crate::guard::GuardConfig::default()
}

/// The shm doorbell round trip of the run (exits `doorbell-rtt:shm` on
/// iopath): no round trip through shared memory can be cheaper.
pub(crate) fn shm_floor(input: &Input) -> Option<f64> {
    docs(input, "exits").find_map(|d| exits_ns(d, "doorbell-rtt:shm", "iopath")).map(|s| s.median)
}

/// The ring floor of the run at `qd`: (ops/s, p50 ns), from `bench floor`'s summary.
pub(crate) fn ring_floor(input: &Input, qd: u64) -> Option<(f64, f64)> {
    docs(input, "floor").find_map(|d| {
        let s = d["summary"].as_array()?.iter().find(|s| s["qd"].as_u64() == Some(qd))?;
        Some((summary_of(&s["ops_s"])?.median, summary_of(&s["p50_ns"])?.median))
    })
}

/// Every measured figure of every document, one per CSV row, with its marks.
pub fn figures(input: &Input) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut push = |bench: &str, row: String, metric: &str, s: Option<Summary>, unit: &str, marks: Vec<String>| {
        if let Some(s) = s {
            out.push(Figure { bench: bench.into(), row, metric: metric.into(), s, unit: unit.into(), marks });
        }
    };
    let shm = shm_floor(input);
    let below_shm = |v: Option<Summary>, unit: &str| -> Vec<String> {
        match (v, shm, unit) {
            (Some(v), Some(fl), "ns") => {
                guard().below_floor(v.median, fl, "shm round trip floor").iter().map(|m| m.label()).collect()
            }
            _ => vec![],
        }
    };
    for d in docs(input, "exits") {
        for r in d["rows"].as_array().into_iter().flatten() {
            let name = exits_row_name(r);
            for (t, v) in r["targets"].as_object().into_iter().flatten() {
                let m = exits_marks(v);
                push("exits", format!("{name} @ {t}"), "ns_per_access", summary_of(&v["ns"]), "ns", m.clone());
                push("exits", format!("{name} @ {t}"), "cycles_per_access", summary_of(&v["cycles"]), "cycles", m);
            }
        }
        for (k, v) in d["out_of_process"]["socket_round_trip"].as_object().into_iter().flatten() {
            let s = summary_of(&v["ns"]);
            // Batches, not rounds: only a single one leaves nothing to check against.
            let one =
                if v["batches"].as_u64() == Some(1) { s.map(|s| vec![s.median]).unwrap_or_default() } else { vec![] };
            let mut m = marks_of(&one, &Value::Null);
            m.extend(below_shm(s, "ns"));
            push("exits", format!("socket round trip {k}"), "round_trip", s, "ns", m);
        }
    }
    for d in docs(input, "nvme") {
        let jobs = d["options"]["jobs"].as_array().cloned().unwrap_or_default();
        for g in nvme_groups(d) {
            let job = jobs.get(g.job);
            let row = format!("{} {}", g.target, job.map(job_label).unwrap_or_else(|| format!("job {}", g.job)));
            let ring = job.and_then(|j| j["iodepth"].as_u64()).and_then(|qd| Some((qd, ring_floor(input, qd)?)));
            let doc_marks = g.summary.map_or(Value::Null, |s| s["marks"].clone());
            let per = |key: &str| {
                let rounds: Vec<f64> = g.runs.iter().filter_map(|r| f(&r[key])).collect();
                marks_of(&rounds, &Value::Null)
            };
            let mut m = per("iops");
            m.extend(marks_text(&doc_marks).map(|t| format!("bench: {t}")));
            if let (Some((qd, (ops, _))), Some(v)) = (ring, g.stat("iops")) {
                m.extend(guard().above_floor_rate(v.median, ops, &format!("ring floor qd{qd}")).map(|x| x.label()));
            }
            push("nvme", row.clone(), "iops", g.stat("iops"), "IOPS", m);
            let mut m = per("p50_ns");
            m.extend(below_shm(g.stat("p50_ns"), "ns"));
            if let (Some((qd, (_, p50))), Some(v)) = (ring, g.stat("p50_ns")) {
                m.extend(guard().below_floor(v.median, p50, &format!("ring floor qd{qd}")).map(|x| x.label()));
            }
            push("nvme", row.clone(), "p50_latency", g.stat("p50_ns"), "ns", m);
            let mut m = per("p99_ns");
            m.extend(below_shm(g.stat("p99_ns"), "ns"));
            push("nvme", row.clone(), "p99_latency", g.stat("p99_ns"), "ns", m);
            push("nvme", row.clone(), "exits_per_io", g.stat("exits_per_io"), "exits", vec![]);
            push("nvme", row.clone(), "cpu_per_io", g.stat("cpu_ns_per_io"), "ns", per("cpu_ns_per_io"));
            push("nvme", row.clone(), "vcpu_per_io", g.stat("vcpu_ns_per_io"), "ns", per("vcpu_ns_per_io"));
            push("nvme", row, "floor_ratio", g.stat("floor_ratio"), "x", vec![]);
        }
    }
    for d in docs(input, "floor") {
        for s in d["summary"].as_array().into_iter().flatten() {
            let qd = s["qd"].as_u64().unwrap_or(0);
            let runs: Vec<&Value> = d["runs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["qd"].as_u64() == Some(qd) && r["attempt"].as_u64().unwrap_or(0) == 0)
                .collect();
            let per = |key: &str| marks_of(&runs.iter().filter_map(|r| f(&r[key])).collect::<Vec<_>>(), &Value::Null);
            push("floor", format!("ring qd{qd}"), "ops_s", summary_of(&s["ops_s"]), "ops/s", per("ops_s"));
            push("floor", format!("ring qd{qd}"), "p50_latency", summary_of(&s["p50_ns"]), "ns", per("p50_ns"));
        }
    }
    blk::figures(input, shm, &mut out);
    out
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// A figure for the CSV: enough digits for any unit here (0.1 of a ns or an
/// IOPS, 6 decimals below 1), trailing zeros dropped.
fn num(v: f64) -> String {
    let s = match v.abs() {
        a if a >= 1000.0 => format!("{v:.1}"),
        a if a >= 1.0 => format!("{v:.3}"),
        _ => format!("{v:.6}"),
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

pub fn csv(figs: &[Figure]) -> String {
    let mut s = String::from("bench,row,metric,median,min,max,unit,mark\n");
    for x in figs {
        s.push_str(&format!(
            "{},{},{},{},{},{},{},{}\n",
            csv_field(&x.bench),
            csv_field(&x.row),
            csv_field(&x.metric),
            num(x.s.median),
            num(x.s.min),
            num(x.s.max),
            csv_field(&x.unit),
            csv_field(&x.marks.join("; "))
        ));
    }
    s
}

/// An exits row's target object, the CPL3 row where rows come at both CPLs.
fn exits_target<'a>(doc: &'a Value, row: &str, target: &str) -> Option<&'a Value> {
    let rows = doc["rows"].as_array()?;
    let r = rows
        .iter()
        .find(|r| r["name"] == row && (r["cpl"].is_null() || r["cpl"] == 3))
        .or_else(|| rows.iter().find(|r| r["name"] == row))?;
    r["targets"].get(target)
}

/// The report's marks on an exits target: from its rounds, and the bench's own.
fn exits_marks(v: &Value) -> Vec<String> {
    let mut rounds: Vec<f64> = v["per_round_median_cycles"].as_array().into_iter().flatten().filter_map(f).collect();
    if rounds.is_empty() && v["rounds"].as_u64() == Some(1) {
        rounds = summary_of(&v["ns"]).map(|s| vec![s.median]).unwrap_or_default();
    }
    marks_of(&rounds, &v["marks"])
}

/// The cost of each path, from the exits document: exit, ioeventfd,
/// in-kernel, each transport, the shared-memory doorbell (and QEMU's exit),
/// each with the report's marks.
pub fn path_costs(input: &Input) -> Vec<plot::Bar> {
    let Some(d) = docs(input, "exits").next() else { return vec![] };
    let mut bars = Vec::new();
    let mut add = |label: String, row: &str, target: &str| {
        if let Some(v) = exits_target(d, row, target) {
            if let Some(s) = summary_of(&v["ns"]) {
                let mark = exits_marks(v).join("; ");
                bars.push(plot::Bar { label, median: s.median, min: s.min, max: s.max, mark, ..Default::default() });
            } else {
                bars.push(plot::Bar { label, failed: true, ..Default::default() });
            }
        }
    };
    add("exit (iopath VMM)".into(), "mmio-no-eventfd:pci-mem", "iopath");
    add("exit (QEMU)".into(), "mmio-no-eventfd:pci-mem", "qemu");
    add("ioeventfd".into(), "mmio-wildcard-eventfd:pci-mem", "iopath");
    add("in-kernel (PIC port)".into(), "outl_to_kernel", "iopath");
    let transports: Vec<String> = d["options"]["transports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str().map(String::from))
        .collect();
    for t in &transports {
        add(format!("{t} (device process)"), "mmio-no-eventfd:pci-mem", t);
    }
    add("mpqemu to QEMU x-remote".into(), "mmio-no-eventfd:pci-mem", "qemu-x-remote");
    add("shm doorbell round trip".into(), "doorbell-rtt:shm", "iopath");
    bars
}

/// The run's `KVM_RUN` floor (exits' floor target on the MMIO row), ns.
pub fn kvm_run_floor(input: &Input) -> Option<f64> {
    docs(input, "exits").find_map(|d| exits_ns(d, "mmio-no-eventfd:pci-mem", "floor")).map(|s| s.median)
}

/// Where an nvme target runs: "vmm" (iopath's VMM, and QEMU), or the transport after its '@'.
fn transport_of(target: &str) -> &str {
    target.split_once('@').map_or("vmm", |(_, t)| t)
}

/// The nvme targets that an error names as failing a run ("TARGET JOB round
/// N: why"): a target with no runs at all shows as failed, not as nothing.
fn failed_targets(doc: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in doc["errors"].as_array().into_iter().flatten().filter_map(Value::as_str) {
        let Some((head, _)) = e.split_once(": ") else { continue };
        let Some(t) = head.split_whitespace().next() else { continue };
        let is_run = head.split_whitespace().rev().nth(1) == Some("round");
        if is_run && !["wake", "guest", "floor"].contains(&t) && !t.ends_with(',') && !out.iter().any(|x| x == t) {
            out.push(t.to_string());
        }
    }
    out
}

/// nvme series against iodepth, one plot per transport ("vmm" holds QEMU
/// too) and one series per target, for the jobs that differ only in
/// iodepth (the most common rw/bs/queues of the run): (transport, family,
/// series). `hi_key`, when given, is each point's whisker top (p99 over a
/// p50); a point the report marked (`figs`) is listed as marked; a target
/// that failed every run of the family is a failed series.
pub fn by_iodepth(
    input: &Input,
    figs: &[Figure],
    key: &str,
    hi_key: Option<&str>,
) -> Vec<(String, String, Vec<plot::Series>)> {
    let Some(d) = docs(input, "nvme").next() else { return vec![] };
    let Some(jobs) = d["options"]["jobs"].as_array() else { return vec![] };
    let family = |j: &Value| {
        (j["verify"] != true && j["thinktime_us"].as_u64().unwrap_or(0) == 0)
            .then(|| format!("{} {} x{}", j["rw"].as_str().unwrap_or("?"), j["bs"], j["queues"]))
    };
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for j in jobs {
        if let Some(k) = family(j) {
            *count.entry(k).or_default() += 1;
        }
    }
    let Some((fam, n)) = count.into_iter().max_by_key(|(_, n)| *n) else { return vec![] };
    if n < 2 {
        return vec![];
    }
    let metric = match key {
        "iops" => "iops",
        "p50_ns" => "p50_latency",
        _ => "p99_latency",
    };
    let mut plots: Vec<(String, String, Vec<plot::Series>)> = Vec::new();
    let plot_of =
        |plots: &mut Vec<(String, String, Vec<plot::Series>)>, tr: &str| match plots.iter().position(|p| p.0 == tr) {
            Some(i) => i,
            None => {
                plots.push((tr.to_string(), fam.clone(), Vec::new()));
                plots.len() - 1
            }
        };
    for g in nvme_groups(d) {
        let Some(j) = jobs.get(g.job) else { continue };
        if family(j).as_deref() != Some(fam.as_str()) || g.target.starts_with("fio") {
            continue;
        }
        let i = plot_of(&mut plots, transport_of(&g.target));
        let series = &mut plots[i].2;
        let si = match series.iter().position(|s| s.name == g.target) {
            Some(si) => si,
            None => {
                series.push(plot::Series { name: g.target.clone(), ..Default::default() });
                series.len() - 1
            }
        };
        let (Some(qd), Some(v)) = (j["iodepth"].as_f64(), g.stat(key)) else { continue };
        let s = &mut series[si];
        s.points.push((qd, v.median));
        if let Some(h) = hi_key {
            s.hi.push(g.stat(h).map_or(f64::NAN, |x| x.median));
        }
        let row = format!("{} {}", g.target, job_label(j));
        if figs.iter().any(|f| f.bench == "nvme" && f.row == row && f.metric == metric && !f.marks.is_empty()) {
            s.marked.push((qd, v.median));
        }
    }
    for t in failed_targets(d).into_iter().filter(|t| !t.starts_with("fio")) {
        let i = plot_of(&mut plots, transport_of(&t));
        if !plots[i].2.iter().any(|s| s.name == t) {
            plots[i].2.push(plot::Series { name: t, ..Default::default() });
        }
    }
    for s in plots.iter_mut().flat_map(|p| p.2.iter_mut()) {
        let mut idx: Vec<usize> = (0..s.points.len()).collect();
        idx.sort_by(|a, b| s.points[*a].0.total_cmp(&s.points[*b].0));
        let hi = s.hi.clone();
        s.hi = if hi.len() == s.points.len() { idx.iter().map(|&i| hi[i]).collect() } else { vec![] };
        s.points = idx.iter().map(|&i| s.points[i]).collect();
        s.failed = s.points.is_empty();
    }
    // The run's ring floor at the family's iodepths, as a dashed line.
    let qds: Vec<u64> = jobs
        .iter()
        .filter(|j| family(j).as_deref() == Some(fam.as_str()))
        .filter_map(|j| j["iodepth"].as_u64())
        .collect();
    let floor: Vec<(f64, f64)> = qds
        .iter()
        .filter_map(|&q| {
            let (ops, p50) = ring_floor(input, q)?;
            Some((q as f64, if key == "iops" { ops } else { p50 }))
        })
        .collect();
    if !floor.is_empty() && (key == "iops" || key == "p50_ns") {
        for p in plots.iter_mut() {
            p.2.push(plot::Series {
                name: "ring floor (same run)".into(),
                points: floor.clone(),
                floor: true,
                ..Default::default()
            });
        }
    }
    plots
}

/// Latency CDFs from the runs' `hist` arrays, one per job and transport
/// ("vmm" holds QEMU too), as the iodepth plots: (job label, transport, series).
pub fn cdfs(input: &Input) -> Vec<(String, String, Vec<plot::Series>)> {
    let Some(d) = docs(input, "nvme").next() else { return vec![] };
    let jobs = d["options"]["jobs"].as_array().cloned().unwrap_or_default();
    let mut out: Vec<(usize, String, String, Vec<plot::Series>)> = Vec::new();
    for g in nvme_groups(d) {
        let h = g.hist();
        let total = h.iter().fold(0u64, |a, x| a.saturating_add(x.1));
        if total == 0 {
            continue;
        }
        let mut acc = 0u64;
        let points = h
            .iter()
            .filter(|x| x.0 > 0.0)
            .map(|&(e, c)| {
                acc = acc.saturating_add(c);
                (e, acc as f64 / total as f64)
            })
            .collect();
        let s = plot::Series { name: g.target.clone(), points, ..Default::default() };
        let tr = transport_of(&g.target).to_string();
        match out.iter_mut().find(|x| x.0 == g.job && x.2 == tr) {
            Some(x) => x.3.push(s),
            None => out.push((g.job, jobs.get(g.job).map(job_label).unwrap_or_default(), tr, vec![s])),
        }
    }
    // By job; within a job, transports in the order the runs came.
    out.sort_by_key(|x| x.0);
    out.into_iter().map(|(_, l, t, s)| (l, t, s)).collect()
}

/// A file name from a label: letters, digits and '-'.
fn slug(s: &str) -> String {
    let mut o: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    while o.contains("--") {
        o = o.replace("--", "-");
    }
    o.trim_matches('-').to_string()
}

/// The SVG plots the input has data for; a plot that fails to draw is
/// reported in `errors` and left out.
pub fn plots(input: &Input, figs: &[Figure], errors: &mut Vec<String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut keep = |name: String, r: Result<String, plot::PlotError>| match r {
        Ok(svg) => out.push((name, svg)),
        Err(e) => errors.push(format!("plot {name}: {e}")),
    };
    let bars = path_costs(input);
    if !bars.is_empty() {
        let p = plot::DotPlot {
            title: "Cost of one guest access per path (exits: one MMIO/port write; shm doorbell: one round trip)",
            what: "time per access",
            q: plot::Quantity::Ns,
            whisker: "min..max",
            floor: kvm_run_floor(input).map(|v| (v, "KVM_RUN floor (same run)".to_string())),
        };
        keep("cost-per-path.svg".into(), plot::dots(&p, &bars));
    }
    for (key, hi, file, title, what, q) in [
        (
            "iops",
            None,
            "iops-vs-iodepth",
            "NVMe IOPS against iodepth",
            "completed I/Os per second",
            plot::Quantity::Other("IOPS"),
        ),
        (
            "p50_ns",
            Some("p99_ns"),
            "latency-vs-iodepth",
            "NVMe I/O latency (p50, whisker to p99) against iodepth",
            "I/O latency, submission to completion",
            plot::Quantity::Ns,
        ),
    ] {
        for (tr, fam, series) in by_iodepth(input, figs, key, hi) {
            let place = if tr == "vmm" { "in the VMM".to_string() } else { format!("over {tr}") };
            let title = format!("{title}, {place} ({fam})");
            let a = plot::Axes {
                title: &title,
                x_what: "iodepth",
                x_q: plot::Quantity::Other("I/Os in flight"),
                y_what: what,
                y_q: q,
                log_x: true,
                log_y: None,
                y_zero: true,
                legend: plot::Legend::UpperLeft,
            };
            keep(format!("{file}-{}.svg", slug(&tr)), plot::lines(&a, &series));
        }
    }
    for (label, tr, series) in cdfs(input) {
        let place = if tr == "vmm" { "in the VMM".to_string() } else { format!("over {tr}") };
        let title = format!("NVMe I/O latency CDF, {place}: {label}");
        let a = plot::Axes {
            title: &title,
            x_what: "I/O latency",
            x_q: plot::Quantity::Ns,
            y_what: "share of I/Os done within it",
            y_q: plot::Quantity::Other("fraction"),
            log_x: true,
            log_y: Some(false),
            y_zero: true,
            legend: plot::Legend::LowerRight,
        };
        keep(format!("cdf-{}-{}.svg", slug(&label), slug(&tr)), plot::lines(&a, &series));
    }
    blk::plots(input, figs, &mut keep);
    out
}

/// Renders the whole report.
pub fn render(input: &Input) -> Report {
    let mut errors = Vec::new();
    let figs = figures(input);
    let svgs = plots(input, &figs, &mut errors);
    let markdown = markdown::render(input, &figs, &svgs, &errors);
    let json = json!({
        "schema_version": crate::guard::JSON_SCHEMA_VERSION,
        "meta": {
            "version": input.meta.version, "qemu": input.meta.qemu, "kvm_modules": input.meta.kvm_modules,
            "command": input.meta.command, "wall_s": input.meta.wall_s,
        },
        "benchmarks": input.docs,
        "tables": input.tables,
        "report_errors": errors,
    });
    Report { markdown, csv: csv(&figs), json, svgs }
}

/// Writes report.md, results.json, results.csv and the SVGs into `dir` (made if missing); the paths written.
pub fn write(dir: &Path, r: &Report) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut files = vec![
        ("report.md".to_string(), r.markdown.clone()),
        ("results.json".to_string(), serde_json::to_string_pretty(&r.json).unwrap_or_default()),
        ("results.csv".to_string(), r.csv.clone()),
    ];
    files.extend(r.svgs.iter().cloned());
    let mut out = Vec::new();
    for (name, text) in files {
        let p = dir.join(name);
        std::fs::write(&p, text)?;
        out.push(p);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
