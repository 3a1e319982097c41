//! Split virtqueues (virtio 1.2, 2.7), the device side, over [`GuestMem`].
//!
//! Own code rather than rust-vmm's `virtio-queue`: that crate reaches guest
//! memory through `vm_memory::GuestMemory`, which [`GuestMem`] is not (a
//! vfio-user client's RAM may be partly reached by DMA messages), and a
//! queue over the mapped part alone would miss those ranges.
//!
//! Everything read from the guest is checked before use: the available
//! index may run at most `num` ahead, every head and `next` index is below
//! `num`, a chain has at most `num` descriptors (so a loop ends), an
//! indirect table is a whole number of descriptors, at most
//! [`MAX_INDIRECT`], never nested, and every buffer lies in guest memory.
//! A violation is a [`QueueError`]: the device marks itself as needing a
//! reset; nothing panics and nothing outside guest RAM is touched.

use crate::mem::GuestMem;
use std::sync::atomic::{fence, Ordering};

/// Descriptor flags (2.7.5).
pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;
pub const DESC_F_INDIRECT: u16 = 4;
/// avail.flags: the driver wants no interrupt (without EVENT_IDX).
pub const AVAIL_F_NO_INTERRUPT: u16 = 1;
/// used.flags: the device wants no notification (without EVENT_IDX).
pub const USED_F_NO_NOTIFY: u16 = 1;
/// Largest queue size the device offers (a power of two, 2.7).
pub const MAX_QUEUE_SIZE: u16 = 256;
/// Largest indirect table the device follows, in descriptors.
pub const MAX_INDIRECT: u32 = 1024;

/// One buffer of a descriptor chain, its range checked against guest memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    /// Device-writable (the driver reads it afterwards).
    pub write: bool,
}

/// A chain taken from the available ring: its head index and its buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub head: u16,
    pub descs: Vec<Desc>,
}

/// Why the device could not take a chain: the driver broke the ring.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
    #[error("queue not ready")]
    NotReady,
    #[error("available index {avail} runs {ahead} ahead of {next} (queue size {num})")]
    AvailIndex { avail: u16, next: u16, ahead: u16, num: u16 },
    #[error("descriptor index {index} >= queue size {num}")]
    BadIndex { index: u16, num: u16 },
    #[error("chain longer than {0} descriptors (a loop?)")]
    TooLong(u32),
    #[error("indirect descriptor inside an indirect table")]
    NestedIndirect,
    #[error("indirect table of {0} bytes (a multiple of 16, 16 ..= 16 * {MAX_INDIRECT})")]
    BadIndirect(u32),
    #[error("indirect descriptor with NEXT set")]
    IndirectNext,
    #[error("readable descriptor after a writable one")]
    ReadAfterWrite,
    #[error("{len} bytes at {addr:#x}: not guest memory")]
    Memory { addr: u64, len: u64 },
}

/// A split virtqueue as the driver set it up through the transport.
#[derive(Clone, Debug, Default)]
pub struct Queue {
    /// Queue size the driver chose (a power of two, <= [`MAX_QUEUE_SIZE`]).
    pub num: u16,
    pub ready: bool,
    pub desc: u64,
    /// The driver area (available ring).
    pub avail: u64,
    /// The device area (used ring).
    pub used: u64,
    /// VIRTIO_RING_F_EVENT_IDX was negotiated.
    pub event_idx: bool,
    /// The next available-ring index the device takes (vhost-user's vring base).
    pub next_avail: u16,
    /// The next used-ring index the device fills.
    pub next_used: u16,
}

fn mem_err(addr: u64, len: u64) -> QueueError {
    QueueError::Memory { addr, len }
}

impl Queue {
    /// A queue with size `num`, not yet enabled.
    pub fn new(num: u16) -> Self {
        Queue { num, ..Default::default() }
    }

    /// Checks the rings lie in guest memory and are aligned (2.7: 16, 2, 4);
    /// the transport calls this when the driver enables the queue.
    pub fn validate(&self, mem: &GuestMem) -> Result<(), QueueError> {
        let n = self.num as u64;
        if self.num == 0 || self.num > MAX_QUEUE_SIZE || !self.num.is_power_of_two() {
            return Err(QueueError::BadIndex { index: self.num, num: MAX_QUEUE_SIZE });
        }
        for (addr, len, align) in [(self.desc, 16 * n, 16), (self.avail, 6 + 2 * n, 2), (self.used, 6 + 8 * n, 4)] {
            if !addr.is_multiple_of(align) || !mem.range_ok(addr, len) {
                return Err(mem_err(addr, len));
            }
        }
        Ok(())
    }

