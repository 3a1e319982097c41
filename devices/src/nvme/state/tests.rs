//! The publication order under death at every store: a driver that never
//! re-initialises the controller runs a script of admin and I/O commands;
//! the controller "dies" (a panic at its Nth store into the state memory,
//! on whatever thread makes it; its object is leaked, no cleanup runs), a
//! new controller adopts the same state memory with `resume`, the BAR write
//! the dead one did not acknowledge is sent again (as a client replays it),
//! and the driver goes on. The oracle is the driver's own book: every
//! command completes exactly once with the status it expects, and every
//! read returns what the writes completed before it left.

use super::super::queue::status;
use super::super::regs::{REG_ACQ, REG_AQA, REG_ASQ, REG_CC};
use super::super::{DoorbellMode, Nvme, NvmeConfig, DOORBELLS};
use super::layout::*;
use crate::block::StorageKind;
use crate::state::StateMemory;
use crate::{DeviceContext, DeviceModel, GuestMemoryMmap};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress};

/// Where a controller dies: after `left` more stores (u64::MAX: never).
pub struct Kill {
    left: AtomicU64,
    dead: AtomicBool,
    stores: AtomicU64,
}

impl Kill {
    pub fn store(&self) {
        self.stores.fetch_add(1, Ordering::Relaxed);
        let left = self.left.load(Ordering::Relaxed);
        if left == 0 || self.dead.load(Ordering::Relaxed) {
            self.dead.store(true, Ordering::SeqCst);
            panic!("state memory: the device process dies here (test)");
        }
        if left != u64::MAX {
            self.left.store(left - 1, Ordering::Relaxed);
        }
    }
}

const ASQ: u64 = 0x10000;
const ACQ: u64 = 0x11000;
const SQ1: u64 = 0x12000;
const CQ1: u64 = 0x13000;
/// A second I/O SQ, on CQ 1 too (`random_script`).
const SQ2: u64 = 0x16000;
const DATA: u64 = 0x40000;
const DBBUF: u64 = 0x14000;
const EVIDX: u64 = 0x15000;
const AQ: u16 = 8;
const SQS: u16 = 4;
const CQS: u16 = 8;

/// The cid of the entries a driver overwrote after they were consumed.
const POISON_CID: u16 = 0xfffe;

/// A command's expected status, and for a read, its buffer and the pattern it must find.
type Want = (u16, Option<(u64, u8)>);

struct Drv {
    cfg: NvmeConfig,
    n: Option<Nvme>,
    kill: Arc<Kill>,
    ram: GuestMemoryMmap,
    state: StateMemory,
    /// Its length (the words, then the ram namespaces' data).
    len: usize,
    /// (tail, queue gpa, size) per SQ; (head, phase, gpa, size) per CQ.
    sq: [(u16, u64, u16); 3],
    cq: [(u16, u32, u64, u16); 2],
    cid: u16,
    /// (sqid, cid) -> (expected status, what a read must find: (buffer, pattern)).
    out: HashMap<(u16, u16), Want>,
    /// (sqid, cid) -> the SQ index of its entry.
    at: HashMap<(u16, u16), u16>,
    /// Per SQ, the first entry not known consumed: those before it the
    /// driver overwrites with `POISON` (a command no one submitted).
    consumed: [u16; 3],
    /// The SQ `io` puts its commands in.
    io_sq: usize,
    completed: u64,
    deaths: u64,
    /// The (namespace, LBA) -> pattern byte the completed writes left.
    disk: HashMap<(u32, u64), u8>,
    /// Shadow doorbells configured (Doorbell Buffer Config).
    shadow: bool,
    /// Deaths left for `restart` to arm, and where (random).
    rng: Option<(crate::nvme::oracle::Rng, u32)>,
    /// bar, bar-adaptive, auto: BAR0's doorbell page, as the host maps it
    /// into the guest (the driver's doorbell stores land there).
    page: Option<Page>,
}

/// A controller's doorbell page (`mapped_areas`), mapped as a VMM maps it.
struct Page {
    area: crate::MappedArea,
    map: GuestMemoryMmap,
}

impl Page {
    fn of(n: &Nvme) -> Option<Page> {
        let area = n.mapped_areas().into_iter().next()?;
        let fo = vm_memory::FileOffset::new(area.fd.try_clone().unwrap(), area.fd_offset);
        let r = vm_memory::MmapRegion::from_file(fo, area.size as usize).unwrap();
        let map = GuestMemoryMmap::from_regions(vec![vm_memory::GuestRegionMmap::new(r, GuestAddress(0)).unwrap()]);
        Some(Page { area, map: map.unwrap() })
    }

    /// What `self` holds now, into `to` (as the vfio-user proxy carries a
    /// dead process's page to the next one's before it resumes).
    fn carry(&self, to: &Page) {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; self.area.size as usize];
        self.area.fd.read_exact_at(&mut b, self.area.fd_offset).unwrap();
        to.area.fd.write_all_at(&b, to.area.fd_offset).unwrap();
    }
}

