//! iopath-doorbell: a test device for doorbell round trips (1234:10db, a
//! test-only ID). The guest rings a doorbell and spins until the device has
//! written the doorbell's sequence number to a completion word in guest RAM:
//! the 2009 ioeventfd measurement, extended to a doorbell that never exits.
//!
//! BAR0 (64-bit memory, 4 KiB):
//!   0x00 magic "IODB" (RO)      0x04 mode (RW): 0 exit, 1 ioeventfd, 2 shm
//!   0x08 completion GPA (RW)    0x10 shm doorbell GPA (RW)
//!   0x18 error (RO)             0x20 exits, 0x28 kicks, 0x30 polls (RO, u64)
//!   0x100 doorbell (WO)
//! BAR2 (I/O, 16 bytes): 0x0 doorbell (WO).
//!
//! mode 0: a doorbell write exits; the vCPU thread completes it.
//! mode 1: both doorbell registers are KVM ioeventfds; a device thread wakes,
//!         adds the eventfd count to the sequence and completes.
//! mode 2: the guest stores the sequence to the shm doorbell word in its RAM;
//!         a device thread polls it and completes. No exit at all.
//! Writing the mode resets the sequence to 0. GPAs are validated when written:
//! a GPA outside guest RAM or misaligned sets `error` and is not taken.

use crate::{le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, Error, IoEventSpec, PciIds};
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub const VENDOR: u16 = 0x1234;
pub const DEVICE: u16 = 0x10db;
pub const MAGIC: u32 = 0x4244_4f49;
pub const REG_MAGIC: u64 = 0x00;
pub const REG_MODE: u64 = 0x04;
pub const REG_COMPLETION: u64 = 0x08;
pub const REG_SHM: u64 = 0x10;
pub const REG_ERROR: u64 = 0x18;
pub const REG_EXITS: u64 = 0x20;
pub const REG_KICKS: u64 = 0x28;
pub const REG_POLLS: u64 = 0x30;
pub const REG_DOORBELL: u64 = 0x100;
pub const BAR_MEM: u8 = 0;
pub const BAR_IO: u8 = 2;

/// Error codes in the `error` register.
pub const ERR_BAD_GPA: u32 = 1;
pub const ERR_COMPLETION_WRITE: u32 = 2;
pub const ERR_NO_IOEVENTFD: u32 = 3;
pub const ERR_BAD_MODE: u32 = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Exit = 0,
    IoEventFd = 1,
    Shm = 2,
}

struct Shared {
    completion: AtomicU64,
    shm: AtomicU64,
    seq: AtomicU64,
    exits: AtomicU64,
    kicks: AtomicU64,
    polls: AtomicU64,
    error: AtomicU32,
}

impl Shared {
    fn complete(&self, mem: &vm_memory::GuestMemoryMmap, seq: u64) {
        let gpa = self.completion.load(Ordering::Relaxed);
        if mem.store(seq, GuestAddress(gpa), Ordering::Release).is_err() {
            self.error.store(ERR_COMPLETION_WRITE, Ordering::Relaxed);
        }
    }
}

struct Worker {
    stop: Arc<AtomicBool>,
    wake: EventFd,
    handle: JoinHandle<()>,
}

pub struct Doorbell {
    shared: Arc<Shared>,
    mode: Mode,
    ctx: Option<DeviceContext>,
    worker: Option<Worker>,
    fds: Option<(EventFd, EventFd)>,
}

impl Default for Doorbell {
    fn default() -> Self {
        Self::new()
    }
}

impl Doorbell {
    pub fn new() -> Self {
        Doorbell {
            shared: Arc::new(Shared {
                completion: AtomicU64::new(0),
                shm: AtomicU64::new(0),
                seq: AtomicU64::new(0),
                exits: AtomicU64::new(0),
                kicks: AtomicU64::new(0),
                polls: AtomicU64::new(0),
                error: AtomicU32::new(0),
            }),
            mode: Mode::Exit,
            ctx: None,
            worker: None,
            fds: None,
        }
    }

