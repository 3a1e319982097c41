//! `iopath serve virtio-blk[,opts] --transport vhost-user (--socket PATH | --fd N)`:
//! the device process's loop, beside the PCI-function transports' one
//! ([`crate::serve`], whose listening, acceptor and stall bounds it shares):
//! one frontend at a time (another one that comes is closed), the device's
//! counters as one JSON line on stdout after each, the disk kept.

use super::VhostUserBackend;
use crate::process::disconnect_report;
use crate::serve::{bind, check_timeouts, clients, handshake, Listen, Timeouts};
use crate::Result;
use iopath_devices::virtio::pci::VirtioBlkConfig;
use std::io::Write;

/// The name on the command line and in the counters line.
pub const TRANSPORT: &str = "vhost-user";

/// What `iopath serve ... --transport vhost-user` was asked.
pub struct VhostUserServeOptions {
    pub device: VirtioBlkConfig,
    pub listen: Listen,
    /// Exit after the first frontend served (with a listening socket).
    pub once: bool,
    pub timeouts: Timeouts,
    /// Confine the process with seccomp once set up ([`crate::seccomp`]).
    pub seccomp: bool,
}

/// Serves until the inherited socket closes, or forever on a listening
/// socket (until the first frontend with `once`).
pub fn run(o: &VhostUserServeOptions) -> Result<()> {
    check_timeouts(&o.timeouts)?;
    let bound = bind(&o.listen)?;
    let dev = VhostUserBackend::new(&o.device)?;
    let spec = iopath_devices::DeviceConfig::VirtioBlk(o.device.clone());
    let banner = format!("{spec} over {TRANSPORT}");
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
        let line = disconnect_report(TRANSPORT, "virtio-blk", &dev.counters());
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        true
    })
}
