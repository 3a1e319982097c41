//! The reference driver: brings the controller up, then runs a schedule
//! of submissions, doorbells, reaps, queue deletions and resets, and checks
//! each completion as it comes (see the module documentation).

use super::model::{canary, Failure, Image, Lbas, Violation};
use super::pi::Prinfo;
use super::rng::Rng;
use super::{OpRecord, Port};
use crate::block::inject::{Action, CommandView, Kind, Lbas as LbaSpan};
use crate::Counter;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};

mod data;
mod shape;

use data::segments;
pub use shape::{injection_rules, Shape};

/// Guest RAM the driver lays out (`LocalPort` makes this much).
pub const RAM: u64 = 8 << 20;
const ASQ: u64 = 0x10000;
const ACQ: u64 = 0x11000;
const DBBUF: u64 = 0x12000;
const EVIDX: u64 = 0x13000;
const ADMIN_DATA: u64 = 0x14000;
/// SQ `k`'s ring (k >= 1), up to 4096 entries of 64 bytes.
const SQ_BASE: u64 = 0x10_0000;
const SQ_STRIDE: u64 = 0x4_0000;
/// CQ `k`'s ring, up to 4096 entries of 16 bytes.
const CQ_BASE: u64 = 0x30_0000;
const CQ_STRIDE: u64 = 0x1_0000;
/// Data pages: the rest.
const DATA: u64 = 0x40_0000;
const PAGE: u64 = 4096;
const DOORBELLS: u64 = 0x1000;
/// I/O queues a schedule uses at most.
pub const MAX_QUEUES: u16 = 8;
/// How long a command or an admin command may take before it counts as lost.
const PATIENCE: Duration = Duration::from_secs(10);
/// Largest transfer the driver makes.
const MAX_BYTES: u64 = 16 << 10;

/// What a schedule did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub submitted: u64,
    pub completed: u64,
    /// Dropped by a reset or a queue deletion without a completion.
    pub dropped: u64,
    pub resets: u64,
    pub deletes: u64,
    pub crashes: u64,
    pub sweeps: u64,
    pub idles: u64,
    /// Completions posted by a timer wheel (delays, a timing model).
    pub timed: u64,
    /// Completions with an injected status, aborted withheld commands.
    pub injected: u64,
    /// Reads checked with their injected corruption flipped back.
    pub corrupted: u64,
    /// Commands with PRINFO on a namespace with protection information,
    /// and those of them that failed a PI check (as predicted).
    pub prinfo: u64,
    pub pi_errors: u64,
    /// Commands submitted whose PI check must fail (completed or not).
    pub pi_doomed: u64,
    /// The controller offered shadow doorbells and the driver used them.
    pub shadowed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Read,
    Write,
    Flush,
    Zeroes,
    Deallocate,
    /// An invalid opcode or an LBA range past the end: (opcode, status).
    Bad(u8, u16),
    /// A read or write (the opcode) to an NSID that names no namespace:
    /// Invalid Namespace or Format, its buffer (canary) untouched.
    BadNs(u8),
}

/// A namespace's metadata format, as Identify Namespace gives it. The
/// driver stores a block's metadata words inverted (word `w` of a block
/// past its data is `!content.word(lba, w)`), so that metadata the
/// controller reports as never written or deallocated (all FFh) matches the
/// model's zero content, and a write's metadata is its pattern.
#[derive(Clone, Copy, Debug)]
struct Meta {
    /// Metadata bytes per block (0: none).
    ms: u64,
    /// Extended LBAs: inline after each block's data.
    ext: bool,
    /// Data bytes per block.
    data: u64,
    /// Protection information type 1 (DPS), in the metadata's first 8
    /// bytes (else its last 8).
    pi: bool,
    pi_first: bool,
}

impl Meta {
    /// Word `w` of a block (data, then metadata) as stored, or as the model
    /// sees a stored one (the inversion is its own inverse).
    fn stored(self, w: u64, v: u64) -> u64 {
        if w >= self.data / 8 {
            !v
        } else {
            v
        }
    }

    /// The index of the PI tuple's word in a block (data, then metadata).
    fn pi_word(self) -> u16 {
        (self.data / 8 + if self.pi_first { 0 } else { self.ms / 8 - 1 }) as u16
    }
}

/// A command the driver submitted and has not seen complete.
struct Cmd {
    sqid: u16,
    cid: u16,
    /// Its namespace's index (NSID - 1; for `BadNs`, 0: it has none).
    ns: usize,
    /// Its place in its SQ, counted from the queue's creation (the slot is
    /// this modulo the size): a slot is reused while an older command in it
    /// may still be out.
    at: u64,
    op: Op,
    slba: u64,
    nlb: u64,
    /// Where the data goes: the first page's offset and the pages.
    offset: u64,
    pages: Vec<u64>,
    /// A PRP list (or a DSM range) page.
    extra: Option<u64>,
    /// The separate metadata buffer (MPTR) of a read or write on a
    /// namespace with metadata that is not extended.
    meta: Option<u64>,
    seq: u64,
    published: bool,
    /// What the injection rules do to it (`Shape::rules`).
    action: Option<Action>,
    /// PRINFO, EILBRT, ELBAT and ELBATM on a namespace with PI (`pi.rs`).
    prinfo: Option<Prinfo>,
    /// A write without PRACT on such a namespace: the tuple each block
    /// carries (empty: its metadata is the pattern's).
    tuples: Vec<u64>,
    /// The PI check error the controller must answer (0: none). The
    /// command then transfers and writes nothing.
    pi_status: u16,
}

impl Cmd {
    fn bytes(&self, lba: u64) -> u64 {
        self.nlb * lba
    }
    fn writes(&self) -> bool {
        matches!(self.op, Op::Write | Op::Zeroes | Op::Deallocate)
    }
    fn touches_lbas(&self) -> bool {
        matches!(self.op, Op::Read | Op::Write | Op::Zeroes | Op::Deallocate)
    }
    /// PI is generated (write, write zeroes) or stripped (read).
    fn pract(&self) -> bool {
        self.prinfo.is_some_and(|p| p.pract)
    }
}

/// An SQ as the driver keeps it; positions count entries from its creation.
struct SqState {
    size: u16,
    cqid: u16,
    tail: u64,
    published: u64,
    /// The SQ head of the newest completion.
    head: u64,
    since_ring: u16,
    /// Commands written and not published yet, in order.
    unpublished: Vec<u32>,
}

impl SqState {
    fn slot(&self, at: u64) -> u16 {
        (at % self.size as u64) as u16
    }
}

struct CqState {
    size: u16,
    head: u16,
    phase: bool,
    rung: u16,
    since_ring: u16,
}

