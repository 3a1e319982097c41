//! DMA_MAP and DMA_UNMAP: guest RAM as the client shares it. Every change
//! rebuilds the device's memory from the maps that came with an fd.

use super::{no_fds, ok, DmaEntry, Reply, Session};
use crate::function::{map_guest_memory, SharedRegion};
use crate::vfio_user::wire::{DmaMap, DmaUnmap, DMA_UNMAP_FLAG_ALL};
use crate::vfio_user::Received;
use crate::{Error, Result};

impl Session<'_> {
    pub(super) fn dma_map(&mut self, m: &Received) -> Result<Reply> {
        let map = DmaMap::parse(&m.payload)?;
        if m.fds.len() > 1 {
            return Err(Error::protocol(format!("DMA_MAP with {} fds", m.fds.len())));
        }
        let end = map.address.checked_add(map.size).filter(|_| map.size > 0);
        let end = end.ok_or_else(|| Error::protocol("empty or wrapping range"))?;
        if self.dma.iter().any(|d| map.address < d.map.address + d.map.size && d.map.address < end) {
            return Ok(Reply::Error(libc::EEXIST));
        }
        let file = m.fds.first().map(|f| f.try_clone()).transpose().map_err(|e| Error::io("dup of a DMA fd", e))?;
        self.dma.push(DmaEntry { map, file });
        if let Err(e) = self.remap() {
            self.dma.pop();
            return Err(e);
        }
        ok(Vec::new())
    }

    pub(super) fn dma_unmap(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let u = DmaUnmap::parse(&m.payload)?;
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
        ok(u.to_bytes())
    }

    /// Rebuilds the device's memory from the fd-backed DMA maps.
    fn remap(&self) -> Result<()> {
        let mut regions = Vec::new();
        for d in &self.dma {
            if let Some(file) = &d.file {
                let file = file.try_clone().map_err(|e| Error::io("dup of a DMA fd", e))?;
                regions.push(SharedRegion { gpa: d.map.address, size: d.map.size, offset: d.map.offset, file });
            }
        }
        let mem = map_guest_memory(regions)?;
        self.srv.function().attach(self.srv.context(mem));
        Ok(())
    }
}
