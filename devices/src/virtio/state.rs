//! A virtio PCI function's state in state memory ([`StateMemory`]), so that
//! a new device process resumes the device a killed one was serving,
//! invisibly to the driver (`DeviceModel::adopt_state`; the engine says
//! whether it can, [`QueueEngine::state_supported`]: iopath's virtio-blk).
//!
//! What is kept: the transport's registers (device status, config
//! generation, the configuration vector, queue_select, the feature selectors
//! and the negotiated features), each queue's size, enable, vector and ring
//! addresses, the MSI-X table and Message Control as the device sees them,
//! and per queue the chains taken from the available ring and not yet
//! completed, in vhost-user's split-ring in-flight format (`inflight.rs`,
//! QEMU's layout: one region per queue, after the registers), with the
//! device's last_avail_idx beside it. The used index is the used ring's own
//! (guest RAM outlives the device process; drivers never write it).
//!
//! Publication order (the process may die between any two stores):
//! 1. a register write (common configuration): served, then every word
//!    that differs from the registers now stored, the status word last;
//!    except a reset (status 0), whose status word goes first. A resumed
//!    device whose status word is 0 is reset, whatever the other words
//!    say. A write the dead process took or not is sent again by the
//!    client (`proxy/reconnect.rs`): register writes are idempotent.
//!    Enabling a queue sets its in-flight region up (no entry in flight,
//!    used index 0), then last_avail_idx, then the queue's word with its
//!    enable bit.
//! 2. a chain taken: the available ring read (nothing stored), then
//!    last_avail_idx (the index past it), then its region entry in flight
//!    (counter, then the flag). Given back to the ring (no room on the
//!    file's io_uring yet): flag cleared, then last_avail_idx back.
//! 3. a completion: the region's last batch = its head, then the used
//!    element into guest RAM, then used->idx (release), then its entry
//!    cleared and the region's used index = used->idx. Died with the
//!    element written and used->idx not published: used->idx equals the
//!    region's, the entry is still in flight, the request runs again and
//!    its element is written again at the same place (the driver saw
//!    neither). Died after used->idx was published: used->idx is one past
//!    the region's, and the last batch's entry is cleared, not resubmitted.
//!    So no request completes twice and none is lost.
//! 4. MSI-X table entries and Message Control: as written (two words a vector).
//!
//! Resume: everything read and validated first (the memory comes from a
//! client; a bad one is refused with the reason and the device left as it
//! was): layout, features within those offered, queue sizes, vectors, ring
//! addresses in guest RAM, each enabled queue's region (version, entries
//! below the queue size), used->idx at most one past the region's, and
//! used->idx plus the chains in flight equal to last_avail_idx or one less
//! (a death between steps 2's stores). Then the registers and MSI-X are
//! applied, the chains in flight run again oldest first, before anything
//! new, the queues served, and every vector in use signalled once: each
//! enabled queue's (or INTx), and the configuration vector if the device
//! needs a reset (the only time it raises that vector). A spurious MSI-X
//! is harmless, a lost one a hang.
//!
//! A ram disk keeps its data in the state memory too, after the words
//! (`crate::state::place_ram`; where, in `W_RAM`, checked at resume): a
//! fresh `adopt` moves the data there (the pages written so far copied),
//! and a resumed device reads and writes it in place (`block/ram.rs`). A
//! write the driver saw completed reads back after a resume: its data is
//! copied into the memfd's pages before step 3 starts, and step 3's stores
//! (the region's, then used->idx with release) come after them in program
//! order; the stores of a killed process stay in the memfd, which the
//! client holds. A write not completed is in flight and runs again.
//!
//! What is not kept: the counters, ISR (INTx is raised again on resume),
//! the PCI_CFG window (the client replays configuration writes), MSI-X
//! pending bits (every vector is signalled instead).

