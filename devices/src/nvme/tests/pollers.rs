//! Several pollers (`pollers=N`): I/O queues spread over queue groups by CQ
//! id, each served by its own poller (`shards.rs`).

use super::*;
use std::time::{Duration, Instant};

/// Queue `q`'s SQ and CQ (16 entries each) and its two data pages.
fn sq_at(q: u64) -> u64 {
    0x40000 + q * 0x4000
}
fn cq_at(q: u64) -> u64 {
    0x41000 + q * 0x4000
}
fn wbuf(q: u64) -> u64 {
    0x42000 + q * 0x4000
}
fn rbuf(q: u64) -> u64 {
    0x43000 + q * 0x4000
}
const QSIZE: u16 = 16;

fn cfg(pollers: u8, doorbell: DoorbellMode) -> NvmeConfig {
    NvmeConfig { backend: StorageKind::Ram, size: 1 << 20, lba_size: 512, doorbell, pollers, ..Default::default() }
}

/// A driver's view of one I/O queue pair on shadow doorbells (guest memory
/// only, so a thread of its own can drive it).
struct Pair {
    mem: GuestMemoryMmap,
    q: u64,
    tail: u16,
    head: u16,
    phase: u32,
    cid: u16,
    /// adaptive: the SQ tail doorbell's ioeventfd, rung by the EventIdx rule (KVM's part).
    kick: Option<vmm_sys_util::eventfd::EventFd>,
    rings: u64,
}

impl Pair {
    fn new(mem: &GuestMemoryMmap, q: u64) -> Pair {
        Pair { mem: mem.clone(), q, tail: 0, head: 0, phase: 1, cid: 0, kick: None, rings: 0 }
    }

    /// One Read or Write of one 512-byte block; returns its status.
    fn io(&mut self, op: u8, lba: u64, buf: u64) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        let mut e = [0u8; 64];
        e[0] = op;
        e[2..4].copy_from_slice(&self.cid.to_le_bytes());
        e[4..8].copy_from_slice(&1u32.to_le_bytes());
        e[24..32].copy_from_slice(&buf.to_le_bytes());
        e[40..44].copy_from_slice(&(lba as u32).to_le_bytes());
        self.mem.write_slice(&e, GuestAddress(sq_at(self.q) + self.tail as u64 * 64)).unwrap();
        let old = self.tail as u32;
        self.tail = (self.tail + 1) % QSIZE;
        self.mem.store(self.tail as u32, GuestAddress(DBBUF + self.q * 8), Ordering::SeqCst).unwrap();
        if let Some(k) = &self.kick {
            std::sync::atomic::fence(Ordering::SeqCst);
            let (new, n) = (self.tail as u32, QSIZE as u32);
            let ev: u32 = self.mem.load(GuestAddress(EVIDX + self.q * 8), Ordering::SeqCst).unwrap();
            if (new + 2 * n - ev - 1) % n < (new + n - old) % n {
                k.write(1).unwrap();
                self.rings += 1;
            }
        }
        let t0 = Instant::now();
        loop {
            let a = cq_at(self.q) + self.head as u64 * 16;
            let dw3: u32 = self.mem.load(GuestAddress(a + 12), Ordering::Acquire).unwrap();
            if dw3 >> 16 & 1 == self.phase {
                assert_eq!(dw3 & 0xffff, self.cid as u32, "queue {}: the completion of its command", self.q);
                self.head += 1;
                if self.head == QSIZE {
                    self.head = 0;
                    self.phase ^= 1;
                }
                self.mem.store(self.head as u32, GuestAddress(DBBUF + self.q * 8 + 4), Ordering::SeqCst).unwrap();
                return (dw3 >> 17) as u16;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "queue {}: no completion", self.q);
            std::thread::yield_now();
        }
    }

    /// Writes a block with a pattern of `seed` and reads it back.
    fn write_read(&mut self, lba: u64, seed: u8) {
        let data: Vec<u8> = (0..512).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        self.mem.write_slice(&data, GuestAddress(wbuf(self.q))).unwrap();
        assert_eq!(self.io(0x01, lba, wbuf(self.q)), status::SUCCESS, "write on queue {}", self.q);
        self.mem.write_slice(&[0u8; 512], GuestAddress(rbuf(self.q))).unwrap();
        assert_eq!(self.io(0x02, lba, rbuf(self.q)), status::SUCCESS, "read on queue {}", self.q);
        let mut back = [0u8; 512];
        self.mem.read_slice(&mut back, GuestAddress(rbuf(self.q))).unwrap();
        assert_eq!(&back[..], &data[..], "queue {}: the data written comes back", self.q);
    }
}

