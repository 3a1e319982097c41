//! A bound on one request of a session. The `vhost` crate retries a read
//! or write that times out (EAGAIN) for ever, so the socket's timeouts do
//! not bound a reply to a frontend that reads nothing: a watchdog thread
//! shuts the socket down when a request outlives its bound, which ends the
//! crate's wait with an error. Unlike the frontend's deadline
//! (`frontend/deadline.rs`), which outlives its owner for a moment, this
//! one is joined when dropped: the session gives back every fd it held,
//! its copy of the socket too, before it returns.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct State {
    /// When the request under way must be done.
    until: Option<Instant>,
    stop: bool,
    fired: bool,
}

type Shared = (Mutex<State>, Condvar);

/// The watchdog of one session's socket.
pub(super) struct Watchdog {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Watches `sock` (a copy of the session's).
    pub(super) fn new(sock: UnixStream) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        let handle = std::thread::Builder::new().name("vhost-blk-watchdog".into()).spawn(move || watch(&s, &sock))?;
        Ok(Watchdog { shared, handle: Some(handle) })
    }

    /// Runs `f` (one request), which must be done within `bound`; true in
    /// the second place if it was not (the socket is then shut down).
    pub(super) fn run<T>(&self, bound: Duration, f: impl FnOnce() -> T) -> (T, bool) {
        iopath_devices::lock(&self.shared.0).until = Some(Instant::now() + bound);
        self.shared.1.notify_all();
        let r = f();
        let mut st = iopath_devices::lock(&self.shared.0);
        st.until = None;
        (r, st.fired)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        iopath_devices::lock(&self.shared.0).stop = true;
        self.shared.1.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn watch((m, cv): &Shared, sock: &UnixStream) {
    let mut st = iopath_devices::lock(m);
    while !st.stop {
        let Some(at) = st.until else {
            st = iopath_devices::wait(cv, st, None);
            continue;
        };
        let now = Instant::now();
        if now < at {
            st = iopath_devices::wait(cv, st, Some(at - now));
            continue;
        }
        st.fired = true;
        st.until = None;
        let _ = sock.shutdown(Shutdown::Both);
    }
}
