//! report.md: the host, every table, the plots, and published figures beside ours.

use super::{docs, exits_ns, job_label, nvme_groups, Figure, Input};
use serde_json::Value;
use std::fmt::Write as _;

fn fmt(v: f64, unit: &str) -> String {
    match unit {
        "ns" if v >= 1e6 => format!("{:.2} ms", v / 1e6),
        "ns" if v >= 1e3 => format!("{:.2} us", v / 1e3),
        "ns" => format!("{v:.1} ns"),
        "IOPS" | "ops/s" if v >= 1e6 => format!("{:.2} M{unit}", v / 1e6),
        "IOPS" | "ops/s" if v >= 1e3 => format!("{:.1} k{unit}", v / 1e3),
        "x" => format!("{v:.2}x"),
        _ => format!("{v:.2} {unit}"),
    }
}

fn host(input: &Input, s: &mut String) {
    let h = input.docs.iter().map(|d| &d["host"]).find(|h| h.is_object()).cloned().unwrap_or(Value::Null);
    let m = &input.meta;
    let _ = writeln!(s, "## Host\n");
    let _ = writeln!(s, "| | |\n|---|---|");
    let _ = writeln!(s, "| CPU | {} ({} CPUs) |", h["cpu"].as_str().unwrap_or("?"), h["cpus"]);
    let _ = writeln!(s, "| kernel | Linux {} |", h["kernel"].as_str().unwrap_or("?"));
    let kvm = h["kvm_module"].as_str().unwrap_or("?");
    let nested = if h["nested"] == true { " (nested: this host is itself a VM)" } else { "" };
    let _ = writeln!(
        s,
        "| KVM | {kvm}{nested}; modules and parameters: {} |",
        if m.kvm_modules.is_empty() { "-" } else { &m.kvm_modules }
    );
    let _ = writeln!(s, "| TSC | {:.3} GHz |", h["tsc_khz"].as_f64().unwrap_or(0.0) / 1e6);
    let _ = writeln!(s, "| iopath | {} |", m.version);
    let _ = writeln!(s, "| QEMU | {} |", if m.qemu.is_empty() { "-" } else { &m.qemu });
    if !m.command.is_empty() {
        let _ = writeln!(s, "| command | `{}` |", m.command);
    }
    if m.wall_s > 0.0 {
        let _ = writeln!(s, "| wall time | {:.0} s |", m.wall_s);
    }
    let _ = writeln!(s);
}

fn figure_table(s: &mut String, bench: &str, figs: &[Figure]) {
    // Cycles are in results.csv; the report shows ns.
    let rows: Vec<&Figure> = figs.iter().filter(|f| f.bench == bench && f.metric != "cycles_per_access").collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(s, "| row | metric | median | min | max | mark |\n|---|---|---:|---:|---:|---|");
    for f in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} |",
            f.row,
            f.metric,
            fmt(f.s.median, &f.unit),
            fmt(f.s.min, &f.unit),
            fmt(f.s.max, &f.unit),
            f.marks.join("; ")
        );
    }
    let _ = writeln!(s);
}

