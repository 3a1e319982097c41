//! `bar-adaptive`: the doorbell page polled while work comes, trapped (or
//! looked at in timed steps) once idle, and no submission lost in between.

use super::*;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::RwLock;
use std::time::{Duration, Instant};

fn cfg() -> NvmeConfig {
    NvmeConfig { doorbell: DoorbellMode::BarAdaptive, ..mmio(StorageKind::Null) }
}

/// A host that maps the doorbell page into the guest and traps it on
/// request, as the VMM does with a memslot: while trapped, a guest store to
/// the page exits (`bar_write`); otherwise it lands in the page. The lock
/// orders each store and each trap change one before the other, as KVM's
/// memslot update does (a store decided to exit is served afterwards,
/// outside it, as an exit is).
struct TrapHost {
    can: bool,
    /// Tests: a trap waits here before it takes effect (`Gate::hold`), so a
    /// store can land in the page in that window, as one may while KVM's
    /// memslot update is under way; the poller's look after it must find it.
    gate: Option<Gate>,
    trapped: RwLock<bool>,
    traps: AtomicU64,
    untraps: AtomicU64,
}

impl TrapHost {
    fn new(can: bool) -> Arc<TrapHost> {
        TrapHost::with_gate(can, None)
    }
    fn with_gate(can: bool, gate: Option<Gate>) -> Arc<TrapHost> {
        let (traps, untraps) = (AtomicU64::new(0), AtomicU64::new(0));
        Arc::new(TrapHost { can, gate, trapped: RwLock::new(false), traps, untraps })
    }
    fn trapped(&self) -> bool {
        *self.trapped.read().unwrap()
    }
}

