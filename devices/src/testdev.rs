//! pci-testdev: register-compatible with QEMU's `-device pci-testdev`
//! (docs/specs/pci-testdev.txt; 1b36:0005).
//!
//! BAR0 is 4 KiB of MMIO, BAR1 256 bytes of I/O. Each BAR begins with the
//! header {test u8, width u8, pad u16, offset u32, data u32, count u32, name}.
//! Writing N to `test` on a BAR starts test N of that BAR's type; tests are
//! no-eventfd, wildcard-eventfd and datamatch-eventfd. An eventfd test asks
//! its host for a real KVM ioeventfd (1 byte, wildcard or datamatch 0xFA).
//! As in QEMU, nothing waits on the eventfd: KVM adds each kick to its
//! counter, which is folded into the kick counter when the guest reads the
//! header and when the device is quiesced (the eventfd counter loses none).
//! The wake-up of a waiting device thread is measured by iopath-doorbell's
//! ioeventfd rows instead. A write that reaches the device is counted in
//! `count`, as QEMU does: routing shows in `count` (exits) and the kicks.
//!
//! Hosted where ioeventfds are announced once to another process (vfio-user),
//! every eventfd test's ioeventfd is registered at attach and kept; the tests
//! use distinct offsets, so routing is the same. Reads of a BAR's `data`
//! register are counted (`<bar>.data-reads`) for the read rows.

use crate::{le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, IoEventSpec, PciIds};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub const VENDOR: u16 = 0x1b36;
pub const DEVICE: u16 = 0x0005;
pub const BAR_MEM: u8 = 0;
pub const BAR_IO: u8 = 1;
const MEM_SIZE: u64 = 4096;
const IO_SIZE: u64 = 256;
const TESTS_PER_BAR: usize = 3;
const DATAMATCH: u8 = 0xfa;
const NOMATCH: u8 = 0xce;
const HDR_TEST: u64 = 0;
const TD_DATA: u64 = 8;
const HDR_NAME: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    NoEventfd,
    Wildcard,
    Datamatch,
}

struct Test {
    name: String,
    bar: u8,
    kind: Kind,
    offset: u32,
    data: u8,
    /// Header bytes as the guest reads them (count patched in on read).
    count: u32,
    exits_total: u64,
    kicks: u64,
    fd: Option<EventFd>,
    ioeventfd_errors: u64,
}

impl Test {
    fn spec(&self) -> IoEventSpec {
        IoEventSpec {
            bar: self.bar,
            offset: self.offset as u64,
            len: 1,
            datamatch: (self.kind == Kind::Datamatch).then_some(self.data as u64),
        }
    }

    /// Adds what KVM counted on the eventfd since the last read to `kicks`.
    fn fold_kicks(&mut self) {
        if let Some(Ok(n)) = self.fd.as_ref().map(|fd| fd.read()) {
            self.kicks += n;
        }
    }

    fn header(&self) -> Vec<u8> {
        let mut h = vec![0u8; HDR_NAME];
        h[1] = 1; // width
        h[4..8].copy_from_slice(&self.offset.to_le_bytes());
        h[8..12].copy_from_slice(&(self.data as u32).to_le_bytes());
        h[12..16].copy_from_slice(&self.count.to_le_bytes());
        h.extend_from_slice(self.name.as_bytes());
        h.push(0);
        h
    }
}

pub struct PciTestDev {
    tests: Vec<Test>,
    current: Option<usize>,
    ctx: Option<DeviceContext>,
    /// Reads of the `data` register, per BAR (mem, io).
    data_reads: [u64; 2],
}

impl Default for PciTestDev {
    fn default() -> Self {
        Self::new()
    }
}

impl PciTestDev {
    pub fn new() -> Self {
        let mut tests = Vec::new();
        for (t, (ty, bar, base)) in
            [("mmio", BAR_MEM, MEM_SIZE / 2), ("portio", BAR_IO, IO_SIZE / 2)].into_iter().enumerate()
        {
            for (k, (kname, kind)) in [
                ("no-eventfd", Kind::NoEventfd),
                ("wildcard-eventfd", Kind::Wildcard),
                ("datamatch-eventfd", Kind::Datamatch),
            ]
            .into_iter()
            .enumerate()
            {
                let i = t * TESTS_PER_BAR + k;
                tests.push(Test {
                    name: format!("{ty}-{kname}"),
                    bar,
                    kind,
                    offset: (base + i as u64) as u32,
                    data: if kind == Kind::Wildcard { NOMATCH } else { DATAMATCH },
                    count: 0,
                    exits_total: 0,
                    kicks: 0,
                    fd: None,
                    ioeventfd_errors: 0,
                });
            }
        }
        PciTestDev { tests, current: None, ctx: None, data_reads: [0; 2] }
    }

