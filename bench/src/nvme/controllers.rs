//! `bench nvme --controllers N[,N..]`: N iopath guests at once, each with
//! its own controller, all N controllers in ONE device process (`iopath
//! serve nvme,... --controllers N --pollers M --socket DIR/c{}.sock`, M =
//! `--pool-pollers`), for each N given; a row per (job, N).
//!
//! What a row holds: the guests' IOPS summed (each guest's own timed
//! window; the windows overlap, they start together), the spread between
//! guests, and CPU time per I/O: the device process's (utime + stime from
//! /proc/PID/stat, from the moment every socket listens to the moment every
//! guest has left) and this process's (getrusage: the N VMMs' vCPU and
//! device threads, from the guests' start to their end; the bench's own
//! thread sleeps meanwhile). Both CPU figures cover each guest's whole life,
//! its boot and driver setup included, not the timed window only: with
//! short runs they are an upper bound. Routing: each controller's counters
//! line (`"controller": K`) counts exactly its guest's I/Os (io.commands).
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
    pub job: String,
    pub controllers: usize,
    pub pool_pollers: usize,
    pub doorbell: String,
    /// The guests' I/Os and IOPS, summed.
    pub ios: u64,
    pub iops: f64,
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
    // SAFETY: getrusage fills the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// Runs every job at every count in `counts`, a pool of `pool` pollers.
pub fn run_controllers(o: &NvmeOptions, counts: &[usize], pool: usize) -> anyhow::Result<CtrlResult> {
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
            match one(o, j, n, pool, db, tsc_khz, &progs) {
                Ok(r) => rows.push(r),
                Err(e) => errors.push(format!("{} x{n}: {e:#}", j.label())),
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

fn one(
    o: &NvmeOptions,
    j: &Job,
    n: usize,
    pool: usize,
    db: DoorbellMode,
    tsc_khz: u64,
    progs: &Programs,
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
    let r = served_run(o, j, n, pool, &model, &dir, tsc_khz, progs);
    let _ = std::fs::remove_dir_all(&dir);
    let mut r = r?;
    r.doorbell = db.to_string();
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
fn served_run(
    o: &NvmeOptions,
    j: &Job,
    n: usize,
    pool: usize,
    model: &DeviceConfig,
    dir: &Path,
    tsc_khz: u64,
    progs: &Programs,
) -> anyhow::Result<CtrlRow> {
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
    let pid = served.0.id();
    let t0 = Instant::now();
    let banner = if n == 1 { " on ".to_string() } else { "controller ".to_string() };
    while std::fs::read_to_string(&err).unwrap_or_default().matches(&banner).count() < n {
        if let Some(s) = served.0.try_wait()? {
            anyhow::bail!("iopath serve ended ({s}): {}", std::fs::read_to_string(&err).unwrap_or_default());
        }
        anyhow::ensure!(t0.elapsed() < Duration::from_secs(30), "iopath serve never listened");
        std::thread::sleep(Duration::from_millis(10));
    }
    let transport = iopath_protocols::transport("vfio-user")?;
    let socket = |k: usize| if n == 1 { dir.join("c{}.sock") } else { dir.join(format!("c{k}.sock")) };
    let line = format!("{} dbbuf=1", cmdline(j, o, tsc_khz));
    let (dev0, me0) = (proc_cpu_s(pid)?, self_cpu_s());
    let results: Vec<anyhow::Result<super::NvmeRun>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|k| {
                let (line, spec) =
                    (line.clone(), DeviceSpec::remote(model.clone(), transport, Endpoint::Socket(socket(k))));
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
    let me1 = self_cpu_s();
    // Each controller's counters line, printed as its guest leaves.
    let t0 = Instant::now();
    let counters = loop {
        let s = std::fs::read_to_string(&out).unwrap_or_default();
        let v: Vec<serde_json::Value> =
            s.lines().filter(|l| l.contains("\"disconnected\"")).filter_map(|l| serde_json::from_str(l).ok()).collect();
        if v.len() >= n || t0.elapsed() > Duration::from_secs(10) {
            break v;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let dev1 = proc_cpu_s(pid)?;
    let runs = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let ios: u64 = runs.iter().map(|r| r.io.ios).sum();
    let iops: f64 = runs.iter().map(|r| r.io.iops).sum();
    let each = |f: fn(f64, f64) -> f64, init| runs.iter().map(|r| r.io.iops).fold(init, f);
    let (device_cpu_s, vmm_cpu_s) = (dev1 - dev0, me1 - me0);
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
        job: j.label(),
        controllers: n,
        pool_pollers: pool,
        doorbell: String::new(),
        ios,
        iops,
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

impl CtrlResult {
    pub fn table(&self) -> String {
        let mut s = String::from(
            "controllers: N guests, N controllers in one `iopath serve --controllers N --pollers M` (CPU over each guest's life)\n",
        );
        let _ = writeln!(
            s,
            "{:<28} {:>3} {:>2} {:>6} {:>11} {:>19} {:>8} {:>8} {:>9} {:>9} {:>7}",
            "job",
            "N",
            "M",
            "mode",
            "total IOPS",
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
                "{:<28} {:>3} {:>2} {:>6} {:>11.0} {:>19} {:>7.2}s {:>7.2}s {:>9.2} {:>9.2} {:>7}",
                r.job,
                r.controllers,
                r.pool_pollers,
                r.doorbell,
                r.iops,
                format!("{:.0}..{:.0}", r.iops_min, r.iops_max),
                r.device_cpu_s,
                r.vmm_cpu_s,
                r.device_us_per_io,
                r.total_us_per_io,
                if r.routing_ok { "ok" } else { "WRONG" },
            );
        }
        for r in self.rows.iter().filter(|r| !r.routing_ok) {
            let _ = writeln!(s, "routing x{}: {}", r.controllers, r.routing);
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
