//! The NVMe controller (`devices::nvme`) driven through `DeviceModel` the way a hostile guest
//! (or vfio-user client) can: BAR0 registers, doorbells, the MSI-X table and configuration
//! writes, and SQEs, PRP lists and DSM ranges in a 1 MiB guest RAM. Doorbells are `mmio`, so
//! every command runs on this thread and a run is deterministic. The input format is
//! `iopath_fuzz::nvme`. The controller must never panic; vm-memory refuses every access
//! outside RAM, so an out-of-range access shows up as an error status, not a crash.

#![no_main]

use iopath_devices::nvme::backend::BackendKind;
use iopath_devices::nvme::{DoorbellMode, Nvme, NvmeConfig};
use iopath_devices::{DeviceContext, DeviceModel, GuestMemoryMmap, Interrupts, NoIoEvents};
use iopath_fuzz::nvme::*;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use vm_memory::{Bytes, GuestAddress};

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
    mem: GuestMemoryMmap,
    irq: Arc<Irq>,
    pairs: [Pair; 4],
}

impl Harness {
    fn ctx(&self, mem: GuestMemoryMmap) -> DeviceContext {
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
                let p = &mut self.pairs[*q as usize];
                // The harness's own writes are in RAM: a failure is a harness bug.
                self.mem.write_slice(sqe, GuestAddress(sq + p.tail as u64 * 64)).unwrap();
                p.tail = (p.tail + 1) % size;
                let tail = p.tail as u32;
                self.w(DOORBELLS + 8 * *q as u64, &tail.to_le_bytes());
            }
            Op::Reap { q } => {
                let (_, cq, size) = Self::queue(*q);
                let p = &mut self.pairs[*q as usize];
                for _ in 0..size {
                    let dw3: u32 = self.mem.read_obj(GuestAddress(cq + p.head as u64 * 16 + 12)).unwrap();
                    if dw3 >> 16 & 1 != p.phase {
                        break;
                    }
                    p.head += 1;
                    if p.head == size {
                        p.head = 0;
                        p.phase ^= 1;
                    }
                }
                let head = p.head as u32;
                self.w(DOORBELLS + 8 * *q as u64 + 4, &head.to_le_bytes());
            }
            Op::Mem { gpa, data } => {
                let gpa = *gpa as u64 % MEM_SIZE;
                let n = data.len().min((MEM_SIZE - gpa) as usize);
                self.mem.write_slice(&data[..n], GuestAddress(gpa)).unwrap();
            }
            Op::Config { off, data } => self.n.config_write(*off as usize, data),
            Op::Enable { aqa, cc } => self.enable(*aqa, *cc),
            Op::Reset => {
                self.n.reset();
                self.pairs = [FRESH; 4];
            }
            Op::Attach { gone } => {
                let mem = if *gone { GuestMemoryMmap::default() } else { self.mem.clone() };
                self.n.attach(self.ctx(mem));
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (setup, image, ops) = decode(data);
    let cfg = NvmeConfig {
        backend: if setup & SETUP_NULL != 0 { BackendKind::Null } else { BackendKind::Ram },
        size: NS_SIZE,
        lba_size: if setup & SETUP_LBA4K != 0 { 4096 } else { 512 },
        doorbell: DoorbellMode::Mmio,
    };
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
    mem.write_slice(image, GuestAddress(IMAGE_BASE)).unwrap();
    let irq = Arc::new(Irq { accept: setup & SETUP_IRQ_ACCEPT != 0, host_owned: setup & SETUP_HOST_TABLE != 0 });
    let mut h = Harness { n: Nvme::new(cfg).unwrap(), mem: mem.clone(), irq, pairs: [FRESH; 4] };
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