impl Drv {
    fn new(cfg: NvmeConfig, kill_at: u64) -> Drv {
        let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let n = Nvme::new(cfg.clone()).unwrap();
        let len = n.state_len().unwrap();
        if !cfg.ns_list().iter().any(|n| n.backend == StorageKind::Ram) {
            assert_eq!(len, LEN);
        }
        let state = StateMemory::create(len).unwrap();
        n.attach(DeviceContext::detached(ram.clone()));
        n.adopt_state(StateMemory::from_fd(state.try_clone_fd().unwrap(), len).unwrap(), false).unwrap();
        let kill = Arc::new(Kill { left: AtomicU64::new(kill_at), dead: AtomicBool::new(false), stores: 0.into() });
        crate::lock(&n.core).rec.as_mut().unwrap().kill = Some(kill.clone());
        Drv {
            cfg,
            n: Some(n),
            kill,
            ram,
            state,
            len,
            sq: [(0, ASQ, AQ), (0, SQ1, SQS), (0, SQ2, SQS)],
            cq: [(0, 1, ACQ, AQ), (0, 1, CQ1, CQS)],
            cid: 0,
            out: HashMap::new(),
            at: HashMap::new(),
            consumed: [0; 3],
            io_sq: 1,
            completed: 0,
            deaths: 0,
            disk: HashMap::new(),
            shadow: false,
            rng: None,
            page: None,
        }
        .with_page()
    }

    fn with_page(mut self) -> Drv {
        self.page = Page::of(self.n.as_ref().unwrap());
        self
    }

    /// The dead controller leaked (nothing of it runs again), a new one on
    /// the same RAM, storage and state memory, resumed.
    fn restart(&mut self, next_kill: u64) {
        std::mem::forget(self.n.take());
        // Its files stay open, leaked: no wait for them (`block/fence.rs`).
        crate::block::fence::PREDECESSOR_LEAKED.set(true);
        self.deaths += 1;
        let n = Nvme::new(self.cfg.clone()).unwrap();
        n.attach(DeviceContext::detached(self.ram.clone()));
        let page = Page::of(&n);
        if let (Some(old), Some(new)) = (&self.page, &page) {
            old.carry(new);
        }
        self.page = page;
        let mem = StateMemory::from_fd(self.state.try_clone_fd().unwrap(), self.len).unwrap();
        n.adopt_state(mem, true).unwrap();
        self.kill = Arc::new(Kill { left: AtomicU64::new(next_kill), dead: AtomicBool::new(false), stores: 0.into() });
        crate::lock(&n.core).rec.as_mut().unwrap().kill = Some(self.kill.clone());
        self.n = Some(n);
    }