    fn static_ioevents(&self) -> bool {
        self.ctx.as_ref().is_some_and(|c| c.ioevents.static_only())
    }

    fn stop_current(&mut self) {
        let Some(cur) = self.current.take() else {
            return;
        };
        if self.static_ioevents() {
            return;
        }
        let t = &self.tests[cur];
        if let (Some(fd), Some(ctx)) = (&t.fd, &self.ctx) {
            if let Err(e) = ctx.ioevents.unregister(t.spec(), fd) {
                log::warn!("pci-testdev: cannot remove the ioeventfd of {}: {e}", t.name);
            }
        }
    }

    fn start(&mut self, bar: u8, n: u64) {
        self.stop_current();
        if n >= TESTS_PER_BAR as u64 {
            return;
        }
        let idx = if bar == BAR_MEM { 0 } else { TESTS_PER_BAR } + n as usize;
        let registered = self.static_ioevents();
        let t = &mut self.tests[idx];
        t.count = 0;
        if t.kind != Kind::NoEventfd && !registered {
            match (&t.fd, &self.ctx) {
                (Some(fd), Some(ctx)) => {
                    if let Err(e) = ctx.ioevents.register(t.spec(), fd) {
                        // Keep the test selected: its writes then exit and the
                        // routing check reports the eventfd row as wrong.
                        t.ioeventfd_errors += 1;
                        log::info!("pci-testdev: no ioeventfd for {}: {e}", t.name);
                    }
                }
                _ => t.ioeventfd_errors += 1,
            }
        }
        self.current = Some(idx);
    }

    fn drain(&mut self) {
        self.tests.iter_mut().for_each(Test::fold_kicks);
    }

    fn create_eventfds(&mut self) -> std::io::Result<()> {
        for t in self.tests.iter_mut().filter(|t| t.kind != Kind::NoEventfd && t.fd.is_none()) {
            t.fd = Some(EventFd::new(EFD_NONBLOCK)?);
        }
        Ok(())
    }

    /// Registers every eventfd test's ioeventfd now (hosts that announce them once).
    fn register_all(&mut self) {
        let Some(ctx) = self.ctx.clone() else { return };
        for t in self.tests.iter_mut() {
            if let Some(fd) = &t.fd {
                if let Err(e) = ctx.ioevents.register(t.spec(), fd) {
                    t.ioeventfd_errors += 1;
                    log::info!("pci-testdev: no ioeventfd for {}: {e}", t.name);
                }
            }
        }
    }

    fn bar_of(&self, bar: u8) -> Option<BarKind> {
        match bar {
            BAR_MEM => Some(BarKind::Mem32),
            BAR_IO => Some(BarKind::Io),
            _ => None,
        }
    }
}

impl DeviceModelMut for PciTestDev {
    fn name(&self) -> String {
        "pci-testdev".into()
    }

    fn ids(&self) -> PciIds {
        PciIds {
            vendor: VENDOR,
            device: DEVICE,
            class: 0xff0000,
            revision: 0,
            subsystem_vendor: 0x1af4,
            subsystem: 0x1100,
            interrupt_pin: 0, // as QEMU's pci-testdev: no INTx
        }
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![
            BarSpec { index: BAR_MEM, kind: BarKind::Mem32, size: MEM_SIZE },
            BarSpec { index: BAR_IO, kind: BarKind::Io, size: IO_SIZE },
        ]
    }