impl Drv {
    fn create_pair(&mut self, q: u64) -> (u16, u16) {
        let size = (QSIZE as u32 - 1) << 16;
        let cq = self.admin(0x05, 0, cq_at(q), 0, [q as u32 | size, 1, 0, 0]).1;
        let sq = self.admin(0x01, 0, sq_at(q), 0, [q as u32 | size, 1 | (q as u32) << 16, 0, 0]).1;
        (cq, sq)
    }
    fn delete_pair(&mut self, q: u64) -> (u16, u16) {
        let sq = self.admin(0x00, 0, 0, 0, [q as u32, 0, 0, 0]).1;
        let cq = self.admin(0x04, 0, 0, 0, [q as u32, 0, 0, 0]).1;
        (sq, cq)
    }
    fn counter(&self, name: &str) -> u64 {
        self.n.counters().iter().find(|c| c.name == name).map_or_else(|| panic!("no counter {name}"), |c| c.value)
    }
}

#[test]
fn two_pollers_serve_four_queues_with_the_right_data_and_both_serve_io() {
    for mode in [DoorbellMode::Shm, DoorbellMode::Bar] {
        let mut d = Drv::new(cfg(2, mode));
        if mode == DoorbellMode::Shm {
            assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        }
        for q in 1..=4 {
            assert_eq!(d.create_pair(q), (0, 0), "queue {q}");
        }
        // bar mode: the driver's doorbell stores land in BAR0's page; here they go by bar_write.
        let mut pairs: Vec<Pair> = (1..=4).map(|q| Pair::new(&d.mem, q)).collect();
        for round in 0..8u64 {
            for p in pairs.iter_mut() {
                if mode == DoorbellMode::Bar {
                    bar_write_read(&mut d, p, p.q * 16 + round, (p.q * 7 + round) as u8);
                } else {
                    p.write_read(p.q * 16 + round, (p.q * 7 + round) as u8);
                }
            }
        }
        // Every block a queue wrote reads back through another queue of the other group.
        if mode == DoorbellMode::Shm {
            let other = &mut pairs[1];
            let lba = 16; // written by queue 1 (group 1) in round 0; queue 2 is group 0
            assert_eq!(other.io(0x02, lba, rbuf(2)), status::SUCCESS);
            let mut back = [0u8; 512];
            d.mem.read_slice(&mut back, GuestAddress(rbuf(2))).unwrap();
            let want: Vec<u8> = (0..512).map(|i| (i as u8).wrapping_mul(31) ^ 7).collect();
            assert_eq!(&back[..], &want[..], "one namespace for every group");
        }
        let (p0, p1) = (d.counter("poller0.ios"), d.counter("poller1.ios"));
        assert!(p0 > 0 && p1 > 0, "{mode}: both pollers served I/O ({p0}, {p1})");
        assert_eq!(d.counter("io.commands"), p0 + p1, "{mode}: the totals add the groups");
        assert_eq!(d.counter("errors"), 0);
        assert_eq!(d.counter("backend.ram"), 1);
        d.n.quiesce();
    }
}

