//! Several controllers in one device process: `iopath serve DEVICE
//! --controllers N --socket PATH` with a `{}` in PATH, replaced by 0..N-1.
//!
//! Each controller is a device of its own (built from the same options,
//! with its own namespace data), on a socket of its own, served by the
//! function transport's loop (`mod.rs`) on a thread of its own
//! (`serve-ctrl-K`): one client at a time per socket, a counters line per
//! client as with one controller, with `"controller": K` added. Every
//! socket is bound (and checked) before any device is built; the process is
//! confined once, after every device is built; it ends when every
//! controller's loop has (`--once`: each after its first client), with the
//! first error any of them met.
//!
//! What they share is the poller pool, if there is one (`--pollers M`,
//! [`pool`]): M threads poll every controller's queue groups, so the
//! process's polling threads do not grow with N. Without it each
//! controller's queue groups have threads of their own, as in a process of
//! one controller.
//!
//! `--control PATH` with a `{}`: a control socket per controller, on that
//! controller's rules and namespaces only.
//!
//! Not here: a queue transport (vhost-user), an inherited fd (one socket).

use super::{bind, check_timeouts, clients_confined, Host, Listen, ServeOptions};
use crate::function::PciFunction;
use crate::transport::{FunctionTransport, Transport};
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::virtio::transport::MAX_QUEUES;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Controllers one process may serve (each has a socket janitor; the
/// janitors' signal handler reaches 64).
pub const MAX_CONTROLLERS: usize = 64;

/// The placeholder in `--socket` replaced by a controller's index.
pub const PLACEHOLDER: &str = "{}";

/// `--socket PATH`'s path for controller `i` of several.
pub fn socket_path(path: &Path, i: usize) -> Result<PathBuf> {
    indexed("--socket", path, i)
}

/// Option `opt`'s `path` for controller `i` of several (its `{}` replaced).
fn indexed(opt: &str, path: &Path, i: usize) -> Result<PathBuf> {
    let s = path.to_str().ok_or_else(|| Error::Config(format!("{opt} {}: not UTF-8", path.display())))?;
    if !s.contains(PLACEHOLDER) {
        return Err(Error::Config(format!(
            "{opt} {s}: several controllers need a {PLACEHOLDER} in the path (replaced by 0, 1, ...)"
        )));
    }
    Ok(PathBuf::from(s.replace(PLACEHOLDER, &i.to_string())))
}

/// Sets up the poller pool of `--pollers m` for `o`'s device: an nvme
/// controller whose queue groups are polled (`shm` or `bar`).
pub(super) fn pool(o: &ServeOptions, m: usize) -> Result<()> {
    use iopath_devices::nvme::DoorbellMode;
    match &o.device {
        iopath_devices::DeviceConfig::Nvme(c) if matches!(c.doorbell, DoorbellMode::Shm | DoorbellMode::Bar) => {}
        d => {
            return Err(Error::Config(format!(
                "--pollers: a pool of poller threads serves nvme with doorbell=shm or bar, not {d}"
            )))
        }
    }
    iopath_devices::nvme::pool::install(m).map_err(|e| Error::Config(format!("--pollers: {e}")))
}

/// A counters line with the controller's index added.
pub(super) fn with_index(line: &str, i: usize) -> String {
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(mut m)) => {
            m.insert("controller".into(), i.into());
            serde_json::Value::Object(m).to_string()
        }
        _ => line.to_string(),
    }
}

