//! The controller driven the way a driver would, through BAR0 and guest RAM.

use super::queue::status;
use super::regs::{REG_ACQ, REG_AQA, REG_ASQ, REG_CC};
use super::*;
use crate::block::StorageKind;
use crate::{DeviceContext, GuestMemoryMmap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress};

mod bar_adaptive;
mod deallocate;
mod forecast;
mod inject;
mod meta;
mod namespaces;
mod oracle;
mod pollers;
mod timing;

/// Pins the calling thread to `cpu`; false where it cannot be had.
pub(super) fn pin_to(cpu: usize) -> bool {
    // SAFETY: cpu_set_t is plain data; CPU_SET is given an index below
    // CPU_SETSIZE (checked); sched_setaffinity only reads the set.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

const ASQ: u64 = 0x10000;
const ACQ: u64 = 0x11000;
const IOSQ: u64 = 0x12000;
const IOCQ: u64 = 0x13000;
const DATA: u64 = 0x20000;
const DBBUF: u64 = 0x30000;
const EVIDX: u64 = 0x31000;

struct Drv {
    n: Nvme,
    mem: GuestMemoryMmap,
    atail: u16,
    ahead: u16,
    aphase: u32,
    iotail: u16,
    iohead: u16,
    iophase: u32,
    cid: u16,
}

impl Drv {
    fn new(cfg: NvmeConfig) -> Drv {
        Drv::with_admin(cfg, 32)
    }
    fn with_admin(cfg: NvmeConfig, aq: u32) -> Drv {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        Drv::with_device_mem(cfg, aq, mem.clone(), mem.into())
    }
    /// The driver sees `mem`; the device `dev_mem` (the same bytes, some or
    /// all of them through a [`MirrorPort`]).
    fn with_device_mem(cfg: NvmeConfig, aq: u32, mem: GuestMemoryMmap, dev_mem: crate::GuestMem) -> Drv {
        Drv::with_ctx(cfg, aq, mem, DeviceContext::detached(dev_mem))
    }
    fn with_ctx(cfg: NvmeConfig, aq: u32, mem: GuestMemoryMmap, ctx: DeviceContext) -> Drv {
        let n = Nvme::new(cfg).unwrap();
        n.attach(ctx);
        let mut d = Drv { n, mem, atail: 0, ahead: 0, aphase: 1, iotail: 0, iohead: 0, iophase: 1, cid: 0 };
        d.w32(REG_AQA, (aq - 1) << 16 | (aq - 1));
        d.n.bar_write(0, REG_ASQ, &ASQ.to_le_bytes());
        d.n.bar_write(0, REG_ACQ, &ACQ.to_le_bytes());
        d.w32(REG_CC, 0x0046_0001);
        assert_eq!(d.r32(0x1c) & 1, 1, "ready");
        d
    }
    /// 1 MiB of guest memory, a 32-entry admin queue, and `host` for ioeventfds.
    fn with_ioevents(cfg: NvmeConfig, host: Arc<dyn crate::IoEvents>) -> Drv {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut ctx = DeviceContext::detached(mem.clone());
        ctx.ioevents = host;
        Drv::with_ctx(cfg, 32, mem, ctx)
    }
    fn w32(&mut self, off: u64, v: u32) {
        self.n.bar_write(0, off, &v.to_le_bytes());
    }
    fn r32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.n.bar_read(0, off, &mut b);
        u32::from_le_bytes(b)
    }
    fn sqe(&mut self, op: u8, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 4]) -> [u8; 64] {
        self.cid += 1;
        let mut e = [0u8; 64];
        e[0] = op;
        e[2..4].copy_from_slice(&self.cid.to_le_bytes());
        e[4..8].copy_from_slice(&nsid.to_le_bytes());
        e[24..32].copy_from_slice(&prp1.to_le_bytes());
        e[32..40].copy_from_slice(&prp2.to_le_bytes());
        for (i, v) in cdw.iter().enumerate() {
            e[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        e
    }
    /// Submits an admin command and returns (dw0, status) of its completion.
    fn admin(&mut self, op: u8, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 4]) -> (u32, u16) {
        let e = self.sqe(op, nsid, prp1, prp2, cdw);
        self.mem.write_slice(&e, GuestAddress(ASQ + self.atail as u64 * 64)).unwrap();
        self.atail = (self.atail + 1) % 32;
        self.w32(DOORBELLS, self.atail as u32);
        // At once, or (bar mode: the poller serves the admin queue) soon.
        let t0 = std::time::Instant::now();
        let r = loop {
            if let Some(r) = self.reap(ACQ, 32, true) {
                break r;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "admin completion");
            std::thread::yield_now();
        };
        self.w32(DOORBELLS + 4, self.ahead as u32);
        r
    }
    fn reap(&mut self, cq: u64, size: u16, admin: bool) -> Option<(u32, u16)> {
        let (head, phase) =
            if admin { (&mut self.ahead, &mut self.aphase) } else { (&mut self.iohead, &mut self.iophase) };
        let a = cq + *head as u64 * 16;
        let dw3: u32 = self.mem.read_obj(GuestAddress(a + 12)).unwrap();
        if dw3 >> 16 & 1 != *phase {
            return None;
        }
        let dw0: u32 = self.mem.read_obj(GuestAddress(a)).unwrap();
        *head += 1;
        if *head == size {
            *head = 0;
            *phase ^= 1;
        }
        Some((dw0, (dw3 >> 17) as u16))
    }
    /// I/O queue pair 1, 16 entries, its CQ interrupting on MSI-X vector 1.
    fn io_queues_on_vector1(&mut self) {
        assert_eq!(self.admin(0x05, 0, IOCQ, 0, [1 | 15 << 16, 3 | 1 << 16, 0, 0]).1, 0);
        assert_eq!(self.admin(0x01, 0, IOSQ, 0, [1 | 15 << 16, 1 | 1 << 16, 0, 0]).1, 0);
    }
    fn io_queues(&mut self, size: u16) {
        let (_, st) = self.admin(0x05, 0, IOCQ, 0, [1 | ((size as u32 - 1) << 16), 1, 0, 0]);
        assert_eq!(st, 0);
        let (_, st) = self.admin(0x01, 0, IOSQ, 0, [1 | ((size as u32 - 1) << 16), 1 | 1 << 16, 0, 0]);
        assert_eq!(st, 0);
    }
    /// One I/O through the MMIO doorbell; returns its status.
    fn io(&mut self, op: u8, slba: u64, nlb0: u32, prp1: u64, prp2: u64, size: u16) -> u16 {
        let e = self.sqe(op, 1, prp1, prp2, [slba as u32, (slba >> 32) as u32, nlb0, 0]);
        self.mem.write_slice(&e, GuestAddress(IOSQ + self.iotail as u64 * 64)).unwrap();
        self.iotail = (self.iotail + 1) % size;
        self.w32(DOORBELLS + 8, self.iotail as u32);
        // At once, or (bar mode) when the poller has served it.
        let t0 = std::time::Instant::now();
        let (_, st) = loop {
            if let Some(r) = self.reap(IOCQ, size, false) {
                break r;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "io completion");
            std::thread::yield_now();
        };
        self.w32(DOORBELLS + 12, self.iohead as u32);
        st
    }
}

fn mmio(backend: StorageKind) -> NvmeConfig {
    NvmeConfig { backend, size: 1 << 20, lba_size: 512, doorbell: DoorbellMode::Mmio, ..NvmeConfig::default() }
}

#[test]
fn bring_up_identify_and_data_round_trip() {
    let mut d = Drv::new(mmio(StorageKind::Ram));
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, 0);
    let vid: u16 = d.mem.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(vid, VENDOR);
    assert_eq!(d.admin(0x06, 1, DATA, 0, [0, 0, 0, 0]).1, 0);
    let nsze: u64 = d.mem.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(nsze, 2048);
    let (dw0, st) = d.admin(0x09, 0, 0, 0, [7, 3 | 3 << 16, 0, 0]);
    assert_eq!((dw0, st), (3 | 3 << 16, 0));
    d.io_queues(16);
    // Write 8 KiB (a PRP list is not needed: PRP2 is the second page), read it back.
    let pat: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    d.mem.write_slice(&pat, GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x01, 100, 15, DATA, DATA + 4096, 16), 0);
    d.mem.write_slice(&[0u8; 8192], GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x02, 100, 15, DATA, DATA + 4096, 16), 0);
    let mut back = vec![0u8; 8192];
    d.mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
    assert_eq!(back, pat);
    // Write Zeroes, then the data reads as zeros.
    assert_eq!(d.io(0x08, 100, 15, 0, 0, 16), 0);
    assert_eq!(d.io(0x02, 100, 0, DATA, 0, 16), 0);
    let z: u64 = d.mem.read_obj(GuestAddress(DATA)).unwrap();
    assert_eq!(z, 0);
    assert_eq!(d.io(0x00, 0, 0, 0, 0, 16), 0, "flush");
    // Many I/Os wrap the queues and flip the phase.
    for i in 0..40 {
        assert_eq!(d.io(0x02, i, 0, DATA, 0, 16), 0);
    }
    let c = d.n.counters();
    let get = |n: &str| c.iter().find(|x| x.name == n).unwrap().value;
    assert_eq!(get("io.reads"), 42);
    assert_eq!(get("errors"), 0);
}

#[test]
fn hostile_commands_get_nvme_statuses_and_the_controller_goes_on() {
    let img = TempImage::new("hostile");
    for backend in [StorageKind::Ram, StorageKind::File(img.0.clone())] {
        let create = matches!(backend, StorageKind::File(_));
        hostile_commands(Drv::new(NvmeConfig { create, ..mmio(backend) }));
    }
}

fn hostile_commands(mut d: Drv) {
    assert_eq!(d.admin(0x55, 0, 0, 0, [0; 4]).1, status::INVALID_OPCODE);
    assert_eq!(d.admin(0x06, 7, DATA, 0, [0, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    assert_eq!(d.admin(0x06, 0, 1 << 30, 0, [1, 0, 0, 0]).1, status::DATA_TRANSFER_ERROR, "PRP outside RAM");
    assert_eq!(d.admin(0x06, 0, DATA + 2, 0, [1, 0, 0, 0]).1, status::INVALID_PRP_OFFSET);
    // Queues: bad ids, sizes, a missing CQ, memory outside RAM, interrupts not offered.
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [15 << 16, 1, 0, 0]).1, status::INVALID_QID);
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [1 | 0xffff << 16, 1, 0, 0]).1, status::MAX_QSIZE_EXCEEDED);
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [1 | 15 << 16, 3 | 900 << 16, 0, 0]).1, status::INVALID_INTERRUPT_VECTOR);
    assert_eq!(d.admin(0x05, 0, 0xff000, 0, [1 | 4095 << 16, 1, 0, 0]).1, status::INVALID_FIELD);
    assert_eq!(d.admin(0x01, 0, IOSQ, 0, [1 | 15 << 16, 1 | 9 << 16, 0, 0]).1, status::CQ_INVALID);
    assert_eq!(d.admin(0x01, 0, IOSQ, 0, [999 | 15 << 16, 1 | 1 << 16, 0, 0]).1, status::INVALID_QID);
    d.io_queues(4);
    assert_eq!(d.admin(0x04, 0, 0, 0, [1, 0, 0, 0]).1, status::INVALID_QUEUE_DELETION, "CQ still in use");
    assert_eq!(d.admin(0x09, 0, 0, 0, [7, 1, 0, 0]).1, status::COMMAND_SEQUENCE_ERROR, "queues exist");
    // I/O: past the namespace, too large, bad opcode, bad namespace, PRP outside RAM.
    assert_eq!(d.io(0x02, 2047, 1, DATA, 0, 4), status::LBA_OUT_OF_RANGE);
    assert_eq!(d.io(0x02, u64::MAX, 0, DATA, 0, 4), status::LBA_OUT_OF_RANGE);
    assert_eq!(d.io(0x02, 0, 511, DATA, 0, 4), status::INVALID_FIELD, "256 KiB > MDTS");
    assert_eq!(d.io(0x7f, 0, 0, DATA, 0, 4), status::INVALID_OPCODE);
    assert_eq!(d.io(0x02, 0, 0, 0xfff00, 0x100000, 4), status::DATA_TRANSFER_ERROR);
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 4), status::SUCCESS, "still serving");
    // AER: an invalid doorbell value raises an error event.
    let e = d.sqe(0x0c, 0, 0, 0, [0; 4]);
    d.mem.write_slice(&e, GuestAddress(ASQ + d.atail as u64 * 64)).unwrap();
    d.atail = (d.atail + 1) % 32;
    d.w32(DOORBELLS, d.atail as u32);
    assert!(d.reap(ACQ, 32, true).is_none(), "an AER completes only with an event");
    d.w32(DOORBELLS + 8, 9); // tail 9 on a 4-entry SQ
    let ev = d.reap(ACQ, 32, true).expect("the AER completes");
    assert_eq!(ev, (1 << 8 | 1 << 16, 0), "error event: invalid doorbell write value, log page 1");
    d.w32(DOORBELLS + 4, d.ahead as u32);
    d.w32(DOORBELLS + 8 * 40, 1); // a queue that does not exist
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 4), status::SUCCESS);
    let c = d.n.counters();
    assert_eq!(c.iter().find(|x| x.name == "doorbell.invalid").unwrap().value, 2);
}