/// `write_read` with the doorbells written as registers (bar mode).
fn bar_write_read(d: &mut Drv, p: &mut Pair, lba: u64, seed: u8) {
    let data: Vec<u8> = (0..512).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
    d.mem.write_slice(&data, GuestAddress(wbuf(p.q))).unwrap();
    for (op, buf) in [(0x01u8, wbuf(p.q)), (0x02, rbuf(p.q))] {
        p.cid = p.cid.wrapping_add(1);
        let e = d.sqe(op, 1, buf, 0, [lba as u32, 0, 0, 0]);
        let mut e = e;
        e[2..4].copy_from_slice(&p.cid.to_le_bytes());
        d.mem.write_slice(&e, GuestAddress(sq_at(p.q) + p.tail as u64 * 64)).unwrap();
        p.tail = (p.tail + 1) % QSIZE;
        d.w32(DOORBELLS + p.q * 8, p.tail as u32);
        let t0 = Instant::now();
        loop {
            let a = cq_at(p.q) + p.head as u64 * 16;
            let dw3: u32 = d.mem.load(GuestAddress(a + 12), Ordering::Acquire).unwrap();
            if dw3 >> 16 & 1 == p.phase {
                assert_eq!(dw3 >> 17, 0, "status");
                p.head = (p.head + 1) % QSIZE;
                if p.head == 0 {
                    p.phase ^= 1;
                }
                d.w32(DOORBELLS + p.q * 8 + 4, p.head as u32);
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "queue {}: no completion", p.q);
            std::thread::yield_now();
        }
    }
    let mut back = [0u8; 512];
    d.mem.read_slice(&mut back, GuestAddress(rbuf(p.q))).unwrap();
    assert_eq!(&back[..], &data[..], "queue {}: the data written comes back", p.q);
}

#[test]
fn queues_of_one_group_are_deleted_and_created_while_the_other_group_runs_io() {
    let mut d = Drv::new(cfg(2, DoorbellMode::Shm));
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    assert_eq!(d.create_pair(1), (0, 0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Queue 1 (group 1) runs I/O on a thread of its own, through guest memory only.
    let io = {
        let (mem, stop) = (d.mem.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut p = Pair::new(&mem, 1);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) || n < 50 {
                p.write_read(n % 64, n as u8);
                n += 1;
            }
            n
        })
    };
    // Meanwhile queue 2 (group 0) comes and goes, and serves I/O each time.
    for i in 0..30u8 {
        d.mem.write_slice(&[0u8; 0x1000], GuestAddress(cq_at(2))).unwrap(); // no stale phase tags
        assert_eq!(d.create_pair(2), (0, 0), "create {i}");
        Pair::new(&d.mem, 2).write_read(100 + i as u64, i);
        assert_eq!(d.delete_pair(2), (0, 0), "delete {i}");
        // The queue is gone: deleting again is refused, in its own group.
        assert_eq!(d.delete_pair(2), (status::INVALID_QID, status::INVALID_QID));
    }
    // Hostile: an SQ on a CQ of the other group that does not exist; a duplicate SQ id.
    let size = (QSIZE as u32 - 1) << 16;
    assert_eq!(d.admin(0x01, 0, sq_at(3), 0, [3 | size, 1 | 4 << 16, 0, 0]).1, status::CQ_INVALID);
    assert_eq!(d.admin(0x01, 0, sq_at(3), 0, [1 | size, 1 | 1 << 16, 0, 0]).1, status::INVALID_QID);
    assert_eq!(d.admin(0x04, 0, 0, 0, [1, 0, 0, 0]).1, status::INVALID_QUEUE_DELETION, "CQ 1 has SQ 1");
    stop.store(true, Ordering::Relaxed);
    let n = io.join().unwrap();
    assert!(n >= 50);
    assert!(d.counter("poller1.ios") >= 2 * n, "group 1 served queue 1");
    assert!(d.counter("poller0.ios") >= 60, "group 0 served queue 2");
    assert_eq!(d.counter("errors"), 30 * 2 + 3, "only the refused admin commands");
    d.n.quiesce();
}

