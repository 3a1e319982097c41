//! NVMe's state in state memory ([`crate::state::StateMemory`]), so that a
//! new device process resumes a controller a killed one was serving,
//! invisibly to the guest (`DeviceModel::adopt_state`, `resume.rs`).
//!
//! Design: a resumed controller runs every command fetched and not
//! completed again, never one whose completion was posted, and never reads
//! an SQ entry the driver may have reused. A driver reuses an entry once a
//! completion says it was consumed: one that reports an SQ head past it
//! (SPDK's driver goes by that), or any completion of a command submitted
//! after it (Linux's reuses entries on that alone). Until then the entry in
//! the SQ is as good as a copy. So an I/O command is published (its 64-byte
//! entry copied into a slot, with its SQ id, SQ index and a sequence
//! number, and the SQ's head word moved past it) only if it is still in
//! flight when another completion is about to be posted, another command is
//! fetched or the configuration is committed (`flush`). A command that
//! completes before that (a null or ram namespace, always) is published by
//! nothing at all: its CQE in guest RAM is the record. The recorder keeps
//! the SQ's head and the CQ's tail as they stand and stores them once per
//! pass over an SQ (`record`); a resumed controller reads back, from each
//! CQ's recorded tail, the entries that carry the lap's phase (`resume.rs`,
//! `scan_cq`): the dead process posted them after its last record. The tail
//! moves past them, and each SQ's head to what the newest of them reports.
//! Admin commands are published at once. The alternative, reporting no SQ
//! head beyond the oldest command in flight, would cost nothing to record
//! but hold the driver's SQ slots for as long as the slowest file operation
//! (a queue as deep as the guest's is what `file:` namespaces are for), and
//! an AER outstanding for hours would pin the admin SQ's head.
//!
//! Publication order (the process may die between any two stores; `S_*`
//! and the word areas are `layout.rs`'s):
//! 0. `record`: the SQ's head word, then the CQ's tail word. A head word
//!    stored after its CQ's tail word could be older than a CQE after that
//!    tail, which a resumed controller would take to be no newer. It runs
//!    at the end of each pass, when a CQ wraps (so a resumed controller
//!    reads back less than a lap; a pass posts less than a lap anyway, the
//!    CQ's room counted at its start), before a fetch is published, a slot
//!    freed or the configuration committed.
//! 1. fetch, published: what stands recorded (0), then the sequence
//!    number and the SQE into a free slot, then its state word FETCHED
//!    (release), then the SQ's head word, which carries the sequence number
//!    of the fetch that moved it. Resumed with a FETCHED slot newer than
//!    its SQ's head word (its head store did not happen), the head is moved
//!    past the slot's index. (The index alone would not tell: a slow
//!    command's entry index comes round again a lap later.) Sequence
//!    numbers are 48 bits there: 2^48 commands, 9 years at a million a
//!    second, before they would wrap.
//! 2. completion of a command in a slot: the CQE (dw0, phase and status,
//!    the SQ head it reports) into the slot, then its state POSTING with the
//!    cid and the CQ position (release), then the CQE into guest RAM, then
//!    what stands (0), then FREE. Resumed with a POSTING slot whose CQE is
//!    not in the CQ (its position is the tail after the read-back), the
//!    same CQE is written at the same place and the tail advanced; with the
//!    CQE found there, only the slot is freed. Only one slot is POSTING at a
//!    time (completions are posted under the core's lock, one queue group).
//!    The completion of the pending command (fetched last, unpublished): the
//!    CQE into guest RAM, nothing else until the next record.
//! 3. configuration (registers, queue definitions, shadow doorbell
//!    addresses, features, namespace formats and attachment, interrupt
//!    coalescing): written whole into the copy the selector does not name,
//!    then the selector flips. An admin command that completes now commits
//!    its configuration together with its completion (`Done`: slot,
//!    sequence number, dw0, status) before the CQE is posted through 2; a
//!    resumed controller finds it FETCHED with that `Done` and posts the
//!    completion without running it again (a Create I/O SQ run twice would
//!    fail, the queue existing). Without a `Done` it was not committed and
//!    runs again: Format NVM erases again, Delete drains again, idempotent.
//!    A disable or reset commits first, then frees the slots (a disabled
//!    configuration ignores them).
//! 4. doorbells served as register writes (the admin queue; I/O queues
//!    without shadow doorbells): the value into the SQ tail or CQ head word
//!    before it is acted upon. Shadow doorbells are read again from guest
//!    RAM on resume. MSI-X table entries and Message Control: as written.
//!
//! What is not kept, and why: the counters; asynchronous events queued or
//! outstanding (AER commands are kept and run again; an event lost is
//! informational, the log pages say the same); the Error Information log;
//! interrupt coalescing's held counts (every vector with a CQ is signalled
//! on resume: a spurious MSI-X is harmless, a lost one a hang); error
//! injection and timed completions (`timing=`, injection rules: refused).
//!
//! What the read-back relies on: a driver that zeroes a CQ before it
//! creates it (the phase tags of a new queue are 0: Linux's nvme driver
//! clears the CQ as it initialises the queue, SPDK's as it resets the queue
//! pair, iopath's guest driver as it allocates it) and leaves consumed entries as the device
//! wrote them (the phase tag protocol). An entry it finds that names an SQ
//! of another CQ, or a head outside its SQ, ends the read-back with a log
//! line: a hostile guest's CQ contents cost it its own commands, not the
//! controller's state.
//!
//! Cost on the fast path, a command that completes before the next is
//! fetched: no store at the fetch or the completion but the CQE's, the SQ
//! head and CQ tail words kept in the recorder, and two stores a pass; no
//! copy of its entry, no syscall, no lock. A command left in flight: its
//! entry read again from the SQ and 11 more stores (its slot's sequence
//! number, entry and state, the head word), then its slot's CQE and state,
//! the tail word and FREE at its completion. Nothing without `adopt_state`: `Core::rec` is None (a client that
//! offers no state memory, `iopath run --state-memory off`). Figures: the
//! ignored test `fast_path_cost_of_keeping_state` (one thread, every line
//! in cache) and `bench nvme --state-memory on,off` (the guest over
//! vfio-user, same run); the closing notes of the issue carry them.
//!
//! What resumes: `pollers=1`, every doorbell mode, null, file and ram
//! namespaces. Refused (`supported`): several pollers, timing models and
//! injection rules.
//!
//! BAR0's doorbell page (bar, bar-adaptive, auto) is a memfd the process
//! makes, and dies with it; the doorbells stored in it are the guest's, not
//! recorded here. The client hands the new process what the dead one's page
//! held, in the new page, before it resumes (the vfio-user proxy: its
//! `reconnect.rs`, which also keeps every store made after that as a
//! register write). A resumed controller takes each SQ's tail to be its
//! recorded head and each CQ's head from the page, then serves what the
//! page shows: a tail past the head is a submission, fetched once; a tail
//! at the head fetches nothing, whatever the page held before.
//!
//! Ram namespaces keep their data in the state memory, after the words
//! (`crate::state::place_ram`; where, in the ram table, checked at resume):
//! `adopt` moves each one's data there (fresh: the pages written so far are
//! copied, before the guest touches the controller), and a resumed
//! controller reads and writes it in place (`block/ram.rs`). A write
//! acknowledged before a kill reads back after the resume: its data is
//! copied into the memfd's pages (`Storage::write` returns) before its
//! completion goes through step 2, whose POSTING store is a release (the
//! data stores are ordered before it, and before the CQE in guest RAM);
//! the stores of a killed process stay in the memfd, which the client
//! holds. A write not acknowledged is FETCHED in its slot and runs again.

