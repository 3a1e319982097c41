//! A timer wheel of `(due_ns, token)` pairs: the completions a device
//! thread holds until their due time. Pure (time is an argument), bounded
//! (all memory taken at creation: `capacity` entries, the queue entries
//! that can be in flight; one more is [`WheelFull`]).
//!
//! Buckets of 2^`shift` ns (1024 ns by default), `slots` of them (4096: a
//! 4.2 ms horizon) as a ring from the cursor, the bucket of the last
//! `expire`; a pair due beyond the horizon waits in an overflow heap and
//! moves into the ring as the cursor comes near. A pair due before the
//! cursor goes into the cursor's bucket. Entries live in a slab with a
//! free list, each bucket a singly linked list of them, and a bitmap of
//! non-empty buckets lets `expire` and `next_due` skip empty ones 64 at a
//! time. Insert is O(1) (O(log n) for the overflow heap); `expire` costs
//! O(1) per pair plus sorting each bucket's expired pairs (a bucket spans
//! ~1 us: a few pairs) so they leave in due order, ties in insertion order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// An insert beyond the wheel's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("timer wheel full ({capacity} entries in flight)")]
pub struct WheelFull {
    pub capacity: usize,
}

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct Entry<T> {
    due: u64,
    seq: u64,
    token: T,
    next: u32,
}

/// See the module doc.
pub struct TimerWheel<T: Copy> {
    shift: u32,
    /// The bucket count, a power of two.
    slots: u64,
    /// Each bucket's first entry (NIL: empty).
    heads: Vec<u32>,
    /// Bit b: bucket b is not empty.
    occupied: Vec<u64>,
    slab: Vec<Entry<T>>,
    free: u32,
    len: usize,
    /// Absolute bucket number (due >> shift) of the ring's first bucket.
    cursor: u64,
    /// Pairs due at or beyond the horizon: (due, seq, slab index).
    overflow: BinaryHeap<Reverse<(u64, u64, u32)>>,
    seq: u64,
    /// One bucket's expired pairs while they are sorted.
    scratch: Vec<(u64, u64, u32)>,
}

impl<T: Copy + Default> TimerWheel<T> {
    /// A wheel for `capacity` pairs: 1024-ns buckets, 4096 of them.
    pub fn new(capacity: usize) -> Self {
        Self::with_geometry(capacity, 10, 4096)
    }

    /// A wheel of `slots` (rounded up to a power of two, at least 64)
    /// buckets of 2^`shift` ns each.
    pub fn with_geometry(capacity: usize, shift: u32, slots: usize) -> Self {
        let capacity = capacity.min(NIL as usize - 1);
        let slots = slots.max(64).next_power_of_two();
        let slab = (0..capacity)
            .map(|i| Entry {
                due: 0,
                seq: 0,
                token: T::default(),
                next: if i + 1 < capacity { i as u32 + 1 } else { NIL },
            })
            .collect();
        TimerWheel {
            shift: shift.min(40),
            slots: slots as u64,
            heads: vec![NIL; slots],
            occupied: vec![0; slots / 64],
            slab,
            free: if capacity > 0 { 0 } else { NIL },
            len: 0,
            cursor: 0,
            overflow: BinaryHeap::with_capacity(capacity),
            seq: 0,
            scratch: Vec::with_capacity(capacity),
        }
    }
}