use super::{Transport, MSIX_CAP, MSIX_TABLE, NO_VECTOR, S_DRIVER_OK, S_NEEDS_RESET};
use crate::block::{Ram, Storage};
use crate::state::{place_ram, RamPlace, StateMemory};
use crate::virtio::inflight::{queue_region_size, InflightRing};
use crate::virtio::queue::{Queue, MAX_QUEUE_SIZE};
use crate::{Error, Result};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// "iopVblk1", little endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"iopVblk1");
pub(super) const W_MAGIC: usize = 0;
pub(super) const W_SHAPE: usize = 1;
/// status | generation << 8 | config vector << 16 | queue_select << 32.
pub(super) const W_DEV: usize = 2;
pub(super) const W_FEAT: usize = 3;
/// device_feature_select | driver_feature_select << 32.
pub(super) const W_SEL: usize = 4;
/// Message Control's high byte; bit 8: valid.
pub(super) const W_MSIX_CTL: usize = 5;
/// A ram disk's data: its byte offset and length (`RamPlace::words`; zeros: none).
pub(super) const W_RAM: usize = 6;
/// Two words a vector (the configuration's and one per queue).
pub(super) const W_MSIX: usize = 8;
/// Per queue: size | enabled << 16 | vector << 32; desc; avail; used.
pub(super) const W_QUEUE: usize = W_MSIX + 2 * (super::MAX_QUEUES as usize + 1);
pub(super) const Q_WORDS: usize = 4;
/// Per queue: the device's last_avail_idx.
pub(super) const W_AVAIL: usize = W_QUEUE + Q_WORDS * super::MAX_QUEUES as usize;
/// Where the in-flight regions start (bytes), one per queue.
pub(super) const REGIONS: usize = (W_AVAIL + super::MAX_QUEUES as usize).next_multiple_of(8) * 8;

/// Bytes of the words of a device of `queues` queues (a ram disk's data after them).
pub fn len(queues: u16) -> usize {
    REGIONS + queues as usize * queue_region_size(MAX_QUEUE_SIZE) as usize
}

/// Byte offset of queue `q`'s in-flight region.
pub(super) fn region_at(q: usize) -> usize {
    REGIONS + q * queue_region_size(MAX_QUEUE_SIZE) as usize
}

fn shape(queues: u16) -> u64 {
    1 | (queues as u64) << 8 | (MAX_QUEUE_SIZE as u64) << 24
}

fn bad(why: String) -> Error {
    Error::Host(format!("virtio: resume refused: state memory {why}"))
}

/// The device's recorder: the state memory and a view of each queue's region.
pub(in crate::virtio) struct Recorder {
    mem: Arc<StateMemory>,
    rings: Vec<InflightRing>,
    /// Set by a resume: the first used element published after it logs
    /// its time (`used_after`; `bench reconnect` reads it).
    first_since_resume: AtomicBool,
    /// Tests: where the "process" dies (a panic at a store).
    #[cfg(test)]
    kill: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Recorder {
    /// A recorder on `mem`, which holds at least [`len`]`(queues)` bytes.
    fn new(mem: StateMemory, queues: u16) -> Recorder {
        assert!(mem.len() >= len(queues));
        let mem = Arc::new(mem);
        let base = mem.words().as_ptr() as *mut u8;
        let rings = (0..queues as usize)
            .map(|q| {
                // SAFETY: inside the mapping (asserted above), 8-aligned
                // (a page-aligned base, REGIONS and region sizes multiples
                // of 64), and kept mapped by the Arc the view holds.
                let p = unsafe { NonNull::new_unchecked(base.add(region_at(q))) };
                // SAFETY: as above.
                unsafe { InflightRing::new(p, MAX_QUEUE_SIZE, mem.clone()) }
            })
            .collect();
        #[allow(unused_mut)]
        let mut rec = Recorder {
            mem,
            rings,
            first_since_resume: AtomicBool::new(false),
            #[cfg(test)]
            kill: None,
        };
        #[cfg(test)]
        if let Some(k) = tests::NEXT_KILL.with(|n| n.borrow().clone()) {
            rec.set_kill(k);
        }
        rec
    }

    /// Tests: die (panic) where `kill` says, at a store here or in a region.
    #[cfg(test)]
    pub(in crate::virtio) fn set_kill(&mut self, kill: Arc<dyn Fn() + Send + Sync>) {
        for r in &mut self.rings {
            r.hook = Some(kill.clone());
        }
        self.kill = Some(kill);
    }

    #[inline]
    fn put(&self, i: usize, v: u64) {
        #[cfg(test)]
        if let Some(k) = &self.kill {
            k();
        }
        self.mem.words()[i].store(v, Ordering::Release);
    }

    #[inline]
    fn put_if(&self, i: usize, v: u64) {
        if self.get(i) != v {
            self.put(i, v);
        }
    }

    fn get(&self, i: usize) -> u64 {
        self.mem.words()[i].load(Ordering::Acquire)
    }

    /// Step 2: queue `q` took the chain at `head`; the next index it takes is `next_avail`.
    #[inline]
    pub(in crate::virtio) fn take(&mut self, q: usize, head: u16, next_avail: u16) {
        self.put(W_AVAIL + q, next_avail as u64);
        self.rings[q].take(head);
    }

    /// Step 2: the chain at `head`, taken last, is left available after all.
    pub(in crate::virtio) fn untake(&mut self, q: usize, head: u16, next_avail: u16) {
        self.rings[q].untake(head);
        self.put(W_AVAIL + q, next_avail as u64);
    }

    /// Step 3, before the used element is written.
    #[inline]
    pub(in crate::virtio) fn used_before(&self, q: usize, head: u16) {
        self.rings[q].used_before(head);
    }

    /// Step 3, after used->idx (`used_idx`) is published.
    #[inline]
    pub(in crate::virtio) fn used_after(&self, q: usize, head: u16, used_idx: u16) {
        self.rings[q].used_after(head, used_idx);
        // A plain load on the fast path; the swap once per resume.
        let first = &self.first_since_resume;
        if first.load(Ordering::Relaxed) && first.swap(false, Ordering::Relaxed) {
            let ns = crate::state::monotonic_ns();
            log::warn!("virtio-blk: {}{ns} ns", crate::state::RESUMED_FIRST_COMPLETION);
        }
    }
}

impl Transport {
    fn dev_word(&self) -> u64 {
        self.status as u64
            | (self.generation as u64) << 8
            | (self.config_vector as u64) << 16
            | (self.queue_sel as u64) << 32
    }