    /// A BAR write, sent again to the next controller until one takes it
    /// and lives.
    fn write(&mut self, off: u64, data: &[u8]) {
        loop {
            let n = self.n.as_ref().unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| n.bar_write(0, off, data)));
            if r.is_ok() && !self.kill.dead.load(Ordering::SeqCst) {
                return;
            }
            let next = self.next_kill();
            self.restart(next);
        }
    }

    /// Random schedules: the next controller dies too, a while later.
    fn next_kill(&mut self) -> u64 {
        match &mut self.rng {
            Some((r, left)) if *left > 0 => {
                *left -= 1;
                r.below(200)
            }
            _ => u64::MAX,
        }
    }

    fn w32(&mut self, off: u64, v: u32) {
        self.write(off, &v.to_le_bytes());
    }

    /// A doorbell store: into the page where there is one (no exit), else a register write.
    fn doorbell(&mut self, off: u64, v: u32) {
        match &self.page {
            Some(p) => p.map.store(v, GuestAddress(off - DOORBELLS), Ordering::SeqCst).unwrap(),
            None => self.w32(off, v),
        }
    }

    fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        let n = self.n.as_ref().unwrap();
        if catch_unwind(AssertUnwindSafe(|| n.bar_read(0, off, &mut b))).is_err()
            || self.kill.dead.load(Ordering::SeqCst)
        {
            let next = self.next_kill();
            self.restart(next);
            return self.r32(off);
        }
        u32::from_le_bytes(b)
    }

    fn enable(&mut self) {
        self.w32(REG_AQA, ((AQ as u32) - 1) << 16 | (AQ as u32 - 1));
        self.write(REG_ASQ, &ASQ.to_le_bytes());
        self.write(REG_ACQ, &ACQ.to_le_bytes());
        self.w32(REG_CC, 0x0046_0001);
        assert_eq!(self.r32(0x1c) & 3, 1, "ready");
    }

    /// Puts a command in SQ `q` (not rung yet).
    fn put(&mut self, q: usize, op: u8, nsid: u32, prp1: u64, cdw: [u32; 4], want: Want) {
        self.cid = self.cid.wrapping_add(1);
        let mut e = [0u8; 64];
        e[0] = op;
        e[2..4].copy_from_slice(&self.cid.to_le_bytes());
        e[4..8].copy_from_slice(&nsid.to_le_bytes());
        e[24..32].copy_from_slice(&prp1.to_le_bytes());
        if op == 0x7c && q == 0 {
            e[32..40].copy_from_slice(&EVIDX.to_le_bytes()); // Doorbell Buffer Config's EventIdx page
        }
        for (i, v) in cdw.iter().enumerate() {
            e[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        let (tail, gpa, size) = self.sq[q];
        self.ram.write_slice(&e, GuestAddress(gpa + tail as u64 * 64)).unwrap();
        self.sq[q].0 = (tail + 1) % size;
        assert!(self.cid != POISON_CID, "the script ran out of command ids");
        assert!(self.out.insert((q as u16, self.cid), want).is_none(), "cid reused while outstanding");
        self.at.insert((q as u16, self.cid), tail);
    }

    /// A completion of the entry at `idx` of SQ `q` reporting head `sqhd`:
    /// the entries up to both are consumed (the head says so, and so does a
    /// completion, for the commands before it: Linux's driver reuses an
    /// entry on that alone). The driver overwrites them at once, as a
    /// driver reusing them would: a controller that reads one again finds
    /// a command that completes with a cid no one submitted.
    fn poison_consumed(&mut self, q: usize, idx: u16, sqhd: u16) {
        let (tail, gpa, size) = self.sq[q];
        let from = self.consumed[q];
        let ahead = |x: u16| (x + size - from) % size;
        let upto = ahead((idx + 1) % size).max(ahead(sqhd)).min(ahead(tail));
        let mut e = [0u8; 64];
        e[0] = 0xff;
        e[2..4].copy_from_slice(&POISON_CID.to_le_bytes());
        for k in 0..upto {
            let i = (from + k) % size;
            self.ram.write_slice(&e, GuestAddress(gpa + i as u64 * 64)).unwrap();
        }
        self.consumed[q] = (from + upto) % size;
    }

    fn ring(&mut self, q: usize) {
        let t = self.sq[q].0 as u32;
        if q > 0 && self.shadow {
            self.ram.write_obj(t, GuestAddress(DBBUF + 8 * q as u64)).unwrap();
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        self.doorbell(DOORBELLS + 8 * q as u64, t);
    }

    /// Reaps CQ `q` until nothing is outstanding on it, checking each entry.
    fn settle(&mut self, q: usize) {
        let t0 = std::time::Instant::now();
        while self.out.keys().any(|k| (k.0 as usize).min(1) == q) {
            if self.kill.dead.load(Ordering::SeqCst) {
                let next = self.next_kill();
                self.restart(next); // died on a device thread
            }
            let (head, phase, gpa, size) = self.cq[q];
            let a = gpa + head as u64 * 16;
            let dw3: u32 = self.ram.read_obj(GuestAddress(a + 12)).unwrap();
            if dw3 >> 16 & 1 != phase {
                assert!(t0.elapsed() < std::time::Duration::from_secs(10), "commands never completed: {:?}", self.out);
                std::thread::yield_now();
                continue;
            }
            let dw2: u32 = self.ram.read_obj(GuestAddress(a + 8)).unwrap();
            let key = ((dw2 >> 16) as u16, dw3 as u16);
            let Some((st, read)) = self.out.remove(&key) else {
                panic!(
                    "completion of SQ {} cid {} that is not outstanding (twice?), after {} deaths",
                    key.0, key.1, self.deaths
                )
            };
            assert_eq!((dw3 >> 17) as u16, st, "status of SQ {} cid {}", key.0, key.1);
            let idx = self.at.remove(&key).unwrap();
            self.poison_consumed(key.0 as usize, idx, dw2 as u16);
            if let Some((buf, pat)) = read {
                let mut b = [0u8; 512];
                self.ram.read_slice(&mut b, GuestAddress(buf)).unwrap();
                assert!(b.iter().all(|&x| x == pat), "read at {buf:#x} found {} not {pat}", b[0]);
            }
            self.completed += 1;
            self.cq[q].0 = (head + 1) % size;
            if self.cq[q].0 == 0 {
                self.cq[q].1 ^= 1;
            }
            let h = self.cq[q].0 as u32;
            if q > 0 && self.shadow {
                self.ram.write_obj(h, GuestAddress(DBBUF + 8 * q as u64 + 4)).unwrap();
            } else {
                self.doorbell(DOORBELLS + 8 * q as u64 + 4, h);
            }
        }
    }

    fn admin(&mut self, op: u8, prp1: u64, cdw: [u32; 4], st: u16) {
        self.put(0, op, 0, prp1, cdw, (st, None));
        self.ring(0);
        self.settle(0);
    }

    fn io_queues(&mut self) {
        self.admin(0x05, CQ1, [1 | ((CQS as u32 - 1) << 16), 1, 0, 0], 0);
        self.admin(0x01, SQ1, [1 | ((SQS as u32 - 1) << 16), 1 | 1 << 16, 0, 0], 0);
        (self.sq[1].0, self.cq[1], self.consumed[1]) = (0, (0, 1, CQ1, CQS), 0);
    }

    /// Write (pattern `pat`) or read (expects what the disk holds) of LBA
    /// `lba`, buffer `buf`.
    fn io(&mut self, write: bool, lba: u64, buf: u64, pat: u8) {
        self.io_ns(1, write, lba, buf, pat);
    }

    /// As `io`, on namespace `nsid`.
    fn io_ns(&mut self, nsid: u32, write: bool, lba: u64, buf: u64, pat: u8) {
        if write {
            self.ram.write_slice(&[pat; 512], GuestAddress(buf)).unwrap();
            self.put(self.io_sq, 0x01, nsid, buf, [lba as u32, 0, 0, 0], (0, None));
            self.disk.insert((nsid, lba), pat);
        } else {
            self.ram.write_slice(&[0xee; 512], GuestAddress(buf)).unwrap();
            let want = if self.cfg.ns_list()[nsid as usize - 1].backend == StorageKind::Null {
                None
            } else {
                Some((buf, self.disk.get(&(nsid, lba)).copied().unwrap_or(0)))
            };
            self.put(self.io_sq, 0x02, nsid, buf, [lba as u32, 0, 0, 0], (0, want));
        }
    }
}

fn cfg(backend: StorageKind) -> NvmeConfig {
    let create = matches!(backend, StorageKind::File(_));
    NvmeConfig { backend, size: 1 << 20, lba_size: 512, doorbell: DoorbellMode::Mmio, create, ..NvmeConfig::default() }
}

/// Admin commands that change state, I/O around queue deletion, a reset.
fn script(d: &mut Drv) {
    d.enable();
    d.admin(0x09, 0, [0x07, 3 | 3 << 16, 0, 0], 0); // Number of Queues
    d.io_queues();
    for round in 0..4u64 {
        for k in 0..3 {
            d.io(round % 2 == 0, k + 4 * round % 8, DATA + 0x1000 * k, (1 + round * 3 + k) as u8);
        }
        d.ring(1);
        d.settle(1);
    }
    d.admin(0x00, 0, [1, 0, 0, 0], 0); // Delete I/O SQ
    d.admin(0x04, 0, [1, 0, 0, 0], 0); // Delete I/O CQ
    d.io_queues();
    d.admin(0x01, SQ1, [1 | ((SQS as u32 - 1) << 16), 1 | 1 << 16, 0, 0], status::INVALID_QID); // exists
    for k in 0..3 {
        d.io(false, k, DATA + 0x1000 * k, 0);
    }
    d.ring(1);
    d.settle(1);
    d.admin(0x09, 0, [0x06, 0, 0, 0], 0); // volatile write cache off
    d.w32(REG_CC, 0); // disable
    assert_eq!(d.r32(0x1c) & 1, 0);
    (d.sq[0].0, d.cq[0]) = (0, (0, 1, ACQ, AQ));
    d.enable();
    d.admin(0x0a, 0, [0x06, 0, 0, 0], 0); // Get Features: write cache, back to its default
    assert!(crate::lock(&d.n.as_ref().unwrap().core).feat.write_cache);
}

#[test]
fn every_command_completes_once_whatever_store_the_process_dies_at() {
    let img = std::env::temp_dir().join(format!("iopath-nvstate-every-{}.img", std::process::id()));
    for backend in [StorageKind::Null, StorageKind::File(img.clone()), StorageKind::Ram] {
        let _ = std::fs::remove_file(&img);
        let mut d = Drv::new(cfg(backend.clone()), u64::MAX);
        script(&mut d);
        let (stores, done) = (d.kill.stores.load(Ordering::Relaxed), d.completed);
        assert!(stores > 100, "{stores} stores");
        eprintln!("{stores} stores, {done} completions");
        for at in 0..stores {
            let _ = std::fs::remove_file(&img);
            let mut d = Drv::new(cfg(backend.clone()), at);
            script(&mut d);
            assert_eq!((d.deaths, d.completed), (1, done), "death at store {at} of {stores}");
            assert!(d.out.is_empty());
        }
    }
    let _ = std::fs::remove_file(&img);
}

/// Resume reads the CQ back from its recorded tail, and the CQ is the
/// driver's memory: an entry there with the lap's phase that this
/// controller did not post (a hostile or careless guest's) names an SQ not
/// on this CQ, or a head outside its SQ. It ends the read-back (with a log
/// line): the resumed controller keeps the CQ tail and SQ head it recorded,
/// and the driver's commands go on, each completed once.
#[test]
fn a_forged_entry_in_the_cq_ends_the_read_back_and_moves_no_head() {
    // (sqid, sqhd): no such SQ; the admin SQ (on CQ 0); SQ 1 with a head past its end.
    for (sqid, sqhd) in [(7u16, 0u16), (0, 0), (1, SQS)] {
        let mut d = Drv::new(cfg(StorageKind::Null), u64::MAX);
        d.enable();
        d.io_queues();
        for k in 0..3 {
            d.io(true, k, DATA + 0x1000 * k, 1 + k as u8);
        }
        d.ring(1);
        d.settle(1);
        let (head, phase, gpa, _) = d.cq[1];
        let at = GuestAddress(gpa + head as u64 * 16);
        let mut kept = [0u8; 16];
        d.ram.read_slice(&mut kept, at).unwrap();
        let mut e = [0u8; 16];
        e[8..10].copy_from_slice(&sqhd.to_le_bytes());
        e[10..12].copy_from_slice(&sqid.to_le_bytes());
        e[12..16].copy_from_slice(&(0x1234 | phase << 16).to_le_bytes());
        d.ram.write_slice(&e, at).unwrap();
        let heads = |d: &Drv| {
            let c = crate::lock(&d.n.as_ref().unwrap().core);
            let cq = c.queues.cqs[1].as_ref().unwrap();
            (cq.tail, cq.phase, c.queues.sqs[1].as_ref().unwrap().head)
        };
        let before = heads(&d);
        d.restart(u64::MAX);
        assert_eq!(heads(&d), before, "forged SQ {sqid} head {sqhd}: the read-back took it");
        // The driver puts its entry back, and goes on.
        d.ram.write_slice(&kept, at).unwrap();
        for k in 0..3 {
            d.io(false, k, DATA + 0x1000 * k, 0);
        }
        d.ring(1);
        d.settle(1);
        assert!(d.out.is_empty() && d.completed == 3 + 3 + 2, "{} completed", d.completed);
    }
}

/// Random batches of writes and reads (distinct LBAs in flight), the
/// controller killed at random stores again and again.
fn random_script(d: &mut Drv, rounds: u64) {
    d.enable();
    if d.cfg.doorbell.shadowed() {
        d.admin(0x7c, DBBUF, [0; 4], 0);
        let n = d.n.as_ref().unwrap();
        crate::lock(&n.core).db.shadow.expect("shadow doorbells");
        d.shadow = true;
    }
    d.io_queues();
    // A second SQ on the same CQ: their completions interleave in it.
    d.admin(0x01, SQ2, [2 | ((SQS as u32 - 1) << 16), 1 | 1 << 16, 0, 0], 0);
    (d.sq[2].0, d.consumed[2]) = (0, 0);
    for _ in 0..rounds {
        let (r, _) = d.rng.as_mut().unwrap();
        let n = r.range(1, SQS as u64 - 1);
        let first = r.below(16);
        let writes: Vec<bool> = (0..n).map(|_| r.chance(60)).collect();
        let pats: Vec<u8> = (0..n).map(|_| r.range(1, 255) as u8).collect();
        let sqs: Vec<usize> = (0..n).map(|_| r.range(1, 2) as usize).collect();
        for k in 0..n {
            d.io_sq = sqs[k as usize];
            d.io(writes[k as usize], (first + k) % 16, DATA + 0x1000 * k, pats[k as usize]);
        }
        d.ring(1);
        d.ring(2);
        d.settle(1);
    }
    d.io_sq = 1;
    // Everything written reads back.
    for lba in 0..16 {
        d.io(false, lba, DATA, 0);
        d.ring(1);
        d.settle(1);
    }
}

fn transparent_restarts(backend: impl Fn() -> StorageKind, doorbell: DoorbellMode, seeds: u64) -> u64 {
    let mut deaths = 0;
    for seed in 0..seeds {
        let mut r = crate::nvme::oracle::Rng::new(seed);
        let first = r.below(200);
        let c = NvmeConfig { doorbell, ..cfg(backend()) };
        let mut d = Drv::new(c, first);
        d.rng = Some((r, 4));
        random_script(&mut d, 24);
        assert!(d.out.is_empty());
        deaths += d.deaths;
    }
    assert!(deaths >= seeds, "{deaths} deaths in {seeds} runs");
    deaths
}

#[test]
fn a_driver_goes_on_across_random_deaths_without_reinitialising_on_a_file() {
    let img = std::env::temp_dir().join(format!("iopath-nvstate-{}.img", std::process::id()));
    for mode in [DoorbellMode::Mmio, DoorbellMode::Shm] {
        let fresh = || {
            let _ = std::fs::remove_file(&img);
            StorageKind::File(img.clone())
        };
        let n = transparent_restarts(fresh, mode, 12);
        eprintln!("file, {mode}: {n} deaths");
    }
    let _ = std::fs::remove_file(&img);
}

#[test]
fn a_driver_goes_on_across_random_deaths_on_null_with_shadow_doorbells() {
    // (With no host for ioeventfds, ioeventfd and adaptive doorbells exit
    // and are served the way those modes serve an exit.)
    for mode in [DoorbellMode::Shm, DoorbellMode::Adaptive, DoorbellMode::Ioeventfd] {
        let n = transparent_restarts(|| StorageKind::Null, mode, 8);
        eprintln!("null, {mode}: {n} deaths");
    }
}

/// The doorbells in BAR0's page: the driver stores them there (no exit),
/// and each new controller gets what the dead one's page held before it
/// resumes (`Page::carry`, as the vfio-user proxy does); the page's tails
/// at the recorded heads fetch nothing again.
#[test]
fn a_driver_goes_on_across_random_deaths_with_doorbells_in_bar0s_page() {
    let img = std::env::temp_dir().join(format!("iopath-nvstate-bar-{}.img", std::process::id()));
    for mode in [DoorbellMode::Bar, DoorbellMode::BarAdaptive, DoorbellMode::Auto] {
        let n = transparent_restarts(|| StorageKind::Null, mode, 8);
        eprintln!("null, {mode}: {n} deaths");
    }
    let fresh = || {
        let _ = std::fs::remove_file(&img);
        StorageKind::File(img.clone())
    };
    let n = transparent_restarts(fresh, DoorbellMode::Bar, 8);
    eprintln!("file, bar: {n} deaths");
    let _ = std::fs::remove_file(&img);
}

#[test]
fn a_driver_goes_on_across_random_deaths_on_ram_reading_what_it_wrote_before_each() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Shm] {
        let n = transparent_restarts(|| StorageKind::Ram, mode, 10);
        eprintln!("ram, {mode}: {n} deaths");
    }
}

