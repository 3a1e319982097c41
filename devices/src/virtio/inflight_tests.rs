//! The in-flight region against a reference model: a driver and a device
//! (its used ring in "guest memory", the region in "shared memory", both of
//! which outlive the device), the device killed at random points of random
//! schedules (after a pop, the region's mark, the I/O, the batch note, the
//! used-ring write, the used index, the clear). The model knows what each
//! chain's state was when the device died; after each restart the region
//! must name exactly the chains marked and not yet published, oldest
//! first, and the next available index must follow them. At the end every
//! request submitted completed exactly once.

use super::*;
use crate::rng::SplitMix64;
use std::collections::{HashMap, VecDeque};

/// The region's memory (8-aligned), kept by the views of it.
fn region(queue_size: u16) -> (Arc<Vec<AtomicU64>>, NonNull<u8>) {
    let words = queue_region_size(queue_size).div_ceil(8) as usize;
    let mem: Arc<Vec<AtomicU64>> = Arc::new((0..words).map(|_| AtomicU64::new(0)).collect());
    let p = NonNull::new(mem.as_ptr() as *mut u8).unwrap();
    (mem, p)
}

fn view(mem: &Arc<Vec<AtomicU64>>, p: NonNull<u8>, desc_num: u16) -> InflightRing {
    // SAFETY: `mem` is 8-aligned, as long as the region, and kept by the view.
    unsafe { InflightRing::new(p, desc_num, mem.clone()) }
}

/// Where a chain taken by the device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Taken from the available ring, not yet noted in the region.
    Popped,
    /// Noted in flight (`take`).
    Marked,
    /// Its I/O done.
    Done,
    /// The batch note written (`used_before`).
    Noted,
    /// Its used element written.
    Written,
    /// The used index published (the driver may see it).
    Published,
}

struct Model {
    num: u16,
    rng: SplitMix64,
    // Guest memory (survives the device).
    avail: Vec<u16>,
    avail_idx: u16,
    used: Vec<u16>,
    used_idx: u16,
    // The driver.
    free: Vec<u16>,
    req_of: HashMap<u16, u64>,
    next_req: u64,
    seen_used: u16,
    completed: HashMap<u64, u32>,
    submitted: u64,
    // The device (lost when it dies).
    ring: InflightRing,
    next_avail: u16,
    /// Chains the device took, oldest first, with their stage.
    taken: VecDeque<(u16, Stage)>,
    executed: HashMap<u64, u32>,
    resubmits: u64,
}

impl Model {
    fn new(num: u16, desc_num: u16, seed: u64, mem: &Arc<Vec<AtomicU64>>, p: NonNull<u8>) -> Self {
        let mut ring = view(mem, p, desc_num);
        assert_eq!(ring.start(num, 0).unwrap(), Resume::default(), "a new region resumes nothing");
        Model {
            num,
            rng: SplitMix64(seed),
            avail: vec![0; num as usize],
            avail_idx: 0,
            used: vec![0; num as usize],
            used_idx: 0,
            free: (0..num).rev().collect(),
            req_of: HashMap::new(),
            next_req: 0,
            seen_used: 0,
            completed: HashMap::new(),
            submitted: 0,
            ring,
            next_avail: 0,
            taken: VecDeque::new(),
            executed: HashMap::new(),
            resubmits: 0,
        }
    }

    fn submit(&mut self) {
        let Some(head) = self.free.pop() else { return };
        self.req_of.insert(head, self.next_req);
        self.next_req += 1;
        self.submitted += 1;
        self.avail[(self.avail_idx % self.num) as usize] = head;
        self.avail_idx = self.avail_idx.wrapping_add(1);
    }

    /// The driver reaps what the used index shows: each request once.
    fn reap(&mut self) {
        while self.seen_used != self.used_idx {
            let head = self.used[(self.seen_used % self.num) as usize];
            let req = self.req_of.remove(&head).expect("a used head the driver had not made available");
            let n = self.completed.entry(req).or_default();
            *n += 1;
            assert_eq!(*n, 1, "request {req} (head {head}) completed twice");
            assert!(self.executed.get(&req).copied().unwrap_or(0) >= 1, "request {req} completed, never done");
            self.free.push(head);
            self.seen_used = self.seen_used.wrapping_add(1);
        }
    }

