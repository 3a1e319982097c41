//! In-flight I/O tracking of a split ring (vhost-user spec, "Inflight I/O
//! tracking"): a region the frontend keeps across a backend's death, in
//! which the device notes each chain it took and has not completed, so
//! that the next device process resubmits exactly those, in the order they
//! were taken, and completes none twice.
//!
//! One queue's region: a 16-byte header (features u64, version u16,
//! desc_num u16, last_batch_head u16, used_idx u16) and desc_num 16-byte
//! entries (inflight u8, 5 bytes padding, next u16, counter u64), one per
//! descriptor index; queue `k`'s region at `k` times
//! [`queue_region_size`]. The device, for each chain:
//! - taken from the available ring ([`InflightRing::take`]): the entry of
//!   its head gets the next counter value, then inflight = 1;
//! - completed: before the used-ring write, the head becomes the last batch
//!   ([`InflightRing::used_before`]); after the used index is published,
//!   inflight = 0 and the region's used_idx = the ring's
//!   ([`InflightRing::used_after`]).
//!
//! At a ring's start ([`InflightRing::start`]): a region of version 0 is new
//! and set up; else, if the region's used_idx differs from the used ring's
//! (the device died between publishing a used index and clearing the
//! batch's entries), the last batch's entries are cleared; then every entry
//! still in flight is resubmitted in counter order, and the device takes
//! new chains from the used index plus that many (every chain taken is
//! used or in flight).
//!
//! The region is shared memory a frontend (hostile, like any peer) can
//! write at any time: every index read from it is checked, and accesses are
//! plain atomic loads and stores (no reference to the memory is formed).
//!
//! virtio-blk over vfio-user keeps the same regions inside its state memory
//! (`state.rs`): [`InflightRing::reset`] sets one up when the driver enables
//! the queue, [`InflightRing::untake`] gives back a chain the device left
//! available after all, and [`InflightRing::check`] reads a region without
//! changing it, so that a resume can refuse a bad one before it starts any.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// The region version this device writes and reads (0: not set up yet).
pub const VERSION: u16 = 1;
const HEADER: usize = 16;
const ENTRY: usize = 16;
/// Each queue's region starts on a multiple of this.
const ALIGN: u64 = 64;
// Header fields.
const VERSION_AT: usize = 8;
const DESC_NUM_AT: usize = 10;
const LAST_BATCH_AT: usize = 12;
const USED_IDX_AT: usize = 14;
// Entry fields.
const INFLIGHT_AT: usize = 0;
const NEXT_AT: usize = 6;
const COUNTER_AT: usize = 8;

/// Bytes one queue of `queue_size` descriptors takes in the region.
pub fn queue_region_size(queue_size: u16) -> u64 {
    (HEADER as u64 + ENTRY as u64 * queue_size as u64).div_ceil(ALIGN) * ALIGN
}

/// Bytes the region of `num_queues` queues of `queue_size` takes.
pub fn region_size(num_queues: u16, queue_size: u16) -> u64 {
    num_queues as u64 * queue_region_size(queue_size)
}

/// Why a ring cannot start on its region.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InflightError {
    #[error("in-flight region of version {0} (this device knows {VERSION})")]
    Version(u16),
    #[error("queue size {num} larger than the in-flight region's {desc_num} entries")]
    Size { num: u16, desc_num: u16 },
    #[error("in-flight entry {index} set, past the queue size {num}")]
    Index { index: u16, num: u16 },
}

/// What a ring resumes from ([`InflightRing::start`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Resume {
    /// The next available index to take: the used index plus the chains
    /// in flight; None for a new region (the frontend's vring base holds).
    pub next_avail: Option<u16>,
    /// Heads of the chains in flight, oldest first: served before any new one.
    pub resubmit: Vec<u16>,
}

/// One queue's part of a mapped in-flight region.
pub struct InflightRing {
    base: NonNull<u8>,
    desc_num: u16,
    /// The counter the next chain taken gets.
    counter: u64,
    /// Keeps the mapping alive as long as this view of it.
    _keep: Arc<dyn Any + Send + Sync>,
    /// Tests: called before every store into the region (where a device dies).
    #[cfg(test)]
    pub(crate) hook: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// What [`InflightRing::check`] read from a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Noted {
    /// The used index the region noted last.
    pub used_idx: u16,
    /// Chains marked in flight.
    pub in_flight: u16,
}

