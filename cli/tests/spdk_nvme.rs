//! SPDK's stock NVMe driver (v25.09's `spdk_nvme_identify`, `spdk_nvme_perf`, `bdevperf`, and
//! `qpair-cycle`, a small client of ours linked to SPDK's driver) against iopath's NVMe
//! controller served over vfio-user (`iopath serve nvme,... --transport vfio-user --socket
//! DIR/cntrl`), in the default doorbell mode and with `doorbell=bar`, on the null, ram and file
//! backends; every such test also runs against SPDK's own `nvmf_tgt` VFIOUSER target, the
//! control, where it must pass. Last, iopath's VMM and guest driver against `nvmf_tgt`.
//!
//! The peers come from `harness/spdk/build.sh` (built once from shared/peers, cached by hash);
//! these tests build them if missing and fail loudly if they cannot, and make hugepages
//! available with `harness/spdk/hugepages.sh`. They run one at a time: every SPDK process polls
//! a core, and the host has two. Every wait is bounded; every child is killed and reaped by a
//! guard, with the hugepage files of an SPDK process killed by a signal.

mod common;
use common::TempDir;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// One target and its clients at a time.
static ONE: Mutex<()> = Mutex::new(());

/// The namespace every target serves: 64 MiB in 512-byte blocks.
const NS_MB: u64 = 64;
const BLOCK: u64 = 512;
const NS_BLOCKS: u64 = NS_MB * 1024 * 1024 / BLOCK;
/// Hugepage memory (MiB, `-s`) DPDK reserves at the start of each SPDK client tool and of
/// `nvmf_tgt`; more is allocated as needed (harness/spdk/README.md: what each holds).
const TOOL_MEM_MB: u32 = 16;
const TGT_MEM_MB: u32 = 16;
/// 2 MiB pages free for nvmf_tgt (about 220 with its pools and a 64 MiB malloc bdev) and a
/// client (about 10) at a time, with room.
const HUGEPAGES: u32 = 300;
/// A bound on any one SPDK tool run beyond its own run time.
const TOOL_SLACK: Duration = Duration::from_secs(60);

const NQN_CONTROL: &str = "nqn.2026-11.io.iopath:spdk-control";
const SERIAL_CONTROL: &str = "SPDKCONTROL000000001";
const MODEL_CONTROL: &str = "SPDK bdev Controller";
const UUID_CONTROL: &str = "6b1f6c1e-7d0a-4c55-9e3b-2f4a1d5c8e90";
/// The identity `iopath serve` is given (`serial=`, `nqn=`), which SPDK must read back.
const NQN_IOPATH: &str = "nqn.2026-11.io.iopath:spdk-test";
const SERIAL_IOPATH: &str = "IOPATH-SPDK-TEST-01";

// ---------------------------------------------------------------------------------------------
// The peers

/// The install directory of harness/spdk/build.sh (built on first use), with hugepages ready.
fn peers() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/spdk");
        let out = Command::new("bash").arg(harness.join("build.sh")).output().expect("run harness/spdk/build.sh");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "harness/spdk/build.sh could not build SPDK v25.09 and libvfio-user (these tests need them; \
             it needs root, the archives in shared/peers and Debian's packages): {}\n{err}",
            out.status
        );
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(dir.join("bin/nvmf_tgt").exists(), "build.sh printed {dir:?}, which has no bin/nvmf_tgt:\n{err}");
        let hp = Command::new("bash")
            .arg(harness.join("hugepages.sh"))
            .arg(HUGEPAGES.to_string())
            .output()
            .expect("run harness/spdk/hugepages.sh");
        assert!(
            hp.status.success(),
            "harness/spdk/hugepages.sh {HUGEPAGES} failed: {}",
            String::from_utf8_lossy(&hp.stderr)
        );
        dir
    })
}

