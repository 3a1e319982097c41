//! Resuming from a state memory an earlier process of this controller left
//! (`adopt_state(mem, true)`): everything is read and validated first
//! (`Plan::read`: the memory comes from a client, which may be hostile; a
//! bad one is refused with the reason, the controller untouched), then
//! applied (`Core::apply`): registers, queues, features, MSI-X; the CQEs
//! posted after each CQ's recorded tail read back (`scan_cq`); the
//! completion being posted when the old process died, if its CQE is not
//! there, posted again at its place; the admin command whose effect was committed completed; every
//! other command fetched and not completed run again, oldest first; the
//! queues served from their recorded tails (or the shadow doorbells); and
//! every vector with a CQ signalled once.

use super::super::controller::Core;
use super::super::ns_admin::LBA_FORMATS;
use super::super::queue::{self, post_cqe, queue_in_ram, Cq, Sq, Sqe, CQE_SIZE, PAGE, SQE_SIZE};
use super::super::{MQES, MSIX_TABLE, MSIX_VECTORS};
use super::layout::*;
use crate::state::StateMemory;
use crate::{Error, Result};
use std::sync::atomic::Ordering;

/// A slot to act on: its index, sequence number, SQ, SQ index, entry.
#[derive(Clone, Copy, Debug)]
struct Slot {
    slot: u16,
    seq: u64,
    sqid: usize,
    idx: u16,
    sqe: Option<Sqe>,
}

/// A slot POSTING: its CQE words and place.
#[derive(Clone, Copy, Debug)]
struct Posting {
    slot: u16,
    cqid: usize,
    pos: u16,
    dw0: u32,
    dw2: u32,
    dw3: u32,
}

/// What a valid state memory says, ready to apply.
pub(in crate::nvme) struct Plan {
    select: u64,
    cfg: Config,
    sq_head: Vec<u16>,
    sq_tail: Vec<u16>,
    cq_tail: Vec<(u16, bool)>,
    cq_head: Vec<u16>,
    msix: Vec<[u8; 16]>,
    msix_ctl: Option<(u8, bool)>,
    posting: Vec<Posting>,
    done: Option<(Slot, Done)>,
    replay: Vec<Slot>,
    /// Slots to free (of a disabled controller).
    drop: Vec<u16>,
    next_seq: u64,
}

fn bad(why: String) -> Error {
    Error::Host(format!("nvme: resume refused: state memory {why}"))
}

