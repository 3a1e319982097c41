//! The transport with several queues (`queues=N`): per-queue registers,
//! selection past N, notify addresses, MSI-X vectors, independence of the
//! queues' requests, reset; and virtio-blk's MQ configuration.

use super::*;

/// Records which MSI-X vector each signal went to.
#[derive(Default)]
struct Vectors(Mutex<Vec<u16>>);
impl crate::Interrupts for Vectors {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, v: u16) -> bool {
        self.0.lock().unwrap().push(v);
        true
    }
}

fn mq(queues: u16, backend: StorageKind) -> VirtioBlkConfig {
    VirtioBlkConfig { queues: Some(queues), ..cfg(backend) }
}

/// A device with `queues` queues, its driver's first queue, and the vectors it signalled.
fn mq_rig(queues: u16) -> (Rig, Arc<Vectors>) {
    let d = Driver::new(8);
    let dev = VirtioBlk::new(mq(queues, StorageKind::Ram)).unwrap();
    let v = Arc::new(Vectors::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = v.clone();
    dev.attach(ctx);
    (Rig { dev, d, irqs: Arc::new(Irqs::default()) }, v)
}

/// Offset of queue q's rings past queue 0's.
fn rings_of(q: u16) -> u64 {
    0x8000 * q as u64
}

impl Rig {
    /// Reset, features (VERSION_1 | EVENT_IDX | MQ), FEATURES_OK.
    fn negotiate(&self) {
        self.w(0x14, 0, 1);
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
        let f = F_VERSION_1 | F_EVENT_IDX | F_MQ;
        for sel in 0..2u64 {
            self.w(0x08, sel, 4);
            self.w(0x0c, (f >> (32 * sel)) & 0xffff_ffff, 4);
        }
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK) as u64, 1);
        assert_ne!(self.status() & S_FEATURES_OK, 0);
    }

    /// Sets queue `q` up on `d`'s rings with MSI-X `vector`, and enables it.
    fn setup(&self, q: u16, d: &Driver, vector: u16) {
        self.w(0x16, q as u64, 2);
        self.w(0x18, d.num as u64, 2);
        self.w(0x1a, vector as u64, 2);
        self.w(0x20, d.desc, 8);
        self.w(0x28, d.avail, 8);
        self.w(0x30, d.used, 8);
        self.w(0x1c, 1, 2);
        assert_eq!(self.r(0x1c, 2), 1, "queue {q} enabled");
    }

    fn driver_ok(&self) {
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK) as u64, 1);
    }

    /// MSI-X on, vectors 0..n unmasked with an address.
    fn msix_on(&self, n: u64) {
        for v in 0..n {
            self.w(MSIX_TABLE + 16 * v, 0xfee0_0000, 4);
            self.w(MSIX_TABLE + 16 * v + 8, 0x40 + v, 4);
            self.w(MSIX_TABLE + 16 * v + 12, 0, 4);
        }
        self.dev.config_write(MSIX_CAP + 3, &[0x80]);
    }

    fn count(&self, name: &str) -> u64 {
        self.dev.counters().iter().find(|c| c.name == name).map(|c| c.value).unwrap_or(u64::MAX)
    }
}

/// Queues a request `(kind, sector, buf, len)` on `d` (header and status
/// at DATA + 0x100 * slot, data at `buf`) and notifies queue `q` at its
/// address; the status byte.
fn request(r: &Rig, d: &mut Driver, q: u16, slot: u16, (kind, sector, buf, len): (u32, u64, u64, u32)) -> u8 {
    let mut hdr = [0u8; 16];
    hdr[0..4].copy_from_slice(&kind.to_le_bytes());
    hdr[8..16].copy_from_slice(&sector.to_le_bytes());
    let at = DATA + 0x100 * slot as u64;
    d.ram.write_slice(&hdr, GuestAddress(at)).unwrap();
    d.ram.write_obj(0xaau8, GuestAddress(at + 0x80)).unwrap();
    let h = d.avail_idx % d.num;
    d.chain(h, &[(at, 16, false), (buf, len, kind == T_IN), (at + 0x80, 1, true)]);
    d.publish(h);
    r.w(notify_offset(q), q as u64, 2);
    d.ram.read_obj(GuestAddress(at + 0x80)).unwrap()
}

