//! The publication order under death at every store, as NVMe's
//! `state/tests.rs` checks its own: a driver that never re-initialises the
//! device (except where its script resets it) sets virtio-blk up with MSI-X
//! and runs batches of writes, reads and flushes on a file disk; the
//! device "dies" (a panic at its Nth store into the state memory, its
//! registers' words or its in-flight region, on whatever thread makes it,
//! resuming included; its object is leaked, no cleanup runs), a new device
//! adopts the same state memory with `resume`, the BAR or configuration
//! write the dead one did not acknowledge is sent again (as a vfio-user
//! client replays it), and the driver goes on. The oracle is the driver's
//! book: every request completes exactly once (a used element for a head
//! not outstanding fails), with S_OK and the used length its kind gives,
//! every read returns what the writes completed before it left, and the
//! disk holds every write at the end.

use super::*;
use crate::block::StorageKind;
use crate::rng::SplitMix64;
use crate::virtio::blk::{S_OK, T_FLUSH, T_IN, T_OUT};
use crate::virtio::fake::{Driver, AVAIL, DATA, DESC, RAM, USED};
use crate::virtio::pci::{
    NotifyMode, VirtioBlk, VirtioBlkConfig, COMMON, F_EVENT_IDX, F_FLUSH, F_VERSION_1, NOTIFY, S_ACKNOWLEDGE, S_DRIVER,
    S_FEATURES_OK,
};
use crate::{DeviceContext, DeviceModel};
use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64};
use vm_memory::{Bytes, GuestAddress};

/// Where a device dies: after `left` more stores (u64::MAX: never).
struct Kill {
    left: AtomicU64,
    dead: AtomicBool,
    stores: AtomicU64,
}

impl Kill {
    fn new(left: u64) -> Arc<Kill> {
        Arc::new(Kill { left: left.into(), dead: false.into(), stores: 0.into() })
    }

    fn store(&self) {
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

thread_local! {
    /// The kill hook the next recorder made on this thread takes (a device
    /// may die inside its own resume).
    pub(super) static NEXT_KILL: RefCell<Option<Arc<dyn Fn() + Send + Sync>>> = const { RefCell::new(None) };
}

/// Counts MSI-X signals (the device's table rules: a masked vector is pending).
#[derive(Default)]
struct Irqs {
    msix: AtomicU64,
}
impl crate::Interrupts for Irqs {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        self.msix.fetch_add(1, Ordering::SeqCst);
        true
    }
}

const QS: u16 = 16;
/// Requests in flight at most: three descriptors each.
const SLOTS: u16 = 5;
const BUF: u64 = 0x20000;
const SECTORS: u64 = 24;

/// An outstanding request: kind, and for a read the sector's pattern it must find.
type Want = (u32, Option<u8>);

struct Drv {
    cfg: VirtioBlkConfig,
    dev: Option<VirtioBlk>,
    kill: Arc<Kill>,
    d: Driver,
    irqs: Arc<Irqs>,
    state: StateMemory,
    /// Its length (the words, then a ram disk's data).
    len: usize,
    seen_used: u16,
    /// head -> what it must complete with.
    out: HashMap<u16, Want>,
    completed: u64,
    deaths: u64,
    /// Resumes during which the device died again.
    deaths_in_resume: u64,
    /// sector -> pattern byte the completed writes left.
    disk: HashMap<u64, u8>,
    /// The driver enabled MSI-X with the queue's vector unmasked.
    msix_on: bool,
    /// Random deaths (after a random number of stores), at most this many more.
    rng: Option<(SplitMix64, u32)>,
    /// The first death's store, for `new`'s caller.
    first: u64,
    /// Writes made available and not yet completed: (sector, pattern).
    pending_writes: Vec<(u64, u8)>,
}

impl Drv {
    fn new(cfg: VirtioBlkConfig, kill_at: u64) -> Drv {
        let d = Driver::new(QS);
        let irqs = Arc::new(Irqs::default());
        let dev = VirtioBlk::new(cfg.clone()).unwrap();
        let n = dev.state_len().unwrap();
        if cfg.backend != StorageKind::Ram {
            assert_eq!(n, len(1));
        }
        let mut ctx = DeviceContext::detached(d.mem.clone());
        ctx.irq = irqs.clone();
        dev.attach(ctx);
        let state = StateMemory::create(n).unwrap();
        dev.adopt_state(StateMemory::from_fd(state.try_clone_fd().unwrap(), n).unwrap(), false).unwrap();
        let kill = Kill::new(kill_at);
        let k = kill.clone();
        crate::lock(dev.shared()).t.rec.as_mut().unwrap().set_kill(Arc::new(move || k.store()));
        Drv {
            cfg,
            dev: Some(dev),
            kill,
            d,
            irqs,
            state,
            len: n,
            seen_used: 0,
            out: HashMap::new(),
            completed: 0,
            deaths: 0,
            deaths_in_resume: 0,
            disk: HashMap::new(),
            msix_on: false,
            rng: None,
            first: kill_at,
            pending_writes: Vec::new(),
        }
    }