fn tool(name: &str) -> PathBuf {
    peers().join("bin").join(name)
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

// ---------------------------------------------------------------------------------------------
// Processes

/// A child process with its stdout and stderr in files (stdout may be taken as a pipe instead);
/// killed and reaped on drop. For an SPDK process (DPDK's `--file-prefix spdk_pid<PID>`), its
/// hugepage files and runtime directory are removed once it is reaped.
struct Proc {
    name: String,
    child: Child,
    out: PathBuf,
    err: PathBuf,
    spdk: bool,
    status: Option<ExitStatus>,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command, dir: &Path, spdk: bool, pipe_stdout: bool) -> Proc {
        let n = unique();
        let out = dir.join(format!("{name}-{n}.out"));
        let err = dir.join(format!("{name}-{n}.err"));
        let stdout = if pipe_stdout { Stdio::piped() } else { File::create(&out).unwrap().into() };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(File::create(&err).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({:?}): {e}", cmd.get_program()));
        Proc { name: name.into(), child, out, err, spdk, status: None }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits up to `d` for the process to exit.
    fn wait_for(&mut self, d: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + d;
        loop {
            if let Some(s) = self.status {
                return Some(s);
            }
            if let Ok(Some(s)) = self.child.try_wait() {
                self.status = Some(s);
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn running(&mut self) -> bool {
        self.wait_for(Duration::ZERO).is_none()
    }

    /// Sends `sig`, then waits up to `grace` and kills it (SIGKILL) if still there.
    fn stop(&mut self, sig: i32, grace: Duration) -> ExitStatus {
        if self.running() {
            // SAFETY: kill(2) on our own child, which is not yet reaped.
            unsafe { libc::kill(self.pid(), sig) };
            if self.wait_for(grace).is_none() {
                let _ = self.child.kill();
                self.status = self.child.wait().ok();
            }
        }
        self.cleanup_hugepages();
        self.status.expect("reaped")
    }

    /// Removes what DPDK leaves of an SPDK process once it is gone: its hugepage files (which
    /// hold pages of the host's pool; with `-g` DPDK does not unlink them, even on a clean exit)
    /// and its runtime directory.
    fn cleanup_hugepages(&self) {
        if !self.spdk || self.status.is_none() {
            return;
        }
        let prefix = format!("spdk_pid{}", self.pid());
        if let Ok(rd) = std::fs::read_dir("/dev/hugepages") {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with(&format!("{prefix}map_")) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/{prefix}"));
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// Its output, for a failure message (the last 60 lines of each).
    fn log(&self) -> String {
        let tail =
            |s: String| s.lines().rev().take(60).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
        format!(
            "--- {} stdout ---\n{}\n--- {} stderr ---\n{}",
            self.name,
            tail(self.stdout()),
            self.name,
            tail(self.stderr())
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.running() {
            let _ = self.child.kill();
            self.status = self.child.wait().ok();
        }
        self.cleanup_hugepages();
    }
}

/// The output of a finished tool run.
struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    log: String,
}

/// Runs `cmd` to its end within `limit`; a run that takes longer is killed and fails the test.
fn run_bounded(name: &str, cmd: &mut Command, dir: &Path, limit: Duration, ctx: &dyn Fn() -> String) -> Ran {
    let mut p = Proc::spawn(name, cmd, dir, true, false);
    let status = p.wait_for(limit).unwrap_or_else(|| {
        p.stop(libc::SIGKILL, Duration::from_secs(5));
        panic!("{name} did not finish within {limit:?} (killed):\n{}\n{}", p.log(), ctx())
    });
    Ran { status, stdout: p.stdout(), stderr: p.stderr(), log: p.log() }
}

// ---------------------------------------------------------------------------------------------
// Targets

#[derive(Clone, Copy, Debug, PartialEq)]
enum Backend {
    Null,
    Ram,
    File,
}

/// Where the controller runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Place {
    /// SPDK's nvmf_tgt with the VFIOUSER transport: the control.
    Nvmf,
    /// `iopath serve nvme` with no doorbell option (the default mode).
    IopathDefault,
    /// `iopath serve nvme,doorbell=bar`.
    IopathBar,
    /// `iopath serve nvme,doorbell=MODE`.
    IopathMode(&'static str),
}

/// The device's I/O counters at one moment (iopath: its report; nvmf_tgt: bdev_get_iostat).
#[derive(Clone, Copy, Debug, Default)]
struct Io {
    commands: u64,
    reads: u64,
    writes: u64,
    errors: u64,
    admin: u64,
}

impl Io {
    fn since(self, before: Io) -> Io {
        Io {
            commands: self.commands - before.commands,
            reads: self.reads - before.reads,
            writes: self.writes - before.writes,
            errors: self.errors - before.errors,
            admin: self.admin - before.admin,
        }
    }
}

/// What a client must find: the identity the target was configured with.
struct Expect {
    vid: &'static str,
    serial: &'static str,
    model: &'static str,
    /// A UUID the namespace was given, when the test chose it.
    uuid: Option<&'static str>,
}

/// A controller serving on `DIR/cntrl`: nvmf_tgt or `iopath serve`, stopped on drop.
struct Target {
    place: Place,
    backend: Backend,
    server: Option<Proc>,
    /// iopath's report lines (one per client that left).
    reports: Option<Receiver<String>>,
    rpc_sock: PathBuf,
    last: Io,
    /// More device options for iopath (`,inject=...`); with any, iopath also serves its
    /// control socket ([`Target::control`]).
    more: &'static str,
    dir: TempDir,
}

impl Target {
    fn start(place: Place, backend: Backend) -> Target {
        Target::start_with(place, backend, "")
    }

    /// iopath's controller with the device options `more` besides the usual ones, and its
    /// control socket.
    fn start_with(place: Place, backend: Backend, more: &'static str) -> Target {
        let dir = TempDir::new(&format!("spdk-{place:?}-{backend:?}").to_lowercase());
        std::fs::create_dir_all(dir.0.join("ctrl")).unwrap();
        let mut t = Target {
            place,
            backend,
            server: None,
            reports: None,
            rpc_sock: dir.0.join("spdk.sock"),
            last: Io::default(),
            more,
            dir,
        };
        match place {
            Place::Nvmf => t.start_nvmf(),
            _ => t.start_iopath(),
        }
        if place == Place::Nvmf {
            t.last = t.nvmf_io(); // the bdev's own examine reads at creation
        }
        t
    }

    fn label(&self) -> String {
        format!("{:?}/{:?}", self.place, self.backend)
    }

    fn traddr(&self) -> PathBuf {
        self.dir.0.join("ctrl")
    }

    fn nqn(&self) -> &'static str {
        if self.place == Place::Nvmf {
            NQN_CONTROL
        } else {
            NQN_IOPATH
        }
    }

    /// SPDK's transport ID of this controller.
    fn trid(&self) -> String {
        format!("trtype:VFIOUSER traddr:{} subnqn:{}", self.traddr().display(), self.nqn())
    }

    fn expect(&self) -> Expect {
        if self.place == Place::Nvmf {
            Expect { vid: "4e58", serial: SERIAL_CONTROL, model: MODEL_CONTROL, uuid: Some(UUID_CONTROL) }
        } else {
            Expect { vid: "1234", serial: SERIAL_IOPATH, model: "iopath NVMe controller", uuid: None }
        }
    }

    fn control(&self) -> PathBuf {
        self.dir.0.join("ctl.sock")
    }

    /// `iopath ctl stats` of iopath's control socket: (matched, fired) of each rule.
    fn rule_stats(&self) -> Vec<(u64, u64)> {
        let o =
            Command::new(env!("CARGO_BIN_EXE_iopath")).arg("ctl").arg(self.control()).arg("stats").output().unwrap();
        assert!(o.status.success(), "iopath ctl stats: {}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("ctl prints JSON");
        let rules = v["stats"]["rules"].as_array().cloned().unwrap_or_default();
        rules.iter().map(|r| (r["matched"].as_u64().unwrap(), r["fired"].as_u64().unwrap())).collect()
    }

    fn backing_file(&self) -> PathBuf {
        self.dir.0.join("ns.img")
    }

    fn start_iopath(&mut self) {
        let mut dev = format!("nvme,size_mb={NS_MB},serial={SERIAL_IOPATH},nqn={NQN_IOPATH}");
        match self.place {
            Place::IopathBar => dev.push_str(",doorbell=bar"),
            Place::IopathMode(m) => dev.push_str(&format!(",doorbell={m}")),
            _ => {}
        }
        dev.push_str(
            match self.backend {
                Backend::Null => ",backend=null".to_string(),
                Backend::Ram => ",backend=ram".to_string(),
                Backend::File => format!(",backend=file:{},create=on", self.backing_file().display()),
            }
            .as_str(),
        );
        dev.push_str(self.more);
        let sock = self.traddr().join("cntrl");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_iopath"));
        cmd.args(["serve", &dev, "--transport", "vfio-user", "--socket"]).arg(&sock);
        if !self.more.is_empty() {
            cmd.arg("--control").arg(self.control());
        }
        let mut p = Proc::spawn("iopath-serve", &mut cmd, &self.dir.0, false, true);
        let (tx, rx) = channel();
        let out = p.child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if l.contains("\"disconnected\"") && tx.send(l).is_err() {
                    return;
                }
            }
        });
        let t0 = Instant::now();
        while !sock.exists() {
            if !p.running() || t0.elapsed() > Duration::from_secs(10) {
                panic!("iopath serve {dev} made no socket at {}:\n{}", sock.display(), p.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.server = Some(p);
        self.reports = Some(rx);
    }

    fn start_nvmf(&mut self) {
        let mut cmd = Command::new(tool("nvmf_tgt"));
        // No core lock: another SPDK application on this host (a bench, a user's) may hold core 1's.
        cmd.args(["-m", "0x2", "-u", "--disable-cpumask-locks", "-s", &TGT_MEM_MB.to_string(), "-r"])
            .arg(&self.rpc_sock);
        let p = Proc::spawn("nvmf_tgt", &mut cmd, &self.dir.0, true, false);
        self.server = Some(p);
        let t0 = Instant::now();
        while !self.rpc_sock.exists() {
            let p = self.server.as_mut().unwrap();
            if !p.running() || t0.elapsed() > Duration::from_secs(30) {
                panic!("nvmf_tgt made no RPC socket at {}:\n{}", self.rpc_sock.display(), p.log());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.rpc(&["framework_wait_init"]);
        self.rpc(&["nvmf_create_transport", "-t", "VFIOUSER"]);
        let mb = NS_MB.to_string();
        let bs = BLOCK.to_string();
        match self.backend {
            Backend::Null => self.rpc(&["bdev_null_create", "Ns0", &mb, &bs, "-u", UUID_CONTROL]),
            Backend::Ram => self.rpc(&["bdev_malloc_create", &mb, &bs, "-b", "Ns0", "-u", UUID_CONTROL]),
            Backend::File => {
                let f = self.backing_file();
                File::create(&f).unwrap().set_len(NS_MB << 20).unwrap();
                self.rpc(&["bdev_aio_create", f.to_str().unwrap(), "Ns0", &bs, "-u", UUID_CONTROL])
            }
        };
        let sub = ["nvmf_create_subsystem", NQN_CONTROL, "-a", "-s", SERIAL_CONTROL, "-d", MODEL_CONTROL, "-m", "1"];
        self.rpc(&sub);
        self.rpc(&["nvmf_subsystem_add_ns", NQN_CONTROL, "Ns0"]);
        let traddr = self.traddr();
        self.rpc(&[
            "nvmf_subsystem_add_listener",
            NQN_CONTROL,
            "-t",
            "VFIOUSER",
            "-a",
            traddr.to_str().unwrap(),
            "-s",
            "0",
        ]);
        let sock = traddr.join("cntrl");
        assert!(sock.exists(), "nvmf_tgt's listener made no {}", sock.display());
    }

    /// scripts/rpc.py against nvmf_tgt (bounded); its stdout.
    fn rpc(&self, args: &[&str]) -> String {
        let mut cmd = Command::new(tool("rpc.py"));
        cmd.arg("-s").arg(&self.rpc_sock).args(["-t", "20"]).args(args);
        let r = run_bounded("rpc.py", &mut cmd, &self.dir.0, Duration::from_secs(30), &|| self.server_log());
        assert!(r.status.success(), "rpc.py {args:?} failed ({}):\n{}\n{}", r.status, r.log, self.server_log());
        r.stdout
    }

    fn server_log(&self) -> String {
        self.server.as_ref().map(Proc::log).unwrap_or_default()
    }

    /// nvmf_tgt's namespace counters now (bdev_get_iostat of the bdev behind it).
    fn nvmf_io(&self) -> Io {
        let out = self.rpc(&["bdev_get_iostat", "-b", "Ns0"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("bdev_get_iostat prints JSON");
        let b = &v["bdevs"][0];
        let n = |k: &str| b[k].as_u64().unwrap_or_else(|| panic!("no {k} in bdev_get_iostat: {v}"));
        let (reads, writes) = (n("num_read_ops"), n("num_write_ops"));
        let errors = b["io_error"].as_object().map_or(0, |m| m.values().filter_map(|x| x.as_u64()).sum());
        Io { commands: reads + writes + n("num_unmap_ops"), reads, writes, errors, admin: 0 }
    }

    /// What the device did since the last call (or the start): for iopath the report of the
    /// client that just left.
    fn io_delta(&mut self) -> Io {
        let now = if self.place == Place::Nvmf {
            self.nvmf_io()
        } else {
            let line = self.reports.as_ref().unwrap().recv_timeout(Duration::from_secs(20)).unwrap_or_else(|_| {
                panic!(
                    "{}: iopath serve printed no counters within 20 s of its client leaving:\n{}",
                    self.label(),
                    self.server_log()
                )
            });
            let v: serde_json::Value = serde_json::from_str(&line).expect("iopath's report is JSON");
            let c = &v["counters"];
            let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("no counter {k} in {line}"));
            Io {
                commands: n("io.commands"),
                reads: n("io.reads"),
                writes: n("io.writes"),
                errors: n("errors"),
                admin: n("admin.commands"),
            }
        };
        let d = now.since(self.last);
        self.last = now;
        d
    }

    fn server_alive(&mut self) {
        let label = self.label();
        let p = self.server.as_mut().unwrap();
        assert!(p.running(), "{label}: the server died:\n{}", p.log());
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(mut p) = self.server.take() {
            // nvmf_tgt shuts down on SIGINT (and frees its hugepages); iopath serve is killed.
            let sig = if self.place == Place::Nvmf { libc::SIGINT } else { libc::SIGKILL };
            p.stop(sig, Duration::from_secs(10));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SPDK's tools and what they print

/// An SPDK tool against `t`, to its end within `secs` + TOOL_SLACK, whatever its exit status;
/// the target must outlive it.
fn try_spdk_tool(t: &mut Target, name: &str, args: &[String], secs: u64) -> Ran {
    let mut cmd = Command::new(tool(name));
    cmd.args(args);
    let r = run_bounded(name, &mut cmd, &t.dir.0, Duration::from_secs(secs) + TOOL_SLACK, &|| t.server_log());
    t.server_alive();
    r
}

/// As [`try_spdk_tool`], and it must succeed.
fn spdk_tool(t: &mut Target, name: &str, args: &[String], secs: u64) -> Ran {
    let label = t.label();
    let r = try_spdk_tool(t, name, args, secs);
    assert!(
        r.status.success(),
        "{label}: {name} {} failed ({}):\n{}\n{}",
        args.join(" "),
        r.status,
        r.log,
        t.server_log()
    );
    eprintln!("{label}: {name} {} ok", args.join(" "));
    r
}

/// The value after `key` on the first line that starts with it (spaces trimmed).
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().map(str::trim_start).find_map(|l| l.strip_prefix(key)).map(str::trim)
}

fn must<'a>(text: &'a str, key: &str, what: &str) -> &'a str {
    field(text, key).unwrap_or_else(|| panic!("{what}: no '{key}' in the output:\n{text}"))
}

/// The lines of a `Title\n=====` section, up to the next blank line after its body.
fn section<'a>(text: &'a str, title: &str) -> Vec<&'a str> {
    let mut lines = text.lines().skip_while(|l| l.trim() != title).skip(2);
    let mut out = Vec::new();
    for l in lines.by_ref() {
        if l.trim().is_empty() {
            break;
        }
        out.push(l);
    }
    out
}

/// The opcodes an effects-log subsection lists as supported ("  Identify (06h): Supported").
fn opcodes(lines: &[&str], from: &str, to: Option<&str>) -> Vec<u8> {
    lines
        .iter()
        .skip_while(|l| l.trim() != from)
        .skip(2)
        .take_while(|l| to.is_none_or(|t| l.trim() != t))
        .filter(|l| l.contains("Supported"))
        .filter_map(|l| {
            let at = l.find("h):")?;
            u8::from_str_radix(&l[at.checked_sub(2)?..at], 16).ok()
        })
        .collect()
}

fn identify(t: &mut Target) {
    let args = vec!["-r".into(), t.trid(), "-s".into(), TOOL_MEM_MB.to_string(), "-g".into()];
    let r = spdk_tool(t, "spdk_nvme_identify", &args, 10);
    let out = r.stdout.as_str();
    let what = format!("{}: spdk_nvme_identify", t.label());
    let e = t.expect();
    // The controller.
    assert_eq!(must(out, "Vendor ID:", &what), e.vid, "{what}: Vendor ID\n{out}");
    assert_eq!(must(out, "Serial Number:", &what), e.serial, "{what}: Serial Number\n{out}");
    assert_eq!(must(out, "Model Number:", &what), e.model, "{what}: Model Number\n{out}");
    assert_eq!(must(out, "Max Data Transfer Size:", &what), "131072", "{what}: MDTS (128 KiB)\n{out}");
    assert_eq!(must(out, "Max Number of Namespaces:", &what), "1", "{what}: NN\n{out}");
    assert_eq!(must(out, "Subsystem NQN:", &what), t.nqn(), "{what}: SUBNQN\n{out}");
    // The namespace: its size and LBA format.
    assert_eq!(must(out, "Namespace ID:", &what), "1", "{what}\n{out}");
    let size = must(out, "Size (in LBAs):", &what);
    assert_eq!(size.split_whitespace().next(), Some(NS_BLOCKS.to_string().as_str()), "{what}: namespace size\n{out}");
    let fmt = must(out, "Current LBA Format:", &what);
    let idx = fmt.strip_prefix("LBA Format #").unwrap_or_else(|| panic!("{what}: current LBA format '{fmt}'"));
    let lbaf = must(out, &format!("LBA Format #{idx}:"), &what);
    let words: Vec<&str> = lbaf.split_whitespace().collect();
    assert_eq!(words.get(2).copied(), Some(BLOCK.to_string().as_str()), "{what}: LBA format #{idx}: {lbaf}");
    assert_eq!(words.get(5).copied(), Some("0"), "{what}: no metadata in LBA format #{idx}: {lbaf}");
    // The Commands Supported and Effects log (05h): the admin commands SPDK's driver sends to
    // both targets (nvmf_tgt does not list the queue commands vfio-user serves) and Read and
    // Write, the Write changing LBAs; each opcode once, in order.
    assert!(
        out.contains("Commands Supported and Effects"),
        "{what}: no Commands Supported and Effects log (LPA bit 1)\n{out}"
    );
    let log = section(out, "Commands Supported and Effects");
    let admin = opcodes(&log, "Admin Commands", Some("I/O Commands"));
    let io = opcodes(&log, "I/O Commands", None);
    for (op, name) in [(0x02, "Get Log Page"), (0x06, "Identify"), (0x09, "Set Features"), (0x0a, "Get Features")] {
        assert!(admin.contains(&op), "{what}: admin {name} ({op:02x}h) not in the effects log: {admin:02x?}\n{log:#?}");
    }
    for (op, name) in [(0x01, "Write"), (0x02, "Read")] {
        assert!(io.contains(&op), "{what}: I/O {name} ({op:02x}h) not in the effects log: {io:02x?}\n{log:#?}");
    }
    for ops in [&admin, &io] {
        assert!(ops.windows(2).all(|w| w[0] < w[1]), "{what}: opcodes out of order or twice: {ops:02x?}");
    }
    let entry = |op: &str| log.iter().rev().find(|l| l.contains(op)).copied().unwrap_or_default();
    assert!(entry("Write (01h)").contains("LBA-Change"), "{what}: Write must change LBAs: '{}'", entry("Write (01h)"));
    assert!(!entry("Read (02h)").contains("LBA-Change"), "{what}: Read changes no LBA: '{}'", entry("Read (02h)"));
    // The namespace identification descriptors (CNS 03h): SPDK's driver reads the list and prints
    // the UUID it found there; it warns when the command fails.
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(!all.contains("Failed to retrieve NS ID Descriptor List"), "{what}: CNS 03h failed\n{all}");
    let uuid = must(out, "UUID:", &what);
    assert!(is_uuid(uuid), "{what}: UUID '{uuid}' from the descriptors is not one");
    if let Some(want) = e.uuid {
        assert_eq!(uuid, want, "{what}: the namespace's UUID");
    }
    let nguid = must(out, "NGUID:", &what);
    assert!(nguid.len() == 32 && nguid.chars().all(|c| c.is_ascii_hexdigit()), "{what}: NGUID '{nguid}'");
    assert!(nguid.chars().any(|c| c != '0'), "{what}: NGUID all zero");
    let io = t.io_delta();
    assert_eq!((io.commands, io.errors), (0, 0), "{what}: identify made I/O or errors: {io:?}");
}

fn is_uuid(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.iter().map(|p| p.len()).collect::<Vec<_>>() == [8, 4, 4, 4, 12]
        && parts.iter().all(|p| p.chars().all(|c| c.is_ascii_hexdigit()))
        && s.chars().any(|c| c.is_ascii_hexdigit() && c != '0')
}

/// One spdk_nvme_perf job.
#[derive(Clone, Copy, Debug)]
struct Job {
    rw: &'static str,
    bs: u32,
    qd: u32,
    qpairs: u32,
    secs: u64,
}

const fn job(rw: &'static str, bs: u32, qd: u32, qpairs: u32) -> Job {
    Job { rw, bs, qd, qpairs, secs: 1 }
}

/// What spdk_nvme_perf printed: IOPS, latency average and percentiles (us).
#[derive(Debug)]
struct PerfResult {
    iops: f64,
    avg_us: f64,
    p50_us: f64,
    p99_us: f64,
}

fn parse_perf(out: &str, what: &str) -> PerfResult {
    let total = must(out, "Total", what);
    let nums: Vec<f64> =
        total.trim_start_matches(':').split_whitespace().map(|w| w.parse().unwrap_or(f64::NAN)).collect();
    assert_eq!(nums.len(), 5, "{what}: Total line '{total}'");
    let pct = |p: &str| -> f64 {
        let v = must(out, &format!("{p}% :"), what);
        v.trim_end_matches("us").trim().parse().unwrap_or_else(|_| panic!("{what}: {p}% '{v}'"))
    };
    PerfResult { iops: nums[0], avg_us: nums[2], p50_us: pct("50.00000"), p99_us: pct("99.00000") }
}

fn perf_args(t: &Target, j: Job) -> Vec<String> {
    let mut a: Vec<String> = vec!["-r".into(), t.trid()];
    for (k, v) in [("-q", j.qd.to_string()), ("-o", j.bs.to_string()), ("-w", j.rw.into()), ("-t", j.secs.to_string())]
    {
        a.push(k.into());
        a.push(v);
    }
    a.extend(["-P".into(), j.qpairs.to_string(), "-c".into(), "0x1".into()]);
    a.extend(["-s".into(), TOOL_MEM_MB.to_string(), "-g".into(), "-L".into()]);
    a
}

/// Runs `j` and checks perf's figures against the device's counters.
fn perf(t: &mut Target, j: Job) -> PerfResult {
    let what = format!("{}: perf {j:?}", t.label());
    let r = spdk_tool(t, "spdk_nvme_perf", &perf_args(t, j), j.secs);
    let all = format!("{}{}", r.stdout, r.stderr);
    assert!(!all.contains("completed with error"), "{what}: I/O errors:\n{}", r.log);
    // (perf exits 0 when it attached no controller: its figures are the proof it ran.)
    assert!(r.stdout.contains("\nTotal"), "{what}: perf printed no figures:\n{}\n{}", r.log, t.server_log());
    let p = parse_perf(&r.stdout, &what);
    assert!(p.iops > 0.0 && p.avg_us > 0.0 && p.p50_us > 0.0, "{what}: {p:?}");
    assert!(p.p50_us <= p.p99_us, "{what}: {p:?}");
    // perf completed at least IOPS x its run time (it measures a little longer than -t).
    let done = (p.iops * j.secs as f64) as u64;
    let io = t.io_delta();
    let slack = u64::from(j.qd * j.qpairs);
    assert!(io.commands >= done, "{what}: the device saw {} commands, perf completed {done}: {io:?}", io.commands);
    assert!(
        io.commands <= (p.iops * (j.secs as f64 + 1.0)) as u64 + slack,
        "{what}: the device saw {} commands, more than perf's {done} in {} s: {io:?}",
        io.commands,
        j.secs
    );
    let (same, other) = if j.rw.contains("read") { (io.reads, io.writes) } else { (io.writes, io.reads) };
    assert_eq!((same, other), (io.commands, 0), "{what}: reads/writes as perf's pattern: {io:?}");
    assert_eq!(io.errors, 0, "{what}: device errors: {io:?}");
    eprintln!(
        "{what}: {:.0} IOPS, avg {:.1} us, p50 {:.1} us, p99 {:.1} us; device: {} commands",
        p.iops, p.avg_us, p.p50_us, p.p99_us, io.commands
    );
    p
}

/// bdevperf's verify workload through SPDK's bdev layer (bdev_nvme attaching the controller,
/// examine on): every block written is read back and compared; 0 failures.
fn bdevperf_verify(t: &mut Target, secs: u64) {
    let what = format!("{}: bdevperf verify", t.label());
    let cfg = serde_json::json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_set_options", "params": {"bdev_auto_examine": true}},
        {"method": "bdev_nvme_attach_controller", "params": {
            "name": "Nvme0", "trtype": "VFIOUSER", "traddr": t.traddr(), "subnqn": t.nqn()}},
        {"method": "bdev_wait_for_examine"}]}]});
    let path = t.dir.0.join("bdevperf.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let args: Vec<String> = ["--json", path.to_str().unwrap(), "-q", "32", "-o", "4096", "-w", "verify", "-t"]
        .iter()
        .map(|s| s.to_string())
        .chain([
            secs.to_string(),
            "-m".into(),
            "0x1".into(),
            "-s".into(),
            TOOL_MEM_MB.to_string(),
            "-g".into(),
            "-u".into(),
        ])
        .collect();
    let r = spdk_tool(t, "bdevperf", &args, secs);
    let out = r.stdout.replace('\r', "\n"); // its progress lines end in CR
    for bad in ["Buffer mismatch", "fails", "with error", "Failed to submit"] {
        assert!(!out.contains(bad), "{what}: '{bad}':\n{}", r.log);
    }
    let total = must(&out, "Total", &what);
    let nums: Vec<f64> = total.trim_start_matches(':').split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(nums.len(), 7, "{what}: Total line '{total}'");
    let (iops, fails, timeouts) = (nums[0], nums[2], nums[3]);
    assert!(iops > 0.0, "{what}: {total}");
    assert_eq!((fails, timeouts), (0.0, 0.0), "{what}: Fail/s and TO/s: {total}");
    let io = t.io_delta();
    let done = (iops * secs as f64 * 0.9) as u64;
    assert!(io.reads >= done / 2 && io.writes >= done / 2, "{what}: the device saw {io:?} for {iops} IOPS");
    assert_eq!(io.errors, 0, "{what}: {io:?}");
    eprintln!("{what}: {iops:.0} IOPS for {secs} s, 0 failures; device {io:?}");
}

/// qpair-cycle: `cycles` times, 4 I/O queue pairs allocated, a block written and read on each,
/// and the pairs freed; the device saw exactly those I/Os (and, in iopath, the Create/Delete
/// I/O SQ/CQ of each pair).
fn qpair_cycle(t: &mut Target, cycles: u32) {
    let what = format!("{}: qpair-cycle", t.label());
    let mut args: Vec<String> = vec!["-r".into(), t.trid(), "-n".into(), cycles.to_string(), "-q".into(), "4".into()];
    args.extend(["-s".into(), TOOL_MEM_MB.to_string()]);
    if t.backend != Backend::Null {
        args.push("-v".into()); // null keeps no data
    }
    let r = spdk_tool(t, "qpair-cycle", &args, 60);
    let line = r
        .stdout
        .lines()
        .find(|l| l.starts_with("qpair-cycle:"))
        .unwrap_or_else(|| panic!("{what}: no summary:\n{}", r.log));
    let kv: BTreeMap<&str, u64> = line
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect();
    let pairs = u64::from(cycles) * 4;
    let want = BTreeMap::from([
        ("cycles", u64::from(cycles)),
        ("qpairs", 4),
        ("allocs", pairs),
        ("frees", pairs),
        ("ios", 2 * pairs),
        ("errors", 0),
        ("mismatches", 0),
    ]);
    assert_eq!(kv, want, "{what}: {line}");
    let io = t.io_delta();
    assert_eq!((io.reads, io.writes, io.errors), (pairs, pairs, 0), "{what}: device counters {io:?}");
    if t.place != Place::Nvmf {
        assert!(io.admin >= 4 * pairs, "{what}: Create/Delete I/O SQ and CQ for each pair: {io:?}");
    }
    eprintln!("{what}: {line}; device {io:?}");
}

/// A perf client killed with SIGKILL in the middle of its run; the next client is served.
fn killed_client(t: &mut Target) {
    let what = format!("{}: perf killed -9", t.label());
    let j = Job { rw: "randread", bs: 4096, qd: 32, qpairs: 2, secs: 20 };
    let mut cmd = Command::new(tool("spdk_nvme_perf"));
    cmd.args(perf_args(t, j));
    let mut p = Proc::spawn("spdk_nvme_perf-killed", &mut cmd, &t.dir.0, true, false);
    // perf's stdout is a file, so block-buffered: nothing shows its progress. It starts its
    // timed run about a second after it starts here; kill it 6 s in, and check by the device's
    // counters that it was doing I/O then.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(6) {
        assert!(p.running(), "{what}: perf ended before it was killed:\n{}\n{}", p.log(), t.server_log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = p.stop(libc::SIGKILL, Duration::from_secs(5));
    drop(p);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{what}: perf ended by itself ({st}):\n{}", t.server_log());
    eprintln!("{what}: perf killed ({st})");
    let io = t.io_delta();
    assert!(io.reads > 0 && io.errors == 0, "{what}: the killed client's I/O: {io:?}\n{}", t.server_log());
    std::thread::sleep(Duration::from_millis(500));
    t.server_alive();
    let p = perf(t, job("randread", 4096, 32, 2));
    eprintln!("{what}: the next client: {:.0} IOPS", p.iops);
}

// ---------------------------------------------------------------------------------------------
// The tests: each check against nvmf_tgt (the control) and iopath in two doorbell modes.

fn identify_check(place: Place) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    for b in [Backend::Null, Backend::Ram, Backend::File] {
        let mut t = Target::start(place, b);
        identify(&mut t);
    }
}

/// randread and randwrite at 512 B and 4 KiB, queue depth 1 to 128, one to four qpairs, and
/// 128 KiB transfers, on null; a few on ram and file.
fn perf_check(place: Place) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let all = [
        job("randread", 512, 1, 1),
        job("randread", 512, 32, 2),
        job("randread", 4096, 128, 4),
        job("randwrite", 512, 1, 1),
        job("randwrite", 512, 16, 2),
        job("randwrite", 4096, 128, 4),
        job("randread", 131072, 8, 1),
        job("randwrite", 131072, 8, 2),
    ];
    let some = [job("randwrite", 4096, 32, 2), job("randread", 4096, 1, 1), job("randread", 131072, 8, 2)];
    let mut t = Target::start(place, Backend::Null);
    let mut table = Vec::new();
    for j in all {
        table.push((Backend::Null, j, perf(&mut t, j)));
    }
    drop(t);
    for b in [Backend::Ram, Backend::File] {
        let mut t = Target::start(place, b);
        for j in some {
            table.push((b, j, perf(&mut t, j)));
        }
    }
    eprintln!("spdk_nvme_perf against {place:?}:");
    eprintln!(
        "{:<6} {:<10} {:>7} {:>4} {:>3} {:>10} {:>9} {:>9} {:>9}",
        "ns", "rw", "bs", "qd", "P", "IOPS", "avg us", "p50 us", "p99 us"
    );
    for (b, j, p) in table {
        eprintln!(
            "{:<6} {:<10} {:>7} {:>4} {:>3} {:>10.0} {:>9.1} {:>9.1} {:>9.1}",
            format!("{b:?}"),
            j.rw,
            j.bs,
            j.qd,
            j.qpairs,
            p.iops,
            p.avg_us,
            p.p50_us,
            p.p99_us
        );
    }
}

fn bdevperf_check(place: Place) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    for b in [Backend::Ram, Backend::File] {
        let mut t = Target::start(place, b);
        bdevperf_verify(&mut t, 30);
    }
}

fn qpair_cycle_check(place: Place) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    for b in [Backend::Ram, Backend::File, Backend::Null] {
        let mut t = Target::start(place, b);
        qpair_cycle(&mut t, 100);
    }
}

fn killed_client_check(place: Place) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let mut t = Target::start(place, Backend::Null);
    killed_client(&mut t);
}

