//! The device process: `iopath serve DEVICE --transport T (--socket PATH | --fd N)`.
//!
//! One device model, one client at a time. After each client leaves, the
//! process prints the device's counters as one JSON line on stdout and (on a
//! listening socket) waits for the next client with the device state kept,
//! as the vfio-user spec asks. A protocol error closes that client's channel
//! with a log line naming the client and the message; the process goes on.

use crate::attach::Transport;
use crate::function::PciFunction;
use iopath_devices::irq::IrqLines;
use crate::process::disconnect_report;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use crate::vfio_user::ServerState;
use std::sync::{Arc, Mutex};

pub enum Listen {
    /// An inherited, connected socket: serve it, then exit.
    Fd(i32),
    /// Listen on this path (removed first if it is a stale socket).
    Socket(PathBuf),
}

pub struct ServeOptions {
    pub device: iopath_devices::DeviceConfig,
    pub transport: Transport,
    pub listen: Listen,
    /// Exit after the first client (with a listening socket).
    pub once: bool,
}

/// Serves until the inherited socket closes, or forever on a listening socket.
pub fn run(o: &ServeOptions) -> Result<(), String> {
    let dev = o.device.build().map_err(|e| e.to_string())?;
    let f = Arc::new(Mutex::new(PciFunction::new(dev)?));
    let irq = IrqLines::new();
    let mut state = match o.transport {
        Transport::Mpqemu => None,
        t => Some(ServerState::new(&f, t, irq.clone())),
    };
    match &o.listen {
        Listen::Fd(fd) => {
            if *fd < 0 {
                return Err(format!("bad fd {fd}"));
            }
            // SAFETY: the fd was handed to this process to own (see DeviceProcess::spawn).
            let sock = unsafe { UnixStream::from_raw_fd(*fd) };
            session(o, &sock, &f, &irq, &mut state, &format!("fd {fd}"));
        }
        Listen::Socket(path) => {
            if path.exists() && UnixStream::connect(path).is_err() {
                let _ = std::fs::remove_file(path);
            }
            let l = UnixListener::bind(path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
            eprintln!("iopath serve: {} over {} on {}", o.device, o.transport.name(), path.display());
            for (n, conn) in l.incoming().enumerate() {
                match conn {
                    Ok(sock) => session(o, &sock, &f, &irq, &mut state, &format!("client {} on {}", n + 1, path.display())),
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

fn session(
    o: &ServeOptions,
    sock: &UnixStream,
    f: &Arc<Mutex<PciFunction>>,
    irq: &Arc<IrqLines>,
    state: &mut Option<ServerState>,
    peer: &str,
) {
    let r = match state {
        None => crate::mpqemu::serve(sock, &mut f.lock().unwrap(), irq),
        Some(st) => crate::vfio_user::serve(sock, f, irq, st),
    };
    if let Err(e) = r {
        log::error!("{} over {}: {peer}: {e}; closing its channel", o.device, o.transport.name());
    }
    irq.clear_intx();
    irq.clear_msix();
    let line = disconnect_report(o.transport.name(), o.device.name(), &f.lock().unwrap().counters());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