    fn attach(&mut self, ctx: DeviceContext) {
        let first = self.ctx.is_none();
        self.ctx = Some(ctx);
        if let Err(e) = self.create_eventfds() {
            log::error!("pci-testdev: cannot create eventfds: {e}");
        }
        if first && self.static_ioevents() {
            self.register_all();
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if self.bar_of(bar).is_none() {
            le_fill(data, u64::MAX);
            return;
        }
        if offset == TD_DATA {
            self.data_reads[bar as usize] += 1;
        }
        let Some(cur) = self.current else {
            data.fill(0);
            return;
        };
        // Reading clears a pending notification, as QEMU's device does.
        self.tests[cur].fold_kicks();
        let h = self.tests[cur].header();
        for (i, d) in data.iter_mut().enumerate() {
            *d = offset.checked_add(i as u64).and_then(|o| h.get(o as usize)).copied().unwrap_or(0);
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if self.bar_of(bar).is_none() || data.is_empty() {
            return; // an empty write does nothing
        }
        if offset == HDR_TEST {
            self.start(bar, le_value(&data[..1]));
            return;
        }
        let Some(cur) = self.current else { return };
        let t = &mut self.tests[cur];
        if t.bar != bar || offset != t.offset as u64 {
            return;
        }
        if t.kind == Kind::Datamatch && (data.len() != 1 || le_value(data) != t.data as u64) {
            return;
        }
        t.count = t.count.wrapping_add(1);
        t.exits_total += 1;
    }

    fn reset(&mut self) {
        self.drain();
        self.stop_current();
        self.tests.iter_mut().for_each(|t| t.count = 0);
    }

    fn quiesce(&mut self) {
        self.drain();
    }

    fn counters(&self) -> Vec<Counter> {
        let mut v = Vec::new();
        for t in &self.tests {
            v.push(Counter { name: format!("{}.exits", t.name), value: t.exits_total });
            v.push(Counter { name: format!("{}.kicks", t.name), value: t.kicks });
            if t.ioeventfd_errors > 0 {
                v.push(Counter { name: format!("{}.ioeventfd_errors", t.name), value: t.ioeventfd_errors });
            }
        }
        v.push(Counter { name: "mmio.data-reads".into(), value: self.data_reads[0] });
        v.push(Counter { name: "portio.data-reads".into(), value: self.data_reads[1] });
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IoEvents, NoIoEvents};
    use std::sync::{Arc, Mutex};
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    #[derive(Default)]
    struct Recorder(Mutex<Vec<(bool, IoEventSpec)>>);
    impl IoEvents for Recorder {
        fn register(&self, s: IoEventSpec, _: &EventFd) -> crate::Result<()> {
            self.0.lock().unwrap().push((true, s));
            Ok(())
        }
        fn unregister(&self, s: IoEventSpec, _: &EventFd) -> crate::Result<()> {
            self.0.lock().unwrap().push((false, s));
            Ok(())
        }
    }

    fn ctx(io: Arc<dyn IoEvents>) -> DeviceContext {
        let mut c = DeviceContext::detached(GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap());
        c.ioevents = io;
        c
    }

    fn read32(d: &mut PciTestDev, bar: u8, off: u64) -> u32 {
        let mut b = [0u8; 4];
        d.bar_read(bar, off, &mut b);
        u32::from_le_bytes(b)
    }

    fn name(d: &mut PciTestDev, bar: u8) -> String {
        let mut s = Vec::new();
        for i in 0..64 {
            let mut b = [0u8];
            d.bar_read(bar, HDR_NAME as u64 + i, &mut b);
            if b[0] == 0 {
                break;
            }
            s.push(b[0]);
        }
        String::from_utf8(s).unwrap()
    }

    #[test]
    fn header_matches_qemu_layout() {
        let mut d = PciTestDev::new();
        d.attach(ctx(Arc::new(NoIoEvents)));
        let want = [
            (BAR_MEM, 0, "mmio-no-eventfd", 2048, 0xfa),
            (BAR_MEM, 1, "mmio-wildcard-eventfd", 2049, 0xce),
            (BAR_MEM, 2, "mmio-datamatch-eventfd", 2050, 0xfa),
            (BAR_IO, 0, "portio-no-eventfd", 131, 0xfa),
            (BAR_IO, 1, "portio-wildcard-eventfd", 132, 0xce),
            (BAR_IO, 2, "portio-datamatch-eventfd", 133, 0xfa),
        ];
        for (bar, n, nm, off, data) in want {
            d.bar_write(bar, 0, &[n]);
            let mut w = [0u8];
            d.bar_read(bar, 1, &mut w);
            assert_eq!(w[0], 1, "width");
            assert_eq!(read32(&mut d, bar, 4), off, "offset of {nm}");
            assert_eq!(read32(&mut d, bar, 8), data, "data of {nm}");
            assert_eq!(read32(&mut d, bar, 12), 0, "count starts at 0");
            assert_eq!(name(&mut d, bar), nm);
        }
        // Past the last test the width is 0: the guest's scan stops there.
        d.bar_write(BAR_MEM, 0, &[3]);
        let mut w = [0xffu8];
        d.bar_read(BAR_MEM, 1, &mut w);
        assert_eq!(w[0], 0);
    }

    #[test]
    fn exits_are_counted_only_when_they_match() {
        let mut d = PciTestDev::new();
        d.attach(ctx(Arc::new(NoIoEvents)));
        d.bar_write(BAR_MEM, 0, &[0]);
        for _ in 0..16 {
            d.bar_write(BAR_MEM, 2048, &[0xfa]);
        }
        d.bar_write(BAR_MEM, 2047, &[0xfa]); // wrong offset
        d.bar_write(BAR_IO, 2048, &[0xfa]); // wrong BAR
        assert_eq!(read32(&mut d, BAR_MEM, 12), 16);
        d.bar_write(BAR_IO, 0, &[2]); // datamatch: value and size must match
        d.bar_write(BAR_IO, 133, &[0xfb]);
        d.bar_write(BAR_IO, 133, &[0xfa, 0]);
        d.bar_write(BAR_IO, 133, &[0xfa]);
        assert_eq!(read32(&mut d, BAR_IO, 12), 1);
        // Hostile offsets and sizes neither panic nor count.
        d.bar_write(BAR_IO, u64::MAX, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let mut b = [0u8; 8];
        d.bar_read(BAR_IO, u64::MAX - 2, &mut b);
        d.bar_read(7, 0, &mut b);
        assert_eq!(b, [0xff; 8]);
    }

    #[test]
    fn eventfd_tests_register_and_remove_ioeventfds() {
        let rec = Arc::new(Recorder::default());
        let mut d = PciTestDev::new();
        d.attach(ctx(rec.clone()));
        d.bar_write(BAR_MEM, 0, &[1]);
        d.bar_write(BAR_MEM, 0, &[2]);
        d.bar_write(BAR_IO, 0, &[0]);
        let log = rec.0.lock().unwrap().clone();
        let wild = IoEventSpec { bar: BAR_MEM, offset: 2049, len: 1, datamatch: None };
        let dm = IoEventSpec { bar: BAR_MEM, offset: 2050, len: 1, datamatch: Some(0xfa) };
        assert_eq!(log, vec![(true, wild), (false, wild), (true, dm), (false, dm)]);
    }

    struct StaticRecorder(Recorder);
    impl IoEvents for StaticRecorder {
        fn register(&self, s: IoEventSpec, fd: &EventFd) -> crate::Result<()> {
            self.0.register(s, fd)
        }
        fn unregister(&self, s: IoEventSpec, fd: &EventFd) -> crate::Result<()> {
            self.0.unregister(s, fd)
        }
        fn static_only(&self) -> bool {
            true
        }
    }

    #[test]
    fn static_hosts_get_every_ioeventfd_once_at_attach() {
        let rec = Arc::new(StaticRecorder(Recorder::default()));
        let mut d = PciTestDev::new();
        d.attach(ctx(rec.clone()));
        d.attach(ctx(rec.clone())); // a new memory map registers nothing again
        d.bar_write(BAR_MEM, 0, &[1]);
        d.bar_write(BAR_MEM, 0, &[2]);
        let log = rec.0 .0.lock().unwrap().clone();
        assert_eq!(log.len(), 4, "{log:?}");
        assert!(log.iter().all(|(reg, _)| *reg));
        // Reads of `data` are counted per BAR.
        read32(&mut d, BAR_IO, 8);
        read32(&mut d, BAR_IO, 8);
        let c = d.counters();
        assert_eq!(c.iter().find(|c| c.name == "portio.data-reads").unwrap().value, 2);
    }

    #[test]
    fn kicks_are_folded_into_the_counter() {
        let mut d = PciTestDev::new();
        d.attach(ctx(Arc::new(Recorder::default())));
        d.bar_write(BAR_IO, 0, &[1]);
        let fd = d.tests[4].fd.as_ref().unwrap().try_clone().unwrap();
        for _ in 0..5 {
            fd.write(1).unwrap();
        }
        d.quiesce();
        let c = d.counters();
        let k = c.iter().find(|c| c.name == "portio-wildcard-eventfd.kicks").unwrap();
        assert_eq!(k.value, 5);
    }

    #[test]
    fn empty_and_odd_sized_accesses_on_every_offset_never_panic() {
        let mut d = PciTestDev::new();
        for (bar, size) in [(BAR_MEM, MEM_SIZE), (BAR_IO, IO_SIZE)] {
            for off in 0..size + 8 {
                for len in [0usize, 1, 3, 5, 7] {
                    d.bar_write(bar, off, &[0u8; 8][..len]);
                    let mut b = vec![0xaau8; len];
                    d.bar_read(bar, off, &mut b);
                }
            }
        }
        d.bar_write(BAR_MEM, 0, &[]);
        d.bar_write(2, 0, &[]);
    }
}