fn counter(d: &Drv, name: &str) -> Option<u64> {
    d.n.as_ref().unwrap().counters().into_iter().find(|c| c.name == name).map(|c| c.value)
}

/// Namespaces 1 and 3 ram (of other sizes), 2 null: each ram namespace's
/// data has its own place in the state memory after the words, and what
/// the driver wrote to each reads back from it, not the other, across
/// random deaths; then across a move into another state memory (a new
/// client's, adopted fresh while the controller serves: the data copied),
/// and a death after it. The counters say what the data takes.
#[test]
fn several_ram_namespaces_keep_their_own_data_across_deaths_and_a_move() {
    use super::super::namespaces::NsConfig;
    let ns = |backend, mb: u64| NsConfig { backend, size: mb << 20, lba_size: 512, ..NsConfig::default() };
    let c = NvmeConfig { ns: vec![ns(StorageKind::Null, 1), ns(StorageKind::Ram, 2)], ..cfg(StorageKind::Ram) };
    // Data, then an eighth for metadata (`meta.rs`), each.
    let (places, len) = crate::state::place_ram(LEN, &[Some(9 << 17), None, Some(9 << 18)]).unwrap();
    assert_eq!(Nvme::new(c.clone()).unwrap().state_len(), Some(len));
    let mut r = crate::nvme::oracle::Rng::new(5);
    let first = r.below(300);
    let mut d = Drv::new(c, first);
    d.rng = Some((r, 6));
    d.enable();
    d.io_queues();
    for round in 0..40u64 {
        let (r, _) = d.rng.as_mut().unwrap();
        let (nsid, lba, pat) = ([1, 3][r.below(2) as usize], r.below(8), r.range(1, 255) as u8);
        d.io_ns(nsid, round % 3 != 2, lba, DATA, pat);
        d.ring(1);
        d.settle(1);
    }
    let check = |d: &mut Drv| {
        for lba in 0..8 {
            for (k, nsid) in [1, 2, 3].into_iter().enumerate() {
                d.io_ns(nsid, false, lba, DATA + 0x1000 * k as u64, 0);
            }
            d.ring(1);
            d.settle(1);
        }
    };
    check(&mut d);
    assert!(d.deaths >= 1, "{} deaths", d.deaths);
    // The table names each place; the counters what the data takes.
    let w = d.state.words();
    for (i, p) in places.iter().enumerate() {
        let had = [0, 1].map(|k| w[RAM_TABLE + 2 * i + k].load(Ordering::Relaxed));
        assert_eq!(had, crate::state::RamPlace::words(*p), "namespace {}", i + 1);
    }
    assert_eq!(counter(&d, crate::state::MEMORY_BYTES), Some(len as u64));
    assert_eq!(counter(&d, crate::state::RAM_BYTES), Some((9 << 17) + (9 << 18)));
    let pages = [1, 3].iter().map(|&n| (0..8).filter(|&l| d.disk.contains_key(&(n, l))).count().min(1)).sum::<usize>();
    assert_eq!(counter(&d, crate::state::RAM_WRITTEN_BYTES), Some(pages as u64 * 4096), "LBAs 0..8: one page each");
    // A new client's state memory, fresh: the data moves in, and survives a death there.
    let next = StateMemory::create(len).unwrap();
    let mem = StateMemory::from_fd(next.try_clone_fd().unwrap(), len).unwrap();
    d.n.as_ref().unwrap().adopt_state(mem, false).unwrap();
    d.state = next;
    d.restart(u64::MAX);
    check(&mut d);
    assert_eq!(counter(&d, crate::state::RAM_WRITTEN_BYTES), Some(pages as u64 * 4096));
    let taken = d.state.allocated().unwrap();
    eprintln!("{} deaths; the state memory takes {taken} bytes of its {len}", d.deaths);
    // The words (read whole at each resume, so every page of them taken),
    // and of the ram data only the two pages written and a map page each.
    assert!(taken <= (LEN.next_multiple_of(4096) + 4 * 4096) as u64, "{taken}");
}