#[test]
fn a_full_cq_holds_submissions_until_the_host_frees_entries() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    d.io_queues(4);
    // Fill the SQ with 3 commands without reaping: a 4-entry CQ holds 3.
    for _ in 0..3 {
        let e = d.sqe(0x02, 1, DATA, 0, [0, 0, 0, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail = (d.iotail + 1) % 4;
    }
    d.w32(DOORBELLS + 8, d.iotail as u32);
    for _ in 0..3 {
        assert!(d.reap(IOCQ, 4, false).is_some());
    }
    // Three more while the host has not told the controller it reaped.
    for _ in 0..3 {
        let e = d.sqe(0x02, 1, DATA, 0, [0, 0, 0, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail = (d.iotail + 1) % 4;
    }
    d.w32(DOORBELLS + 8, d.iotail as u32);
    assert!(d.reap(IOCQ, 4, false).is_none(), "no room: nothing posted over unreaped entries");
    d.w32(DOORBELLS + 12, d.iohead as u32);
    for _ in 0..3 {
        assert!(d.reap(IOCQ, 4, false).is_some());
    }
}

#[test]
fn shm_doorbells_are_polled_with_eventidx_kept_behind_and_moved_only_when_it_lags() {
    let cfg = NvmeConfig {
        backend: StorageKind::Ram,
        size: 1 << 20,
        lba_size: 4096,
        doorbell: DoorbellMode::Shm,
        ..NvmeConfig::default()
    };
    let mut d = Drv::new(cfg);
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    d.io_queues(8);
    let before = d.n.counters().iter().find(|x| x.name == "doorbell.writes").unwrap().value;
    // The EventIdx rule (as in the guest's nvme.c and Linux): ring if `nw` passed `ev` since `old`.
    let need_event = |ev: u32, nw: u32, old: u32| (nw + 16 - ev - 1) % 8 < (nw + 8 - old) % 8;
    let (mut moves, mut last_ev) = (0, u32::MAX);
    for i in 0..20u64 {
        let e = d.sqe(0x02, 1, DATA, 0, [i as u32, 0, 0, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        let old = d.iotail as u32;
        d.iotail = (d.iotail + 1) % 8;
        d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
        let ev: u32 = d.mem.load(GuestAddress(EVIDX + 8), Ordering::Acquire).unwrap();
        assert!(!need_event(ev, d.iotail as u32, old), "submission {i}: EventIdx {ev} asks for a ring");
        let t0 = std::time::Instant::now();
        let r = loop {
            if let Some(r) = d.reap(IOCQ, 8, false) {
                break r;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "the poller did not serve the queue");
        };
        assert_eq!(r.1, 0);
        d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
        let ev: u32 = d.mem.load(GuestAddress(EVIDX + 8), Ordering::Acquire).unwrap();
        // Behind the tail (never in the next submission's way), by at most half the queue.
        let lag = (d.iotail as u32 + 8 - ev) % 8;
        assert!((1..=5).contains(&lag), "submission {i}: EventIdx {ev} for tail {}", d.iotail);
        moves += (ev != last_ev) as u32;
        last_ev = ev;
    }
    // Moved once every few submissions (each move is a line the driver fetches again), not each time.
    assert!((5..=11).contains(&moves), "EventIdx moved {moves} times in 20 submissions");
    let after = d.n.counters().iter().find(|x| x.name == "doorbell.writes").unwrap().value;
    assert_eq!(after, before, "no MMIO doorbell write for I/O");
    d.n.quiesce();
}

#[test]
fn mmio_mode_offers_no_doorbell_buffer_config_and_bad_lba_sizes_are_refused() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, status::INVALID_OPCODE);
    assert!(Nvme::new(NvmeConfig { lba_size: 1024, ..mmio(StorageKind::Null) }).is_err());
    assert!(Nvme::new(NvmeConfig { size: 1000, ..mmio(StorageKind::Null) }).is_err());
}

type Routes = Vec<(u16, Option<(u64, u32)>)>;

#[derive(Default)]
struct Irqs {
    routes: std::sync::Mutex<Routes>,
    signals: std::sync::Mutex<Vec<u16>>,
}
impl crate::Interrupts for Irqs {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, v: u16) -> bool {
        self.signals.lock().unwrap().push(v);
        true
    }
    fn msix_route(&self, v: u16, m: Option<(u64, u32)>) {
        self.routes.lock().unwrap().push((v, m));
    }
}

#[test]
fn msix_vectors_follow_the_table_and_fire_on_completions_or_stay_pending_while_masked() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    let irqs = Arc::new(Irqs::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = irqs.clone();
    d.n.attach(ctx);
    let caps = d.n.capabilities();
    assert_eq!(caps[0].id, crate::pci::PCI_CAP_ID_MSIX);
    // Vector 1: address 0xfee00000, data 0x45, unmasked; MSI-X enabled.
    d.n.bar_write(0, MSIX_TABLE + 16, &0xfee0_0000u64.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 24, &0x45u32.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    assert!(irqs.routes.lock().unwrap().iter().all(|(_, r)| r.is_none()), "no route while MSI-X is off");
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    assert!(irqs.routes.lock().unwrap().contains(&(1, Some((0xfee0_0000, 0x45)))));
    // A CQ with IEN on vector 1; an invalid vector is refused.
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [1 | 15 << 16, 3 | 900 << 16, 0, 0]).1, status::INVALID_INTERRUPT_VECTOR);
    d.io_queues_on_vector1();
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    assert_eq!(irqs.signals.lock().unwrap().as_slice(), [1]);
    // Masked: the completion sets the pending bit; unmasking fires it.
    d.n.bar_write(0, MSIX_TABLE + 28, &1u32.to_le_bytes());
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    assert_eq!(irqs.signals.lock().unwrap().len(), 1);
    let mut pba = [0u8; 8];
    d.n.bar_read(0, MSIX_PBA, &mut pba);
    // Vector 0 is the admin CQ's, which the guest left masked: its completions wait there too.
    assert_eq!(pba[0], 0b11, "vector 1 pending (and vector 0)");
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    assert_eq!(irqs.signals.lock().unwrap().as_slice(), [1, 1]);
    d.n.bar_read(0, MSIX_PBA, &mut pba);
    assert_eq!(pba[0], 0b01);
    // Hostile table accesses: odd sizes and offsets are dropped, reads stay in the table.
    d.n.bar_write(0, MSIX_TABLE + 17, &[1, 2, 3, 4]);
    d.n.bar_write(0, MSIX_TABLE + 16 * MSIX_VECTORS as u64 - 4, &u64::MAX.to_le_bytes());
    let mut b = [0u8; 4];
    d.n.bar_read(0, MSIX_TABLE + 24, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x45);
}

#[test]
fn interrupt_coalescing_holds_completions_to_the_threshold_or_the_time() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Shm, ..mmio(StorageKind::Null) };
    let mut d = Drv::new(cfg);
    let irqs = Arc::new(Irqs::default());
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = irqs.clone();
    d.n.attach(ctx);
    d.n.bar_write(0, MSIX_TABLE + 16, &0xfee0_0000u64.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 24, &0x45u32.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    // THR 3 (4 completions), TIME 200 x 100 us = 20 ms.
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x08, 200 << 8 | 3, 0, 0]).1, 0);
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x08, 0, 0, 0]).0, 200 << 8 | 3);
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [1 | 31 << 16, 3 | 1 << 16, 0, 0]).1, 0);
    assert_eq!(d.admin(0x01, 0, IOSQ, 0, [1 | 31 << 16, 1 | 1 << 16, 0, 0]).1, 0);
    let one_io = |d: &mut Drv| {
        let e = d.sqe(0x02, 1, DATA, 0, [0, 0, 0, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail = (d.iotail + 1) % 32;
        d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
        let t0 = std::time::Instant::now();
        while d.reap(IOCQ, 32, false).is_none() {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        }
        d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
    };
    let signals = |i: &Irqs| i.signals.lock().unwrap().len();
    // (A shared host may stall this thread past the 20 ms; then the time fired first.)
    let t = std::time::Instant::now();
    for _ in 0..3 {
        one_io(&mut d);
    }
    if t.elapsed() < std::time::Duration::from_millis(15) {
        assert_eq!(signals(&irqs), 0, "3 completions stay under the threshold");
    }
    one_io(&mut d);
    // The poller posts the entry, then signals: wait for the signal, not only the entry.
    let t1 = std::time::Instant::now();
    while signals(&irqs) < 1 {
        assert!(t1.elapsed() < std::time::Duration::from_secs(2), "the 4th completion never signalled");
        std::thread::yield_now();
    }
    if t.elapsed() < std::time::Duration::from_millis(15) {
        assert_eq!(signals(&irqs), 1, "the 4th reaches it");
    }
    let before = signals(&irqs);
    one_io(&mut d);
    let t0 = std::time::Instant::now();
    while signals(&irqs) < before + 1 {
        assert!(t0.elapsed() < std::time::Duration::from_secs(2), "the aggregation time never fired");
    }
    assert!(t0.elapsed() < std::time::Duration::from_millis(500));
    d.n.quiesce();
}

#[test]
fn an_async_event_waits_for_room_in_the_admin_cq() {
    // Admin queues of 2 entries: the CQ holds one unreaped completion at most.
    let mut d = Drv::with_admin(mmio(StorageKind::Null), 2);
    let submit = |d: &mut Drv, op: u8, prp: u64, cdw10: u32| {
        let e = d.sqe(op, 0, prp, 0, [cdw10, 0, 0, 0]);
        d.mem.write_slice(&e, GuestAddress(ASQ + d.atail as u64 * 64)).unwrap();
        d.atail = (d.atail + 1) % 2;
        d.w32(DOORBELLS, d.atail as u32);
    };
    submit(&mut d, 0x0c, 0, 0); // AER, outstanding
    submit(&mut d, 0x06, DATA, 1); // Identify: its completion now fills the CQ
    d.w32(DOORBELLS + 8 * 9, 1); // a doorbell of no queue: an error event
                                 // The event must not overwrite the unreaped Identify completion.
    let id = d.reap(ACQ, 2, true).unwrap();
    assert_eq!(id, (0, 0), "the Identify completion is intact");
    assert!(d.reap(ACQ, 2, true).is_none(), "no event while the CQ was full");
    d.w32(DOORBELLS + 4, d.ahead as u32); // the host frees the entry: the event goes out
    let ev = d.reap(ACQ, 2, true).expect("the AER completes once there is room");
    assert_eq!(ev.0 & 0xff07, 0, "error event, invalid doorbell register");
}

#[test]
fn the_controller_is_shared_without_an_outer_lock_and_survives_enable_cycles_under_concurrent_accesses() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Shm, ..mmio(StorageKind::Null) };
    let Drv { n, .. } = Drv::new(cfg);
    let n: crate::SharedDevice = Arc::new(n);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The other thread's accesses, counted as they happen: the enable cycles go on until it has
    // made some, so a busy host that schedules it late cannot turn the test into one thread's.
    let accesses = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let vcpu = {
        let (n, stop, accesses) = (n.clone(), stop.clone(), accesses.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut b = [0u8; 4];
                n.bar_read(0, 0x1c, &mut b);
                n.bar_write(0, DOORBELLS + 8, &1u32.to_le_bytes()); // a queue that does not exist
                accesses.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let csts = |n: &crate::SharedDevice| {
        let mut b = [0u8; 4];
        n.bar_read(0, 0x1c, &mut b);
        u32::from_le_bytes(b)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut cycles = 0;
    while cycles < 20 || accesses.load(Ordering::Relaxed) < 100 {
        assert!(std::time::Instant::now() < deadline, "the accessing thread never ran");
        n.bar_write(0, REG_CC, &0u32.to_le_bytes());
        assert_eq!(csts(&n) & 1, 0, "disabled");
        n.bar_write(0, REG_CC, &0x0046_0001u32.to_le_bytes());
        assert_eq!(csts(&n) & 1, 1, "enabled again (the poller restarted)");
        cycles += 1;
    }
    n.reset();
    assert_eq!(csts(&n), 0);
    stop.store(true, Ordering::Relaxed);
    vcpu.join().unwrap();
    n.quiesce();
    assert!(n.counters().iter().any(|c| c.name == "doorbell.invalid" && c.value > 0));
}

#[test]
fn options_round_trip_and_bad_geometry_names_its_option() {
    let all = [DoorbellMode::Mmio, DoorbellMode::Ioeventfd, DoorbellMode::Shm, DoorbellMode::Bar];
    for m in all.into_iter().chain([DoorbellMode::Adaptive, DoorbellMode::BarAdaptive]) {
        assert_eq!(m.to_string().parse::<DoorbellMode>().unwrap(), m);
    }
    let e = "shmm".parse::<DoorbellMode>().unwrap_err();
    assert!(matches!(&e, crate::Error::Option { option, .. } if option == "doorbell"), "{e}");
    let e = Nvme::new(NvmeConfig { lba_size: 1024, ..mmio(StorageKind::Null) }).err().unwrap();
    assert!(matches!(&e, crate::Error::Option { option, .. } if option == "lba"), "{e}");
    let e = Nvme::new(NvmeConfig { size: 1000, ..mmio(StorageKind::Null) }).err().unwrap();
    assert!(matches!(&e, crate::Error::Option { option, .. } if option == "size_mb"), "{e}");
}

/// Vectors a vfio-user client (QEMU) gave eventfds for; it emulates the MSI-X
/// table itself and forwards no table write.
fn client_lines(vectors: &[u16]) -> (Arc<crate::irq::IrqLines>, Vec<vmm_sys_util::eventfd::EventFd>) {
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    let lines = crate::irq::IrqLines::new();
    let fds: Vec<EventFd> = vectors.iter().map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
    for (v, fd) in vectors.iter().zip(&fds) {
        lines.set_msix(*v as usize, vec![Some(fd.try_clone().unwrap())]);
    }
    (lines, fds)
}

/// A `mmio` controller on `null` whose host is a client with an eventfd per
/// vector in `vectors` (see [`client_lines`]).
fn with_client_lines(vectors: &[u16]) -> (Drv, Arc<crate::irq::IrqLines>, Vec<vmm_sys_util::eventfd::EventFd>) {
    let d = Drv::new(mmio(StorageKind::Null));
    let (lines, fds) = client_lines(vectors);
    let mut ctx = DeviceContext::detached(d.mem.clone());
    ctx.irq = lines.clone();
    d.n.attach(ctx);
    (d, lines, fds)
}

fn counter(n: &Nvme, name: &str) -> u64 {
    n.counters().iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

#[test]
fn a_client_that_owns_the_msix_table_gets_every_raised_vector_on_its_eventfd() {
    let (mut d, lines, fds) = with_client_lines(&[0, 1]);
    // The client forwards the Message Control write (MSI-X on) but no table
    // write: the controller's own table keeps every vector masked.
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    // The admin CQ signals vector 0 (its interrupts are always enabled).
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, 0);
    assert_eq!(fds[0].read().ok(), Some(1), "admin completion on vector 0");
    d.io_queues_on_vector1();
    let _ = fds[0].read();
    for _ in 0..3 {
        assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    }
    assert_eq!(fds[1].read().ok(), Some(3), "one signal per completion on vector 1");
    assert_eq!(counter(&d.n, "msix.interrupts"), 3 + 3, "3 admin + 3 I/O");
    // A vector without an eventfd yet is held, and signalled when one arrives.
    assert_eq!(d.admin(0x05, 0, 0x14000, 0, [2 | 15 << 16, 3 | 2 << 16, 0, 0]).1, 0);
    assert_eq!(d.admin(0x01, 0, 0x15000, 0, [2 | 15 << 16, 1 | 2 << 16, 0, 0]).1, 0);
    let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
    d.mem.write_slice(&e, GuestAddress(0x15000)).unwrap();
    d.w32(DOORBELLS + 16, 1);
    let dw3: u32 = d.mem.read_obj(GuestAddress(0x14000 + 12)).unwrap();
    assert_eq!(dw3 >> 16 & 1, 1, "the completion is posted");
    let late = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
    lines.set_msix(2, vec![Some(late.try_clone().unwrap())]);
    assert_eq!(late.read().ok(), Some(1), "the held vector 2 fires when its eventfd arrives");
    // The client takes its eventfds back (MSI-X off): the controller's table rules again.
    lines.clear_msix();
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    assert!(fds[1].read().is_err(), "no longer signalled");
    let mut pba = [0u8; 1];
    d.n.bar_read(0, MSIX_PBA, &mut pba);
    assert_eq!(pba[0] & 0b10, 0b10, "vector 1 pending in the controller's own PBA");
}

#[test]
fn the_completions_of_one_doorbell_pass_share_one_msix_message() {
    let (mut d, _, fds) = with_client_lines(&[0, 1]);
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    d.io_queues_on_vector1();
    let _ = fds[0].read();
    let before = counter(&d.n, "msix.interrupts");
    // Five commands, one SQ tail doorbell: one pass posts five entries.
    let cmds: Vec<_> = (0..5u64).map(|i| (0x02, i, 0, DATA)).collect();
    let cids = d.submit_batch(&cmds, IOSQ, 16);
    let done = d.reap_batch(5, IOCQ, 16);
    assert_eq!(done, cids.iter().map(|&c| (c, 0)).collect::<Vec<_>>(), "posted, successful");
    assert_eq!(fds[1].read().ok(), Some(1), "one message for the pass's five completions");
    assert_eq!(counter(&d.n, "msix.interrupts") - before, 1);
    assert_eq!(counter(&d.n, "msix.merged"), 4, "the other four merged into it");
    // The next pass signals again: a message is never held past its pass.
    d.submit_batch(&[(0x02, 0, 0, DATA)], IOSQ, 16);
    assert_eq!(fds[1].read().ok(), Some(1), "the next pass's own message");
    assert_eq!(counter(&d.n, "msix.merged"), 4);
}

#[test]
fn a_client_that_programs_the_msix_table_keeps_the_controllers_masking() {
    // iopath's own vfio-user proxy forwards table writes and hands eventfds
    // over: the controller's table stays authoritative, so a masked vector
    // is held pending and fires on unmask.
    let (mut d, _, fds) = with_client_lines(&[1]);
    d.n.bar_write(0, MSIX_TABLE + 16, &0xfee0_0000u64.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 24, &0x45u32.to_le_bytes());
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    d.n.config_write(MSIX_CAP + 2, &0x8000u16.to_le_bytes());
    d.io_queues_on_vector1();
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    assert_eq!(fds[0].read().ok(), Some(1));
    d.n.bar_write(0, MSIX_TABLE + 28, &1u32.to_le_bytes());
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 16), 0);
    assert!(fds[0].read().is_err(), "masked in the table the client programs: held");
    d.n.bar_write(0, MSIX_TABLE + 28, &0u32.to_le_bytes());
    assert_eq!(fds[0].read().ok(), Some(1), "fired on unmask");
}

