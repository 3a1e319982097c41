use super::*;
use crate::virtio::blk::{S_OK, T_IN, T_OUT};
use crate::virtio::fake::{Driver, AVAIL, DATA, DESC, USED};
use crate::virtio::queue::MAX_QUEUE_SIZE;
use crate::virtio::transport::MSIX_CAP;
use crate::DeviceModel;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use vm_memory::{Bytes, GuestAddress};

/// Records INTx levels and MSI-X signals.
#[derive(Default)]
struct Irqs {
    intx: AtomicBool,
    msix: AtomicU64,
}
impl crate::Interrupts for Irqs {
    fn set_intx(&self, level: bool) {
        self.intx.store(level, Ordering::SeqCst);
    }
    fn signal_msix(&self, _: u16) -> bool {
        self.msix.fetch_add(1, Ordering::SeqCst);
        true
    }
}

struct Rig {
    dev: VirtioBlk,
    d: Driver,
    irqs: Arc<Irqs>,
}

fn rig(cfg: VirtioBlkConfig) -> Rig {
    let d = Driver::new(8);
    let dev = VirtioBlk::new(cfg).unwrap();
    let irqs = Arc::new(Irqs::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = irqs.clone();
    dev.attach(ctx);
    Rig { dev, d, irqs }
}

impl Rig {
    fn w(&self, off: u64, v: u64, len: usize) {
        self.dev.bar_write(0, off, &v.to_le_bytes()[..len]);
    }
    fn r(&self, off: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev.bar_read(0, off, &mut b[..len]);
        u64::from_le_bytes(b)
    }
    fn status(&self) -> u8 {
        self.r(COMMON + 0x14, 1) as u8
    }
    /// 3.1.1: reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK, queue, DRIVER_OK.
    fn init(&self, features: u64) -> bool {
        self.w(0x14, 0, 1);
        self.w(0x14, S_ACKNOWLEDGE as u64, 1);
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
        for sel in 0..2u64 {
            self.w(0x00, sel, 4);
            let offered = self.r(0x04, 4) << (32 * sel);
            assert_eq!(offered, FEATURES & (0xffff_ffff << (32 * sel)));
            self.w(0x08, sel, 4);
            self.w(0x0c, (features >> (32 * sel)) & 0xffff_ffff, 4);
        }
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK) as u64, 1);
        if self.status() & S_FEATURES_OK == 0 {
            return false;
        }
        self.w(0x16, 0, 2);
        assert_eq!(self.r(0x18, 2), MAX_QUEUE_SIZE as u64);
        self.w(0x18, 8, 2);
        self.w(0x20, DESC, 8);
        self.w(0x28, AVAIL, 4);
        self.w(0x2c, 0, 4);
        self.w(0x30, USED, 8);
        self.w(0x1c, 1, 2);
        assert_eq!(self.r(0x1c, 2), 1, "queue enabled");
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK) as u64, 1);
        true
    }
    /// Queues a request (header at DATA, data buffer, status) at descriptor `h` and notifies.
    fn request(&mut self, h: u16, kind: u32, sector: u64, buf: u64, len: u32) -> u8 {
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&kind.to_le_bytes());
        hdr[8..16].copy_from_slice(&sector.to_le_bytes());
        let at = DATA + 0x100 * h as u64;
        self.d.ram.write_slice(&hdr, GuestAddress(at)).unwrap();
        self.d.ram.write_obj(0xaau8, GuestAddress(at + 0x80)).unwrap();
        self.d.chain(h, &[(at, 16, false), (buf, len, kind == T_IN), (at + 0x80, 1, true)]);
        self.d.publish(h);
        self.w(NOTIFY, 0, 2);
        self.d.ram.read_obj(GuestAddress(at + 0x80)).unwrap()
    }
}

fn cfg(backend: StorageKind) -> VirtioBlkConfig {
    VirtioBlkConfig { backend, size: 1 << 20, notify: NotifyMode::Exit, ..VirtioBlkConfig::default() }
}

