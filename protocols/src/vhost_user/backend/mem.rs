//! SET_MEM_TABLE: the frontend's guest RAM, mapped from the fds it sends,
//! and the translation of its ring addresses (virtual addresses in the
//! frontend, vhost-user spec "Memory region description") to guest
//! physical ones, which [`Queue`](iopath_devices::virtio::queue::Queue)
//! and the descriptors use.
//!
//! Every fd is mapped, whatever it is ([`crate::function`]'s SIGBUS policy:
//! a frontend that shrinks it afterwards ends its own session). Region
//! count, sizes, offsets against the fd's length and overlaps are checked
//! before anything is used.

use crate::function::{guest_memory, map_region, shrunk, MappedRegion, SharedRegion};
use crate::sigbus::Owner;
use iopath_devices::GuestMem;
use std::fs::File;
use std::sync::Arc;
use vhost::vhost_user::message::VhostUserMemoryRegion;

/// Most regions one SET_MEM_TABLE may carry (QEMU sends at most 8 without
/// CONFIGURE_MEM_SLOTS, which the backend does not offer).
pub const MAX_REGIONS: usize = 8;

/// One region: guest physical range and where it sits in the frontend.
#[derive(Clone, Copy, Debug)]
struct Region {
    gpa: u64,
    size: u64,
    uva: u64,
}

/// Why a SET_MEM_TABLE is refused.
#[derive(Debug, thiserror::Error)]
pub(super) enum BadMemTable {
    #[error("{0} memory regions (1 ..= {MAX_REGIONS})")]
    Count(usize),
    #[error("{fds} fds for {regions} memory regions")]
    Fds { fds: usize, regions: usize },
    #[error("memory region at {gpa:#x}: size {size:#x} at address {uva:#x}")]
    Region { gpa: u64, size: u64, uva: u64 },
    /// Mapping a region (or building guest memory over them) failed.
    #[error("{0}")]
    Map(#[from] crate::Error),
}

/// A session's guest RAM: the mapping and the address translation.
pub(super) struct MemTable {
    regions: Vec<Region>,
    pub(super) mem: GuestMem,
    mapped: Vec<MappedRegion>,
}

impl MemTable {
    /// Checks and maps `regions`, each from its fd in `files`, registered
    /// for `owner` with the SIGBUS handler; a clear reason for the first
    /// thing refused.
    pub(super) fn map(
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        owner: &Arc<Owner>,
    ) -> Result<Self, BadMemTable> {
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return Err(BadMemTable::Count(regions.len()));
        }
        if files.len() != regions.len() {
            return Err(BadMemTable::Fds { fds: files.len(), regions: regions.len() });
        }
        let mut table = Vec::with_capacity(regions.len());
        let mut mapped = Vec::with_capacity(regions.len());
        for (r, file) in regions.iter().zip(files) {
            let (gpa, size, uva, offset) = (r.guest_phys_addr, r.memory_size, r.user_addr, r.mmap_offset);
            if size == 0 || uva.checked_add(size).is_none() {
                return Err(BadMemTable::Region { gpa, size, uva });
            }
            let m = map_region(SharedRegion { gpa, size, offset, file }, owner)?;
            mapped.push(m);
            table.push(Region { gpa, size, uva });
        }
        let (mem, keep) = guest_memory(mapped.clone())?;
        Ok(MemTable { regions: table, mem: GuestMem::from(mem).keeping(keep), mapped })
    }

    /// Why the session ends if the frontend shrank some of this memory.
    pub(super) fn shrunk(&self) -> Option<crate::Error> {
        shrunk(&self.mapped.iter().collect::<Vec<_>>())
    }

    /// The guest physical address of `len` bytes at frontend address
    /// `uva`, if they lie in one region.
    pub(super) fn gpa(&self, uva: u64, len: u64) -> Option<u64> {
        let end = uva.checked_add(len)?;
        self.regions.iter().find(|r| uva >= r.uva && end <= r.uva + r.size).map(|r| r.gpa + (uva - r.uva))
    }
}
