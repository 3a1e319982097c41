//! A bound on vhost-user requests. The `vhost` crate retries a read or
//! write that times out (EAGAIN) for ever, so a socket timeout cannot bound
//! a backend that does not answer; instead a watchdog thread shuts the
//! socket down when a request outlives its deadline, which ends the
//! crate's wait with an error. The caller gives the deadline, one for a
//! whole sequence of requests (connect, DRIVER_OK, reset).

use iopath_devices::FailFn;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Default)]
struct Armed {
    /// The request under way and when it must be done.
    current: Option<(String, Instant)>,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    armed: Mutex<Armed>,
    cv: Condvar,
    fired: AtomicBool,
    /// Told first when the deadline passes (the run stops with this message).
    fail: Mutex<Option<FailFn>>,
}

/// The watchdog of one frontend's socket.
pub struct Deadline {
    shared: Arc<Shared>,
}

impl Deadline {
    /// Watches `sock` (a copy of the frontend's). `watching` is the peer
    /// watcher's flag (`Peer::watching`), cleared before the watchdog shuts
    /// the socket down, so that the shutdown is not reported again as a
    /// backend that closed its socket.
    pub fn new(sock: UnixStream, name: &str, watching: Arc<AtomicBool>) -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let (s, name) = (shared.clone(), name.to_string());
        std::thread::Builder::new()
            .name("vhost-user-deadline".into())
            .spawn(move || watch(&s, &sock, &name, &watching))?;
        Ok(Deadline { shared })
    }

    /// The run's fail hook, once the device is attached.
    pub fn set_fail(&self, fail: FailFn) {
        *iopath_devices::lock(&self.shared.fail) = Some(fail);
    }

    /// Runs `f` (one request) that must be done by `at`; true in the second
    /// place if the deadline passed (the socket is then shut down).
    pub fn run<T>(&self, what: &str, at: Instant, f: impl FnOnce() -> T) -> (T, bool) {
        if self.shared.fired.load(Ordering::Acquire) {
            return (f(), true);
        }
        iopath_devices::lock(&self.shared.armed).current = Some((what.to_string(), at));
        self.shared.cv.notify_all();
        let r = f();
        iopath_devices::lock(&self.shared.armed).current = None;
        (r, self.shared.fired.load(Ordering::Acquire))
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        iopath_devices::lock(&self.shared.armed).stop = true;
        self.shared.cv.notify_all();
    }
}

fn watch(s: &Shared, sock: &UnixStream, name: &str, watching: &AtomicBool) {
    let mut a = iopath_devices::lock(&s.armed);
    loop {
        if a.stop {
            return;
        }
        let Some((what, at)) = a.current.clone() else {
            a = iopath_devices::wait(&s.cv, a, None);
            continue;
        };
        let now = Instant::now();
        if now < at {
            a = iopath_devices::wait(&s.cv, a, Some(at - now));
            continue;
        }
        s.fired.store(true, Ordering::Release);
        a.current = None;
        if let Some(fail) = iopath_devices::lock(&s.fail).clone() {
            fail(format!("{name}: the vhost-user backend did not answer {what}: timed out; device needs reset"));
        }
        // The cause is given: the peer watcher must not see the shutdown as another.
        watching.store(false, Ordering::Release);
        let _ = sock.shutdown(Shutdown::Both);
        return;
    }
}