    /// Back to the state before the driver set it up (device reset).
    pub fn reset(&mut self) {
        *self = Queue::new(self.num);
    }

    fn read_u16(mem: &GuestMem, gpa: u64) -> Result<u16, QueueError> {
        mem.read_obj::<u16>(gpa).map_err(|_| mem_err(gpa, 2))
    }

    fn write_u16(mem: &GuestMem, gpa: u64, v: u16) -> Result<(), QueueError> {
        mem.write_slice(&v.to_le_bytes(), gpa).map_err(|_| mem_err(gpa, 2))
    }

    /// The driver's available index, read with acquire ordering (the ring
    /// entries it covers are read after it).
    pub fn avail_idx(&self, mem: &GuestMem) -> Result<u16, QueueError> {
        let v = Self::read_u16(mem, self.avail + 2)?;
        fence(Ordering::Acquire);
        Ok(v)
    }

    /// The next chain the driver made available, if any.
    pub fn pop(&mut self, mem: &GuestMem) -> Result<Option<Chain>, QueueError> {
        if !self.ready || self.num == 0 {
            return Err(QueueError::NotReady);
        }
        let avail = self.avail_idx(mem)?;
        let ahead = avail.wrapping_sub(self.next_avail);
        if ahead == 0 {
            return Ok(None);
        }
        if ahead > self.num {
            return Err(QueueError::AvailIndex { avail, next: self.next_avail, ahead, num: self.num });
        }
        let slot = (self.next_avail % self.num) as u64;
        let head = Self::read_u16(mem, self.avail + 4 + 2 * slot)?;
        let descs = self.walk(mem, head)?;
        self.next_avail = self.next_avail.wrapping_add(1);
        Ok(Some(Chain { head, descs }))
    }

    /// Gives back the chain the last [`pop`](Self::pop) took: it stays
    /// available, and the next pop takes it again (a device that cannot
    /// start it yet). Nothing was written to the guest for it.
    pub fn unpop(&mut self) {
        self.next_avail = self.next_avail.wrapping_sub(1);
    }

    /// The chain at `head`, walked as [`pop`](Self::pop) walks one, without
    /// taking anything from the available ring: a chain taken by an earlier
    /// device process and resubmitted (vhost-user's in-flight tracking).
    pub fn chain(&self, mem: &GuestMem, head: u16) -> Result<Chain, QueueError> {
        if !self.ready || self.num == 0 {
            return Err(QueueError::NotReady);
        }
        Ok(Chain { head, descs: self.walk(mem, head)? })
    }

    /// The used index the used ring holds (what the driver has been given).
    pub fn used_idx(&self, mem: &GuestMem) -> Result<u16, QueueError> {
        Self::read_u16(mem, self.used + 2)
    }

    fn read_desc(mem: &GuestMem, gpa: u64) -> Result<(u64, u32, u16, u16), QueueError> {
        let mut b = [0u8; 16];
        mem.read_slice(&mut b, gpa).map_err(|_| mem_err(gpa, 16))?;
        let addr = u64::from_le_bytes(b[0..8].try_into().unwrap());
        let len = u32::from_le_bytes(b[8..12].try_into().unwrap());
        let flags = u16::from_le_bytes(b[12..14].try_into().unwrap());
        let next = u16::from_le_bytes(b[14..16].try_into().unwrap());
        Ok((addr, len, flags, next))
    }