/// The reference driver over a [`Port`].
pub struct Driver<'a, P: Port + ?Sized> {
    port: &'a P,
    rng: Rng,
    shape: Shape,
    img: Image,
    /// Per namespace (index NSID - 1): the model of its blocks, the bytes
    /// a block takes in a transfer (its LBA size, + MS with extended LBAs),
    /// and its metadata format.
    lbas: Vec<Lbas>,
    lba: Vec<u64>,
    meta: Vec<Meta>,
    mqes: u16,
    dbbc: bool,
    shadow: bool,
    atail: u16,
    ahead: u16,
    aphase: bool,
    acid: u16,
    sqs: Vec<Option<SqState>>,
    cqs: Vec<Option<CqState>>,
    cmds: HashMap<u32, Cmd>,
    by_cid: HashMap<(u16, u16), u32>,
    pages: Vec<u64>,
    next_tag: u32,
    next_seq: u64,
    next_cid: u16,
    /// Tags: published, executed (from the operation log), completed, dropped.
    published: HashSet<u32>,
    executed: HashSet<u32>,
    completed: HashSet<u32>,
    dropped: HashSet<u32>,
    report: Report,
    step: u32,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// Entries from `from` to `to` in a ring of `size`.
fn dist(from: u16, to: u16, size: u16) -> u16 {
    ((to as u32 + size as u32 - from as u32) % size as u32) as u16
}

impl<'a, P: Port + ?Sized> Driver<'a, P> {
    pub fn new(port: &'a P, rng: Rng, shape: Shape) -> Self {
        let pages = (DATA / PAGE..RAM / PAGE).rev().map(|p| p * PAGE).collect();
        Driver {
            port,
            rng,
            shape,
            img: Image::new(RAM),
            lbas: Vec::new(),
            lba: Vec::new(),
            meta: Vec::new(),
            mqes: 2,
            dbbc: false,
            shadow: false,
            atail: 0,
            ahead: 0,
            aphase: true,
            acid: 0,
            sqs: (0..=MAX_QUEUES).map(|_| None).collect(),
            cqs: (0..=MAX_QUEUES).map(|_| None).collect(),
            cmds: HashMap::new(),
            by_cid: HashMap::new(),
            pages,
            next_tag: 1,
            next_seq: 1,
            next_cid: 0,
            published: HashSet::new(),
            executed: HashSet::new(),
            completed: HashSet::new(),
            dropped: HashSet::new(),
            report: Report::default(),
            step: 0,
        }
    }

    /// Runs the schedule; the first violation ends it, with where it was.
    pub fn run(mut self) -> Result<Report, Failure> {
        let r = self.run_inner();
        r.map_err(|violation| Failure {
            step: self.step,
            shape: Box::new(self.shape.clone()),
            violation,
            outstanding: self.outstanding_summary(),
            counters: self.port.counters().iter().map(|c| c.to_string()).collect::<Vec<_>>().join(" "),
        })
    }

    fn run_inner(&mut self) -> Result<Report, Violation> {
        // Every word the driver does not own holds the canary.
        self.fill_canary(0, RAM);
        self.init()?;
        while self.step < self.shape.steps && !self.rng.exhausted() {
            self.step += 1;
            self.one_step()?;
        }
        self.finish()?;
        Ok(self.report.clone())
    }

    fn one_step(&mut self) -> Result<(), Violation> {
        // A schedule with crashes has one at least: half way, if its draws
        // gave none yet (1 % a step; a slow host's schedule met none in CI).
        if self.shape.crashes && self.report.crashes == 0 && self.step == self.shape.steps / 2 {
            return self.crash();
        }
        match self.rng.below(100) {
            0..=39 => self.submit_batch(),
            40..=69 => self.reap_all(false).map(|_| ()),
            70..=74 => self.publish_all(),
            75..=86 => self.wait_some(),
            // Idle gaps: a sleeping poller's wake-up (armed EventIdx, timed
            // steps, a trapped doorbell page) is part of the protocol too.
            87..=88 => self.idle(50, 1000),
            89 => self.idle(1000, 25_000),
            90..=93 if self.shape.deletes => self.delete_and_create(),
            94..=96 if self.shape.resets => self.reset(false),
            97 if self.shape.resets => self.reset(true),
            98 if self.shape.crashes => self.crash(),
            99 => self.sweep(),
            _ => Ok(()),
        }
    }

    // ---- memory ------------------------------------------------------------

    fn ram(&self) -> &vm_memory::GuestMemoryMmap {
        self.port.ram()
    }

    fn put(&mut self, gpa: u64, data: &[u8]) {
        self.ram().write_slice(data, GuestAddress(gpa)).unwrap();
        self.img.put(gpa, data);
    }

