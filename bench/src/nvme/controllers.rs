//! `bench nvme --controllers N[,N..]`: N iopath guests at once, each with
//! its own controller, all N controllers in ONE device process (`iopath
//! serve nvme,... --controllers N --pollers M --socket DIR/c{}.sock`, M =
//! `--pool-pollers`), for each N given; a row per (job, N).
//!
//! What a row holds: the guests' IOPS summed (each guest's own timed
//! window; they start together, but on a loaded host their windows need not
//! overlap, and the sum then overstates), the guests' I/Os over the wall
//! time from their start to the last one's end (boot included: understates),
//! the spread between guests, and CPU time per I/O: the device process's (utime + stime from
//! /proc/PID/stat, from the moment every socket listens to the moment every
//! guest has left) and this process's (getrusage: the N VMMs' vCPU and
//! device threads, from the guests' start to their end; the bench's own
//! thread sleeps meanwhile). Both CPU figures cover each guest's whole life,
//! its boot and driver setup included, not the timed window only: with
//! short runs they are an upper bound. Routing: each controller's counters
//! line (`"controller": K`) counts exactly its guest's I/Os (io.commands).
//!
//! `--controllers-vs-spdk DIR`: each N also against one SPDK nvmf_tgt
//! (one reactor, on CPU 1, as the harness runs it) with N subsystems, each
//! a null bdev and a VFIOUSER listener, the same guests attached as
//! `vfio-user:DIR/sK/cntrl`; its routing from each bdev's iostat.
//!
//! Doorbell mode: the first of `--doorbell` the pool serves (shm, bar; shm
//! if none). Backend: ram or null (each controller its own namespace data).
//! One round; `--rounds` is not applied here.

