//! The one interface a protocol implements, and the registry of them.
//!
//! A transport is a [`Transport`] (both sides of one protocol: the proxy the
//! VMM hosts, the server a device process runs) plus one entry in
//! [`TRANSPORTS`]. `attach` (the VMM side), `serve` (the device process),
//! the CLI and the benches find it there by name; none of them names a
//! protocol.

use crate::function::PciFunction;
use crate::process::DeviceProcess;
use crate::{mpqemu, vfio_user, Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::SharedDevice;
use std::fmt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// One out-of-process protocol, both sides.
pub trait Transport: Sync {
    /// The name in device specs and on the command line ("vfio-user").
    fn name(&self) -> &'static str;

    /// VMM side: the model the VMM hosts (a proxy) for the device process on
    /// `sock`, reported as `name`; `child` is the process if the VMM started it.
    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice>;

    /// Device side: the server of `f` in a device process, kept across
    /// clients. `irq` is where the clients' interrupt fds go.
    fn server(&self, f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Result<Box<dyn Server>>;

    /// True if the server announces the ioeventfds the device registers, so
    /// that guest writes to them go to the device process without a message
    /// (the benches run the eventfd rows over it).
    fn announces_ioeventfds(&self) -> bool {
        false
    }

    /// True if BAR pages the device shares (`DeviceModel::mapped_areas`)
    /// reach the client as memory it maps into the guest, so that guest
    /// stores to them cross no transport (NVMe `bar` mode).
    fn shares_bar_pages(&self) -> bool {
        true
    }

    /// True if QEMU's `-machine x-remote` serves this protocol
    /// (`DEVICE@TRANSPORT:qemu`).
    fn qemu_speaks(&self) -> bool {
        false
    }

    /// The proxy counter that counts what crossed the transport (at least
    /// one per access that reached the device process), and its unit in a
    /// table ("msgs").
    fn crossings(&self) -> (&'static str, &'static str);

    /// Device side: tells a client that came while another is served that
    /// the device is busy, within the socket's timeouts (`serve` sets
    /// them); the caller then closes it. By default nothing is said: the
    /// close is the answer.
    fn refuse(&self, _sock: &UnixStream) -> Result<()> {
        Ok(())
    }
}

/// A device process's side of one client.
pub trait Server: Send {
    /// Serves one client on `sock` until it leaves. `Ok` on a clean
    /// disconnect; `Err` says what broke the channel (the caller logs it with
    /// `peer` and closes the channel). The device state is kept for the next
    /// client.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()>;
}

/// Every transport, by name.
pub static TRANSPORTS: &[&dyn Transport] = &[
    &mpqemu::Mpqemu,
    &vfio_user::VfioUser,
    &vfio_user::ioregionfd::IoRegionFd { posted: false },
    &vfio_user::ioregionfd::IoRegionFd { posted: true },
];

/// The transport called `name`.
pub fn transport(name: &str) -> Result<&'static dyn Transport> {
    TRANSPORTS.iter().copied().find(|t| t.name() == name).ok_or_else(|| {
        let names: Vec<&str> = TRANSPORTS.iter().map(|t| t.name()).collect();
        Error::Config(format!("unknown transport {name:?} (one of {})", names.join(", ")))
    })
}

/// Transports are equal when their names are (a registry entry is one name).
impl PartialEq for dyn Transport + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for dyn Transport + '_ {}

impl fmt::Debug for dyn Transport + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_transport_is_found_by_its_name() {
        for t in TRANSPORTS {
            assert_eq!(transport(t.name()).unwrap(), *t);
        }
        let names: Vec<&str> = TRANSPORTS.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["mpqemu", "vfio-user", "ioregionfd", "ioregionfd-posted"]);
        let e = transport("carrier-pigeon").unwrap_err();
        assert!(matches!(e, Error::Config(_)) && e.to_string().contains("vfio-user"), "{e}");
    }
}
