//! The registry of out-of-process protocols, and the two kinds of them.
//!
//! A transport carries either a whole PCI function or a device's queues:
//! - [`FunctionTransport`] (mpqemu, vfio-user, ioregionfd): the device
//!   process hosts the model with its registers, configuration space and
//!   interrupts; the VMM hosts a proxy that forwards accesses to it. Any
//!   device model goes over one.
//! - [`QueueTransport`] (vhost-user): the function stays in the VMM (its
//!   virtio registers, configuration and interrupts); a backend in another
//!   process serves its queues in the guest's RAM, kicked and calling back
//!   through eventfds. Only the device it is made for goes over one.
//!
//! [`TRANSPORTS`] holds both as a [`Transport`]. `attach` (`--device`),
//! `serve` (`iopath serve --transport`) and the benches find one there by
//! name, and none of them names a protocol; [`Transport::carries`] says,
//! before anything starts, whether a device can go over it.

use crate::function::PciFunction;
use crate::process::DeviceProcess;
use crate::serve::ServeOptions;
use crate::{mpqemu, vfio_user, vhost_user, Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::{DeviceConfig, SharedDevice};
use std::fmt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// A protocol that carries a whole PCI function, both sides.
pub trait FunctionTransport: Sync {
    /// The name in device specs and on the command line ("vfio-user").
    fn name(&self) -> &'static str;

    /// VMM side: the model the VMM hosts (a proxy) for the device process on
    /// `sock`, reported as `name`; `child` is the process if the VMM started it.
    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice>;

    /// [`connect`](Self::connect) as `cfg` asks; a transport without
    /// state memory ([`offers_state_memory`](Self::offers_state_memory)
    /// false) has no use for it and connects as `connect`.
    fn connect_with(
        &self,
        sock: UnixStream,
        child: Option<DeviceProcess>,
        name: &str,
        cfg: &vfio_user::ProxyConfig,
    ) -> Result<SharedDevice> {
        let _ = cfg;
        self.connect(sock, child, name)
    }

    /// True if the VMM side offers a device state memory to keep its state
    /// in over this transport (`ProxyConfig::state_memory` turns it off).
    fn offers_state_memory(&self) -> bool {
        false
    }

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

/// A device process's side of one client of a [`FunctionTransport`].
pub trait Server: Send {
    /// Serves one client on `sock` until it leaves. `Ok` on a clean
    /// disconnect; `Err` says what broke the channel (the caller logs it with
    /// `peer` and closes the channel). The device state is kept for the next
    /// client.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()>;
}

/// A protocol that carries the queues of one device whose function stays in
/// the VMM, both sides: the frontend (the VMM's) and iopath's backend.
pub trait QueueTransport: Sync {
    /// The name in device specs and on the command line ("vhost-user").
    fn name(&self) -> &'static str;

    /// The device model whose queues it carries (a [`DeviceConfig`] name,
    /// "virtio-blk"): the function its frontend makes.
    fn device(&self) -> &'static str;

    /// `NAME:PATH` in a device spec: whatever backend of [`device`](Self::device)
    /// listens on PATH, iopath's or not ("vhost-user-blk").
    fn any_backend(&self) -> &'static str;

    /// VMM side: the function the VMM hosts, with `queues` queues that the
    /// backend on `sock` serves; `child` is the backend's process if the VMM
    /// started it.
    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, queues: u16) -> Result<SharedDevice>;

    /// [`connect`](Self::connect), and when the backend dies its session is
    /// started again as `again` says (a new process or the same socket), if
    /// the transport can; by default it cannot, and a death stops the run.
    fn connect_again(
        &self,
        sock: UnixStream,
        child: Option<DeviceProcess>,
        queues: u16,
        again: Option<crate::respawn::Reconnect>,
    ) -> Result<SharedDevice> {
        let _ = again;
        self.connect(sock, child, queues)
    }

    /// Device side: `iopath serve`'s loop, iopath's backend of `o.device`
    /// (one [`device`](Self::device) names) to one frontend after another.
    fn serve(&self, o: &ServeOptions) -> Result<()>;
}

/// One protocol of the registry, by what it carries.
#[derive(Clone, Copy)]
pub enum Transport {
    /// The whole PCI function in a device process (vfio-user, mpqemu, ioregionfd).
    Function(&'static dyn FunctionTransport),
    /// The function in the VMM, its queues served by a backend (vhost-user).
    Queues(&'static dyn QueueTransport),
}

/// Every transport, by name: the function transports, then the queue transports.
pub static TRANSPORTS: &[Transport] = &[
    Transport::Function(&mpqemu::Mpqemu),
    Transport::Function(&vfio_user::VfioUser),
    Transport::Function(&vfio_user::ioregionfd::IoRegionFd { posted: false }),
    Transport::Function(&vfio_user::ioregionfd::IoRegionFd { posted: true }),
    Transport::Queues(&vhost_user::VhostUser),
];

/// The transport called `name`.
pub fn transport(name: &str) -> Result<Transport> {
    TRANSPORTS.iter().copied().find(|t| t.name() == name).ok_or_else(|| {
        let names: Vec<&str> = TRANSPORTS.iter().map(|t| t.name()).collect();
        Error::Config(format!("unknown transport {name:?} (one of {})", names.join(", ")))
    })
}

/// The function transports, in registry order.
pub fn function_transports() -> impl Iterator<Item = &'static dyn FunctionTransport> {
    TRANSPORTS.iter().filter_map(|t| t.function())
}

impl Transport {
    /// The name in device specs and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Function(t) => t.name(),
            Transport::Queues(t) => t.name(),
        }
    }

    /// The function transport, if this is one.
    pub fn function(self) -> Option<&'static dyn FunctionTransport> {
        match self {
            Transport::Function(t) => Some(t),
            Transport::Queues(_) => None,
        }
    }

    /// The function transport `device` (a [`DeviceConfig`] name) goes over
    /// as a whole PCI function in a device process: this one, or
    /// [`Error::Carry`] for a queue transport.
    pub fn function_for(self, device: &str) -> Result<&'static dyn FunctionTransport> {
        match self {
            Transport::Function(t) => Ok(t),
            Transport::Queues(q) => Err(refusal(q, device)),
        }
    }

    /// `Ok` if `device` can go over this transport: any over a function
    /// transport, the one it is made for over a queue transport.
    pub fn carries(self, device: &DeviceConfig) -> Result<()> {
        match self {
            Transport::Queues(q) if device.name() != q.device() => Err(refusal(q, device.name())),
            _ => Ok(()),
        }
    }

    /// True if QEMU's `-machine x-remote` serves this protocol.
    pub fn qemu_speaks(self) -> bool {
        self.function().is_some_and(|t| t.qemu_speaks())
    }
}