#[test]
fn each_queue_has_its_own_registers_and_a_queue_past_n_is_unavailable() {
    let (r, _) = mq_rig(3);
    assert_eq!(r.r(0x12, 2), 3, "num_queues");
    for q in 0..3u64 {
        r.w(0x16, q, 2);
        assert_eq!(r.r(0x16, 2), q);
        assert_eq!(r.r(0x18, 2), MAX_QUEUE_SIZE as u64, "queue {q}: the largest size on reset");
        assert_eq!(r.r(0x1a, 2), NO_VECTOR as u64);
        assert_eq!(r.r(0x1c, 2), 0);
        assert_eq!(r.r(0x1e, 2), q, "queue_notify_off");
    }
    r.w(0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
    // Sizes and addresses stay with their queue.
    for (q, size) in [(0u64, 8u64), (1, 4), (2, 2)] {
        r.w(0x16, q, 2);
        r.w(0x18, size, 2);
        r.w(0x20, 0x1000 * (q + 1), 8);
        r.w(0x18, 3, 2); // not a power of two: dropped
        r.w(0x18, 2 * MAX_QUEUE_SIZE as u64, 2); // too large: dropped
    }
    for (q, size) in [(0u64, 8u64), (1, 4), (2, 2)] {
        r.w(0x16, q, 2);
        assert_eq!((r.r(0x18, 2), r.r(0x20, 8)), (size, 0x1000 * (q + 1)), "queue {q}");
    }
    // Past N (and the largest index): size 0, no vector, writes dropped (4.1.4.3).
    for q in [3u64, 16, 0xffff] {
        r.w(0x16, q, 2);
        assert_eq!(r.r(0x16, 2), q, "queue_select reads back");
        r.w(0x18, 8, 2);
        r.w(0x1a, 1, 2);
        r.w(0x20, 0x1000, 8);
        r.w(0x1c, 1, 2);
        assert_eq!((r.r(0x18, 2), r.r(0x1a, 2), r.r(0x1c, 2)), (0, NO_VECTOR as u64, 0), "queue {q}");
        assert_eq!((r.r(0x1e, 2), r.r(0x20, 8), r.r(0x28, 8), r.r(0x30, 8)), (0, 0, 0, 0), "queue {q}");
    }
    assert_eq!(r.status() & S_NEEDS_RESET, 0, "nothing past N was touched");
    r.w(0x16, 1, 2);
    assert_eq!((r.r(0x18, 2), r.r(0x20, 8)), (4, 0x2000), "queue 1 unchanged");
}

#[test]
fn notify_area_and_msix_table_cover_every_queue() {
    for n in [1u16, 2, 16] {
        let dev = VirtioBlk::new(mq(n, StorageKind::Null)).unwrap();
        let caps = dev.capabilities();
        let notify = caps.iter().find(|c| c.id == 0x09 && c.body[1] == 2).expect("notify capability");
        let le32 = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap());
        // body: cap_len, cfg_type, bar, id, pad, pad, offset, length, multiplier
        assert_eq!(le32(&notify.body[6..10]) as u64, NOTIFY);
        let (len, mult) = (le32(&notify.body[10..14]), le32(&notify.body[14..18]));
        assert_eq!(mult, NOTIFY_MULT);
        // 4.1.4.4: every queue's notify address, and its 2 bytes, inside the area.
        assert!((n as u32 - 1) * mult + 2 <= len && len <= n as u32 * mult, "{n} queues: notify length {len}");
        assert!(NOTIFY + len as u64 <= MSIX_TABLE);
        // MSI-X: table size N + 1 (the field holds size - 1).
        let msix = caps.iter().find(|c| c.id == 0x11).expect("MSI-X capability");
        assert_eq!(u16::from_le_bytes([msix.body[0], msix.body[1]]) & 0x7ff, n, "{n} queues");
    }
    // A queue takes any vector up to N, not past it.
    let (r, _) = mq_rig(2);
    r.w(0x16, 1, 2);
    for (v, back) in [(2u16, 2u16), (3, NO_VECTOR), (0, 0)] {
        r.w(0x1a, v as u64, 2);
        assert_eq!(r.r(0x1a, 2), back as u64, "vector {v}");
    }
    r.w(0x10, 3, 2);
    assert_eq!(r.r(0x10, 2), NO_VECTOR as u64, "config vector past the table");
}

