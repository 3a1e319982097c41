//! The two targets `bench spdk` runs perf against, each started once per
//! controller count N: `iopath serve nvme,backend=null` (no doorbell option:
//! the default mode) over vfio-user, with `--controllers N` (a socket each)
//! when N > 1, and SPDK's `nvmf_tgt` with the VFIOUSER transport and N
//! subsystems, each a null bdev of the same size and block size and a
//! listener of its own, configured with rpc.py. Each reports what its
//! devices did, so every perf run is checked against it.

use super::proc::{run_bounded, Proc};
use super::SpdkOptions;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// The subsystem NQNs and serials the targets are given.
pub const NQN_IOPATH: &str = "nqn.2026-11.io.iopath:bench-spdk";
pub const NQN_NVMF: &str = "nqn.2026-11.io.iopath:bench-spdk-nvmf";
const SERIAL_IOPATH: &str = "IOPATH-BENCH-SPDK";
const SERIAL_NVMF: &str = "SPDK-BENCH-NVMF";
/// nvmf_tgt's reserved hugepage memory (`-s`, MiB); it grows on demand.
const TGT_MEM_MB: u32 = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    #[serde(rename = "iopath")]
    Iopath,
    #[serde(rename = "nvmf_tgt")]
    Nvmf,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Iopath => "iopath",
            Kind::Nvmf => "nvmf_tgt",
        }
    }
}

/// The device's I/O counters (iopath: its report when a client leaves;
/// nvmf_tgt: `bdev_get_iostat` of the null bdev).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Io {
    pub commands: u64,
    pub reads: u64,
    pub writes: u64,
    pub errors: u64,
    /// Times iopath's poller went to sleep (`adaptive.sleeps`; 0 for a
    /// mode that does not sleep and for nvmf_tgt, whose reactor polls).
    pub sleeps: u64,
}

impl Io {
    fn plus(self, o: Io) -> Io {
        Io {
            commands: self.commands + o.commands,
            reads: self.reads + o.reads,
            writes: self.writes + o.writes,
            errors: self.errors + o.errors,
            sleeps: self.sleeps + o.sleeps,
        }
    }

    /// What happened since `before`; counters that went back (a device reset
    /// between clients) count from zero.
    fn since(self, before: Io) -> Io {
        if self.commands < before.commands
            || self.reads < before.reads
            || self.writes < before.writes
            || self.sleeps < before.sleeps
        {
            return self;
        }
        Io {
            commands: self.commands - before.commands,
            reads: self.reads - before.reads,
            writes: self.writes - before.writes,
            errors: self.errors.saturating_sub(before.errors),
            sleeps: self.sleeps - before.sleeps,
        }
    }
}

/// A running target serving its controllers, each on `TRADDR/cntrl`.
pub struct Server {
    pub kind: Kind,
    proc: Proc,
    /// Each controller's directory (SPDK's traddr), in order.
    ctrls: Vec<PathBuf>,
    rpc_sock: PathBuf,
    rpc_py: PathBuf,
    dir: PathBuf,
    reports: Option<Receiver<String>>,
    last: Io,
}