impl Drv {
    /// Waits up to 5 s for the next completion of the I/O CQ (device threads post it).
    fn reap_io_wait(&mut self, size: u16) -> (u16, u16) {
        let t0 = std::time::Instant::now();
        loop {
            let a = IOCQ + self.iohead as u64 * 16;
            if let Some((_, st)) = self.reap(IOCQ, size, false) {
                let dw3: u32 = self.mem.read_obj(GuestAddress(a + 12)).unwrap();
                return (dw3 as u16, st);
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "no completion");
            std::thread::yield_now();
        }
    }
    /// Rings I/O queue 1's SQ tail or CQ head the way `mode` delivers doorbells.
    fn ring1(&mut self, mode: DoorbellMode, cq: bool, v: u32) {
        let off = 8 + if cq { 4 } else { 0 };
        if matches!(mode, DoorbellMode::Shm | DoorbellMode::Ioeventfd) {
            self.mem.store(v, GuestAddress(DBBUF + off), Ordering::Release).unwrap();
        }
        if mode != DoorbellMode::Shm {
            self.w32(DOORBELLS + off, v);
        }
    }
}

#[test]
fn a_recreated_io_queue_starts_from_zeroed_doorbells_in_every_mode() {
    let modes = [DoorbellMode::Mmio, DoorbellMode::Ioeventfd, DoorbellMode::Shm, DoorbellMode::Bar];
    for mode in modes.into_iter().chain([DoorbellMode::BarAdaptive]) {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let mut d = Drv::new(cfg);
        if matches!(mode, DoorbellMode::Shm | DoorbellMode::Ioeventfd) {
            assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0, "{mode}");
        }
        // Round 0 submits 3 commands, round 1 (the same queue ids, created again) one.
        for n in [3u16, 1] {
            d.mem.write_slice(&[0u8; 8 * 16], GuestAddress(IOCQ)).unwrap();
            (d.iotail, d.iohead, d.iophase) = (0, 0, 1);
            d.io_queues(8);
            let mut cids = Vec::new();
            for _ in 0..n {
                let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
                cids.push(d.cid);
                d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
                d.iotail += 1;
            }
            d.ring1(mode, false, d.iotail as u32);
            for cid in cids {
                assert_eq!(d.reap_io_wait(8), (cid, 0), "{mode}: round of {n}");
            }
            d.ring1(mode, true, d.iohead as u32);
            std::thread::sleep(std::time::Duration::from_millis(30));
            assert!(d.reap(IOCQ, 8, false).is_none(), "{mode}: exactly {n} completion(s), nothing stale");
            assert_eq!(d.admin(0x00, 0, 0, 0, [1, 0, 0, 0]).1, 0, "{mode}: delete SQ 1");
            assert_eq!(d.admin(0x04, 0, 0, 0, [1, 0, 0, 0]).1, 0, "{mode}: delete CQ 1");
        }
        d.n.quiesce();
    }
}

impl Drv {
    /// Submits an Asynchronous Event Request (it completes when an event comes).
    fn submit_aer(&mut self) -> u16 {
        let e = self.sqe(0x0c, 0, 0, 0, [0; 4]);
        self.mem.write_slice(&e, GuestAddress(ASQ + self.atail as u64 * 64)).unwrap();
        self.atail = (self.atail + 1) % 32;
        self.w32(DOORBELLS, self.atail as u32);
        self.cid
    }
    fn queued_events(&self) -> usize {
        self.n.core.lock().unwrap().events.queued.len()
    }
}

#[test]
fn a_doorbell_flood_keeps_one_pending_event_per_type_and_info() {
    // bar-adaptive: the writes exit while its poller sleeps, each waking it to refuse the tail.
    for mode in [DoorbellMode::Mmio, DoorbellMode::Bar, DoorbellMode::BarAdaptive] {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let mut d = Drv::new(cfg);
        d.io_queues(4);
        for i in 0..100_000u32 {
            d.w32(DOORBELLS + 8, 0xffff_ffff); // invalid doorbell write value
            if mode == DoorbellMode::Mmio {
                d.w32(DOORBELLS + 8 * 40, 1); // invalid doorbell register
            }
            if i % 1000 == 0 {
                assert!(d.queued_events() <= 2, "{mode}: {} events queued", d.queued_events());
            }
        }
        assert!(d.queued_events() <= 2, "{mode}: {} events queued", d.queued_events());
        // The last bad value stays in a polled page until the poller looks: on a loaded
        // host (the other tests) it may not have run during the flood.
        let t0 = std::time::Instant::now();
        while counter(&d.n, "doorbell.invalid") == 0 && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        d.n.quiesce();
        let invalid = counter(&d.n, "doorbell.invalid");
        assert!(invalid > 0, "{mode}");
        assert_eq!(counter(&d.n, "events.dropped"), invalid - d.queued_events() as u64, "{mode}");
    }
}

#[test]
fn an_event_type_reported_is_not_reported_again_until_its_log_page_is_read() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    d.io_queues(4);
    let (a1, a2) = (d.submit_aer(), d.submit_aer());
    d.w32(DOORBELLS + 8, 9); // invalid value: error event, info 1, log page 1
    d.w32(DOORBELLS + 8 * 40, 1); // invalid register: error event, info 0
    let ev = d.reap(ACQ, 32, true).expect("the first AER completes");
    assert_eq!(ev, (1 << 8 | 1 << 16, 0));
    assert!(d.reap(ACQ, 32, true).is_none(), "an error event is outstanding: the second waits");
    d.w32(DOORBELLS + 4, d.ahead as u32);
    // Reading the error log with RAE (bit 15) set keeps the event outstanding.
    assert_eq!(d.admin(0x02, 0, DATA, 0, [1 | 1 << 15 | 15 << 16, 0, 0, 0]).1, 0);
    assert!(d.reap(ACQ, 32, true).is_none(), "retained");
    // Reading it clears the event, and what it reported with it.
    assert_eq!(d.admin(0x02, 0, DATA, 0, [1 | 15 << 16, 0, 0, 0]).1, 0);
    assert!(d.reap(ACQ, 32, true).is_none(), "the queued error was reported by the log page");
    d.w32(DOORBELLS + 8 * 40, 1);
    let ev = d.reap(ACQ, 32, true).expect("a new error is reported");
    assert_eq!(ev, (1 << 16, 0));
    let _ = (a1, a2);
}

impl Drv {
    /// Runs an admin command that returns data to DATA and returns (status, the data).
    fn admin_data(&mut self, op: u8, nsid: u32, cdw: [u32; 4], len: usize) -> (u16, Vec<u8>) {
        self.mem.write_slice(&vec![0xa5u8; 8192], GuestAddress(DATA)).unwrap();
        let st = self.admin(op, nsid, DATA, DATA + 4096, cdw).1;
        let mut b = vec![0u8; len];
        self.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
        (st, b)
    }
    /// Get Log Page `lid` of `len` bytes (a multiple of 4) from byte offset `off`.
    fn log_page(&mut self, lid: u8, off: u64, len: usize) -> (u16, Vec<u8>) {
        let numd = (len / 4 - 1) as u32;
        let cdw = [lid as u32 | 1 << 15 | (numd & 0xffff) << 16, numd >> 16, off as u32, (off >> 32) as u32];
        self.admin_data(0x02, 0xffff_ffff, cdw, len)
    }
}