use super::{cmdline, namespace_size, Job, NvmeOptions};
use iopath_devices::nvme::{DoorbellMode, NvmeConfig};
use iopath_devices::DeviceConfig;
use iopath_protocols::attach::{instantiate, DeviceSpec, Endpoint, Programs};
use iopath_vmm::{run, VmConfig};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Controllers one run may have (`iopath serve --controllers`' bound).
pub const MAX_CONTROLLERS: usize = 64;

/// One (job, N) run.
#[derive(Clone, Debug, Serialize)]
pub struct CtrlRow {
    /// `iopath` (one `iopath serve --controllers N`) or `nvmf_tgt` (one
    /// SPDK nvmf_tgt with N subsystems, each a VFIOUSER listener).
    pub target: String,
    pub job: String,
    pub controllers: usize,
    pub pool_pollers: usize,
    pub doorbell: String,
    /// The guests' I/Os and IOPS, summed.
    pub ios: u64,
    pub iops: f64,
    /// The guests' I/Os over the wall time from their start to the last
    /// one's end (boot included: a lower bound where `iops`, the sum of
    /// each guest's own window, overstates when the windows do not overlap).
    pub wall_iops: f64,
    pub wall_s: f64,
    /// The lowest and highest guest's IOPS.
    pub iops_min: f64,
    pub iops_max: f64,
    /// CPU seconds: the device process, and this process (the VMMs).
    pub device_cpu_s: f64,
    pub vmm_cpu_s: f64,
    /// Microseconds of CPU per I/O: the device process's, and in all.
    pub device_us_per_io: f64,
    pub total_us_per_io: f64,
    /// Each controller's io.commands equals its guest's I/Os.
    pub routing_ok: bool,
    pub routing: String,
}

#[derive(Debug, Serialize)]
pub struct CtrlResult {
    pub rows: Vec<CtrlRow>,
    pub errors: Vec<String>,
}

/// `--controllers`' list: each 1 ..= [`MAX_CONTROLLERS`].
pub fn parse_counts(s: &str) -> anyhow::Result<Vec<usize>> {
    let v = s
        .split(',')
        .map(|p| p.trim().parse::<usize>().map_err(|e| anyhow::anyhow!("--controllers {p}: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    anyhow::ensure!(
        !v.is_empty() && v.iter().all(|&n| (1..=MAX_CONTROLLERS).contains(&n)),
        "--controllers {s}: each 1..={MAX_CONTROLLERS}"
    );
    Ok(v)
}

/// The device process, killed if the run ends early.
struct Served(Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// utime + stime of process `pid`, in seconds.
fn proc_cpu_s(pid: u32) -> anyhow::Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let rest = s.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| anyhow::anyhow!("/proc/{pid}/stat: {s}"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm: state is field 3, utime 14, stime 15 (1-based).
    let ticks = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads a value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((ticks(14) + ticks(15)) as f64 / hz)
}

/// This process's user + system CPU seconds, all threads.
fn self_cpu_s() -> f64 {
    // SAFETY: an all-zero rusage is valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Runs every job at every count in `counts`, a pool of `pool` pollers.
/// With `spdk` (an install directory of harness/spdk/build.sh), each count
/// also against one SPDK nvmf_tgt with as many subsystems, right after.
pub fn run_controllers(
    o: &NvmeOptions,
    counts: &[usize],
    pool: usize,
    spdk: Option<&Path>,
) -> anyhow::Result<CtrlResult> {
    anyhow::ensure!(
        matches!(o.backend, iopath_devices::block::StorageKind::Null | iopath_devices::block::StorageKind::Ram),
        "--controllers: backend null or ram (each controller its own namespace data)"
    );
    let db = o.doorbells.iter().copied().find(|d| matches!(d, DoorbellMode::Shm | DoorbellMode::Bar));
    let db = db.unwrap_or(DoorbellMode::Shm);
    let tsc_khz = crate::exits::tsc_khz_of_host()?;
    let progs = Programs::current(None)?;
    let (mut rows, mut errors) = (Vec::new(), Vec::new());
    for j in &o.jobs {
        for &n in counts {
            let servers = std::iter::once(None).chain(spdk.map(Some));
            for sp in servers {
                match one(o, j, n, pool, db, tsc_khz, &progs, sp) {
                    Ok(r) => rows.push(r),
                    Err(e) => errors.push(format!(
                        "{} x{n} {}: {e:#}",
                        j.label(),
                        if sp.is_some() { "nvmf_tgt" } else { "iopath" }
                    )),
                }
            }
        }
    }
    Ok(CtrlResult { rows, errors })
}

fn scratch() -> anyhow::Result<PathBuf> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "iopath-bench-ctrls-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

#[allow(clippy::too_many_arguments)]
fn one(
    o: &NvmeOptions,
    j: &Job,
    n: usize,
    pool: usize,
    db: DoorbellMode,
    tsc_khz: u64,
    progs: &Programs,
    spdk: Option<&Path>,
) -> anyhow::Result<CtrlRow> {
    let config = NvmeConfig {
        doorbell: db,
        backend: o.backend.clone(),
        lba_size: o.lba,
        size: namespace_size(&o.backend, o.size_mb),
        ..NvmeConfig::default()
    };
    let model = DeviceConfig::Nvme(config);
    let dir = scratch()?;
    let r = match spdk {
        None => Server::iopath(&model, n, pool, &dir, progs)
            .and_then(|s| served_run(o, j, n, &model, &dir, tsc_khz, progs, &s)),
        Some(sp) => Server::nvmf(sp, o, n, &dir).and_then(|s| served_run(o, j, n, &model, &dir, tsc_khz, progs, &s)),
    };
    let _ = std::fs::remove_dir_all(&dir);
    let mut r = r?;
    r.pool_pollers = if spdk.is_some() { 1 } else { pool };
    r.doorbell = if spdk.is_some() { "reactor".into() } else { db.to_string() };
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
fn served_run(
    o: &NvmeOptions,
    j: &Job,
    n: usize,
    model: &DeviceConfig,
    dir: &Path,
    tsc_khz: u64,
    progs: &Programs,
    server: &Server,
) -> anyhow::Result<CtrlRow> {
    let pid = server.pid();
    let transport = iopath_protocols::transport("vfio-user")?;
    let socket = |k: usize| server.socket(dir, n, k);
    let line = format!("{} dbbuf=1", cmdline(j, o, tsc_khz));
    // nvmf_tgt's bdevs count reads of their own (the examine at creation).
    let before = match server {
        Server::Nvmf { rpc, .. } => counters_nvmf(rpc, dir, n),
        Server::Iopath(_) => Vec::new(),
    };
    let (dev0, me0, wall0) = (proc_cpu_s(pid)?, self_cpu_s(), Instant::now());
    let results: Vec<anyhow::Result<super::NvmeRun>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|k| {
                let spec = match server {
                    Server::Iopath(_) => DeviceSpec::remote(model.clone(), transport, Endpoint::Socket(socket(k))),
                    Server::Nvmf { .. } => match transport {
                        iopath_protocols::Transport::Function(t) => Ok(DeviceSpec::server(t, socket(k))),
                        _ => unreachable!("vfio-user is a function transport"),
                    },
                };
                let line = line.clone();
                s.spawn(move || -> anyhow::Result<super::NvmeRun> {
                    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &line);
                    cfg.devices = vec![instantiate(&spec?, progs)?];
                    cfg.mem_size = o.mem_mb.min(128) << 20;
                    cfg.timeout = Duration::from_secs(o.timeout_s);
                    cfg.cancel = Some(&crate::interrupt::FLAG);
                    let rep = run(cfg)?;
                    anyhow::ensure!(rep.status == 1, "{}", crate::record::exit_failure(rep.status, &rep.lines));
                    super::run::to_run(&format!("ctrl{k}"), 0, 0, j, &rep.lines, tsc_khz)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a guest thread panicked")))).collect()
    });
    let (me1, dev1, wall_s) = (self_cpu_s(), proc_cpu_s(pid)?, wall0.elapsed().as_secs_f64());
    let counters = match server {
        // nvmf_tgt prints no counters line: each subsystem's bdev's operations.
        Server::Nvmf { rpc, .. } => less(counters_nvmf(rpc, dir, n), &before),
        Server::Iopath(_) => counters_lines(&dir.join("serve.out"), n),
    };
    let mut r = finish(j, n, runs_of(results)?, dev1 - dev0, me1 - me0, counters, server)?;
    (r.wall_s, r.wall_iops) = (wall_s, r.ios as f64 / wall_s.max(1e-9));
    Ok(r)
}

/// Each controller's counters line, printed as its guest leaves (waited for up to 10 s).
fn counters_lines(out: &Path, n: usize) -> Vec<serde_json::Value> {
    let t0 = Instant::now();
    loop {
        let s = std::fs::read_to_string(out).unwrap_or_default();
        let v: Vec<serde_json::Value> =
            s.lines().filter(|l| l.contains("\"disconnected\"")).filter_map(|l| serde_json::from_str(l).ok()).collect();
        if v.len() >= n || t0.elapsed() > Duration::from_secs(10) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `after`'s io.commands less `before`'s, controller by controller.
fn less(mut after: Vec<serde_json::Value>, before: &[serde_json::Value]) -> Vec<serde_json::Value> {
    let io = |v: &serde_json::Value| v["counters"]["io.commands"].as_u64().unwrap_or(0);
    for (a, b) in after.iter_mut().zip(before) {
        a["counters"]["io.commands"] = io(a).saturating_sub(io(b)).into();
    }
    after
}

fn runs_of(r: Vec<anyhow::Result<super::NvmeRun>>) -> anyhow::Result<Vec<super::NvmeRun>> {
    r.into_iter().collect()
}

/// nvmf_tgt's bdev read counts, as counters lines (`"controller": K`, io.commands).
fn counters_nvmf(rpc: &Path, dir: &Path, n: usize) -> Vec<serde_json::Value> {
    (0..n)
        .filter_map(|k| {
            let out = rpc_call(rpc, dir, &["bdev_get_iostat", "-b", &format!("Ns{k}")]).ok()?;
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let b = v["bdevs"].get(0)?;
            let ios = b["num_read_ops"].as_u64()? + b["num_write_ops"].as_u64()?;
            Some(serde_json::json!({"controller": k, "counters": {"io.commands": ios}}))
        })
        .collect()
}

fn finish(
    j: &Job,
    n: usize,
    runs: Vec<super::NvmeRun>,
    device_cpu_s: f64,
    vmm_cpu_s: f64,
    counters: Vec<serde_json::Value>,
    server: &Server,
) -> anyhow::Result<CtrlRow> {
    let ios: u64 = runs.iter().map(|r| r.io.ios).sum();
    let iops: f64 = runs.iter().map(|r| r.io.iops).sum();
    let each = |f: fn(f64, f64) -> f64, init| runs.iter().map(|r| r.io.iops).fold(init, f);
    let mut routing = String::new();
    let mut routing_ok = counters.len() == n;
    for c in &counters {
        let k = c.get("controller").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
        let cmds = c["counters"]["io.commands"].as_u64();
        let want = runs.get(k).map(|r| r.io.ios);
        routing_ok &= cmds.is_some() && cmds == want;
        let _ = write!(routing, "c{k} io.commands={cmds:?} of {want:?}; ");
    }
    Ok(CtrlRow {
        target: server.name().into(),
        job: j.label(),
        controllers: n,
        pool_pollers: 0,
        doorbell: String::new(),
        ios,
        iops,
        wall_iops: 0.0,
        wall_s: 0.0,
        iops_min: each(f64::min, f64::INFINITY),
        iops_max: each(f64::max, 0.0),
        device_cpu_s,
        vmm_cpu_s,
        device_us_per_io: device_cpu_s * 1e6 / ios.max(1) as f64,
        total_us_per_io: (device_cpu_s + vmm_cpu_s) * 1e6 / ios.max(1) as f64,
        routing_ok,
        routing,
    })
}

/// The device side of a run, stopped on drop.
enum Server {
    /// `iopath serve --controllers N`.
    Iopath(Served),
    /// nvmf_tgt with N subsystems; `rpc` its rpc.py.
    Nvmf { tgt: Served, rpc: PathBuf },
}

impl Server {
    fn name(&self) -> &'static str {
        match self {
            Server::Iopath(_) => "iopath",
            Server::Nvmf { .. } => "nvmf_tgt",
        }
    }

    fn pid(&self) -> u32 {
        match self {
            Server::Iopath(s) | Server::Nvmf { tgt: s, .. } => s.0.id(),
        }
    }

    /// Controller `k`'s socket of `n`.
    fn socket(&self, dir: &Path, n: usize, k: usize) -> PathBuf {
        match self {
            Server::Iopath(_) if n == 1 => dir.join("c{}.sock"),
            Server::Iopath(_) => dir.join(format!("c{k}.sock")),
            Server::Nvmf { .. } => dir.join(format!("s{k}")).join("cntrl"),
        }
    }

    /// `iopath serve MODEL --controllers n --pollers pool --socket DIR/c{}.sock`, listening.
    fn iopath(model: &DeviceConfig, n: usize, pool: usize, dir: &Path, progs: &Programs) -> anyhow::Result<Server> {
        let (out, err) = (dir.join("serve.out"), dir.join("serve.err"));
        let child = Command::new(&progs.iopath)
            .arg("serve")
            .arg(model.to_string())
            .args(["--controllers", &n.to_string(), "--pollers", &pool.to_string(), "--socket"])
            .arg(dir.join("c{}.sock"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out)?)
            .stderr(std::fs::File::create(&err)?)
            .spawn()?;
        let mut served = Served(child);
        let t0 = Instant::now();
        let banner = if n == 1 { " on " } else { "controller " };
        while std::fs::read_to_string(&err).unwrap_or_default().matches(banner).count() < n {
            if let Some(s) = served.0.try_wait()? {
                anyhow::bail!("iopath serve ended ({s}): {}", std::fs::read_to_string(&err).unwrap_or_default());
            }
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "iopath serve never listened");
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Server::Iopath(served))
    }

    /// SPDK's nvmf_tgt (`spdk`/bin, one reactor on CPU 1, as the harness
    /// runs it) with the VFIOUSER transport and N subsystems, each a null
    /// bdev of the namespace's size and a listener at DIR/sK/cntrl.
    fn nvmf(spdk: &Path, o: &NvmeOptions, n: usize, dir: &Path) -> anyhow::Result<Server> {
        let rpc = spdk.join("bin/rpc.py");
        let sock = dir.join("spdk.sock");
        let log = std::fs::File::create(dir.join("nvmf_tgt.log"))?;
        let child = Command::new(spdk.join("bin/nvmf_tgt"))
            .args(["-m", "0x2", "-u", "--disable-cpumask-locks", "-s", "64", "-r"])
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut tgt = Served(child);
        let t0 = Instant::now();
        while !sock.exists() {
            if let Some(s) = tgt.0.try_wait()? {
                anyhow::bail!("nvmf_tgt ended ({s}): see {}", dir.join("nvmf_tgt.log").display());
            }
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "nvmf_tgt made no RPC socket");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mb = (namespace_size(&o.backend, o.size_mb) >> 20).to_string();
        let bs = o.lba.to_string();
        rpc_call(&rpc, dir, &["framework_wait_init"])?;
        rpc_call(&rpc, dir, &["nvmf_create_transport", "-t", "VFIOUSER"])?;
        for k in 0..n {
            let (ns, nqn) = (format!("Ns{k}"), format!("nqn.2026-11.io.iopath:ctrls{k}"));
            let l = dir.join(format!("s{k}"));
            std::fs::create_dir_all(&l)?;
            rpc_call(&rpc, dir, &["bdev_null_create", &ns, &mb, &bs])?;
            rpc_call(
                &rpc,
                dir,
                &["nvmf_create_subsystem", &nqn, "-a", "-s", &format!("IOPATHCTRLS{k:05}"), "-m", "1"],
            )?;
            rpc_call(&rpc, dir, &["nvmf_subsystem_add_ns", &nqn, &ns])?;
            let a = l.to_string_lossy().to_string();
            rpc_call(&rpc, dir, &["nvmf_subsystem_add_listener", &nqn, "-t", "VFIOUSER", "-a", &a, "-s", "0"])?;
        }
        Ok(Server::Nvmf { tgt, rpc })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Server::Nvmf { tgt, .. } = self {
            // SIGINT: nvmf_tgt shuts down and frees its hugepages; then its
            // hugetlbfs files, which DPDK leaves (harness/spdk/README.md).
            let pid = tgt.0.id();
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) && matches!(tgt.0.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = tgt.0.kill();
            let _ = tgt.0.wait();
            if let Ok(d) = std::fs::read_dir("/dev/hugepages") {
                let mine = format!("spdk_pid{pid}map_");
                for e in d.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&mine) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
    }
}

/// rpc.py against nvmf_tgt's socket in `dir` (bounded by its own timeout); its stdout.
fn rpc_call(rpc: &Path, dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(rpc).arg("-s").arg(dir.join("spdk.sock")).args(["-t", "30"]).args(args).output()?;
    anyhow::ensure!(out.status.success(), "rpc.py {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

impl CtrlResult {
    pub fn table(&self) -> String {
        let mut s = String::from(
            "controllers: N guests at once, N controllers in one device process (iopath serve --controllers N \
             --pollers M, or nvmf_tgt with N subsystems); CPU over each guest's whole life\n",
        );
        let _ = writeln!(
            s,
            "{:<9} {:<22} {:>3} {:>2} {:>7} {:>11} {:>15} {:>19} {:>8} {:>8} {:>9} {:>9} {:>7}",
            "target",
            "job",
            "N",
            "M",
            "mode",
            "total IOPS",
            "wall IOPS (s)",
            "per guest min..max",
            "dev CPU",
            "VMM CPU",
            "dev us/IO",
            "all us/IO",
            "routing"
        );
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{:<9} {:<22} {:>3} {:>2} {:>7} {:>11.0} {:>15} {:>19} {:>7.2}s {:>7.2}s {:>9.2} {:>9.2} {:>7}",
                r.target,
                r.job,
                r.controllers,
                r.pool_pollers,
                r.doorbell,
                r.iops,
                format!("{:.0} ({:.1})", r.wall_iops, r.wall_s),
                format!("{:.0}..{:.0}", r.iops_min, r.iops_max),
                r.device_cpu_s,
                r.vmm_cpu_s,
                r.device_us_per_io,
                r.total_us_per_io,
                if r.routing_ok { "ok" } else { "WRONG" },
            );
        }
        for r in self.rows.iter().filter(|r| !r.routing_ok) {
            let _ = writeln!(s, "routing {} x{}: {}", r.target, r.controllers, r.routing);
        }
        for e in &self.errors {
            let _ = writeln!(s, "error: {e}");
        }
        s
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// Failed runs and wrong routing.
    pub fn failures(&self) -> Vec<String> {
        let mut v = self.errors.clone();
        v.extend(self.rows.iter().filter(|r| !r.routing_ok).map(|r| format!("x{}: {}", r.controllers, r.routing)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_bounded() {
        assert_eq!(parse_counts("1,2,4,8,16").unwrap(), vec![1, 2, 4, 8, 16]);
        assert!(parse_counts("0").is_err());
        assert!(parse_counts("65").is_err());
        assert!(parse_counts("x").is_err());
    }

    #[test]
    fn cpu_of_this_process_reads() {
        let me = proc_cpu_s(std::process::id()).unwrap();
        assert!(me >= 0.0 && self_cpu_s() >= 0.0);
    }
}