#[test]
fn each_queue_serves_its_own_requests_and_raises_its_own_vector() {
    let (r, vectors) = mq_rig(2);
    let mut d1 = r.d.another(rings_of(1));
    r.negotiate();
    r.msix_on(3);
    r.setup(0, &r.d, 1);
    r.setup(1, &d1, 2);
    r.driver_ok();
    assert!(r.dev.counters().iter().any(|c| c.name == "q1.requests"));
    // Written through queue 1, read back through queue 0: one disk.
    let (src, dst) = (DATA + 0x4000, DATA + 0x6000);
    r.d.ram.write_slice(&[0x3c; 4096], GuestAddress(src)).unwrap();
    assert_eq!(request(&r, &mut d1, 1, 0, (T_OUT, 8, src, 4096)), S_OK);
    assert_eq!((d1.used_idx(), r.d.used_idx()), (1, 0), "queue 1's used ring only");
    assert_eq!(*vectors.0.lock().unwrap(), [2], "queue 1's vector");
    let mut d0 = r.d.another(0);
    assert_eq!(request(&r, &mut d0, 0, 1, (T_IN, 8, dst, 4096)), S_OK);
    let mut back = [0u8; 4096];
    d0.ram.read_slice(&mut back, GuestAddress(dst)).unwrap();
    assert_eq!(back, [0x3c; 4096]);
    assert_eq!((d1.used_idx(), d0.used_idx()), (1, 1));
    assert_eq!(d0.used_elem(0), (0, 4097));
    assert_eq!(*vectors.0.lock().unwrap(), [2, 1], "then queue 0's");
    // Each queue's EVENT_IDX threshold is its own.
    assert_eq!((d0.avail_event(), d1.avail_event()), (1, 1));
    assert_eq!((r.count("requests"), r.count("q0.requests"), r.count("q1.requests")), (2, 1, 1));
    assert_eq!((r.count("notifies"), r.count("errors")), (2, 0));
}

#[test]
fn queues_the_driver_leaves_disabled_are_not_served_and_break_nothing() {
    // Linux uses min(num_queues, CPUs) queues: the others stay disabled.
    let (r, _) = mq_rig(4);
    r.negotiate();
    r.setup(0, &r.d, NO_VECTOR);
    r.driver_ok();
    let mut d0 = r.d.another(0);
    r.w(notify_offset(3), 3, 2);
    assert_eq!(request(&r, &mut d0, 0, 0, (T_IN, 0, DATA + 0x4000, 512)), S_OK);
    assert_eq!(r.status() & S_NEEDS_RESET, 0);
    // A disabled queue's registers are still written... before DRIVER_OK only.
    r.w(0x16, 2, 2);
    r.w(0x18, 4, 2);
    r.w(0x1c, 1, 2);
    assert_eq!((r.r(0x18, 2), r.r(0x1c, 2)), (MAX_QUEUE_SIZE as u64, 0), "after DRIVER_OK");
    assert_eq!(r.count("q0.requests"), 1);
}

#[test]
fn a_ring_broken_on_one_queue_stops_every_queue_until_a_reset_forgets_them_all() {
    let (r, _) = mq_rig(2);
    let mut d1 = r.d.another(rings_of(1));
    r.negotiate();
    r.msix_on(3);
    r.setup(0, &r.d, 1);
    r.setup(1, &d1, 2);
    r.driver_ok();
    d1.publish(200); // a head past queue 1's size
    r.w(notify_offset(1), 1, 2);
    assert_ne!(r.status() & S_NEEDS_RESET, 0);
    let mut d0 = r.d.another(0);
    assert_eq!(request(&r, &mut d0, 0, 0, (T_IN, 0, DATA + 0x4000, 512)), 0xaa, "queue 0 stopped too");
    // Reset: every queue back to its reset values.
    r.w(0x14, 0, 1);
    assert_eq!((r.status(), r.r(0x16, 2)), (0, 0));
    for q in 0..2u64 {
        r.w(0x16, q, 2);
        assert_eq!(r.r(0x18, 2), MAX_QUEUE_SIZE as u64, "queue {q} size");
        assert_eq!((r.r(0x1a, 2), r.r(0x1c, 2)), (NO_VECTOR as u64, 0), "queue {q} vector, enable");
        assert_eq!((r.r(0x20, 8), r.r(0x28, 8), r.r(0x30, 8)), (0, 0, 0), "queue {q} rings");
    }
    // A fresh setup serves both again, from index 0.
    let (mut d0, mut d1) = (r.d.another(0), r.d.another(rings_of(1)));
    d0.w16(d0.avail + 2, 0);
    d1.w16(d1.avail + 2, 0);
    r.negotiate();
    r.setup(0, &d0, NO_VECTOR);
    r.setup(1, &d1, NO_VECTOR);
    r.driver_ok();
    assert_eq!(request(&r, &mut d1, 1, 1, (T_IN, 0, DATA + 0x4000, 512)), S_OK);
    assert_eq!(request(&r, &mut d0, 0, 2, (T_IN, 0, DATA + 0x4000, 512)), S_OK);
    assert_eq!((r.count("q0.requests"), r.count("q1.requests"), r.count("ring_errors")), (1, 1, 1));
}