mod layout;
mod resume;
#[cfg(test)]
mod tests;

use super::controller::Core;
use super::queue::Sqe;
use super::{NvmeConfig, MSIX_TABLE, MSIX_VECTORS};
use crate::block::{Ram, Storage};
use crate::state::{place_ram, RamPlace, StateMemory};
use crate::{Error, GuestMem, Result};
use layout::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// The counter of the bytes of state memory the controller keeps its
/// state in (absent: it keeps none).
pub const STATE_MEMORY_BYTES: &str = crate::state::MEMORY_BYTES;

/// Where the ram namespaces' data lies (None: not ram), after the words,
/// and the bytes of state memory the controller asks for.
fn ram_places(c: &Core) -> Result<(Vec<Option<RamPlace>>, usize)> {
    let sizes: Vec<Option<u64>> =
        c.ns.iter().map(|n| matches!(n.storage, Storage::Ram(_)).then(|| n.storage.bytes())).collect();
    place_ram(LEN, &sizes).map_err(|e| Error::Host(format!("nvme: {e}")))
}

/// `DeviceModel::state_len`: the words and the ram namespaces' data.
pub(super) fn len(c: &Core) -> Result<usize> {
    ram_places(c).map(|(_, len)| len)
}

/// Why this controller's state cannot be kept, if it cannot.
pub(super) fn supported(cfg: &NvmeConfig) -> Result<()> {
    let no = |why: String| Err(Error::Host(format!("nvme: no state memory: {why}")));
    if cfg.pollers > 1 {
        return no(format!("pollers={} (one queue group only)", cfg.pollers));
    }
    if cfg.timing.is_some() || cfg.ns.iter().any(|n| n.timing.is_some()) || !cfg.inject.is_empty() {
        return no("timing= and inject= are not recorded".into());
    }
    Ok(())
}