impl Plan {
    pub fn read(c: &Core, mem: &StateMemory) -> Result<Plan> {
        let w: Vec<u64> = mem.words()[..WORDS].iter().map(|x| x.load(Ordering::Acquire)).collect();
        if w[W_MAGIC] != MAGIC {
            return Err(bad(format!("holds no NVMe state (magic {:#x})", w[W_MAGIC])));
        }
        if w[W_SHAPE] != SHAPE {
            return Err(bad(format!("has another layout ({:#x}, this build {SHAPE:#x})", w[W_SHAPE])));
        }
        let select = w[W_SELECT];
        let at = config_at(select);
        let cfg = Config::decode(&w[at..at + CFG_WORDS]);
        let enabled = cfg.csts & 1 == 1;
        check_config(c, &cfg, enabled)?;
        let word = |base: usize, q: usize| w[base + q];
        let mut sq_head = vec![0u16; NQ];
        let mut sq_tail = vec![0u16; NQ];
        let mut cq_tail = vec![(0u16, false); NQ];
        let mut cq_head = vec![0u16; NQ];
        let mut head_seq = vec![0u64; NQ];
        for q in 0..NQ {
            if let Some(s) = cfg.sqs[q] {
                let (h, t) = (word(SQ_HEAD, q) & 0xffff, word(SQ_TAIL, q));
                if h >= s.size as u64 || t >= s.size as u64 {
                    return Err(bad(format!("has SQ {q} head {h} tail {t} in a queue of {}", s.size)));
                }
                (sq_head[q], sq_tail[q], head_seq[q]) = (h as u16, t as u16, word(SQ_HEAD, q) >> 16);
            }
            if let Some(cq) = cfg.cqs[q] {
                let (t, h) = (word(CQ_TAIL, q), word(CQ_HEAD, q));
                if t & 0xffff >= cq.size as u64 || t >> 17 != 0 || h >= cq.size as u64 {
                    return Err(bad(format!("has CQ {q} tail {t:#x} head {h} in a queue of {}", cq.size)));
                }
                cq_tail[q] = (t as u16, t >> 16 & 1 == 1);
                cq_head[q] = h as u16;
            }
        }
        let msix = (0..MSIX_VECTORS)
            .map(|v| {
                let mut e = [0u8; 16];
                e[..8].copy_from_slice(&w[MSIX + 2 * v].to_le_bytes());
                e[8..].copy_from_slice(&w[MSIX + 2 * v + 1].to_le_bytes());
                e
            })
            .collect();
        let ctl = w[MSIX_CTL];
        let msix_ctl = (ctl >> 8 & 1 == 1).then_some((ctl as u8, ctl >> 9 & 1 == 1));
        let (mut posting, mut fetched, mut drop) = (Vec::new(), Vec::new(), Vec::new());
        let mut next_seq = 1;
        for s in 0..SLOTS {
            let b = SLOT0 + s * SLOT_WORDS;
            let meta = w[b + S_META];
            // Sequence numbers go on from the newest ever recorded.
            next_seq = next_seq.max(w[b + S_SEQ].saturating_add(1));
            if meta & 3 == FREE {
                continue;
            }
            let (sqid, idx, seq) = ((meta >> 8 & 0xff) as usize, (meta >> 16) as u16, w[b + S_SEQ]);
            if seq >= 1 << 48 {
                return Err(bad(format!("has slot {s} with sequence number {seq:#x}")));
            }
            if !enabled {
                drop.push(s as u16);
                continue;
            }
            let Some(sq) = cfg.sqs.get(sqid).copied().flatten() else {
                return Err(bad(format!("has slot {s} of SQ {sqid}, which does not exist")));
            };
            if meta & 3 == POSTING {
                // CQE and position; its CQ is its SQ's.
                let (cid, pos, at) = ((meta >> 32) as u16, (meta >> 48) as u16, w[b + S_CQE]);
                let sqhd = (at >> 48) as u16;
                let cqid = sq.cqid as usize;
                let fits = cfg.cqs.get(cqid).copied().flatten().is_some_and(|cq| pos < cq.size);
                if idx >= sq.size || meta & 0xfc != 0 || sqhd >= sq.size || !fits {
                    return Err(bad(format!("has slot {s} posting {meta:#x} (CQE {at:#x}) at CQ {cqid}")));
                }
                posting.push(Posting {
                    slot: s as u16,
                    cqid,
                    pos,
                    dw0: at as u32,
                    dw2: sqhd as u32 | (sqid as u32) << 16,
                    dw3: cid as u32 | ((at >> 32) as u32 & 0xffff) << 16,
                });
                continue;
            }
            if meta & 3 == 3 || idx >= sq.size || meta >> 32 != 0 || meta & 0xf8 != 0 {
                return Err(bad(format!("has slot {s} with state {meta:#x}")));
            }
            let words: [u64; 8] = w[b + S_SQE..b + S_SQE + 8].try_into().unwrap();
            let sqe = (meta & BAD_SQE == 0).then(|| Sqe::from_words(&words));
            fetched.push(Slot { slot: s as u16, seq, sqid, idx, sqe });
        }
        // The CQEs posted after each CQ's recorded tail, read back from the
        // CQ: the tail moves past them, and each SQ's head to the newest
        // one's (`scan_cq`).
        for (q, tail) in cq_tail.iter_mut().enumerate() {
            if let Some(cq) = cfg.cqs[q] {
                *tail = scan_cq(c, &cfg, q, cq, *tail, &mut sq_head);
            }
        }
        next_seq = next_seq.max(head_seq.iter().max().map_or(1, |h| h + 1));
        // A fetch whose head store did not happen: the newest slot of its SQ,
        // newer than the fetch that recorded the head, still at the head.
        for q in 0..NQ {
            let newest = fetched.iter().filter(|f| f.sqid == q).max_by_key(|f| f.seq);
            if let Some(f) = newest {
                if f.seq > head_seq[q] && f.idx == sq_head[q] {
                    let size = cfg.sqs[q].map_or(1, |s| s.size);
                    sq_head[q] = queue::next(sq_head[q], size);
                }
            }
        }
        let done = cfg.done.and_then(|d| {
            let i = fetched.iter().position(|f| f.slot == d.slot && f.seq == d.seq)?;
            Some((fetched.remove(i), d))
        });
        if let Some((s, _)) = &done {
            if s.sqid != 0 {
                return Err(bad(format!("commits slot {} of SQ {}, not an admin command", s.slot, s.sqid)));
            }
        }
        fetched.sort_by_key(|f| f.seq);
        let cfg_done = done.is_some();
        let mut cfg = cfg;
        if !cfg_done {
            cfg.done = None;
        }
        Ok(Plan {
            select,
            cfg,
            sq_head,
            sq_tail,
            cq_tail,
            cq_head,
            msix,
            msix_ctl,
            posting,
            done,
            replay: fetched,
            drop,
            next_seq,
        })
    }
}

