//! What a VMM-side proxy keeps about its device process: the socket, a
//! watcher that stops the run if the process goes away, the first error
//! (after which the proxy answers all-ones and sends nothing), and the
//! process's own counters once the session ends.

use crate::process::DeviceProcess;
use crate::{Error, Result};
use iopath_devices::{Counter, FailFn};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a proxy waits for its device process to answer before the run stops.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Peer {
    pub sock: UnixStream,
    pub name: String,
    pub fail: Option<FailFn>,
    /// The first error, after which the peer is given up on.
    pub dead: Option<String>,
    watching: Arc<AtomicBool>,
    child: Option<DeviceProcess>,
    /// The device process's counters, reported when the session ended.
    pub remote: Vec<Counter>,
}

impl Peer {
    pub fn new(sock: UnixStream, name: &str, child: Option<DeviceProcess>) -> Self {
        // A device process that stops answering must not hold the vCPU forever.
        let _ = sock.set_read_timeout(Some(REPLY_TIMEOUT));
        let _ = sock.set_write_timeout(Some(REPLY_TIMEOUT));
        Peer {
            sock,
            name: name.to_string(),
            fail: None,
            dead: None,
            watching: Arc::new(AtomicBool::new(false)),
            child,
            remote: Vec::new(),
        }
    }

    /// Records the first error and stops the run through the fail hook.
    pub fn die(&mut self, e: &Error) {
        if self.dead.is_none() {
            self.watching.store(false, Ordering::Release);
            if let Some(f) = &self.fail {
                f(format!("{}: {e}", self.name));
            }
            self.dead = Some(e.to_string());
        }
    }

    /// `Err(PeerGone)` once the peer is given up on: nothing more is sent.
    pub fn alive(&self) -> Result<()> {
        match &self.dead {
            Some(e) => Err(Error::PeerGone(e.clone())),
            None => Ok(()),
        }
    }

    /// Watches the socket: a device process that dies stops the run.
    pub fn watch(&self) {
        let (Ok(sock), Some(fail)) = (self.sock.try_clone(), self.fail.clone()) else {
            return;
        };
        let on = self.watching.clone();
        on.store(true, Ordering::Release);
        let name = self.name.clone();
        let _ = std::thread::Builder::new().name("peer-watch".into()).spawn(move || {
            while on.load(Ordering::Acquire) {
                if crate::socket::peer_closed(&sock, 100) {
                    if on.swap(false, Ordering::AcqRel) {
                        fail(format!("{name}: the device process closed its socket (did it die?)"));
                    }
                    return;
                }
            }
        });
    }

    /// Ends the session; a device process the VMM started reports its counters.
    pub fn end(&mut self) {
        self.watching.store(false, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        if let Some(child) = &mut self.child {
            match child.counters(Duration::from_secs(5)) {
                Ok(c) => self.remote = c,
                Err(e) => log::warn!("{}: {e}", self.name),
            }
        }
    }
}

impl Drop for Peer {
    /// Stops the watcher (it holds a copy of the socket) and ends the session.
    fn drop(&mut self) {
        self.watching.store(false, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}