/// `serial=`, `nqn=`, `cntlid=` as Identify Controller reports them, and
/// the namespace ids they give: the same options, the same ids.
#[test]
fn identify_reports_the_identity_options() {
    let id = |serial: &str, nqn: &str, cntlid: u16| identity::IdentityOptions {
        serial: Some(serial.into()),
        nqn: Some(nqn.into()),
        cntlid: Some(cntlid),
    };
    let nqn = "nqn.2014-08.com.example:nvme:disk-7";
    let cfg = |id| NvmeConfig { id, ..mmio(StorageKind::Null) };
    let mut d = Drv::new(cfg(id("SN-0042", nqn, 0x1234)));
    let (st, ctrl) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
    assert_eq!(st, 0);
    assert_eq!(&ctrl[4..24], b"SN-0042             ", "SN, space padded");
    assert_eq!(u16::from_le_bytes([ctrl[78], ctrl[79]]), 0x1234, "CNTLID");
    assert_eq!(&ctrl[768..768 + nqn.len()], nqn.as_bytes(), "SUBNQN");
    assert!(ctrl[768 + nqn.len()..1024].iter().all(|&b| b == 0), "NUL-terminated, zero filled");
    let list = d.admin_data(0x06, 1, [3, 0, 0, 0], 4096).1;
    let (nguid, uuid) = (list[4..20].to_vec(), list[24..40].to_vec());
    assert_eq!((list[0], list[1], list[20], list[21]), (2, 16, 3, 16), "NGUID then UUID descriptors");
    assert_eq!((uuid[6] >> 4, uuid[8] >> 6), (8, 0b10), "an RFC 9562 version 8 UUID");
    // Another instance with the same serial and NQN: the same namespace ids
    // (another CNTLID is the host's business); another serial: others.
    let mut e = Drv::new(cfg(id("SN-0042", nqn, 2)));
    assert_eq!(e.admin_data(0x06, 1, [3, 0, 0, 0], 4096).1, list);
    let mut f = Drv::new(cfg(id("SN-0043", nqn, 2)));
    let l = f.admin_data(0x06, 1, [3, 0, 0, 0], 4096).1;
    assert!(l[4..20] != nguid[..] && l[24..40] != uuid[..]);
    // A 223-byte NQN fills the field up to its terminating NUL.
    let long = format!("nqn.2014-08.com.example:{}", "n".repeat(223 - 24));
    let mut g = Drv::new(cfg(id("X", &long, 1)));
    let ctrl = g.admin_data(0x06, 0, [1, 0, 0, 0], 4096).1;
    assert_eq!(&ctrl[768..768 + 223], long.as_bytes());
    assert!(ctrl[768 + 223..1024].iter().all(|&b| b == 0));
    // Invalid options never make a controller.
    assert!(Nvme::new(cfg(id("", nqn, 1))).is_err());
    assert!(Nvme::new(cfg(id("S", "nqn.x", 1))).is_err());
    assert!(Nvme::new(cfg(id("S", nqn, 0))).is_err());
}

#[test]
fn identify_gives_namespace_descriptors_a_subsystem_nqn_and_matching_namespace_ids() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    let (st, ctrl) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
    assert_eq!(st, 0);
    let serial = std::str::from_utf8(&ctrl[4..24]).unwrap().trim_end().to_string();
    let nqn = &ctrl[768..1024];
    let end = nqn.iter().position(|&b| b == 0).expect("SUBNQN is NUL-terminated");
    assert_eq!(std::str::from_utf8(&nqn[..end]).unwrap(), format!("nqn.2026-11.io.iopath:nvme:{serial}"));
    assert!(nqn[end..].iter().all(|&b| b == 0));
    // CNS 03h: a descriptor list (NIDT, NIDL, 2 reserved, NID) ended by a zero NIDT.
    let (st, list) = d.admin_data(0x06, 1, [3, 0, 0, 0], 4096);
    assert_eq!(st, 0, "Namespace Identification Descriptor list");
    let mut ids = std::collections::BTreeMap::new();
    let mut p = 0;
    while list[p] != 0 {
        let (t, l) = (list[p], list[p + 1] as usize);
        assert!(ids.insert(t, list[p + 4..p + 4 + l].to_vec()).is_none(), "one descriptor per type");
        p += 4 + l;
    }
    assert!(list[p..].iter().all(|&b| b == 0));
    let (nguid, uuid) = (ids[&2].clone(), ids[&3].clone());
    assert_eq!((nguid.len(), uuid.len()), (16, 16));
    assert!(nguid.iter().any(|&b| b != 0) && uuid.iter().any(|&b| b != 0));
    assert_eq!((uuid[6] >> 4, uuid[8] >> 6), (8, 0b10), "an RFC 9562 version 8 UUID");
    assert!(!ids.contains_key(&1), "no EUI64");
    // Identify Namespace carries the same NGUID and no EUI64.
    let (st, ns) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!(st, 0);
    assert_eq!(&ns[104..120], &nguid[..], "NGUID as in the descriptor");
    assert_eq!(&ns[120..128], &[0u8; 8], "EUI64 not reported");
    // Stable for the instance: asked again, the same ids.
    assert_eq!(d.admin_data(0x06, 1, [3, 0, 0, 0], 4096).1, list);
    assert_eq!(d.admin_data(0x06, 0, [1, 0, 0, 0], 4096).1, ctrl);
    // Another instance with no identity options is another controller: SN,
    // SUBNQN, NGUID and UUID differ (Linux refuses a second controller of one
    // subsystem with the same CNTLID, and merges namespaces with one NGUID).
    let mut e = Drv::new(mmio(StorageKind::Null));
    let other = e.admin_data(0x06, 0, [1, 0, 0, 0], 4096).1;
    assert_ne!(other[4..24], ctrl[4..24], "SN");
    assert_ne!(other[768..1024], ctrl[768..1024], "SUBNQN");
    let other_list = e.admin_data(0x06, 1, [3, 0, 0, 0], 4096).1;
    assert_ne!(other_list[4..20], list[4..20], "NGUID");
    assert_ne!(other_list[24..40], list[24..40], "UUID");
    // Only namespace 1 exists; the active namespace list refuses the reserved ids.
    assert_eq!(d.admin(0x06, 2, DATA, 0, [3, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    assert_eq!(d.admin(0x06, 0xffff_ffff, DATA, 0, [3, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    assert_eq!(d.admin(0x06, 0xffff_fffe, DATA, 0, [2, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    let (st, active) = d.admin_data(0x06, 0, [2, 0, 0, 0], 8);
    assert_eq!((st, &active[..]), (0, &[1u8, 0, 0, 0, 0, 0, 0, 0][..]));
}

#[test]
fn the_effects_log_marks_exactly_the_commands_the_controller_implements() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Shm] {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let mut d = Drv::new(cfg);
        let (_, ctrl) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
        assert_eq!(ctrl[261] & 0b110, 0b110, "LPA: effects log, extended data (NUMDU, offsets)");
        let (st, log) = d.log_page(0x05, 0, 4096);
        assert_eq!(st, 0, "{mode}: Commands Supported and Effects");
        let dword = |i: usize| u32::from_le_bytes(log[4 * i..4 * i + 4].try_into().unwrap());
        d.io_queues(16);
        for op in 0..=255u8 {
            let (acs, iocs) = (dword(op as usize), dword(256 + op as usize));
            // Every admin opcode without CSUPP answers Invalid Opcode, every one with it does not.
            // (An AER completes only with an event; Doorbell Buffer Config, below, moves the doorbells.)
            if !matches!(op, 0x0c | 0x7c) {
                let st = d.admin(op, 0, 0, 0, [0; 4]).1;
                assert_eq!(acs & 1 == 1, st != status::INVALID_OPCODE, "{mode}: admin {op:#04x}: {st:#x}");
            }
            let st = d.io(op, 0, 0, 0, 0, 16);
            assert_eq!(iocs & 1 == 1, st != status::INVALID_OPCODE, "{mode}: I/O {op:#04x}: {st:#x}");
            assert_eq!(iocs & 2 != 0, matches!(op, 0x01 | 0x08 | 0x09), "{mode}: LBCC of {op:#04x}");
            // Format NVM alone changes LBA contents and the namespace's capability, and
            // wants no other command to the namespace while it runs (CSE 001b).
            let effects = if op == 0x80 { 0b110 | 1 << 16 } else { 0 };
            assert_eq!(acs & !1, effects, "{mode}: admin {op:#04x}'s effects");
        }
        let acs = |op: usize| dword(op) & 1;
        assert_eq!((acs(0x0c), acs(0x7c)), (1, (mode == DoorbellMode::Shm) as u32), "{mode}: AER, DBBC");
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1 == status::INVALID_OPCODE, acs(0x7c) == 0);
        d.n.quiesce();
    }
}

#[test]
fn get_log_page_reads_from_its_offset_within_bounds() {
    let mut d = Drv::new(mmio(StorageKind::Null));
    let (_, full) = d.log_page(0x05, 0, 4096);
    let (st, part) = d.log_page(0x05, 4096 - 8, 8);
    assert_eq!((st, &part[..]), (0, &full[4088..]), "the last two dwords");
    let (st, part) = d.log_page(0x05, 0x40, 12);
    assert_eq!((st, &part[..]), (0, &full[0x40..0x4c]));
    let (st, smart) = d.log_page(0x02, 0, 512);
    let (st2, tail) = d.log_page(0x02, 500, 16);
    assert_eq!((st, st2), (0, 0));
    assert_eq!(&tail[..12], &smart[500..], "past the end of the page reads as zeros");
    assert_eq!(&tail[12..], &[0u8; 4]);
    assert_eq!(d.log_page(0x05, 2, 8).0, status::INVALID_FIELD, "not dword aligned");
    assert_eq!(d.log_page(0x05, 4100, 8).0, status::INVALID_FIELD, "past the log page");
    assert_eq!(d.log_page(0x05, u64::MAX - 3, 8).0, status::INVALID_FIELD);
    assert_eq!(d.log_page(0x03, 512, 4).0, status::SUCCESS, "at the end: zeros");
}

#[test]
fn identify_controller_advertises_only_what_the_controller_implements() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Ioeventfd, DoorbellMode::Shm, DoorbellMode::Bar] {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let mut d = Drv::new(cfg);
        let (_, c) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
        let shadow = matches!(mode, DoorbellMode::Shm | DoorbellMode::Ioeventfd);
        let oacs = (shadow as u16) << 8 | 1 << 1;
        assert_eq!(u16::from_le_bytes([c[256], c[257]]), oacs, "{mode}: OACS: Format NVM, DBBC where offered");
        d.n.quiesce();
    }
    let mut d = Drv::new(mmio(StorageKind::Ram));
    let (_, c) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
    // Firmware: one slot, read-only (no Firmware Download or Commit).
    assert_eq!(c[260], 0b11, "FRMW");
    assert_eq!(d.admin(0x10, 0, 0, 0, [0; 4]).1, status::INVALID_OPCODE);
    assert_eq!(d.admin(0x11, 0, 0, 0, [0; 4]).1, status::INVALID_OPCODE);
    assert_eq!(c[261], 0b110, "LPA: no per-namespace SMART, effects log, extended data");
    assert_eq!(u16::from_le_bytes([c[520], c[521]]), 0b1100, "ONCS: DSM and Write Zeroes");
    assert_eq!(c[525] & 1, 1, "VWC present");
    let (wctemp, cctemp) = (u16::from_le_bytes([c[266], c[267]]), u16::from_le_bytes([c[268], c[269]]));
    assert!(wctemp > 0 && cctemp > wctemp, "temperature thresholds reported");
    assert_eq!(&c[64..72], b"1.0     ");
    let (_, fw) = d.log_page(0x03, 0, 512);
    assert_eq!((fw[0], &fw[8..16]), (1, &b"1.0     "[..]), "slot 1 active, the revision Identify gives");
    // Volatile Write Cache: enabled, and the host may turn it off.
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x06, 0, 0, 0]), (1, 0));
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x06, 0, 0, 0]).1, 0);
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x06, 0, 0, 0]), (0, 0));
    d.io_queues(16);
    assert_eq!(d.io(0x01, 0, 0, DATA, 0, 16), 0, "write-through");
    // The features the controller keeps read back as set; values it cannot honour are refused.
    for (fid, v) in [(0x01, 0x0302_0103), (0x04, 0x0150), (0x05, 0x20), (0x0a, 1), (0x0b, 0x02)] {
        assert_eq!(d.admin(0x09, 0, 0, 0, [fid, v, 0, 0]).1, 0, "set {fid:#x}");
        assert_eq!(d.admin(0x0a, 0, 0, 0, [fid, 0, 0, 0]), (v, 0), "get {fid:#x}");
    }
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x04, 1 << 20, 0, 0]), (0, 0), "under-temperature threshold");
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x04, 3 << 16, 0, 0]).1, status::INVALID_FIELD, "no sensor 3");
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x02, 1, 0, 0]).1, status::INVALID_FIELD, "one power state");
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x05, 1 << 16, 0, 0]).1, status::INVALID_FIELD, "no DULBE");
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x07 | 1 << 31, 0, 0, 0]).1, status::FEATURE_NOT_SAVEABLE);
    // Interrupt Vector Configuration: per vector, for vectors that exist.
    assert_eq!(d.admin(0x09, 0, 0, 0, [0x09, 1 | 1 << 16, 0, 0]).1, 0);
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x09, 1, 0, 0]), (1 | 1 << 16, 0));
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x09, 2, 0, 0]), (2, 0));
    assert_eq!(d.admin(0x0a, 0, 0, 0, [0x09, 900, 0, 0]).1, status::INVALID_FIELD);
}

