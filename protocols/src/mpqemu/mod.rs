//! QEMU's multi-process protocol ("mpqemu", QEMU 6.0..), byte-compatible
//! with QEMU 7.2 on x86-64: the codec ([`wire`]), the VMM side
//! ([`MpqemuProxy`], what QEMU's `x-pci-proxy-dev` does) and the device side
//! ([`MpqemuServer`], what QEMU's `-machine x-remote` does).
//!
//! Every access is a request answered by RET: the vCPU waits for the device
//! process. BARs travel as the absolute addresses the guest programmed, so
//! both sides keep the header. Guest RAM goes over as memfds (SYNC_SYSMEM),
//! INTx as a KVM irqfd pair (SET_IRQFD); there are no ioeventfds and no MSI-X.

mod proxy;
mod server;
pub mod wire;

#[cfg(test)]
mod tests;

pub use proxy::MpqemuProxy;
pub use server::MpqemuServer;

use crate::function::PciFunction;
use crate::process::DeviceProcess;
use crate::transport::{FunctionTransport, Server};
use crate::Result;
use iopath_devices::irq::IrqLines;
use iopath_devices::SharedDevice;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// The mpqemu [`FunctionTransport`].
pub struct Mpqemu;

impl FunctionTransport for Mpqemu {
    fn name(&self) -> &'static str {
        "mpqemu"
    }

    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        let mut p = MpqemuProxy::connect(sock, child)?;
        p.set_name(name);
        Ok(Arc::new(Mutex::new(p)))
    }

    fn server(&self, f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Result<Box<dyn Server>> {
        Ok(Box::new(MpqemuServer::new(f, irq)))
    }

    fn qemu_speaks(&self) -> bool {
        true
    }

    /// mpqemu has no message that shares BAR memory: every access is BAR_WRITE/BAR_READ.
    fn shares_bar_pages(&self) -> bool {
        false
    }

    fn crossings(&self) -> (&'static str, &'static str) {
        (proxy::REQUESTS, "mpqemu msgs")
    }
}