/// The controller's recorder: the state memory and where its slots are.
pub(super) struct Recorder {
    mem: StateMemory,
    /// The next fetch's sequence number.
    seq: u64,
    free: Vec<u16>,
    /// Slots in flight: (sqid << 16 | cid, slot), newest last.
    busy: Vec<(u32, u16)>,
    /// The slot of the admin command fetched last (it commits it).
    current: Option<(u16, u64)>,
    /// The I/O command fetched last, not published yet: by nothing if it
    /// completes before anything else is posted, fetched or committed;
    /// else with its entry copied into a slot (`flush`; the module doc).
    pending: Option<Pending>,
    /// The SQ head word and CQ tail word that changed since the last
    /// `record` (a pass serves one SQ, completing to one CQ): (queue id,
    /// word), the id `NQ` for none.
    sq_word: (usize, u64),
    cq_word: (usize, u64),
    /// Commands whose entry was copied into their slot.
    copied: u64,
    select: u64,
    /// Commands fetched with no slot free (never, slots cover the most in flight).
    unrecorded: u64,
    /// Tests: where the "process" dies (a panic at a store).
    #[cfg(test)]
    pub kill: Option<std::sync::Arc<tests::Kill>>,
}

impl Recorder {
    fn new(mem: StateMemory) -> Recorder {
        Recorder {
            mem,
            seq: 1,
            free: (0..SLOTS as u16).rev().collect(),
            busy: Vec::new(),
            current: None,
            pending: None,
            sq_word: (NQ, 0),
            cq_word: (NQ, 0),
            copied: 0,
            select: 0,
            unrecorded: 0,
            #[cfg(test)]
            kill: None,
        }
    }

    #[inline]
    fn put(&self, i: usize, v: u64, o: Ordering) {
        self.put_to(&self.mem.words()[i], v, o);
    }

    /// A store to `w`, a word of the state memory (tests: a death may come first).
    #[inline(always)]
    fn put_to(&self, w: &AtomicU64, v: u64, o: Ordering) {
        self.kill_point();
        w.store(v, o);
    }

    /// Tests: the process may die here (a store, or a CQE about to be
    /// written to guest RAM); nothing otherwise.
    #[inline(always)]
    pub fn kill_point(&self) {
        #[cfg(test)]
        if let Some(k) = &self.kill {
            k.store();
        }
    }

    /// Slot `slot`'s words: one bounds check for all its stores, where
    /// each store through `put` would take its own.
    #[inline(always)]
    fn slot_words(&self, slot: u16) -> &[AtomicU64; SLOT_WORDS] {
        let base = SLOT0 + slot as usize * SLOT_WORDS;
        // `adopt` checked the memory holds every slot (LEN), and a slot
        // number comes from `free`, below SLOTS.
        self.mem.words()[base..base + SLOT_WORDS].try_into().expect("a slot lies within the state memory")
    }

    fn get(&self, i: usize) -> u64 {
        self.mem.words()[i].load(Ordering::Acquire)
    }

