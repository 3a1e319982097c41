//! `iopath bench all --out DIR`: every benchmark (exits, floor, nvme, blk) in its default matrix, then
//! the report (`iopath_bench::report`) in DIR.

use crate::bench::AllArgs;
use anyhow::Context;
use iopath_bench::blk::{run_blk, BlkOptions};
use iopath_bench::exits::{run_exits, ExitsOptions};
use iopath_bench::floor::{run_floor, FloorOptions};
use iopath_bench::nvme::{run_nvme, Job, NvmeOptions};
use iopath_bench::report;
use iopath_devices::virtio::pci::NotifyMode;
use std::time::Instant;

/// Queue depths of the NVMe sweep (IOPS and p99 against iodepth).
const SWEEP: [u32; 4] = [1, 4, 16, 64];
pub const SWEEP_QUICK: [u32; 3] = [1, 4, 16];

/// The benches' options for this matrix.
pub struct Matrix {
    pub exits: ExitsOptions,
    pub floor: FloorOptions,
    pub nvme: NvmeOptions,
    pub blk: BlkOptions,
}

/// The benches' options for this matrix.
pub fn matrix(a: &AllArgs, qemu: bool) -> Matrix {
    let rounds = if a.quick { 1 } else { a.rounds.max(1) };
    let progress = !a.quiet;
    let pin = a.pin.placement();
    // The exit rows at ring 3 and ring 0: the r0/r3 ratio is the nested host's own cost.
    let mut exits = ExitsOptions { rounds, vs_qemu: qemu, progress, cpls: vec![0, 3], ..ExitsOptions::default() };
    let mut floor = FloorOptions { rounds, cpus: pin.map(|p| p.pair()), progress, ..FloorOptions::default() };
    // In the VMM and over each transport that carries NVMe, every doorbell mode.
    let transports: Vec<Option<&'static dyn iopath_protocols::FunctionTransport>> = std::iter::once(None)
        .chain(
            ["vfio-user", "mpqemu", "ioregionfd"]
                .iter()
                .filter_map(|t| iopath_protocols::transport(t).ok().and_then(|t| t.function()).map(Some)),
        )
        .collect();
    let sweep: &[u32] = if a.quick { &SWEEP_QUICK } else { &SWEEP };
    let mut jobs: Vec<Job> = sweep.iter().map(|&qd| Job::randread(512, qd)).collect();
    // The latency reference job (4 KiB at iodepth 1).
    jobs.push(Job::randread(4096, 1));
    let mut nvme = NvmeOptions { jobs, transports, rounds, vs_qemu: qemu, progress, pin, ..NvmeOptions::default() };
    // Every path to a guest's disk on the null backend (QEMU's only with QEMU).
    let mut blk = BlkOptions { rounds, progress, pin, time_ms: 1000, ..BlkOptions::default() };
    blk.targets.retain(|t| qemu || !t.is_qemu());
    if a.quick {
        blk.time_ms = 300;
        (exits.batches, exits.batch_us) = (5, 5000);
        floor.time_ms = 100;
        nvme.time_ms = 300;
        nvme.floor_ms = 100;
    }
    if a.smoke {
        // The whole pipeline on little: a few exit rows over one transport,
        // two NVMe modes in the VMM and over vfio-user at two depths.
        exits.only =
            Some("mmio-no-eventfd:pci-mem,mmio-wildcard-eventfd:pci-mem,outl_to_kernel,doorbell-rtt:shm".into());
        exits.transports = vec!["vfio-user".into()];
        floor.depths = vec![1, 16];
        floor.time_ms = 50;
        nvme.jobs = vec![Job::randread(512, 1), Job::randread(512, 16)];
        nvme.doorbells = vec![iopath_devices::nvme::DoorbellMode::Shm, iopath_devices::nvme::DoorbellMode::Mmio];
        nvme.transports.truncate(2);
        nvme.time_ms = 200;
        nvme.floor_ms = 50;
        blk.targets = [NotifyMode::Exit, NotifyMode::Ioeventfd].map(iopath_bench::blk::Target::Virtio).into();
        blk.time_ms = 100;
    }
    Matrix { exits, floor, nvme, blk }
}

/// `git describe`-like: the commit of the source tree this binary was built from, if it is still a git tree.
fn version() -> String {
    let v = env!("CARGO_PKG_VERSION");
    let dir = env!("CARGO_MANIFEST_DIR");
    match std::process::Command::new("git").args(["-C", dir, "rev-parse", "--short=12", "HEAD"]).output() {
        Ok(o) if o.status.success() => {
            let dirty = std::process::Command::new("git")
                .args(["-C", dir, "status", "--porcelain", "--untracked-files=no"])
                .output()
                .map(|o| !o.stdout.is_empty())
                .unwrap_or(false);
            format!("{v} (git {}{})", String::from_utf8_lossy(&o.stdout).trim(), if dirty { ", modified" } else { "" })
        }
        _ => format!("{v} (git commit unknown)"),
    }
}

