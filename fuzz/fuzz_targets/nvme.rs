//! The NVMe controller (`devices::nvme`) driven through `DeviceModel` the way a hostile guest
//! (or vfio-user client) can: BAR0 registers, doorbells, the MSI-X table and configuration
//! writes, and SQEs, PRP lists and DSM ranges in a 1 MiB guest RAM, all mapped or (a vfio-user
//! client without a memory fd) partly reached through a DMA port. Doorbells are `mmio`, so
//! every command runs on this thread and a run is deterministic. The input format is
//! `iopath_fuzz::nvme`. The controller must never panic; `GuestMem` (vm-memory for the mapped
//! part) refuses every access outside RAM, so an out-of-range access shows up as an error
//! status, not a crash; the DMA port asserts that it is only asked for its own range.

#![no_main]

use iopath_devices::mem::{MemError, Result as MemResult};
use iopath_devices::block::StorageKind;
use iopath_devices::nvme::{DoorbellMode, Nvme, NvmeConfig};
use iopath_devices::{DeviceContext, DeviceModel, DmaPort, GuestMem, GuestMemoryMmap, Interrupts, NoIoEvents};
use iopath_fuzz::nvme::*;
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use vm_memory::GuestAddress;

/// Doorbells start here in BAR0 (stride 4).
const DOORBELLS: u64 = 0x1000;

struct Irq {
    accept: bool,
    host_owned: bool,
}

impl Interrupts for Irq {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        self.accept
    }
    fn msix_host_owned(&self) -> bool {
        self.host_owned
    }
}

/// The `REMOTE` range of RAM as a client serves DMA_READ/DMA_WRITE: a buffer.
struct Port {
    bytes: Mutex<Vec<u8>>,
    fail: AtomicBool,
}

impl Port {
    fn range(&self, gpa: u64, len: usize) -> MemResult<std::ops::Range<usize>> {
        // GuestMem's contract: a port is asked only for bytes inside its ranges.
        let end = gpa.checked_add(len as u64);
        assert!(
            gpa >= REMOTE.0 && end.is_some_and(|e| e <= REMOTE.1),
            "the DMA port was asked for {len} bytes at {gpa:#x}, outside its range {REMOTE:x?}"
        );
        if self.fail.load(Ordering::Relaxed) {
            return Err(MemError::Remote { gpa, len, reason: "the client is gone".into() });
        }
        let off = (gpa - REMOTE.0) as usize;
        Ok(off..off + len)
    }
}

impl DmaPort for Port {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> MemResult<()> {
        let r = self.range(gpa, buf.len())?;
        buf.copy_from_slice(&self.bytes.lock().unwrap()[r]);
        Ok(())
    }
    fn write(&self, gpa: u64, data: &[u8]) -> MemResult<()> {
        let r = self.range(gpa, data.len())?;
        self.bytes.lock().unwrap()[r].copy_from_slice(data);
        Ok(())
    }
}

/// Guest RAM: all mapped, or mapped around `REMOTE`, which `port` serves.
fn guest_ram(remote: bool) -> (GuestMem, Arc<Port>) {
    let port =
        Arc::new(Port { bytes: Mutex::new(vec![0; (REMOTE.1 - REMOTE.0) as usize]), fail: AtomicBool::new(false) });
    if !remote {
        let m = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        return (m.into(), port);
    }
    let low = (GuestAddress(0), REMOTE.0 as usize);
    let high = (GuestAddress(REMOTE.1), (MEM_SIZE - REMOTE.1) as usize);
    let m = GuestMemoryMmap::from_ranges(&[low, high]).unwrap();
    let dma: Arc<dyn DmaPort> = port.clone();
    (GuestMem::with_remote(m, &[(REMOTE.0, REMOTE.1 - REMOTE.0)], dma).unwrap(), port)
}

/// What a driver keeps per queue pair: SQ tail, CQ head, expected phase.
#[derive(Clone, Copy)]
struct Pair {
    tail: u16,
    head: u16,
    phase: u32,
}

const FRESH: Pair = Pair { tail: 0, head: 0, phase: 1 };

struct Harness {
    n: Nvme,
    mem: GuestMem,
    port: Arc<Port>,
    irq: Arc<Irq>,
    pairs: [Pair; 4],
}

impl Harness {
    /// The guest's own accesses (the harness's) go around a failing port.
    fn guest<T>(&self, f: impl FnOnce(&GuestMem) -> MemResult<T>) -> T {
        let fail = self.port.fail.swap(false, Ordering::Relaxed);
        let r = f(&self.mem);
        self.port.fail.store(fail, Ordering::Relaxed);
        // The harness's own accesses are in RAM: a failure is a harness bug.
        r.unwrap()
    }

    fn ctx(&self, mem: GuestMem) -> DeviceContext {
        DeviceContext {
            mem,
            ioevents: Arc::new(NoIoEvents),
            irq: self.irq.clone(),
            fail: Arc::new(|m| panic!("the controller stopped the run: {m}")),
        }
    }

    fn w(&self, off: u64, data: &[u8]) {
        self.n.bar_write(0, off, data);
    }

