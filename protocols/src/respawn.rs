//! Getting a device process back after it died, for a client that
//! reconnects (the vfio-user proxy; any transport's client may use it):
//! why it died ([`cause_of_death`]), a new process of an iopath device
//! process the VMM started ([`respawn`]: the same binary and arguments, on
//! a new socket pair), or the socket of an external one once it listens
//! again ([`reconnect`], bounded).

use crate::process::DeviceProcess;
use crate::{Error, Result};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long [`cause_of_death`] waits for a process whose socket closed to end.
pub const REAP_WAIT: Duration = Duration::from_secs(1);

/// Why `child` went away: its exit status or the signal that killed it,
/// waiting up to [`REAP_WAIT`]; one still running is said so (its drop kills it).
pub fn cause_of_death(child: &mut DeviceProcess) -> String {
    let id = child.id();
    match child.exit_status(REAP_WAIT) {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("device process {id} exited with status {c}"),
            (None, Some(sig)) => {
                // SAFETY: strsignal returns a pointer to a static or
                // thread-local string (or NULL), read at once.
                let name = unsafe { libc::strsignal(sig) };
                let name = if name.is_null() {
                    String::new()
                } else {
                    // SAFETY: a NUL-terminated C string from strsignal.
                    format!(" ({})", unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy())
                };
                format!("device process {id} was killed by signal {sig}{name}")
            }
            _ => format!("device process {id} ended ({s})"),
        },
        None => format!("device process {id} closed its socket and still runs (it is killed)"),
    }
}

/// A new process of the iopath device process `old` was (the same binary
/// and `serve` arguments, with a new socket as its fd 3): our end and it.
/// None for a process that is not one (QEMU).
pub fn respawn(old: &DeviceProcess) -> Option<Result<(UnixStream, DeviceProcess)>> {
    let (exe, args) = old.command()?;
    Some(spawn(exe, args))
}

fn spawn(exe: &Path, args: &[String]) -> Result<(UnixStream, DeviceProcess)> {
    let (mine, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
    let child = DeviceProcess::spawn(exe, args, theirs.into())?;
    Ok((mine, child))
}

/// Connects to the UNIX socket `path` again, trying every `every` until
/// `deadline` (a server that restarts takes a moment to listen).
pub fn reconnect(path: &Path, deadline: Instant, every: Duration) -> Result<UnixStream> {
    loop {
        match crate::attach::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() + every >= deadline => {
                return Err(Error::io(format!("reconnecting to {}", path.display()), e))
            }
            Err(_) => std::thread::sleep(every),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn the_cause_of_death_names_the_status_or_the_signal() {
        let run = |script: &str| {
            let (_a, b) = UnixStream::pair().unwrap();
            let mut cmd = Command::new("/bin/sh");
            cmd.args(["-c", script]);
            DeviceProcess::spawn_command(cmd, b.into()).unwrap()
        };
        let mut p = run("exit 7");
        assert!(cause_of_death(&mut p).ends_with("exited with status 7"), "{}", cause_of_death(&mut p));
        let mut p = run("kill -9 $$");
        let c = cause_of_death(&mut p);
        assert!(c.contains("killed by signal 9"), "{c}");
        let mut p = run("sleep 30");
        assert!(cause_of_death(&mut p).contains("still runs"));
        assert!(respawn(&p).is_none(), "not an iopath device process");
    }

    #[test]
    fn reconnecting_to_a_socket_that_never_listens_ends_at_the_deadline() {
        let path = std::env::temp_dir().join(format!("iopath-respawn-{}.sock", std::process::id()));
        let e = reconnect(&path, Instant::now() + Duration::from_millis(100), Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("reconnecting to"), "{e}");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        reconnect(&path, Instant::now() + Duration::from_secs(1), Duration::from_millis(20)).unwrap();
        drop(l);
        let _ = std::fs::remove_file(&path);
    }
}