    /// Step 1: SQ `qid`'s entry at `idx`, at `gpa` in guest RAM `mem`, was
    /// fetched (None: unreadable) and the head is `head` now. An I/O command
    /// is published only if it stays in flight (`flush`, which reads its
    /// entry again from the SQ); an admin command, or an unreadable entry,
    /// at once.
    #[inline(always)]
    pub fn fetched(&mut self, mem: &GuestMem, qid: usize, idx: u16, gpa: u64, head: u16, sqe: Option<&Sqe>) {
        self.flush(mem);
        self.seq += 1;
        match sqe {
            Some(c) if qid > 0 => {
                let key = (qid as u32) << 16 | c.cid as u32;
                self.pending = Some(Pending { key, idx, head, gpa });
                self.current = None;
            }
            _ => self.fetched_now(self.seq - 1, FETCHED | (qid as u64) << 8 | (idx as u64) << 16, head, sqe),
        }
    }

    /// An admin command, or an entry that could not be read: published at once.
    #[inline(never)]
    fn fetched_now(&mut self, seq: u64, meta: u64, head: u16, sqe: Option<&Sqe>) {
        self.current = None;
        let Some(slot) = self.take_slot() else { return };
        let (w, bad) = sqe.map_or(([0; 8], BAD_SQE), |c| (sqe_words(c), 0));
        self.publish(slot, seq, &w, meta | bad, head);
        let key = ((meta >> 8 & 0xff) as u32) << 16 | sqe.map_or(0, |c| c.cid) as u32;
        self.busy.push((key, slot));
        self.current = Some((slot, seq));
    }

    fn take_slot(&mut self) -> Option<u16> {
        let slot = self.free.pop();
        if slot.is_none() {
            self.unrecorded += 1;
            if self.unrecorded == 1 {
                log::error!("nvme: no state slot free; a command goes unrecorded");
            }
        }
        slot
    }

    /// A fetch, published: what stands recorded first (`record`), then
    /// `slot`'s sequence number and entry, its state `meta` (FETCHED), and
    /// its SQ's head word.
    fn publish(&mut self, slot: u16, seq: u64, w: &[u64; 8], meta: u64, head: u16) {
        self.record();
        let s = self.slot_words(slot);
        self.put_to(&s[S_SEQ], seq, Ordering::Relaxed);
        for (k, &v) in w.iter().enumerate() {
            self.put_to(&s[S_SQE + k], v, Ordering::Relaxed);
        }
        self.put_to(&s[S_META], meta, Ordering::Release);
        let qid = (meta >> 8 & 0xff) as usize;
        self.put(SQ_HEAD + qid, head as u64 | seq << 16, Ordering::Release);
        self.copied += 1;
    }

    /// The pending command is still in flight: published (its entry into
    /// a slot) before the driver may reuse the SQ's: before a completion
    /// is posted (it reports a head past it, or completes a command after
    /// it), another command fetched or the configuration committed.
    /// Its entry is read again from the SQ in `mem` (no completion since
    /// its fetch: the driver has not reused it), so the fast path copies
    /// nothing; unreadable now (the memory gone), it is recorded as such.
    #[inline(always)]
    fn flush(&mut self, mem: &GuestMem) {
        if self.pending.is_some() {
            self.publish_pending(mem);
        }
    }

    #[inline(never)]
    fn publish_pending(&mut self, mem: &GuestMem) {
        if let Some(p) = self.pending.take() {
            let Some(slot) = self.take_slot() else { return };
            let mut e = [0u8; 64];
            let (w, bad) = match mem.read_slice(&mut e, p.gpa) {
                Ok(()) => (sqe_words(&Sqe::parse(&e)), 0),
                Err(_) => ([0; 8], BAD_SQE),
            };
            let meta = FETCHED | ((p.key >> 16) as u64) << 8 | (p.idx as u64) << 16;
            self.publish(slot, self.seq - 1, &w, meta | bad, p.head);
            self.busy.push((p.key, slot));
        }
    }

    /// What stands since the last record, stored: the SQs' head words
    /// first, then the CQs' tail words (a resumed controller reads the
    /// CQEs posted after a recorded tail back from the CQ, and takes an
    /// SQ's head from the newest of them: a head word stored after the
    /// tail word would be older than what the CQ says). Called at the end
    /// of every pass over an SQ, when a CQ wraps, and before a slot is
    /// published or freed or the configuration committed.
    #[inline(always)]
    pub fn record(&mut self) {
        if self.sq_word.0 != NQ || self.cq_word.0 != NQ {
            self.record_now();
        }
    }