impl<T: Copy> TimerWheel<T> {
    pub fn capacity(&self) -> usize {
        self.slab.len()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Holds `token` until `due_ns`.
    pub fn insert(&mut self, due_ns: u64, token: T) -> Result<(), WheelFull> {
        if self.free == NIL {
            return Err(WheelFull { capacity: self.capacity() });
        }
        let i = self.free;
        self.free = self.slab[i as usize].next;
        let seq = self.seq;
        self.seq += 1;
        self.slab[i as usize] = Entry { due: due_ns, seq, token, next: NIL };
        self.len += 1;
        self.place(i);
        Ok(())
    }

    /// The earliest due time held, if any: how long a poller may sleep.
    pub fn next_due(&self) -> Option<u64> {
        if let Some(b) = self.next_occupied(self.cursor) {
            let mut i = self.heads[(b & (self.slots - 1)) as usize];
            let mut min = u64::MAX;
            while i != NIL {
                min = min.min(self.slab[i as usize].due);
                i = self.slab[i as usize].next;
            }
            return Some(min);
        }
        self.overflow.peek().map(|Reverse((due, _, _))| *due)
    }

    /// Appends to `out` every token due at or before `now_ns`, in due
    /// order (ties in insertion order), and forgets them.
    pub fn expire(&mut self, now_ns: u64, out: &mut Vec<T>) {
        let target = (now_ns >> self.shift).max(self.cursor);
        loop {
            self.refill();
            let b = match (self.next_occupied(self.cursor), self.overflow.peek()) {
                (Some(b), _) => b,
                (None, Some(Reverse((due, _, _)))) => {
                    // Only far pairs: move the horizon up to the first of them.
                    let b = due >> self.shift;
                    if b > target {
                        break;
                    }
                    self.cursor = b + 1 - self.slots;
                    continue;
                }
                (None, None) => break,
            };
            if b > target {
                break;
            }
            self.cursor = b;
            self.drain_bucket(b, now_ns, out);
            if b == target {
                break;
            }
            self.cursor = b + 1;
        }
        self.cursor = target;
        self.refill();
    }

    /// Puts entry `i` into its bucket, or the overflow heap.
    fn place(&mut self, i: u32) {
        let e = self.slab[i as usize];
        let b = (e.due >> self.shift).max(self.cursor);
        if b - self.cursor >= self.slots {
            self.overflow.push(Reverse((e.due, e.seq, i)));
            return;
        }
        let slot = (b & (self.slots - 1)) as usize;
        self.slab[i as usize].next = self.heads[slot];
        self.heads[slot] = i;
        self.occupied[slot / 64] |= 1 << (slot % 64);
    }

    /// Moves the overflow pairs that are now within the horizon into the ring.
    fn refill(&mut self) {
        while let Some(&Reverse((due, _, i))) = self.overflow.peek() {
            if (due >> self.shift).saturating_sub(self.cursor) >= self.slots {
                break;
            }
            self.overflow.pop();
            self.place(i);
        }
    }

    /// The first non-empty bucket at or after absolute bucket `from`,
    /// within the horizon (absolute number).
    fn next_occupied(&self, from: u64) -> Option<u64> {
        let mask = self.slots - 1;
        let words = self.occupied.len();
        let start = (from & mask) as usize;
        // Scan the ring once from `start`, wrapping.
        for k in 0..=words {
            let w = (start / 64 + k) % words;
            let mut bits = self.occupied[w];
            if k == 0 {
                bits &= !0u64 << (start % 64);
            } else if k == words {
                bits &= !(!0u64 << (start % 64));
            }
            if bits != 0 {
                let slot = (w * 64 + bits.trailing_zeros() as usize) as u64;
                return Some(from + ((slot.wrapping_sub(from & mask)) & mask));
            }
        }
        None
    }

    /// Takes the pairs due by `now` out of absolute bucket `b`, sorted.
    fn drain_bucket(&mut self, b: u64, now: u64, out: &mut Vec<T>) {
        let slot = (b & (self.slots - 1)) as usize;
        let mut i = self.heads[slot];
        let mut kept = NIL;
        while i != NIL {
            let e = self.slab[i as usize];
            if e.due <= now {
                self.scratch.push((e.due, e.seq, i));
            } else {
                self.slab[i as usize].next = kept;
                kept = i;
            }
            i = e.next;
        }
        self.heads[slot] = kept;
        if kept == NIL {
            self.occupied[slot / 64] &= !(1 << (slot % 64));
        }
        self.scratch.sort_unstable();
        for &(_, _, i) in &self.scratch {
            out.push(self.slab[i as usize].token);
            self.slab[i as usize].next = self.free;
            self.free = i;
        }
        self.len -= self.scratch.len();
        self.scratch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// A tiny deterministic generator for the schedules.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// The reference: a sorted set of (due, seq, token).
    fn run_schedule(seed: u64, capacity: usize, shift: u32, slots: usize, steps: usize) -> usize {
        let mut rng = Rng(seed | 1);
        let mut w: TimerWheel<u32> = TimerWheel::with_geometry(capacity, shift, slots);
        let mut reference: BTreeSet<(u64, u64, u32)> = BTreeSet::new();
        let (mut now, mut seq, mut token, mut expired_total) = (0u64, 0u64, 0u32, 0usize);
        let mut out = Vec::new();
        let horizon = (slots as u64) << shift;
        for _ in 0..steps {
            match rng.below(10) {
                0..=5 => {
                    // A due time: mostly near, some far beyond the horizon,
                    // some already past, some exactly now, some ties.
                    let due = match rng.below(8) {
                        0 => now.saturating_sub(rng.below(5000)),
                        1 => now,
                        2 => now + horizon + rng.below(4 * horizon),
                        3 => (now / 1000 + 3) * 1000,
                        _ => now + rng.below(horizon / 4),
                    };
                    let r = w.insert(due, token);
                    if reference.len() == capacity {
                        assert_eq!(r, Err(WheelFull { capacity }));
                    } else {
                        r.unwrap();
                        reference.insert((due, seq, token));
                        seq += 1;
                        token += 1;
                    }
                }
                _ => {
                    now += match rng.below(6) {
                        0 => 0,
                        1 => rng.below(2 * horizon),
                        _ => rng.below(3000),
                    };
                    out.clear();
                    w.expire(now, &mut out);
                    let want: Vec<u32> = reference.iter().take_while(|e| e.0 <= now).map(|e| e.2).collect();
                    assert_eq!(out, want, "expire({now})");
                    for _ in 0..want.len() {
                        reference.pop_first();
                    }
                    expired_total += want.len();
                }
            }
            assert_eq!(w.len(), reference.len());
            assert_eq!(w.next_due(), reference.first().map(|e| e.0), "next_due at {now}");
        }
        // Drain: every token leaves exactly once.
        out.clear();
        w.expire(u64::MAX, &mut out);
        let want: Vec<u32> = reference.iter().map(|e| e.2).collect();
        assert_eq!(out, want);
        assert!(w.is_empty() && w.next_due().is_none());
        expired_total + want.len()
    }

    #[test]
    fn matches_a_sorted_set_over_long_random_schedules() {
        let mut total = 0;
        for seed in 1..=6 {
            total += run_schedule(seed, 256, 10, 4096, 40_000);
            // A small ring: the overflow heap and wrapping work hard.
            total += run_schedule(seed * 77, 64, 6, 64, 40_000);
        }
        assert!(total > 200_000, "{total} tokens went through");
    }

    #[test]
    fn full_is_an_error_and_a_freed_entry_is_reused() {
        let mut w: TimerWheel<u8> = TimerWheel::new(2);
        w.insert(10, 1).unwrap();
        w.insert(5, 2).unwrap();
        assert_eq!(w.insert(7, 3), Err(WheelFull { capacity: 2 }));
        assert_eq!(w.next_due(), Some(5));
        let mut out = Vec::new();
        w.expire(4, &mut out);
        assert!(out.is_empty());
        w.expire(5, &mut out);
        assert_eq!(out, [2]);
        w.insert(7, 3).unwrap();
        w.expire(100, &mut out);
        assert_eq!(out, [2, 3, 1]);
        let mut z: TimerWheel<u8> = TimerWheel::new(0);
        assert_eq!(z.insert(1, 1), Err(WheelFull { capacity: 0 }));
    }

    #[test]
    fn ties_leave_in_insertion_order_across_buckets_and_overflow() {
        let mut w: TimerWheel<u32> = TimerWheel::with_geometry(16, 4, 64);
        for t in 0..4 {
            w.insert(5000, t).unwrap(); // beyond the 1024-ns horizon
            w.insert(3, 10 + t).unwrap();
        }
        let mut out = Vec::new();
        w.expire(6000, &mut out);
        assert_eq!(out, [10, 11, 12, 13, 0, 1, 2, 3]);
    }
}
