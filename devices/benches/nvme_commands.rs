//! The NVMe controller's own cost per command, in one thread with every
//! line in its cache: the SQ tail doorbell of a batch of 16 commands served
//! at once (`doorbell=mmio`: the write serves the queue in the caller), then
//! the CQ head doorbell. Only those two calls are timed; the driver's work
//! (entries written, completions read) is not.
//!
//! In `bench nvme` the same work runs on another core than the guest's, and
//! each command's entry, completion and doorbell lines cross between the two
//! caches. The difference between this figure and `bench nvme`'s device CPU
//! per I/O at QD16 is what those crossings cost.
//!
//! `read-null-state` is `read-null` with the controller keeping its state in
//! state memory (each command's entry into a slot, its completion, the SQ
//! head and CQ tail words: `nvme/state/`): their difference is that cost.
//!
//! `cargo bench -p iopath-devices --bench nvme_commands`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use iopath_devices::nvme::Nvme;
use iopath_devices::state::StateMemory;
use iopath_devices::{DeviceConfig, DeviceContext, DeviceModel, GuestMemoryMmap};
use std::time::{Duration, Instant};
use vm_memory::{Bytes, GuestAddress};

/// BAR0: the doorbells (SQ y tail at 0x1000 + 8y, CQ y head at 0x1004 + 8y; CAP.DSTRD 0).
const DOORBELLS: u64 = 0x1000;
const ASQ: u64 = 0x10000;
const ACQ: u64 = 0x11000;
const IOSQ: u64 = 0x20000;
const IOCQ: u64 = 0x30000;
const DATA: u64 = 0x100000;
/// I/O queue entries, and commands per doorbell (the guest's QD16).
const QSIZE: u16 = 64;
const BATCH: u16 = 16;

/// A driver of one I/O queue pair, polled (no interrupts).
struct Driver {
    n: Nvme,
    mem: GuestMemoryMmap,
    sq_tail: u16,
    cq_head: u16,
    phase: u32,
    bs: u64,
}

impl Driver {
    /// With `state`, the controller keeps its state in state memory (as a
    /// client that offers it makes it: `nvme/state/`).
    fn new(config: &str, bs: u64, state: bool) -> Driver {
        let DeviceConfig::Nvme(cfg) = config.parse().expect("a device configuration") else {
            panic!("{config}: not an nvme configuration")
        };
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap();
        let n = Nvme::new(cfg).unwrap();
        n.attach(DeviceContext::detached(mem.clone()));
        if state {
            let len = n.state_len().expect("the controller keeps state memory");
            n.adopt_state(StateMemory::create(len).unwrap(), false).unwrap();
        }
        let mut d = Driver { n, mem, sq_tail: 0, cq_head: 0, phase: 1, bs };
        d.w32(0x24, 31 << 16 | 31); // AQA: 32-entry admin queues
        d.n.bar_write(0, 0x28, &ASQ.to_le_bytes());
        d.n.bar_write(0, 0x30, &ACQ.to_le_bytes());
        d.w32(0x14, 0x0046_0001); // CC: enabled, 64-byte SQEs, 16-byte CQEs
        let q = (QSIZE as u32 - 1) << 16 | 1;
        d.admin(0, 0x05, IOCQ, q, 1); // Create I/O CQ 1: contiguous, no interrupts
        d.admin(1, 0x01, IOSQ, q, 1 << 16 | 1); // Create I/O SQ 1 on CQ 1
        d
    }

    fn w32(&self, off: u64, v: u32) {
        self.n.bar_write(0, off, &v.to_le_bytes());
    }

    /// Admin command `slot` of a fresh admin queue; its completion must succeed.
    fn admin(&mut self, slot: u64, op: u8, prp1: u64, cdw10: u32, cdw11: u32) {
        let mut e = [0u8; 64];
        e[0] = op;
        e[2] = slot as u8 + 1;
        e[24..32].copy_from_slice(&prp1.to_le_bytes());
        e[40..44].copy_from_slice(&cdw10.to_le_bytes());
        e[44..48].copy_from_slice(&cdw11.to_le_bytes());
        self.mem.write_slice(&e, GuestAddress(ASQ + slot * 64)).unwrap();
        self.w32(DOORBELLS, slot as u32 + 1);
        let dw3: u32 = self.mem.read_obj(GuestAddress(ACQ + slot * 16 + 12)).unwrap();
        assert_eq!(dw3 >> 16 & 1, 1, "admin command {op:#x} completed");
        assert_eq!(dw3 >> 17, 0, "admin command {op:#x} succeeded");
        self.w32(DOORBELLS + 4, slot as u32 + 1);
    }

    /// Writes a batch of reads (each slot its own buffer and LBAs).
    fn fill(&mut self) {
        let lbas = (self.bs / 512) as u32;
        for _ in 0..BATCH {
            let slot = self.sq_tail as u64;
            let mut e = [0u8; 64];
            e[0] = 0x02;
            e[2..4].copy_from_slice(&self.sq_tail.to_le_bytes());
            e[4..8].copy_from_slice(&1u32.to_le_bytes());
            e[24..32].copy_from_slice(&(DATA + slot * self.bs).to_le_bytes());
            e[40..44].copy_from_slice(&((slot as u32) * lbas).to_le_bytes());
            e[48..52].copy_from_slice(&(lbas - 1).to_le_bytes());
            self.mem.write_slice(&e, GuestAddress(IOSQ + slot * 64)).unwrap();
            self.sq_tail = (self.sq_tail + 1) % QSIZE;
        }
    }

    /// Reads the batch's completions; each must be there and succeed.
    fn reap(&mut self) {
        for _ in 0..BATCH {
            let dw3: u32 = self.mem.read_obj(GuestAddress(IOCQ + self.cq_head as u64 * 16 + 12)).unwrap();
            assert_eq!(dw3 >> 16 & 1, self.phase, "a completion for each command");
            assert_eq!(dw3 >> 17, 0, "the read succeeded");
            self.cq_head += 1;
            if self.cq_head == QSIZE {
                self.cq_head = 0;
                self.phase ^= 1;
            }
        }
    }

    /// One batch: the two doorbells timed, the rest not.
    fn batch(&mut self) -> Duration {
        self.fill();
        let t = Instant::now();
        self.w32(DOORBELLS + 8, self.sq_tail as u32);
        let served = t.elapsed();
        self.reap();
        let t = Instant::now();
        self.w32(DOORBELLS + 12, self.cq_head as u32);
        served + t.elapsed()
    }
}

fn commands(c: &mut Criterion) {
    let mut g = c.benchmark_group("nvme-commands");
    g.throughput(Throughput::Elements(BATCH as u64));
    // `-state`: the state memory's cost per command (`bench nvme --state-memory on,off` in a guest).
    for (backend, bs, state) in
        [("null", 512u64, false), ("null", 512, true), ("ram", 512, false), ("ram", 4096, false)]
    {
        let config = format!("nvme,doorbell=mmio,backend={backend},size_mb=64");
        let mut d = Driver::new(&config, bs, state);
        let name = format!("read-{backend}{}", if state { "-state" } else { "" });
        g.bench_function(BenchmarkId::new(name, bs), |b| b.iter_custom(|iters| (0..iters).map(|_| d.batch()).sum()));
    }
    g.finish();
}

criterion_group!(benches, commands);
criterion_main!(benches);