/// CQ `q` (`cq`) from its recorded tail and phase `at`: the entries the
/// dead process posted after the tail it recorded last (`Recorder::record`)
/// carry this lap's phase. The tail after them is returned, and each of
/// their SQs' heads in `sq_head` is the one the newest of them reports:
/// every command fetched before that CQE was posted is completed by now or
/// published in a slot (`flush`), so the head word stored before the tail
/// word is no newer. At most a lap less one is read (the recorder records
/// the tail when it wraps). This relies on the driver zeroing a CQ before
/// it creates it (Linux's, SPDK's and iopath's guest do; a stale entry of
/// this lap's phase would read as posted) and leaving consumed entries as
/// the device wrote them (the phase tag protocol). An entry naming an SQ
/// that does not complete to this CQ, or a head outside it, is not one this
/// controller posted: the scan stops there, with a log line.
fn scan_cq(c: &Core, cfg: &Config, q: usize, cq: CqDef, at: (u16, bool), sq_head: &mut [u16]) -> (u16, bool) {
    let (mut tail, mut phase) = at;
    for _ in 0..cq.size - 1 {
        let mut e = [0u8; 16];
        if c.mem.read_slice(&mut e, cq.gpa + tail as u64 * CQE_SIZE).is_err() {
            break;
        }
        let dw2 = u32::from_le_bytes(e[8..12].try_into().unwrap());
        let dw3 = u32::from_le_bytes(e[12..16].try_into().unwrap());
        if (dw3 >> 16 & 1 == 1) == phase {
            break; // not posted this lap
        }
        let (sqid, sqhd) = ((dw2 >> 16) as usize, dw2 as u16);
        let ours = cfg.sqs.get(sqid).copied().flatten().is_some_and(|s| s.cqid as usize == q && sqhd < s.size);
        if !ours {
            log::warn!("nvme: resume: CQ {q} entry {tail} names SQ {sqid} head {sqhd}; not posted by this controller");
            break;
        }
        sq_head[sqid] = sqhd;
        (tail, phase) = queue::cq_after(tail, phase, cq.size);
    }
    (tail, phase)
}

/// The configuration must describe a controller this one can be: its
/// namespaces, queues in guest RAM, ids and vectors in range.
fn check_config(c: &Core, cfg: &Config, enabled: bool) -> Result<()> {
    if cfg.ns.len() != c.ns.len() {
        return Err(bad(format!("has {} namespaces, this controller {}", cfg.ns.len(), c.ns.len())));
    }
    for (i, (n, ns)) in cfg.ns.iter().zip(&c.ns).enumerate() {
        let bytes = ns.nlbas << ns.lba_shift;
        let fits = LBA_FORMATS.contains(&(n.lba_shift, n.ms))
            && n.nlbas.checked_shl(n.lba_shift) == Some(bytes)
            && n.nlbas << n.lba_shift >> n.lba_shift == n.nlbas
            && n.pi <= 1
            && (n.pi == 0 || n.ms >= 8)
            && (n.ms as u64).checked_mul(n.nlbas).is_some_and(|m| m <= ns.meta.area);
        if !fits {
            return Err(bad(format!("has namespace {} formatted {n:?}, which its {bytes} bytes cannot be", i + 1)));
        }
    }
    if cfg.nsqa > super::super::MAX_IO_QUEUES || cfg.ncqa > super::super::MAX_IO_QUEUES {
        return Err(bad(format!("allocates {} SQs and {} CQs", cfg.nsqa, cfg.ncqa)));
    }
    if cfg.sqs.len() != NQ || cfg.cqs.len() != NQ {
        return Err(bad("has a queue table of another size".into()));
    }
    let any = cfg.sqs.iter().chain([&None]).any(|s| s.is_some()) || cfg.cqs.iter().any(|q| q.is_some());
    if !enabled {
        if any || cfg.shadow.is_some() {
            return Err(bad("has queues or shadow doorbells on a disabled controller".into()));
        }
        return Ok(());
    }
    if cfg.sqs[0].is_none() || cfg.cqs[0].is_none() {
        return Err(bad("has an enabled controller without admin queues".into()));
    }
    for (q, cq) in cfg.cqs.iter().enumerate() {
        let Some(cq) = cq else { continue };
        if cq.size < 2 || cq.size > MQES || !queue_in_ram(&c.mem, cq.gpa, cq.size as u64 * CQE_SIZE) {
            return Err(bad(format!("has CQ {q} of {} entries at {:#x}, not in guest RAM", cq.size, cq.gpa)));
        }
        if cq.iv as usize >= MSIX_VECTORS || (q == 0 && (cq.iv != 0 || !cq.ien)) {
            return Err(bad(format!("has CQ {q} on vector {}", cq.iv)));
        }
    }
    for (q, sq) in cfg.sqs.iter().enumerate() {
        let Some(sq) = sq else { continue };
        if sq.size < 2 || sq.size > MQES || !queue_in_ram(&c.mem, sq.gpa, sq.size as u64 * SQE_SIZE) {
            return Err(bad(format!("has SQ {q} of {} entries at {:#x}, not in guest RAM", sq.size, sq.gpa)));
        }
        let cq_ok = (q == 0) == (sq.cqid == 0) && cfg.cqs.get(sq.cqid as usize).is_some_and(|c| c.is_some());
        if !cq_ok {
            return Err(bad(format!("has SQ {q} on CQ {}", sq.cqid)));
        }
    }
    if let Some((db, ei)) = cfg.shadow {
        let ok = c.mode().shadowed()
            && [db, ei].iter().all(|&a| queue_in_ram(&c.mem, a, PAGE) && c.mem.range_mapped(a, PAGE));
        if !ok {
            return Err(bad(format!("has shadow doorbells at {db:#x} and {ei:#x}, not in mapped guest RAM")));
        }
    }
    Ok(())
}