#[test]
fn a_controller_reset_with_two_pollers_stops_them_and_drops_every_groups_queues() {
    let mut d = Drv::new(cfg(2, DoorbellMode::Shm));
    for _ in 0..3 {
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        for q in 1..=4 {
            assert_eq!(d.create_pair(q), (0, 0), "queue {q}");
            Pair::new(&d.mem, q).write_read(q, q as u8);
        }
        d.w32(REG_CC, 0);
        let t0 = Instant::now();
        while d.r32(0x1c) & 1 != 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "CSTS.RDY stays 1");
        }
        // Disabled: a submission to a queue of either group is not served.
        for q in [1u64, 2] {
            let e = d.sqe(0x02, 1, rbuf(q), 0, [0; 4]);
            // Slots 0 and 1 served the write and read above.
            d.mem.write_slice(&e, GuestAddress(sq_at(q) + 2 * 64)).unwrap();
            d.mem.store(3u32, GuestAddress(DBBUF + q * 8), Ordering::SeqCst).unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
        for q in [1u64, 2] {
            let dw3: u32 = d.mem.load(GuestAddress(cq_at(q) + 2 * 16 + 12), Ordering::Acquire).unwrap();
            assert_eq!(dw3 >> 16 & 1, 0, "queue {q}: nothing posted after the disable");
        }
        // Enabled again, every queue id is free in every group.
        for q in 1..=4 {
            d.mem.write_slice(&[0u8; 0x1000], GuestAddress(cq_at(q))).unwrap();
        }
        d.mem.write_slice(&[0u8; 0x1000], GuestAddress(ACQ)).unwrap();
        (d.atail, d.ahead, d.aphase) = (0, 0, 1);
        d.w32(REG_CC, 0x0046_0001);
        assert_eq!(d.r32(0x1c) & 1, 1, "ready again");
    }
    d.n.reset();
    drop(d); // joins every poller: a hang here is the failure
}

