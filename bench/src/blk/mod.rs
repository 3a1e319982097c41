//! `iopath bench blk`: one block workload on every path iopath has to a
//! guest's disk, and on QEMU's, in one run and on the same backend: the
//! emulated NVMe controller (doorbells as MMIO exits, shadow doorbells in
//! guest RAM, a shared BAR page), virtio-blk in the VMM (notify exits, KVM
//! ioeventfds, a polling device thread), virtio-blk in a device process over
//! vfio-user, over vhost-user (iopath's VMM as frontend), and QEMU 7.2's
//! `virtio-blk-pci` and `vhost-user-blk-pci` (with iopath's backend).
//!
//! Jobs: seq read, seq write, rand read, rand write, each for throughput
//! (128 KiB at `tput_qd`) and for latency (4 KiB at QD1). The guest drivers
//! (nvmeperf, vblk) share one load generator, so the job is the same code on
//! every target. Each run is checked against the device's counters
//! (`routing_ok`, see `run.rs`); exits per I/O count the timed window only.
//! Figures are medians over rounds with min and max; latency percentiles
//! come from the rounds' merged histograms. Device assignment (VFIO) has no
//! hardware here: its line says so and carries no figures.

use crate::host::HostInfo;
use crate::nvme::{Job, LatHist};
use iopath_devices::block::StorageKind;
use iopath_devices::virtio::pci::NotifyMode;
use serde::Serialize;
use std::time::Duration;

mod args;
pub mod check;
mod qemu;
mod run;
mod table;
pub mod target;

pub use args::BlkArgs;
pub use run::DEVICE_THREADS;
pub use table::Record;
pub use target::{QemuBlk, Target, UnknownTarget};

/// The device-assignment line: never run, never faked.
pub const VFIO_TARGET: &str = "vfio (device assignment)";

/// The target the ratio column divides by, unless `--reference` says otherwise.
pub const DEFAULT_REFERENCE: Target = Target::Virtio(NotifyMode::Ioeventfd);

#[derive(Clone, Debug, Serialize)]
pub struct BlkOptions {
    /// Targets to run, in that order (by default [`Target::all`]).
    pub targets: Vec<Target>,
    #[serde(serialize_with = "as_string")]
    pub backend: StorageKind,
    /// Disk size in MiB on null and ram backends (each device's, and the
    /// guest's range); a file backend's is the file's.
    pub size_mb: u64,
    /// Length of each run's timed window.
    pub time_ms: u64,
    pub rounds: u32,
    /// Block size and queue depth of the throughput jobs.
    pub tput_bs: u64,
    pub tput_qd: u32,
    /// Block size of the latency jobs (at QD1).
    pub lat_bs: u64,
    pub mem_mb: u64,
    pub timeout_s: u64,
    pub progress: bool,
    /// The target every other is divided by in the ratio column.
    pub reference: Target,
    /// A target that failed this many times without a good run is not run again.
    pub max_failures: u32,
    /// Where the vCPU and the device threads run (`--pin`); None leaves them to the scheduler.
    pub pin: Option<crate::pin::Placement>,
    #[serde(skip)]
    pub iopath_exe: Option<std::path::PathBuf>,
}

fn as_string<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

impl Default for BlkOptions {
    fn default() -> Self {
        BlkOptions {
            targets: Target::all(),
            backend: StorageKind::Null,
            size_mb: 64,
            time_ms: 2000,
            rounds: 3,
            tput_bs: 128 << 10,
            tput_qd: 16,
            lat_bs: 4096,
            mem_mb: 256,
            timeout_s: 120,
            progress: true,
            reference: DEFAULT_REFERENCE,
            max_failures: 2,
            pin: crate::pin::Placement::auto(),
            iopath_exe: None,
        }
    }
}

/// The workloads, fio's names, with what the table calls them.
pub const RWS: [(&str, &str); 4] =
    [("read", "seq read"), ("write", "seq write"), ("randread", "rand read"), ("randwrite", "rand write")];

/// What a job measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Measure {
    /// MB/s at `tput_bs` and `tput_qd`.
    Throughput,
    /// p50 and p99 at `lat_bs` and QD1.
    Latency,
}

/// One job of the matrix: the load generator's job and its name.
#[derive(Clone, Debug, Serialize)]
pub struct BlkJob {
    /// "seq read 128k qd16".
    pub name: String,
    pub measure: Measure,
    #[serde(flatten)]
    pub job: Job,
}