    /// Step 1: the registers into the state memory, in the module's order.
    pub(super) fn record(&mut self) {
        let dev = self.dev_word();
        let Some(r) = self.rec.as_deref_mut() else { return };
        if self.status == 0 {
            r.put_if(W_DEV, dev);
        }
        for (q, vq) in self.queues.iter().enumerate() {
            let b = W_QUEUE + Q_WORDS * q;
            let ring = &vq.ring;
            if ring.ready && r.get(b) >> 16 & 1 == 0 {
                r.rings[q].reset(ring.next_used);
                r.put_if(W_AVAIL + q, ring.next_avail as u64);
            }
            r.put_if(b + 1, ring.desc);
            r.put_if(b + 2, ring.avail);
            r.put_if(b + 3, ring.used);
            r.put_if(b, ring.num as u64 | (ring.ready as u64) << 16 | (vq.vector as u64) << 32);
        }
        r.put_if(W_FEAT, self.driver_features);
        r.put_if(W_SEL, self.dfsel as u64 | (self.gfsel as u64) << 32);
        r.put_if(W_DEV, dev);
    }

    /// Step 4: MSI-X vector `v`'s table entry as it stands.
    pub(super) fn record_msix(&mut self, v: usize) {
        let mut e = [0u8; 16];
        if !self.msix.read(0, MSIX_TABLE + 16 * v as u64, &mut e) {
            return;
        }
        let Some(r) = self.rec.as_deref_mut() else { return };
        if v < self.queues.len() + 1 {
            r.put_if(W_MSIX + 2 * v, u64::from_le_bytes(e[..8].try_into().unwrap()));
            r.put_if(W_MSIX + 2 * v + 1, u64::from_le_bytes(e[8..].try_into().unwrap()));
        }
    }

    /// Step 4: Message Control's enable and function mask.
    pub(super) fn record_msix_control(&mut self) {
        let b = (self.msix.enabled() as u64) << 7 | (self.msix.function_masked() as u64) << 6;
        if let Some(r) = self.rec.as_deref_mut() {
            r.put_if(W_MSIX_CTL, b | 1 << 8);
        }
    }

