//! `iopath bench spdk`: SPDK's stock client, `spdk_nvme_perf`, against
//! `iopath serve nvme,backend=null` in the default doorbell mode over
//! vfio-user and against SPDK's own `nvmf_tgt` (VFIOUSER transport, a null
//! bdev of the same size and block size), side by side in one run.
//! `--controllers N,...`: for each N, one iopath process serving N
//! controllers (`iopath serve --controllers N`) against one nvmf_tgt with N
//! subsystems, perf driving all N at once from its one core; each run also
//! records the target process's CPU time, so the table gives CPU per I/O.
//!
//! Both servers start once for each N and stop after its runs; every job runs a fresh perf
//! process (its hugepage files removed when it is reaped) against each,
//! rounds interleaved (even rounds iopath first, odd rounds nvmf_tgt first).
//! Every run is checked against the device's own counters (iopath's report
//! when perf leaves, nvmf_tgt's `bdev_get_iostat`): the device served at
//! least every I/O perf counted, no more than perf could have issued, reads
//! only for a read job, and no error. A run that fails a check is an error,
//! not a number. The figures are perf's own (IOPS, average latency, and the
//! percentiles of `-L`), median over rounds with min and max.
//!
//! The peers come from `harness/spdk/build.sh` (built and cached; `--spdk
//! DIR` names an install directory instead); `proc` keeps every child
//! bounded and leaves nothing behind, Ctrl-C included.

mod args;
pub mod perf;
pub mod proc;
mod table;
mod targets;

use crate::host::HostInfo;
use crate::pin::Placement;
pub use args::SpdkArgs;
use perf::{PerfJob, PerfOut};
use proc::{check, run_bounded, Interrupted};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
pub use targets::{Io, Kind};

/// 2 MiB pages `bench spdk` asks `harness/spdk/hugepages.sh` to have free:
/// nvmf_tgt's pools and a perf client at a time, with room (see
/// harness/spdk/README.md for what each holds).
pub const HUGEPAGES: u32 = 300;
/// A perf run may take this long beyond its own run time (start, attach, exit).
const PERF_SLACK: Duration = Duration::from_secs(60);
/// How long iopath serve may take to print its counters once perf left.
const REPORT_WAIT: Duration = Duration::from_secs(20);

#[derive(Clone, Debug, Serialize)]
pub struct SpdkOptions {
    pub jobs: Vec<PerfJob>,
    /// Controller counts: for each, a pair of targets serving that many.
    pub controllers: Vec<u32>,
    /// perf's `-t`, whole seconds.
    pub runtime_s: u64,
    pub rounds: u32,
    /// The namespace: MiB and LBA size, the same on both targets.
    pub size_mb: u64,
    pub lba: u32,
    /// iopath's doorbell mode; None: no option, the controller's default (auto).
    #[serde(serialize_with = "mode_name")]
    pub doorbell: Option<iopath_devices::nvme::DoorbellMode>,
    /// perf's core (`vcpu`) and the targets' (`device`).
    pub pin: Placement,
    /// The peers' install directory (bin/spdk_nvme_perf, bin/nvmf_tgt,
    /// bin/rpc.py); None: harness/spdk/build.sh's, built if missing.
    pub spdk: Option<PathBuf>,
    #[serde(skip)]
    pub iopath_exe: Option<PathBuf>,
    #[serde(skip)]
    pub progress: bool,
}

impl Default for SpdkOptions {
    fn default() -> Self {
        let jobs = [4096, 512]
            .iter()
            .flat_map(|&bs| [1, 16, 64, 128].map(|iodepth| PerfJob { rw: "randread".into(), bs, iodepth }))
            .collect();
        SpdkOptions {
            jobs,
            controllers: vec![1],
            runtime_s: 2,
            rounds: 3,
            size_mb: 64,
            lba: 512,
            doorbell: None,
            pin: Placement { vcpu: 0, device: 1 },
            spdk: None,
            iopath_exe: None,
            progress: true,
        }
    }
}

fn mode_name<S: serde::Serializer>(m: &Option<iopath_devices::nvme::DoorbellMode>, s: S) -> Result<S::Ok, S::Error> {
    match m {
        Some(m) => s.collect_str(m),
        None => s.serialize_none(),
    }
}