impl BlkOptions {
    /// The eight jobs: each workload for throughput, then each for latency.
    pub fn jobs(&self) -> Vec<BlkJob> {
        let mut v = Vec::new();
        for (measure, bs, qd) in
            [(Measure::Throughput, self.tput_bs, self.tput_qd.max(1)), (Measure::Latency, self.lat_bs, 1)]
        {
            for (rw, label) in RWS {
                let job = Job { rw: rw.into(), ..Job::randread(bs, qd) };
                let b = if bs.is_multiple_of(1024) { format!("{}k", bs / 1024) } else { bs.to_string() };
                v.push(BlkJob { name: format!("{label} {b} qd{qd}"), measure, job });
            }
        }
        v
    }
}

/// One guest run of one target and job.
#[derive(Clone, Debug, Serialize)]
pub struct BlkRun {
    pub target: String,
    /// The job's index in `BlkOptions::jobs` and its name.
    pub job_index: usize,
    pub job: String,
    pub round: u32,
    /// I/Os in the guest's timed window, and the window in guest TSC cycles.
    pub ios: u64,
    pub cycles: u64,
    pub iops: f64,
    pub mb_s: f64,
    /// The guest's mean, shortest and longest latency (`lat_sum` over the
    /// I/Os, `lat_min`, `lat_max`), where its record gave them.
    pub lat_avg_ns: Option<f64>,
    pub lat_min_ns: Option<f64>,
    pub lat_max_ns: Option<f64>,
    /// From this run's histogram, interpolated within the bucket.
    pub p50_ns: f64,
    pub p99_ns: f64,
    /// The guest's histogram: `[upper_edge_ns, count]` pairs.
    pub hist: Vec<(f64, u64)>,
    #[serde(skip)]
    pub lat: Option<LatHist>,
    /// VMM exits in the guest's timed window (iopath's VMM only), and per I/O.
    pub window_exits: Option<u64>,
    pub exits_per_io: Option<f64>,
    /// Notify writes (virtio) or I/O doorbell writes (NVMe mmio) the guest made.
    pub guest_notifies: Option<u64>,
    pub errors: u64,
    /// What the device counters said, and whether that is the path's routing.
    pub routing: String,
    pub routing_ok: bool,
}

/// A target that did not run a job: its error, or why it was left out.
#[derive(Clone, Debug, Serialize)]
pub struct Failure {
    pub target: String,
    pub job_index: usize,
    pub job: String,
    pub round: u32,
    pub error: String,
}

pub struct BlkResult {
    /// Ctrl-C stopped the bench (`crate::interrupt`): the runs measured before it.
    pub partial: bool,
    pub host: HostInfo,
    pub options: BlkOptions,
    /// The disk every target ran on, in bytes (a file backend's is the file's).
    pub disk_bytes: u64,
    pub jobs: Vec<BlkJob>,
    pub tsc_khz: u64,
    pub runs: Vec<BlkRun>,
    pub failures: Vec<Failure>,
    /// Lines not run, with the reason (the VFIO device-assignment line).
    pub not_run: Vec<(String, String)>,
    pub errors: Vec<String>,
}

/// Why device assignment is not measured: what /sys says about vfio-pci.
pub fn vfio_reason() -> String {
    let bound: Vec<String> = std::fs::read_dir("/sys/bus/pci/drivers/vfio-pci")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(':') && n.contains('.'))
                .collect()
        })
        .unwrap_or_default();
    if bound.is_empty() {
        "no hardware here: no PCI function is bound to vfio-pci, so no figures".into()
    } else {
        format!("not measured: vfio-pci holds {} but iopath's VMM does not assign devices", bound.join(", "))
    }
}

/// What is wrong with a list of targets.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TargetsError {
    #[error(transparent)]
    Unknown(#[from] UnknownTarget),
    #[error("no target given")]
    Empty,
}

/// Targets from their comma-separated names, each once, in the given order
/// (the VFIO line, `vfio`, is always shown and runs nothing).
pub fn parse_targets(s: &str) -> Result<Vec<Target>, TargetsError> {
    let mut v = Vec::new();
    for name in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        if name == "vfio" || name == VFIO_TARGET {
            continue;
        }
        let t: Target = name.parse()?;
        if !v.contains(&t) {
            v.push(t);
        }
    }
    if v.is_empty() {
        return Err(TargetsError::Empty);
    }
    Ok(v)
}