#[test]
fn a_queue_whose_rings_leave_memory_is_refused_by_its_index() {
    let (r, _) = mq_rig(2);
    r.negotiate();
    r.setup(0, &r.d, NO_VECTOR);
    r.w(0x16, 1, 2);
    r.w(0x30, crate::virtio::fake::RAM - 8, 8);
    r.w(0x1c, 1, 2);
    assert_eq!(r.r(0x1c, 2), 0);
    assert_ne!(r.status() & S_NEEDS_RESET, 0);
}

#[test]
fn with_an_ioeventfd_every_queue_notify_address_wakes_the_one_thread() {
    for notify in [NotifyMode::Ioeventfd, NotifyMode::Poll] {
        let d = Driver::new(8);
        let dev = VirtioBlk::new(VirtioBlkConfig { notify, ..mq(3, StorageKind::Ram) }).unwrap();
        let io = Arc::new(FakeIoEvents::default());
        let mut ctx = DeviceContext::detached(d.mem.clone());
        ctx.ioevents = io.clone();
        dev.attach(ctx);
        let regs: Vec<(IoEventSpec, EventFd)> = std::mem::take(&mut *io.0.lock().unwrap());
        let offsets: Vec<u64> = regs.iter().map(|(s, _)| s.offset).collect();
        assert_eq!(offsets, [NOTIFY, NOTIFY + 4, NOTIFY + 8], "{notify}");
        assert!(regs.iter().all(|(s, _)| s.bar == 0 && s.len == 0 && s.datamatch.is_none()));
        let r = Rig { dev, d, irqs: Arc::new(Irqs::default()) };
        let mut d2 = r.d.another(rings_of(2));
        r.negotiate();
        r.setup(0, &r.d, NO_VECTOR);
        r.setup(2, &d2, NO_VECTOR);
        r.driver_ok();
        // The driver stores to queue 2's notify address: KVM signals that registration's fd.
        d2.chain(0, &[(DATA, 16, false), (DATA + 0x80, 1, true)]);
        d2.ram.write_slice(&[4u8, 0, 0, 0], GuestAddress(DATA)).unwrap(); // FLUSH
        d2.publish(0);
        regs[2].1.write(1).unwrap();
        eventually("queue 2's request is served", || d2.used_idx() == 1);
        assert_eq!(r.d.used_idx(), 0);
        r.dev.quiesce();
        assert_eq!((r.count("q2.requests"), r.count("notifies"), r.count("kicks")), (1, 0, 1), "{notify}");
    }
}

#[test]
fn the_configuration_offers_mq_with_num_queues() {
    assert_ne!(FEATURES & F_MQ, 0, "MQ is offered whatever the count");
    for (queues, n) in [(None, 1u64), (Some(1), 1), (Some(4), 4), (Some(16), 16)] {
        let dev = VirtioBlk::new(VirtioBlkConfig { queues, ..cfg(StorageKind::Null) }).unwrap();
        let mut b = [0u8; 2];
        dev.bar_read(0, DEVCFG + blk::NUM_QUEUES_AT as u64, &mut b);
        assert_eq!(u16::from_le_bytes(b) as u64, n, "{queues:?}");
        dev.bar_read(0, COMMON + 0x12, &mut b);
        assert_eq!(u16::from_le_bytes(b) as u64, n, "{queues:?}: the transport's num_queues");
    }
    for bad in [0u16, 17] {
        let e = VirtioBlk::new(VirtioBlkConfig { queues: Some(bad), ..cfg(StorageKind::Null) }).err().unwrap();
        assert!(e.to_string().contains("queues"), "{e}");
    }
}