impl Core {
    /// Applies a plan `Plan::read` validated; `rec` is installed already.
    pub(in crate::nvme) fn apply(&mut self, p: Plan) {
        let cfg = &p.cfg;
        // The first completion posted from here on logs its time (`Core::complete`).
        self.first_since_resume = true;
        let rec = self.rec.as_deref_mut().expect("apply after the recorder is in place");
        rec.select = p.select;
        rec.seq = p.next_seq;
        let taken: Vec<u16> = (p.posting.iter().map(|x| x.slot))
            .chain(p.replay.iter().map(|x| x.slot))
            .chain(p.done.iter().map(|d| d.0.slot))
            .chain(p.drop.iter().copied())
            .collect();
        rec.free.retain(|s| !taken.contains(s));
        for &s in &p.drop {
            rec.release(s);
        }
        // Registers, features, namespaces.
        (self.regs.cc, self.regs.csts, self.regs.aqa, self.regs.intms) = (cfg.cc, cfg.csts, cfg.aqa, cfg.intms);
        (self.regs.asq, self.regs.acq) = (cfg.asq, cfg.acq);
        (self.queues.nsqa, self.queues.ncqa, self.queues.created) = (cfg.nsqa, cfg.ncqa, cfg.created);
        let f = &mut self.feat;
        (f.arbitration, f.power, f.temp_over, f.temp_under) =
            (cfg.arbitration, cfg.power, cfg.temp_over, cfg.temp_under);
        (f.write_cache, f.error_recovery, f.write_atomicity) =
            (cfg.write_cache, cfg.error_recovery, cfg.write_atomicity);
        f.async_events = cfg.async_events;
        for (v, off) in f.coalescing_off.iter_mut().enumerate() {
            *off = cfg.coalescing_off >> v & 1 == 1;
        }
        self.intr.coalescing = cfg.coalescing;
        for (ns, n) in self.ns.iter_mut().zip(&cfg.ns) {
            (ns.attached, ns.lba_shift, ns.nlbas) = (n.attached, n.lba_shift, n.nlbas);
            (ns.meta.ms, ns.meta.ext, ns.meta.pi, ns.meta.pi_first) = (n.ms, n.ext, n.pi, n.pi_first);
        }
        // Queues; shadowed I/O SQs take their tails from the shadow below,
        // and those whose doorbells are BAR0's page from the page; CQ heads
        // from either (`memory_cq_head`) before anything is posted.
        self.db.shadow = cfg.shadow;
        for q in 0..NQ {
            let in_memory = (q > 0 && cfg.shadow.is_some()) || self.page_doorbells(q);
            let sq = cfg.sqs[q].map(|s| {
                let tail = if in_memory { p.sq_head[q] } else { p.sq_tail[q] };
                Sq { gpa: s.gpa, size: s.size, head: p.sq_head[q], tail, cqid: s.cqid, ..Default::default() }
            });
            self.queues.set_sq(q, sq);
            let head = cfg.cqs[q].and_then(|c| self.memory_cq_head(q, c.size)).unwrap_or(p.cq_head[q]);
            self.queues.cqs[q] = cfg.cqs[q].map(|c| Cq {
                gpa: c.gpa,
                size: c.size,
                head,
                tail: p.cq_tail[q].0,
                phase: p.cq_tail[q].1,
                ien: c.ien,
                iv: c.iv,
                ..Default::default()
            });
        }
        self.queues.resolve(&self.mem);
        for q in 1..NQ {
            self.register_doorbells(q);
        }
        // MSI-X as the guest programmed it.
        let bar = self.intr.msix.bar();
        for (v, e) in p.msix.iter().enumerate() {
            for k in 0..4 {
                let at = MSIX_TABLE + 16 * v as u64 + 4 * k as u64;
                self.intr.msix.write(bar, at, &e[4 * k..4 * k + 4]);
            }
        }
        if let Some((b, client)) = p.msix_ctl {
            let cap = self.intr.msix.cap_offset();
            self.intr.msix.config_write(cap + 3, &[b]);
            self.intr.client_table = client;
        }
        for v in 0..MSIX_VECTORS {
            self.msix_update(v);
        }
        self.sync_vectors();
        // The recorded heads, as of the newest fetch.
        let seq = p.next_seq - 1;
        if let Some(r) = self.rec.as_deref_mut() {
            for q in (0..NQ).filter(|&q| cfg.sqs[q].is_some()) {
                r.put(SQ_HEAD + q, p.sq_head[q] as u64 | seq << 16, Ordering::Release);
            }
            // Then the tails past what was read back from the CQs.
            for q in (0..NQ).filter(|&q| cfg.cqs[q].is_some()) {
                let (t, ph) = p.cq_tail[q];
                r.put(CQ_TAIL + q, t as u64 | (ph as u64) << 16, Ordering::Release);
            }
        }
        // The completion being posted: again, at its place.
        for x in &p.posting {
            let Some(cq) = self.queues.cqs[x.cqid].as_mut() else { continue };
            if cq.tail == x.pos {
                cq.phase = x.dw3 >> 16 & 1 == 0;
                let (sqhd, sqid, cid, st) = (x.dw2 as u16, (x.dw2 >> 16) as u16, x.dw3 as u16, (x.dw3 >> 17) as u16);
                let after = post_cqe(&self.mem, cq, x.dw0, sqhd, sqid, cid, st);
                let (t, ph) = after.unwrap_or((cq.tail, cq.phase));
                if let Some(r) = self.rec.as_deref_mut() {
                    r.posted(Some(super::Posted { slot: x.slot }), x.cqid, t, ph);
                }
            } else if let Some(r) = self.rec.as_deref_mut() {
                r.release(x.slot);
            }
        }
        // The admin command whose effect is committed: completed.
        if let Some((s, d)) = p.done {
            self.adopt_slot(&s);
            self.complete(0, s.sqe.map_or(0, |c| c.cid), d.dw0, d.st);
        }
        // The others, oldest first.
        if cfg.csts & 1 == 1 {
            for s in &p.replay {
                self.adopt_slot(s);
                self.batched(|c| {
                    c.run(s.sqid, s.sqe);
                    c.io_submit();
                });
            }
            // What the driver submitted since: recorded tails, or the shadow.
            for q in self.queues.sq_ids() {
                if (q == 0 || cfg.shadow.is_none()) && self.queues.sqs[q].is_some_and(|s| s.head != s.tail) {
                    self.process_sq(q);
                }
            }
            if cfg.shadow.is_some() {
                if self.mode().kicked() {
                    self.serve_kicked();
                } else {
                    self.poll_shadow();
                }
            }
            // BAR0's page, if the doorbells are there.
            self.poll_bar();
            // Interrupts the old process may have owed.
            for q in 0..NQ {
                if let Some(cq) = self.queues.cqs[q].filter(|c| c.ien) {
                    self.interrupt(cq.iv);
                }
            }
        }
        self.commit_state(None);
    }

    /// Slot `s` is in flight again, as the command its SQE names.
    fn adopt_slot(&mut self, s: &Slot) {
        if let Some(r) = self.rec.as_deref_mut() {
            let cid = s.sqe.map_or(0, |c| c.cid);
            r.busy.push(((s.sqid as u32) << 16 | cid as u32, s.slot));
            r.current = Some((s.slot, s.seq));
        }
    }
}
