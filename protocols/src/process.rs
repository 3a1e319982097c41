//! A device process the VMM starts itself (`iopath serve ... --fd 3`), and
//! the report a device process prints when a client disconnects: one JSON
//! line on standard output with the device's own counters, which is how the
//! VMM verifies routing for a device it does not host.

use crate::{Error, Result};
use iopath_devices::Counter;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The fd number a spawned device process finds its socket on.
pub const CHILD_SOCKET_FD: i32 = 3;

/// The device processes started and not reaped yet (`Drop` reaps them),
/// for [`kill_leftovers`].
static LIVE: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// Kills and reaps every device process this process started that is still
/// unreaped, whatever holds its [`DeviceProcess`] (a thread the process's
/// exit would end before it drops it): what `iopath` runs on its way out,
/// so that no device process outlives it. Returns their pids. (A pid here
/// is an unreaped child's: no other process can have it.)
pub fn kill_leftovers() -> Vec<u32> {
    let pids = std::mem::take(&mut *iopath_devices::lock(&LIVE));
    for &pid in &pids {
        // SAFETY: kill(2) and waitpid(2) on our own unreaped child.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
        }
    }
    pids
}

pub struct DeviceProcess {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// An iopath device process, which reports its counters (QEMU does not).
    reports: bool,
    /// QEMU's monitor (QMP on its standard input), kept open for the session.
    _monitor: Option<ChildStdin>,
    /// How it was started, for an iopath device process: the binary and
    /// the arguments after `serve` (see [`crate::respawn`]).
    command: Option<(PathBuf, Vec<String>)>,
}

/// Most QMP lines read while waiting for QEMU to run (events come between replies).
const MAX_QMP_LINES: usize = 1000;

/// The line a device process prints when its client goes away.
pub fn disconnect_report(transport: &str, device: &str, counters: &[Counter]) -> String {
    let map: serde_json::Map<String, serde_json::Value> =
        counters.iter().map(|c| (c.name.clone(), serde_json::Value::from(c.value))).collect();
    serde_json::json!({"event": "disconnected", "transport": transport, "device": device, "counters": map}).to_string()
}

/// Parses a [`disconnect_report`] line; None for any other line.
pub fn parse_report(line: &str) -> Option<Vec<Counter>> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    if v.get("event")?.as_str()? != "disconnected" {
        return None;
    }
    let m = v.get("counters")?.as_object()?;
    Some(m.iter().filter_map(|(k, v)| Some(Counter { name: k.clone(), value: v.as_u64()? })).collect())
}