    fn dev(&self) -> &VirtioBlk {
        self.dev.as_ref().unwrap()
    }

    fn next_kill(&mut self) -> u64 {
        match &mut self.rng {
            Some((r, left)) if *left > 0 => {
                *left -= 1;
                // Now and then within the next few stores: inside the resume.
                if r.below(4) == 0 {
                    r.below(6)
                } else {
                    r.below(120)
                }
            }
            _ => u64::MAX,
        }
    }

    /// The dead device leaked (nothing of it runs again), a new one on the
    /// same RAM, disk and state memory, resumed (and it may die in its
    /// resume: then another).
    fn restart(&mut self) {
        loop {
            std::mem::forget(self.dev.take());
            // Its files stay open, leaked: no wait for them (`block/fence.rs`).
            crate::block::fence::PREDECESSOR_LEAKED.set(true);
            self.deaths += 1;
            let dev = VirtioBlk::new(VirtioBlkConfig { create: false, ..self.cfg.clone() }).unwrap();
            let mut ctx = DeviceContext::detached(self.d.mem.clone());
            ctx.irq = self.irqs.clone();
            dev.attach(ctx);
            let mem = StateMemory::from_fd(self.state.try_clone_fd().unwrap(), self.len).unwrap();
            let next = self.next_kill();
            let kill = Kill::new(next);
            let k = kill.clone();
            NEXT_KILL.with(|n| *n.borrow_mut() = Some(Arc::new(move || k.store())));
            let before = self.irqs.msix.load(Ordering::SeqCst);
            let r = catch_unwind(AssertUnwindSafe(|| dev.adopt_state(mem, true)));
            NEXT_KILL.with(|n| *n.borrow_mut() = None);
            self.kill = kill;
            self.dev = Some(dev);
            match r {
                Ok(Ok(())) if !self.kill.dead.load(Ordering::SeqCst) => {
                    // Every vector in use signalled once (a queue served already may have signalled too).
                    let live = self.bar_read(COMMON + 0x14, 1) as u8 & S_DRIVER_OK != 0;
                    if live && self.msix_on {
                        assert!(self.irqs.msix.load(Ordering::SeqCst) > before, "no vector signalled on resume");
                    }
                    return;
                }
                Ok(Err(e)) => panic!("resume refused after {} deaths: {e}", self.deaths),
                _ => self.deaths_in_resume += 1,
            }
        }
    }

    fn bar_read(&self, off: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev().bar_read(0, off, &mut b[..len]);
        u64::from_le_bytes(b)
    }

    /// A BAR write, sent again to the next device until one takes it and lives.
    fn w(&mut self, off: u64, v: u64, len: usize) {
        self.until_taken(|d| d.bar_write(0, off, &v.to_le_bytes()[..len]));
    }

    fn until_taken(&mut self, f: impl Fn(&VirtioBlk)) {
        loop {
            let dev = self.dev.as_ref().unwrap();
            let r = catch_unwind(AssertUnwindSafe(|| f(dev)));
            if r.is_ok() && !self.kill.dead.load(Ordering::SeqCst) {
                return;
            }
            self.restart();
        }
    }