    /// Everything, as it stands (after an adopt).
    fn record_all(&mut self) {
        self.record();
        for v in 0..self.queues.len() + 1 {
            self.record_msix(v);
        }
        self.record_msix_control();
    }
}

/// One queue as a valid state memory describes it.
#[derive(Debug, Clone, Default)]
struct QueuePlan {
    ring: Queue,
    vector: u16,
    resubmit: Vec<u16>,
}

/// What a valid state memory says, ready to apply.
pub(super) struct Plan {
    dev: u64,
    features: u64,
    sel: u64,
    msix: Vec<[u8; 16]>,
    msix_ctl: Option<u8>,
    queues: Vec<QueuePlan>,
}

impl Plan {
    /// Reads and validates what `rec`'s memory holds for transport `t`
    /// (attached: its guest memory is where the rings must lie). Repairs a
    /// region whose device died inside a completion (step 3) only once
    /// everything else has been found valid.
    fn read(t: &Transport, rec: &mut Recorder, ram: Option<RamPlace>) -> Result<Plan> {
        let n = t.queues.len();
        let w: Vec<u64> = rec.mem.words()[..REGIONS / 8].iter().map(|x| x.load(Ordering::Acquire)).collect();
        if w[W_MAGIC] != MAGIC {
            return Err(bad(format!("holds no virtio state (magic {:#x})", w[W_MAGIC])));
        }
        if w[W_SHAPE] != shape(n as u16) {
            return Err(bad(format!("has another layout ({:#x}; this device {:#x})", w[W_SHAPE], shape(n as u16))));
        }
        if w[W_RAM..W_RAM + 2] != RamPlace::words(ram) {
            let want = ram.map_or("none".into(), |p| format!("{} bytes at byte {}", p.len, p.at));
            let (at, len) = (w[W_RAM], w[W_RAM + 1]);
            return Err(bad(format!("has ram data at byte {at} ({len} bytes); this device keeps {want} there")));
        }
        let Some(ctx) = &t.ctx else { return Err(bad("cannot be resumed before the device is attached".into())) };
        let dev = w[W_DEV];
        let vectors = t.msix_vectors();
        let vector_ok = |v: u16| v < vectors || v == NO_VECTOR;
        let cv = (dev >> 16) as u16;
        if dev >> 48 != 0 || !vector_ok(cv) {
            return Err(bad(format!("has device word {dev:#x} (configuration vector {cv} of {vectors})")));
        }
        let features = w[W_FEAT];
        if features & !t.features() != 0 {
            return Err(bad(format!("has features {features:#x}, not within those offered ({:#x})", t.features())));
        }
        let msix = (0..vectors as usize)
            .map(|v| {
                let mut e = [0u8; 16];
                e[..8].copy_from_slice(&w[W_MSIX + 2 * v].to_le_bytes());
                e[8..].copy_from_slice(&w[W_MSIX + 2 * v + 1].to_le_bytes());
                e
            })
            .collect();
        let ctl = w[W_MSIX_CTL];
        let msix_ctl = (ctl >> 8 & 1 == 1).then_some(ctl as u8);
        let mut plan = Plan { dev, features, sel: w[W_SEL], msix, msix_ctl, queues: vec![QueuePlan::default(); n] };
        if dev as u8 == 0 {
            return Ok(plan); // reset, whatever else the words say (step 1)
        }
        let event_idx = features & super::F_EVENT_IDX != 0;
        let mut noted = vec![None; n];
        for (q, slot) in noted.iter_mut().enumerate() {
            let b = W_QUEUE + Q_WORDS * q;
            let word = w[b];
            let (num, ready, vector) = (word as u16, word >> 16 & 1 == 1, (word >> 32) as u16);
            if word >> 48 != 0 || word >> 17 & 0x7fff != 0 || !vector_ok(vector) {
                return Err(bad(format!("has queue {q} word {word:#x}")));
            }
            if num == 0 || num > MAX_QUEUE_SIZE || !num.is_power_of_two() {
                return Err(bad(format!("has queue {q} of size {num}")));
            }
            let ring =
                Queue { num, ready, desc: w[b + 1], avail: w[b + 2], used: w[b + 3], event_idx, ..Queue::new(num) };
            if ready {
                ring.validate(&ctx.mem).map_err(|e| bad(format!("has queue {q}'s rings where they cannot be: {e}")))?;
                let note = rec.rings[q].check(num).map_err(|e| bad(format!("has queue {q}'s {e}")))?;
                let used = ring.used_idx(&ctx.mem).map_err(|e| bad(format!("has queue {q}'s used ring: {e}")))?;
                let gap = used.wrapping_sub(note.used_idx);
                if gap > 1 {
                    return Err(bad(format!(
                        "has queue {q}'s used index {} noted, its used ring {used} (one completion apart at most)",
                        note.used_idx
                    )));
                }
                *slot = Some(used);
            }
            plan.queues[q] = QueuePlan { ring, vector, resubmit: Vec::new() };
        }
        // Valid: the regions resume (a completion cut short is repaired).
        let live = t.live_status(dev as u8);
        for (q, qp) in plan.queues.iter_mut().enumerate() {
            let Some(used) = noted[q] else { continue };
            let r = rec.rings[q].start(qp.ring.num, used).map_err(|e| bad(format!("has queue {q}'s {e}")))?;
            let next = r.next_avail.unwrap_or(used);
            let last = w[W_AVAIL + q];
            if last >> 16 != 0 || (next != last as u16 && next.wrapping_add(1) != last as u16) {
                return Err(bad(format!(
                    "has queue {q}'s last available index {last:#x}; its used index {used} and {} in flight say {next}",
                    r.resubmit.len()
                )));
            }
            (qp.ring.next_avail, qp.ring.next_used) = (next, used);
            if live {
                qp.resubmit = r.resubmit;
            }
        }
        Ok(plan)
    }
}

impl Transport {
    /// Whether a device with status `s` serves its queues (see [`Transport::live`]).
    fn live_status(&self, s: u8) -> bool {
        let ok = super::S_FEATURES_OK | S_DRIVER_OK;
        s & ok == ok && s & (S_NEEDS_RESET | super::S_FAILED) == 0
    }