    #[inline(never)]
    fn record_now(&mut self) {
        let (sq, cq) = (std::mem::replace(&mut self.sq_word, (NQ, 0)), std::mem::replace(&mut self.cq_word, (NQ, 0)));
        if sq.0 < NQ {
            self.put(SQ_HEAD + sq.0, sq.1, Ordering::Release);
        }
        if cq.0 < NQ {
            self.put(CQ_TAIL + cq.0, cq.1, Ordering::Release);
        }
    }

    /// Step 2, before the CQE goes to guest RAM. The pending command (it
    /// completes before anything else was published): nothing stored,
    /// its SQ's head kept for the next `record`. A command in a slot: the
    /// slot POSTING with the CQE (`cqe`: dw0, dw2, dw3) and its CQ
    /// position `pos`, after the pending one, if any, is published.
    #[inline(always)]
    pub fn posting(&mut self, mem: &GuestMem, sqid: usize, cid: u16, pos: u16, cqe: (u32, u32, u32)) -> Option<Posted> {
        let key = (sqid as u32) << 16 | cid as u32;
        if let Some(p) = self.pending.take_if(|p| p.key == key) {
            if self.sq_word.0 != sqid && self.sq_word.0 != NQ {
                self.record_now();
            }
            self.sq_word = (sqid, p.head as u64 | (self.seq - 1) << 16);
            return None;
        }
        self.posting_slot(mem, key, pos, cqe)
    }

    #[inline(never)]
    fn posting_slot(&mut self, mem: &GuestMem, key: u32, pos: u16, cqe: (u32, u32, u32)) -> Option<Posted> {
        let cid = key as u16;
        self.flush(mem);
        let i = self.busy.iter().rposition(|b| b.0 == key)?;
        let (_, slot) = self.busy.swap_remove(i);
        let at = self.slot_words(slot)[S_META].load(Ordering::Acquire) & AT;
        let s = self.slot_words(slot);
        let (dw0, dw2, dw3) = cqe;
        self.put_to(
            &s[S_CQE],
            dw0 as u64 | ((dw3 >> 16) as u64) << 32 | (dw2 as u64 & 0xffff) << 48,
            Ordering::Relaxed,
        );
        self.put_to(&s[S_META], POSTING | at | (cid as u64) << 32 | (pos as u64) << 48, Ordering::Release);
        Some(Posted { slot })
    }

    /// Step 2, after the CQE is in guest RAM: CQ `cqid`'s tail and phase
    /// now. Recorded at once for a slot's completion (then the slot is
    /// freed) or when the CQ wraps (a resumed controller reads back at most
    /// a lap of CQEs); else at the end of the pass.
    #[inline(always)]
    pub fn posted(&mut self, p: Option<Posted>, cqid: usize, tail: u16, phase: bool) {
        if self.cq_word.0 != cqid && self.cq_word.0 != NQ {
            self.record_now();
        }
        self.cq_word = (cqid, tail as u64 | (phase as u64) << 16);
        if let Some(p) = p {
            self.release(p.slot);
        } else if tail == 0 {
            self.record();
        }
    }

    /// Slot `slot` freed, after what stands is recorded.
    #[inline(never)]
    fn release(&mut self, slot: u16) {
        self.record();
        self.put_to(&self.slot_words(slot)[S_META], FREE, Ordering::Release);
        self.free.push(slot);
    }

    /// A command whose completion will not be posted (its SQ is gone).
    pub fn forget(&mut self, sqid: usize, cid: u16) {
        let key = (sqid as u32) << 16 | cid as u32;
        if self.pending.take_if(|p| p.key == key).is_some() {
            return;
        }
        if let Some(i) = self.busy.iter().rposition(|b| b.0 == key) {
            let (_, slot) = self.busy.swap_remove(i);
            self.release(slot);
        }
    }

    /// Step 4: a doorbell register write, before it is served.
    #[inline]
    pub fn doorbell(&mut self, qid: usize, cq: bool, value: u32) {
        let at = if cq { CQ_HEAD } else { SQ_TAIL } + qid;
        self.put(at, value as u64, Ordering::Release);
    }