macro_rules! against_each_target {
    ($check:ident, $name:ident) => {
        mod $name {
            #[test]
            fn nvmf_tgt_control() {
                super::$check(super::Place::Nvmf);
            }
            #[test]
            fn iopath_default_doorbell() {
                super::$check(super::Place::IopathDefault);
            }
            #[test]
            fn iopath_doorbell_bar() {
                super::$check(super::Place::IopathBar);
            }
        }
    };
}

against_each_target!(identify_check, identify);
against_each_target!(perf_check, perf);
against_each_target!(bdevperf_check, bdevperf_verify_30s);
against_each_target!(qpair_cycle_check, qpair_free_and_alloc_loop);
against_each_target!(killed_client_check, client_killed_mid_perf);

/// bar-adaptive, the other mode with a mappable doorbell page: identify and two perf jobs (the
/// full matrix runs in the default mode and `bar`).
#[test]
fn identify_and_perf_in_bar_adaptive() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let mut t = Target::start(Place::IopathMode("bar-adaptive"), Backend::Ram);
    identify(&mut t);
    perf(&mut t, job("randwrite", 4096, 16, 2));
    perf(&mut t, job("randread", 512, 1, 1));
}

/// SPDK's driver needs BAR0's doorbell page mappable (sparse mmap): the modes without it are
/// refused by SPDK itself at once, with its own message (README's table of modes and clients).
#[test]
fn spdk_refuses_the_modes_without_a_mappable_doorbell_page() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    for mode in ["shm", "mmio", "adaptive", "ioeventfd"] {
        let mut t = Target::start(Place::IopathMode(mode), Backend::Null);
        let t0 = Instant::now();
        let args = vec!["-r".into(), t.trid(), "-s".into(), TOOL_MEM_MB.to_string(), "-g".into()];
        let r = try_spdk_tool(&mut t, "spdk_nvme_identify", &args, 10);
        assert!(!r.status.success(), "{mode}: identify succeeded:\n{}", r.stdout);
        assert!(r.stderr.contains("Error to get device BAR0"), "{mode}: {}", r.stderr);
        assert!(t0.elapsed() < Duration::from_secs(20), "{mode}: took {:?}", t0.elapsed());
    }
}