    /// Applies a plan [`Plan::read`] validated: the registers, queues and
    /// MSI-X. Returns the chains to run again per queue.
    /// A reset plan (status 0) applies MSI-X alone: a virtio reset leaves it as it was.
    fn apply(&mut self, p: Plan) -> Vec<Vec<u16>> {
        let dev = p.dev;
        let mut again = Vec::new();
        if dev as u8 != 0 {
            (self.status, self.generation) = (dev as u8, (dev >> 8) as u8);
            (self.config_vector, self.queue_sel) = ((dev >> 16) as u16, (dev >> 32) as u16);
            (self.driver_features, self.dfsel, self.gfsel) = (p.features, p.sel as u32, (p.sel >> 32) as u32);
            for (vq, qp) in self.queues.iter_mut().zip(p.queues) {
                vq.ring = qp.ring;
                vq.vector = qp.vector;
                again.push(qp.resubmit);
            }
        }
        for (v, e) in p.msix.iter().enumerate() {
            for k in 0..4 {
                self.msix.write(0, MSIX_TABLE + 16 * v as u64 + 4 * k as u64, &e[4 * k..4 * k + 4]);
            }
        }
        if let Some(b) = p.msix_ctl {
            self.msix.config_write(MSIX_CAP + 3, &[b]);
        }
        for v in 0..self.msix_vectors() as usize {
            self.msix_update(v);
        }
        again
    }

    /// Signals every vector in use once, after a resume: each enabled
    /// queue's (INTx with the ISR's queue bit without MSI-X), and the
    /// configuration vector of a device that needs a reset.
    fn signal_all(&mut self) {
        if !self.live() && self.status & S_NEEDS_RESET == 0 {
            return;
        }
        let mut seen = Vec::new();
        for i in 0..self.queues.len() {
            let v = self.queues[i].vector;
            if self.queues[i].ring.ready && !seen.contains(&v) {
                seen.push(v);
                self.queue_interrupt(i);
            }
        }
        if self.status & S_NEEDS_RESET != 0 {
            self.interrupt(self.config_vector, 2);
        }
    }
}

impl<E: super::QueueEngine> super::VirtioPci<E> {
    /// `DeviceModel::state_len`: the bytes, if the engine can resume.
    pub(super) fn state_bytes(&self) -> Option<usize> {
        let mut s = self.state();
        s.e.state_supported().ok()?;
        let n = s.t.num_queues();
        ram_place(&mut s.e, n).ok().map(|(_, len)| len)
    }