    fn specs() -> [IoEventSpec; 2] {
        [
            IoEventSpec { bar: BAR_MEM, offset: REG_DOORBELL, len: 4, datamatch: None },
            IoEventSpec { bar: BAR_IO, offset: 0, len: 4, datamatch: None },
        ]
    }

    fn stop_worker(&mut self) {
        if let Some(w) = self.worker.take() {
            w.stop.store(true, Ordering::Relaxed);
            let _ = w.wake.write(1);
            let _ = w.handle.join();
        }
        if self.mode == Mode::IoEventFd {
            if let (Some((m, p)), Some(ctx)) = (&self.fds, &self.ctx) {
                let [sm, sp] = Self::specs();
                for (s, fd) in [(sm, m), (sp, p)] {
                    if let Err(e) = ctx.ioevents.unregister(s, fd) {
                        log::warn!("iopath-doorbell: cannot remove ioeventfd: {e}");
                    }
                }
                // Fold kicks that arrived after the last completion.
                for fd in [m, p] {
                    if let Ok(n) = fd.read() {
                        self.shared.kicks.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }
        }
        self.mode = Mode::Exit;
    }

    fn gpa_ok(&self, gpa: u64) -> bool {
        let Some(ctx) = &self.ctx else { return false };
        // Mapped memory only: the device polls and stores with atomics, which
        // memory a host reaches by message (vfio-user without an fd) cannot take.
        let mem = ctx.mem.mapped();
        gpa != 0
            && gpa.is_multiple_of(8)
            && gpa.checked_add(7).is_some_and(|end| mem.address_in_range(GuestAddress(end)))
            && mem.address_in_range(GuestAddress(gpa))
    }

    fn set_mode(&mut self, v: u64) {
        self.stop_worker();
        self.shared.seq.store(0, Ordering::Relaxed);
        let mode = match v {
            0 => Mode::Exit,
            1 => Mode::IoEventFd,
            2 => Mode::Shm,
            _ => {
                log::warn!("iopath-doorbell: guest wrote unknown mode {v}");
                self.shared.error.store(ERR_BAD_MODE, Ordering::Relaxed);
                return;
            }
        };
        if mode == Mode::Exit {
            return;
        }
        let Some(ctx) = self.ctx.clone() else { return };
        let stop = Arc::new(AtomicBool::new(false));
        let started = match mode {
            Mode::IoEventFd => self.start_ioeventfd(&ctx, stop.clone()),
            _ => self.start_shm(&ctx, stop.clone()),
        };
        match started {
            Ok(w) => {
                self.worker = Some(w);
                self.mode = mode;
            }
            Err(e) => {
                log::warn!("iopath-doorbell: cannot start mode {mode:?}: {e}");
                self.shared.error.store(ERR_NO_IOEVENTFD, Ordering::Relaxed);
            }
        }
    }

    fn start_ioeventfd(&mut self, ctx: &DeviceContext, stop: Arc<AtomicBool>) -> crate::Result<Worker> {
        if self.fds.is_none() {
            let m = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?;
            let p = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?;
            self.fds = Some((m, p));
        }
        let (m, p) = self.fds.as_ref().unwrap();
        let [sm, sp] = Self::specs();
        ctx.ioevents.register(sm, m)?;
        if let Err(e) = ctx.ioevents.register(sp, p) {
            let _ = ctx.ioevents.unregister(sm, m);
            return Err(e);
        }
        let wake = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?;
        let epoll = Epoll::new().map_err(|e| Error::io("epoll", e))?;
        for (fd, tag) in [(wake.as_raw_fd(), 0u64), (m.as_raw_fd(), 1), (p.as_raw_fd(), 2)] {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, tag))
                .map_err(|e| Error::io("epoll_ctl", e))?;
        }
        let fds = [m.try_clone().map_err(|e| Error::io("dup", e))?, p.try_clone().map_err(|e| Error::io("dup", e))?];
        let shared = self.shared.clone();
        // The GuestMem, not its mapping alone: it keeps what its regions may be windows into.
        let held = ctx.mem.clone();
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("doorbell-ioeventfd".into())
            .spawn(move || {
                crate::sandbox::enter(crate::sandbox::Role::Device);
                let mem = held.mapped();
                let mut events = [EpollEvent::default(); 4];
                while !stop2.load(Ordering::Relaxed) {
                    let n = match epoll.wait(-1, &mut events) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            log::error!("iopath-doorbell: epoll_wait: {e}");
                            return;
                        }
                    };
                    for ev in &events[..n] {
                        let Some(fd) = ev.data().checked_sub(1).and_then(|i| fds.get(i as usize)) else { continue };
                        if let Ok(k) = fd.read() {
                            shared.kicks.fetch_add(k, Ordering::Relaxed);
                            let seq = shared.seq.fetch_add(k, Ordering::Relaxed) + k;
                            shared.complete(mem, seq);
                        }
                    }
                }
            })
            .map_err(|e| Error::io("doorbell thread", e))?;
        Ok(Worker { stop, wake, handle })
    }

    fn start_shm(&mut self, ctx: &DeviceContext, stop: Arc<AtomicBool>) -> crate::Result<Worker> {
        let shm = self.shared.shm.load(Ordering::Relaxed);
        let comp = self.shared.completion.load(Ordering::Relaxed);
        if !self.gpa_ok(shm) || !self.gpa_ok(comp) {
            return Err(Error::Host("shm or completion GPA not set".into()));
        }
        let wake = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("eventfd", e))?;
        let shared = self.shared.clone();
        // The GuestMem, not its mapping alone: it keeps what its regions may be windows into.
        let held = ctx.mem.clone();
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("doorbell-poll".into())
            .spawn(move || {
                crate::sandbox::enter(crate::sandbox::Role::Device);
                let mem = held.mapped();
                // Both slices were validated above; resolve them once, outside the loop.
                let (Ok(db), Ok(cq)) = (mem.get_slice(GuestAddress(shm), 8), mem.get_slice(GuestAddress(comp), 8))
                else {
                    shared.error.store(ERR_BAD_GPA, Ordering::Relaxed);
                    return;
                };
                let mut last = 0u64; // the sequence restarts at 0 with every mode write
                while !stop2.load(Ordering::Relaxed) {
                    let Ok(v) = db.load::<u64>(0, Ordering::Acquire) else { break };
                    if v != last {
                        last = v;
                        shared.polls.fetch_add(1, Ordering::Relaxed);
                        if cq.store(v, 0, Ordering::Release).is_err() {
                            shared.error.store(ERR_COMPLETION_WRITE, Ordering::Relaxed);
                        }
                    } else {
                        std::hint::spin_loop();
                    }
                }
            })
            .map_err(|e| Error::io("doorbell thread", e))?;
        Ok(Worker { stop, wake, handle })
    }

    fn ring_exit(&mut self) {
        self.shared.exits.fetch_add(1, Ordering::Relaxed);
        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(ctx) = &self.ctx {
            self.shared.complete(ctx.mem.mapped(), seq);
        }
    }

    fn regs(&self) -> [u8; 0x38] {
        let s = &self.shared;
        let mut r = [0u8; 0x38];
        r[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        r[4..8].copy_from_slice(&(self.mode as u32).to_le_bytes());
        r[8..16].copy_from_slice(&s.completion.load(Ordering::Relaxed).to_le_bytes());
        r[16..24].copy_from_slice(&s.shm.load(Ordering::Relaxed).to_le_bytes());
        r[24..28].copy_from_slice(&s.error.load(Ordering::Relaxed).to_le_bytes());
        r[32..40].copy_from_slice(&s.exits.load(Ordering::Relaxed).to_le_bytes());
        r[40..48].copy_from_slice(&s.kicks.load(Ordering::Relaxed).to_le_bytes());
        r[48..56].copy_from_slice(&s.polls.load(Ordering::Relaxed).to_le_bytes());
        r
    }

    /// Merges a 1..8-byte write at `off` into the 64-bit GPA register at
    /// `which`. A whole 8-byte write is validated at once; a GPA written in
    /// halves is validated when a mode that uses it starts.
    fn write_gpa(&mut self, which: u64, off: u64, data: &[u8]) {
        let reg = if which == REG_COMPLETION { &self.shared.completion } else { &self.shared.shm };
        let shift = (off - which) * 8;
        let width = data.len() as u64 * 8;
        if shift + width > 64 {
            return;
        }
        let mask = if width == 64 { u64::MAX } else { ((1u64 << width) - 1) << shift };
        let new = (reg.load(Ordering::Relaxed) & !mask) | ((le_value(data) << shift) & mask);
        if width == 64 && !self.gpa_ok(new) {
            log::warn!("iopath-doorbell: guest GPA {new:#x} is outside guest RAM or misaligned");
            self.shared.error.store(ERR_BAD_GPA, Ordering::Relaxed);
            return;
        }
        reg.store(new, Ordering::Relaxed);
    }
}