#[test]
fn a_driver_negotiates_and_does_io() {
    let mut r = rig(cfg(StorageKind::Ram));
    assert!(r.init(F_VERSION_1 | F_EVENT_IDX | F_FLUSH));
    assert_eq!(r.r(DEVCFG, 8), (1 << 20) / 512, "capacity in sectors");
    assert_eq!(r.r(DEVCFG + 20, 4), 512, "blk_size");
    assert_eq!(r.r(DEVCFG + 12, 4), SEG_MAX as u64);
    assert_eq!((r.r(DEVCFG + 36, 4), r.r(DEVCFG + 40, 4)), (blk::MAX_RANGE_SECTORS as u64, 1), "discard limits");
    assert_eq!((r.r(DEVCFG + 48, 4), r.r(DEVCFG + 52, 4)), (blk::MAX_RANGE_SECTORS as u64, 1), "write zeroes limits");
    let buf = DATA + 0x4000;
    r.d.ram.write_slice(&[0x5a; 4096], GuestAddress(buf)).unwrap();
    assert_eq!(r.request(0, T_OUT, 16, buf, 4096), S_OK);
    let out = DATA + 0x6000;
    assert_eq!(r.request(1, T_IN, 16, out, 4096), S_OK);
    let mut back = [0u8; 4096];
    r.d.ram.read_slice(&mut back, GuestAddress(out)).unwrap();
    assert_eq!(back, [0x5a; 4096]);
    assert_eq!(r.d.used_idx(), 2);
    assert_eq!(r.d.used_elem(1), (1, 4097));
    // EVENT_IDX: the device asks to be notified for the next buffer.
    assert_eq!(r.d.avail_event(), 2);
    // No MSI-X: INTx and the ISR's queue bit; reading the ISR clears both.
    assert!(r.irqs.intx.load(Ordering::SeqCst));
    assert_eq!(r.r(ISR, 1), 1);
    assert!(!r.irqs.intx.load(Ordering::SeqCst));
    assert_eq!(r.r(ISR, 1), 0);
    let c = r.dev.counters();
    let get = |n: &str| c.iter().find(|x| x.name == n).unwrap().value;
    assert_eq!((get("requests"), get("notifies"), get("errors")), (2, 2, 0));
}

#[test]
fn features_without_version_1_or_unoffered_are_refused() {
    let r = rig(cfg(StorageKind::Null));
    assert!(!r.init(F_EVENT_IDX), "legacy driver");
    assert!(!r.init(F_VERSION_1 | 1 << 40), "a feature never offered");
    // DRIVER_OK without FEATURES_OK: the queue is not served.
    r.w(0x16, 0, 2);
    r.w(0x18, 8, 2);
    r.w(0x20, DESC, 8);
    r.w(0x28, AVAIL, 8);
    r.w(0x30, USED, 8);
    r.w(0x1c, 1, 2);
    r.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_DRIVER_OK) as u64, 1);
    let mut r = r;
    assert_eq!(r.request(0, T_IN, 0, DATA + 0x4000, 512), 0xaa, "not served");
    assert_eq!(r.d.used_idx(), 0);
    r.d.avail_idx = 0;
    r.d.w16(AVAIL + 2, 0);
    assert!(r.init(F_VERSION_1));
}

#[test]
fn a_broken_ring_needs_reset_and_reset_recovers() {
    let mut r = rig(cfg(StorageKind::Ram));
    assert!(r.init(F_VERSION_1));
    r.d.publish(200); // head index beyond the queue
    r.w(NOTIFY, 0, 2);
    assert_ne!(r.status() & S_NEEDS_RESET, 0);
    assert_eq!(r.r(ISR, 1), 2, "configuration change");
    // Queued I/O is not served until reset.
    assert_eq!(r.request(1, T_IN, 0, DATA + 0x4000, 512), 0xaa);
    // Reset: status 0, queue disabled; a fresh setup works again.
    r.w(0x14, 0, 1);
    assert_eq!(r.status(), 0);
    assert_eq!(r.r(0x1c, 2), 0);
    r.d.avail_idx = 0;
    r.d.w16(AVAIL + 2, 0);
    assert!(r.init(F_VERSION_1));
    assert_eq!(r.request(0, T_IN, 0, DATA + 0x4000, 512), S_OK);
}

#[test]
fn queue_setup_outside_memory_is_refused() {
    let r = rig(cfg(StorageKind::Null));
    r.w(0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
    r.w(0x0c, 0, 4);
    r.w(0x08, 1, 4);
    r.w(0x0c, 1, 4);
    r.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK) as u64, 1);
    r.w(0x20, crate::virtio::fake::RAM - 16, 8);
    r.w(0x1c, 1, 2);
    assert_eq!(r.r(0x1c, 2), 0);
    assert_ne!(r.status() & S_NEEDS_RESET, 0);
    // Odd register accesses are dropped, reads past the areas are all-ones.
    r.w(0x24, u64::MAX, 8);
    assert_eq!(r.r(0x20, 8), crate::virtio::fake::RAM - 16, "a misaligned 8-byte write is dropped");
    assert_eq!(r.r(0x7000, 4), 0xffff_ffff);
    r.dev.bar_write(0, u64::MAX, &[1; 8]);
}