/// Serves `o.controllers` controllers (see the module doc).
pub(super) fn run(o: &ServeOptions) -> Result<()> {
    let n = o.controllers;
    if n == 0 || n > MAX_CONTROLLERS {
        return Err(Error::Config(format!("--controllers {n}: 1 ..= {MAX_CONTROLLERS}")));
    }
    let Transport::Function(transport) = o.transport else {
        return Err(Error::Config(format!(
            "--controllers: one controller per process with --transport {}",
            o.transport
        )));
    };
    let Listen::Socket(path) = &o.listen else {
        return Err(Error::Config("--controllers: several controllers need --socket PATH, not --fd".into()));
    };
    if let iopath_devices::DeviceConfig::Nvme(c) = &o.device {
        if c.any_file() {
            return Err(Error::Config(
                "--controllers: a file namespace would be every controller's; use backend=ram or null".into(),
            ));
        }
    }
    check_timeouts(&o.timeouts)?;
    let paths = (0..n).map(|i| socket_path(path, i)).collect::<Result<Vec<_>>>()?;
    for (i, p) in paths.iter().enumerate() {
        if paths[..i].contains(p) {
            return Err(Error::Config(format!("--socket: {} twice", p.display())));
        }
    }
    // A control socket per controller: `--control`'s `{}` too.
    let controls = match &o.control {
        Some(c) => {
            let cs = (0..n).map(|i| indexed("--control", c, i)).collect::<Result<Vec<_>>>()?;
            if let Some(p) = cs.iter().find(|p| paths.contains(p)) {
                return Err(Error::Config(format!("--control: {} is also a controller's --socket", p.display())));
            }
            cs
        }
        None => Vec::new(),
    };
    let mut bound = Vec::with_capacity(n);
    for p in &paths {
        bound.push(bind(&Listen::Socket(p.clone()))?);
    }
    // As `function` does, before any client memory is mapped.
    crate::sigbus::install()?;
    let config = o.device.with_default_queues(MAX_QUEUES);
    let mut hosts = Vec::with_capacity(n);
    // Served until the controllers' loops end (dropped after the scope).
    let mut controlled = Vec::with_capacity(controls.len());
    for i in 0..n {
        let device = config.build()?;
        if let Some(c) = controls.get(i) {
            let Some(rules) = device.injector() else {
                return Err(Error::Config(format!("--control: {} takes no error injection rules", o.device)));
            };
            controlled.push(super::control::Control::start(c, rules, Some(device.clone()))?);
        }
        let f = Arc::new(Mutex::new(PciFunction::new(device)?));
        let irq = IrqLines::new();
        let server = transport.server(f.clone(), irq.clone())?;
        hosts.push(Host { o, transport, f, irq, server, index: Some(i) });
    }
    // Confined once, when every controller's loop is set up (each waits
    // for the others there, then for the confinement, on every thread). A
    // controller whose thread ends before it gets there (a setup error, a
    // panic) fails the gate: the others end too, with that said.
    let gate = Gate::new(n);
    let confine = || -> Result<()> {
        if gate.arrive()? {
            let r = if o.seccomp { crate::seccomp::install().map_err(|e| e.to_string()) } else { Ok(()) };
            gate.confined(r);
        }
        gate.outcome()
    };
    let banner = format!("{config} over {} ({n} controllers)", transport.name());
    let listens: Vec<Listen> = paths.into_iter().map(Listen::Socket).collect();
    std::thread::scope(|scope| {
        let mut joins = Vec::with_capacity(n);
        for (i, ((mut host, b), listen)) in hosts.into_iter().zip(bound).zip(&listens).enumerate() {
            let banner = format!("{banner}: controller {i}");
            let refuse = Box::new(move |s: &UnixStream| transport_refuse(transport, s));
            let (confine, gate) = (&confine, &gate);
            let h = std::thread::Builder::new().name(format!("serve-ctrl-{i}")).spawn_scoped(scope, move || {
                let _left = Leaving(gate, i);
                clients_confined(listen, b, &banner, o.once, confine, &o.timeouts, refuse, |sock, peer, free| {
                    host.client(sock, peer, free)
                })
            });
            match h {
                Ok(h) => joins.push(h),
                Err(e) => {
                    gate.fail(format!("controller {i}'s thread did not start: {e}"));
                    return Err(Error::io(format!("the thread of controller {i}"), e));
                }
            }
        }
        let mut first = Ok(());
        for (i, j) in joins.into_iter().enumerate() {
            let r = j.join().unwrap_or_else(|_| Err(Error::Config(format!("controller {i}'s thread panicked"))));
            if let Err(e) = r {
                log::error!("controller {i}: {e}");
                // The failing controller's own error, not another's "not serving" from the gate.
                let echo = |e: &Error| e.to_string().contains("not serving: ");
                if first.as_ref().map_or_else(echo, |_| true) && (first.is_ok() || !echo(&e)) {
                    first = Err(e);
                }
            }
        }
        first
    })
}

