//! The report's block-path section, from `bench blk`'s JSON document: its
//! figures (CSV), a table per measure (targets by jobs, with the ratio to the
//! reference target and how far apart the paths are), and a bar plot per job.

use super::{docs, f, plot, slug, Figure, Input};
use crate::stats::{summarize, Summary};
use serde_json::Value;
use std::fmt::Write as _;

/// A record's figure `key` over its rounds: the record's own value as the
/// median (for percentiles, that of the merged histogram), the rounds' range.
fn stat(r: &Value, key: &str) -> Option<Summary> {
    let rounds: Vec<f64> = r["rounds"].as_array().into_iter().flatten().filter_map(|x| f(&x[key])).collect();
    let s = summarize(&rounds)?;
    Some(Summary { median: f(&r[key])?, ..s })
}

fn records(d: &Value) -> impl Iterator<Item = &Value> {
    d["records"].as_array().into_iter().flatten()
}

/// Every blk figure: one CSV row per target, job and metric, marked from its
/// rounds and (latency) against the run's shm round trip floor `shm`.
pub(super) fn figures(input: &Input, shm: Option<f64>, out: &mut Vec<Figure>) {
    for d in docs(input, "blk") {
        for r in records(d) {
            let row = format!("{} {}", r["target"].as_str().unwrap_or("?"), r["job"].as_str().unwrap_or("?"));
            for (metric, key, unit) in [
                ("mb_s", "mb_s", "MB/s"),
                ("iops", "iops", "IOPS"),
                ("p50_latency", "p50_ns", "ns"),
                ("p99_latency", "p99_ns", "ns"),
                ("exits_per_io", "exits_per_io", "exits"),
                ("ratio_to_reference", "ratio", "x"),
            ] {
                let s = if key == "ratio" {
                    f(&r[key]).map(|v| Summary { median: v, min: v, max: v, n: 1 })
                } else {
                    stat(r, key)
                };
                let Some(s) = s else { continue };
                let mut marks = Vec::new();
                if key != "ratio" {
                    let rounds = super::values(&r["rounds"], key);
                    marks.extend(super::guard().rounds(&rounds).iter().map(|m| m.label()));
                }
                if let (Some(fl), "ns") = (shm, unit) {
                    marks.extend(super::guard().below_floor(s.median, fl, "shm round trip floor").map(|m| m.label()));
                }
                out.push(Figure {
                    bench: "blk".into(),
                    row: row.clone(),
                    metric: metric.into(),
                    s,
                    unit: unit.into(),
                    marks,
                });
            }
        }
    }
}

/// The jobs of a document: (index, name, measure).
fn jobs(d: &Value) -> Vec<(usize, String, String)> {
    d["jobs"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, j)| (i, j["name"].as_str().unwrap_or("?").into(), j["measure"].as_str().unwrap_or("?").into()))
        .collect()
}

/// The targets in the document's order.
fn targets(d: &Value) -> Vec<String> {
    d["options"]["targets"].as_array().into_iter().flatten().filter_map(|t| t.as_str().map(String::from)).collect()
}

fn find<'a>(d: &'a Value, t: &str, ji: usize) -> Option<&'a Value> {
    records(d).find(|r| r["target"] == t && r["job_index"].as_u64() == Some(ji as u64))
}

/// A table cell: MB/s [min..max] or p50/p99 us, with the ratio.
fn cell(r: &Value, throughput: bool) -> String {
    if r["rounds"].as_array().is_none_or(|v| v.is_empty()) {
        return "failed".into();
    }
    let ratio = f(&r["ratio"]).map_or(String::new(), |x| format!(" ({x:.2}x)"));
    let ok = if r["routing_ok"] == true { "" } else { " WRONG" };
    if throughput {
        match stat(r, "mb_s") {
            Some(s) => format!("{:.0} [{:.0}..{:.0}]{ratio}{ok}", s.median, s.min, s.max),
            None => "-".into(),
        }
    } else {
        match (f(&r["p50_ns"]), f(&r["p99_ns"])) {
            (Some(a), Some(b)) => format!("{:.1} / {:.1}{ratio}{ok}", a / 1e3, b / 1e3),
            _ => "-".into(),
        }
    }
}

/// max/min over the targets that ran job `ji` and held their checks, naming both ends.
fn apart(d: &Value, ji: usize, key: &str) -> String {
    let v: Vec<(f64, &str)> = records(d)
        .filter(|r| r["job_index"].as_u64() == Some(ji as u64) && r["routing_ok"] == true)
        .filter_map(|r| Some((f(&r[key]).filter(|x| *x > 0.0)?, r["target"].as_str()?)))
        .collect();
    let lo = v.iter().min_by(|a, b| a.0.total_cmp(&b.0));
    let hi = v.iter().max_by(|a, b| a.0.total_cmp(&b.0));
    match (lo, hi) {
        (Some(lo), Some(hi)) if v.len() > 1 => format!("{:.2}x ({} .. {})", hi.0 / lo.0, lo.1, hi.1),
        _ => "-".into(),
    }
}