pub fn run_blk(o: &BlkOptions) -> anyhow::Result<BlkResult> {
    anyhow::ensure!(!o.targets.is_empty(), "no target to run");
    let jobs = o.jobs();
    let nvme = run::nvme_options(o, &jobs);
    let ctx = run::Ctx::new(o, &jobs, &nvme)?;
    let pb = run::progress(o.progress, (jobs.len() * o.targets.len()) as u64 * o.rounds as u64);
    let (mut runs, mut failures) = (Vec::new(), Vec::new());
    // Failures without a good run, per target, and the first one's error:
    // past max_failures the target is left out.
    let mut failed: Vec<(u32, bool, String)> = o.targets.iter().map(|_| (0, false, String::new())).collect();
    let interrupted = crate::interrupt::interrupted;
    'rounds: for round in 0..o.rounds {
        for (ji, j) in jobs.iter().enumerate() {
            for (ti, t) in o.targets.iter().enumerate() {
                if interrupted() {
                    break 'rounds;
                }
                pb.set_message(format!("round {}/{} {} {t}", round + 1, o.rounds, j.name));
                let fail =
                    |error: String| Failure { target: t.to_string(), job_index: ji, job: j.name.clone(), round, error };
                let (n, ok, first) = &mut failed[ti];
                if !*ok && *n >= o.max_failures {
                    failures.push(fail(format!("not run: it failed {n} times without a good run, first: {first}")));
                } else {
                    match ctx.run(*t, ji, round) {
                        Ok(r) => {
                            *ok = true;
                            runs.push(r)
                        }
                        Err(_) if interrupted() => break 'rounds,
                        Err(e) => {
                            *n += 1;
                            if first.is_empty() {
                                *first = format!("{e:#}");
                            }
                            failures.push(fail(format!("{e:#}")));
                        }
                    }
                }
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    let mut errors: Vec<String> =
        failures.iter().map(|f| format!("{} {} round {}: {}", f.target, f.job, f.round, f.error)).collect();
    for r in runs.iter().filter(|r| !r.routing_ok) {
        errors.push(format!("{} {} round {}: wrong: {}", r.target, r.job, r.round, r.routing));
    }
    let (host, tsc_khz, disk_bytes) = (ctx.host.clone(), ctx.tsc_khz, ctx.size);
    drop(ctx);
    Ok(BlkResult {
        partial: interrupted(),
        host,
        options: o.clone(),
        disk_bytes,
        jobs,
        tsc_khz,
        runs,
        failures,
        not_run: vec![(VFIO_TARGET.to_string(), vfio_reason())],
        errors,
    })
}

/// How long a device process may take to start listening.
const LISTEN_WAIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_is_four_workloads_for_throughput_and_latency() {
        let o = BlkOptions::default();
        let names: Vec<String> = o.jobs().iter().map(|j| j.name.clone()).collect();
        assert_eq!(names[0], "seq read 128k qd16");
        assert_eq!(names[7], "rand write 4k qd1");
        assert_eq!(names.len(), 8);
        assert!(o.jobs().iter().all(|j| (j.measure == Measure::Latency) == (j.job.iodepth == 1)));
    }

    #[test]
    fn targets_are_checked_and_kept_in_the_given_order() {
        use iopath_devices::nvme::DoorbellMode;
        let (bar, exit) = (Target::Nvme(DoorbellMode::Bar), Target::Virtio(NotifyMode::Exit));
        assert_eq!(parse_targets("nvme-bar,virtio-exit").unwrap(), [bar, exit]);
        assert_eq!(parse_targets("virtio-exit, nvme-bar,virtio-exit,vfio").unwrap(), [exit, bar]);
        let vu = Target::Remote(iopath_protocols::transport("vhost-user").unwrap());
        assert_eq!(parse_targets("vhost-user,virtio@vfio-user").unwrap()[0], vu);
        let e = parse_targets("nvme-foo").unwrap_err();
        assert!(matches!(&e, TargetsError::Unknown(u) if u.name == "nvme-foo"), "{e:?}");
        assert!(e.to_string().contains("nvme-foo") && e.to_string().contains("qemu-vhost-user-blk-pci"), "{e}");
        assert_eq!(parse_targets(""), Err(TargetsError::Empty));
        assert_eq!(parse_targets("vfio"), Err(TargetsError::Empty), "the VFIO line alone runs nothing");
    }
}