#[test]
fn registers_the_controller_does_not_implement_read_as_zero() {
    // Linux reads CMBSZ (0x3c) and CMBLOC (0x38): all-ones there is a controller memory buffer.
    let mut d = Drv::new(mmio(StorageKind::Null));
    for off in [0x38, 0x3c, 0x40, 0x50, 0x58, 0xe00, 0xffc] {
        assert_eq!(d.r32(off), 0, "{off:#x}");
    }
    let mut b = [0xaau8; 8];
    d.n.bar_read(0, REG_ACQ + 4, &mut b);
    assert_eq!(b, [0; 8], "ACQ's high dword, then CMBLOC");
}

#[test]
fn a_late_register_doorbell_does_not_rewind_a_shadowed_queue() {
    // Over vfio-user the guest's doorbell register writes are posted messages: one the EventIdx
    // rule asked for can arrive after the poller already served newer shadow tails. Its value
    // must not be taken as the tail (the controller would serve the whole ring again).
    for mode in [DoorbellMode::Shm, DoorbellMode::Ioeventfd] {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let mut d = Drv::new(cfg);
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        d.io_queues(8);
        let mut cids = Vec::new();
        for _ in 0..3 {
            let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
            cids.push(d.cid);
            d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
            d.iotail += 1;
            d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
            if mode == DoorbellMode::Ioeventfd {
                d.w32(DOORBELLS + 8, d.iotail as u32); // no ioeventfd here: the write exits
            }
        }
        for cid in cids {
            assert_eq!(d.reap_io_wait(8), (cid, 0), "{mode}");
        }
        d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
        d.w32(DOORBELLS + 8, 1); // the register write of the first submission, late
        d.w32(DOORBELLS + 12, 1); // and a late CQ head
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert!(d.reap(IOCQ, 8, false).is_none(), "{mode}: nothing served again");
        assert_eq!(counter(&d.n, "io.commands"), 3, "{mode}");
        // The queue goes on from the shadow.
        let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail += 1;
        d.ring1(mode, false, d.iotail as u32);
        assert_eq!(d.reap_io_wait(8), (d.cid, 0), "{mode}");
        d.n.quiesce();
    }
}

/// Guest memory the device reaches through a port, as a vfio-user server
/// reaches a client's RAM without an fd: here the port copies to and from
/// the driver's own memory, and counts.
struct MirrorPort {
    mem: GuestMemoryMmap,
    reads: std::sync::atomic::AtomicU64,
    writes: std::sync::atomic::AtomicU64,
    fail: std::sync::atomic::AtomicBool,
}

impl crate::DmaPort for MirrorPort {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> crate::mem::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        if self.fail.load(Ordering::Relaxed) {
            return Err(crate::mem::MemError::Remote { gpa, len: buf.len(), reason: "gone".into() });
        }
        self.mem.read_slice(buf, GuestAddress(gpa)).map_err(|_| crate::mem::MemError::Unmapped { gpa, len: buf.len() })
    }
    fn write(&self, gpa: u64, data: &[u8]) -> crate::mem::Result<()> {
        self.writes.fetch_add(1, Ordering::Relaxed);
        if self.fail.load(Ordering::Relaxed) {
            return Err(crate::mem::MemError::Remote { gpa, len: data.len(), reason: "gone".into() });
        }
        self.mem
            .write_slice(data, GuestAddress(gpa))
            .map_err(|_| crate::mem::MemError::Unmapped { gpa, len: data.len() })
    }
}

/// A driver whose guest RAM (1 MiB) the device reaches through a port from
/// `remote_from` up; below it the device maps it.
fn remote_drv(cfg: NvmeConfig, remote_from: u64) -> (Drv, Arc<MirrorPort>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
    let port = Arc::new(MirrorPort {
        mem: mem.clone(),
        reads: Default::default(),
        writes: Default::default(),
        fail: Default::default(),
    });
    // The device's mapped part: the same bytes as the driver's, below `remote_from`.
    let host = vm_memory::GuestMemoryBackend::get_host_address(&mem, GuestAddress(0)).unwrap();
    let mapped = if remote_from == 0 {
        GuestMemoryMmap::from_regions(Vec::new()).unwrap_or_default()
    } else {
        // SAFETY: `host` maps 1 MiB that `mem` keeps alive for the test (the
        // driver holds it); the region covers only its first `remote_from` bytes.
        let r = unsafe {
            vm_memory::MmapRegion::build_raw(
                host,
                remote_from as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
            )
        }
        .unwrap();
        GuestMemoryMmap::from_regions(vec![vm_memory::GuestRegionMmap::new(r, GuestAddress(0)).unwrap()]).unwrap()
    };
    let dev = crate::GuestMem::with_remote(mapped, &[(remote_from, (1 << 20) - remote_from)], port.clone()).unwrap();
    (Drv::with_device_mem(cfg, 32, mem, dev), port)
}

/// Writes 16 KiB (PRP1 and a PRP list) from DATA and reads it back into
/// DATA + 0x8000 (queues at 0x10000-0x13fff, the list at 0x30000).
fn remote_round_trip(d: &mut Drv) {
    let pat: Vec<u8> = (0..16384u32).map(|i| (i * 13 + 5) as u8).collect();
    d.mem.write_slice(&pat, GuestAddress(DATA)).unwrap();
    for (i, p) in [DATA + 0x1000, DATA + 0x2000, DATA + 0x3000].iter().enumerate() {
        d.mem.write_obj(*p, GuestAddress(0x30000 + 8 * i as u64)).unwrap();
    }
    assert_eq!(d.io(0x01, 8, 31, DATA, 0x30000, 16), 0, "write through the port");
    for (i, p) in [DATA + 0x9000, DATA + 0xa000, DATA + 0xb000].iter().enumerate() {
        d.mem.write_obj(*p, GuestAddress(0x30000 + 8 * i as u64)).unwrap();
    }
    assert_eq!(d.io(0x02, 8, 31, DATA + 0x8000, 0x30000, 16), 0, "read through the port");
    let mut back = vec![0u8; 16384];
    d.mem.read_slice(&mut back, GuestAddress(DATA + 0x8000)).unwrap();
    assert_eq!(back, pat);
}

#[test]
fn guest_ram_reached_only_through_a_port_serves_admin_and_io_in_mmio_mode() {
    let (mut d, port) = remote_drv(mmio(StorageKind::Ram), 0);
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, 0, "Identify into memory reached by message");
    assert_eq!(d.mem.read_obj::<u16>(GuestAddress(DATA)).unwrap(), VENDOR);
    d.io_queues(16);
    let before = port.reads.load(Ordering::Relaxed);
    remote_round_trip(&mut d);
    // Each 16 KiB I/O: the SQE, the PRP list (one read), the data (one run of
    // four pages), the CQE (entry, then the phase dword).
    let reads = port.reads.load(Ordering::Relaxed) - before;
    assert!(reads <= 6, "{reads} DMA reads for two I/Os");
    assert_eq!(counter(&d.n, "errors"), 0);
}

#[test]
fn guest_ram_reached_through_a_port_serves_the_bar_mode_poller_and_a_mixed_map() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Bar, ..mmio(StorageKind::Ram) };
    // Queues mapped, data and PRP lists (0x20000 up) reached by message.
    let (mut d, port) = remote_drv(cfg, 0x20000);
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, 0);
    assert_eq!(d.mem.read_obj::<u16>(GuestAddress(DATA)).unwrap(), VENDOR);
    d.io_queues(16);
    let io_reads = port.reads.load(Ordering::Relaxed);
    remote_round_trip(&mut d);
    assert!(port.reads.load(Ordering::Relaxed) > io_reads && port.writes.load(Ordering::Relaxed) > 0);
    // A port that fails makes the command fail, and the controller goes on.
    port.fail.store(true, Ordering::Relaxed);
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, status::DATA_TRANSFER_ERROR);
    port.fail.store(false, Ordering::Relaxed);
    assert_eq!(d.admin(0x06, 0, DATA, 0, [1, 0, 0, 0]).1, 0);
    d.n.quiesce();
}

#[test]
fn shadow_doorbells_in_memory_reached_by_message_are_refused_and_mmio_doorbells_serve() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Shm, ..mmio(StorageKind::Ram) };
    let (mut d, port) = remote_drv(cfg, 0x20000);
    // DBBUF (0x30000) is reached by message: polling it would be a message per look.
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, status::INVALID_FIELD);
    d.io_queues(16);
    let before = port.reads.load(Ordering::Relaxed);
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(port.reads.load(Ordering::Relaxed), before, "the poller sends nothing while idle");
    remote_round_trip(&mut d);
    assert!(counter(&d.n, "doorbell.writes") > 0, "served from MMIO doorbell writes");
    // Shadow pages in mapped memory are taken.
    assert_eq!(d.admin(0x7c, 0, 0x14000, 0x15000, [0; 4]).1, 0);
    d.n.quiesce();
}

/// A file namespace of 1 MiB in a fresh file (removed when dropped).
struct TempImage(std::path::PathBuf);