#[test]
fn msix_vectors_carry_queue_interrupts() {
    let mut r = rig(cfg(StorageKind::Null));
    assert!(r.init(F_VERSION_1));
    // Unmask vector 1 with an address, enable MSI-X in the capability.
    r.w(MSIX_TABLE + 16, 0xfee0_0000, 4);
    r.w(MSIX_TABLE + 24, 0x41, 4);
    r.w(MSIX_TABLE + 28, 0, 4);
    r.dev.config_write(MSIX_CAP + 3, &[0x80]);
    r.w(0x1a, 1, 2);
    assert_eq!(r.r(0x1a, 2), 1);
    r.w(0x1a, 7, 2);
    assert_eq!(r.r(0x1a, 2), NO_VECTOR as u64, "no such vector");
    r.w(0x1a, 1, 2);
    assert_eq!(r.request(0, T_IN, 0, DATA + 0x4000, 512), S_OK);
    assert_eq!(r.irqs.msix.load(Ordering::SeqCst), 1);
    assert!(!r.irqs.intx.load(Ordering::SeqCst));
}

#[test]
fn capabilities_fit_the_header() {
    let dev = VirtioBlk::new(cfg(StorageKind::Null)).unwrap();
    let mut c = crate::pci::ConfigSpace::new(dev.ids(), &dev.bars()).unwrap();
    c.add_capabilities(&dev.capabilities()).unwrap();
    let mut b = [0u8; 4];
    c.read(0, &mut b);
    assert_eq!(u32::from_le_bytes(b), (DEVICE as u32) << 16 | VENDOR as u32);
    // The engine's class and subsystem: what QEMU's virtio-blk-pci shows (mass storage, 0x1100).
    c.read(0x08, &mut b);
    assert_eq!(u32::from_le_bytes(b) >> 8, 0x01_00_00);
    c.read(0x2c, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x1100 << 16 | VENDOR as u32);
}