    /// An MSI-X table entry (two words) or Message Control's high byte.
    fn msix(&mut self, v: usize, entry: [u8; 16]) {
        let lo = u64::from_le_bytes(entry[..8].try_into().unwrap());
        let hi = u64::from_le_bytes(entry[8..].try_into().unwrap());
        self.put(MSIX + 2 * v, lo, Ordering::Relaxed);
        self.put(MSIX + 2 * v + 1, hi, Ordering::Release);
    }

    /// Step 3: `cfg` into the copy not selected, the moving indices of the
    /// queues it defines, then the flip; then, for a disabled controller,
    /// every slot free, else the slots of SQs that no longer exist.
    fn commit(&mut self, mem: &GuestMem, cfg: &Config, moving: &[(usize, u64)]) {
        // The slots below are `busy`'s; a slot left POSTING may name a
        // queue this configuration deletes.
        self.flush(mem);
        self.record();
        // A head word names the newest fetch it has seen (`resume.rs`).
        let newest = self.seq - 1;
        for &(i, v) in moving {
            let v = if (SQ_HEAD..SQ_HEAD + NQ).contains(&i) { v | newest << 16 } else { v };
            if self.get(i) != v {
                self.put(i, v, Ordering::Relaxed);
            }
        }
        // The copy not selected, where it differs (it holds the one before last).
        let mut w = [0u64; CFG_WORDS];
        cfg.encode(&mut w);
        let at = config_at(self.select + 1);
        for (k, v) in w.into_iter().enumerate() {
            if self.get(at + k) != v {
                self.put(at + k, v, Ordering::Relaxed);
            }
        }
        self.select += 1;
        self.put(W_SELECT, self.select, Ordering::Release);
        let enabled = cfg.csts & 1 == 1;
        let gone: Vec<u16> = self
            .busy
            .iter()
            .filter(|&&(key, _)| !enabled || cfg.sqs.get((key >> 16) as usize).is_none_or(|s| s.is_none()))
            .map(|b| b.1)
            .collect();
        if !gone.is_empty() {
            self.busy.retain(|b| !gone.contains(&b.1));
            for s in gone {
                self.release(s);
            }
        }
    }
}

/// An I/O command fetched whose entry is not in a slot (yet). It is the
/// command fetched last: its sequence number is the recorder's `seq - 1`.
#[derive(Clone, Copy)]
struct Pending {
    /// sqid << 16 | cid, as in `busy`.
    key: u32,
    /// Its SQ index, and the SQ's head after it.
    idx: u16,
    head: u16,
    /// Where its entry is in guest RAM.
    gpa: u64,
}

/// A slot's completion being posted (`posting`), for `posted`.
pub(super) struct Posted {
    slot: u16,
}

/// An SQE as the eight words `Sqe::from_words` reads (the fields this
/// controller uses; the others are zero).
pub(super) fn sqe_words(c: &Sqe) -> [u64; 8] {
    [
        c.opcode as u64 | (c.cid as u64) << 16 | (c.nsid as u64) << 32,
        c.cdw2 as u64,
        c.mptr,
        c.prp1,
        c.prp2,
        c.cdw10 as u64 | (c.cdw11 as u64) << 32,
        c.cdw12 as u64 | (c.cdw13 as u64) << 32,
        c.cdw14 as u64 | (c.cdw15 as u64) << 32,
    ]
}

impl Core {
    /// The configuration as it stands (with `done`, the admin command being completed).
    fn config(&self, done: Option<Done>) -> Config {
        let r = &self.regs;
        let f = &self.feat;
        Config {
            cc: r.cc,
            csts: r.csts,
            aqa: r.aqa,
            intms: r.intms,
            asq: r.asq,
            acq: r.acq,
            nsqa: self.queues.nsqa,
            ncqa: self.queues.ncqa,
            created: self.queues.created,
            shadow: self.db.shadow,
            arbitration: f.arbitration,
            power: f.power,
            temp_over: f.temp_over,
            temp_under: f.temp_under,
            write_cache: f.write_cache,
            error_recovery: f.error_recovery,
            write_atomicity: f.write_atomicity,
            async_events: f.async_events,
            coalescing: self.intr.coalescing,
            coalescing_off: f.coalescing_off.iter().enumerate().fold(0, |m, (v, &off)| m | (off as u128) << v),
            done,
            ns: self
                .ns
                .iter()
                .map(|n| NsFmt {
                    attached: n.attached,
                    lba_shift: n.lba_shift,
                    nlbas: n.nlbas,
                    ms: n.meta.ms,
                    ext: n.meta.ext,
                    pi: n.meta.pi,
                    pi_first: n.meta.pi_first,
                })
                .collect(),
            sqs: self.queues.sqs.iter().map(|s| s.map(|s| SqDef { gpa: s.gpa, size: s.size, cqid: s.cqid })).collect(),
            cqs: self
                .queues
                .cqs
                .iter()
                .map(|c| c.map(|c| CqDef { gpa: c.gpa, size: c.size, iv: c.iv, ien: c.ien }))
                .collect(),
        }
    }