    fn queue(q: u8) -> (u64, u64, u16) {
        match q {
            0 => (ASQ, ACQ, ADMIN_ENTRIES),
            q => (iosq(q), iocq(q), IO_ENTRIES),
        }
    }

    fn enable(&self, aqa: u32, cc: u32) {
        self.w(0x24, &aqa.to_le_bytes());
        self.w(0x28, &ASQ.to_le_bytes());
        self.w(0x30, &ACQ.to_le_bytes());
        self.w(0x14, &cc.to_le_bytes());
    }

    fn run(&mut self, op: &Op) {
        match op {
            Op::W32 { off, v } => self.w(*off as u64, &v.to_le_bytes()),
            Op::W64 { off, v } => self.w(*off as u64, &v.to_le_bytes()),
            Op::Write { bar, off, data } => self.n.bar_write(*bar, *off as u64, data),
            Op::Read { bar, off, len } => {
                let mut b = vec![0u8; *len as usize];
                self.n.bar_read(*bar, *off as u64, &mut b);
            }
            Op::Doorbell { idx, v } => self.w(DOORBELLS + 4 * *idx as u64, &v.to_le_bytes()),
            Op::Submit { q, sqe } => {
                let (sq, _, size) = Self::queue(*q);
                let at = sq + self.pairs[*q as usize].tail as u64 * 64;
                self.guest(|m| m.write_slice(sqe, at));
                let p = &mut self.pairs[*q as usize];
                p.tail = (p.tail + 1) % size;
                let tail = p.tail as u32;
                self.w(DOORBELLS + 8 * *q as u64, &tail.to_le_bytes());
            }
            Op::Reap { q } => {
                let (_, cq, size) = Self::queue(*q);
                for _ in 0..size {
                    let at = cq + self.pairs[*q as usize].head as u64 * 16 + 12;
                    let dw3: u32 = self.guest(|m| m.read_obj(at));
                    let p = &mut self.pairs[*q as usize];
                    if dw3 >> 16 & 1 != p.phase {
                        break;
                    }
                    p.head += 1;
                    if p.head == size {
                        p.head = 0;
                        p.phase ^= 1;
                    }
                }
                let head = self.pairs[*q as usize].head as u32;
                self.w(DOORBELLS + 8 * *q as u64 + 4, &head.to_le_bytes());
            }
            Op::Mem { gpa, data } => {
                let gpa = *gpa as u64 % MEM_SIZE;
                let n = data.len().min((MEM_SIZE - gpa) as usize);
                self.guest(|m| m.write_slice(&data[..n], gpa));
            }
            Op::Config { off, data } => self.n.config_write(*off as usize, data),
            Op::Enable { aqa, cc } => self.enable(*aqa, *cc),
            Op::Reset => {
                self.n.reset();
                self.pairs = [FRESH; 4];
            }
            Op::Attach { gone } => {
                let mem = if *gone { GuestMem::default() } else { self.mem.clone() };
                self.n.attach(self.ctx(mem));
            }
            Op::PortFail { on } => self.port.fail.store(*on, Ordering::Relaxed),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (setup, image, ops) = decode(data);
    let cfg = NvmeConfig {
        backend: if setup & SETUP_NULL != 0 { StorageKind::Null } else { StorageKind::Ram },
        size: NS_SIZE,
        lba_size: if setup & SETUP_LBA4K != 0 { 4096 } else { 512 },
        doorbell: DoorbellMode::Mmio,
        ..NvmeConfig::default()
    };
    let (mem, port) = guest_ram(setup & SETUP_REMOTE != 0);
    let irq = Arc::new(Irq { accept: setup & SETUP_IRQ_ACCEPT != 0, host_owned: setup & SETUP_HOST_TABLE != 0 });
    let mut h = Harness { n: Nvme::new(cfg).unwrap(), mem: mem.clone(), port, irq, pairs: [FRESH; 4] };
    h.guest(|m| m.write_slice(image, IMAGE_BASE));
    h.n.attach(h.ctx(mem));
    if setup & SETUP_MSIX_ON != 0 {
        // Message Control's high byte: MSI-X Enable.
        h.n.config_write(0x43, &[0x80]);
    }
    if setup & SETUP_BRING_UP != 0 {
        let q = ADMIN_ENTRIES as u32 - 1;
        h.enable(q << 16 | q, CC_ENABLE);
    }
    for op in &ops {
        h.run(op);
    }
    // Everything a host reads afterwards.
    for off in (0..0x40).step_by(4) {
        let mut b = [0u8; 4];
        h.n.bar_read(0, off, &mut b);
    }
    let counters = h.n.counters();
    let _ = h.n.capabilities();
    if verbose() {
        let c: Vec<String> = counters.iter().filter(|c| c.value != 0).map(|c| c.to_string()).collect();
        eprintln!("nvme: {} ops; {}", ops.len(), c.join(" "));
    }
});

/// IOPATH_FUZZ_VERBOSE=1: print the controller's counters after each input (to see what a
/// seed or a crash input reaches; keep it off while fuzzing).
fn verbose() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var_os("IOPATH_FUZZ_VERBOSE").is_some_and(|v| v != "0"))
}