/// One perf run that held every check.
#[derive(Clone, Debug, Serialize)]
pub struct SpdkRun {
    pub target: Kind,
    /// The controllers the target served, perf drove them all.
    pub controllers: u32,
    pub job: usize,
    pub round: u32,
    pub perf: PerfOut,
    /// What the devices did during the run (their counters' difference).
    pub device: Io,
    /// The target process's CPU time during the run (perf's start and exit
    /// included), ns.
    pub target_cpu_ns: u64,
    pub check: String,
    /// perf's process id (its DPDK files are `spdk_pid<PID>*`).
    pub perf_pid: u32,
}

pub struct SpdkResult {
    /// Ctrl-C stopped the bench once perf had started: the runs before it.
    pub partial: bool,
    pub host: HostInfo,
    pub options: SpdkOptions,
    /// The peers' install directory used.
    pub peers: PathBuf,
    /// Each server's process id, for the record.
    pub server_pids: Vec<(Kind, u32)>,
    pub runs: Vec<SpdkRun>,
    pub errors: Vec<String>,
}

/// The peers' tools.
struct Peers {
    dir: PathBuf,
    perf: PathBuf,
    nvmf_tgt: PathBuf,
    rpc_py: PathBuf,
}

/// harness/spdk/ of the source tree this binary was built from, or of the
/// current directory.
fn harness_dir() -> Option<PathBuf> {
    [Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/spdk"), PathBuf::from("harness/spdk")]
        .into_iter()
        .find(|d| d.join("build.sh").is_file())
}

fn peers(o: &SpdkOptions) -> anyhow::Result<Peers> {
    let dir = match &o.spdk {
        Some(d) => d.clone(),
        None => {
            let Some(h) = harness_dir() else {
                anyhow::bail!(
                    "no SPDK peers: harness/spdk/build.sh is not found from here (run the bench from the \
                     iopath source tree, or give --spdk DIR, a directory harness/spdk/build.sh printed)"
                );
            };
            // Its progress goes to our stderr; the directory comes on stdout.
            let out = Command::new("bash")
                .arg(h.join("build.sh"))
                .stderr(std::process::Stdio::inherit())
                .output()
                .map_err(|e| anyhow::anyhow!("cannot run {}: {e}", h.join("build.sh").display()))?;
            if !out.status.success() {
                anyhow::bail!(
                    "harness/spdk/build.sh could not build SPDK's spdk_nvme_perf and nvmf_tgt ({}); it needs root, \
                     the archives in shared/peers and Debian's packages: see its messages above and \
                     harness/spdk/README.md",
                    out.status
                );
            }
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    let bin = |n: &str| {
        let p = dir.join("bin").join(n);
        if p.is_file() {
            Ok(p)
        } else {
            Err(anyhow::anyhow!(
                "{} is missing: {} is not an install directory of harness/spdk/build.sh",
                p.display(),
                dir.display()
            ))
        }
    };
    Ok(Peers { perf: bin("spdk_nvme_perf")?, nvmf_tgt: bin("nvmf_tgt")?, rpc_py: bin("rpc.py")?, dir })
}

/// Free 2 MiB pages in a hugetlbfs at /dev/hugepages: harness/spdk/hugepages.sh
/// where found (it mounts and grows the pool; never shrinks it), else a check.
fn hugepages() -> anyhow::Result<()> {
    if let Some(h) = harness_dir() {
        let out = Command::new("bash").arg(h.join("hugepages.sh")).arg(HUGEPAGES.to_string()).output()?;
        if !out.status.success() {
            anyhow::bail!(
                "harness/spdk/hugepages.sh {HUGEPAGES} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        return Ok(());
    }
    let free = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find_map(|l| l.strip_prefix("HugePages_Free:")?.trim().parse::<u32>().ok()))
        .unwrap_or(0);
    if free < HUGEPAGES || !Path::new("/dev/hugepages").is_dir() {
        anyhow::bail!(
            "SPDK needs a hugetlbfs at /dev/hugepages with {HUGEPAGES} free 2 MiB pages ({free} free): \
             run harness/spdk/hugepages.sh {HUGEPAGES} as root"
        );
    }
    Ok(())
}

fn progress_bar(show: bool, len: u64) -> indicatif::ProgressBar {
    crate::progress::bar(show, len)
}

/// Runs the bench. Ctrl-C stops it after the servers and any perf are
/// stopped and their files removed: the runs measured so far, `partial`
/// (before the servers ran, [`Interrupted`]; whatever failed because of the
/// signal, a child it also reached, is that).
pub fn run_spdk(o: &SpdkOptions) -> anyhow::Result<SpdkResult> {
    let _signals = proc::SignalGuard::install()?;
    run(o).map_err(crate::interrupt::or_interrupted)
}

fn run(o: &SpdkOptions) -> anyhow::Result<SpdkResult> {
    anyhow::ensure!(!o.jobs.is_empty() && o.rounds > 0 && o.runtime_s > 0, "bench spdk: no job, round or run time");
    for j in &o.jobs {
        anyhow::ensure!(
            j.bs.is_multiple_of(o.lba as u64) && j.bs >= o.lba as u64,
            "{}: the block size is not a multiple of the {} B LBA",
            j.label(),
            o.lba
        );
    }
    let peers = peers(o)?;
    hugepages()?;
    let tsc_khz = crate::exits::tsc_khz_of_host().unwrap_or(0);
    let iopath = match &o.iopath_exe {
        Some(p) => p.clone(),
        None => std::env::current_exe()?,
    };
    anyhow::ensure!(!o.controllers.is_empty(), "bench spdk: no controller count");
    let pb = progress_bar(o.progress, (o.jobs.len() * 2 * o.controllers.len()) as u64 * o.rounds as u64);
    let (mut runs, mut errors, mut server_pids) = (Vec::new(), Vec::new(), Vec::new());
    'counts: for &n in &o.controllers {
        // Both servers once per count, each on the targets' CPU, in a directory of their own;
        // dropped (stopped) on every way out.
        let dir = proc::TempDir::new("spdk")?;
        pb.set_message(format!("starting iopath serve and nvmf_tgt with {n} controller(s)"));
        let mut servers = [
            targets::Server::iopath(o, n, &iopath, &peers.rpc_py, &dir.0, o.pin.device)?,
            targets::Server::nvmf(o, n, &peers.nvmf_tgt, &peers.rpc_py, &dir.0, o.pin.device)?,
        ];
        server_pids.extend(servers.iter().map(|s| (s.kind, s.pid())));
        for round in 0..o.rounds {
            for (ji, j) in o.jobs.iter().enumerate() {
                let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
                for ti in order {
                    let s = &mut servers[ti];
                    let what = format!("{} {} x{n} round {round}", s.kind.name(), j.label());
                    pb.set_message(format!("round {}/{} {} x{n} {}", round + 1, o.rounds, j.label(), s.kind.name()));
                    match run_one(o, &peers, &dir.0, s, ji, round) {
                        Ok(r) => runs.push(r),
                        Err(e) if e.is::<Interrupted>() || proc::interrupted() => break 'counts,
                        Err(e) => errors.push(format!("{what}: {e:#}")),
                    }
                    pb.inc(1);
                }
            }
        }
        for s in &mut servers {
            s.stop();
        }
    }
    pb.finish_and_clear();
    Ok(SpdkResult {
        partial: proc::interrupted(),
        host: crate::host::host_info(tsc_khz),
        options: o.clone(),
        peers: peers.dir,
        server_pids,
        runs,
        errors,
    })
}

/// One fresh perf process against `s`, and its checks.
fn run_one(
    o: &SpdkOptions,
    p: &Peers,
    dir: &Path,
    s: &mut targets::Server,
    ji: usize,
    round: u32,
) -> anyhow::Result<SpdkRun> {
    let j = &o.jobs[ji];
    check()?;
    s.alive()?;
    let mut cmd = Command::new(&p.perf);
    cmd.args(perf::args(&s.trids(), j, o.runtime_s, o.pin.vcpu));
    let limit = Duration::from_secs(o.runtime_s) + PERF_SLACK;
    let cpu0 = s.cpu_ns();
    let ran = run_bounded("spdk_nvme_perf", &mut cmd, dir, limit, None);
    let cpu1 = s.cpu_ns();
    let ran = match ran {
        Ok(r) => r,
        Err(e) => {
            // iopath's report of that client, if any, must not count for the next run.
            let _ = s.io_delta(Duration::from_secs(2));
            return Err(e);
        }
    };
    let perf_pid = ran.pid;
    let figures = match (ran.status.success(), perf::parse(&ran.stdout), perf::error_line(&ran.stderr)) {
        (true, Ok(f), None) => Ok(f),
        (false, _, _) => Err(format!("spdk_nvme_perf exited with {}", ran.status)),
        (_, Err(e), _) => Err(e.to_string()),
        (_, _, Some(l)) => Err(format!("spdk_nvme_perf: {l}")),
    };
    let io = s.io_delta(if s.kind == Kind::Iopath { REPORT_WAIT } else { Duration::ZERO });
    s.alive()?;
    let f = figures.map_err(|e| anyhow::anyhow!("{e}:\n{}", ran.log))?;
    let io = io?;
    let n = s.controllers() as u32;
    let (ok, check) = verdict(j, n, o.runtime_s, &f, &io);
    if !ok {
        anyhow::bail!(
            "perf's figures and the device's counters disagree: {check} (fewer: I/O perf counted that the device \
             did not serve; more: perf's timing took a stall longer than its run, which its IOPS would understate, \
             or the device served I/O perf did not send)"
        );
    }
    let target_cpu_ns = match (cpu0, cpu1) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => anyhow::bail!("{}'s CPU time could not be read from /proc", s.kind.name()),
    };
    Ok(SpdkRun { target: s.kind, controllers: n, job: ji, round, perf: f, device: io, target_cpu_ns, check, perf_pid })
}

/// Whether the devices' counters account for perf's I/O: at least the I/Os
/// perf counted (IOPS x its run time: it measures a little longer), at most
/// what it could have issued in one more second plus its queues (one per
/// controller), reads only for a read job (writes only for a write job), and
/// no error.
fn verdict(j: &PerfJob, controllers: u32, secs: u64, f: &PerfOut, io: &Io) -> (bool, String) {
    let done = (f.iops * secs as f64) as u64;
    let most = (f.iops * (secs as f64 + 1.0)) as u64 + u64::from(j.iodepth) * u64::from(controllers);
    let (same, other) = match j.rw.as_str() {
        "read" | "randread" => (io.reads, io.writes),
        "write" | "randwrite" => (io.writes, io.reads),
        _ => (io.commands, 0),
    };
    let ok = io.commands >= done && io.commands <= most && same == io.commands && other == 0 && io.errors == 0;
    let text = format!(
        "device {} commands ({} reads, {} writes, {} errors; poller sleeps {}) for perf's {done} I/Os (at most {most})",
        io.commands, io.reads, io.writes, io.errors, io.sleeps
    );
    (ok, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(iops: f64) -> PerfOut {
        PerfOut { iops, mib_s: 1.0, avg_us: 1.0, min_us: 1.0, max_us: 1.0, p50_us: 1.0, p99_us: 1.0, p999_us: 1.0 }
    }

    #[test]
    fn a_run_counts_only_if_the_device_served_every_io_perf_counted_and_no_more() {
        let j = PerfJob { rw: "randread".into(), bs: 4096, iodepth: 16 };
        let io = |commands, reads, writes, errors| Io { commands, reads, writes, errors, sleeps: 0 };
        assert!(verdict(&j, 1, 2, &out(1000.0), &io(2010, 2010, 0, 0)).0);
        assert!(!verdict(&j, 1, 2, &out(1000.0), &io(1999, 1999, 0, 0)).0, "fewer than perf counted");
        assert!(!verdict(&j, 1, 2, &out(1000.0), &io(3100, 3100, 0, 0)).0, "more than perf could issue");
        assert!(!verdict(&j, 1, 2, &out(1000.0), &io(2010, 2000, 10, 0)).0, "writes in a read job");
        let (ok, why) = verdict(&j, 1, 2, &out(1000.0), &io(2010, 2010, 0, 1));
        assert!(!ok && why.contains("1 errors"), "{why}");
        let w = PerfJob { rw: "randwrite".into(), ..j };
        assert!(verdict(&w, 1, 1, &out(10.0), &io(10, 0, 10, 0)).0);
    }

    #[test]
    fn the_default_jobs_are_randread_4k_and_512_at_four_depths_on_one_namespace() {
        let o = SpdkOptions::default();
        let labels: Vec<String> = o.jobs.iter().map(|j| j.label()).collect();
        assert_eq!(labels[..4], ["randread 4k qd1", "randread 4k qd16", "randread 4k qd64", "randread 4k qd128"]);
        assert_eq!(labels[4..], ["randread 512 qd1", "randread 512 qd16", "randread 512 qd64", "randread 512 qd128"]);
        assert_eq!((o.size_mb, o.lba, o.rounds), (64, 512, 3));
    }
}