/// The controllers' meeting point before the confinement: every one
/// arrives, or one fails and every waiting one ends with why.
struct Gate {
    n: usize,
    st: Mutex<GateState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct GateState {
    arrived: usize,
    failed: Option<String>,
    /// The confinement's outcome, set by the last to arrive.
    confined: Option<std::result::Result<(), String>>,
}

impl Gate {
    fn new(n: usize) -> Self {
        Gate { n, st: Mutex::new(GateState::default()), cv: std::sync::Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for all `n`; true for the last to arrive (it confines the
    /// process, then [`Gate::confined`]). Err if one failed first.
    fn arrive(&self) -> Result<bool> {
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(Error::Config(format!("not serving: {e}")));
        }
        st.arrived += 1;
        if st.arrived == self.n {
            return Ok(true);
        }
        while st.arrived < self.n && st.failed.is_none() {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        match &st.failed {
            Some(e) if st.arrived < self.n => Err(Error::Config(format!("not serving: {e}"))),
            _ => Ok(false),
        }
    }

    /// The last to arrive: the confinement's outcome.
    fn confined(&self, r: std::result::Result<(), String>) {
        self.lock().confined = Some(r);
        self.cv.notify_all();
    }

    /// Waits for the confinement's outcome (or a failure before it).
    fn outcome(&self) -> Result<()> {
        let mut st = self.lock();
        loop {
            match (&st.confined, &st.failed) {
                (Some(Ok(())), _) => return Ok(()),
                (Some(Err(e)), _) => return Err(Error::Config(format!("confining the process: {e}"))),
                (None, Some(e)) => return Err(Error::Config(format!("not serving: {e}"))),
                (None, None) => st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    /// A controller that will not arrive: the others stop waiting.
    fn fail(&self, why: String) {
        let mut st = self.lock();
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// Fails the gate if controller K's thread ends before the confinement
/// (an error, a panic); after it, a no-op.
struct Leaving<'a>(&'a Gate, usize);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        let done = self.0.lock().confined.is_some();
        if !done {
            let how = if std::thread::panicking() { "panicked" } else { "failed" };
            self.0.fail(format!("controller {} {how} while starting", self.1));
        }
    }
}

fn transport_refuse(t: &'static dyn FunctionTransport, s: &UnixStream) -> Result<()> {
    t.refuse(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_controller_failing_at_startup_ends_the_others_wait() {
        let gate = Gate::new(3);
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2).map(|_| s.spawn(|| gate.arrive().map(|_| ()))).collect();
            s.spawn(|| {
                // Controller 2 ends before it arrives (its setup failed).
                let _left = Leaving(&gate, 2);
            });
            for w in waiters {
                let e = w.join().unwrap().unwrap_err().to_string();
                assert!(e.contains("controller 2 failed while starting"), "{e}");
            }
        });
        // A late one is refused at once, and nobody waits for a confinement.
        assert!(gate.arrive().is_err());
        assert!(gate.outcome().is_err());
    }

    #[test]
    fn every_controller_arriving_confines_once() {
        let gate = Gate::new(3);
        let leaders = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for i in 0..3 {
                let (gate, leaders) = (&gate, &leaders);
                s.spawn(move || {
                    let _left = Leaving(gate, i);
                    if gate.arrive().unwrap() {
                        leaders.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        gate.confined(Ok(()));
                    }
                    gate.outcome().unwrap();
                });
            }
        });
        assert_eq!(leaders.into_inner(), 1);
        // Threads leaving after the confinement do not fail it.
        assert!(gate.lock().failed.is_none());
    }

    #[test]
    fn socket_paths() {
        let p = Path::new("/tmp/nvme-{}.sock");
        assert_eq!(socket_path(p, 3).unwrap(), PathBuf::from("/tmp/nvme-3.sock"));
        assert!(socket_path(Path::new("/tmp/nvme.sock"), 0).is_err());
    }

    #[test]
    fn index_in_the_counters_line() {
        let line = crate::process::disconnect_report("vfio-user", "nvme", &[]);
        let v: serde_json::Value = serde_json::from_str(&with_index(&line, 5)).unwrap();
        assert_eq!(v["controller"], 5);
        assert_eq!(v["event"], "disconnected");
        assert!(crate::process::parse_report(&with_index(&line, 5)).is_some());
    }
}