/// Keeps a copy of each eventfd registered, as KVM would.
#[derive(Default)]
struct FakeIoEvents(Mutex<Vec<(IoEventSpec, EventFd)>>);
impl crate::IoEvents for FakeIoEvents {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> Result<()> {
        self.0.lock().unwrap().push((spec, fd.try_clone().unwrap()));
        Ok(())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> Result<()> {
        Ok(())
    }
}

#[test]
fn ioeventfd_mode_serves_kicks_on_the_device_thread() {
    let d = Driver::new(8);
    let dev = VirtioBlk::new(VirtioBlkConfig { notify: NotifyMode::Ioeventfd, ..cfg(StorageKind::Ram) }).unwrap();
    let io = Arc::new(FakeIoEvents::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.ioevents = io.clone();
    dev.attach(ctx);
    let (spec, kick) = io.0.lock().unwrap().pop().expect("notify registered as an ioeventfd");
    assert_eq!((spec.bar, spec.offset), (0, NOTIFY));
    let mut r = Rig { dev, d, irqs: Arc::new(Irqs::default()) };
    assert!(r.init(F_VERSION_1 | F_EVENT_IDX));
    r.d.chain(0, &[(DATA, 16, false), (DATA + 0x80, 1, true)]);
    r.d.ram.write_slice(&[4u8, 0, 0, 0], GuestAddress(DATA)).unwrap(); // FLUSH
    r.d.publish(0);
    kick.write(1).unwrap();
    let t = std::time::Instant::now();
    while r.d.used_idx() != 1 {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "the device thread never served the kick");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(r.d.ram.read_obj::<u8>(GuestAddress(DATA + 0x80)).unwrap(), S_OK);
    r.dev.quiesce();
    let c = r.dev.counters();
    assert_eq!(c.iter().find(|x| x.name == "kicks").unwrap().value, 1);
    assert_eq!(c.iter().find(|x| x.name == "notifies").unwrap().value, 0);
}

#[test]
fn one_notify_serves_a_full_ring() {
    let mut r = rig(cfg(StorageKind::Null));
    assert!(r.init(F_VERSION_1 | F_EVENT_IDX));
    // Eight requests, each through an indirect table of its own.
    for h in 0..8u16 {
        let table = DATA + 0x1000 + 0x100 * h as u64;
        r.d.chain_at(table, 0, &[(DATA, 16, false), (DATA + 0x100 + h as u64, 1, true)]);
        r.d.indirect(h, table, 2);
        r.d.publish(h);
    }
    r.d.ram.write_slice(&[4u8, 0, 0, 0], GuestAddress(DATA)).unwrap(); // FLUSH
    r.w(NOTIFY, 0, 2);
    assert_eq!(r.d.used_idx(), 8);
    assert_eq!(r.d.avail_event(), 8);
    // A notify at another queue's address (there is none) serves nothing,
    // nor does one inside queue 0's 4 bytes but not at their start.
    r.d.chain(0, &[(DATA, 16, false), (DATA + 0x100, 1, true)]);
    r.d.publish(0);
    r.w(notify_offset(1), 1, 2);
    r.w(NOTIFY + 2, 0, 2);
    assert_eq!(r.d.used_idx(), 8);
    // The address says which queue, whatever the value (as an ioeventfd).
    r.w(NOTIFY, 1, 2);
    assert_eq!(r.d.used_idx(), 9);
}

/// Waits (bounded, for liveness only) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "never: {what}");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

#[test]
fn poll_mode_serves_then_sleeps_with_notifications_on() {
    let d = Driver::new(8);
    let dev = VirtioBlk::new(VirtioBlkConfig { notify: NotifyMode::Poll, ..cfg(StorageKind::Null) }).unwrap();
    let io = Arc::new(FakeIoEvents::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.ioevents = io.clone();
    dev.attach(ctx);
    let (_, kick) = io.0.lock().unwrap().pop().expect("notify registered as an ioeventfd");
    let mut r = Rig { dev, d, irqs: Arc::new(Irqs::default()) };
    assert!(r.init(F_VERSION_1 | F_EVENT_IDX));
    r.d.ram.write_slice(&[4u8, 0, 0, 0], GuestAddress(DATA)).unwrap(); // FLUSH
    let count = |r: &Rig, n: &str| r.dev.counters().iter().find(|x| x.name == n).unwrap().value;
    for round in 1..=2u16 {
        let h = 2 * (round - 1);
        r.d.chain(h, &[(DATA, 16, false), (DATA + 0x80, 1, true)]);
        r.d.publish(h);
        kick.write(1).unwrap();
        eventually("the request is served", || r.d.used_idx() == round);
        // Idle, the poller turns notifications back on and sleeps.
        eventually("the poller sleeps", || count(&r, "sleeps") == round as u64);
        assert_eq!(r.d.avail_event(), round, "notify me for the next request");
    }
    r.dev.quiesce();
    assert_eq!(count(&r, "notifies"), 0);
    assert_eq!(count(&r, "kicks"), 2);
}

#[test]
fn the_pci_cfg_window_reaches_the_bar() {
    let r = rig(cfg(StorageKind::Null));
    let body = 0x98 + 2;
    let cw = |off: usize, v: u32| r.dev.config_write(off, &v.to_le_bytes());
    // Window: BAR 0, the device status byte (common config 0x14), 1 byte.
    r.dev.config_write(body + 2, &[0]);
    cw(body + 6, 0x14);
    cw(body + 10, 1);
    cw(body + 14, S_ACKNOWLEDGE as u32);
    assert_eq!(r.status(), S_ACKNOWLEDGE);
    let mut d = [0u8; 4];
    assert!(r.dev.config_read(body + 14, &mut d));
    assert_eq!(d, [S_ACKNOWLEDGE, 0, 0, 0]);
    // A window of 3 bytes, a misaligned one, or another BAR does nothing.
    for (bar, off, len) in [(0u8, 0x14u32, 3u32), (0, 0x13, 2), (2, 0x14, 1)] {
        r.dev.config_write(body + 2, &[bar]);
        cw(body + 6, off);
        cw(body + 10, len);
        cw(body + 14, 0);
        assert_eq!(r.status(), S_ACKNOWLEDGE, "{bar} {off:#x} {len}");
        assert!(r.dev.config_read(body + 14, &mut d));
        assert_eq!(d, [0; 4]);
    }
    // Other configuration reads are the host header's.
    assert!(!r.dev.config_read(body + 6, &mut d));
}

#[path = "blk_async_tests.rs"]
mod aio;
#[path = "blk_emu_tests.rs"]
mod emu;
#[path = "pci_mq_tests.rs"]
mod mq;