/// A ram table that places a namespace's data elsewhere is refused, the
/// controller untouched; put back, the data reads back.
#[test]
fn a_ram_table_of_another_layout_is_refused() {
    let mut d = Drv::new(cfg(StorageKind::Ram), u64::MAX);
    d.enable();
    d.io_queues();
    d.io(true, 3, DATA, 0x5a);
    d.ring(1);
    d.settle(1);
    let w = d.state.words();
    for (k, v) in [(0, 4096u64), (1, 512), (0, 0)] {
        let old = w[RAM_TABLE + k].swap(v, Ordering::Relaxed);
        let n = Nvme::new(cfg(StorageKind::Ram)).unwrap();
        n.attach(DeviceContext::detached(d.ram.clone()));
        let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), d.len).unwrap();
        let e = n.adopt_state(mem, true).unwrap_err().to_string();
        assert!(e.contains("resume refused") && e.contains("namespace 1's ram data"), "{e}");
        let c = crate::lock(&n.core);
        assert!(c.rec.is_none() && c.regs.csts == 0);
        assert!(matches!(&c.ns[0].storage, crate::block::Storage::Ram(r) if !r.in_state_memory()));
        drop(c);
        w[RAM_TABLE + k].store(old, Ordering::Relaxed);
    }
    d.restart(u64::MAX);
    d.io(false, 3, DATA, 0);
    d.ring(1);
    d.settle(1);
}