/// What a queue transport says to `device`, which it does not carry as a
/// PCI function in a device process.
pub(crate) fn refusal(q: &dyn QueueTransport, device: &str) -> Error {
    let functions: Vec<&str> = function_transports().map(|t| t.name()).collect();
    Error::Carry {
        transport: q.name(),
        device: device.to_string(),
        why: format!(
            "it carries {dev}'s queues only, the function staying in the VMM ({dev}@{name}, {any}:PATH); \
             {device} in a device process goes over a function transport ({})",
            functions.join(", "),
            dev = q.device(),
            name = q.name(),
            any = q.any_backend(),
        ),
    }
}

/// Transports are equal when their names are (a registry entry is one name).
impl PartialEq for Transport {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Transport {}

impl fmt::Debug for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

impl PartialEq for dyn FunctionTransport + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for dyn FunctionTransport + '_ {}

impl fmt::Debug for dyn FunctionTransport + '_ {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<&'static dyn FunctionTransport> for Transport {
    fn from(t: &'static dyn FunctionTransport) -> Self {
        Transport::Function(t)
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
        assert_eq!(names, ["mpqemu", "vfio-user", "ioregionfd", "ioregionfd-posted", "vhost-user"]);
        let functions: Vec<&str> = function_transports().map(|t| t.name()).collect();
        assert_eq!(functions, ["mpqemu", "vfio-user", "ioregionfd", "ioregionfd-posted"]);
        assert!(matches!(transport("vhost-user").unwrap(), Transport::Queues(_)));
        let e = transport("carrier-pigeon").unwrap_err();
        assert!(matches!(e, Error::Config(_)) && e.to_string().contains("vfio-user"), "{e}");
    }

    #[test]
    fn a_queue_transport_carries_its_device_only() {
        let vu = transport("vhost-user").unwrap();
        let blk: DeviceConfig = "virtio-blk".parse().unwrap();
        assert!(vu.carries(&blk).is_ok());
        for d in ["nvme", "pci-testdev", "iopath-doorbell"] {
            let e = vu.carries(&d.parse().unwrap()).unwrap_err();
            assert!(matches!(&e, Error::Carry { transport: "vhost-user", device, .. } if device == d), "{e}");
            let text = e.to_string();
            assert!(text.starts_with(&format!("vhost-user cannot carry {d}: ")), "{text}");
            assert!(text.contains("virtio-blk@vhost-user") && text.contains("vfio-user"), "{text}");
        }
        let e = vu.function_for("nvme").map(|t| t.name()).unwrap_err();
        assert!(matches!(e, Error::Carry { .. }), "{e}");
        assert!(vu.function().is_none() && !vu.qemu_speaks());
        for t in function_transports() {
            let t = Transport::from(t);
            for d in ["nvme", "pci-testdev", "iopath-doorbell", "virtio-blk"] {
                assert!(t.carries(&d.parse().unwrap()).is_ok(), "{t} {d}");
            }
            assert_eq!(t.function_for("nvme").unwrap().name(), t.name());
        }
    }
}