// SAFETY: the region is reached through atomics only, and `_keep` holds
// the mapping; the device's lock serializes the ring's own use.
unsafe impl Send for InflightRing {}

impl InflightRing {
    /// A view of the `queue_region_size(desc_num)` bytes at `base`.
    ///
    /// # Safety
    /// `base` is 8-byte aligned, and those bytes stay mapped, readable and
    /// writable as long as `keep` lives (anyone else may write them).
    pub unsafe fn new(base: NonNull<u8>, desc_num: u16, keep: Arc<dyn Any + Send + Sync>) -> Self {
        debug_assert!(base.as_ptr().align_offset(8) == 0);
        InflightRing {
            base,
            desc_num,
            counter: 0,
            _keep: keep,
            #[cfg(test)]
            hook: None,
        }
    }

    /// Before each store (tests: the device may die here).
    #[inline]
    fn storing(&self) {
        #[cfg(test)]
        if let Some(h) = &self.hook {
            h();
        }
    }

    fn u8_at(&self, off: usize) -> &AtomicU8 {
        debug_assert!(off < queue_region_size(self.desc_num) as usize);
        // SAFETY: inside the region (callers index below desc_num), which `_keep` keeps mapped.
        unsafe { AtomicU8::from_ptr(self.base.as_ptr().add(off)) }
    }

    fn u16_at(&self, off: usize) -> &AtomicU16 {
        debug_assert!(off + 2 <= queue_region_size(self.desc_num) as usize && off.is_multiple_of(2));
        // SAFETY: as u8_at; the offset is even and the base 8-aligned.
        unsafe { AtomicU16::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= queue_region_size(self.desc_num) as usize && off.is_multiple_of(8));
        // SAFETY: as u8_at; the offset is a multiple of 8 and the base 8-aligned.
        unsafe { AtomicU64::from_ptr(self.base.as_ptr().add(off).cast()) }
    }

    fn entry(i: u16) -> usize {
        HEADER + ENTRY * i as usize
    }

    fn inflight(&self, i: u16) -> bool {
        self.u8_at(Self::entry(i) + INFLIGHT_AT).load(Ordering::Acquire) == 1
    }

    fn clear(&self, i: u16) {
        self.storing();
        self.u8_at(Self::entry(i) + INFLIGHT_AT).store(0, Ordering::Release);
    }

    /// Sets the region up for a queue that starts now (its used index
    /// `used_idx`), whatever it held: no entry in flight, then the version
    /// (last: a region whose set-up was cut short reads as version 0 or
    /// with stale entries cleared already).
    pub fn reset(&mut self, used_idx: u16) {
        self.storing();
        self.u16_at(VERSION_AT).store(0, Ordering::Release);
        for i in 0..self.desc_num {
            if self.inflight(i) {
                self.clear(i);
            }
        }
        for (at, v) in [(DESC_NUM_AT, self.desc_num), (LAST_BATCH_AT, 0), (USED_IDX_AT, used_idx)] {
            if self.u16_at(at).load(Ordering::Relaxed) != v {
                self.storing();
                self.u16_at(at).store(v, Ordering::Relaxed);
            }
        }
        self.storing();
        self.u16_at(VERSION_AT).store(VERSION, Ordering::Release);
        self.counter = 0;
    }

    /// Reads a region [`start`](Self::start) would resume a queue of size
    /// `num` from, changing nothing: an error where `start` would give one,
    /// and for a region set up before, also one whose version is 0.
    pub fn check(&self, num: u16) -> Result<Noted, InflightError> {
        if num > self.desc_num {
            return Err(InflightError::Size { num, desc_num: self.desc_num });
        }
        let version = self.u16_at(VERSION_AT).load(Ordering::Acquire);
        if version != VERSION {
            return Err(InflightError::Version(version));
        }
        let mut in_flight = 0u16;
        for i in 0..self.desc_num {
            if self.inflight(i) {
                if i >= num {
                    return Err(InflightError::Index { index: i, num });
                }
                in_flight += 1;
            }
        }
        Ok(Noted { used_idx: self.u16_at(USED_IDX_AT).load(Ordering::Acquire), in_flight })
    }