    /// 3.1.1 with MSI-X: vector 0 for configuration changes, 1 for the queue.
    fn init(&mut self) {
        self.w(COMMON + 0x14, 0, 1);
        self.w(COMMON + 0x14, S_ACKNOWLEDGE as u64, 1);
        self.w(COMMON + 0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
        let features = F_VERSION_1 | F_EVENT_IDX | F_FLUSH;
        for sel in 0..2u64 {
            self.w(COMMON + 0x08, sel, 4);
            self.w(COMMON + 0x0c, (features >> (32 * sel)) & 0xffff_ffff, 4);
        }
        self.w(COMMON + 0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK) as u64, 1);
        assert_ne!(self.bar_read(COMMON + 0x14, 1) as u8 & S_FEATURES_OK, 0);
        for v in 0..2u64 {
            self.w(MSIX_TABLE + 16 * v, 0xfee0_0000, 4);
            self.w(MSIX_TABLE + 16 * v + 8, 0x40 + v, 4);
            self.w(MSIX_TABLE + 16 * v + 12, 0, 4);
        }
        let cap = MSIX_CAP;
        self.until_taken(|d| d.config_write(cap + 3, &[0x80]));
        self.msix_on = true;
        self.w(COMMON + 0x10, 0, 2);
        self.w(COMMON + 0x16, 0, 2);
        self.w(COMMON + 0x18, QS as u64, 2);
        self.w(COMMON + 0x1a, 1, 2);
        self.w(COMMON + 0x20, DESC, 8);
        self.w(COMMON + 0x28, AVAIL, 8);
        self.w(COMMON + 0x30, USED, 8);
        self.w(COMMON + 0x1c, 1, 2);
        self.w(COMMON + 0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK) as u64, 1);
        assert_eq!(self.bar_read(COMMON + 0x1c, 2), 1, "queue enabled");
    }

    /// Resets the device and forgets the rings (the driver starts over).
    fn reset(&mut self) {
        assert!(self.out.is_empty());
        self.w(COMMON + 0x14, 0, 1);
        assert_eq!(self.bar_read(COMMON + 0x14, 1), 0);
        self.msix_on = false;
        self.d.avail_idx = 0;
        self.d.w16(AVAIL + 2, 0);
        self.d.w16(USED + 2, 0);
        self.seen_used = 0;
    }

    /// Request slot `k` (head 3k): a write of `pat` to `sector`, a read of
    /// it, or a flush; made available (not notified).
    fn put(&mut self, k: u16, kind: u32, sector: u64, pat: u8) {
        let head = 3 * k;
        let (hdr_at, st_at, buf) = (DATA + 0x100 * k as u64, DATA + 0x100 * k as u64 + 0x80, BUF + 0x1000 * k as u64);
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        self.d.ram.write_slice(&hdr, GuestAddress(hdr_at)).unwrap();
        self.d.ram.write_obj(0xaau8, GuestAddress(st_at)).unwrap();
        let want = match kind {
            T_OUT => {
                self.d.ram.write_slice(&[pat; 512], GuestAddress(buf)).unwrap();
                self.d.chain(head, &[(hdr_at, 16, false), (buf, 512, false), (st_at, 1, true)]);
                None
            }
            T_IN => {
                self.d.ram.write_slice(&[0xee; 512], GuestAddress(buf)).unwrap();
                self.d.chain(head, &[(hdr_at, 16, false), (buf, 512, true), (st_at, 1, true)]);
                Some(self.disk.get(&sector).copied().unwrap_or(0))
            }
            _ => {
                self.d.chain(head, &[(hdr_at, 16, false), (st_at, 1, true)]);
                None
            }
        };
        assert!(self.out.insert(head, (kind, want)).is_none(), "head reused while outstanding");
        if kind == T_OUT {
            self.pending_writes.push((sector, pat));
        }
        self.d.publish(head);
    }