    /// The state counters, only while state is kept: the bytes of state
    /// memory, and a ram disk's there (`crate::state`'s counters).
    pub(super) fn state_counters(s: &mut super::State<E>) -> Vec<crate::Counter> {
        let Some(r) = s.t.rec.as_deref() else { return Vec::new() };
        let mut c = vec![(crate::state::MEMORY_BYTES, r.mem.len() as u64)];
        if let Some(Storage::Ram(ram)) = s.e.state_ram() {
            if ram.in_state_memory() {
                c.push((crate::state::RAM_BYTES, ram.len()));
                c.push((crate::state::RAM_WRITTEN_BYTES, ram.written_bytes()));
            }
        }
        c.into_iter().map(|(n, value)| crate::Counter { name: n.into(), value }).collect()
    }

    /// `DeviceModel::adopt_state`: fresh (zeroed, then the device as it
    /// stands recorded) or resumed (see the module documentation).
    pub(super) fn adopt(&self, mem: StateMemory, resume: bool) -> Result<()> {
        let mut s = self.state();
        s.e.state_supported()?;
        let n = s.t.num_queues();
        let (place, need) = ram_place(&mut s.e, n)?;
        if mem.len() < need {
            return Err(Error::Host(format!("virtio: state memory of {} bytes; it needs {need}", mem.len())));
        }
        if !resume {
            let busy = s.t.queues.iter().position(|q| q.ring.ready && q.ring.next_avail != q.ring.next_used);
            if let Some(q) = busy {
                return Err(Error::Host(format!("virtio: no state memory: queue {q} has requests in flight")));
            }
            for w in mem.words()[..len(n).div_ceil(8)].iter().filter(|w| w.load(Ordering::Relaxed) != 0) {
                w.store(0, Ordering::Relaxed);
            }
            // A ram disk's data moves in (the magic, below, comes after it).
            for (k, v) in RamPlace::words(place).into_iter().enumerate() {
                mem.words()[W_RAM + k].store(v, Ordering::Relaxed);
            }
            move_ram(&mut s.e, &mem, place, false)?;
            mem.words()[W_SHAPE].store(shape(n), Ordering::Relaxed);
            mem.words()[W_MAGIC].store(MAGIC, Ordering::Release);
            s.t.rec = Some(Box::new(Recorder::new(mem, n)));
            s.t.record_all();
            return Ok(());
        }
        if s.t.rec.is_some() {
            return Err(Error::Host("virtio: resume: this device keeps its state already (resume a fresh one)".into()));
        }
        let mut rec = Recorder::new(mem, n);
        let plan = Plan::read(&s.t, &mut rec, place)?;
        // Valid: no write of the dead process may land after the re-executed ones.
        s.e.after_predecessor()?;
        move_ram(&mut s.e, &rec.mem, place, true)?;
        let reset = plan.dev as u8 == 0;
        let super::State { t, e } = &mut *s;
        if reset {
            e.reset(t);
            t.forget();
        }
        let again = t.apply(plan);
        rec.first_since_resume = AtomicBool::new(true);
        t.rec = Some(Box::new(rec));
        t.record_all();
        e.resumed(t, again);
        t.signal_all();
        Ok(())
    }
}

/// Where the engine's ram disk's data lies (None: no ram disk), after the
/// words of `queues` queues, and the bytes of state memory it asks for.
fn ram_place<E: super::QueueEngine>(e: &mut E, queues: u16) -> Result<(Option<RamPlace>, usize)> {
    let size = e.state_ram().map(|s| s.bytes());
    let (places, len) = place_ram(len(queues), &[size]).map_err(|e| Error::Host(format!("virtio: {e}")))?;
    Ok((places[0], len))
}

/// The engine's ram disk into the state memory at `place`: resumed, the
/// data there in place; fresh, the data it held copied in.
fn move_ram<E: super::QueueEngine>(e: &mut E, mem: &StateMemory, place: Option<RamPlace>, resume: bool) -> Result<()> {
    let (Some(Storage::Ram(old)), Some(p)) = (e.state_ram(), place) else { return Ok(()) };
    let ram = Ram::in_state(mem, p, (!resume).then_some(&**old))
        .map_err(|e| Error::Host(format!("virtio: the ram disk's data: {e}")))?;
    if let Some(s) = e.state_ram() {
        *s = Storage::Ram(Arc::new(ram));
    }
    Ok(())
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
