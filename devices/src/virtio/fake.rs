//! A fake virtio driver for tests: rings and buffers in guest memory at
//! fixed addresses, chains built as a driver would.

use super::queue::{Queue, DESC_F_INDIRECT, DESC_F_NEXT, DESC_F_WRITE};
use crate::{GuestMem, GuestMemoryMmap};
use vm_memory::{Bytes, GuestAddress};

pub const RAM: u64 = 1 << 20;
pub const DESC: u64 = 0x1000;
pub const AVAIL: u64 = 0x3000;
pub const USED: u64 = 0x4000;
/// Buffers the tests use start here.
pub const DATA: u64 = 0x10000;

pub struct Driver {
    pub ram: GuestMemoryMmap,
    pub mem: GuestMem,
    pub num: u16,
    pub avail_idx: u16,
    /// Where this queue's rings are (DESC, AVAIL, USED for the first).
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
}

impl Driver {
    pub fn new(num: u16) -> Self {
        Self::with_ram(num, RAM)
    }

    /// A driver with `bytes` of guest RAM (at least [`RAM`]).
    pub fn with_ram(num: u16, bytes: u64) -> Self {
        let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), bytes.max(RAM) as usize)]).unwrap();
        Driver { mem: ram.clone().into(), ram, num, avail_idx: 0, desc: DESC, avail: AVAIL, used: USED }
    }

    /// The driver of another queue in the same memory, its rings `off`
    /// bytes past the first queue's (descriptor tables at `desc`: the
    /// tests' chains go through [`chain_at`](Self::chain_at)).
    pub fn another(&self, off: u64) -> Self {
        let (ram, mem) = (self.ram.clone(), self.mem.clone());
        Driver { ram, mem, num: self.num, avail_idx: 0, desc: DESC + off, avail: AVAIL + off, used: USED + off }
    }

    /// A device-side queue set up on this driver's rings.
    pub fn queue(&self, event_idx: bool) -> Queue {
        let mut q = Queue::new(self.num);
        (q.desc, q.avail, q.used, q.event_idx, q.ready) = (self.desc, self.avail, self.used, event_idx, true);
        q.validate(&self.mem).unwrap();
        q
    }

    pub fn w16(&self, gpa: u64, v: u16) {
        self.ram.write_obj(v, GuestAddress(gpa)).unwrap();
    }
    pub fn r16(&self, gpa: u64) -> u16 {
        self.ram.read_obj(GuestAddress(gpa)).unwrap()
    }
    pub fn r32(&self, gpa: u64) -> u32 {
        self.ram.read_obj(GuestAddress(gpa)).unwrap()
    }

    /// Writes descriptor `i` of the table at `table`.
    pub fn desc_at(&self, table: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&addr.to_le_bytes());
        b[8..12].copy_from_slice(&len.to_le_bytes());
        b[12..14].copy_from_slice(&flags.to_le_bytes());
        b[14..16].copy_from_slice(&next.to_le_bytes());
        self.ram.write_slice(&b, GuestAddress(table + 16 * i as u64)).unwrap();
    }

    /// Writes a chain of `(addr, len, writable)` buffers at descriptors
    /// `first..`, linked with NEXT.
    pub fn chain(&self, first: u16, bufs: &[(u64, u32, bool)]) {
        self.chain_at(self.desc, first, bufs);
    }

    pub fn chain_at(&self, table: u64, first: u16, bufs: &[(u64, u32, bool)]) {
        for (k, &(addr, len, w)) in bufs.iter().enumerate() {
            let i = first + k as u16;
            let mut flags = if w { DESC_F_WRITE } else { 0 };
            if k + 1 < bufs.len() {
                flags |= DESC_F_NEXT;
            }
            self.desc_at(table, i, addr, len, flags, i + 1);
        }
    }

    /// Descriptor `i` points at an indirect table of `n` descriptors.
    pub fn indirect(&self, i: u16, table: u64, n: u32) {
        self.desc_at(self.desc, i, table, 16 * n, DESC_F_INDIRECT, 0);
    }

    /// Makes the chain at `head` available and publishes the index.
    pub fn publish(&mut self, head: u16) {
        let slot = (self.avail_idx % self.num) as u64;
        self.w16(self.avail + 4 + 2 * slot, head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.w16(self.avail + 2, self.avail_idx);
    }

    /// The used ring's index and element `k`: (id, len).
    pub fn used_idx(&self) -> u16 {
        self.r16(self.used + 2)
    }
    pub fn used_elem(&self, k: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * (k % self.num) as u64;
        (self.r32(at), self.r32(at + 4))
    }
    /// used_event (the driver's interrupt threshold with EVENT_IDX).
    pub fn set_used_event(&self, v: u16) {
        self.w16(self.avail + 4 + 2 * self.num as u64, v);
    }
    /// avail_event (the device's notification threshold with EVENT_IDX).
    pub fn avail_event(&self) -> u16 {
        self.r16(self.used + 4 + 8 * self.num as u64)
    }
}