/// The highest median IOPS among nvme groups whose target passes `pick` (and, with a qd, at that iodepth).
fn best_iops(input: &Input, pick: &dyn Fn(&str) -> bool, qd: Option<u64>) -> Option<(f64, String)> {
    let d = docs(input, "nvme").next()?;
    let jobs = d["options"]["jobs"].as_array()?;
    nvme_groups(d)
        .into_iter()
        .filter(|g| pick(&g.target))
        .filter(|g| qd.is_none_or(|q| jobs.get(g.job).and_then(|j| j["iodepth"].as_u64()) == Some(q)))
        .filter_map(|g| {
            Some((
                g.stat("iops")?.median,
                format!("{} {}", g.target, jobs.get(g.job).map(job_label).unwrap_or_default()),
            ))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
}

/// One line of the comparison: what, theirs, ours, ratio, source.
fn seed_row(s: &mut String, what: &str, theirs: f64, unit: &str, ours: Option<(f64, String)>, source: &str) {
    let (o, r) = match &ours {
        Some((v, how)) => (format!("{} ({how})", fmt(*v, unit)), format!("{:.2}x", v / theirs)),
        None => ("not measured".into(), "-".into()),
    };
    let _ = writeln!(s, "| {what} | {} | {o} | {r} | {source} |", fmt(theirs, unit));
}

const SAFL: &str = "safl.dk notebook, \"Getting 4.3 M IOPS with an emulated NVMe device in a qemu guest\", https://safl.dk/notebook/exploration/vfio_user.html";
const FAN: &str = "Jinhao Fan, \"hw/nvme: Use ioeventfd to handle doorbell updates\", qemu-devel 2022";
const UFIM: &str = "Elena Ufimtseva, \"[RFC 0/8] ioregionfd introduction\", qemu-devel 2022-02-08";
const HOSTKVM: &str =
    "measured 2026-11-22 on this machine kind with a bare C KVM loop and QEMU 7.2 (the project's host notes; not a figure of this run)";

fn seeds(input: &Input, s: &mut String) {
    let _ = writeln!(s, "## Published figures beside ours\n");
    let _ = writeln!(
        s,
        "**Other hardware, other guests, other jobs.** These figures were measured elsewhere, on hosts we do not \
         know in detail and (except the last table) on bare metal; ours come from this host. A ratio shows where \
         this host's figure stands, not which implementation is faster.\n"
    );
    let _ = writeln!(s, "| figure | published | ours | ours / published | source |\n|---|---:|---|---:|---|");
    seed_row(
        s,
        "emulated NVMe over vfio-user, SPDK target on 1 core (bdev_malloc), QEMU guest, fio + xNVMe",
        4.3e6,
        "IOPS",
        best_iops(input, &|t| t.ends_with("@vfio-user"), None),
        SAFL,
    );
    seed_row(
        s,
        "emulated NVMe, best of any path",
        4.3e6,
        "IOPS",
        best_iops(input, &|t| t.starts_with("iopath-"), None),
        SAFL,
    );
    // QEMU's nvme with ioeventfd doorbells: KIOPS at qd 1/4/16/64.
    for (qd, k) in [(1u64, 41.0), (4, 133.0), (16, 258.0), (64, 313.0)] {
        seed_row(
            s,
            &format!("QEMU nvme, ioeventfd doorbells + shadow buffer, qd {qd}"),
            k * 1e3,
            "IOPS",
            best_iops(input, &|t| t == "iopath-ioeventfd", Some(qd)),
            FAN,
        );
    }
    // ioregionfd over mpqemu: the published gain, and ours for one write.
    let ours = docs(input, "exits").next().and_then(|d| {
        let m = exits_ns(d, "mmio-no-eventfd:pci-mem", "mpqemu")?;
        let i = exits_ns(d, "mmio-no-eventfd:pci-mem", "ioregionfd")?;
        Some((m.median / i.median, "mpqemu ns / ioregionfd ns per MMIO write".to_string()))
    });
    for (what, gain) in
        [("random R/W", 938.0 / 889.0), ("sequential read", 374.0 / 367.0), ("sequential write", 77.3 / 76.0)]
    {
        seed_row(s, &format!("ioregionfd over mpqemu speed-up, lsi53c895a fio {what}"), gain, "x", ours.clone(), UFIM);
    }
    let _ = writeln!(s, "\n**Same machine kind, earlier measurement** (a different program: a bare C KVM loop; midpoints of the ranges given):\n");
    let _ = writeln!(s, "| figure | earlier | ours | ours / earlier | source |\n|---|---:|---|---:|---|");
    let ex = docs(input, "exits").next();
    // Ours with the report's marks on it: a marked figure is not compared unmarked.
    let o = |row: &str, t: &str| {
        let d = ex?;
        let v = exits_ns(d, row, t)?;
        let marks = super::exits_target(d, row, t).map(super::exits_marks).unwrap_or_default();
        let how = if marks.is_empty() { format!("{row} @ {t}") } else { format!("{row} @ {t}; {}", marks.join("; ")) };
        Some((v.median, how))
    };
    seed_row(s, "MMIO write, exit to the VMM", 28_500.0, "ns", o("mmio-no-eventfd:pci-mem", "iopath"), HOSTKVM);
    seed_row(
        s,
        "MMIO write caught by an ioeventfd",
        2_850.0,
        "ns",
        o("mmio-wildcard-eventfd:pci-mem", "iopath"),
        HOSTKVM,
    );
    seed_row(
        s,
        "shared guest-RAM word, host thread answers (round trip)",
        107.5,
        "ns",
        o("doorbell-rtt:shm", "iopath"),
        HOSTKVM,
    );
    seed_row(s, "QEMU pci-testdev mmio-no-eventfd", 35_000.0, "ns", o("mmio-no-eventfd:pci-mem", "qemu"), HOSTKVM);
    let _ = writeln!(s);
}

pub(super) fn render(input: &Input, figs: &[Figure], svgs: &[(String, String)], errors: &[String]) -> String {
    let mut s = String::from("# iopath report\n\n");
    let _ = writeln!(
        s,
        "Every figure is a median over rounds (exits: over all batches of all rounds) with its min and max. \
         Files beside this one: `results.json` (every bench's JSON document), `results.csv` (one row per figure), \
         and the plots.\n"
    );
    host(input, &mut s);
    let bench_errors: Vec<String> = input
        .docs
        .iter()
        .flat_map(|d| {
            d["errors"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |e| format!("{}: {}", d["benchmark"].as_str().unwrap_or("?"), e.as_str().unwrap_or("?")))
        })
        .collect();
    if !bench_errors.is_empty() || !errors.is_empty() {
        let _ = writeln!(s, "## Errors\n");
        for e in bench_errors.iter().chain(errors) {
            let _ = writeln!(s, "- {e}");
        }
        let _ = writeln!(s);
    }
    let marked = super::marked(input);
    let figs_marked: Vec<&Figure> =
        figs.iter().filter(|f| !f.marks.is_empty() && f.metric != "cycles_per_access").collect();
    if !marked.is_empty() || !figs_marked.is_empty() {
        let _ = writeln!(
            s,
            "## Marked figures\n\nDo not take these at face value. `!round k Nx the others`: one round 100x or more away \
             from the median of its row's other rounds; `!unguarded (1 round)`: one round only, so no spread check was \
             possible; `!0.50x of F`: below the same run's floor F; `bench:` the bench's own guard, after its re-runs.\n\n\
             | bench | row | marks |\n|---|---|---|"
        );
        for (b, r, m) in &marked {
            let _ = writeln!(s, "| {b} | {r} | bench: {m} |");
        }
        for f in figs_marked {
            let _ = writeln!(s, "| {} | {} {} | {} |", f.bench, f.row, f.metric, f.marks.join("; "));
        }
        let _ = writeln!(s);
    }
    if !svgs.is_empty() {
        let _ = writeln!(s, "## Plots\n");
        for (name, _) in svgs {
            let _ = writeln!(s, "![{name}]({name})");
        }
        let _ = writeln!(s);
    }
    let costs = super::path_costs(input);
    if !costs.is_empty() {
        let _ = writeln!(s, "## Cost per path\n\nOne guest access (an exit: one write; the shm doorbell: one round trip).\n\n| path | median | min | max | mark |\n|---|---:|---:|---:|---|");
        for b in &costs {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} |",
                b.label,
                fmt(b.median, "ns"),
                fmt(b.min, "ns"),
                fmt(b.max, "ns"),
                b.mark
            );
        }
        let _ = writeln!(s);
    }
    seeds(input, &mut s);
    for (bench, title) in [("exits", "Exits"), ("nvme", "NVMe"), ("floor", "Ring floor")] {
        let has_table = input.tables.iter().any(|(b, _)| b == bench);
        if !figs.iter().any(|f| f.bench == bench) && !has_table {
            continue;
        }
        let _ = writeln!(s, "## {title}\n");
        figure_table(&mut s, bench, figs);
        for (_, t) in input.tables.iter().filter(|(b, _)| b == bench) {
            let _ = writeln!(s, "The bench's own table:\n\n```\n{}```\n", t);
        }
    }
    super::blk::markdown(input, &mut s);
    for (_, t) in input.tables.iter().filter(|(b, _)| b == "blk") {
        let _ = writeln!(s, "The bench's own table:\n\n```\n{}```\n", t);
    }
    s
}
