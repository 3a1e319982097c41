//! What a VMM-side proxy keeps about its device process: the socket, a
//! watcher that stops the run if the process goes away, the first error
//! (after which the proxy answers all-ones and sends nothing), and the
//! process's own counters once the session ends.

use crate::process::DeviceProcess;
use crate::{Error, Result};
use iopath_devices::{Counter, FailFn};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
    /// Watcher threads started: one per peer at most.
    watchers: std::sync::atomic::AtomicUsize,
    /// The fail hook the watcher calls (the latest `watch` was given).
    watch_fail: Arc<Mutex<Option<FailFn>>>,
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
            watchers: Default::default(),
            watch_fail: Arc::default(),
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

    /// Watches the socket: a device process that dies stops the run
    /// (through `fail`). One watcher per peer: a second call (a device
    /// attached again) only gives it the current fail hook.
    pub fn watch(&self) {
        if self.fail.is_none() {
            return;
        }
        *iopath_devices::lock(&self.watch_fail) = self.fail.clone();
        if self.watchers.load(Ordering::Acquire) > 0 {
            return;
        }
        let Ok(sock) = self.sock.try_clone() else { return };
        let (on, fail) = (self.watching.clone(), self.watch_fail.clone());
        on.store(true, Ordering::Release);
        let name = self.name.clone();
        self.watchers.fetch_add(1, Ordering::AcqRel);
        let _ = std::thread::Builder::new().name("peer-watch".into()).spawn(move || {
            while on.load(Ordering::Acquire) {
                if crate::socket::peer_closed(&sock, 100) {
                    let hook = iopath_devices::lock(&fail).clone();
                    if let (true, Some(fail)) = (on.swap(false, Ordering::AcqRel), hook) {
                        fail(format!("{name}: the device process closed its socket (did it die?)"));
                    }
                    return;
                }
            }
        });
    }

    /// The watcher's flag: whoever shuts the socket down for a cause it
    /// reported itself clears it first, so the watcher says nothing.
    pub fn watching(&self) -> Arc<AtomicBool> {
        self.watching.clone()
    }

    /// How many watcher threads were started.
    pub fn watchers(&self) -> usize {
        self.watchers.load(Ordering::Relaxed)
    }

    /// Ends the session; a device process the VMM started reports its counters.
    pub fn end(&mut self) {
        if let Some(mut child) = self.hang_up() {
            let c = Self::counters_of(&mut child, &self.name);
            self.ended(child, c);
        }
    }

    /// Ends the session and hands out the device process, if any, so that
    /// its counters can be waited for ([`Self::counters_of`]) without
    /// holding whatever lock the peer is behind; give it back with [`Self::ended`].
    pub fn hang_up(&mut self) -> Option<DeviceProcess> {
        self.watching.store(false, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        self.child.take()
    }

    /// The counters `child` reports once its session ended (waits up to 5 s).
    pub fn counters_of(child: &mut DeviceProcess, name: &str) -> Vec<Counter> {
        child.counters(Duration::from_secs(5)).unwrap_or_else(|e| {
            log::warn!("{name}: {e}");
            Vec::new()
        })
    }

    /// Takes back the device process [`Self::hang_up`] gave, and its counters.
    pub fn ended(&mut self, child: DeviceProcess, counters: Vec<Counter>) {
        self.child = Some(child);
        self.remote = counters;
    }
}

impl Drop for Peer {
    /// Stops the watcher (it holds a copy of the socket) and ends the session.
    fn drop(&mut self) {
        self.watching.store(false, Ordering::Release);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}