#[test]
fn modes_and_backends_that_cannot_resume_are_refused_with_their_reason() {
    let timed = |spec: &str| match format!("nvme,backend=null,{spec}").parse::<crate::spec::DeviceConfig>() {
        Ok(crate::spec::DeviceConfig::Nvme(c)) => c,
        other => panic!("{spec}: {other:?}"),
    };
    for (c, why) in [
        (NvmeConfig { doorbell: DoorbellMode::Shm, pollers: 2, ..cfg(StorageKind::Null) }, "pollers=2"),
        (timed("timing=read:10us"), "timing="),
    ] {
        let n = Nvme::new(c).unwrap();
        assert_eq!(n.state_len(), None);
        let e = n.adopt_state(StateMemory::create(LEN).unwrap(), false).unwrap_err().to_string();
        assert!(e.contains(why), "{e}");
    }
    let n = Nvme::new(cfg(StorageKind::Null)).unwrap();
    let e = n.adopt_state(StateMemory::create(4096).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("it needs"), "{e}");
    // A ram namespace's data needs room after the words.
    let n = Nvme::new(cfg(StorageKind::Ram)).unwrap();
    let e = n.adopt_state(StateMemory::create(LEN).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("it needs"), "{e}");
    // More ram data than a state memory holds.
    let n = Nvme::new(NvmeConfig { size: 1 << 40, ..cfg(StorageKind::Ram) }).unwrap();
    assert_eq!(n.state_len(), None);
    let e = n.adopt_state(StateMemory::create(LEN).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
}

/// A state memory a hostile client altered: refused, with the reason, and
/// the new controller is left as it was (disabled, recording nothing).
#[test]
fn a_hostile_state_memory_is_refused_and_the_controller_left_untouched() {
    let mut d = Drv::new(cfg(StorageKind::Null), u64::MAX);
    d.enable();
    d.io_queues();
    d.io(true, 0, DATA, 1);
    d.ring(1);
    d.settle(1);
    let w = d.state.words();
    let cfg_at = config_at(w[W_SELECT].load(Ordering::Relaxed));
    let cases: Vec<(usize, u64, &str)> = vec![
        (W_MAGIC, 7, "holds no NVMe state"),
        (W_SHAPE, 7, "another layout"),
        (cfg_at + CFG_SQ + 2, 1 << 40, "SQ 1 of 4 entries at 0x10000000000, not in guest RAM"),
        (cfg_at + CFG_SQ + 3, 1 << 16 | 1 << 40, "SQ 1 of 0 entries"),
        (cfg_at + CFG_SQ + 3, 4 | 9 << 16 | 1 << 40, "SQ 1 on CQ 9"),
        (cfg_at + CFG_CQ + 3, 8 | 200 << 16 | 1 << 40, "CQ 1 on vector 200"),
        (cfg_at + CFG_NS + 1, 13 | 1 << 40, "namespace 1 formatted"),
        (SQ_HEAD + 1, 4, "SQ 1 head 4"),
        (CQ_TAIL + 1, 9, "CQ 1 tail 0x9"),
        (SLOT0 + S_META, FETCHED | 7 << 8, "slot 0 of SQ 7"),
        (SLOT0 + S_META, 3 | 1 << 8, "slot 0 with state"),
        // Posting at entry 9 of CQ 1 (8 entries); a state bit no state has.
        (SLOT0 + SLOT_WORDS + S_META, POSTING | 1 << 8 | 9 << 48, "has slot 1 posting 0x9000000000102"),
        (SLOT0 + SLOT_WORDS + S_META, POSTING | 1 << 8 | 4, "has slot 1 posting 0x106"),
    ];
    for (at, v, why) in cases {
        let old = w[at].swap(v, Ordering::Relaxed);
        let n = Nvme::new(cfg(StorageKind::Null)).unwrap();
        n.attach(DeviceContext::detached(d.ram.clone()));
        let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), LEN).unwrap();
        let e = n.adopt_state(mem, true).unwrap_err().to_string();
        assert!(e.contains("resume refused") && e.contains(why), "word {at}: {e}");
        let c = crate::lock(&n.core);
        assert!(c.rec.is_none() && c.regs.csts == 0 && c.queues.sqs.iter().all(|q| q.is_none()));
        drop(c);
        w[at].store(old, Ordering::Relaxed);
    }
    // Put back, it resumes; a second resume of a serving controller is refused.
    d.restart(u64::MAX);
    let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), LEN).unwrap();
    let e = d.n.as_ref().unwrap().adopt_state(mem, true).unwrap_err().to_string();
    assert!(e.contains("already serves"), "{e}");
    d.io(false, 0, DATA, 0);
    d.ring(1);
    d.settle(1);
}