fn qemu_version() -> (bool, String) {
    match iopath_bench::qemu::find() {
        Ok(q) => {
            let v = std::process::Command::new(&q)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").trim().to_string())
                .unwrap_or_default();
            (true, format!("{v} ({})", q.display()))
        }
        Err(e) => (false, format!("not run: {e}")),
    }
}

/// The KVM modules loaded (or built in), as /sys/module lists them, each
/// with its parameters (`kvm_pvm (force=N, pvm_native=Y, ...)`): /proc/modules
/// may be absent (a kernel without module unloading lists nothing there).
fn kvm_modules() -> String {
    let mut names: Vec<String> = std::fs::read_dir("/sys/module")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with("kvm")).collect())
        .unwrap_or_default();
    names.sort();
    let params = |m: &str| -> Vec<String> {
        let mut p: Vec<String> = std::fs::read_dir(format!("/sys/module/{m}/parameters"))
            .map(|d| {
                d.filter_map(|e| {
                    let e = e.ok()?;
                    let v = std::fs::read_to_string(e.path()).ok()?;
                    Some(format!("{}={}", e.file_name().to_string_lossy(), v.trim()))
                })
                .collect()
            })
            .unwrap_or_default();
        p.sort();
        p.truncate(64);
        p
    };
    let all: Vec<String> = names
        .iter()
        .map(|m| match params(m) {
            p if p.is_empty() => m.clone(),
            p => format!("{m} ({})", p.join(", ")),
        })
        .collect();
    if all.is_empty() {
        "none found in /sys/module".into()
    } else {
        all.join("; ")
    }
}

pub fn run(a: &AllArgs) -> anyhow::Result<i32> {
    let start = Instant::now();
    let (found, qemu) = qemu_version();
    let Matrix { exits, floor, nvme, blk } = matrix(a, found && !a.no_qemu);
    let mut input = report::Input {
        meta: report::Meta {
            version: version(),
            qemu: if a.no_qemu { "left out (--no-qemu)".into() } else { qemu },
            kvm_modules: kvm_modules(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            wall_s: 0.0,
        },
        ..report::Input::default()
    };
    let say = |step: &str| {
        if !a.quiet {
            eprintln!("bench all [{:>4.0} s] {step}", start.elapsed().as_secs_f64());
        }
    };
    let mut failed = false;
    // Each bench runs even if one before it failed; its error goes into the report.
    let mut take = |name: &str, r: anyhow::Result<(bool, String, serde_json::Value)>| match r {
        Ok((errors, table, json)) => {
            failed |= errors;
            input.tables.push((name.into(), table));
            input.docs.push(json);
        }
        Err(e) => {
            failed = true;
            input.docs.push(serde_json::json!({"benchmark": name, "errors": [crate::error_text(&e)]}));
        }
    };
    say("1/4 exits (each bench shows its own runs and ETA)");
    take("exits", run_exits(&exits).map(|r| (!r.errors.is_empty(), r.table(), r.json())));
    say("2/4 floor");
    take("floor", run_floor(&floor).map(|r| (!r.errors.is_empty(), r.table(), r.json())));
    say("3/4 nvme");
    take("nvme", run_nvme(&nvme).map(|r| (!r.errors.is_empty(), r.table(), r.json())));
    say("4/4 blk");
    take("blk", run_blk(&blk).map(|r| (!r.errors.is_empty(), r.table(), r.json())));
    input.meta.wall_s = start.elapsed().as_secs_f64();
    let r = report::render(&input);
    let files = report::write(&a.out, &r).with_context(|| format!("writing the report to {}", a.out.display()))?;
    if !a.quiet {
        for (_, t) in &input.tables {
            print!("{t}");
        }
        println!("\nreport: {}", a.out.join("report.md").display());
        for f in &files {
            println!("  {}", f.display());
        }
    }
    Ok(if failed { 1 } else { 0 })
}

/// `iopath report --from FILE --out DIR`: the report again from a results.json.
pub fn rerender(from: &std::path::Path, out: &std::path::Path) -> anyhow::Result<i32> {
    let text = std::fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).with_context(|| format!("{} is not JSON", from.display()))?;
    anyhow::ensure!(v["benchmarks"].is_array(), "{} is not a results.json of `iopath bench all`", from.display());
    let r = report::render(&report::Input::from_results(&v));
    for f in report::write(out, &r).with_context(|| format!("writing the report to {}", out.display()))? {
        println!("{}", f.display());
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    /// The report's KVM line names the loaded module and its parameters, as
    /// /sys/module has them (this host's /proc/modules may not exist).
    #[test]
    fn the_kvm_line_names_the_module_and_its_parameters() {
        let want: Vec<String> = std::fs::read_dir("/sys/module")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("kvm_"))
            .collect();
        assert!(!want.is_empty(), "no kvm_* module in /sys/module: these tests need KVM");
        let line = super::kvm_modules();
        for m in &want {
            assert!(line.contains(m.as_str()), "{m} missing from {line:?}");
            let has_params = std::fs::read_dir(format!("/sys/module/{m}/parameters")).map_or(0, |d| d.count()) > 0;
            assert!(!has_params || line.contains(&format!("{m} (")), "{m}'s parameters missing from {line:?}");
        }
    }
}