impl TempImage {
    fn new(tag: &str) -> TempImage {
        let p = std::env::temp_dir().join(format!("iopath-nvme-{}-{tag}.img", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TempImage(p)
    }
    fn cfg(&self, doorbell: DoorbellMode) -> NvmeConfig {
        NvmeConfig {
            backend: StorageKind::File(self.0.clone()),
            size: 1 << 20,
            lba_size: 512,
            doorbell,
            create: true,
            ..NvmeConfig::default()
        }
    }
}

impl Drop for TempImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const MODES: [DoorbellMode; 4] = [DoorbellMode::Mmio, DoorbellMode::Ioeventfd, DoorbellMode::Shm, DoorbellMode::Bar];

impl Drv {
    /// Creates I/O queue pair 1 with `size` entries at `sq` and `cq`.
    fn io_queues_at(&mut self, sq: u64, cq: u64, size: u16) {
        let (_, st) = self.admin(0x05, 0, cq, 0, [1 | ((size as u32 - 1) << 16), 1, 0, 0]);
        assert_eq!(st, 0);
        let (_, st) = self.admin(0x01, 0, sq, 0, [1 | ((size as u32 - 1) << 16), 1 | 1 << 16, 0, 0]);
        assert_eq!(st, 0);
    }
    /// Writes I/O commands (opcode, slba, nlb - 1, prp1) at the SQ tail and
    /// rings the doorbell once; returns their cids.
    fn submit_batch(&mut self, cmds: &[(u8, u64, u32, u64)], sq: u64, size: u16) -> Vec<u16> {
        let mut cids = Vec::new();
        for &(op, slba, nlb0, prp1) in cmds {
            let e = self.sqe(op, 1, prp1, 0, [slba as u32, (slba >> 32) as u32, nlb0, 0]);
            cids.push(self.cid);
            self.mem.write_slice(&e, GuestAddress(sq + self.iotail as u64 * 64)).unwrap();
            self.iotail = (self.iotail + 1) % size;
        }
        self.w32(DOORBELLS + 8, self.iotail as u32);
        cids
    }
    /// Waits (5 s at most) for `n` completions of the I/O CQ; (cid, status)
    /// in CQ order. Frees the CQ entries as it goes.
    fn reap_batch(&mut self, n: usize, cq: u64, size: u16) -> Vec<(u16, u16)> {
        let mut out = Vec::new();
        let t0 = std::time::Instant::now();
        while out.len() < n {
            let a = cq + self.iohead as u64 * 16;
            if let Some((_, st)) = self.reap(cq, size, false) {
                let dw3: u32 = self.mem.read_obj(GuestAddress(a + 12)).unwrap();
                out.push((dw3 as u16, st));
                self.w32(DOORBELLS + 12, self.iohead as u32);
                continue;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{} of {n} completions", out.len());
            std::thread::yield_now();
        }
        out
    }
}

fn sorted(mut v: Vec<u16>) -> Vec<u16> {
    v.sort_unstable();
    v
}

#[test]
fn a_file_namespace_keeps_32_commands_in_flight_and_each_completes_with_its_data() {
    const W: u64 = 0x40000;
    const R: u64 = 0x60000;
    for mode in MODES {
        let img = TempImage::new("qd32");
        let mut d = Drv::new(img.cfg(mode));
        d.io_queues(64);
        let mut writes = Vec::new();
        for i in 0..32u64 {
            d.mem.write_slice(&[(i as u8).wrapping_mul(7) ^ mode as u8; 4096], GuestAddress(W + i * 4096)).unwrap();
            // 4 KiB each (8 LBAs), scattered over the namespace.
            writes.push((0x01, (i * 37 % 32) * 8, 7, W + i * 4096));
        }
        let cids = d.submit_batch(&writes, IOSQ, 64);
        let done = d.reap_batch(32, IOCQ, 64);
        assert!(done.iter().all(|&(_, st)| st == 0), "{mode}: {done:?}");
        assert_eq!(sorted(done.iter().map(|c| c.0).collect()), sorted(cids), "{mode}: every write completed once");
        d.mem.write_slice(&[0xee; 32 * 4096], GuestAddress(R)).unwrap();
        let reads: Vec<_> = writes.iter().enumerate().map(|(i, w)| (0x02, w.1, 7, R + i as u64 * 4096)).collect();
        let cids = d.submit_batch(&reads, IOSQ, 64);
        let done = d.reap_batch(32, IOCQ, 64);
        assert!(done.iter().all(|&(_, st)| st == 0), "{mode}: {done:?}");
        assert_eq!(sorted(done.iter().map(|c| c.0).collect()), sorted(cids), "{mode}: every read completed once");
        let (mut w, mut r) = (vec![0u8; 32 * 4096], vec![0u8; 32 * 4096]);
        d.mem.read_slice(&mut w, GuestAddress(W)).unwrap();
        d.mem.read_slice(&mut r, GuestAddress(R)).unwrap();
        assert!(w == r, "{mode}: the data read back is the data written");
        assert_eq!((counter(&d.n, "io.writes"), counter(&d.n, "io.reads")), (32, 32), "{mode}");
        // One doorbell for 32 commands: all 32 went to the file at once.
        assert!(counter(&d.n, "backend.inflight-max") >= 32, "{mode}: {:?}", d.n.counters());
    }
}

#[test]
fn a_flush_completes_after_the_writes_fetched_before_it() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Shm] {
        let img = TempImage::new("flush");
        let mut d = Drv::new(img.cfg(mode));
        d.io_queues(64);
        let mut cmds: Vec<_> = (0..32u64).map(|i| (0x01, i * 8, 7, 0x40000 + i * 4096)).collect();
        cmds.push((0x00, 0, 0, 0));
        let cids = d.submit_batch(&cmds, IOSQ, 64);
        let done = d.reap_batch(33, IOCQ, 64);
        assert!(done.iter().all(|&(_, st)| st == 0), "{mode}: {done:?}");
        assert_eq!(done.last().unwrap().0, *cids.last().unwrap(), "{mode}: the Flush completes last: {done:?}");
    }
}

#[test]
fn a_reset_with_reads_in_flight_leaves_guest_memory_alone_after_it_returns() {
    a_reset_with_reads_in_flight(false);
    a_reset_with_reads_in_flight(true);
}

fn a_reset_with_reads_in_flight(in_place: bool) {
    const R: u64 = 0x40000;
    let img = TempImage::new("reset");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    if !in_place {
        bounce_only(&d);
    }
    d.io_queues(64);
    d.io(0x01, 0, 7, DATA, 0, 64); // block 0 holds what DATA held (zeros)
    d.mem.write_slice(&[0x5a; 4096], GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x01, 0, 7, DATA, 0, 64), 0);
    // No device thread reaps now: the reads below stay in flight (or
    // completed and unreaped) until after the reset.
    d.n.quiesce();
    d.mem.write_slice(&[0xee; 32 * 4096], GuestAddress(R)).unwrap();
    let reads: Vec<_> = (0..32u64).map(|i| (0x02, 0, 7, R + i * 4096)).collect();
    d.submit_batch(&reads, IOSQ, 64);
    std::thread::sleep(std::time::Duration::from_millis(50)); // let the file complete them
    d.w32(REG_CC, 0);
    assert_eq!(d.r32(0x1c) & 1, 0, "disabled");
    assert_eq!(d.n.core.lock().unwrap().io_in_flight(), 0, "the reset waited for the aborted reads");
    // What the guest sees once the reset returned stays.
    let (mut r_after, mut cq_after) = (vec![0u8; 32 * 4096], vec![0u8; 64 * 16]);
    d.mem.read_slice(&mut r_after, GuestAddress(R)).unwrap();
    d.mem.read_slice(&mut cq_after, GuestAddress(IOCQ)).unwrap();
    if in_place {
        // The kernel moved the data to the guest's pages; the reset waited for it.
        assert!(r_after.iter().all(|&b| b == 0x5a), "the reads on the guest's pages ended before the reset returned");
    } else {
        assert!(r_after.iter().all(|&b| b == 0xee), "nothing reaped them before the reset: they were out");
    }
    // Enabled again: the device thread runs; nothing of the aborted reads is left to deliver.
    d.w32(REG_CC, 0x0046_0001);
    (d.atail, d.ahead, d.aphase, d.iotail, d.iohead, d.iophase) = (0, 0, 1, 0, 0, 1);
    d.mem.write_slice(&[0u8; 64 * 16], GuestAddress(ACQ)).unwrap();
    let mut r = vec![0u8; 32 * 4096];
    let mut cq = vec![0u8; 64 * 16];
    let t0 = std::time::Instant::now();
    while t0.elapsed() < std::time::Duration::from_millis(300) {
        d.mem.read_slice(&mut r, GuestAddress(R)).unwrap();
        d.mem.read_slice(&mut cq, GuestAddress(IOCQ)).unwrap();
        assert!(r == r_after, "an aborted read wrote guest memory after the reset");
        assert!(cq == cq_after, "an aborted command completed after the reset");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    // The slots came back: the new queues serve a full batch.
    d.mem.write_slice(&[0u8; 64 * 16], GuestAddress(IOCQ)).unwrap();
    d.io_queues(64);
    let reads: Vec<_> = (0..32u64).map(|i| (0x02, 0, 7, R + i * 4096)).collect();
    d.submit_batch(&reads, IOSQ, 64);
    assert!(d.reap_batch(32, IOCQ, 64).iter().all(|&(_, st)| st == 0));
    d.mem.read_slice(&mut r, GuestAddress(R)).unwrap();
    assert!(r.iter().all(|&b| b == 0x5a));
}

#[test]
fn deleting_an_sq_posts_its_commands_completions_before_the_deletes() {
    let img = TempImage::new("delete");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(64);
    d.n.quiesce(); // only the Delete reaps
    let reads: Vec<_> = (0..16u64).map(|i| (0x02, i * 8, 7, 0x40000 + i * 4096)).collect();
    let cids = d.submit_batch(&reads, IOSQ, 64);
    assert_eq!(d.admin(0x00, 0, 0, 0, [1, 0, 0, 0]).1, 0, "Delete I/O SQ");
    let done: Vec<_> = (0..16).map_while(|_| d.reap(IOCQ, 64, false)).collect();
    assert_eq!(done.len(), 16, "every command of the SQ completed before the Delete did");
    assert_eq!(counter(&d.n, "io.reads"), 16);
    assert_eq!(d.admin(0x04, 0, 0, 0, [1, 0, 0, 0]).1, 0, "Delete I/O CQ");
    drop(cids);
}

#[test]
fn a_thousand_commands_on_a_deep_queue_all_complete_within_the_in_flight_bound() {
    const SQ: u64 = 0x80000; // 1024 x 64 B
    const CQ: u64 = 0x90000; // 1024 x 16 B
    for mode in [DoorbellMode::Mmio, DoorbellMode::Bar] {
        let img = TempImage::new("deep");
        let mut d = Drv::new(img.cfg(mode));
        d.io_queues_at(SQ, CQ, 1024);
        let cmds: Vec<_> = (0..1000u64).map(|i| (0x02 - (i % 2) as u8, (i % 256) * 8, 7, 0x40000)).collect();
        let cids = d.submit_batch(&cmds, SQ, 1024);
        let done = d.reap_batch(1000, CQ, 1024);
        assert!(done.iter().all(|&(_, st)| st == 0), "{mode}");
        assert_eq!(sorted(done.iter().map(|c| c.0).collect()), sorted(cids), "{mode}: each command completed once");
        let max = counter(&d.n, "backend.inflight-max");
        assert_eq!(max, crate::block::FILE_SLOTS as u64, "{mode}: the bound was reached and held");
        assert!(counter(&d.n, "backend.slot-waits") > 0, "{mode}: fetching waited for slots");
    }
}

#[test]
fn a_cq_head_moved_back_holds_file_completions_instead_of_overwriting_entries() {
    let img = TempImage::new("held");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(8);
    d.n.quiesce(); // nothing reaps until the head has moved
    let reads: Vec<_> = (0..4u64).map(|i| (0x02, i * 8, 7, 0x40000 + i * 4096)).collect();
    d.submit_batch(&reads, IOSQ, 8);
    // Head 4 with tail 0: the CQ now looks half full, room for 3 of the 4 owed.
    d.w32(DOORBELLS + 12, 4);
    let posted = |d: &Drv, i: u64| d.mem.read_obj::<u32>(GuestAddress(IOCQ + i * 16 + 12)).unwrap() >> 16 & 1 == 1;
    d.n.attach(DeviceContext::detached(d.mem.clone())); // the device thread again
    let t0 = std::time::Instant::now();
    while !(0..3).all(|i| posted(&d, i)) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "three completions");
        std::thread::yield_now();
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(!posted(&d, 3), "the fourth would fill the CQ: held");
    assert_eq!(counter(&d.n, "io.reads"), 4, "all four were read");
    // The host frees entries: the held completion goes out.
    d.w32(DOORBELLS + 12, 0);
    assert!(posted(&d, 3), "posted when the CQ head doorbell made room");
}

#[test]
fn file_commands_are_fetched_only_while_their_cq_has_room_for_every_completion_owed() {
    let img = TempImage::new("room");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    // An 8-entry SQ on a 4-entry CQ (room for 3 completions).
    assert_eq!(d.admin(0x05, 0, IOCQ, 0, [1 | 3 << 16, 1, 0, 0]).1, 0);
    assert_eq!(d.admin(0x01, 0, IOSQ, 0, [1 | 7 << 16, 1 | 1 << 16, 0, 0]).1, 0);
    let reads: Vec<_> = (0..6u64).map(|i| (0x02, i * 8, 7, 0x40000 + i * 4096)).collect();
    d.submit_batch(&reads, IOSQ, 8);
    assert_eq!(d.reap_batch(6, IOCQ, 4).len(), 6, "all complete as the host frees CQ entries");
    assert_eq!(counter(&d.n, "backend.inflight-max"), 3, "never more out than the CQ can take");
    assert!(counter(&d.n, "cq.full-waits") > 0);
    assert_eq!(counter(&d.n, "io.reads"), 6);
}