#[test]
fn a_bad_doorbell_in_another_group_raises_its_event_through_the_admin_queue() {
    let mut d = Drv::new(cfg(2, DoorbellMode::Shm));
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    assert_eq!(d.create_pair(1), (0, 0)); // group 1
                                          // An AER, then a shadow tail past the queue's end.
    let e = d.sqe(0x0c, 0, 0, 0, [0; 4]);
    d.mem.write_slice(&e, GuestAddress(ASQ + d.atail as u64 * 64)).unwrap();
    d.atail = (d.atail + 1) % 32;
    d.w32(DOORBELLS, d.atail as u32);
    d.mem.store(QSIZE as u32 + 5, GuestAddress(DBBUF + 8), Ordering::SeqCst).unwrap();
    let t0 = Instant::now();
    let ev = loop {
        if let Some(r) = d.reap(ACQ, 32, true) {
            break r;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no event");
        std::thread::yield_now();
    };
    assert_eq!(ev.0 & 0xff07, 1 << 8, "error event: invalid doorbell write value");
    assert_eq!(d.counter("doorbell.invalid"), 1);
    // The queue still works once the driver writes a good tail.
    Pair::new(&d.mem, 1).write_read(3, 3);
    d.n.quiesce();
}

#[test]
fn a_masked_vector_of_another_group_is_pending_in_the_pba_and_fires_when_unmasked() {
    let mut d = Drv::new(cfg(2, DoorbellMode::Shm));
    let irqs = Arc::new(Irqs::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = irqs.clone();
    d.n.attach(ctx);
    // Vector 1 routed, masked; MSI-X on.
    d.n.bar_write(0, MSIX_TABLE + 16, &0xfee0_0000u64.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 24, &0x45u32.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 28, &1u32.to_le_bytes());
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    let size = (QSIZE as u32 - 1) << 16;
    // CQ 1 (group 1) interrupts on vector 1.
    assert_eq!(d.admin(0x05, 0, cq_at(1), 0, [1 | size, 3 | 1 << 16, 0, 0]).1, 0);
    assert_eq!(d.admin(0x01, 0, sq_at(1), 0, [1 | size, 1 | 1 << 16, 0, 0]).1, 0);
    let count = |v: u16| irqs.signals.lock().unwrap().iter().filter(|&&s| s == v).count();
    let mut p = Pair::new(&d.mem, 1);
    p.write_read(1, 1);
    assert_eq!(count(1), 0, "masked: not signalled");
    let mut pba = [0u8; 8];
    d.n.bar_read(0, MSIX_PBA, &mut pba);
    assert_eq!(pba[0] & 0b10, 0b10, "vector 1 pending in the PBA");
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    assert_eq!(count(1), 1, "fired once when unmasked");
    p.write_read(2, 2);
    let t0 = Instant::now();
    while count(1) < 3 {
        assert!(t0.elapsed() < Duration::from_secs(10), "unmasked: each completion signals");
        std::thread::yield_now();
    }
    d.n.quiesce();
}

#[test]
fn several_pollers_are_refused_where_they_are_not_served() {
    for (db, backend) in [
        (DoorbellMode::Mmio, StorageKind::Null),
        (DoorbellMode::Ioeventfd, StorageKind::Null),
        (DoorbellMode::Shm, StorageKind::File("/nonexistent".into())),
    ] {
        let e = Nvme::new(NvmeConfig { backend, ..cfg(2, db) }).err().expect("refused").to_string();
        assert!(e.contains("pollers"), "{e}");
    }
    for n in [0, MAX_POLLERS + 1] {
        assert!(Nvme::new(cfg(n, DoorbellMode::Shm)).is_err(), "{n} pollers");
    }
}

/// A VMM's ioeventfds: registered as queues come (not all at attach); keeps a
/// copy of each fd to play KVM's part, and refuses a second registration at
/// an address, as KVM does (EEXIST).
#[derive(Default)]
struct Kvm(std::sync::Mutex<Vec<(crate::IoEventSpec, vmm_sys_util::eventfd::EventFd)>>);
impl crate::IoEvents for Kvm {
    fn register(&self, s: crate::IoEventSpec, fd: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        let mut h = self.0.lock().unwrap();
        if h.iter().any(|(x, _)| x.offset == s.offset) {
            return Err(crate::Error::Host(format!("ioeventfd at {:#x}: already registered", s.offset)));
        }
        h.push((s, fd.try_clone().unwrap()));
        Ok(())
    }
    fn unregister(&self, s: crate::IoEventSpec, _: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        self.0.lock().unwrap().retain(|(x, _)| *x != s);
        Ok(())
    }
}

#[test]
fn adaptive_pollers_each_sleep_on_their_own_queues_doorbells_and_wake_for_them() {
    let host = Arc::new(Kvm::default());
    let mut d = Drv::with_ioevents(cfg(2, DoorbellMode::Adaptive), host.clone());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    for q in 1..=4 {
        assert_eq!(d.create_pair(q), (0, 0), "queue {q}");
    }
    let kick_of = |q: u64| {
        let h = host.0.lock().unwrap();
        h.iter().find(|(s, _)| s.offset == DOORBELLS + 8 * q).map(|(_, fd)| fd.try_clone().unwrap())
    };
    let mut pairs: Vec<Pair> = (1..=4)
        .map(|q| {
            let mut p = Pair::new(&d.mem, q);
            p.kick = Some(kick_of(q).unwrap_or_else(|| panic!("queue {q}'s doorbell is an ioeventfd")));
            p
        })
        .collect();
    // Pauses longer than ADAPTIVE_IDLE let both pollers sleep; each submission that must ring
    // rings only its own queue's ioeventfd: a group woken by another's eventfd would leave
    // the command unserved (the 10 s bound in `io`).
    for i in 0..200u64 {
        if i % 4 == 0 {
            std::thread::sleep(Duration::from_micros(300 + (i * 37) % 700));
        }
        let p = &mut pairs[(i % 4) as usize];
        p.write_read(i % 32, i as u8);
    }
    let rings: u64 = pairs.iter().map(|p| p.rings).sum();
    let (p0, p1) = (d.counter("poller0.ios"), d.counter("poller1.ios"));
    assert!(p0 > 0 && p1 > 0, "both pollers served I/O ({p0}, {p1})");
    assert_eq!(p0 + p1, 400);
    let (sleeps, wakeups) = (d.counter("adaptive.sleeps"), d.counter("adaptive.wakeups"));
    assert!(sleeps > 0 && wakeups > 0 && rings > 0, "sleeps {sleeps} wakeups {wakeups} rings {rings}");
    // A reset stops both sleeping pollers (a hang here is the failure) and unregisters.
    d.w32(REG_CC, 0);
    assert!(host.0.lock().unwrap().is_empty(), "every doorbell unregistered");
    drop(d);
}

#[test]
fn a_queue_id_created_again_in_another_group_gets_its_doorbell_on_that_groups_eventfd() {
    let host = Arc::new(Kvm::default());
    let mut d = Drv::with_ioevents(cfg(2, DoorbellMode::Adaptive), host.clone());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    let size = (QSIZE as u32 - 1) << 16;
    let create_sq = |d: &mut Drv, cqid: u32| d.admin(0x01, 0, sq_at(1), 0, [1 | size, 1 | cqid << 16, 0, 0]).1;
    for q in [1u32, 2] {
        assert_eq!(d.admin(0x05, 0, cq_at(q as u64), 0, [q | size, 1, 0, 0]).1, 0, "CQ {q}");
    }
    // SQ 1 on CQ 2: group 0. Deleted, then SQ 1 again on CQ 1: group 1, whose poller must be
    // the one its doorbell wakes (KVM keeps one registration per address).
    assert_eq!(create_sq(&mut d, 2), 0);
    assert_eq!(d.admin(0x00, 0, 0, 0, [1, 0, 0, 0]).1, 0);
    assert_eq!(create_sq(&mut d, 1), 0);
    let kick = {
        let h = host.0.lock().unwrap();
        let sq1: Vec<_> = h.iter().filter(|(s, _)| s.offset == DOORBELLS + 8).collect();
        assert_eq!(sq1.len(), 1, "one registration for SQ 1's doorbell");
        sq1[0].1.try_clone().unwrap()
    };
    // The pair's CQ is CQ 1 (cq_at(1)), as Pair expects.
    let mut p = Pair::new(&d.mem, 1);
    p.kick = Some(kick);
    for i in 0..20u64 {
        std::thread::sleep(Duration::from_micros(400)); // past ADAPTIVE_IDLE: group 1 sleeps
        p.write_read(i, i as u8);
    }
    assert!(p.rings > 0, "the EventIdx rule asked for the doorbell");
    assert_eq!(d.counter("poller1.ios"), 40, "group 1 served SQ 1");
    d.n.quiesce();
}

#[test]
fn doorbell_buffer_config_after_io_sets_eventidx_so_a_sleeping_poller_is_rung() {
    // A driver that runs I/O on register doorbells first, then configures the shadow buffer
    // (in the VMM: doorbells become ioeventfds only then). The EventIdx page holds what the
    // driver left (zeros); the adaptive poller sleeps since before. EventIdx must make the next
    // submission ring, or the queue, its tail past 0, is never served.
    for pollers in [1, 2] {
        let host = Arc::new(Kvm::default());
        let mut d = Drv::with_ioevents(cfg(pollers, DoorbellMode::Adaptive), host.clone());
        assert_eq!(d.create_pair(1), (0, 0));
        let mut p = Pair::new(&d.mem, 1);
        for i in 0..3 {
            bar_write_read(&mut d, &mut p, i, i as u8); // tail 6, head 6
        }
        d.mem.write_slice(&[0u8; 4096], GuestAddress(EVIDX)).unwrap();
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        let kick = host.0.lock().unwrap().iter().find(|(s, _)| s.offset == DOORBELLS + 8).map(|(_, f)| f.try_clone());
        p.kick = Some(kick.expect("SQ 1's doorbell is an ioeventfd now").unwrap());
        for i in 0..10u64 {
            std::thread::sleep(Duration::from_micros(400)); // past ADAPTIVE_IDLE: the poller sleeps
            p.write_read(10 + i, i as u8);
        }
        assert!(p.rings > 0, "{pollers} pollers");
        d.n.quiesce();
    }
}

#[test]
fn register_doorbells_reach_the_queues_group_and_hostile_ones_are_refused() {
    // shm before Doorbell Buffer Config: I/O doorbells are registers, served on the writer's thread.
    let mut d = Drv::new(cfg(2, DoorbellMode::Shm));
    assert_eq!(d.create_pair(1), (0, 0)); // group 1
    assert_eq!(d.create_pair(2), (0, 0)); // group 0
    let mut pairs = [Pair::new(&d.mem, 1), Pair::new(&d.mem, 2)];
    for p in pairs.iter_mut() {
        bar_write_read(&mut d, p, p.q, p.q as u8);
    }
    assert!(d.counter("poller0.ios") == 2 && d.counter("poller1.ios") == 2, "each group served its queue");
    // Queues that exist nowhere (SQ 3, CQ 3 of group 1, CQ 4 of group 0), a doorbell past the
    // queues the controller offers, and a tail past queue 1's end (group 1).
    let bad = [
        DOORBELLS + 3 * 8,
        DOORBELLS + 3 * 8 + 4,
        DOORBELLS + 4 * 8 + 4,
        DOORBELLS + (MAX_IO_QUEUES as u64 + 1) * 8,
        DOORBELLS + 0xff8,
    ];
    for off in bad {
        d.w32(off, 1);
    }
    d.w32(DOORBELLS + 8, QSIZE as u32 + 3);
    assert_eq!(d.counter("doorbell.invalid"), bad.len() as u64 + 1);
    // 4 admin commands and 4 I/Os, two doorbells each, and the bad ones: each counted once.
    assert_eq!(d.counter("doorbell.writes"), 4 * 2 + 4 * 2 + bad.len() as u64 + 1);
    // Both queues still serve.
    for p in pairs.iter_mut() {
        bar_write_read(&mut d, p, 10 + p.q, 9);
    }
    d.n.quiesce();
}

#[test]
fn reading_the_counters_while_an_adaptive_poller_sleeps_takes_no_wake_up_from_it() {
    // A host that reads the counters while I/O runs (a status query) must not consume the
    // doorbells' eventfd under a sleeping poller: the kick it takes is the one that poller
    // waits for, and the command it announced would not be served (the 10 s bound in `io`).
    let host = Arc::new(Kvm::default());
    let mut d = Drv::with_ioevents(cfg(1, DoorbellMode::Adaptive), host.clone());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    assert_eq!(d.create_pair(1), (0, 0));
    let kick = host.0.lock().unwrap().iter().find(|(s, _)| s.offset == DOORBELLS + 8).map(|(_, f)| f.try_clone());
    let mut p = Pair::new(&d.mem, 1);
    p.kick = Some(kick.expect("SQ 1's doorbell is an ioeventfd").unwrap());
    let stop = std::sync::atomic::AtomicBool::new(false);
    struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let reads = std::thread::scope(|s| {
        let n = &d.n;
        let reader = s.spawn(|| {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = n.counters();
                reads += 1;
            }
            reads
        });
        let _stop = StopOnDrop(&stop);
        for i in 0..40u64 {
            std::thread::sleep(Duration::from_micros(400)); // past ADAPTIVE_IDLE: the poller sleeps
            p.write_read(i, i as u8);
        }
        drop(_stop);
        reader.join().unwrap()
    });
    assert!(p.rings > 0 && reads > 0, "rings {} counter reads {reads}", p.rings);
    // Stopped, the controller counts every kick the guest made.
    d.n.quiesce();
    assert_eq!(d.counter("ioeventfd.kicks"), p.rings);
}