/// The fast path's cost of keeping state, measured (no assertion: speed
/// belongs in benchmarks): 512 B writes to a null namespace, 16 per SQ
/// doorbell (mmio: the controller serves them inside the doorbell write,
/// on this thread), the time spent in the doorbell writes with state kept
/// and without, alternating. `cargo test --release -p iopath-devices --lib
/// fast_path_cost -- --ignored --nocapture`
#[test]
#[ignore]
fn fast_path_cost_of_keeping_state() {
    const QD: u16 = 16;
    const SIZE: u16 = 64;
    let mut per = [Vec::new(), Vec::new()];
    for round in 0..10 {
        let keep = round % 2 == 0;
        let mut d = Drv::new(cfg(StorageKind::Null), u64::MAX);
        d.enable();
        d.admin(0x05, CQ1, [1 | ((SIZE as u32 - 1) << 16), 1, 0, 0], 0);
        d.admin(0x01, SQ1, [1 | ((SIZE as u32 - 1) << 16), 1 | 1 << 16, 0, 0], 0);
        let n = d.n.take().unwrap();
        match keep {
            // (The test's kill hook off: it counts every store.)
            true => crate::lock(&n.core).rec.as_mut().unwrap().kill = None,
            false => crate::lock(&n.core).rec = None,
        }
        let (mut tail, mut head, mut phase, mut cid) = (0u16, 0u16, 1u32, 0u16);
        let mut spent = std::time::Duration::ZERO;
        let batches = 20_000;
        for _ in 0..batches {
            for _ in 0..QD {
                cid = cid.wrapping_add(1);
                let mut e = [0u8; 64];
                e[0] = 0x01;
                e[2..4].copy_from_slice(&cid.to_le_bytes());
                e[4..8].copy_from_slice(&1u32.to_le_bytes());
                e[24..32].copy_from_slice(&DATA.to_le_bytes());
                d.ram.write_slice(&e, GuestAddress(SQ1 + tail as u64 * 64)).unwrap();
                tail = (tail + 1) % SIZE;
            }
            let t0 = std::time::Instant::now();
            n.bar_write(0, DOORBELLS + 8, &(tail as u32).to_le_bytes());
            spent += t0.elapsed();
            for _ in 0..QD {
                let dw3: u32 = d.ram.read_obj(GuestAddress(CQ1 + head as u64 * 16 + 12)).unwrap();
                assert_eq!(dw3 >> 16 & 1, phase, "completed in the doorbell write");
                assert_eq!(dw3 >> 17, 0);
                head = (head + 1) % SIZE;
                if head == 0 {
                    phase ^= 1;
                }
            }
            let t0 = std::time::Instant::now();
            n.bar_write(0, DOORBELLS + 12, &(head as u32).to_le_bytes());
            spent += t0.elapsed();
        }
        per[keep as usize].push(spent.as_nanos() as f64 / (batches * QD as u64) as f64);
        if keep {
            // Each I/O command completed before the next was fetched: only
            // the two admin commands' entries were copied.
            let c = crate::lock(&n.core).state_counters();
            assert_eq!(c.iter().find(|c| c.name == "state.entries-copied").map(|c| c.value), Some(2), "{c:?}");
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (off, on) = (med(&mut per[0]), med(&mut per[1]));
    eprintln!(
        "device time per 512 B write, QD16, null, mmio: state off {off:.0} ns, on {on:.0} ns ({:+.1}%); runs off {:?} on {:?}",
        (on / off - 1.0) * 100.0,
        per[0].iter().map(|x| *x as u64).collect::<Vec<_>>(),
        per[1].iter().map(|x| *x as u64).collect::<Vec<_>>()
    );
}