    /// Commits the configuration (step 3), if state is kept; `done`: the
    /// completion of the admin command fetched last, which it holds.
    pub(super) fn commit_state(&mut self, done: Option<(u32, u16)>) {
        if self.rec.is_none() {
            return;
        }
        let done = done.and_then(|(dw0, st)| {
            let (slot, seq) = self.rec.as_ref()?.current?;
            Some(Done { slot, seq, dw0, st })
        });
        let cfg = self.config(done);
        let mut moving = Vec::new();
        for (q, s) in self.queues.sqs.iter().enumerate() {
            if let Some(s) = s {
                moving.push((SQ_HEAD + q, s.head as u64));
                moving.push((SQ_TAIL + q, s.tail as u64));
            }
        }
        for (q, c) in self.queues.cqs.iter().enumerate() {
            if let Some(c) = c {
                moving.push((CQ_TAIL + q, c.tail as u64 | (c.phase as u64) << 16));
                moving.push((CQ_HEAD + q, c.head as u64));
            }
        }
        if let Some(r) = self.rec.as_deref_mut() {
            r.commit(&self.mem, &cfg, &moving);
        }
    }

    /// The state counters, only while state is kept (none: the controller
    /// keeps no state): the bytes of state memory, the commands recorded
    /// (the sequence numbers given, a resumed controller's predecessors'
    /// included), those that found no slot free, and the entries this
    /// controller copied into slots (admin commands, and I/O commands in
    /// flight when another completion was posted).
    pub(super) fn state_counters(&self) -> Vec<crate::Counter> {
        let Some(r) = self.rec.as_deref() else { return Vec::new() };
        let mut c = vec![
            (STATE_MEMORY_BYTES, r.mem.len() as u64),
            ("state.commands", r.seq - 1),
            ("state.unrecorded", r.unrecorded),
            ("state.entries-copied", r.copied),
        ];
        // Ram namespaces in the state memory: the bytes laid out for their
        // data (within `state.memory-bytes`, which counts address space: a
        // memfd takes memory only where written), and those written.
        let rams: Vec<&Ram> = self
            .ns
            .iter()
            .filter_map(|n| match &n.storage {
                Storage::Ram(r) if r.in_state_memory() => Some(&**r),
                _ => None,
            })
            .collect();
        if !rams.is_empty() {
            c.push((crate::state::RAM_BYTES, rams.iter().map(|r| r.len()).sum()));
            c.push((crate::state::RAM_WRITTEN_BYTES, rams.iter().map(|r| r.written_bytes()).sum()));
        }
        c.into_iter().map(|(n, value)| crate::Counter { name: n.into(), value }).collect()
    }

    /// Records MSI-X vector `v`'s entry as the guest wrote it.
    pub(super) fn record_msix(&mut self, v: usize) {
        if v >= MSIX_VECTORS {
            return;
        }
        let Some(r) = self.rec.as_deref_mut() else { return };
        let mut e = [0u8; 16];
        self.intr.msix.read(self.intr.msix.bar(), MSIX_TABLE + 16 * v as u64, &mut e);
        r.msix(v, e);
    }

    /// Records MSI-X Message Control (enable, function mask) and whose table it is.
    pub(super) fn record_msix_control(&mut self) {
        let Some(r) = self.rec.as_deref_mut() else { return };
        let m = &self.intr.msix;
        let b = (m.enabled() as u64) << 7 | (m.function_masked() as u64) << 6;
        r.put(MSIX_CTL, b | 1 << 8 | (self.intr.client_table as u64) << 9, Ordering::Release);
    }
}