    /// Follows the chain at `head`, into at most one indirect table.
    fn walk(&self, mem: &GuestMem, head: u16) -> Result<Vec<Desc>, QueueError> {
        let mut out = Vec::new();
        // (table address, table size) of the table being walked.
        let (mut table, mut size) = (self.desc, self.num as u32);
        let mut index = head;
        let mut indirect = false;
        let mut seen = 0u32;
        loop {
            if index as u32 >= size {
                return Err(QueueError::BadIndex { index, num: size as u16 });
            }
            seen += 1;
            if seen > size {
                return Err(QueueError::TooLong(size));
            }
            let (addr, len, flags, next) = Self::read_desc(mem, table + 16 * index as u64)?;
            if flags & DESC_F_INDIRECT != 0 {
                if indirect {
                    return Err(QueueError::NestedIndirect);
                }
                if flags & DESC_F_NEXT != 0 {
                    return Err(QueueError::IndirectNext);
                }
                if len == 0 || len % 16 != 0 || len / 16 > MAX_INDIRECT {
                    return Err(QueueError::BadIndirect(len));
                }
                if !addr.is_multiple_of(16) || !mem.range_ok(addr, len as u64) {
                    return Err(mem_err(addr, len as u64));
                }
                (table, size, index, indirect, seen) = (addr, len / 16, 0, true, 0);
                continue;
            }
            if !mem.range_ok(addr, len as u64) {
                return Err(mem_err(addr, len as u64));
            }
            let write = flags & DESC_F_WRITE != 0;
            if !write && out.last().is_some_and(|d: &Desc| d.write) {
                return Err(QueueError::ReadAfterWrite);
            }
            out.push(Desc { addr, len, write });
            if flags & DESC_F_NEXT == 0 {
                return Ok(out);
            }
            index = next;
        }
    }

    /// Puts `(head, len)` in the used ring and publishes the new used index
    /// (release: the element and the data the device wrote come first).
    /// Returns whether the driver wants an interrupt for it.
    pub fn push_used(&mut self, mem: &GuestMem, head: u16, len: u32) -> Result<bool, QueueError> {
        let slot = (self.next_used % self.num.max(1)) as u64;
        let mut e = [0u8; 8];
        e[..4].copy_from_slice(&(head as u32).to_le_bytes());
        e[4..].copy_from_slice(&len.to_le_bytes());
        let at = self.used + 4 + 8 * slot;
        mem.write_slice(&e, at).map_err(|_| mem_err(at, 8))?;
        let old = self.next_used;
        self.next_used = old.wrapping_add(1);
        fence(Ordering::Release);
        Self::write_u16(mem, self.used + 2, self.next_used)?;
        fence(Ordering::SeqCst); // the index store before the driver's event/flags load
        self.needs_interrupt(mem, old, self.next_used)
    }

    /// 2.7.7.2: with EVENT_IDX, an interrupt iff used_event lies in
    /// [old, new); else unless the driver set AVAIL_F_NO_INTERRUPT.
    fn needs_interrupt(&self, mem: &GuestMem, old: u16, new: u16) -> Result<bool, QueueError> {
        if self.event_idx {
            let used_event = Self::read_u16(mem, self.avail + 4 + 2 * self.num as u64)?;
            Ok(new.wrapping_sub(used_event).wrapping_sub(1) < new.wrapping_sub(old))
        } else {
            Ok(Self::read_u16(mem, self.avail)? & AVAIL_F_NO_INTERRUPT == 0)
        }
    }

    /// Asks the driver to notify (or not) when it adds buffers: with
    /// EVENT_IDX, avail_event = the next index the device will take (or, to
    /// suppress, one that stays far behind); else USED_F_NO_NOTIFY. Returns
    /// the available index seen afterwards, so a caller that enabled
    /// notifications re-checks for buffers that raced in.
    pub fn set_notify(&mut self, mem: &GuestMem, enable: bool) -> Result<u16, QueueError> {
        if self.event_idx {
            let v = if enable { self.next_avail } else { self.next_avail.wrapping_sub(1) };
            Self::write_u16(mem, self.used + 4 + 8 * self.num as u64, v)?;
        } else {
            Self::write_u16(mem, self.used, if enable { 0 } else { USED_F_NO_NOTIFY })?;
        }
        fence(Ordering::SeqCst);
        self.avail_idx(mem)
    }

    /// The index of the next chain the device will take.
    pub fn next_avail(&self) -> u16 {
        self.next_avail
    }

    /// True if the driver has made chains available the device has not taken.
    pub fn has_work(&self, mem: &GuestMem) -> Result<bool, QueueError> {
        Ok(self.avail_idx(mem)? != self.next_avail)
    }
}

#[cfg(test)]
#[path = "queue_tests.rs"]
mod tests;
