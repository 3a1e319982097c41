//! DMA_MAP and DMA_UNMAP: guest RAM as the client shares it. A map with an
//! fd is mmapped once, when it comes, whatever the fd (`function`'s SIGBUS
//! policy: a client that shrinks it afterwards ends its own session); every
//! change gives the device a new memory built from those maps, in address
//! order (clients map in any order).
//!
//! A map without an fd (QEMU's guest RAM without `share=on`) is memory the
//! device reaches through the session's link (`link.rs`): DMA_READ and
//! DMA_WRITE messages to the client, the spec's fallback. The device gets
//! one [`GuestMem`](iopath_devices::GuestMem) of both kinds, routed per
//! range, so a client may mix them.
//!
//! DMA_UNMAP is done before its reply: the device is attached to the memory
//! without the map, which a model takes under its own lock, so no device
//! thread uses the old mapping once the reply is sent (the spec: the server
//! drops all references before it replies). A device thread that is waiting
//! for a DMA reply holds that lock, so the unmap waits for it; the reader
//! thread still delivers the reply meanwhile.

use super::{ok, DmaEntry, Reply, Session};
use crate::function::{guest_memory, map_region, SharedRegion};
use crate::vfio_user::wire::{fixed_part, DmaMap, DmaUnmap, DMA_MAP_SIZE, DMA_UNMAP_FLAG_ALL, DMA_UNMAP_SIZE};
use crate::vfio_user::Received;
use crate::{Error, Result};
use iopath_devices::{DmaPort, GuestMem};
use std::sync::Arc;

impl Session<'_> {
    pub(super) fn dma_map(&mut self, m: &Received) -> Result<Reply> {
        let map = DmaMap::parse(fixed_part(&m.payload, DMA_MAP_SIZE))?;
        if m.fds.len() > 1 {
            return Err(Error::protocol(format!("DMA_MAP with {} fds", m.fds.len())));
        }
        let end = map.address.checked_add(map.size).filter(|_| map.size > 0);
        let end = end.ok_or_else(|| Error::protocol("empty or wrapping range"))?;
        if self.dma.iter().any(|d| map.address < d.map.address + d.map.size && d.map.address < end) {
            return Ok(Reply::Error(libc::EEXIST));
        }
        if self.dma.len() >= self.caps.max_dma_maps as usize {
            return Ok(Reply::Error(libc::ENOSPC));
        }
        let region = match m.fds.first() {
            Some(f) => {
                let file = f.try_clone().map_err(|e| Error::io("dup of a DMA fd", e))?;
                let shared = SharedRegion { gpa: map.address, size: map.size, offset: map.offset, file };
                Some(map_region(shared, &self.owner)?)
            }
            None => {
                // From now on the device may wait for replies from any thread.
                self.start_reader()?;
                if !self.remote_logged {
                    self.remote_logged = true;
                    // A warning: every device access to that memory is a
                    // message, far slower than shared memory.
                    log::warn!(
                        "vfio-user {}: DMA_MAP of {:#x}..{end:#x} without an fd: the device reaches it with \
                         DMA_READ/DMA_WRITE messages (slow; share guest RAM for speed, e.g. QEMU's share=on)",
                        self.peer,
                        map.address
                    );
                }
                None
            }
        };
        self.dma.push(DmaEntry { map, region });
        if let Err(e) = self.remap() {
            self.dma.pop();
            return Err(e);
        }
        ok(Vec::new())
    }

    /// QEMU sends no fd with DMA_UNMAP; a client that does (the map's fd
    /// again) has it closed with the message.
    pub(super) fn dma_unmap(&mut self, m: &Received) -> Result<Reply> {
        let u = DmaUnmap::parse(fixed_part(&m.payload, DMA_UNMAP_SIZE))?;
        if u.flags & DMA_UNMAP_FLAG_ALL != 0 {
            self.dma.clear();
        } else {
            let before = self.dma.len();
            self.dma.retain(|d| !(d.map.address == u.address && d.map.size == u.size));
            if self.dma.len() == before {
                return Ok(Reply::Error(libc::ENOENT));
            }
        }
        self.remap()?;
        ok(DmaUnmap::new(u.flags, u.address, u.size).to_bytes())
    }

    /// Gives the device a memory of the maps: those with an fd mapped, the
    /// others reached through the link (none at all is the empty memory).
    /// The model swaps it in under its lock.
    fn remap(&self) -> Result<()> {
        let (mapped, keep) = guest_memory(self.dma.iter().filter_map(|d| d.region.clone()).collect())?;
        let remote: Vec<(u64, u64)> =
            self.dma.iter().filter(|d| d.region.is_none()).map(|d| (d.map.address, d.map.size)).collect();
        let port: Arc<dyn DmaPort> = self.link.clone();
        let mem =
            GuestMem::with_remote(mapped, &remote, port).map_err(|e| Error::protocol(format!("DMA maps: {e}")))?;
        let mem = mem.keeping(keep);
        self.srv.function().attach(self.srv.context(mem));
        Ok(())
    }
}