impl Server {
    /// `iopath serve nvme,backend=null,...` (no doorbell option unless `--doorbell`) on
    /// `dir/iopath/cntrl`, or with `n` controllers on `dir/iopath/K/cntrl` (K from 0), on CPU `cpu`.
    pub fn iopath(
        o: &SpdkOptions,
        n: u32,
        iopath: &Path,
        rpc_py: &Path,
        dir: &Path,
        cpu: usize,
    ) -> anyhow::Result<Server> {
        let base = dir.join("iopath");
        let ctrls = ctrl_dirs(&base, n)?;
        let mut dev =
            format!("nvme,backend=null,size_mb={},lba={},serial={SERIAL_IOPATH},nqn={NQN_IOPATH}", o.size_mb, o.lba);
        if let Some(db) = o.doorbell {
            dev.push_str(&format!(",doorbell={db}"));
        }
        let mut cmd = Command::new(iopath);
        cmd.args(["serve", &dev, "--transport", "vfio-user", "--socket"]);
        if n == 1 {
            cmd.arg(ctrls[0].join("cntrl"));
        } else {
            cmd.arg(base.join("{}").join("cntrl")).args(["--controllers", &n.to_string()]);
        }
        let mut proc = Proc::spawn("iopath-serve", &mut cmd, dir, false, true, Some(cpu))?;
        let (tx, rx) = channel();
        let out = proc.child.stdout.take().ok_or_else(|| anyhow::anyhow!("iopath serve: no stdout pipe"))?;
        std::thread::Builder::new().name("bench-serve-out".into()).spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if l.contains("\"disconnected\"") && tx.send(l).is_err() {
                    return;
                }
            }
        })?;
        let t0 = Instant::now();
        while let Some(c) = ctrls.iter().find(|c| !c.join("cntrl").exists()) {
            if proc.wait_for(Duration::from_millis(20))?.is_some() || t0.elapsed() > Duration::from_secs(10) {
                anyhow::bail!("iopath serve {dev} made no socket at {}/cntrl:\n{}", c.display(), proc.log());
            }
        }
        Ok(Server {
            kind: Kind::Iopath,
            proc,
            ctrls,
            rpc_sock: PathBuf::new(),
            rpc_py: rpc_py.into(),
            dir: dir.into(),
            reports: Some(rx),
            last: Io::default(),
        })
    }

    /// nvmf_tgt on core `cpu` (`-m`), its VFIOUSER listener on `dir/nvmf/cntrl`, or with `n`
    /// subsystems (bdevs NsK, NQNs ending in -K) their listeners on `dir/nvmf/K/cntrl`.
    pub fn nvmf(
        o: &SpdkOptions,
        n: u32,
        nvmf_tgt: &Path,
        rpc_py: &Path,
        dir: &Path,
        cpu: usize,
    ) -> anyhow::Result<Server> {
        let ctrls = ctrl_dirs(&dir.join("nvmf"), n)?;
        let rpc_sock = dir.join("spdk.sock");
        let mut cmd = Command::new(nvmf_tgt);
        cmd.args(["-m", &format!("{:#x}", 1u64 << cpu), "-u", "-s", &TGT_MEM_MB.to_string(), "-r"]).arg(&rpc_sock);
        let proc = Proc::spawn("nvmf_tgt", &mut cmd, dir, true, false, None)?;
        let mut s = Server {
            kind: Kind::Nvmf,
            proc,
            ctrls,
            rpc_sock,
            rpc_py: rpc_py.into(),
            dir: dir.into(),
            reports: None,
            last: Io::default(),
        };
        let t0 = Instant::now();
        while !s.rpc_sock.exists() {
            if s.proc.wait_for(Duration::from_millis(50))?.is_some() || t0.elapsed() > Duration::from_secs(30) {
                anyhow::bail!("nvmf_tgt made no RPC socket at {}:\n{}", s.rpc_sock.display(), s.proc.log());
            }
        }
        let (mb, bs) = (o.size_mb.to_string(), o.lba.to_string());
        s.rpc(&["framework_wait_init"])?;
        s.rpc(&["nvmf_create_transport", "-t", "VFIOUSER"])?;
        for k in 0..n as usize {
            let (bdev, nqn, serial) = (format!("Ns{k}"), s.nqn(k), format!("{SERIAL_NVMF}-{k}"));
            let traddr = s.ctrls[k].to_string_lossy().into_owned();
            for args in [
                &["bdev_null_create", &bdev, &mb, &bs][..],
                &["nvmf_create_subsystem", &nqn, "-a", "-s", &serial, "-d", "SPDK bdev Controller", "-m", "1"],
                &["nvmf_subsystem_add_ns", &nqn, &bdev],
                &["nvmf_subsystem_add_listener", &nqn, "-t", "VFIOUSER", "-a", &traddr, "-s", "0"],
            ] {
                s.rpc(args)?;
            }
            let sock = s.ctrls[k].join("cntrl");
            anyhow::ensure!(sock.exists(), "nvmf_tgt's listener made no {}", sock.display());
        }
        s.last = s.nvmf_io()?; // the bdev's examine reads at creation
        Ok(s)
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    /// How many controllers it serves.
    pub fn controllers(&self) -> usize {
        self.ctrls.len()
    }

    /// Controller `k`'s subsystem NQN (iopath's controllers share theirs: one device option).
    fn nqn(&self, k: usize) -> String {
        match (self.kind, self.ctrls.len()) {
            (Kind::Iopath, _) => NQN_IOPATH.into(),
            (Kind::Nvmf, 1) => NQN_NVMF.into(),
            (Kind::Nvmf, _) => format!("{NQN_NVMF}-{k}"),
        }
    }

    /// SPDK's transport IDs of its controllers, in order.
    pub fn trids(&self) -> Vec<String> {
        (0..self.ctrls.len())
            .map(|k| format!("trtype:VFIOUSER traddr:{} subnqn:{}", self.ctrls[k].display(), self.nqn(k)))
            .collect()
    }

    /// The process's CPU time so far, in ns (None once it is gone).
    pub fn cpu_ns(&self) -> Option<u64> {
        crate::cpu::process_cpu_ns(self.pid())
    }

    /// rpc.py against nvmf_tgt, bounded; its stdout.
    fn rpc(&mut self, args: &[&str]) -> anyhow::Result<String> {
        let mut cmd = Command::new(&self.rpc_py);
        cmd.arg("-s").arg(&self.rpc_sock).args(["-t", "20"]).args(args);
        let r = run_bounded("rpc.py", &mut cmd, &self.dir, Duration::from_secs(30), None)?;
        if !r.status.success() {
            anyhow::bail!("rpc.py {} failed ({}):\n{}\n{}", args.join(" "), r.status, r.log, self.proc.log());
        }
        Ok(r.stdout)
    }

    /// The sum over its bdevs.
    fn nvmf_io(&mut self) -> anyhow::Result<Io> {
        let out = self.rpc(&["bdev_get_iostat"])?;
        parse_iostat(&out, self.ctrls.len())
    }

    /// What the devices did since the last call: iopath's reports of the
    /// client that just left each controller (within `wait`), the sum; nvmf_tgt's
    /// bdev counters now.
    pub fn io_delta(&mut self, wait: Duration) -> anyhow::Result<Io> {
        let Some(rx) = &self.reports else {
            let now = self.nvmf_io()?;
            let d = now.since(self.last);
            self.last = now;
            return Ok(d);
        };
        // Each controller is its own device: its report holds its counters since it started.
        let t0 = Instant::now();
        let mut sum = Io::default();
        for got in 0..self.ctrls.len() {
            let line = loop {
                super::proc::check()?;
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(l) => break l,
                    Err(RecvTimeoutError::Timeout) if t0.elapsed() < wait => {}
                    Err(_) => anyhow::bail!(
                        "iopath serve printed {got} of its {} controllers' counters within {wait:?} of its client \
                         leaving:\n{}",
                        self.ctrls.len(),
                        self.proc.log()
                    ),
                }
            };
            sum = sum.plus(parse_report(&line)?);
        }
        let d = sum.since(self.last);
        self.last = sum;
        Ok(d)
    }

    /// Fails if the server process has ended.
    pub fn alive(&mut self) -> anyhow::Result<()> {
        if !self.proc.running() {
            anyhow::bail!("{} ended:\n{}", self.kind.name(), self.proc.log());
        }
        Ok(())
    }

    /// Stops it: nvmf_tgt shuts down on SIGINT, iopath serve on SIGTERM; SIGKILL after a grace.
    pub fn stop(&mut self) {
        let sig = if self.kind == Kind::Nvmf { libc::SIGINT } else { libc::SIGTERM };
        self.proc.stop(sig, Duration::from_secs(10));
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The controllers' directories under `base`: `base` itself for one, else `base/K`, made.
fn ctrl_dirs(base: &Path, n: u32) -> anyhow::Result<Vec<PathBuf>> {
    anyhow::ensure!(n >= 1, "no controller");
    let dirs: Vec<PathBuf> =
        if n == 1 { vec![base.into()] } else { (0..n).map(|k| base.join(k.to_string())).collect() };
    for d in &dirs {
        std::fs::create_dir_all(d)?;
    }
    Ok(dirs)
}

/// iopath's disconnect report: its NVMe counters.
fn parse_report(line: &str) -> anyhow::Result<Io> {
    let c = iopath_protocols::process::parse_report(line)
        .ok_or_else(|| anyhow::anyhow!("iopath serve's report is not a counters line: {line}"))?;
    let n = |k: &str| {
        c.iter().find(|c| c.name == k).map(|c| c.value).ok_or_else(|| anyhow::anyhow!("no counter {k} in {line}"))
    };
    let sleeps = n("adaptive.sleeps").unwrap_or(0);
    Ok(Io { commands: n("io.commands")?, reads: n("io.reads")?, writes: n("io.writes")?, errors: n("errors")?, sleeps })
}

/// `bdev_get_iostat`: reads, writes and unmaps, and the I/O error counts, summed over the
/// bdevs Ns0 .. Ns(n-1), each of which must be there.
fn parse_iostat(out: &str, n: usize) -> anyhow::Result<Io> {
    let v: serde_json::Value =
        serde_json::from_str(out).map_err(|e| anyhow::anyhow!("bdev_get_iostat printed no JSON ({e}): {out}"))?;
    let bdevs = v["bdevs"].as_array().cloned().unwrap_or_default();
    let mut sum = Io::default();
    for k in 0..n {
        let name = format!("Ns{k}");
        let b = bdevs
            .iter()
            .find(|b| b["name"] == name.as_str())
            .ok_or_else(|| anyhow::anyhow!("no bdev {name} in bdev_get_iostat: {out}"))?;
        let c = |f: &str| b[f].as_u64().ok_or_else(|| anyhow::anyhow!("no {f} of {name} in bdev_get_iostat: {out}"));
        let (reads, writes) = (c("num_read_ops")?, c("num_write_ops")?);
        let errors = b["io_error"].as_object().map_or(0, |m| m.values().filter_map(|x| x.as_u64()).sum());
        let io = Io { commands: reads + writes + c("num_unmap_ops")?, reads, writes, errors, sleeps: 0 };
        sum = sum.plus(io);
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counters_of_both_targets_parse_and_deltas_survive_a_reset() {
        let line = r#"{"event":"disconnected","transport":"vfio-user","device":"nvme","counters":{"io.commands":120,"io.reads":120,"io.writes":0,"errors":0,"admin.commands":30,"adaptive.sleeps":7}}"#;
        assert_eq!(parse_report(line).unwrap(), Io { commands: 120, reads: 120, writes: 0, errors: 0, sleeps: 7 });
        assert!(parse_report(r#"{"event":"connected"}"#).is_err());
        assert!(parse_report(r#"{"event":"disconnected","counters":{"io.reads":1}}"#).is_err());
        let st = r#"{"tick_rate": 1, "bdevs": [{"name": "Ns0", "num_read_ops": 57893, "num_write_ops": 2,
                   "num_unmap_ops": 1, "io_error": {"read": 3}}]}"#;
        assert_eq!(parse_iostat(st, 1).unwrap(), Io { commands: 57896, reads: 57893, writes: 2, errors: 3, sleeps: 0 });
        assert!(parse_iostat("not json", 1).is_err());
        assert!(parse_iostat(r#"{"bdevs": []}"#, 1).is_err());
        let two = r#"{"bdevs": [{"name": "Ns1", "num_read_ops": 10, "num_write_ops": 0, "num_unmap_ops": 0},
                     {"name": "Other", "num_read_ops": 99, "num_write_ops": 0, "num_unmap_ops": 0},
                     {"name": "Ns0", "num_read_ops": 5, "num_write_ops": 1, "num_unmap_ops": 0}]}"#;
        assert_eq!(parse_iostat(two, 2).unwrap(), Io { commands: 16, reads: 15, writes: 1, errors: 0, sleeps: 0 });
        assert!(parse_iostat(two, 3).is_err(), "Ns2 is missing");
        let a = Io { commands: 10, reads: 10, writes: 0, errors: 0, sleeps: 2 };
        let b = Io { commands: 25, reads: 25, writes: 0, errors: 1, sleeps: 5 };
        assert_eq!(b.since(a), Io { commands: 15, reads: 15, writes: 0, errors: 1, sleeps: 3 });
        assert_eq!(a.since(b), a, "counters that went back count from zero");
    }
}
