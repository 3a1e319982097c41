//! The scratch device of the recipe tests (`recipe_device.rs`, `recipe_transport.rs`): a PCI
//! device that lives in the tests only, an implementation of `DeviceModelMut` and nothing else,
//! with what iopath's guest image does to it (`workload=pci`, which finds any function by its
//! ids) and the checks of both sides: the guest's values and the device's own trace.
#![allow(dead_code)] // each recipe test uses a part of it

use iopath_devices::{BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, PciIds, SharedDevice};
use iopath_vmm::{run, RunReport, VmConfig};
use std::sync::Mutex;
use std::time::Duration;

pub const VENDOR: u16 = 0x1234;
pub const DEVICE: u16 = 0x11ea;
/// BAR 0 (4 KiB, memory): a scratch register, the count of writes it took (read only), a magic.
pub const SCRATCH: u64 = 0x0;
pub const COUNT: u64 = 0x4;
pub const MAGIC: u64 = 0x8;
pub const MAGIC_VALUE: u32 = 0x5ca7_c4ed;

/// The recipe's device: one register the guest writes and reads back, and a count of the
/// writes it took that the guest reads, so both sides can be checked against each other.
#[derive(Default)]
pub struct Scratch {
    pub scratch: u32,
    pub writes: u64,
    pub reads: u64,
    /// Writes to anything but the scratch register (dropped).
    pub dropped: u64,
    /// Every access as (op, offset, width), in order.
    pub trace: Vec<(char, u64, usize)>,
}

impl DeviceModelMut for Scratch {
    fn name(&self) -> String {
        "scratch".into()
    }
    fn ids(&self) -> PciIds {
        PciIds {
            vendor: VENDOR,
            device: DEVICE,
            class: 0xff_00_00,
            revision: 1,
            subsystem_vendor: VENDOR,
            subsystem: 1,
            interrupt_pin: 0,
        }
    }
    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem32, size: 4096 }]
    }
    fn attach(&mut self, _ctx: DeviceContext) {}
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        self.trace.push(('r', offset, data.len()));
        let v = match (bar, offset, data.len()) {
            (0, SCRATCH, 4) => self.scratch,
            (0, COUNT, 4) => self.writes as u32,
            (0, MAGIC, 4) => MAGIC_VALUE,
            _ => return data.fill(0xff),
        };
        self.reads += 1;
        data.copy_from_slice(&v.to_le_bytes());
    }
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        self.trace.push(('w', offset, data.len()));
        match (bar, offset, <[u8; 4]>::try_from(data)) {
            (0, SCRATCH, Ok(b)) => {
                self.scratch = u32::from_le_bytes(b);
                self.writes += 1;
            }
            _ => self.dropped += 1,
        }
    }
    fn counters(&self) -> Vec<Counter> {
        let c = |name: &str, value| Counter { name: name.into(), value };
        vec![c("writes", self.writes), c("reads", self.reads), c("dropped", self.dropped)]
    }
}

/// What the guest does: write, read back, write again, read the count, write the read-only
/// count (dropped), read it again, read the magic. Values in hex, as `workload=pci` takes them.
pub const OPS: &str = "w4:0:0:cafe,r4:0:0,w4:0:0:beef,r4:0:0,r4:0:4,w4:0:4:ff,r4:0:4,r4:0:8";

/// The guest's `@pciio` records as (op, offset, value).
pub fn pciio(r: &RunReport) -> Vec<(String, u64, u64)> {
    let field = |l: &str, k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
    let hex = |s: String| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    r.lines
        .iter()
        .filter(|l| l.starts_with("@pciio "))
        .map(|l| {
            assert!(!l.contains("status="), "the guest refused an access: {l}");
            (field(l, "op=").unwrap(), hex(field(l, "off=").unwrap()), hex(field(l, "value=").unwrap()))
        })
        .collect()
}

/// Boots iopath's guest image with `device` and its `workload=pci` on the scratch device;
/// checks what the guest read against what the device holds.
pub fn guest_accesses(device: SharedDevice) -> RunReport {
    assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing: this test needs KVM");
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &format!("workload=pci id={VENDOR:04x}:{DEVICE:04x} ops={OPS}"));
    cfg.devices = vec![device];
    cfg.timeout = Duration::from_secs(120);
    let r = run(cfg).unwrap();
    assert_eq!(r.status, 1, "the guest failed: {:#?}", r.lines);
    let want = [
        ("w", SCRATCH, 0xcafe),
        ("r", SCRATCH, 0xcafe),
        ("w", SCRATCH, 0xbeef),
        ("r", SCRATCH, 0xbeef),
        ("r", COUNT, 2),
        ("w", COUNT, 0xff),
        ("r", COUNT, 2),
        ("r", MAGIC, MAGIC_VALUE as u64),
    ];
    let want: Vec<(String, u64, u64)> = want.iter().map(|&(o, off, v)| (o.to_string(), off, v)).collect();
    assert_eq!(pciio(&r), want, "guest lines: {:#?}", r.lines);
    r
}

/// The device's own record after the guest's accesses: each reached it exactly once, in order.
pub fn check_device(dev: &Mutex<Scratch>) {
    let d = dev.lock().unwrap();
    let want = [('w', 0, 4), ('r', 0, 4), ('w', 0, 4), ('r', 0, 4), ('r', 4, 4), ('w', 4, 4), ('r', 4, 4), ('r', 8, 4)];
    assert_eq!(d.trace, want);
    assert_eq!((d.writes, d.reads, d.dropped, d.scratch), (2, 5, 1, 0xbeef));
}

pub fn counter(c: &[Counter], name: &str) -> u64 {
    c.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no counter {name} in {c:?}")).value
}