/// The "Block paths" section of report.md.
pub(super) fn markdown(input: &Input, s: &mut String) {
    let Some(d) = docs(input, "blk").next() else { return };
    let o = &d["options"];
    let _ = writeln!(s, "## Block paths\n");
    let _ = writeln!(
        s,
        "`bench blk`: one guest job on every path, backend `{}` ({} MiB) for all; throughput at {} B QD{}, \
         latency at {} B QD1; {} s per run, {} round(s). Medians over rounds [min..max]; latency percentiles \
         from all rounds' I/Os. In parentheses: the ratio to `{}` (MB/s; latency: p50), only between records \
         whose checks held; exits/IO per job, in the columns' order.\n",
        o["backend"].as_str().unwrap_or("?"),
        // A file backend's real size (documents before disk_mb: the option).
        if d["disk_mb"].is_u64() { &d["disk_mb"] } else { &o["size_mb"] },
        o["tput_bs"],
        o["tput_qd"],
        o["lat_bs"],
        o["time_ms"].as_f64().unwrap_or(0.0) / 1e3,
        o["rounds"],
        o["reference"].as_str().unwrap_or("?"),
    );
    let js = jobs(d);
    for (measure, title, key) in
        [("throughput", "Throughput, MB/s", "mb_s"), ("latency", "Latency, p50 / p99 us", "p50_ns")]
    {
        let cols: Vec<&(usize, String, String)> = js.iter().filter(|j| j.2 == measure).collect();
        if cols.is_empty() {
            continue;
        }
        let _ = write!(s, "**{title}**\n\n| target |");
        for c in &cols {
            let _ = write!(s, " {} |", c.1);
        }
        let _ = writeln!(s, " exits/IO per job |\n|---|{}---:|", "---:|".repeat(cols.len()));
        for t in targets(d) {
            let _ = write!(s, "| {t} |");
            for c in &cols {
                let _ = write!(s, " {} |", find(d, &t, c.0).map_or("-".into(), |r| cell(r, measure == "throughput")));
            }
            // Exits per I/O of each job of this measure, in the columns' order.
            let e: Vec<String> = cols
                .iter()
                .map(|c| find(d, &t, c.0).and_then(|r| f(&r["exits_per_io"])).map_or("-".into(), |x| format!("{x:.3}")))
                .collect();
            let _ = writeln!(s, " {} |", e.join(" / "));
        }
        for n in d["not_run"].as_array().into_iter().flatten() {
            let _ = writeln!(
                s,
                "| {} | {} |{}",
                n["target"].as_str().unwrap_or("?"),
                n["reason"].as_str().unwrap_or("?"),
                " |".repeat(cols.len())
            );
        }
        let _ = write!(s, "| how far apart (max/min) |");
        for c in &cols {
            let _ = write!(s, " {} |", apart(d, c.0, key));
        }
        let _ = writeln!(s, " |\n");
    }
    let fails: Vec<String> = d["failures"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| Some(format!("{}: {}", x["target"].as_str()?, x["error"].as_str()?)))
        .fold(Vec::new(), |mut v, e| {
            if !v.contains(&e) {
                v.push(e);
            }
            v
        });
    if !fails.is_empty() {
        let _ = writeln!(s, "Failed targets (no figures):\n");
        for e in fails {
            let _ = writeln!(s, "- {e}");
        }
        let _ = writeln!(s);
    }
}

/// One dot plot per job: MB/s (throughput, min..max over rounds) or p50
/// with a whisker to p99 (latency) per target; failed targets say so; a
/// null backend's throughput says no data moved.
pub(super) fn plots(input: &Input, figs: &[Figure], keep: &mut dyn FnMut(String, Result<String, plot::PlotError>)) {
    let Some(d) = docs(input, "blk").next() else { return };
    let null = d["options"]["backend"].as_str() == Some("null");
    let failed: Vec<&str> = d["failures"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x["target"].as_str())
        .chain(d["not_run"].as_array().into_iter().flatten().filter_map(|x| x["target"].as_str()))
        .collect();
    for (ji, name, measure) in jobs(d) {
        let tput = measure == "throughput";
        let (key, metric) = if tput { ("mb_s", "mb_s") } else { ("p50_ns", "p50_latency") };
        let bars: Vec<plot::Bar> = targets(d)
            .iter()
            .filter_map(|t| {
                let r = find(d, t, ji);
                let s = r.and_then(|r| stat(r, key));
                let Some(s) = s.filter(|s| s.median > 0.0) else {
                    let known = r.is_some() || failed.contains(&t.as_str());
                    return known.then(|| plot::Bar { label: t.clone(), failed: true, ..Default::default() });
                };
                let row = format!("{t} {name}");
                let mark: Vec<String> = figs
                    .iter()
                    .filter(|x| x.bench == "blk" && x.row == row && x.metric == metric)
                    .flat_map(|x| x.marks.clone())
                    .collect();
                let note = if tput && null { "(no data moved)".to_string() } else { String::new() };
                let (min, max) =
                    if tput { (s.min, s.max) } else { (s.median, r.and_then(|r| f(&r["p99_ns"])).unwrap_or(s.median)) };
                Some(plot::Bar {
                    label: t.clone(),
                    median: s.median,
                    min,
                    max,
                    mark: mark.join("; "),
                    note,
                    failed: false,
                })
            })
            .collect();
        if bars.is_empty() {
            continue;
        }
        let title = if tput {
            let note = if null { " — null backend: no data moved, a bound on the path alone" } else { "" };
            format!("Block paths, {name}: guest I/O throughput per path{note}")
        } else {
            format!("Block paths, {name}: guest I/O latency per path")
        };
        let p = plot::DotPlot {
            title: &title,
            what: if tput { "throughput the guest saw" } else { "I/O latency" },
            q: if tput { plot::Quantity::Other("MB/s") } else { plot::Quantity::Ns },
            whisker: if tput { "min..max over rounds" } else { "p50..p99" },
            floor: if tput {
                None
            } else {
                super::shm_floor(input).map(|v| (v, "shm round trip floor (same run)".to_string()))
            },
        };
        keep(format!("blk-{measure}-{}.svg", slug(&name)), plot::dots(&p, &bars));
    }
}