    /// Notifies the queue and checks every used element it brought.
    fn kick_and_reap(&mut self) {
        self.w(NOTIFY, 0, 2);
        let used = self.d.used_idx();
        while self.seen_used != used {
            let (id, len) = self.d.used_elem(self.seen_used);
            let head = id as u16;
            let Some((kind, want)) = self.out.remove(&head) else {
                panic!("head {head} completed but not outstanding (twice?), after {} deaths", self.deaths)
            };
            let k = head / 3;
            let st: u8 = self.d.ram.read_obj(GuestAddress(DATA + 0x100 * k as u64 + 0x80)).unwrap();
            assert_eq!(st, S_OK, "status of head {head} (kind {kind})");
            assert_eq!(len, if kind == T_IN { 513 } else { 1 }, "used length of head {head}");
            if let Some(pat) = want {
                let mut b = [0u8; 512];
                self.d.ram.read_slice(&mut b, GuestAddress(BUF + 0x1000 * k as u64)).unwrap();
                assert!(b.iter().all(|&x| x == pat), "read of head {head} found {} not {pat}", b[0]);
            }
            self.completed += 1;
            self.seen_used = self.seen_used.wrapping_add(1);
        }
        assert!(self.out.is_empty(), "not completed: {:?} (after {} deaths)", self.out, self.deaths);
        for (s, p) in std::mem::take(&mut self.pending_writes) {
            self.disk.insert(s, p);
        }
    }
}

fn cfg(img: &std::path::Path) -> VirtioBlkConfig {
    VirtioBlkConfig {
        backend: StorageKind::File(img.to_path_buf()),
        size: 1 << 20,
        notify: NotifyMode::Exit,
        queues: Some(1),
        create: true,
        direct: false,
        ..VirtioBlkConfig::default()
    }
}

/// Batches of distinct sectors (writes, reads, a flush), a reset and a
/// second set-up half way, then every sector read back.
fn script(d: &mut Drv, rounds: u64, seed: u64) {
    let mut r = SplitMix64(seed);
    d.init();
    for round in 0..rounds {
        if round == rounds / 2 {
            d.reset();
            d.init();
        }
        let n = 1 + r.next_u64() % SLOTS as u64;
        let first = r.next_u64() % SECTORS;
        for k in 0..n {
            let kind = match r.next_u64() % 10 {
                0 => T_FLUSH,
                x if x < 6 => T_OUT,
                _ => T_IN,
            };
            d.put(k as u16, kind, (first + k) % SECTORS, 1 + (r.next_u64() % 254) as u8);
        }
        d.kick_and_reap();
    }
    for s in 0..SECTORS {
        d.put((s % SLOTS as u64) as u16, T_IN, s, 0);
        if s % SLOTS as u64 == SLOTS as u64 - 1 || s == SECTORS - 1 {
            d.kick_and_reap();
        }
    }
}

fn img(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("iopath-vblkstate-{name}-{}.img", std::process::id()))
}

/// A ram disk of `cfg`'s size (its data in the state memory).
fn ram(img: &std::path::Path) -> VirtioBlkConfig {
    VirtioBlkConfig { backend: StorageKind::Ram, create: false, ..cfg(img) }
}

#[test]
fn every_request_completes_once_whatever_store_the_process_dies_at() {
    let img = img("every");
    for make in [cfg, ram] {
        let _ = std::fs::remove_file(&img);
        let mut d = Drv::new(make(&img), u64::MAX);
        script(&mut d, 12, 7);
        let (stores, done) = (d.kill.stores.load(Ordering::Relaxed), d.completed);
        assert_eq!(d.deaths, 0);
        assert!(stores > 100, "{stores} stores");
        let mut resubmitted = 0;
        for at in 0..stores {
            let _ = std::fs::remove_file(&img);
            let mut d = Drv::new(make(&img), at);
            script(&mut d, 12, 7);
            assert_eq!((d.deaths, d.completed), (1, done), "death at store {at} of {stores}");
            resubmitted += counter(d.dev(), "resubmitted");
        }
        let b = &d.cfg.backend;
        eprintln!(
            "{b:?}: {stores} stores, {done} completions a run; {resubmitted} requests re-executed over {stores} deaths"
        );
        assert!(resubmitted > 0, "no death left a request in flight");
    }
    let _ = std::fs::remove_file(&img);
}