    fn fill_canary(&mut self, gpa: u64, len: u64) {
        let mut bytes = vec![0u8; len as usize];
        for (i, w) in bytes.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&canary(gpa + 8 * i as u64).to_le_bytes());
        }
        self.ram().write_slice(&bytes, GuestAddress(gpa)).unwrap();
        self.img.canary(gpa, len);
    }

    fn zero(&mut self, gpa: u64, len: u64) {
        self.put(gpa, &vec![0u8; len as usize]);
    }

    fn store32(&self, gpa: u64, v: u32) {
        self.ram().store(v, GuestAddress(gpa), Ordering::Release).unwrap();
    }

    fn load32(&self, gpa: u64) -> u32 {
        self.ram().load(GuestAddress(gpa), Ordering::Acquire).unwrap()
    }

    /// Compares all of guest memory with the image.
    fn sweep(&mut self) -> Result<(), Violation> {
        self.report.sweeps += 1;
        self.take_ops()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut words = vec![0u64; buf.len() / 8];
        for base in (0..RAM).step_by(buf.len()) {
            self.ram().read_slice(&mut buf, GuestAddress(base)).unwrap();
            for (w, c) in words.iter_mut().zip(buf.chunks_exact(8)) {
                *w = u64::from_le_bytes(c.try_into().unwrap());
            }
            if let Some((at, want, got)) = self.img.first_difference(base, &words) {
                return Err(Violation::Memory(format!(
                    "{at:#x} holds {got:#x}, not {want:#x} ({})",
                    self.describe(at)
                )));
            }
        }
        Ok(())
    }

    fn describe(&self, gpa: u64) -> String {
        let page = gpa / PAGE * PAGE;
        if let Some((tag, c)) =
            self.cmds.iter().find(|(_, c)| c.pages.contains(&page) || c.extra == Some(page) || c.meta == Some(page))
        {
            return format!("a page of tag {tag}, {:?} on SQ {}", c.op, c.sqid);
        }
        match gpa {
            a if a >= DATA => "a free data page".into(),
            a if a >= CQ_BASE => format!("around CQ {}", (a - CQ_BASE) / CQ_STRIDE + 1),
            a if a >= SQ_BASE => format!("SQ {}'s ring", (a - SQ_BASE) / SQ_STRIDE + 1),
            a if (DBBUF..DBBUF + PAGE).contains(&a) => "the shadow doorbells".into(),
            _ => "driver memory".into(),
        }
    }

    // ---- registers and admin ---------------------------------------------

    fn wait_until(&self, what: &str, mut cond: impl FnMut() -> bool) -> Result<(), Violation> {
        let t0 = Instant::now();
        while !cond() {
            if t0.elapsed() > PATIENCE {
                return Err(Violation::Controller(format!("{what} not within {PATIENCE:?}")));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    fn disable(&mut self) -> Result<(), Violation> {
        self.port.write(0x14, &0u32.to_le_bytes());
        self.wait_until("CSTS.RDY = 0 after CC.EN = 0", || self.port.read32(0x1c) & 1 == 0)?;
        if self.port.read32(0x1c) & 2 != 0 {
            return Err(Violation::Controller("CSTS.CFS after a disable".into()));
        }
        Ok(())
    }

    /// Enables the controller with a fresh admin queue, identifies it, sets
    /// up the shadow doorbells (as the shape says) and creates the I/O queues.
    fn init(&mut self) -> Result<(), Violation> {
        self.disable()?;
        let cap = self.port.read32(0) as u64 | (self.port.read32(4) as u64) << 32;
        self.mqes = (cap & 0xffff) as u16 + 1;
        let n = self.shape.admin as u32;
        self.zero(ASQ, n as u64 * 64);
        self.zero(ACQ, n as u64 * 16);
        self.img.release(ACQ, n as u64 * 16, true);
        (self.atail, self.ahead, self.aphase) = (0, 0, true);
        self.port.write(0x24, &((n - 1) << 16 | (n - 1)).to_le_bytes());
        self.port.write(0x28, &ASQ.to_le_bytes());
        self.port.write(0x30, &ACQ.to_le_bytes());
        self.port.write(0x14, &0x0046_0001u32.to_le_bytes());
        self.wait_until("CSTS.RDY = 1", || self.port.read32(0x1c) & 3 != 0)?;
        if self.port.read32(0x1c) & 2 != 0 {
            return Err(Violation::Controller("CSTS.CFS at enable".into()));
        }
        self.img.release(ADMIN_DATA, PAGE, true);
        self.admin_ok(0x06, 0, ADMIN_DATA, [1, 0, 0])?;
        let mut id = vec![0u8; 4096];
        self.ram().read_slice(&mut id, GuestAddress(ADMIN_DATA)).unwrap();
        self.dbbc = u16::from_le_bytes([id[256], id[257]]) & 1 << 8 != 0;
        // NN: every namespace gets commands (up to 32).
        let nn = le32(&id, 516).clamp(1, 32);
        self.lba.clear();
        self.meta.clear();
        for nsid in 1..=nn {
            self.admin_ok(0x06, nsid, ADMIN_DATA, [0, 0, 0])?;
            self.ram().read_slice(&mut id, GuestAddress(ADMIN_DATA)).unwrap();
            let nsze = u64::from_le_bytes(id[0..8].try_into().unwrap());
            let flbas = id[26] & 0xf;
            let lbaf = 128 + 4 * flbas as usize;
            let (ms, lbads) = (u16::from_le_bytes([id[lbaf], id[lbaf + 1]]) as u64, id[lbaf + 2]);
            let (ext, dps) = (ms > 0 && id[26] & 0x10 != 0, id[29]);
            let meta = Meta { ms, ext, data: 1 << lbads, pi: ms >= 8 && dps & 7 == 1, pi_first: dps & 8 != 0 };
            self.lba.push(meta.data + if meta.ext { ms } else { 0 });
            self.meta.push(meta);
            if self.lbas.len() < nsid as usize {
                // A namespace keeps its data over resets: its model only starts once.
                self.lbas.push(Lbas::new(nsze.min(4096)));
            }
        }
        let q = self.shape.sqs as u32 - 1;
        self.admin_ok(0x09, 0, 0, [7, q | q << 16, 0])?;
        self.shadow = self.dbbc && self.shape.shadow;
        if self.shadow {
            self.zero(DBBUF, PAGE);
            self.zero(EVIDX, PAGE);
            self.img.release(EVIDX, PAGE, true);
            // The controller writes each queue's shadow word when it creates it.
            self.img.release(DBBUF, PAGE, true);
            self.admin_ok(0x7c, 0, DBBUF, [0, 0, 0])?;
            self.report.shadowed = true;
        }
        for cq in 1..=self.shape.cqs {
            self.create_cq(cq)?;
        }
        for sq in 1..=self.shape.sqs {
            self.create_sq(sq)?;
        }
        Ok(())
    }

    /// An admin command; (dw0, status). PRP2 of Doorbell Buffer Config is EVIDX.
    fn admin(&mut self, op: u8, nsid: u32, prp1: u64, cdw: [u32; 3]) -> Result<(u32, u16), Violation> {
        let size = self.shape.admin;
        self.acid = self.acid.wrapping_add(1);
        let prp2 = if op == 0x7c { EVIDX } else { 0 };
        let e = sqe(op, self.acid, nsid, 0, prp1, prp2, [cdw[0], cdw[1], cdw[2]]);
        self.put(ASQ + self.atail as u64 * 64, &e);
        self.atail = (self.atail + 1) % size;
        self.port.doorbell(DOORBELLS, self.atail as u32);
        let t0 = Instant::now();
        loop {
            let at = ACQ + self.ahead as u64 * 16;
            let dw3 = self.load32(at + 12);
            if (dw3 >> 16 & 1 != 0) == self.aphase {
                let dw0 = self.load32(at);
                let dw2 = self.load32(at + 8);
                self.ahead = (self.ahead + 1) % size;
                if self.ahead == 0 {
                    self.aphase = !self.aphase;
                }
                self.port.doorbell(DOORBELLS + 4, self.ahead as u32);
                if dw3 & 0xffff != self.acid as u32 || dw2 >> 16 != 0 {
                    return Err(Violation::UnexpectedCompletion(format!(
                        "admin CQ entry with cid {} sqid {}, waiting for cid {} (opcode {op:#x})",
                        dw3 & 0xffff,
                        dw2 >> 16,
                        self.acid
                    )));
                }
                return Ok((dw0, (dw3 >> 17) as u16 & 0x7fff));
            }
            // I/O completions may be what the controller waits to post first.
            self.reap_all(true)?;
            if t0.elapsed() > PATIENCE {
                return Err(Violation::LostCompletion(format!("admin opcode {op:#x} (cid {})", self.acid)));
            }
            std::thread::yield_now();
        }
    }

    fn admin_ok(&mut self, op: u8, nsid: u32, prp1: u64, cdw: [u32; 3]) -> Result<u32, Violation> {
        match self.admin(op, nsid, prp1, cdw)? {
            (dw0, 0) => Ok(dw0),
            (_, st) => Err(Violation::Status(format!("admin opcode {op:#x} cdw10 {:#x}: status {st:#x}", cdw[0]))),
        }
    }

    fn queue_size(&mut self) -> u16 {
        let s = self.rng.pick(&[2u16, 3, 4, 7, 16, 31, 64, 255, 256, 1024, 4096]);
        s.min(self.mqes)
    }

    fn create_cq(&mut self, qid: u16) -> Result<(), Violation> {
        let size = self.queue_size();
        let gpa = CQ_BASE + (qid as u64 - 1) * CQ_STRIDE;
        self.zero(gpa, size as u64 * 16);
        self.img.release(gpa, size as u64 * 16, true);
        self.admin_ok(0x05, 0, gpa, [qid as u32 | (size as u32 - 1) << 16, 1, 0])?;
        self.cqs[qid as usize] = Some(CqState { size, head: 0, phase: true, rung: 0, since_ring: 0 });
        Ok(())
    }

    fn create_sq(&mut self, qid: u16) -> Result<(), Violation> {
        let size = self.queue_size();
        let cqid = (qid - 1) % self.shape.cqs + 1;
        let gpa = SQ_BASE + (qid as u64 - 1) * SQ_STRIDE;
        self.admin_ok(0x01, 0, gpa, [qid as u32 | (size as u32 - 1) << 16, 1 | (cqid as u32) << 16, 0])?;
        let unpublished = Vec::new();
        self.sqs[qid as usize] =
            Some(SqState { size, cqid, tail: 0, published: 0, head: 0, since_ring: 0, unpublished });
        Ok(())
    }

    // ---- I/O ----------------------------------------------------------------

    fn submit_batch(&mut self) -> Result<(), Violation> {
        let n = self.rng.range(1, self.shape.batch as u64);
        let ids: Vec<u16> = (1..=self.shape.sqs).filter(|&q| self.sqs[q as usize].is_some()).collect();
        if ids.is_empty() {
            return Ok(());
        }
        let mut touched = Vec::new();
        for _ in 0..n {
            if self.cmds.len() >= self.shape.inflight as usize {
                break;
            }
            let qid = self.rng.pick(&ids);
            if self.submit(qid)? && !touched.contains(&qid) {
                touched.push(qid);
            }
        }
        for qid in touched {
            if !self.rng.chance(self.shape.sq_late) {
                self.publish_sq(qid);
            }
        }
        Ok(())
    }

    fn take_page(&mut self) -> Option<u64> {
        self.pages.pop()
    }

    fn free_page(&mut self, p: u64) {
        self.fill_canary(p, PAGE);
        self.pages.push(p);
    }

    /// Picks an LBA range of namespace index `ns` that may go out now, or None.
    fn lbas_for(&mut self, ns: usize, write: bool) -> Option<(u64, u64)> {
        let max = (MAX_BYTES / self.lba[ns]).max(1);
        for _ in 0..8 {
            let n = self.rng.range(1, max);
            let slba = self.rng.below(self.lbas[ns].len() - n + 1);
            if self.lbas[ns].free(slba, n, write) {
                return Some((slba, n));
            }
        }
        None
    }

    /// Writes one command into SQ `qid` if it has room; true if it did.
    fn submit(&mut self, qid: u16) -> Result<bool, Violation> {
        let sq = self.sqs[qid as usize].as_ref().unwrap();
        // Entries the controller may not have fetched yet, as its last completion told.
        if sq.tail - sq.head >= sq.size as u64 - 1 {
            return Ok(false);
        }
        let mut op = match self.rng.below(100) {
            0..=39 => Op::Read,
            40..=79 => Op::Write,
            80..=84 => Op::Flush,
            85..=89 => Op::Zeroes,
            90..=94 => Op::Deallocate,
            95 => Op::BadNs(self.rng.pick(&[0x01, 0x02])),
            96..=97 => Op::Bad(0x7f, 0x001),
            _ => Op::Bad(0x02, 0x080),
        };
        // Commands spread over the namespaces; a bad NSID names none.
        let nn = self.lbas.len() as u32;
        let ns = self.rng.below(nn as u64) as usize;
        let mut nsid = ns as u32 + 1;
        if let Op::BadNs(_) = op {
            nsid = self.rng.pick(&[0, nn + 1, 0xffff_fffe, 0xffff_ffff]);
        } else if op == Op::Flush && self.rng.chance(20) {
            nsid = 0xffff_ffff; // every namespace
        }
        let (mut slba, mut nlb) = (0, 0);
        if matches!(op, Op::Read | Op::Write | Op::Zeroes | Op::Deallocate) {
            match self.lbas_for(ns, op != Op::Read) {
                Some((s, n)) => (slba, nlb) = (s, n),
                None => op = Op::Flush,
            }
        }
        if let Op::Bad(0x02, _) = op {
            (slba, nlb) = (u32::MAX as u64, 1);
        }
        if let Op::BadNs(_) = op {
            nlb = 1;
        }
        let mut cmd = Cmd {
            sqid: qid,
            cid: 0,
            ns: if let Op::BadNs(_) = op { 0 } else { ns },
            at: 0,
            op,
            slba,
            nlb,
            offset: 0,
            pages: Vec::new(),
            extra: None,
            meta: None,
            seq: 0,
            published: false,
            action: None,
            prinfo: None,
            tuples: Vec::new(),
            pi_status: 0,
        };
        let opcode = match op {
            Op::Read => 0x02,
            Op::Write => 0x01,
            Op::Flush => 0x00,
            Op::Zeroes => 0x08,
            Op::Deallocate => 0x09,
            Op::Bad(o, _) | Op::BadNs(o) => o,
        };
        cmd.action = self.predict(qid, opcode, nsid, &cmd);
        self.draw_prinfo(&mut cmd);
        let (mut prp1, mut prp2) = (0, 0);
        if matches!(op, Op::Read | Op::Write) {
            let bytes = cmd.bytes(self.host_lba(&cmd));
            // PRP1 may start inside a page (dword aligned; the driver keeps 8).
            let offset = if self.rng.chance(30) { self.rng.below((PAGE - 8) / 8) * 8 } else { 0 };
            let npages = (offset + bytes).div_ceil(PAGE);
            let separate = self.meta[ns].ms > 0 && !self.meta[ns].ext && !self.stripped(&cmd);
            let need = npages + u64::from(npages > 2) + u64::from(separate);
            if (self.pages.len() as u64) < need {
                return Ok(false);
            }
            if separate {
                // nlb * MS <= 32 * 64 bytes: one page, its start as MPTR.
                cmd.meta = self.take_page();
            }
            cmd.offset = offset;
            cmd.pages = (0..npages).map(|_| self.take_page().unwrap()).collect();
            prp1 = cmd.pages[0] + offset;
            if npages == 2 {
                prp2 = cmd.pages[1];
            } else if npages > 2 {
                let list = self.take_page().unwrap();
                let entries: Vec<u8> = cmd.pages[1..].iter().flat_map(|p| p.to_le_bytes()).collect();
                self.put(list, &entries);
                cmd.extra = Some(list);
                prp2 = list;
            }
            if op == Op::Write {
                cmd.seq = self.next_seq;
                self.next_seq += 1;
                self.draw_tuples(&mut cmd);
                let data = self.payload(&cmd);
                self.scatter(&cmd, &data);
                if let Some(p) = cmd.meta {
                    let meta = self.meta_payload(&cmd);
                    self.put(p, &meta);
                }
            } else {
                // The transfer's bytes are the device's; the rest of its pages stay canary.
                for (a, n) in segments(&cmd, self.host_lba(&cmd)) {
                    self.img.release(a, n, true);
                }
                if let Some(p) = cmd.meta {
                    self.img.release(p, nlb * self.meta[ns].ms, true);
                }
            }
        } else if let Op::BadNs(_) = op {
            // A page of canary the controller must not touch (the sweep checks it).
            let Some(p) = self.take_page() else { return Ok(false) };
            cmd.extra = Some(p);
            prp1 = p;
        } else if op == Op::Deallocate {
            let Some(p) = self.take_page() else { return Ok(false) };
            let mut range = [0u8; 16];
            range[4..8].copy_from_slice(&(nlb as u32).to_le_bytes());
            range[8..16].copy_from_slice(&slba.to_le_bytes());
            self.put(p, &range);
            cmd.extra = Some(p);
            prp1 = p;
        }
        if cmd.touches_lbas() {
            self.lbas[ns].claim(slba, nlb, cmd.writes(), true);
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        cmd.cid = self.alloc_cid(qid);
        let prinfo = cmd.prinfo.map_or(0, |p| p.cdw12());
        let cdw = match op {
            Op::Deallocate => [0, 4, 0],
            Op::Flush | Op::Bad(0x7f, _) => [0, 0, 0],
            _ => [slba as u32, (slba >> 32) as u32, (nlb as u32 - 1) | prinfo],
        };
        let mut e = sqe(opcode, cmd.cid, nsid, tag, prp1, prp2, cdw);
        if let Some(p) = cmd.meta {
            e[16..24].copy_from_slice(&p.to_le_bytes()); // MPTR
        }
        if let Some(p) = cmd.prinfo {
            let (cdw14, cdw15) = p.cdw14_15();
            e[56..60].copy_from_slice(&cdw14.to_le_bytes());
            e[60..64].copy_from_slice(&cdw15.to_le_bytes());
        }
        let sq = self.sqs[qid as usize].as_mut().unwrap();
        let slot = sq.slot(sq.tail);
        cmd.at = sq.tail;
        sq.unpublished.push(tag);
        sq.tail += 1;
        sq.since_ring += 1;
        let every = self.shape.sq_every;
        let ring = every > 0 && sq.since_ring >= every;
        let gpa = SQ_BASE + (qid as u64 - 1) * SQ_STRIDE + slot as u64 * 64;
        self.put(gpa, &e);
        self.by_cid.insert((qid, cmd.cid), tag);
        self.report.pi_doomed += u64::from(cmd.pi_status != 0);
        self.cmds.insert(tag, cmd);
        self.report.submitted += 1;
        if ring {
            self.publish_sq(qid);
        }
        Ok(true)
    }

    /// What the injection rules do to command `c` (opcode `opcode`) of SQ
    /// `qid`: the first rule that matches (all trigger always).
    fn predict(&self, qid: u16, opcode: u8, nsid: u32, c: &Cmd) -> Option<Action> {
        // The controller's view is the SQE's fields as given (its NSID,
        // named namespace or not; the LBAs of CDW10-12).
        let kind = match c.op {
            Op::Read | Op::Bad(0x02, _) | Op::BadNs(0x02) => Kind::Read,
            Op::Write | Op::BadNs(0x01) => Kind::Write,
            Op::Flush => Kind::Flush,
            Op::Zeroes => Kind::WriteZeroes,
            Op::Deallocate => Kind::Discard,
            Op::Bad(..) | Op::BadNs(_) => Kind::Other,
        };
        let lba = matches!(kind, Kind::Read | Kind::Write | Kind::WriteZeroes)
            .then(|| LbaSpan { slba: c.slba, nlb: c.nlb.max(1) as u32 - 1 });
        let view = CommandView { opcode, kind, nsid, lba, qid };
        self.shape.rules.iter().find(|r| r.matcher.matches(&view)).map(|r| r.action)
    }

    fn alloc_cid(&mut self, qid: u16) -> u16 {
        loop {
            self.next_cid = self.next_cid.wrapping_add(1);
            if self.next_cid != 0xffff && !self.by_cid.contains_key(&(qid, self.next_cid)) {
                return self.next_cid;
            }
        }
    }

    /// Makes SQ `qid`'s tail visible to the controller: the register (or
    /// mapped page) store, or the shadow word and, as EventIdx asks (or
    /// always), the register.
    fn publish_sq(&mut self, qid: u16) {
        let sq = self.sqs[qid as usize].as_mut().unwrap();
        let (old, new) = (sq.slot(sq.published), sq.slot(sq.tail));
        sq.since_ring = 0;
        for tag in sq.unpublished.drain(..) {
            self.published.insert(tag);
            if let Some(c) = self.cmds.get_mut(&tag) {
                c.published = true;
            }
        }
        sq.published = sq.tail;
        self.ring(qid as u64 * 8, old as u32, new as u32);
    }

    fn publish_cq(&mut self, qid: u16) {
        let cq = self.cqs[qid as usize].as_mut().unwrap();
        let (old, new) = (cq.rung, cq.head);
        cq.since_ring = 0;
        if old == new {
            return;
        }
        cq.rung = new;
        self.ring(qid as u64 * 8 + 4, old as u32, new as u32);
    }

    /// A doorbell of an I/O queue: `off` from the first doorbell.
    fn ring(&mut self, off: u64, old: u32, new: u32) {
        if !self.shadow {
            return self.port.doorbell(DOORBELLS + off, new);
        }
        self.store32(DBBUF + off, new);
        fence(Ordering::SeqCst);
        let ring = if self.shape.event_idx {
            let ev = self.load32(EVIDX + off);
            // Linux's nvme_dbbuf_need_event, in 16 bits.
            (new.wrapping_sub(ev).wrapping_sub(1) as u16) < (new.wrapping_sub(old) as u16)
        } else {
            true
        };
        if ring {
            self.port.doorbell(DOORBELLS + off, new);
        }
    }

    fn publish_all(&mut self) -> Result<(), Violation> {
        for q in 1..=MAX_QUEUES {
            if self.sqs[q as usize].as_ref().is_some_and(|s| s.published != s.tail) {
                self.publish_sq(q);
            }
            if self.cqs[q as usize].is_some() {
                self.publish_cq(q);
            }
        }
        Ok(())
    }

    /// Reaps what every CQ holds; true if anything. In `quiet` (waiting for
    /// an admin command) heads are rung at once.
    fn reap_all(&mut self, quiet: bool) -> Result<bool, Violation> {
        let mut any = false;
        for q in 1..=MAX_QUEUES {
            if self.cqs[q as usize].is_none() {
                continue;
            }
            let mut n = 0;
            while self.reap_one(q)? {
                n += 1;
                let cq = self.cqs[q as usize].as_mut().unwrap();
                cq.since_ring += 1;
                let every = self.shape.cq_every;
                if every > 0 && cq.since_ring >= every {
                    self.publish_cq(q);
                }
            }
            if n > 0 && (quiet || !self.rng.chance(self.shape.cq_late)) {
                self.publish_cq(q);
            }
            any |= n > 0;
        }
        Ok(any)
    }

    /// Takes the entry at CQ `q`'s head if its phase says it is new.
    fn reap_one(&mut self, q: u16) -> Result<bool, Violation> {
        let cq = self.cqs[q as usize].as_ref().unwrap();
        let at = CQ_BASE + (q as u64 - 1) * CQ_STRIDE + cq.head as u64 * 16;
        let dw3 = self.load32(at + 12);
        if (dw3 >> 16 & 1 != 0) != cq.phase {
            return Ok(false);
        }
        let mut e = [0u8; 16];
        self.ram().read_slice(&mut e, GuestAddress(at)).unwrap();
        let cq = self.cqs[q as usize].as_mut().unwrap();
        cq.head = (cq.head + 1) % cq.size;
        if cq.head == 0 {
            cq.phase = !cq.phase;
        }
        let (sqhd, sqid, cid, st) = (le32(&e, 8) as u16, (le32(&e, 8) >> 16) as u16, dw3 as u16, (dw3 >> 17) as u16);
        self.complete(q, sqhd, sqid, cid, st)?;
        Ok(true)
    }

    fn complete(&mut self, q: u16, sqhd: u16, sqid: u16, cid: u16, st: u16) -> Result<(), Violation> {
        let on_cq = self.sqs.get(sqid as usize).and_then(|s| s.as_ref()).is_some_and(|s| s.cqid == q);
        if !on_cq {
            return Err(Violation::UnexpectedCompletion(format!(
                "CQ {q}: entry names SQ {sqid}, not an SQ of this CQ"
            )));
        }
        let Some(&tag) = self.by_cid.get(&(sqid, cid)) else {
            return Err(Violation::UnexpectedCompletion(format!("SQ {sqid} cid {cid} (sqhd {sqhd}): no such command")));
        };
        let c = &self.cmds[&tag];
        if !c.published {
            return Err(Violation::UnexpectedCompletion(format!(
                "SQ {sqid} cid {cid} tag {tag} at entry {} was never published",
                c.at
            )));
        }
        let sq = self.sqs[sqid as usize].as_mut().unwrap();
        // The head moves forward, up to the tail published, and past this command's slot.
        let ahead = dist(sq.slot(sq.head), sqhd, sq.size) as u64;
        if sq.head + ahead > sq.published {
            return Err(Violation::SqHead(format!(
                "SQ {sqid}: a completion reports head {sqhd}; last head {}, tail published {} (size {})",
                sq.slot(sq.head),
                sq.slot(sq.published),
                sq.size
            )));
        }
        sq.head += ahead;
        // The command is behind that head: fetched, not among the entries
        // published and not fetched yet, as the completion itself tells.
        if c.at >= sq.head {
            return Err(Violation::SqHead(format!(
                "SQ {sqid} cid {cid}: its entry {} (slot {}) is not before the head {sqhd} the completion reports",
                c.at,
                sq.slot(c.at)
            )));
        }
        let c = self.cmds.remove(&tag).unwrap();
        self.by_cid.remove(&(sqid, cid));
        self.completed.insert(tag);
        self.report.completed += 1;
        let want = match (c.action, c.op) {
            (Some(Action::Status(s)), _) => s.field() & 0x7ff,
            // Withheld, then aborted: Command Abort Requested.
            (Some(Action::Drop), _) => 0x007,
            (_, Op::Bad(_, st)) => st,
            (_, Op::BadNs(_)) => 0x00b,
            _ => c.pi_status,
        };
        if st & 0x7ff != want {
            return Err(Violation::Status(format!(
                "SQ {sqid} cid {cid} {:?} LBA {}+{}: status {st:#x}, expected {want:#x}",
                c.op, c.slba, c.nlb
            )));
        }
        // Failed or withheld by injection: not executed.
        let executed = !matches!(c.action, Some(Action::Status(_) | Action::Drop));
        self.report.injected += u64::from(!executed);
        self.report.prinfo += u64::from(c.prinfo.is_some());
        self.report.pi_errors += u64::from(c.pi_status != 0);
        let executed = executed && c.pi_status == 0;
        self.retire(c, executed)
    }

    /// A command done: checks its data (completed) and gives its pages back.
    fn retire(&mut self, c: Cmd, completed: bool) -> Result<(), Violation> {
        let (lba, ns) = (self.host_lba(&c), c.ns);
        let mut result = Ok(());
        match c.op {
            Op::Read if completed && self.shape.data => {
                let mut data = self.gather(&c);
                if let Some(Action::Corrupt(k)) = c.action {
                    // Exactly the flipped bytes differ: flipped back, it is the data.
                    k.apply(&mut data);
                    self.report.corrupted += 1;
                }
                let (m, meta) = (self.meta[ns], self.meta_of(&c));
                let ms = m.ms as usize;
                for (b, block) in data.chunks_exact(lba as usize).enumerate() {
                    // Each block's words with its metadata (inline or from MPTR) after its data,
                    // stored inverted: what the model's content gives.
                    let separate = meta.get(b * ms..(b + 1) * ms).unwrap_or(&[]);
                    let words: Vec<u64> = block
                        .chunks_exact(8)
                        .chain(separate.chunks_exact(8))
                        .enumerate()
                        .map(|(w, x)| m.stored(w as u64, u64::from_le_bytes(x.try_into().unwrap())))
                        .collect();
                    if let Err(e) = self.lbas[ns].observe(c.slba + b as u64, &words) {
                        let nsid = ns + 1;
                        result = Err(Violation::Data(format!(
                            "read of SQ {} cid {} (namespace {nsid}): {e}",
                            c.sqid, c.cid
                        )));
                        break;
                    }
                }
            }
            Op::Write if completed => {
                if self.gather(&c) != self.payload(&c)
                    || (c.meta.is_some() && self.meta_of(&c) != self.meta_payload(&c))
                {
                    result = Err(Violation::Memory(format!("the data of write SQ {} cid {} changed", c.sqid, c.cid)));
                }
                for k in 0..c.nlb {
                    let left = self.left(&c, k);
                    self.lbas[ns].set(c.slba + k, 1, left);
                }
            }
            Op::Zeroes | Op::Deallocate if completed => {
                for k in 0..c.nlb {
                    let left = self.left(&c, k);
                    self.lbas[ns].set(c.slba + k, 1, left);
                }
            }
            // A failed PI check writes nothing; a command dropped may or may not have run.
            Op::Write | Op::Zeroes | Op::Deallocate if c.pi_status == 0 => {
                for k in 0..c.nlb {
                    let left = self.left(&c, k);
                    self.lbas[ns].maybe(c.slba + k, 1, left);
                }
            }
            _ => {}
        }
        if c.touches_lbas() {
            self.lbas[ns].claim(c.slba, c.nlb, c.writes(), false);
        }
        for p in c.pages.iter().copied().chain(c.extra).chain(c.meta) {
            self.free_page(p);
        }
        result
    }

    /// Waits for at least one completion, everything published first; a
    /// controller that posts none within [`PATIENCE`] lost one.
    fn wait_some(&mut self) -> Result<(), Violation> {
        if !self.cmds.values().any(|c| c.published && c.action != Some(Action::Drop)) {
            return Ok(());
        }
        let t0 = Instant::now();
        loop {
            if self.reap_all(false)? {
                return Ok(());
            }
            // Late doorbells: everything goes out before the wait is long.
            if t0.elapsed() > Duration::from_millis(1) {
                self.publish_all()?;
            }
            if t0.elapsed() > PATIENCE {
                return Err(Violation::LostCompletion(format!("{} commands published", self.cmds.len())));
            }
            std::thread::yield_now();
        }
    }

    /// Does nothing for `lo..=hi` microseconds, everything published or
    /// not, as the schedule has it.
    fn idle(&mut self, lo: u64, hi: u64) -> Result<(), Violation> {
        self.report.idles += 1;
        std::thread::sleep(Duration::from_micros(self.rng.range(lo, hi)));
        Ok(())
    }

    /// Drains: everything published, every command completed.
    fn drain(&mut self) -> Result<(), Violation> {
        let t0 = Instant::now();
        let mut aborted = Instant::now() - Duration::from_secs(1);
        while !self.cmds.is_empty() {
            self.publish_all()?;
            if aborted.elapsed() > Duration::from_millis(2) {
                // Commands injection withholds complete only when aborted
                // (one not fetched yet is not aborted: asked again later).
                self.abort_withheld()?;
                aborted = Instant::now();
            }
            if !self.reap_all(true)? {
                std::thread::yield_now();
            }
            if t0.elapsed() > PATIENCE {
                return Err(Violation::LostCompletion(format!("{} commands never completed", self.cmds.len())));
            }
        }
        self.publish_all()
    }

    /// Aborts the published commands injection withholds: each completes
    /// with Command Abort Requested, if the controller fetched it.
    fn abort_withheld(&mut self) -> Result<(), Violation> {
        let w: Vec<(u16, u16)> = self
            .cmds
            .values()
            .filter(|c| c.published && c.action == Some(Action::Drop))
            .map(|c| (c.sqid, c.cid))
            .collect();
        for (sqid, cid) in w {
            if !self.by_cid.contains_key(&(sqid, cid)) {
                continue; // completed (aborted) meanwhile
            }
            self.admin_ok(0x08, 0, 0, [sqid as u32 | (cid as u32) << 16, 0, 0])?;
        }
        Ok(())
    }

    /// Deletes an SQ (and its CQ when it is the CQ's only one), with its
    /// commands in flight or drained first, and creates them again.
    fn delete_and_create(&mut self) -> Result<(), Violation> {
        let qid = self.rng.range(1, self.shape.sqs as u64) as u16;
        if self.sqs[qid as usize].is_none() {
            return Ok(());
        }
        self.report.deletes += 1;
        if self.rng.chance(50) {
            self.drain()?;
        } else {
            self.publish_all()?;
        }
        self.admin_ok(0x00, 0, 0, [qid as u32, 0, 0])?;
        // What the deleted SQ had out: completed by now, or never to be.
        self.reap_all(true)?;
        let left: Vec<u32> = self.cmds.iter().filter(|(_, c)| c.sqid == qid).map(|(&t, _)| t).collect();
        for tag in left {
            self.drop_cmd(tag)?;
        }
        self.sqs[qid as usize] = None;
        let cqid = (qid - 1) % self.shape.cqs + 1;
        let alone = !self.sqs.iter().flatten().any(|s| s.cqid == cqid);
        if alone {
            self.admin_ok(0x04, 0, 0, [cqid as u32, 0, 0])?;
            let cq = self.cqs[cqid as usize].take().unwrap();
            // Nothing may land in the old ring any more.
            let gpa = CQ_BASE + (cqid as u64 - 1) * CQ_STRIDE;
            self.fill_canary(gpa, cq.size as u64 * 16);
            self.create_cq(cqid)?;
        }
        self.create_sq(qid)
    }

    /// A command that will never complete (its SQ deleted, or a reset).
    fn drop_cmd(&mut self, tag: u32) -> Result<(), Violation> {
        let c = self.cmds.remove(&tag).unwrap();
        self.by_cid.remove(&(c.sqid, c.cid));
        self.dropped.insert(tag);
        self.report.dropped += 1;
        // Its pages go back as canary: nothing may land there any more.
        self.retire(c, false)
    }

    /// CC.EN = 0 (or a shutdown first) with commands in flight, then the
    /// controller brought up again.
    fn reset(&mut self, shutdown: bool) -> Result<(), Violation> {
        self.report.resets += 1;
        if self.rng.chance(50) {
            self.publish_all()?;
        }
        if shutdown {
            self.port.write(0x14, &(0x0046_0001u32 | 1 << 14).to_le_bytes());
            self.wait_until("CSTS.SHST = complete", || self.port.read32(0x1c) >> 2 & 3 == 2)?;
        }
        self.disable()?;
        // From here on the controller may not touch the old queues or buffers.
        let tags: Vec<u32> = self.cmds.keys().copied().collect();
        for tag in tags {
            self.drop_cmd(tag)?;
        }
        self.forget_queues();
        self.sweep()?;
        self.init()
    }

    /// The device killed with what it has in flight, and a new one on the
    /// same storage: every command out is dropped (a write may have landed
    /// or not), completions reaped before stay reaped, and the controller is
    /// brought up again from scratch.
    fn crash(&mut self) -> Result<(), Violation> {
        if self.rng.chance(50) {
            self.publish_all()?;
        }
        match self.port.restart() {
            None => return Ok(()),
            Some(Err(e)) => return Err(Violation::Controller(format!("restarting the device: {e}"))),
            Some(Ok(())) => {}
        }
        self.report.crashes += 1;
        let tags: Vec<u32> = self.cmds.keys().copied().collect();
        for tag in tags {
            self.drop_cmd(tag)?;
        }
        // A new controller, a new log: tags the old one fetched stay fetched.
        self.forget_queues();
        self.init()
    }

    /// The queues and admin queue are gone (a reset, a new device): their
    /// rings hold the canary, so nothing may write there any more.
    fn forget_queues(&mut self) {
        for q in 1..=MAX_QUEUES as usize {
            if let Some(cq) = self.cqs[q].take() {
                self.fill_canary(CQ_BASE + (q as u64 - 1) * CQ_STRIDE, cq.size as u64 * 16);
            }
            self.sqs[q] = None;
        }
        self.fill_canary(ACQ, self.shape.admin as u64 * 16);
        if self.shadow {
            self.fill_canary(DBBUF, PAGE);
            self.fill_canary(EVIDX, PAGE);
        }
    }

    /// Everything completes; then the operation log and the counters agree.
    fn finish(&mut self) -> Result<(), Violation> {
        self.drain()?;
        self.sweep()?;
        // Executed and completed: every completed command ran exactly once.
        if self.take_ops()? {
            for &tag in &self.completed {
                if !self.executed.contains(&tag) {
                    return Err(Violation::Execution(format!("tag {tag} completed but never fetched")));
                }
            }
            for &tag in &self.executed {
                if !self.completed.contains(&tag) && !self.dropped.contains(&tag) {
                    return Err(Violation::Execution(format!("tag {tag} fetched but never completed")));
                }
            }
        }
        // Timed completions (injected delays, a timing model): none posted
        // before its due time, on the controller's own clock.
        if let Some(t) = self.port.take_timed() {
            if let Some(r) = t.iter().find(|r| r.posted_ns < r.due_ns) {
                return Err(Violation::Controller(format!("a timed completion posted early: {r:?}")));
            }
            self.report.timed += t.len() as u64;
        }
        let c = self.port.counters();
        let get = |n: &str| c.iter().find(|c: &&Counter| c.name == n).map(|c| c.value);
        if let Some(io) = get("io.commands") {
            let (lo, hi) = (self.report.completed, self.published.len() as u64);
            if io < lo || io > hi {
                return Err(Violation::Execution(format!("io.commands {io}: {lo} commands completed, {hi} published")));
            }
        }
        // The controller counted each PI check that failed: those completed
        // with it, and perhaps those a reset dropped (a restarted device
        // counts from zero).
        if let Some(e) = get("pi.errors").filter(|_| self.report.crashes == 0) {
            let (lo, hi) = (self.report.pi_errors, self.report.pi_doomed);
            if e < lo || e > hi {
                return Err(Violation::Controller(format!(
                    "pi.errors {e}: {lo} commands completed with a PI check error, {hi} submitted to fail one"
                )));
            }
        }
        Ok(())
    }

    /// Takes the controller's operation log: each tag fetched at most once,
    /// and only published ones.
    /// False if the port cannot see the log.
    fn take_ops(&mut self) -> Result<bool, Violation> {
        let Some(ops) = self.port.take_ops() else { return Ok(false) };
        for OpRecord { sqid, cid, tag, opcode } in ops {
            if !self.published.contains(&tag) {
                return Err(Violation::Execution(format!(
                    "SQ {sqid} cid {cid} opcode {opcode:#x}: tag {tag} fetched but never published"
                )));
            }
            if !self.executed.insert(tag) {
                return Err(Violation::Execution(format!(
                    "SQ {sqid} cid {cid} opcode {opcode:#x}: tag {tag} fetched twice"
                )));
            }
        }
        Ok(true)
    }

    fn outstanding_summary(&self) -> String {
        let mut v: Vec<String> = self
            .cmds
            .iter()
            .map(|(t, c)| {
                format!(
                    "tag {t} SQ {} cid {} entry {} {:?}{}",
                    c.sqid,
                    c.cid,
                    c.at,
                    c.op,
                    if c.published { "" } else { " (unpublished)" }
                )
            })
            .collect();
        v.sort();
        v.truncate(8);
        let qs: Vec<String> = (1..=MAX_QUEUES as usize)
            .filter_map(|q| {
                self.sqs[q].as_ref().map(|s| {
                    format!("SQ{q}[size {} tail {} published {} head {}]", s.size, s.tail, s.published, s.head)
                })
            })
            .chain((1..=MAX_QUEUES as usize).filter_map(|q| {
                self.cqs[q].as_ref().map(|c| format!("CQ{q}[size {} head {} rung {}]", c.size, c.head, c.rung))
            }))
            .collect();
        format!("{} ({}); {}", self.cmds.len(), v.join(", "), qs.join(" "))
    }
}

/// The (guest address, length) pieces of a command's data.
/// A submission queue entry.
fn sqe(op: u8, cid: u16, nsid: u32, tag: u32, prp1: u64, prp2: u64, cdw: [u32; 3]) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = op;
    e[2..4].copy_from_slice(&cid.to_le_bytes());
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[8..12].copy_from_slice(&tag.to_le_bytes());
    e[12..16].copy_from_slice(&(!tag).to_le_bytes());
    e[24..32].copy_from_slice(&prp1.to_le_bytes());
    e[32..40].copy_from_slice(&prp2.to_le_bytes());
    for (i, v) in cdw.iter().enumerate() {
        e[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    e
}
