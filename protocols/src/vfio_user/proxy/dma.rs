//! The proxy's DMA service: guest RAM for the device process.
//!
//! At attach, each fd-backed region of guest RAM goes to the server as
//! DMA_MAP with its memfd ([`map_guest_ram`]); the server maps it and its
//! device reaches RAM directly. A server that reaches RAM by message
//! instead sends DMA_READ/DMA_WRITE, which [`DmaService::serve`] answers
//! from guest RAM, bounds-checked, while the proxy waits for a reply (see
//! `channel`). Maps last the session: no DMA_UNMAP is sent.
//!
//! It owns guest RAM's handle and the transfer limit of one DMA message,
//! not the socket.

use super::channel::Channel;
use crate::vfio_user::wire::*;
use crate::vfio_user::Received;
use crate::{Error, Result};
use iopath_devices::GuestMem;
use std::os::fd::AsRawFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// What the proxy serves the server's DMA_READ/DMA_WRITE from.
pub(in crate::vfio_user) struct DmaService {
    /// Guest RAM: the `GuestMem`, which keeps what its regions may be
    /// windows into, not its mapping alone. None before the attach.
    pub(in crate::vfio_user) mem: Option<GuestMem>,
    /// The most bytes one DMA_READ/DMA_WRITE may move (from VERSION).
    pub(super) max_xfer: u32,
    /// DMA requests served, answered or refused.
    pub(super) requests: u64,
}

impl Default for DmaService {
    fn default() -> Self {
        DmaService { mem: None, max_xfer: DEFAULT_MAX_DATA_XFER_SIZE, requests: 0 }
    }
}

impl DmaService {
    /// Answers a server's DMA_READ/DMA_WRITE from guest RAM, bounds-checked;
    /// more than the proxy's own transfer limit is E2BIG (no buffer made).
    pub(in crate::vfio_user) fn serve(&mut self, m: &Received) -> Vec<u8> {
        self.requests += 1;
        let Some(mem) = self.mem.as_ref().map(|m| m.mapped()) else { return error_reply(&m.hdr, libc::EFAULT) };
        let max = self.max_xfer as u64;
        match m.hdr.command() {
            Some(Command::DmaRead) => dma_read(mem, max, m),
            Some(Command::DmaWrite) => dma_write(mem, max, m),
            _ => error_reply(&m.hdr, libc::ENOTSUP),
        }
    }
}

/// DMA_READ: the bytes of guest RAM the server asked for, in the reply.
fn dma_read(mem: &GuestMemoryMmap, max: u64, m: &Received) -> Vec<u8> {
    match DmaAccess::parse(&m.payload) {
        Ok(a) if a.count > max => error_reply(&m.hdr, libc::E2BIG),
        Ok(a) => {
            let mut buf = vec![0u8; a.count as usize];
            match mem.read_slice(&mut buf, GuestAddress(a.address)) {
                Ok(()) => reply(&m.hdr, &DmaAccess::to_bytes_with_data(a.address, &buf)),
                Err(_) => error_reply(&m.hdr, libc::EFAULT),
            }
        }
        _ => error_reply(&m.hdr, libc::EINVAL),
    }
}

/// DMA_WRITE: the server's bytes into guest RAM.
fn dma_write(mem: &GuestMemoryMmap, max: u64, m: &Received) -> Vec<u8> {
    match DmaAccess::parse_with_data(&m.payload) {
        Ok((a, _)) if a.count > max => error_reply(&m.hdr, libc::E2BIG),
        Ok((a, data)) => match mem.write_slice(data, GuestAddress(a.address)) {
            Ok(()) => reply(&m.hdr, &DmaAccess { address: a.address, count: a.count }.to_bytes()),
            Err(_) => error_reply(&m.hdr, libc::EFAULT),
        },
        _ => error_reply(&m.hdr, libc::EINVAL),
    }
}

/// DMA_MAP of each region of guest RAM, with its fd: an error reply is
/// logged and the attach goes on (a server may have no use for DMA).
pub(super) fn map_guest_ram(chan: &mut Channel, mem: &GuestMem) -> Result<()> {
    for r in mem.mapped().iter() {
        let fo = r.file_offset().ok_or_else(|| Error::Config("guest RAM is not fd-backed".into()))?;
        let map = DmaMap {
            flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
            offset: fo.start(),
            address: r.start_addr().0,
            size: r.len(),
        };
        let what = format!("DMA_MAP of guest RAM at {:#x}", map.address);
        chan.optional(&what, Command::DmaMap, &map.to_bytes(), &[fo.file().as_raw_fd()])?;
    }
    Ok(())
}
