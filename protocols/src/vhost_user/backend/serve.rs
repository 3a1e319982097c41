//! `iopath serve virtio-blk[,opts] --transport vhost-user (--socket PATH | --fd N)`:
//! the device process's loop, beside the function transports' one
//! ([`crate::serve`], whose listening, acceptor and stall bounds it shares):
//! one frontend at a time (another one that comes is closed), the device's
//! counters as one JSON line on stdout after each, the disk kept.

use super::VhostUserBackend;
use crate::process::disconnect_report;
use crate::serve::{bind, check_timeouts, clients, handshake, ServeOptions};
use crate::transport::{refusal, QueueTransport};
use crate::{Error, Result};
use iopath_devices::virtio::pci::NotifyMode;
use iopath_devices::DeviceConfig;
use std::io::Write;

/// Serves `o.device` (a virtio-blk) over `t` until the inherited socket
/// closes, or forever on a listening socket (until the first frontend with
/// `o.once`). `o.keep_state` is refused: a frontend that reconnects sets
/// the rings up again, and the disk is kept anyway.
pub fn serve(t: &dyn QueueTransport, o: &ServeOptions) -> Result<()> {
    let name = t.name();
    let DeviceConfig::VirtioBlk(device) = &o.device else { return Err(refusal(t, o.device.name())) };
    if o.keep_state {
        return Err(Error::Config(format!(
            "--keep-state does not apply to --transport {name}: a {name} frontend sets the rings up again when it reconnects"
        )));
    }
    if o.control.is_some() {
        return Err(Error::Config(format!("--control: virtio-blk over {name} takes no error injection rules yet")));
    }
    check_timeouts(&o.timeouts)?;
    // A backend is always kicked through an eventfd: notify=exit (the
    // default) means nothing here and is served, and shown, as ioeventfd.
    let mut device = device.clone();
    if device.notify == NotifyMode::Exit {
        device.notify = NotifyMode::Ioeventfd;
    }
    let bound = bind(&o.listen)?;
    let dev = VhostUserBackend::new(&device)?;
    let banner = format!("{} over {name}", DeviceConfig::VirtioBlk(device));
    let refuse = Box::new(|_: &std::os::unix::net::UnixStream| Ok(()));
    clients(&o.listen, bound, &banner, o.once, o.seccomp, &o.timeouts, refuse, |sock, peer, free| {
        let what = format!("{banner}: {peer}");
        if !handshake(&sock, &o.timeouts, &what) {
            free();
            return false;
        }
        if let Err(e) = dev.session(&sock) {
            log::error!("{what}: {e}; closing its channel");
        }
        drop(sock);
        free();
        let line = disconnect_report(name, t.device(), &dev.counters());
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        true
    })
}