/// Makes `fd` the child's fd 3 (the caller keeps `fd` open until spawn).
pub fn inherit_as_fd3(cmd: &mut Command, fd: &OwnedFd) {
    let raw = fd.as_raw_fd();
    // SAFETY: between fork and exec only async-signal-safe calls (dup2, fcntl).
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(move || {
            if raw == CHILD_SOCKET_FD {
                let fl = libc::fcntl(raw, libc::F_GETFD);
                if fl < 0 || libc::fcntl(raw, libc::F_SETFD, fl & !libc::FD_CLOEXEC) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(raw, CHILD_SOCKET_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

impl DeviceProcess {
    /// Starts `exe serve <args>` with `socket` as its fd 3.
    pub fn spawn(exe: &Path, args: &[String], socket: OwnedFd) -> Result<Self> {
        let mut cmd = Command::new(exe);
        cmd.arg("serve").args(args);
        let mut p = Self::spawn_command(cmd, socket)?;
        p.reports = true;
        p.command = Some((exe.to_path_buf(), args.to_vec()));
        Ok(p)
    }

    /// Starts QEMU's `-machine x-remote` (`cmd`, which must have `-qmp stdio`)
    /// with `socket` as its fd 3, and returns once QEMU runs, within `timeout`.
    ///
    /// QEMU serves the socket from the moment its machine is created, and
    /// only then resets the machine: a probe that crossed before that reset
    /// would see its BAR sizing and configuration undone. The VM state
    /// `running` comes after that reset, so the first message waits for it.
    pub fn spawn_qemu(mut cmd: Command, socket: OwnedFd, timeout: Duration) -> Result<Self> {
        cmd.stdin(Stdio::piped());
        let mut p = Self::spawn_command_with(cmd, socket)?;
        let mut stdin = p.child.stdin.take().ok_or_else(|| Error::PeerGone("QEMU has no standard input".into()))?;
        let deadline = Instant::now() + timeout;
        p.qmp_line(deadline, "the QMP greeting", |v| v.get("QMP").is_some())?;
        let mut ask = |cmd: &str| {
            writeln!(stdin, "{}", serde_json::json!({ "execute": cmd }))
                .map_err(|e| Error::io(format!("QEMU's monitor ({cmd})"), e))
        };
        ask("qmp_capabilities")?;
        p.qmp_line(deadline, "the reply to qmp_capabilities", |v| v.get("return").is_some())?;
        loop {
            ask("query-status")?;
            let r = p.qmp_line(deadline, "the reply to query-status", |v| v.get("return").is_some())?;
            if r["return"]["status"] == "running" {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        p._monitor = Some(stdin);
        Ok(p)
    }

    /// The first QMP line that `wanted` accepts, by `deadline`; an error
    /// reply, a non-JSON line or too many other lines end the wait.
    fn qmp_line(
        &mut self,
        deadline: Instant,
        what: &str,
        wanted: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value> {
        let id = self.child.id();
        for _ in 0..MAX_QMP_LINES {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(l) => l,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(Error::Timeout { what: format!("{what} from QEMU {id}") })
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.try_wait().ok().flatten();
                    return Err(Error::PeerGone(format!("QEMU {id} ended ({status:?}) before {what}")));
                }
            };
            let v: serde_json::Value = serde_json::from_str(line.trim_end())
                .map_err(|e| Error::protocol(format!("QEMU {id} monitor, waiting for {what}: {e}: {line:.200}")))?;
            if let Some(e) = v.get("error") {
                return Err(Error::protocol(format!("QEMU {id} monitor, waiting for {what}: {e}")));
            }
            if wanted(&v) {
                return Ok(v);
            }
        }
        Err(Error::protocol(format!("QEMU {id} monitor: no {what} in {MAX_QMP_LINES} lines")))
    }

    /// Starts `cmd` with `socket` as its fd 3 and no standard input (an
    /// iopath serve; QEMU's `-machine x-remote` starts with [`spawn_qemu`](Self::spawn_qemu)).
    pub fn spawn_command(mut cmd: Command, socket: OwnedFd) -> Result<Self> {
        cmd.stdin(Stdio::null());
        Self::spawn_command_with(cmd, socket)
    }

    fn spawn_command_with(mut cmd: Command, socket: OwnedFd) -> Result<Self> {
        let exe = std::path::PathBuf::from(cmd.get_program());
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        inherit_as_fd3(&mut cmd, &socket);
        let mut child =
            cmd.spawn().map_err(|e| Error::io(format!("cannot start the device process {}", exe.display()), e))?;
        iopath_devices::lock(&LIVE).push(child.id());
        drop(socket);
        let stdout: ChildStdout =
            child.stdout.take().ok_or_else(|| Error::PeerGone("the device process has no stdout".into()))?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("device-process-out".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| Error::io("cannot read the device process output", e))?;
        Ok(DeviceProcess { child, lines: rx, reports: false, _monitor: None, command: None })
    }

    /// The binary and `serve` arguments of an iopath device process
    /// ([`spawn`](Self::spawn)); None for another program.
    pub fn command(&self) -> Option<(&Path, &[String])> {
        self.command.as_ref().map(|(e, a)| (e.as_path(), a.as_slice()))
    }

    /// The process's id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// How the process ended (exit status or signal), waiting for it up
    /// to `timeout`; None while it still runs.
    pub fn exit_status(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for the device's counters after the client disconnected.
    pub fn counters(&mut self, timeout: Duration) -> Result<Vec<Counter>> {
        if !self.reports {
            return Ok(Vec::new());
        }
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => match parse_report(&line) {
                    Some(c) => return Ok(c),
                    None => log::info!("device process {}: {line}", self.child.id()),
                },
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let what = format!("counters of device process {} ({timeout:?})", self.child.id());
                    return Err(Error::Timeout { what });
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.try_wait().ok().flatten();
                    let id = self.child.id();
                    return Err(Error::PeerGone(format!("device process {id} ended ({status:?}) without counters")));
                }
            }
        }
    }
}

impl Drop for DeviceProcess {
    fn drop(&mut self) {
        // Out of the list first: `kill_leftovers` then never signals a pid
        // reaped here (and the lock is not held while a dying process is
        // waited for, which may take tens of ms).
        iopath_devices::lock(&LIVE).retain(|&p| p != self.child.id());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `spawn_qemu` against a stand-in that prints `script`'s output as its
    /// QMP and reads what it is sent.
    fn fake_qemu(script: &str, timeout: Duration) -> Result<DeviceProcess> {
        let (_mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", script]);
        DeviceProcess::spawn_qemu(cmd, theirs.into(), timeout)
    }

    #[test]
    fn a_monitor_that_misbehaves_ends_the_wait_with_an_error() {
        let t = Duration::from_secs(5);
        let greet = r#"echo '{"QMP": {}}'; read a; echo '{"return": {}}'; read b"#;
        let e = fake_qemu("echo 'not json'", t).err().expect("a line that is not JSON").to_string();
        assert!(e.contains("not json"), "{e}");
        let e = fake_qemu("exit 3", t).err().expect("QEMU gone").to_string();
        assert!(e.contains("ended"), "{e}");
        let e = fake_qemu(&format!(r#"{greet}; echo '{{"error": {{"desc": "no"}}}}'; cat"#), t).err().unwrap();
        assert!(e.to_string().contains("no"), "{e}");
        // Silent, or never running: the wait ends at its deadline.
        let short = Duration::from_millis(300);
        let e = fake_qemu("sleep 10", short).err().expect("no greeting").to_string();
        assert!(e.contains("QMP greeting"), "{e}");
        let paused = r#"echo '{"return": {"status": "paused"}}'; while read c; do echo '{"return": {"status": "paused"}}'; done"#;
        let e = fake_qemu(&format!("{greet}; {paused}"), short).err().expect("never running");
        assert!(e.to_string().contains("query-status"), "{e}");
        // Events between replies are skipped, up to a bound.
        let flood = r#"echo '{"QMP": {}}'; while :; do echo '{"event": "X"}'; done"#;
        let e = fake_qemu(flood, t).err().expect("no reply among events").to_string();
        assert!(e.contains("1000 lines"), "{e}");
        let ok = format!(r#"{greet}; echo '{{"event": "RESUME"}}'; echo '{{"return": {{"status": "running"}}}}'; cat"#);
        fake_qemu(&ok, t).expect("a monitor that says running");
    }

    #[test]
    fn report_round_trip() {
        let c = vec![Counter { name: "a.exits".into(), value: 7 }];
        let line = disconnect_report("mpqemu", "pci-testdev", &c);
        assert_eq!(parse_report(&line).unwrap(), c);
        assert!(parse_report("{\"event\":\"other\"}").is_none());
        assert!(parse_report("not json").is_none());
    }
}