/// Waits up to 5 s for `cond`; its last value.
fn within_5s(mut cond: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while !cond() {
        if t0.elapsed() > std::time::Duration::from_secs(5) {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    true
}

#[test]
fn an_sq_waiting_for_a_file_slot_is_served_when_a_cq_doorbell_or_a_delete_frees_slots() {
    const SQ1: u64 = 0x80000; // 1024 x 64 B
    const CQ1: u64 = 0x90000; // 1024 x 16 B
    const SQ2: u64 = 0xA0000;
    const CQ2: u64 = 0xA8000;
    // How the slots come back: the host's head doorbell on CQ1 (the vCPU
    // reaps), or Delete I/O SQ 1 (its commands are drained).
    for delete in [false, true] {
        let img = TempImage::new("slot-wait");
        let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
        d.io_queues_at(SQ1, CQ1, 1024);
        assert_eq!(d.admin(0x05, 0, CQ2, 0, [2 | 63 << 16, 1, 0, 0]).1, 0);
        assert_eq!(d.admin(0x01, 0, SQ2, 0, [2 | 63 << 16, 1 | 2 << 16, 0, 0]).1, 0);
        d.n.quiesce(); // no device thread reaps: SQ1 keeps every slot
        let cmds: Vec<_> = (0..256u64).map(|i| (0x02, i * 8, 7, 0x40000)).collect();
        d.submit_batch(&cmds, SQ1, 1024);
        let e = d.sqe(0x02, 1, 0x41000, 0, [0, 0, 7, 0]);
        d.mem.write_slice(&e, GuestAddress(SQ2)).unwrap();
        d.w32(DOORBELLS + 16, 1);
        assert!(counter(&d.n, "backend.slot-waits") > 0, "SQ2's read waits for a slot");
        std::thread::sleep(std::time::Duration::from_millis(100)); // the file completes SQ1's reads
        if delete {
            assert_eq!(d.admin(0x00, 0, 0, 0, [1, 0, 0, 0]).1, 0, "Delete I/O SQ 1");
        } else {
            d.w32(DOORBELLS + 12, 0); // the vCPU reaps all 256
        }
        d.n.attach(DeviceContext::detached(d.mem.clone())); // the reaper runs again
        let posted = || d.mem.read_obj::<u32>(GuestAddress(CQ2 + 12)).unwrap() >> 16 & 1 == 1;
        assert!(within_5s(posted), "delete {delete}: SQ2's read never completed although slots are free");
    }
}

#[test]
fn a_write_in_flight_at_reset_or_disable_is_in_the_file_before_either_returns() {
    const W: u64 = 0x40000;
    for reset in [false, true] {
        let img = TempImage::new("reset-write");
        let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
        d.io_queues(64);
        d.n.quiesce(); // nothing reaps: the writes stay out until the reset
                       // 8 writes of 128 KiB (256 LBAs) = the whole 1 MiB namespace.
        let fill = |i: u64| (i as u8).wrapping_mul(29) ^ 0x5a ^ reset as u8;
        for i in 0..4u64 {
            d.mem.write_slice(&[fill(i); 32 << 10], GuestAddress(W + (i << 15))).unwrap();
        }
        for i in 0..8u64 {
            // PRP1 and a list of 31 pages, all in the 32 KiB block of fill(i % 4).
            let list = 0x60000 + i * 0x100;
            let pages: Vec<u8> =
                (1..32u64).flat_map(|p| (W + ((i % 4) << 15) + (p % 8) * 4096).to_le_bytes()).collect();
            d.mem.write_slice(&pages, GuestAddress(list)).unwrap();
            let e = d.sqe(0x01, 1, W + ((i % 4) << 15), list, [(i * 256) as u32, 0, 255, 0]);
            d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
            d.iotail += 1;
        }
        d.w32(DOORBELLS + 8, d.iotail as u32);
        assert_eq!(d.n.core.lock().unwrap().io_in_flight(), 8);
        if reset {
            d.n.reset();
        } else {
            d.w32(REG_CC, 0);
            assert_eq!(d.r32(0x1c) & 1, 0, "disabled");
        }
        assert_eq!(d.n.core.lock().unwrap().io_in_flight(), 0, "reset {reset}: nothing is left in flight");
        let file = std::fs::read(&img.0).unwrap();
        for (i, chunk) in file.chunks(128 << 10).enumerate() {
            let want = fill(i as u64 % 4);
            assert!(chunk.iter().all(|&b| b == want), "reset {reset}: write {i} is in the file");
        }
    }
}

/// Reads and writes of a file namespace through the bounce buffers only.
fn bounce_only(d: &Drv) {
    if let crate::block::Storage::File(f) = &mut d.n.core.lock().unwrap().ns[0].storage {
        f.in_place = InPlace::Off;
    }
}

#[test]
fn a_transfer_o_direct_cannot_take_in_place_bounces_with_its_data() {
    let img = TempImage::new("in-place-odd");
    let mut d = Drv::new(NvmeConfig { in_place: InPlace::On, ..img.cfg(DoorbellMode::Mmio) });
    d.io_queues(64);
    // A dword-aligned PRP (valid NVMe) that O_DIRECT's alignment here refuses.
    let align = match &d.n.core.lock().unwrap().ns[0].storage {
        crate::block::Storage::File(f) => f.dio_align().expect("O_DIRECT io_uring on the test file"),
        _ => unreachable!(),
    };
    if align.0 <= 4 {
        eprintln!("O_DIRECT takes any dword-aligned address here ({align:?}): no PRP to bounce");
        return;
    }
    let odd = DATA + 4;
    d.mem.write_slice(&[0x6b; 512], GuestAddress(odd)).unwrap();
    eprintln!("O_DIRECT alignment {align:?}, PRP at DATA + {}", odd - DATA);
    assert_eq!(d.io(0x01, 3, 0, odd, 0, 64), status::SUCCESS);
    d.mem.write_slice(&[0u8; 520], GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x02, 3, 0, odd, 0, 64), status::SUCCESS);
    let mut b = [0u8; 520];
    d.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
    let at = (odd - DATA) as usize;
    assert!(b[..at].iter().chain(&b[at + 512..]).all(|&x| x == 0), "nothing outside the transfer");
    assert!(b[at..at + 512].iter().all(|&x| x == 0x6b), "the data read back");
    // Both went O_DIRECT through a bounce buffer (one tried in place would
    // have failed with EINVAL and been redone without O_DIRECT).
    assert_eq!(counter(&d.n, "backend.direct-ops"), 2, "{:?}", d.n.counters());
    assert_eq!(counter(&d.n, "backend.in-place-ops"), 0, "{:?}", d.n.counters());
}

#[test]
fn file_reads_on_guest_pages_in_place_complete_before_the_memory_is_given_up() {
    const R: u64 = 0x40000;
    let img = TempImage::new("in-place");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(64);
    for i in 0..8u64 {
        d.mem.write_slice(&[0x50 + i as u8; 4096], GuestAddress(DATA)).unwrap();
        assert_eq!(d.io(0x01, i * 8, 7, DATA, 0, 64), 0);
    }
    let direct = counter(&d.n, "backend.direct-ops");
    assert!(direct >= 8, "O_DIRECT through io_uring on {}: {:?}", img.0.display(), d.n.counters());
    assert_eq!(counter(&d.n, "backend.in-place-ops"), direct, "page-aligned writes go in place");
    // Nothing but the attach below reaps: the completion thread is stopped.
    d.n.quiesce();
    d.mem.write_slice(&[0xee; 8 * 4096], GuestAddress(R)).unwrap();
    let reads: Vec<_> = (0..8u64).map(|i| (0x02, i * 8, 7, R + i * 4096)).collect();
    let cids = d.submit_batch(&reads, IOSQ, 64);
    // The client leaves: before the device lets its memory go, the reads on
    // its pages end and their completions are in its CQ.
    d.n.attach(DeviceContext::detached(GuestMemoryMmap::default()));
    assert_eq!(counter(&d.n, "backend.in-place-ops"), direct + 8);
    let mut done = Vec::new();
    for k in 0..8u64 {
        let e: [u32; 4] = d.mem.read_obj(GuestAddress(IOCQ + (d.iohead as u64 + k) % 64 * 16)).unwrap();
        assert_eq!(e[3] >> 16 & 1, d.iophase, "completion {k} is posted");
        done.push(e[3] as u16);
        assert_eq!(e[3] >> 17, 0, "completion {k}: success");
    }
    assert_eq!(sorted(done), sorted(cids));
    for i in 0..8u64 {
        let mut b = [0u8; 4096];
        d.mem.read_slice(&mut b, GuestAddress(R + i * 4096)).unwrap();
        assert!(b.iter().all(|&x| x == 0x50 + i as u8), "read {i} carries its data");
    }
}

#[test]
fn completions_reaped_while_the_client_is_gone_wait_for_its_memory() {
    const R: u64 = 0x40000;
    let img = TempImage::new("no-memory");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    bounce_only(&d);
    d.io_queues(64);
    for i in 0..8u64 {
        d.mem.write_slice(&[0x30 + i as u8; 4096], GuestAddress(DATA)).unwrap();
        assert_eq!(d.io(0x01, i * 8, 7, DATA, 0, 64), 0);
    }
    d.n.quiesce();
    d.mem.write_slice(&[0xee; 8 * 4096], GuestAddress(R)).unwrap();
    let reads: Vec<_> = (0..8u64).map(|i| (0x02, i * 8, 7, R + i * 4096)).collect();
    let cids = d.submit_batch(&reads, IOSQ, 64);
    // The client leaves: the device gets no memory, its thread runs (and is woken by the completions).
    d.n.attach(DeviceContext::detached(GuestMemoryMmap::default()));
    std::thread::sleep(std::time::Duration::from_millis(200));
    d.n.quiesce();
    // The next client (the same memory: --keep-state).
    d.n.attach(DeviceContext::detached(d.mem.clone()));
    let done = d.reap_batch(8, IOCQ, 64);
    assert_eq!(sorted(done.iter().map(|c| c.0).collect()), sorted(cids));
    assert!(done.iter().all(|&(_, st)| st == 0), "{done:?}");
    assert_eq!(counter(&d.n, "errors"), 0);
    for i in 0..8u64 {
        let mut b = [0u8; 4096];
        d.mem.read_slice(&mut b, GuestAddress(R + i * 4096)).unwrap();
        assert!(b.iter().all(|&x| x == 0x30 + i as u8), "read {i} carries its data");
    }
}

/// The threads of this process named `name`.
fn threads_named(name: &str) -> Vec<i32> {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    let comm = |t: &std::path::Path| std::fs::read_to_string(t.join("comm")).unwrap_or_default();
    tasks
        .flatten()
        .filter(|t| comm(&t.path()).trim() == name)
        .filter_map(|t| t.file_name().to_str()?.parse().ok())
        .collect()
}

extern "C" fn on_sigusr1(_: libc::c_int) {}

#[test]
fn the_mmio_completion_thread_goes_on_after_signals_and_records_the_error_it_stops_on() {
    // A handler without SA_RESTART: a blocking read the signal interrupts fails with EINTR.
    // SAFETY: a zeroed sigaction with a handler that does nothing (async-signal-safe).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as extern "C" fn(libc::c_int) as usize;
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    let img = TempImage::new("eintr");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(64);
    assert_eq!(d.io(0x02, 0, 7, DATA, 0, 64), 0, "the completion thread posts");
    // Signal every completion thread (other tests' too: theirs go on as well)
    // a few times, so that some signal finds it asleep.
    for _ in 0..10 {
        for tid in threads_named("nvme-uring") {
            // SAFETY: tgkill on a thread of this process, with a signal it handles.
            unsafe { libc::syscall(libc::SYS_tgkill, std::process::id(), tid, libc::SIGUSR1) };
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!threads_named("nvme-uring").is_empty());
    for i in 0..4 {
        let e = d.sqe(0x02, 1, DATA, 0, [i * 8, 0, 7, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail = (d.iotail + 1) % 64;
        d.w32(DOORBELLS + 8, d.iotail as u32);
        assert_eq!(d.reap_io_wait(64).1, 0, "read {i} after the signals");
        d.w32(DOORBELLS + 12, d.iohead as u32);
    }
    // Its eventfd becomes unreadable (a write-only fd in its place): the
    // thread stops, and says why.
    use std::os::fd::AsRawFd;
    let done = d.n.core.lock().unwrap().io_completion_fd().unwrap();
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null").unwrap();
    // SAFETY: replaces the eventfd's descriptor with another open one; the EventFd closes it when dropped.
    assert!(unsafe { libc::dup2(null.as_raw_fd(), done.as_raw_fd()) } >= 0);
    // A completion wakes the thread (the ring signals the eventfd itself); it reads the fd.
    let e = d.sqe(0x02, 1, DATA, 0, [0, 0, 7, 0]);
    d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
    d.iotail = (d.iotail + 1) % 64;
    d.w32(DOORBELLS + 8, d.iotail as u32);
    let failed = || d.n.core.lock().unwrap().db.failed.clone();
    assert!(within_5s(|| failed().is_some()), "the error is recorded");
    let why = failed().unwrap();
    assert!(why.contains("io_uring thread stopped"), "{why}");
}

#[test]
fn commands_a_refused_submit_left_in_the_ring_are_retried_by_the_device_thread() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Ioeventfd] {
        let img = TempImage::new("refused");
        let mut d = Drv::new(img.cfg(mode));
        d.io_queues(64);
        if mode == DoorbellMode::Ioeventfd {
            assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0, "Doorbell Buffer Config");
        }
        // The kernel refuses the next 5 submits (EAGAIN, ENOMEM): the reads
        // stay in the ring with nothing in the kernel to signal a completion.
        match &mut d.n.core.lock().unwrap().ns[0].storage {
            crate::block::Storage::File(f) => f.fail_submits = 5,
            _ => unreachable!(),
        }
        let reads: Vec<_> = (0..4u64).map(|i| (0x02, i * 8, 7, 0x40000 + i * 4096)).collect();
        let mut cids = Vec::new();
        for &(op, slba, nlb0, prp1) in &reads {
            let e = d.sqe(op, 1, prp1, 0, [slba as u32, 0, nlb0, 0]);
            cids.push(d.cid);
            d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
            d.iotail += 1;
        }
        d.ring1(mode, false, d.iotail as u32);
        let mut done = Vec::new();
        for _ in 0..4 {
            done.push(d.reap_io_wait(64));
            d.ring1(mode, true, d.iohead as u32);
        }
        assert!(done.iter().all(|&(_, st)| st == 0), "{mode}: {done:?}");
        assert_eq!(sorted(done.iter().map(|c| c.0).collect()), sorted(cids), "{mode}");
    }
}

#[test]
fn a_write_with_force_unit_access_is_a_dsync_write_on_a_file_namespace() {
    let img = TempImage::new("fua");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(64);
    d.n.quiesce(); // the writes stay taken: their operations can be looked at
    for (fua, dsync) in [(0, false), (1 << 30, true)] {
        let e = d.sqe(0x01, 1, DATA, 0, [8, 0, 7 | fua, 0]);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail += 1;
        d.w32(DOORBELLS + 8, d.iotail as u32);
        let ops = match &d.n.core.lock().unwrap().ns[0].storage {
            crate::block::Storage::File(f) => f.taken_ops(),
            _ => unreachable!(),
        };
        assert!(ops.contains(&crate::block::FileOp::Write { dsync }), "FUA {fua:#x}: {ops:?}");
    }
}

#[test]
fn write_zeroes_and_deallocate_wait_for_the_file_writes_in_flight_before_them() {
    let img = TempImage::new("zeroes");
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(64);
    d.n.quiesce(); // only the commands below reap: the writes stay out until then
                   // DSM range list: 8 LBAs at 512.
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&512u64.to_le_bytes());
    d.mem.write_slice(&range, GuestAddress(DATA)).unwrap();
    // Write Zeroes of 8 LBAs at 256; Dataset Management, one range, deallocate.
    for (op, prp1, cdw) in [(0x08, 0, [256, 0, 7, 0]), (0x09, DATA, [0, 4, 0, 0])] {
        let writes: Vec<_> = (0..16u64).map(|i| (0x01, i * 8, 7, 0x40000 + i * 4096)).collect();
        d.submit_batch(&writes, IOSQ, 64);
        assert_eq!(d.n.core.lock().unwrap().io_in_flight(), 16);
        let e = d.sqe(op, 1, prp1, 0, cdw);
        d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
        d.iotail = (d.iotail + 1) % 64;
        d.w32(DOORBELLS + 8, d.iotail as u32);
        assert_eq!(d.n.core.lock().unwrap().io_in_flight(), 0, "opcode {op:#x}: the writes before it settled");
        let done: Vec<_> = (0..17).map_while(|_| d.reap(IOCQ, 64, false)).collect();
        assert_eq!(done.len(), 17, "opcode {op:#x}: every completion is posted");
        assert!(done.iter().all(|&(_, st)| st == 0), "{done:?}");
        d.w32(DOORBELLS + 12, d.iohead as u32);
    }
}