fn counter(dev: &VirtioBlk, name: &str) -> u64 {
    dev.counters().iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

#[test]
fn a_driver_goes_on_across_random_deaths_including_deaths_inside_a_resume() {
    random_deaths(cfg, "random");
}

#[test]
fn a_driver_goes_on_across_random_deaths_on_a_ram_disk_reading_what_it_wrote_before_each() {
    random_deaths(ram, "random-ram");
}

fn random_deaths(make: fn(&std::path::Path) -> VirtioBlkConfig, name: &str) {
    let img = img(name);
    let (mut deaths, mut in_resume) = (0, 0);
    for seed in 0..24 {
        let _ = std::fs::remove_file(&img);
        let mut r = SplitMix64(seed ^ 0x5eed);
        let first = r.next_u64() % 200;
        let mut d = Drv::new(make(&img), first);
        d.rng = Some((r, 6));
        script(&mut d, 16, seed);
        assert!(d.out.is_empty());
        assert_eq!(d.first, first);
        deaths += d.deaths;
        in_resume += d.deaths_in_resume;
    }
    eprintln!("{deaths} deaths, {in_resume} of them inside a resume");
    assert!(deaths >= 24 && in_resume > 0, "{deaths} deaths, {in_resume} inside a resume");
    let _ = std::fs::remove_file(&img);
}

#[test]
fn configurations_that_cannot_resume_are_refused_with_their_reason() {
    let img = img("refused");
    let timing = "read:80us".parse().unwrap();
    let dev = VirtioBlk::new(VirtioBlkConfig { timing: Some(Box::new(timing)), ..cfg(&img) }).unwrap();
    assert_eq!(dev.state_len(), None);
    let e = dev.adopt_state(StateMemory::create(len(1)).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("timing= and inject="), "{e}");
    let dev = VirtioBlk::new(cfg(&img)).unwrap();
    let e = dev.adopt_state(StateMemory::create(4096).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("it needs"), "{e}");
    // A ram disk's data needs room after the words; more than a state memory holds is refused.
    let dev = VirtioBlk::new(ram(&img)).unwrap();
    let e = dev.adopt_state(StateMemory::create(len(1)).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("it needs"), "{e}");
    let dev = VirtioBlk::new(VirtioBlkConfig { size: 1 << 40, ..ram(&img) }).unwrap();
    assert_eq!(dev.state_len(), None);
    let e = dev.adopt_state(StateMemory::create(len(1)).unwrap(), false).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
    let _ = std::fs::remove_file(&img);
}

/// A ram disk: its data after the words (`W_RAM` says where), what the
/// driver wrote reads back across a death, a place of another layout is
/// refused (the device untouched), a move into another state memory (a
/// new client's, adopted fresh) copies the data, which survives a death
/// there; the counters say what the data takes.
#[test]
fn a_ram_disk_keeps_its_data_in_place_across_deaths_and_moves_with_a_fresh_state_memory() {
    let img = img("ram");
    let mut d = Drv::new(ram(&img), u64::MAX);
    let (places, n) = crate::state::place_ram(len(1), &[Some(1 << 20)]).unwrap();
    assert_eq!(d.len, n);
    d.init();
    for s in 0..SLOTS as u64 {
        d.put(s as u16, T_OUT, 2 * s, 0x30 + s as u8);
    }
    d.kick_and_reap();
    let w = d.state.words();
    assert_eq!([w[W_RAM].load(Ordering::Relaxed), w[W_RAM + 1].load(Ordering::Relaxed)], RamPlace::words(places[0]));
    let c = |d: &Drv, n| counter(d.dev(), n);
    assert_eq!((c(&d, crate::state::MEMORY_BYTES), c(&d, crate::state::RAM_BYTES)), (n as u64, 1 << 20));
    assert_eq!(c(&d, crate::state::RAM_WRITTEN_BYTES), 2 * 4096, "sectors 0..10: pages 0 and 1");
    for (k, v) in [(W_RAM, 0), (W_RAM + 1, 4096), (W_RAM, 1 << 30)] {
        let old = w[k].swap(v, Ordering::Relaxed);
        let dev = VirtioBlk::new(ram(&img)).unwrap();
        dev.attach(DeviceContext::detached(d.d.mem.clone()));
        let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), d.len).unwrap();
        let e = dev.adopt_state(mem, true).unwrap_err().to_string();
        assert!(e.contains("resume refused") && e.contains("ram data at byte"), "{e}");
        let s = crate::lock(dev.shared());
        assert!(s.t.rec.is_none() && s.t.status == 0);
        drop(s);
        w[k].store(old, Ordering::Relaxed);
    }
    let read_back = |d: &mut Drv| {
        for s in 0..SLOTS as u64 {
            d.put(s as u16, T_IN, 2 * s, 0);
        }
        d.kick_and_reap();
    };
    d.restart();
    read_back(&mut d);
    // A new client's state memory, fresh: the data moves in and survives a death there.
    let next = StateMemory::create(n).unwrap();
    let mem = StateMemory::from_fd(next.try_clone_fd().unwrap(), n).unwrap();
    d.dev().adopt_state(mem, false).unwrap();
    d.state = next;
    d.restart();
    read_back(&mut d);
    assert_eq!(c(&d, crate::state::RAM_WRITTEN_BYTES), 2 * 4096);
    let taken = d.state.allocated().unwrap();
    eprintln!("the state memory takes {taken} bytes of its {n}");
    assert!(taken <= (len(1).next_multiple_of(4096) + 3 * 4096) as u64, "the words, two pages and the map's: {taken}");
}

