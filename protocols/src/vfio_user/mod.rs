//! vfio-user (QEMU `docs/interop/vfio-user.rst`; libvfio-user): the codec
//! ([`wire`]), the VMM side ([`VfioUserProxy`]) and the device side
//! ([`VfioUserServer`]); [`ioregionfd`] is this project's extension of it.
//!
//! The server is a PCI device with 9 regions (BAR0..5, ROM, config, VGA) and
//! 5 IRQ indexes. Guest RAM comes as DMA_MAP with the memfd and is mapped in
//! the device process; a map without an fd (QEMU's RAM without `share=on`)
//! is reached with DMA_READ/DMA_WRITE messages to the client, on the same
//! socket, from whichever thread the device accesses it (`server/link.rs`).
//! The proxy answers DMA_READ/DMA_WRITE from guest RAM while it waits for a
//! reply (it always shares RAM with an fd). BAR accesses arrive as REGION_READ/WRITE, as KVM ioeventfds the
//! client installed from GET_REGION_IO_FDS (type IOEVENTFD), or, with
//! ioregionfd, on region fds the server announced (type IOREGIONFD). INTx
//! and MSI-X eventfds come with SET_IRQS; the client makes them KVM irqfds.
//! A client that disconnects leaves the device state in place here: DMA maps,
//! IRQ fds and region fds are dropped, the device keeps its registers (then
//! `iopath serve` resets the device, unless `--keep-state`). A client that
//! comes while another is served gets EBUSY to its first message.

pub mod ioregionfd;
pub(crate) mod proxy;
mod server;
pub mod wire;

#[cfg(test)]
mod tests;

pub use proxy::{
    ProxyConfig, StateMemoryMode, VfioUserProxy, BURST_WINDOW, MAX_BURST, RECONNECTS, RESPAWN_WINDOW,
    STATE_MEMORY_BYTES,
};
pub use server::{IoFds, VfioUserServer};

use crate::function::PciFunction;
use crate::process::DeviceProcess;
use crate::transport::{FunctionTransport, Server};
use crate::{socket, Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::SharedDevice;
use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use wire::{Header, HEADER_SIZE};

/// Config space as a vfio-user region (a conventional PCI header).
const CONFIG_REGION_SIZE: u64 = 256;
/// Most fds this side takes with one message (its `max_msg_fds`).
const MAX_FDS: u32 = 16;

/// The vfio-user [`FunctionTransport`]: accesses as messages, and the ioeventfds the
/// device registers announced to the client.
pub struct VfioUser;

impl FunctionTransport for VfioUser {
    fn name(&self) -> &'static str {
        "vfio-user"
    }

    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        VfioUserProxy::shared(sock, child, name)
    }

    fn connect_with(
        &self,
        sock: UnixStream,
        child: Option<DeviceProcess>,
        name: &str,
        cfg: &ProxyConfig,
    ) -> Result<SharedDevice> {
        VfioUserProxy::shared_with(sock, child, name, *cfg)
    }

    fn offers_state_memory(&self) -> bool {
        true
    }

    fn server(&self, f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Result<Box<dyn Server>> {
        Ok(Box::new(VfioUserServer::new(f, irq, IoFds::IoEventFds)))
    }

    fn announces_ioeventfds(&self) -> bool {
        true
    }

    fn crossings(&self) -> (&'static str, &'static str) {
        (proxy::REQUESTS, "vfio-user msgs")
    }

    fn refuse(&self, sock: &UnixStream) -> Result<()> {
        refuse_busy(sock)
    }
}

/// One message off the socket: header, payload and the fds that came with it.
struct Received {
    hdr: Header,
    payload: Vec<u8>,
    fds: Vec<File>,
}

/// Reads a client's next message (a server's read): the client may be idle
/// between messages for as long as it likes; once a message has begun, the
/// rest must come within the socket's read timeout (see [`socket`]).
/// `Ok(None)` is a clean end of stream.
fn recv(sock: &UnixStream) -> Result<Option<Received>> {
    recv_with(sock, true)
}

/// Reads the reply a proxy waits for, as the socket's read timeout bounds it.
fn recv_reply(sock: &UnixStream) -> Result<Option<Received>> {
    recv_with(sock, false)
}

fn recv_with(sock: &UnixStream, idle: bool) -> Result<Option<Received>> {
    let mut h = [0u8; HEADER_SIZE];
    let head = if idle { socket::recv_exact_idle(sock, &mut h) } else { socket::recv_exact(sock, &mut h) };
    let fds = match head {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("receiving a header", e)),
    };
    let hdr = Header::parse(&h);
    let what = || format!("message {} (command {})", hdr.msg_id, hdr.cmd);
    let len = hdr.payload_len().map_err(|e| Error::protocol(format!("{}: {e}", what())))?;
    let mut payload = vec![0u8; len];
    socket::recv_exact(sock, &mut payload).map_err(|e| Error::io(format!("{}: payload of {len} bytes", what()), e))?;
    Ok(Some(Received { hdr, payload, fds }))
}

/// Answers a client that came while another is served: its first message
/// gets EBUSY (a client that sends none within the socket's read timeout
/// gets nothing), then the channel closes.
pub(crate) fn refuse_busy(sock: &UnixStream) -> Result<()> {
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(sock, &mut h).map_err(|e| Error::io("a busy server reading a header", e))?;
    let hdr = Header::parse(&h);
    // Take a small payload too (VERSION's), so that closing leaves nothing
    // unread: the client then reads the reply, not a reset connection.
    if let Ok(len @ 0..=4096) = hdr.payload_len() {
        let mut p = vec![0u8; len];
        socket::recv_exact(sock, &mut p).map_err(|e| Error::io("a busy server reading a payload", e))?;
    }
    send(sock, &wire::error_reply(&hdr, libc::EBUSY), &[])?;
    let _ = sock.shutdown(std::net::Shutdown::Write);
    Ok(())
}

fn send(sock: &UnixStream, msg: &[u8], fds: &[RawFd]) -> Result<()> {
    socket::send(sock, &[msg], fds).map_err(|e| Error::io("sending", e))
}