impl super::Nvme {
    /// `DeviceModel::adopt_state`: fresh (zeroed, then the controller as it
    /// stands recorded) or resumed (`resume.rs`).
    pub(super) fn adopt(&self, mem: StateMemory, resume: bool) -> Result<()> {
        supported(&self.cfg)?;
        let mut t = crate::lock(&self.threads);
        let mut c = crate::lock(&self.core);
        let (places, need) = ram_places(&c)?;
        if mem.len() < need {
            return Err(Error::Host(format!("nvme: state memory of {} bytes; it needs {need}", mem.len())));
        }
        if c.ext.timing || c.ext.injector.armed() {
            return Err(Error::Host("nvme: no state memory: injection rules are armed".into()));
        }
        if !resume {
            drop(c);
            self.stop_threads(&mut t);
            let mut c = crate::lock(&self.core);
            for w in mem.words()[..WORDS].iter().filter(|w| w.load(Ordering::Relaxed) != 0) {
                w.store(0, Ordering::Relaxed);
            }
            // The ram namespaces' data moves in (the magic, below, comes after it).
            for (i, p) in places.iter().enumerate() {
                for (k, v) in RamPlace::words(*p).into_iter().enumerate() {
                    mem.words()[RAM_TABLE + 2 * i + k].store(v, Ordering::Relaxed);
                }
            }
            move_ram(&mut c, &mem, &places, false)?;
            mem.words()[W_SHAPE].store(SHAPE, Ordering::Relaxed);
            mem.words()[W_MAGIC].store(MAGIC, Ordering::Release);
            c.rec = Some(Box::new(Recorder::new(mem)));
            for v in 0..MSIX_VECTORS {
                c.record_msix(v);
            }
            c.record_msix_control();
            c.commit_state(None);
            let ready = c.regs.csts & 1 == 1;
            drop(c);
            if ready {
                self.start_threads(&mut t);
            }
            return Ok(());
        }
        if t.running() || c.regs.csts & 1 == 1 || c.rec.is_some() {
            return Err(Error::Host("nvme: resume: this controller already serves (resume a fresh one)".into()));
        }
        let plan = resume::Plan::read(&c, &mem)?;
        check_ram_table(&mem, &places)?;
        // Valid: no write of the dead process may land after the re-executed ones.
        for n in &c.ns {
            n.storage.after_predecessor()?;
        }
        move_ram(&mut c, &mem, &places, true)?;
        c.rec = Some(Box::new(Recorder::new(mem)));
        c.apply(plan);
        let ready = c.regs.csts & 1 == 1;
        drop(c);
        if ready {
            self.start_threads(&mut t);
        }
        Ok(())
    }
}

/// The ram table must place each namespace's data where this controller
/// does (the memory comes from a client: a table of another layout would
/// have the controller read another namespace's data, or the words).
fn check_ram_table(mem: &StateMemory, places: &[Option<RamPlace>]) -> Result<()> {
    for (i, p) in places.iter().enumerate() {
        let had = [0, 1].map(|k| mem.words()[RAM_TABLE + 2 * i + k].load(Ordering::Acquire));
        if had != RamPlace::words(*p) {
            return Err(Error::Host(format!(
                "nvme: resume refused: state memory has namespace {}'s ram data at byte {} ({} bytes); \
                 this controller keeps {} there",
                i + 1,
                had[0],
                had[1],
                p.map_or("none".into(), |p| format!("{} bytes at byte {}", p.len, p.at))
            )));
        }
    }
    Ok(())
}

/// Each ram namespace's storage into the state memory at its place:
/// resumed, the data there in place; fresh, the data it held copied in.
/// All are made before any is swapped in: an error leaves every namespace
/// as it was.
fn move_ram(c: &mut Core, mem: &StateMemory, places: &[Option<RamPlace>], resume: bool) -> Result<()> {
    let mut moved = Vec::new();
    for (i, (n, p)) in c.ns.iter().zip(places).enumerate() {
        let (Storage::Ram(old), Some(p)) = (&n.storage, p) else { continue };
        let ram = Ram::in_state(mem, *p, (!resume).then_some(&**old))
            .map_err(|e| Error::Host(format!("nvme: namespace {}'s ram data: {e}", i + 1)))?;
        moved.push((i, ram));
    }
    for (i, ram) in moved {
        c.ns[i].storage = Storage::Ram(std::sync::Arc::new(ram));
    }
    Ok(())
}