    /// The ring starts on this region, its size `num` and the used index
    /// its used ring holds `used_idx`: the region set up if new, repaired
    /// if the last device died inside a completion, and what was in flight.
    pub fn start(&mut self, num: u16, used_idx: u16) -> Result<Resume, InflightError> {
        if num > self.desc_num {
            return Err(InflightError::Size { num, desc_num: self.desc_num });
        }
        let version = self.u16_at(VERSION_AT).load(Ordering::Acquire);
        if version == 0 {
            self.u64_at(0).store(0, Ordering::Relaxed);
            for i in 0..self.desc_num {
                self.clear(i);
            }
            self.u16_at(DESC_NUM_AT).store(self.desc_num, Ordering::Relaxed);
            self.u16_at(LAST_BATCH_AT).store(0, Ordering::Relaxed);
            self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Relaxed);
            self.u16_at(VERSION_AT).store(VERSION, Ordering::Release);
            self.counter = 0;
            return Ok(Resume::default());
        }
        if version != VERSION {
            return Err(InflightError::Version(version));
        }
        let noted = self.u16_at(USED_IDX_AT).load(Ordering::Acquire);
        if noted != used_idx {
            // Died after publishing used entries, before clearing them: the
            // batch (a list from last_batch_head, as long as the gap) is done.
            let mut at = self.u16_at(LAST_BATCH_AT).load(Ordering::Acquire);
            for _ in 0..used_idx.wrapping_sub(noted).min(self.desc_num) {
                if at >= self.desc_num {
                    break;
                }
                self.clear(at);
                at = self.u16_at(Self::entry(at) + NEXT_AT).load(Ordering::Acquire);
            }
            fence(Ordering::Release);
            self.storing();
            self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Release);
        }
        let mut taken = Vec::new();
        for i in 0..self.desc_num {
            if self.inflight(i) {
                if i >= num {
                    return Err(InflightError::Index { index: i, num });
                }
                taken.push((self.u64_at(Self::entry(i) + COUNTER_AT).load(Ordering::Acquire), i));
            }
        }
        taken.sort_unstable();
        self.counter = taken.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        Ok(Resume {
            next_avail: Some(used_idx.wrapping_add(taken.len() as u16)),
            resubmit: taken.into_iter().map(|(_, i)| i).collect(),
        })
    }

    /// The device took the chain at `head` from the available ring.
    pub fn take(&mut self, head: u16) {
        if head >= self.desc_num {
            return; // the queue checked it against its size, at most desc_num
        }
        self.storing();
        self.u64_at(Self::entry(head) + COUNTER_AT).store(self.counter, Ordering::Relaxed);
        self.storing();
        self.u8_at(Self::entry(head) + INFLIGHT_AT).store(1, Ordering::Release);
        self.counter = self.counter.wrapping_add(1);
    }

    /// The chain at `head`, taken last, goes back to the available ring
    /// (the device could not start it yet): no longer in flight.
    pub fn untake(&mut self, head: u16) {
        if head < self.desc_num {
            self.clear(head);
        }
    }

    /// The chain at `head` is about to be put in the used ring (a batch of one).
    pub fn used_before(&self, head: u16) {
        if head >= self.desc_num {
            return;
        }
        let last = self.u16_at(LAST_BATCH_AT).load(Ordering::Relaxed);
        self.storing();
        self.u16_at(Self::entry(head) + NEXT_AT).store(last, Ordering::Relaxed);
        self.storing();
        self.u16_at(LAST_BATCH_AT).store(head, Ordering::Release);
        fence(Ordering::Release); // before the used-ring write (a no-op on x86, whose stores stay in order)
    }

    /// The chain at `head` is in the used ring and the used index `used_idx`
    /// is published.
    pub fn used_after(&self, head: u16, used_idx: u16) {
        fence(Ordering::Release); // after the used index's store (push_used ends with a full fence)
        if head < self.desc_num {
            self.clear(head);
        }
        self.storing();
        self.u16_at(USED_IDX_AT).store(used_idx, Ordering::Release);
    }
}

#[cfg(test)]
#[path = "inflight_tests.rs"]
mod tests;
