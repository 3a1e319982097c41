//! NVMe's state in state memory ([`crate::state::StateMemory`]), so that a
//! new device process resumes a controller a killed one was serving,
//! invisibly to the guest (`DeviceModel::adopt_state`, `resume.rs`).
//!
//! Design: a resumed controller runs every command fetched and not
//! completed again, and never reads an SQ entry the driver may have
//! reused. A driver reuses an entry once a completion says it was
//! consumed: one that reports an SQ head past it (SPDK's driver goes by
//! that), or any completion of a command submitted after it (Linux's
//! reuses entries on that alone). Until then the entry in the SQ is as
//! good as a copy. So an I/O command is published (its 64-byte entry
//! copied into a slot, with its SQ id, SQ index and a sequence number, and
//! the SQ's head word moved past it) only if it is still in flight when
//! another completion is about to be posted, another command is fetched
//! or the configuration is committed (`flush`). A command that completes
//! before that (a null or ram namespace, always) is published by its
//! completion alone (`HEAD_AFTER`): until then the recorded head still
//! names its index, and a resumed controller fetches it again from the
//! SQ. Admin commands are published at once. The alternative, reporting
//! no SQ head beyond the oldest command in flight, would cost nothing to
//! record but hold the driver's SQ slots for as long as the slowest file
//! operation (a queue as deep as the guest's is what `file:` namespaces
//! are for), and an AER outstanding for hours would pin the admin SQ's
//! head.
//!
//! Publication order (the process may die between any two stores; `S_*`
//! and the word areas are `layout.rs`'s):
//! 1. fetch, published: the sequence number and the SQE into a free slot,
//!    then its state word FETCHED (release), then the SQ's head word,
//!    which carries the sequence number of the fetch that moved it.
//!    Resumed with a FETCHED slot newer than its SQ's head word (its head
//!    store did not happen), the head is moved past the slot's index. (The
//!    index alone would not tell: a slow command's entry index comes round
//!    again a lap later.) Sequence numbers are 48 bits there: 2^48
//!    commands, 9 years at a million a second, before they would wrap.
//! 2. completion: the CQE (dw0, phase and status, the SQ head it reports)
//!    into the slot, then its state POSTING with the cid and the CQ
//!    position (release; `HEAD_AFTER` if its fetch was not published),
//!    then the CQE into guest RAM, then the CQ's tail word (and with
//!    `HEAD_AFTER` the SQ's head word), then FREE, which is left out until
//!    the next store that publishes another slot (the next command takes
//!    the same slot and overwrites it). Resumed with a POSTING slot whose
//!    position is the CQ's recorded tail, the same CQE is written at the
//!    same place again and the tail advanced (the bytes are identical, so
//!    a guest that saw the first copy sees no change); with the tail
//!    already past it, only the slot is freed; with `HEAD_AFTER` and the
//!    SQ's head word still at its index, the head is moved past it. Only
//!    one slot is POSTING and not free at a time (completions are posted
//!    under the core's lock, one queue group).
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
//! Cost on the fast path, a command that completes before the next is
//! fetched: no store at the fetch, 4 at the completion (the CQE and state
//! words, in one cache line of the slot, the CQ's tail and the SQ's head
//! words), into memory already mapped; no copy of its entry, no syscall, no
//! lock. A command left in flight: its entry read again from the SQ and 11
//! more stores (its slot's sequence number, entry and state, the head
//! word), and a FREE. Nothing without `adopt_state`: `Core::rec` is None
//! (a client that offers no state memory, `iopath run --state-memory
//! off`). In one thread with every line in cache (the ignored test
//! `fast_path_cost_of_keeping_state`, release, 512 B writes at QD16 on null
//! through mmio doorbells) the device time per command goes from 57 ns to
//! 67 ns with state (71 ns with the 16 stores and the entry's copy of every
//! command before; 61 ns with the recorder's calls made and returning at
//! once: what costs is the work around the stores more than the stores).
//! In the guest over vfio-user (`bench nvme --state-memory on,off`, 9
//! rounds) 512 B QD16's IOPS on/off are 0.88x (shm) and 0.83x (adaptive) at
//! the median, the device thread's CPU per I/O 93 against 81 ns and 95
//! against 79 ns: the 5% is not met. 4 KiB QD1's p50 0.99x and 1.07x.
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
    /// The slot of the command fetched last (an admin command commits it).
    current: Option<(u16, u64)>,
    /// The I/O command fetched last, not published yet: by its completion
    /// (`posting`), or, if it is still in flight when another completion is
    /// posted, another command fetched or the configuration committed,
    /// with its entry copied into its slot (`flush`; the module doc).
    pending: Option<Pending>,
    /// A free slot still POSTING in the state memory (`posted`).
    stale: Option<u16>,
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
            stale: None,
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
        #[cfg(test)]
        if let Some(k) = &self.kill {
            k.store();
        }
        w.store(v, o);
    }

    /// Slot `slot`'s words: one bounds check for all its stores (the fast
    /// path's), where each store through `put` would take its own.
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
    /// is published only when it turns out to stay in flight (`flush`, which
    /// reads its entry again from the SQ) or completes (`posting`); an admin
    /// command, or an unreadable entry, at once.
    #[inline]
    pub fn fetched(&mut self, mem: &GuestMem, qid: usize, idx: u16, gpa: u64, head: u16, sqe: Option<&Sqe>) {
        self.flush(mem);
        let Some(slot) = self.free.pop() else {
            self.unrecorded += 1;
            self.current = None;
            if self.unrecorded == 1 {
                log::error!("nvme: no state slot free; a command goes unrecorded");
            }
            return;
        };
        let seq = self.seq;
        self.seq += 1;
        let meta = FETCHED | (qid as u64) << 8 | (idx as u64) << 16;
        let key = (qid as u32) << 16 | sqe.map_or(0, |c| c.cid) as u32;
        match sqe {
            Some(_) if qid > 0 => self.pending = Some(Pending { slot, key, meta, gpa, seq, head }),
            _ => {
                let (w, bad) = sqe.map_or(([0; 8], BAD_SQE), |c| (sqe_words(c), 0));
                self.publish(slot, seq, &w, meta | bad, head);
                self.busy.push((key, slot));
            }
        }
        self.current = Some((slot, seq));
    }

    /// A fetch, published: `slot`'s sequence number and entry, then its
    /// state `meta` (FETCHED), then its SQ's head word.
    #[inline]
    fn publish(&mut self, slot: u16, seq: u64, w: &[u64; 8], meta: u64, head: u16) {
        self.unstale(slot);
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
    /// its slot) before the driver may reuse the SQ's: before a completion
    /// is posted (it reports a head past it, or completes a command after
    /// it), another command fetched or the configuration committed.
    /// Its entry is read again from the SQ in `mem` (no completion since
    /// its fetch: the driver has not reused it), so the fast path copies
    /// nothing; unreadable now (the memory gone), it is recorded as such.
    #[inline]
    fn flush(&mut self, mem: &GuestMem) {
        if let Some(p) = self.pending.take() {
            let mut e = [0u8; 64];
            let (w, bad) = match mem.read_slice(&mut e, p.gpa) {
                Ok(()) => (sqe_words(&Sqe::parse(&e)), 0),
                Err(_) => ([0; 8], BAD_SQE),
            };
            self.publish(p.slot, p.seq, &w, p.meta | bad, p.head);
            self.busy.push((p.key, p.slot));
        }
    }

    /// The slot whose FREE store was left out (`posted`), before a store
    /// publishes another: freed now, unless it is `slot`, which is
    /// overwritten.
    #[inline]
    fn unstale(&mut self, slot: u16) {
        if let Some(s) = self.stale.take() {
            if s != slot {
                self.put_to(&self.slot_words(s)[S_META], FREE, Ordering::Release);
            }
        }
    }

    /// Step 2, before the CQE goes to guest RAM: the slot of (sqid, cid),
    /// POSTING with the CQE (`cqe`: dw0, dw2, dw3) and its CQ position.
    #[inline]
    pub fn posting(&mut self, mem: &GuestMem, sqid: usize, cid: u16, pos: u16, cqe: (u32, u32, u32)) -> Option<Posted> {
        let key = (sqid as u32) << 16 | cid as u32;
        // The command fetched last, completed before anything else was
        // published: its fetch is published by this (`HEAD_AFTER`: the
        // SQ's head word moves past it after the CQE). Any other completion
        // reports a head past the pending one's: that is published first.
        let (slot, at, head) = match self.pending.take_if(|p| p.key == key) {
            Some(p) => (p.slot, p.meta & AT | HEAD_AFTER, Some(p.head as u64 | p.seq << 16)),
            None => {
                self.flush(mem);
                let i = self.busy.iter().rposition(|b| b.0 == key)?;
                let (_, slot) = self.busy.swap_remove(i);
                (slot, self.slot_words(slot)[S_META].load(Ordering::Acquire) & AT, None)
            }
        };
        self.unstale(slot);
        let s = self.slot_words(slot);
        let (dw0, dw2, dw3) = cqe;
        self.put_to(
            &s[S_CQE],
            dw0 as u64 | ((dw3 >> 16) as u64) << 32 | (dw2 as u64 & 0xffff) << 48,
            Ordering::Relaxed,
        );
        self.put_to(&s[S_META], POSTING | at | (cid as u64) << 32 | (pos as u64) << 48, Ordering::Release);
        Some(Posted { slot, sqid, head })
    }

    /// Step 2, after the CQE is in guest RAM: the CQ's tail, the SQ's head
    /// if the posting moves it; the slot is free, its FREE store left for
    /// the next store that publishes something (`unstale`; the next fetch
    /// takes this slot again and overwrites it).
    #[inline]
    pub fn posted(&mut self, p: Option<Posted>, cqid: usize, tail: u16, phase: bool) {
        self.put(CQ_TAIL + cqid, tail as u64 | (phase as u64) << 16, Ordering::Release);
        if let Some(p) = p {
            if let Some(h) = p.head {
                self.put(SQ_HEAD + p.sqid, h, Ordering::Release);
            }
            self.unstale(p.slot);
            self.stale = Some(p.slot);
            self.free.push(p.slot);
        }
    }

    fn release(&mut self, slot: u16) {
        self.unstale(slot);
        self.put_to(&self.slot_words(slot)[S_META], FREE, Ordering::Release);
        self.free.push(slot);
    }

    /// A command whose completion will not be posted (its SQ is gone).
    pub fn forget(&mut self, sqid: usize, cid: u16) {
        let key = (sqid as u32) << 16 | cid as u32;
        if let Some(p) = self.pending.take_if(|p| p.key == key) {
            self.release(p.slot);
        } else if let Some(i) = self.busy.iter().rposition(|b| b.0 == key) {
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
        if let Some(s) = self.stale.take() {
            self.put_to(&self.slot_words(s)[S_META], FREE, Ordering::Release);
        }
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

/// An I/O command fetched whose entry is not in its slot yet.
#[derive(Clone, Copy)]
struct Pending {
    slot: u16,
    /// sqid << 16 | cid, as in `busy`.
    key: u32,
    /// Its slot's state word once published (FETCHED).
    meta: u64,
    /// Where its entry is in guest RAM.
    gpa: u64,
    seq: u64,
    /// The SQ's head after it.
    head: u16,
}

/// A completion being posted (`posting`), for `posted`.
pub(super) struct Posted {
    slot: u16,
    sqid: usize,
    /// The SQ's head word to store after the CQE (`HEAD_AFTER`).
    head: Option<u64>,
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