/// iopath's VMM and its guest's NVMe driver (nvmeperf, MSI-X, sleeping on interrupts, verify)
/// against SPDK's nvmf_tgt: `iopath run --device vfio-user:DIR/cntrl`. Bounded: a run that hangs
/// fails within two minutes.
#[test]
fn iopath_vmm_guest_driver_against_nvmf_tgt() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let t = Target::start(Place::Nvmf, Backend::Ram);
    let sock = t.traddr().join("cntrl");
    let append = "rw=randrw bs=4096 iodepth=8 time_ms=1000 size_mb=8 irq=wait verify=1";
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iopath"));
    cmd.args(["run", "--workload", "nvme", "--timeout", "60", "--append", append, "--device"])
        .arg(format!("vfio-user:{}", sock.display()));
    let r = run_bounded("iopath-run", &mut cmd, &t.dir.0, Duration::from_secs(90), &|| t.server_log());
    let lines: Vec<&str> = r.stdout.lines().chain(r.stderr.lines()).collect();
    let progress = if lines.iter().any(|l| l.starts_with("@nvme ")) {
        ""
    } else {
        " (no @nvme record: the guest's driver did not finish its run)"
    };
    assert!(
        r.status.success(),
        "iopath run against nvmf_tgt failed ({}){progress}:\n{}\n{}",
        r.status,
        r.log,
        t.server_log()
    );
    let rec = iopath_bench::record::find_record(&lines, "nvme")
        .unwrap_or_else(|| panic!("no @nvme record from the guest:\n{}", r.log));
    let n = |k: &str| rec.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or_else(|| panic!("no {k} in {rec:?}"));
    assert_eq!((n("errors"), n("mismatches")), (0, 0), "{rec:?}");
    assert!(n("ios") > 0, "{rec:?}");
    assert!(n("irqs") >= n("sleeps"), "every halt ended on an interrupt: {rec:?}");
    let io = t.nvmf_io();
    assert!(io.reads + io.writes >= n("ios"), "nvmf_tgt's bdev saw {io:?} for the guest's {rec:?}");
    eprintln!("iopath VMM + guest driver against nvmf_tgt: {rec:?}; bdev {io:?}");
}

