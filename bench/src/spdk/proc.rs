//! The child processes of `bench spdk` (spdk_nvme_perf, nvmf_tgt, rpc.py,
//! `iopath serve`) and what they leave behind.
//!
//! Every child is killed and reaped when its [`Proc`] drops, and dies with
//! the bench if the bench dies first (`PR_SET_PDEATHSIG`). An SPDK process
//! (DPDK's `--file-prefix spdk_pid<PID>`) keeps its hugepage files in
//! /dev/hugepages after it ends when it ran with `-g` (DPDK does not unlink
//! them even on a clean exit): they are removed, with its runtime directory,
//! once it is reaped. Ctrl-C (SIGINT), SIGTERM and SIGHUP set the benches'
//! one flag (`crate::interrupt`) that every wait here checks, so the bench
//! unwinds through these drops instead of dying with its children running.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

pub use crate::interrupt::{check, interrupted, Interrupted, SignalGuard};

/// A child process with its stdout and stderr in files (or stdout as a
/// pipe), killed and reaped on drop.
pub struct Proc {
    pub name: String,
    pub child: Child,
    out: PathBuf,
    err: PathBuf,
    /// An SPDK process: its hugepage files and runtime directory go when it is reaped.
    spdk: bool,
    status: Option<ExitStatus>,
}

impl Proc {
    /// Starts `cmd` with its output in `dir`; `cpu`: its affinity (it and
    /// every thread it makes), else inherited.
    pub fn spawn(
        name: &str,
        cmd: &mut Command,
        dir: &Path,
        spdk: bool,
        pipe_stdout: bool,
        cpu: Option<usize>,
    ) -> anyhow::Result<Proc> {
        use std::os::unix::process::CommandExt;
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let out = dir.join(format!("{name}-{n}.out"));
        let err = dir.join(format!("{name}-{n}.err"));
        let stdout = if pipe_stdout { Stdio::piped() } else { File::create(&out)?.into() };
        // SAFETY: between fork and exec only async-signal-safe calls (prctl,
        // getppid, sched_setaffinity on a set built before the fork).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if let Some(c) = cpu {
                anyhow::ensure!(c < libc::CPU_SETSIZE as usize, "CPU {c} is beyond CPU_SETSIZE");
                libc::CPU_SET(c, &mut set);
            }
            let parent = libc::getpid();
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 || libc::getppid() != parent {
                    return Err(std::io::Error::other("the bench is gone"));
                }
                if cpu.is_some() && libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(File::create(&err)?)
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {name} ({}): {e}", cmd.get_program().to_string_lossy()))?;
        Ok(Proc { name: name.into(), child, out, err, spdk, status: None })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits up to `d` for the process to end: its status, or None if it
    /// still runs; [`Interrupted`] as soon as a signal came.
    pub fn wait_for(&mut self, d: Duration) -> Result<Option<ExitStatus>, Interrupted> {
        let end = Instant::now() + d;
        loop {
            if let Some(s) = self.try_status() {
                return Ok(Some(s));
            }
            check()?;
            if Instant::now() >= end {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.status = Some(s);
            }
        }
        self.status
    }

    pub fn running(&mut self) -> bool {
        self.try_status().is_none()
    }

    /// Sends `sig`, waits up to `grace`, then SIGKILL; reaps it and removes
    /// what an SPDK process leaves. Not interrupted by a signal: this is the cleanup.
    pub fn stop(&mut self, sig: libc::c_int, grace: Duration) -> Option<ExitStatus> {
        if self.running() {
            // SAFETY: kill(2) on our own child, not yet reaped (its pid is still ours).
            unsafe { libc::kill(self.pid() as libc::pid_t, sig) };
            let end = Instant::now() + grace;
            while self.running() && Instant::now() < end {
                std::thread::sleep(Duration::from_millis(10));
            }
            if self.running() {
                let _ = self.child.kill();
                self.status = self.child.wait().ok();
            }
        }
        self.cleanup();
        self.status
    }