    /// One step of the device: a pop, or the next stage of a taken chain.
    fn device_step(&mut self) {
        // A popped chain is marked next (one thread: nothing else between).
        if let Some(k) = self.taken.iter().position(|&(_, s)| s == Stage::Popped) {
            let head = self.taken[k].0;
            self.ring.take(head);
            self.taken[k].1 = Stage::Marked;
            return;
        }
        // A completion under way goes on (one used-ring writer).
        if let Some(k) = self.taken.iter().position(|&(_, s)| matches!(s, Stage::Noted | Stage::Written)) {
            let head = self.taken[k].0;
            if self.taken[k].1 == Stage::Noted {
                self.used[(self.used_idx % self.num) as usize] = head;
                self.taken[k].1 = Stage::Written;
            } else {
                self.used_idx = self.used_idx.wrapping_add(1);
                self.taken[k].1 = Stage::Published;
            }
            return;
        }
        if let Some(k) = self.taken.iter().position(|&(_, s)| s == Stage::Published) {
            let (head, _) = self.taken.remove(k).unwrap();
            self.ring.used_after(head, self.used_idx);
            return;
        }
        let pop = self.next_avail != self.avail_idx && self.rng.below(3) == 0;
        if pop || self.taken.is_empty() {
            if self.next_avail != self.avail_idx {
                let head = self.avail[(self.next_avail % self.num) as usize];
                self.next_avail = self.next_avail.wrapping_add(1);
                self.taken.push_back((head, Stage::Popped));
            }
            return;
        }
        // Any chain taken: its I/O, or (done) the start of its completion, out of order.
        let k = self.rng.below(self.taken.len() as u64) as usize;
        let (head, stage) = self.taken[k];
        match stage {
            Stage::Marked => {
                *self.executed.entry(self.req_of[&head]).or_default() += 1;
                self.taken[k].1 = Stage::Done;
            }
            Stage::Done => {
                self.ring.used_before(head);
                self.taken[k].1 = Stage::Noted;
            }
            _ => unreachable!("handled above"),
        }
    }

    /// The device dies; a new one starts on the same region and rings, with
    /// the vring base the frontend then sends (its used index, as QEMU's
    /// vhost-user-blk after a lost backend).
    fn restart(&mut self, mem: &Arc<Vec<AtomicU64>>, p: NonNull<u8>, desc_num: u16) {
        // What the region must say: chains marked and not published, oldest first.
        let want: Vec<u16> = self
            .taken
            .iter()
            .filter(|&&(_, s)| !matches!(s, Stage::Popped | Stage::Published))
            .map(|&(h, _)| h)
            .collect();
        let mut ring = view(mem, p, desc_num);
        let r = ring.start(self.num, self.used_idx).unwrap();
        assert_eq!(r.resubmit, want, "resubmitted chains (taken: {:?})", self.taken);
        assert_eq!(r.next_avail, Some(self.used_idx.wrapping_add(want.len() as u16)));
        self.ring = ring;
        self.next_avail = r.next_avail.unwrap();
        self.resubmits += want.len() as u64;
        self.taken = want.into_iter().map(|h| (h, Stage::Marked)).collect();
    }
}

fn run(seed: u64, num: u16, desc_num: u16, steps: usize) -> Model {
    let (mem, p) = region(desc_num);
    let mut m = Model::new(num, desc_num, seed, &mem, p);
    for _ in 0..steps {
        match m.rng.below(20) {
            0..=4 => m.submit(),
            5..=7 => m.reap(),
            8 => m.restart(&mem, p, desc_num),
            _ => m.device_step(),
        }
    }
    // Drain without deaths: everything submitted completes, once.
    for _ in 0..100_000 {
        if m.completed.len() as u64 == m.submitted {
            break;
        }
        m.device_step();
        m.reap();
    }
    assert_eq!(m.completed.len() as u64, m.submitted, "seed {seed}: requests lost");
    assert!(m.completed.values().all(|&n| n == 1));
    m
}

#[test]
fn every_request_completes_once_across_deaths_at_any_point() {
    let mut resubmits = 0;
    for seed in 0..300 {
        for (num, desc_num) in [(4, 4), (8, 16), (16, 16)] {
            let m = run(seed, num, desc_num, 3000);
            resubmits += m.resubmits;
        }
    }
    // The schedules did kill devices with chains in flight.
    assert!(resubmits > 1000, "only {resubmits} resubmissions");
}