/// SPDK's stock tools count the errors a rule injects, as many as the device injected: every
/// 97th read fails with Unrecovered Read Error and DNR (so neither SPDK's NVMe driver nor
/// bdev_nvme retries it). The oracle: the rule (its counters through `iopath ctl stats`) fired
/// on exactly each 97th of the reads it matched, those are all the device's read commands (a
/// failed read is not carried out, so `io.reads` counts the others), and the device completed
/// that many with an error. spdk_nvme_perf with `-Q 1` (go on after errors, log each) logs each
/// one; bdevperf with `-f` (go on after failures) reports them as Fail/s over its run time.
#[test]
fn spdk_perf_and_bdevperf_count_the_errors_iopath_injects() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let mut t = Target::start_with(Place::IopathBar, Backend::Ram, ",inject=op=read/status=2:0x81:dnr/every=97");
    let mut last = (0, 0);
    // (I/O errors the device completed, the reads it saw) since the last call, checked.
    let mut injected = |t: &mut Target, what: &str| -> (u64, u64) {
        let io = t.io_delta();
        let (m, f) = t.rule_stats()[0];
        let (matched, fired) = (m - last.0, f - last.1);
        assert_eq!(f, m / 97, "{what}: the trigger: fired {f} of {m} matched");
        assert_eq!(matched, io.reads + fired, "{what}: every read matched the rule once: {io:?}");
        assert!(io.errors >= fired, "{what}: the device completed {fired} injected errors: {io:?}");
        assert!(fired >= 10, "{what}: too few reads to tell: {io:?}");
        last = (m, f);
        (fired, io.reads)
    };
    let j = Job { secs: 2, ..job("randread", 512, 16, 1) };
    let mut args = perf_args(&t, j);
    args.extend(["-Q".into(), "1".into()]);
    let r = spdk_tool(&mut t, "spdk_nvme_perf", &args, j.secs);
    let logged = r.stderr.lines().filter(|l| l.contains("Read completed with error (sct=2, sc=129)")).count() as u64;
    let (fired, reads) = injected(&mut t, "perf");
    assert_eq!(logged, fired, "perf logged {logged} errors, the device injected {fired}:\n{}", r.log);
    eprintln!("spdk_nvme_perf -Q 1: {logged} errors logged; device: {reads} reads carried out, {fired} injected");

    let secs = 2;
    let cfg = serde_json::json!({"subsystems": [{"subsystem": "bdev", "config": [
        {"method": "bdev_nvme_attach_controller", "params": {
            "name": "Nvme0", "trtype": "VFIOUSER", "traddr": t.traddr(), "subnqn": t.nqn()}},
        {"method": "bdev_wait_for_examine"}]}]});
    let path = t.dir.0.join("bdevperf.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let mut args: Vec<String> =
        ["--json", path.to_str().unwrap(), "-q", "16", "-o", "4096", "-w", "randread", "-f", "-m", "0x1", "-g", "-u"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    args.extend(["-t".into(), secs.to_string(), "-s".into(), TOOL_MEM_MB.to_string()]);
    let r = spdk_tool(&mut t, "bdevperf", &args, secs);
    let out = r.stdout.replace('\r', "\n");
    // The job's line: runtime(s) IOPS MiB/s Fail/s TO/s Average min max.
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("Nvme0n1") && l.contains(':'))
        .unwrap_or_else(|| panic!("bdevperf printed no job line:\n{}", r.log));
    let nums: Vec<f64> = line.split(':').nth(1).unwrap().split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(nums.len(), 8, "bdevperf job line '{line}'");
    let failed = nums[0] * nums[3];
    let (fired, reads) = injected(&mut t, "bdevperf");
    // Fail/s and the run time are printed to 2 decimals; the examine reads before the job may
    // have met the rule too (the device's, not the job's).
    let slack = 0.01 * nums[0] + 0.01 * nums[3] + 2.0;
    assert!(
        (failed - fired as f64).abs() <= slack,
        "bdevperf: {failed:.1} failed (line '{line}'), the device injected {fired}"
    );
    eprintln!("bdevperf -f: {failed:.1} failed ({}); device: {reads} reads carried out, {fired} injected", line.trim());
}
