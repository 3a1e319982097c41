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

/// Every measured figure of every document, one per CSV row.
pub fn figures(input: &Input) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut push = |bench: &str, row: String, metric: &str, s: Option<Summary>, unit: &str| {
        if let Some(s) = s {
            out.push(Figure { bench: bench.into(), row, metric: metric.into(), s, unit: unit.into() });
        }
    };
    for d in docs(input, "exits") {
        for r in d["rows"].as_array().into_iter().flatten() {
            let name = exits_row_name(r);
            for (t, v) in r["targets"].as_object().into_iter().flatten() {
                push("exits", format!("{name} @ {t}"), "ns_per_access", summary_of(&v["ns"]), "ns");
                push("exits", format!("{name} @ {t}"), "cycles_per_access", summary_of(&v["cycles"]), "cycles");
            }
        }
        for (k, v) in d["out_of_process"]["socket_round_trip"].as_object().into_iter().flatten() {
            push("exits", format!("socket round trip {k}"), "round_trip", summary_of(&v["ns"]), "ns");
        }
    }
    for d in docs(input, "nvme") {
        let jobs = d["options"]["jobs"].as_array().cloned().unwrap_or_default();
        for g in nvme_groups(d) {
            let row =
                format!("{} {}", g.target, jobs.get(g.job).map(job_label).unwrap_or_else(|| format!("job {}", g.job)));
            push("nvme", row.clone(), "iops", g.stat("iops"), "IOPS");
            push("nvme", row.clone(), "p50_latency", g.stat("p50_ns"), "ns");
            push("nvme", row.clone(), "p99_latency", g.stat("p99_ns"), "ns");
            push("nvme", row.clone(), "exits_per_io", g.stat("exits_per_io"), "exits");
            push("nvme", row.clone(), "cpu_per_io", g.stat("cpu_ns_per_io"), "ns");
            push("nvme", row.clone(), "vcpu_per_io", g.stat("vcpu_ns_per_io"), "ns");
            push("nvme", row, "floor_ratio", g.stat("floor_ratio"), "x");
        }
    }
    for d in docs(input, "floor") {
        for s in d["summary"].as_array().into_iter().flatten() {
            let qd = s["qd"].as_u64().unwrap_or(0);
            push("floor", format!("ring qd{qd}"), "ops_s", summary_of(&s["ops_s"]), "ops/s");
            push("floor", format!("ring qd{qd}"), "p50_latency", summary_of(&s["p50_ns"]), "ns");
        }
    }
    blk::figures(input, &mut out);
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
    let mut s = String::from("bench,row,metric,median,min,max,unit\n");
    for x in figs {
        s.push_str(&format!(
            "{},{},{},{},{},{},{}\n",
            csv_field(&x.bench),
            csv_field(&x.row),
            csv_field(&x.metric),
            num(x.s.median),
            num(x.s.min),
            num(x.s.max),
            csv_field(&x.unit)
        ));
    }
    s
}

/// The cost of each path, from the exits document: exit, ioeventfd,
/// in-kernel, each transport, the shared-memory doorbell (and QEMU's exit).
pub fn path_costs(input: &Input) -> Vec<plot::Bar> {
    let Some(d) = docs(input, "exits").next() else { return vec![] };
    let mut bars = Vec::new();
    let mut add = |label: String, row: &str, target: &str| {
        if let Some(s) = exits_ns(d, row, target) {
            bars.push(plot::Bar { label, median: s.median, min: s.min, max: s.max });
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

/// Where an nvme target runs: "vmm" (iopath's VMM, and QEMU), or the transport after its '@'.
fn transport_of(target: &str) -> &str {
    target.split_once('@').map_or("vmm", |(_, t)| t)
}

/// nvme series against iodepth, one plot per transport ("vmm" holds QEMU
/// too) and one series per target, for the jobs that differ only in
/// iodepth (the most common rw/bs/queues of the run): (transport, family, series).
pub fn by_iodepth(input: &Input, key: &str) -> Vec<(String, String, Vec<plot::Series>)> {
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
    let mut plots: Vec<(String, String, Vec<plot::Series>)> = Vec::new();
    for g in nvme_groups(d) {
        let Some(j) = jobs.get(g.job) else { continue };
        if family(j).as_deref() != Some(fam.as_str()) || g.target.starts_with("fio") {
            continue;
        }
        let (Some(qd), Some(v)) = (j["iodepth"].as_f64(), g.stat(key)) else { continue };
        let tr = transport_of(&g.target).to_string();
        let i = match plots.iter().position(|p| p.0 == tr) {
            Some(i) => i,
            None => {
                plots.push((tr, fam.clone(), Vec::new()));
                plots.len() - 1
            }
        };
        let series = &mut plots[i].2;
        match series.iter_mut().find(|s| s.name == g.target) {
            Some(s) => s.points.push((qd, v.median)),
            None => series.push(plot::Series { name: g.target.clone(), points: vec![(qd, v.median)] }),
        }
    }
    for s in plots.iter_mut().flat_map(|p| p.2.iter_mut()) {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
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
        let s = plot::Series { name: g.target.clone(), points };
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
pub fn plots(input: &Input, errors: &mut Vec<String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut keep = |name: String, r: Result<String, String>| match r {
        Ok(svg) => out.push((name, svg)),
        Err(e) => errors.push(format!("plot {name}: {e}")),
    };
    let bars = path_costs(input);
    if !bars.is_empty() {
        keep("cost-per-path.svg".into(), plot::cost_bars("Cost of one guest write, per path", "ns", &bars));
    }
    for (key, file, title, desc, log_y) in [
        ("iops", "iops-vs-iodepth", "NVMe IOPS against iodepth", "IOPS", false),
        ("p99_ns", "p99-vs-iodepth", "NVMe p99 latency against iodepth", "p99 latency (log)", true),
    ] {
        for (tr, fam, series) in by_iodepth(input, key) {
            let place = if tr == "vmm" { "in the VMM".to_string() } else { format!("over {tr}") };
            let title = format!("{title}, {place} ({fam})");
            let a = plot::Axes {
                title: &title,
                x_desc: "iodepth (log)",
                y_desc: desc,
                log_x: true,
                log_y,
                y_zero: true,
                x_ns: false,
                y_ns: log_y,
                legend: plot::Legend::UpperLeft,
            };
            keep(format!("{file}-{}.svg", slug(&tr)), plot::lines(&a, &series));
        }
    }
    for (label, tr, series) in cdfs(input) {
        let place = if tr == "vmm" { "in the VMM".to_string() } else { format!("over {tr}") };
        let title = format!("NVMe latency CDF, {place}: {label}");
        let a = plot::Axes {
            title: &title,
            x_desc: "latency (log)",
            y_desc: "fraction of I/Os",
            log_x: true,
            log_y: false,
            y_zero: true,
            x_ns: true,
            y_ns: false,
            legend: plot::Legend::LowerRight,
        };
        keep(format!("cdf-{}-{}.svg", slug(&label), slug(&tr)), plot::lines(&a, &series));
    }
    blk::plots(input, &mut keep);
    out
}

/// Renders the whole report.
pub fn render(input: &Input) -> Report {
    let mut errors = Vec::new();
    let svgs = plots(input, &mut errors);
    let figs = figures(input);
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