impl DeviceModelMut for Doorbell {
    fn name(&self) -> String {
        "iopath-doorbell".into()
    }

    fn ids(&self) -> PciIds {
        PciIds {
            vendor: VENDOR,
            device: DEVICE,
            class: 0xff0000,
            revision: 0,
            subsystem_vendor: VENDOR,
            subsystem: DEVICE,
            interrupt_pin: 0,
        }
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![
            BarSpec { index: BAR_MEM, kind: BarKind::Mem64, size: 4096 },
            BarSpec { index: BAR_IO, kind: BarKind::Io, size: 16 },
        ]
    }

    /// A new view of guest memory (a device process's client mapped or
    /// unmapped some): the worker thread holds the old one, so it is stopped
    /// and the mode restarted on the new memory, whose GPAs are checked again.
    fn attach(&mut self, ctx: DeviceContext) {
        let mode = self.mode;
        self.stop_worker();
        self.ctx = Some(ctx);
        if mode != Mode::Exit {
            self.set_mode(mode as u64);
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if bar == BAR_MEM {
            crate::read_regs(&self.regs(), offset, data);
        } else {
            le_fill(data, u64::MAX);
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        match (bar, offset) {
            (BAR_MEM, REG_DOORBELL) | (BAR_IO, 0) => self.ring_exit(),
            (BAR_MEM, REG_MODE) => self.set_mode(le_value(data)),
            (BAR_MEM, o) if (REG_COMPLETION..REG_COMPLETION + 8).contains(&o) => {
                self.write_gpa(REG_COMPLETION, o, data)
            }
            (BAR_MEM, o) if (REG_SHM..REG_SHM + 8).contains(&o) => self.write_gpa(REG_SHM, o, data),
            _ => {}
        }
    }

    fn quiesce(&mut self) {
        self.stop_worker();
    }

    fn counters(&self) -> Vec<Counter> {
        let s = &self.shared;
        vec![
            Counter { name: "exits".into(), value: s.exits.load(Ordering::Relaxed) },
            Counter { name: "kicks".into(), value: s.kicks.load(Ordering::Relaxed) },
            Counter { name: "polls".into(), value: s.polls.load(Ordering::Relaxed) },
        ]
    }
}

impl Drop for Doorbell {
    fn drop(&mut self) {
        self.stop_worker();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn dev() -> (Doorbell, GuestMemoryMmap) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut d = Doorbell::new();
        d.attach(DeviceContext::detached(mem.clone()));
        (d, mem)
    }

    fn rd64(d: &mut Doorbell, off: u64) -> u64 {
        let mut b = [0u8; 8];
        d.bar_read(BAR_MEM, off, &mut b);
        u64::from_le_bytes(b)
    }

    #[test]
    fn exit_doorbell_completes_in_guest_memory() {
        let (mut d, mem) = dev();
        assert_eq!(rd64(&mut d, REG_MAGIC) as u32, MAGIC);
        d.bar_write(BAR_MEM, REG_COMPLETION, &0x1000u64.to_le_bytes());
        d.bar_write(BAR_MEM, REG_DOORBELL, &1u32.to_le_bytes());
        d.bar_write(BAR_IO, 0, &1u32.to_le_bytes());
        assert_eq!(mem.read_obj::<u64>(GuestAddress(0x1000)).unwrap(), 2);
        assert_eq!(rd64(&mut d, REG_EXITS), 2);
    }

    #[test]
    fn hostile_gpas_are_refused() {
        let (mut d, _) = dev();
        for bad in [0x10000u64, 0xfffc, 0x1001, u64::MAX] {
            d.bar_write(BAR_MEM, REG_COMPLETION, &bad.to_le_bytes());
            assert_eq!(rd64(&mut d, REG_ERROR) as u32, ERR_BAD_GPA, "gpa {bad:#x}");
            assert_eq!(rd64(&mut d, REG_COMPLETION), 0);
        }
        // Shared-memory mode without valid GPAs does not start.
        d.shared.error.store(0, Ordering::Relaxed);
        d.bar_write(BAR_MEM, REG_MODE, &2u32.to_le_bytes());
        assert_eq!(d.mode, Mode::Exit);
        assert_ne!(rd64(&mut d, REG_ERROR) as u32, 0);
        d.bar_write(BAR_MEM, REG_MODE, &9u32.to_le_bytes());
        assert_eq!(rd64(&mut d, REG_ERROR) as u32, ERR_BAD_MODE);
        // ioeventfd mode on a host without ioeventfd reports it.
        d.bar_write(BAR_MEM, REG_MODE, &1u32.to_le_bytes());
        assert_eq!(rd64(&mut d, REG_ERROR) as u32, ERR_NO_IOEVENTFD);
    }

    #[test]
    fn shm_doorbell_is_polled_without_exits() {
        let (mut d, mem) = dev();
        d.bar_write(BAR_MEM, REG_COMPLETION, &0x2000u64.to_le_bytes());
        d.bar_write(BAR_MEM, REG_SHM, &0x3000u64.to_le_bytes());
        d.bar_write(BAR_MEM, REG_MODE, &2u32.to_le_bytes());
        let err = rd64(&mut d, REG_ERROR);
        assert_eq!(d.mode, Mode::Shm, "error {err}");
        for seq in 1..=100u64 {
            mem.store(seq, GuestAddress(0x3000), Ordering::Release).unwrap();
            let t0 = std::time::Instant::now();
            while mem.load::<u64>(GuestAddress(0x2000), Ordering::Acquire).unwrap() != seq {
                assert!(t0.elapsed().as_secs() < 10, "device thread never completed {seq}");
                std::hint::spin_loop();
            }
        }
        d.quiesce();
        assert_eq!(rd64(&mut d, REG_POLLS), 100);
        assert_eq!(rd64(&mut d, REG_EXITS), 0);
    }

    #[test]
    fn after_attach_the_poller_no_longer_touches_the_old_memory() {
        let (mut d, old) = dev();
        d.bar_write(BAR_MEM, REG_COMPLETION, &0x2000u64.to_le_bytes());
        d.bar_write(BAR_MEM, REG_SHM, &0x3000u64.to_le_bytes());
        d.bar_write(BAR_MEM, REG_MODE, &2u32.to_le_bytes());
        assert_eq!(d.mode, Mode::Shm);
        // The client takes the memory back and gives other memory.
        let new = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        d.attach(DeviceContext::detached(new.clone()));
        old.store(7u64, GuestAddress(0x3000), Ordering::Release).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(old.load::<u64>(GuestAddress(0x2000), Ordering::Acquire).unwrap(), 0, "old memory written");
        // The mode goes on over the new memory.
        assert_eq!(d.mode, Mode::Shm);
        new.store(1u64, GuestAddress(0x3000), Ordering::Release).unwrap();
        let t0 = std::time::Instant::now();
        while new.load::<u64>(GuestAddress(0x2000), Ordering::Acquire).unwrap() != 1 {
            assert!(t0.elapsed().as_secs() < 10, "the poller does not serve the new memory");
            std::hint::spin_loop();
        }
        d.quiesce();
    }
}
