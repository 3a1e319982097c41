//! The device process: `iopath serve DEVICE --transport T (--socket PATH | --fd N)`.
//!
//! One device model, one client at a time, whatever the transport: the
//! transport's [`Server`](crate::Server) serves each client. After each client leaves, the
//! process prints the device's counters as one JSON line on stdout and (on a
//! listening socket) waits for the next client with the device state kept,
//! as the vfio-user spec asks. A protocol error closes that client's channel
//! with a log line naming the client and the message; the process goes on.

use crate::function::PciFunction;
use crate::process::disconnect_report;
use crate::transport::Transport;
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub enum Listen {
    /// An inherited, connected socket: serve it, then exit.
    Fd(i32),
    /// Listen on this path (removed first if it is a stale socket).
    Socket(PathBuf),
}

pub struct ServeOptions {
    pub device: iopath_devices::DeviceConfig,
    pub transport: &'static dyn Transport,
    pub listen: Listen,
    /// Exit after the first client (with a listening socket).
    pub once: bool,
    /// Confine the process with seccomp once it is set up ([`crate::seccomp`]).
    pub seccomp: bool,
}

/// Serves until the inherited socket closes, or forever on a listening socket.
pub fn run(o: &ServeOptions) -> Result<()> {
    let f = Arc::new(Mutex::new(PciFunction::new(o.device.build()?)?));
    let irq = IrqLines::new();
    let mut server = o.transport.server(f.clone(), irq.clone())?;
    let mut session = |sock: &UnixStream, peer: &str| {
        if let Err(e) = server.session(sock, peer) {
            log::error!("{} over {}: {peer}: {e}; closing its channel", o.device, o.transport.name());
        }
        irq.clear_intx();
        irq.clear_msix();
        let line = disconnect_report(o.transport.name(), o.device.name(), &iopath_devices::lock(&f).counters());
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    match &o.listen {
        Listen::Fd(fd) => {
            if *fd < 0 {
                return Err(Error::Config(format!("bad fd {fd}")));
            }
            // SAFETY: the fd was handed to this process to own (see DeviceProcess::spawn).
            let sock = unsafe { UnixStream::from_raw_fd(*fd) };
            if o.seccomp {
                crate::seccomp::install()?;
            }
            session(&sock, &format!("fd {fd}"));
        }
        Listen::Socket(path) => {
            if path.exists() && UnixStream::connect(path).is_err() {
                let _ = std::fs::remove_file(path);
            }
            let l =
                UnixListener::bind(path).map_err(|e| Error::io(format!("cannot listen on {}", path.display()), e))?;
            eprintln!("iopath serve: {} over {} on {}", o.device, o.transport.name(), path.display());
            if o.seccomp {
                crate::seccomp::install()?;
            }
            for (n, conn) in l.incoming().enumerate() {
                match conn {
                    Ok(sock) => session(&sock, &format!("client {} on {}", n + 1, path.display())),
                    Err(e) => log::warn!("accept on {}: {e}", path.display()),
                }
                if o.once {
                    break;
                }
            }
        }
    }
    Ok(())
}