#[test]
fn a_death_between_the_used_index_and_the_clear_resubmits_nothing() {
    let (mem, p) = region(8);
    let mut r = view(&mem, p, 8);
    r.start(8, 5).unwrap();
    r.take(3);
    r.take(6);
    r.used_before(6);
    // The used index went 5 -> 6 (head 6), then the device died.
    let mut again = view(&mem, p, 8);
    assert_eq!(again.start(8, 6).unwrap(), Resume { next_avail: Some(7), resubmit: vec![3] });
    // And a death before the used index resubmits both, oldest first.
    let (mem, p) = region(8);
    let mut r = view(&mem, p, 8);
    r.start(8, 0).unwrap();
    r.take(6);
    r.take(3);
    r.used_before(3);
    let mut again = view(&mem, p, 8);
    assert_eq!(again.start(8, 0).unwrap(), Resume { next_avail: Some(2), resubmit: vec![6, 3] });
    // The new device counts on: a chain it takes now is after both.
    again.take(1);
    let mut third = view(&mem, p, 8);
    assert_eq!(third.start(8, 0).unwrap().resubmit, vec![6, 3, 1]);
}

#[test]
fn a_hostile_region_is_refused_not_followed() {
    let (mem, p) = region(8);
    let mut r = view(&mem, p, 8);
    assert_eq!(r.start(16, 0), Err(InflightError::Size { num: 16, desc_num: 8 }));
    r.start(4, 0).unwrap();
    r.take(2);
    // An entry past the ring's size (the frontend wrote it).
    r.u8_at(InflightRing::entry(6)).store(1, Ordering::Relaxed);
    assert_eq!(view(&mem, p, 8).start(4, 0), Err(InflightError::Index { index: 6, num: 4 }));
    r.u16_at(VERSION_AT).store(7, Ordering::Relaxed);
    assert_eq!(view(&mem, p, 8).start(4, 0), Err(InflightError::Version(7)));
    // A batch list pointing anywhere, and a gap as large as it gets: bounded, in range.
    r.u16_at(VERSION_AT).store(VERSION, Ordering::Relaxed);
    r.u8_at(InflightRing::entry(6)).store(0, Ordering::Relaxed);
    r.u16_at(LAST_BATCH_AT).store(0xffff, Ordering::Relaxed);
    assert_eq!(view(&mem, p, 8).start(4, 0x8000).unwrap().next_avail, Some(0x8001));
    // A head past the region is ignored, never written out of bounds.
    r.take(9);
    r.used_before(9);
    r.used_after(9, 1);
}

#[test]
fn sizes_follow_the_queue_size() {
    assert_eq!(queue_region_size(128), 2112);
    assert_eq!(queue_region_size(256), 4160);
    assert_eq!(queue_region_size(1), 64);
    assert_eq!(region_size(4, 256), 4 * 4160);
}

/// What virtio-blk's state memory adds (`state.rs`): a region set up at a
/// queue's enable whatever it held, a chain given back, and a read that
/// changes nothing and refuses what `start` would.
#[test]
fn reset_untake_and_check_as_the_state_memory_uses_them() {
    let (mem, p) = region(8);
    let mut r = view(&mem, p, 8);
    assert_eq!(r.check(8), Err(InflightError::Version(0)), "never set up");
    r.reset(5);
    assert_eq!(r.check(8), Ok(Noted { used_idx: 5, in_flight: 0 }));
    r.take(3);
    r.take(6);
    r.untake(6);
    assert_eq!(r.check(8), Ok(Noted { used_idx: 5, in_flight: 1 }));
    r.take(6);
    assert_eq!(r.check(4), Err(InflightError::Index { index: 6, num: 4 }));
    assert_eq!(r.check(16), Err(InflightError::Size { num: 16, desc_num: 8 }));
    // check changed nothing: a start resumes both, oldest first.
    let mut again = view(&mem, p, 8);
    assert_eq!(again.start(8, 5).unwrap(), Resume { next_avail: Some(7), resubmit: vec![3, 6] });
    // A reset forgets them (a driver that reset the device abandoned them).
    again.reset(0);
    assert_eq!(again.check(8), Ok(Noted { used_idx: 0, in_flight: 0 }));
    assert_eq!(view(&mem, p, 8).start(8, 0).unwrap(), Resume { next_avail: Some(0), resubmit: vec![] });
}