/// A state memory a hostile client altered: refused with the reason, and
/// the new device left as it was (reset, recording nothing).
#[test]
fn a_corrupted_state_memory_is_refused_and_the_device_left_untouched() {
    let img = img("hostile");
    let _ = std::fs::remove_file(&img);
    let mut d = Drv::new(cfg(&img), u64::MAX);
    d.init();
    d.put(0, T_OUT, 3, 9);
    d.put(1, T_IN, 4, 0);
    d.kick_and_reap();
    let w = d.state.words();
    let q = W_QUEUE;
    let region = region_at(0) / 8;
    let qword = w[q].load(Ordering::Relaxed);
    let cases: Vec<(usize, u64, &str)> = vec![
        (W_MAGIC, 7, "holds no virtio state"),
        (W_SHAPE, 7, "another layout"),
        (W_DEV, w[W_DEV].load(Ordering::Relaxed) | 99 << 16, "configuration vector 99"),
        (W_FEAT, 1 << 40 | F_VERSION_1, "not within those offered"),
        (q, qword & !0xffff | 3, "queue 0 of size 3"),
        (q, qword | 200 << 32, "queue 0 word"),
        (q + 1, RAM - 16, "queue 0's rings where they cannot be"),
        (region + 1, 7, "version 7"),
        (region + 2 + 2 * 20, 1, "entry 20 set, past the queue size 16"),
        (W_AVAIL, 9, "last available index 0x9"),
        (region + 1, w[region + 1].load(Ordering::Relaxed) & !(0xffff << 48), "used index 0 noted, its used ring 2"),
    ];
    for (at, v, why) in cases {
        let old = w[at].swap(v, Ordering::Relaxed);
        let dev = VirtioBlk::new(VirtioBlkConfig { create: false, ..cfg(&img) }).unwrap();
        dev.attach(DeviceContext::detached(d.d.mem.clone()));
        let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), len(1)).unwrap();
        let e = dev.adopt_state(mem, true).unwrap_err().to_string();
        assert!(e.contains("resume refused") && e.contains(why), "word {at}: {e}");
        let s = crate::lock(dev.shared());
        assert!(s.t.rec.is_none() && s.t.status == 0 && s.t.queues.iter().all(|q| !q.ring.ready), "word {at}");
        drop(s);
        w[at].store(old, Ordering::Relaxed);
    }
    // Put back, it resumes and goes on; a second adopt is refused.
    d.restart();
    let mem = StateMemory::from_fd(d.state.try_clone_fd().unwrap(), len(1)).unwrap();
    let e = d.dev().adopt_state(mem, true).unwrap_err().to_string();
    assert!(e.contains("keeps its state already"), "{e}");
    d.put(2, T_IN, 3, 0);
    d.kick_and_reap();
    let _ = std::fs::remove_file(&img);
}
