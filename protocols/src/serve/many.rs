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
//! Not here: a queue transport (vhost-user), an inherited fd (one socket),
//! and the control socket (it serves one device's rules).

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
    let s = path.to_str().ok_or_else(|| Error::Config(format!("--socket {}: not UTF-8", path.display())))?;
    if !s.contains(PLACEHOLDER) {
        return Err(Error::Config(format!(
            "--socket {s}: several controllers need a {PLACEHOLDER} in the path (replaced by 0, 1, ...)"
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
    if o.control.is_some() {
        return Err(Error::Config("--control serves one controller's rules: not with --controllers".into()));
    }
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
    let mut bound = Vec::with_capacity(n);
    for p in &paths {
        bound.push(bind(&Listen::Socket(p.clone()))?);
    }
    // As `function` does, before any client memory is mapped.
    crate::sigbus::install()?;
    let config = o.device.with_default_queues(MAX_QUEUES);
    let mut hosts = Vec::with_capacity(n);
    for i in 0..n {
        let device = config.build()?;
        let f = Arc::new(Mutex::new(PciFunction::new(device)?));
        let irq = IrqLines::new();
        let server = transport.server(f.clone(), irq.clone())?;
        hosts.push(Host { o, transport, f, irq, server, index: Some(i) });
    }
    // Confined once, when every controller's loop is set up (each waits
    // for the others there, then for the confinement, on every thread).
    let ready = std::sync::Barrier::new(n);
    let confined = std::sync::Barrier::new(n);
    let outcome: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    let confine = || -> Result<()> {
        if ready.wait().is_leader() {
            let r = if o.seccomp { crate::seccomp::install().map_err(|e| e.to_string()) } else { Ok(()) };
            let _ = outcome.set(r);
        }
        confined.wait();
        match outcome.get() {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(Error::Config(format!("confining the process: {e}"))),
            None => Err(Error::Config("confining the process: no outcome".into())),
        }
    };
    let banner = format!("{config} over {} ({n} controllers)", transport.name());
    let listens: Vec<Listen> = paths.into_iter().map(Listen::Socket).collect();
    std::thread::scope(|scope| {
        let mut joins = Vec::with_capacity(n);
        for (i, ((mut host, b), listen)) in hosts.into_iter().zip(bound).zip(&listens).enumerate() {
            let banner = format!("{banner}: controller {i}");
            let refuse = Box::new(move |s: &UnixStream| transport_refuse(transport, s));
            let confine = &confine;
            let h = std::thread::Builder::new().name(format!("serve-ctrl-{i}")).spawn_scoped(scope, move || {
                clients_confined(listen, b, &banner, o.once, confine, &o.timeouts, refuse, |sock, peer, free| {
                    host.client(sock, peer, free)
                })
            });
            match h {
                Ok(h) => joins.push(h),
                Err(e) => return Err(Error::io(format!("the thread of controller {i}"), e)),
            }
        }
        let mut first = Ok(());
        for (i, j) in joins.into_iter().enumerate() {
            let r = j.join().unwrap_or_else(|_| Err(Error::Config(format!("controller {i}'s thread panicked"))));
            if let Err(e) = r {
                log::error!("controller {i}: {e}");
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    })
}

fn transport_refuse(t: &'static dyn FunctionTransport, s: &UnixStream) -> Result<()> {
    t.refuse(s)
}

#[cfg(test)]
mod tests {
    use super::*;

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