impl crate::IoEvents for TrapHost {
    fn register(&self, _: crate::IoEventSpec, _: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        Err(crate::Error::Host("no ioeventfds here".into()))
    }
    fn unregister(&self, _: crate::IoEventSpec, _: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        Ok(())
    }
    fn trap_area(&self, bar: u8, offset: u64, trap: bool) -> bool {
        assert_eq!((bar, offset), (0, DOORBELLS), "the doorbell page is the area");
        if !self.can {
            return false;
        }
        if let (true, Some(g)) = (trap, &self.gate) {
            self.gated_trap(g);
            return true;
        }
        *self.trapped.write().unwrap() = trap;
        let n = if trap { &self.traps } else { &self.untraps };
        n.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// Where a trap can be held before it takes effect: the test asks for it
/// (`Want`), the next trap waits there (`Armed`) until the test says `Go`.
#[derive(Default)]
struct Gate(std::sync::Mutex<GateState>, std::sync::Condvar);

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum GateState {
    /// Traps take effect at once.
    #[default]
    Pass,
    Want,
    Armed,
    Go,
}

impl TrapHost {
    /// The poller's trap, through the gate: a wanted one waits for the test;
    /// either way it takes effect with the gate's lock held, so that the
    /// test sees it taken or knows the next one will wait.
    fn gated_trap(&self, g: &Gate) {
        let mut st = g.0.lock().unwrap();
        if *st == GateState::Want {
            *st = GateState::Armed;
            g.1.notify_all();
            st = g.1.wait_timeout_while(st, Duration::from_secs(5), |s| *s == GateState::Armed).unwrap().0;
            *st = GateState::Pass;
        }
        *self.trapped.write().unwrap() = true;
        self.traps.fetch_add(1, Ordering::Relaxed);
    }

    /// The test's side: holds the poller's next trap, runs `store` while it
    /// waits (the page still mapped), then lets it take effect. A poller
    /// asleep with the page trapped is woken first with an exit.
    fn while_trap_is_held(&self, d: &mut Drv, store: impl FnOnce(&mut Drv)) {
        let g = self.gate.as_ref().expect("a gated host");
        let asleep = {
            let mut st = g.0.lock().unwrap();
            *st = GateState::Want;
            self.trapped()
        };
        if asleep {
            let head = d.iohead as u32;
            d.w32(DOORBELLS + 12, head); // the CQ head again: an exit that wakes it
        }
        let st = g.0.lock().unwrap();
        let (mut st, to) = g.1.wait_timeout_while(st, Duration::from_secs(5), |s| *s != GateState::Armed).unwrap();
        assert!(!to.timed_out(), "the idle poller never armed");
        store(d);
        *st = GateState::Go;
        g.1.notify_all();
    }
}

/// The controller's doorbell page as the guest sees it where it is mapped.
struct Page(vm_memory::MmapRegion);

impl Page {
    fn of(n: &Nvme) -> Page {
        let a = n.mapped_areas().pop().expect("bar-adaptive shares its doorbell page");
        assert_eq!((a.bar, a.offset, a.size), (0, DOORBELLS, 0x1000));
        let fo = vm_memory::FileOffset::new(a.fd, a.fd_offset);
        Page(vm_memory::MmapRegion::from_file(fo, 0x1000).unwrap())
    }
    fn word(&self, off: u64) -> &AtomicU32 {
        assert!(off < 0x1000 && off.is_multiple_of(4));
        // SAFETY: an aligned word inside the 4 KiB mapping this Page owns.
        unsafe { &*(self.0.as_ptr().add(off as usize) as *const AtomicU32) }
    }
}

/// A guest doorbell store at `off` in the page: into memory, or (trapped) an exit.
fn ring(d: &mut Drv, host: &TrapHost, page: &Page, off: u64, v: u32) -> bool {
    {
        let t = host.trapped.read().unwrap();
        if !*t {
            page.word(off).store(v, Ordering::Release);
            return false;
        }
    }
    d.w32(DOORBELLS + off, v);
    true
}

/// A read put in I/O queue 1's SQ (`size` entries), not rung: the new tail.
fn put_read(d: &mut Drv, size: u16) -> u32 {
    let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
    d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
    d.iotail = (d.iotail + 1) % size;
    d.iotail as u32
}

/// A bar-adaptive controller on `host`, its doorbell page as the guest
/// maps it, and I/O queue pair 1 of `size` entries.
fn rig(host: &Arc<TrapHost>, size: u16) -> (Drv, Page) {
    let mut d = Drv::with_ioevents(cfg(), host.clone());
    let page = Page::of(&d.n);
    d.io_queues(size);
    (d, page)
}

/// One read on I/O queue 1 (`size` entries), its SQ tail rung through
/// `ring`; whether that store exited. The CQ head is rung after it unless
/// `keep_head` (a CQ head store can wake the poller too).
fn one_io_on(d: &mut Drv, host: &TrapHost, page: &Page, size: u16, keep_head: bool) -> bool {
    let tail = put_read(d, size);
    let exited = ring(d, host, page, 8, tail);
    assert_eq!(d.reap_io_wait(size).1, 0);
    if !keep_head {
        let head = d.iohead as u32;
        ring(d, host, page, 12, head);
    }
    exited
}

fn one_io(d: &mut Drv, host: &TrapHost, page: &Page) -> bool {
    one_io_on(d, host, page, 8, false)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[test]
fn an_idle_poller_sleeps_with_the_page_trapped_and_the_next_store_wakes_it() {
    let host = TrapHost::new(true);
    let (mut d, page) = rig(&host, 32);
    // Nothing but the SQ tail store may wake the poller in these rounds: the
    // CQ (32 entries) takes the 20 completions without a head store.
    for i in 0..20 {
        wait_for("the idle poller traps the page", || host.trapped());
        let (sleeps, wakeups) = (counter(&d.n, "adaptive.sleeps"), counter(&d.n, "adaptive.wakeups"));
        // The store exits, wakes the poller, which serves it and maps the page back.
        assert!(one_io_on(&mut d, &host, &page, 32, true), "round {i}: a store to the trapped page exits");
        assert!(counter(&d.n, "adaptive.wakeups") > wakeups && sleeps >= 1);
    }
    assert_eq!(counter(&d.n, "io.commands"), 20);
    assert!(counter(&d.n, "doorbell.writes") >= 20, "each round's store exited");
    // Disabled while asleep: the thread stops and the page goes back to the guest.
    wait_for("asleep again", || host.trapped());
    d.w32(REG_CC, 0);
    assert!(!host.trapped(), "a stopped poller leaves no trap behind");
    assert_eq!(host.traps.load(Ordering::Relaxed), host.untraps.load(Ordering::Relaxed));
}

#[test]
fn a_store_that_lands_while_the_trap_takes_effect_is_served_not_slept_on() {
    let host = TrapHost::with_gate(true, Some(Gate::default()));
    let (mut d, page) = rig(&host, 8);
    for _ in 0..10 {
        // The poller is in the trap, the page still mapped: the store lands in memory.
        let tail = put_read(&mut d, 8);
        let h = host.clone();
        host.while_trap_is_held(&mut d, |d| assert!(!ring(d, &h, &page, 8, tail), "the page is still mapped"));
        // No exit will come for it: the poller's look after the trap serves it.
        assert_eq!(d.reap_io_wait(8).1, 0);
        let head = d.iohead as u32;
        ring(&mut d, &host, &page, 12, head);
    }
    assert_eq!(counter(&d.n, "io.commands"), 10);
    d.n.quiesce();
}

#[test]
fn submissions_at_any_moment_around_the_idle_interval_all_complete() {
    let host = TrapHost::new(true);
    let (mut d, page) = rig(&host, 8);
    // Pauses either side of the idle interval: whichever way each store goes
    // (memory, or an exit), none is lost. How many go each way depends on the
    // machine's speed, and is not asserted.
    for i in 0..300u64 {
        one_io(&mut d, &host, &page);
        let pause = Duration::from_micros(100 + (i * 137) % 900);
        let t0 = Instant::now();
        while t0.elapsed() < pause {
            std::hint::spin_loop();
        }
    }
    assert_eq!(counter(&d.n, "io.commands"), 300);
    assert_eq!(counter(&d.n, "errors"), 0);
    d.n.quiesce();
}

#[test]
fn a_host_that_cannot_trap_the_page_gets_a_poller_that_looks_at_it_in_timed_steps() {
    let host = TrapHost::new(false);
    let (mut d, page) = rig(&host, 8);
    let admin_exits = counter(&d.n, "doorbell.writes");
    for _ in 0..5 {
        // Long enough for the poller to sleep, and for its steps to reach their longest.
        let t0 = Instant::now();
        wait_for("asleep", || counter(&d.n, "adaptive.sleeps") > 0);
        std::thread::sleep(BAR_IDLE_MAX * 3);
        assert!(!one_io(&mut d, &host, &page), "the page stays in memory");
        assert!(t0.elapsed() < Duration::from_secs(2));
    }
    assert_eq!(counter(&d.n, "io.commands"), 5);
    assert_eq!(counter(&d.n, "doorbell.writes"), admin_exits, "no I/O doorbell exited");
    assert!(counter(&d.n, "adaptive.sleeps") >= 5, "it slept before each");
    // A doorbell that comes as a message (a client that did not map the page) wakes it at once.
    std::thread::sleep(BAR_IDLE_MAX * 3);
    let tail = put_read(&mut d, 8);
    let wakeups = counter(&d.n, "adaptive.wakeups");
    d.w32(DOORBELLS + 8, tail);
    assert_eq!(d.reap_io_wait(8).1, 0);
    assert!(counter(&d.n, "adaptive.wakeups") > wakeups, "woken by the message, not a step");
    d.n.quiesce();
}

#[test]
fn bar_adaptive_takes_one_poller() {
    let c = NvmeConfig { pollers: 2, ..cfg() };
    let e = Nvme::new(c).err().expect("refused").to_string();
    assert!(e.contains("bar-adaptive takes one poller"), "{e}");
    assert_eq!("bar-adaptive".parse::<DoorbellMode>().unwrap(), DoorbellMode::BarAdaptive);
    assert_eq!(DoorbellMode::BarAdaptive.to_string(), "bar-adaptive");
}