    /// What DPDK leaves of a reaped SPDK process: `/dev/hugepages/spdk_pid<PID>map_*`
    /// and `/var/run/dpdk/spdk_pid<PID>`.
    fn cleanup(&self) {
        if !self.spdk || self.status.is_none() {
            return;
        }
        remove_dpdk_files(self.pid());
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// The last lines of its output, for an error message.
    pub fn log(&self) -> String {
        let tail = |s: String| {
            let v: Vec<&str> = s.lines().collect();
            v[v.len().saturating_sub(30)..].join("\n")
        };
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
        self.cleanup();
    }
}

/// Removes DPDK's hugepage files and runtime directory of process `pid`
/// (`--file-prefix spdk_pid<PID>`, SPDK's default); only those names.
pub fn remove_dpdk_files(pid: u32) {
    let prefix = format!("spdk_pid{pid}map_");
    if let Ok(rd) = std::fs::read_dir("/dev/hugepages") {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir_all(format!("/var/run/dpdk/spdk_pid{pid}"));
}

/// Runs `cmd` to its end within `limit`: its status and output; a run that
/// takes longer is killed and is an error.
pub fn run_bounded(
    name: &str,
    cmd: &mut Command,
    dir: &Path,
    limit: Duration,
    cpu: Option<usize>,
) -> anyhow::Result<Ran> {
    let mut p = Proc::spawn(name, cmd, dir, true, false, cpu)?;
    let Some(status) = p.wait_for(limit)? else {
        p.stop(libc::SIGKILL, Duration::from_secs(5));
        anyhow::bail!("{name} did not finish within {limit:?} (killed):\n{}", p.log());
    };
    p.cleanup();
    Ok(Ran { status, pid: p.pid(), stdout: p.stdout(), stderr: p.stderr(), log: p.log() })
}

/// A finished run's status and output.
#[derive(Debug)]
pub struct Ran {
    pub status: ExitStatus,
    pub pid: u32,
    pub stdout: String,
    pub stderr: String,
    pub log: String,
}

/// A directory for a bench's sockets and logs, removed with its contents on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> std::io::Result<TempDir> {
        let d = std::env::temp_dir().join(format!("iopath-bench-{tag}-{}", std::process::id()));
        if d.exists() {
            std::fs::remove_dir_all(&d)?;
        }
        std::fs::create_dir_all(&d)?;
        Ok(TempDir(d))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_killed_and_reaped_when_dropped_and_a_signal_stops_a_wait() {
        let _one = crate::interrupt::TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let dir = TempDir::new("proc-test").unwrap();
        let mut p = Proc::spawn("sleep", Command::new("sleep").arg("30"), &dir.0, false, false, None).unwrap();
        let pid = p.pid();
        assert_eq!(p.wait_for(Duration::from_millis(50)).unwrap(), None, "still sleeping");
        drop(p);
        // Reaped: no such process (not even a zombie) with that pid as our child.
        // SAFETY: waitpid on a pid that is no longer our child fails with ECHILD.
        let r = unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
        assert_eq!(r, -1, "the child was reaped on drop");
        let ran = run_bounded("true", &mut Command::new("true"), &dir.0, Duration::from_secs(10), None).unwrap();
        assert!(ran.status.success());
        let e = run_bounded("sleep", Command::new("sleep").arg("30"), &dir.0, Duration::from_millis(100), None);
        assert!(e.unwrap_err().to_string().contains("did not finish"));
    }

    #[test]
    fn dpdk_files_of_one_pid_are_removed_and_no_others() {
        let Ok(rd) = std::fs::read_dir("/dev/hugepages") else { return };
        drop(rd);
        // A pid no process has (above pid_max's ceiling): its names cannot be anyone's.
        let mine = "/dev/hugepages/spdk_pid4999999map_0";
        let other = "/dev/hugepages/spdk_pid49999990map_0";
        if std::fs::write(mine, b"").is_err() {
            return; // hugetlbfs refuses plain writes on some kernels: nothing to check here
        }
        std::fs::write(other, b"").unwrap();
        remove_dpdk_files(4_999_999);
        let (m, o) = (Path::new(mine).exists(), Path::new(other).exists());
        let _ = std::fs::remove_file(other);
        assert!(!m && o, "removed {mine}: {}, kept {other}: {o}", !m);
    }
}