/// A host that announces ioeventfds once, as a vfio-user device process
/// does: it keeps what the device registers (a copy of each fd).
#[derive(Default)]
struct Announcer(std::sync::Mutex<Vec<(crate::IoEventSpec, vmm_sys_util::eventfd::EventFd)>>);
impl crate::IoEvents for Announcer {
    fn register(&self, s: crate::IoEventSpec, fd: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        self.0.lock().unwrap().push((s, fd.try_clone().unwrap()));
        Ok(())
    }
    fn unregister(&self, s: crate::IoEventSpec, _: &vmm_sys_util::eventfd::EventFd) -> crate::Result<()> {
        self.0.lock().unwrap().retain(|(x, _)| *x != s);
        Ok(())
    }
    fn static_only(&self) -> bool {
        true
    }
}

#[test]
fn ioeventfd_mode_on_a_static_host_registers_every_io_doorbell_at_attach_and_kicks_serve() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Ioeventfd, ..mmio(StorageKind::Null) };
    let host = Arc::new(Announcer::default());
    let mut d = Drv::with_ioevents(cfg, host.clone());
    // Before any queue exists: SQ tail and CQ head of every I/O queue, none of the admin queue.
    let offsets = |h: &Announcer| h.0.lock().unwrap().iter().map(|(s, _)| s.offset).collect::<Vec<_>>();
    let mut want: Vec<u64> =
        (1..=MAX_IO_QUEUES as u64).flat_map(|q| [DOORBELLS + 8 * q, DOORBELLS + 8 * q + 4]).collect();
    let mut got = offsets(&host);
    want.sort();
    got.sort();
    assert_eq!(got, want);
    assert!(host.0.lock().unwrap().iter().all(|(s, _)| s.bar == 0 && s.len == 4 && s.datamatch.is_none()));
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    d.io_queues(8);
    assert_eq!(host.0.lock().unwrap().len(), 2 * MAX_IO_QUEUES as usize, "queue creation registers nothing more");
    // A kick of a queue that does not exist finds no work and harms nothing.
    let kick = |h: &Announcer, off: u64| {
        h.0.lock().unwrap().iter().find(|(s, _)| s.offset == off).unwrap().1.write(1).unwrap()
    };
    kick(&host, DOORBELLS + 8 * MAX_IO_QUEUES as u64);
    // Submissions through the shadow tail, each announced by a kick of SQ 1's doorbell (KVM's part).
    for round in 0..2 {
        for _ in 0..5 {
            let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
            d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
            d.iotail = (d.iotail + 1) % 8;
            d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
            kick(&host, DOORBELLS + 8);
            assert_eq!(d.reap_io_wait(8).1, 0);
            d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
        }
        assert!(counter(&d.n, "ioeventfd.kicks") >= 5 * (round + 1), "round {round}");
        assert_eq!(counter(&d.n, "doorbell.invalid"), 0);
        // Disabled and enabled again: the announced doorbells and their eventfd stay.
        d.w32(REG_CC, 0);
        assert_eq!(host.0.lock().unwrap().len(), 2 * MAX_IO_QUEUES as usize);
        let kicks = counter(&d.n, "ioeventfd.kicks");
        d.w32(REG_CC, 0x0046_0001);
        assert_eq!(counter(&d.n, "ioeventfd.kicks"), kicks, "the wake-up of the stopped thread is no kick");
        (d.atail, d.ahead, d.aphase, d.cid) = (0, 0, 1, 0);
        d.mem.write_slice(&[0u8; 32 * 16], GuestAddress(ACQ)).unwrap();
        d.mem.write_slice(&[0u8; 8 * 16], GuestAddress(IOCQ)).unwrap();
        (d.iotail, d.iohead, d.iophase) = (0, 0, 1);
        d.mem.write_slice(&[0u8; 4096], GuestAddress(DBBUF)).unwrap();
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        d.io_queues(8);
    }
    d.n.quiesce();
}

#[test]
fn out_of_process_a_kick_before_the_shadow_doorbells_is_a_fatal_status_not_a_lost_doorbell() {
    for doorbell in [DoorbellMode::Ioeventfd, DoorbellMode::Adaptive] {
        let cfg = NvmeConfig { doorbell, ..mmio(StorageKind::Null) };
        let host = Arc::new(Announcer::default());
        let mut d = Drv::with_ioevents(cfg, host.clone());
        // Queues may come first (Linux creates them, then configures the shadow doorbells).
        d.io_queues(8);
        assert_eq!(d.r32(0x1c) & 2, 0, "{doorbell}: no fault yet");
        // A driver without shadow doorbells rings SQ 1's tail: the host's ioeventfd takes it.
        let e = d.sqe(0x02, 1, DATA, 0, [0; 4]);
        d.mem.write_slice(&e, GuestAddress(IOSQ)).unwrap();
        sq1_kick(&host).write(1).unwrap();
        assert!(within_5s(|| d.r32(0x1c) & 2 != 0), "{doorbell}: CSTS.CFS after a doorbell whose value was lost");
        d.n.quiesce();
    }
}

/// SQ 1's doorbell eventfd as the host registered it (KVM's ioeventfd).
fn sq1_kick(host: &Announcer) -> vmm_sys_util::eventfd::EventFd {
    host.0.lock().unwrap().iter().find(|(s, _)| s.offset == DOORBELLS + 8).unwrap().1.try_clone().unwrap()
}

impl Drv {
    /// Submits a read on I/O SQ 1 (8 entries) through the shadow tail and,
    /// as the EventIdx rule asks, rings `kick` if EventIdx lies in the
    /// entries just added. True if it rang.
    fn read_ringing_by_event_idx(&mut self, kick: &vmm_sys_util::eventfd::EventFd) -> bool {
        let old = self.iotail as u32;
        let e = self.sqe(0x02, 1, DATA, 0, [0; 4]);
        self.mem.write_slice(&e, GuestAddress(IOSQ + self.iotail as u64 * 64)).unwrap();
        self.iotail = (self.iotail + 1) % 8;
        let new = self.iotail as u32;
        self.mem.store(new, GuestAddress(DBBUF + 8), Ordering::SeqCst).unwrap();
        std::sync::atomic::fence(Ordering::SeqCst);
        let ev: u32 = self.mem.load(GuestAddress(EVIDX + 8), Ordering::SeqCst).unwrap();
        let ring = (new + 16 - ev - 1) % 8 < (new + 8 - old) % 8;
        if ring {
            kick.write(1).unwrap();
        }
        ring
    }
}

#[test]
fn adaptive_mode_sleeps_when_idle_and_no_submission_racing_the_sleep_is_lost() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Adaptive, ..mmio(StorageKind::Null) };
    let host = Arc::new(Announcer::default());
    let mut d = Drv::with_ioevents(cfg, host.clone());
    assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    d.io_queues(8);
    let sq_kick = sq1_kick(&host);
    let mut rings = 0u64;
    // Submissions one at a time, the driver following the EventIdx rule (KVM's part: the
    // ioeventfd). Pauses of varied length put submissions before, during and after the
    // poller's switch to sleep; a lost wake-up leaves a command unserved (5 s timeout).
    for i in 0..2000u32 {
        if i % 3 == 0 {
            std::thread::sleep(std::time::Duration::from_micros((i as u64 * 37) % 700));
        }
        rings += d.read_ringing_by_event_idx(&sq_kick) as u64;
        assert_eq!(d.reap_io_wait(8).1, 0, "command {i}");
        d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::SeqCst).unwrap();
    }
    let (sleeps, wakeups) = (counter(&d.n, "adaptive.sleeps"), counter(&d.n, "adaptive.wakeups"));
    assert!(sleeps > 0 && wakeups > 0 && rings > 0, "sleeps {sleeps} wakeups {wakeups} rings {rings}");
    assert!(counter(&d.n, "shadow.polls") > 0);
    assert_eq!(counter(&d.n, "ioeventfd.kicks"), rings, "every ring is a kick, counted");
    assert_eq!(counter(&d.n, "io.commands"), 2000);
    assert_eq!(counter(&d.n, "doorbell.invalid"), 0);
    d.n.quiesce();
}

#[test]
fn a_batch_completes_in_order_across_cq_lines_errors_and_a_wrap_off_a_line_boundary() {
    // A 6-entry queue: lines of 4 entries, and a wrap that is no line boundary.
    let mut d = Drv::new(mmio(StorageKind::Ram));
    d.io_queues_at(IOSQ, IOCQ, 6);
    for round in 0..4 {
        // Five reads in one doorbell write; the third is out of range.
        let cmds: Vec<(u8, u64, u32, u64)> =
            (0..5u64).map(|i| (0x02, if i == 2 { 1 << 40 } else { i }, 0, DATA)).collect();
        let cids = d.submit_batch(&cmds, IOSQ, 6);
        let got = d.reap_batch(5, IOCQ, 6);
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), cids, "round {round}: command order");
        for (i, &(cid, st)) in got.iter().enumerate() {
            let want = if i == 2 { status::LBA_OUT_OF_RANGE } else { status::SUCCESS };
            assert_eq!(st, want, "round {round}, cid {cid}");
        }
    }
    assert_eq!(counter(&d.n, "io.commands"), 20);
}

#[test]
fn the_pollers_walk_exactly_the_sqs_that_exist_in_ascending_order() {
    let cfg = NvmeConfig { doorbell: DoorbellMode::Shm, ..mmio(StorageKind::Null) };
    let mut c = controller::Core::new(&cfg, vec![crate::block::Storage::Null { bytes: cfg.size }], None);
    let q = &mut c.queues;
    assert_eq!(q.sq_ids().count(), 0);
    let sq = queue::Sq { size: 2, ..Default::default() };
    for id in [64, 0, 3, 1, 3] {
        q.set_sq(id, Some(sq));
    }
    assert_eq!(q.sq_ids().collect::<Vec<_>>(), [0, 1, 3, 64], "the highest queue id included");
    assert_eq!(q.io_sq_ids().collect::<Vec<_>>(), [1, 3, 64], "the admin SQ is not an I/O SQ");
    q.set_sq(3, None);
    q.set_sq(5, None); // not there: nothing changes
    assert_eq!(q.io_sq_ids().collect::<Vec<_>>(), [1, 64]);
    q.clear_sqs();
    assert_eq!(q.sq_ids().count(), 0);
    assert!(q.sqs.iter().all(|s| s.is_none()));
}

#[test]
fn the_watched_doorbell_words_change_with_every_tail_and_head_the_poller_has_not_taken() {
    for mode in [DoorbellMode::Shm, DoorbellMode::Bar] {
        let cfg = NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) };
        let page = (mode == DoorbellMode::Bar).then(|| doorbells::bar_memory().unwrap().0);
        let mut c = controller::Core::new(&cfg, vec![crate::block::Storage::Null { bytes: cfg.size }], page.clone());
        let ram = crate::GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        c.mem = crate::GuestMem::from(ram.clone());
        // SQ 1 on CQ 1, SQ 2 on CQ 3: three words, one of them holding a CQ head alone.
        let sq = |cqid, tail| Some(queue::Sq { size: 8, cqid, tail, head: tail, ..Default::default() });
        c.queues.set_sq(1, sq(1, 2));
        c.queues.set_sq(2, sq(3, 5));
        for (id, head) in [(1, 2u16), (3, 4)] {
            c.queues.cqs[id] = Some(queue::Cq { size: 8, head, ..Default::default() });
        }
        // Where the driver writes: BAR0's page, or the shadow doorbell buffer.
        let (store, base): (Box<dyn Fn(u32, u64)>, u64) = match &page {
            Some(p) => {
                let p = p.clone();
                (Box::new(move |v, a| p.store(v, GuestAddress(a), Ordering::Release).unwrap()), DOORBELLS)
            }
            None => {
                c.db.shadow = Some((0x8000, 0x9000));
                (Box::new(move |v, a| ram.store(v, GuestAddress(a), Ordering::Release).unwrap()), 0x8000)
            }
        };
        let set = |sq1: u32, cq1: u32, sq2: u32, cq3: u32| {
            for (off, v) in [(8, sq1), (12, cq1), (16, sq2), (28, cq3)] {
                store(v, base + off);
            }
        };
        set(2, 2, 5, 4);
        assert!(!c.rewatch(None).changed(), "{mode}: every word as taken");
        for (i, moved) in [(3, 2, 5, 4), (2, 3, 5, 4), (2, 2, 6, 4), (2, 2, 5, 5)].into_iter().enumerate() {
            let w = c.rewatch(None);
            set(moved.0, moved.1, moved.2, moved.3);
            assert!(w.changed(), "{mode}: word {i} written after the watch was made");
            assert!(c.rewatch(None).changed(), "{mode}: word {i} written before");
            set(2, 2, 5, 4);
        }
        // A word of no queue (SQ 2's CQ head half, queue 3's SQ half) is not looked at.
        store(7, base + 20);
        store(7, base + 24);
        assert!(!c.rewatch(None).changed(), "{mode}");
        // Guest memory replaced (a client's new map): the watch of the old one is not kept.
        let old = c.rewatch(None);
        let kept = c.rewatch(Some(c.rewatch(None)));
        c.mem = crate::GuestMem::from(c.mem.mapped().clone());
        let w = c.rewatch(Some(old));
        if mode == DoorbellMode::Shm {
            assert!(!kept.of(&c.mem) && w.of(&c.mem), "shm: rebuilt on the new memory");
        } else {
            assert!(c.db.bar_mem.as_ref().is_some_and(|m| kept.of(m) && w.of(m)), "bar: the page stays");
        }
        assert!(c.rewatch(None).of(if mode == DoorbellMode::Shm { &c.mem } else { c.db.bar_mem.as_ref().unwrap() }));
    }
}
