//! Device models, written once.
//!
//! A device model sees its BARs as offsets, guest memory as a
//! [`GuestMemoryMmap`], and asks for KVM ioeventfds through the [`IoEvents`]
//! trait. It never learns which transport carries its accesses (a VMM exit,
//! an ioeventfd, or later a message from another process): that is what makes
//! the transports comparable. This crate must not touch KVM or the VMM.

pub mod doorbell;
pub mod pci;
pub mod testdev;

use std::fmt;
pub use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// Kind of a Base Address Register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Mem32,
    /// 64-bit memory BAR (takes two BAR slots).
    Mem64,
    /// I/O space BAR.
    Io,
}

/// One BAR a device implements: its slot, kind and size (a power of two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarSpec {
    pub index: u8,
    pub kind: BarKind,
    pub size: u64,
}

/// PCI identity of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    /// Class code (base, sub, prog-if) in bits 23:0.
    pub class: u32,
    pub revision: u8,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
}

/// A KVM ioeventfd a device asks for, in BAR terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoEventSpec {
    pub bar: u8,
    pub offset: u64,
    /// Access length that hits: 1, 2, 4, 8, or 0 for any length.
    pub len: u32,
    /// Only a write of this value hits (None: any value, a "wildcard").
    pub datamatch: Option<u64>,
}

/// Registers ioeventfds for a device; implemented by the transport that hosts it.
pub trait IoEvents: Send + Sync {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> Result<(), String>;
    fn unregister(&self, spec: IoEventSpec, fd: &EventFd) -> Result<(), String>;
}

/// An [`IoEvents`] for hosts without ioeventfd: every request fails, so the
/// device falls back to serving the access where it arrives.
pub struct NoIoEvents;
impl IoEvents for NoIoEvents {
    fn register(&self, _: IoEventSpec, _: &EventFd) -> Result<(), String> {
        Err("this transport has no ioeventfd".into())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> Result<(), String> {
        Ok(())
    }
}

/// What a device gets from whoever hosts it.
#[derive(Clone)]
pub struct DeviceContext {
    pub mem: GuestMemoryMmap,
    pub ioevents: std::sync::Arc<dyn IoEvents>,
}

/// A named device counter (routing checks read these).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    pub name: String,
    pub value: u64,
}

impl fmt::Display for Counter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.value)
    }
}

/// A PCI device model.
///
/// `bar_read`/`bar_write` receive an offset inside BAR `bar`; `data.len()` is
/// the access size (1, 2, 4 or 8). A model must accept any offset and size
/// without panicking: out-of-range reads return all-ones, writes are dropped.
pub trait DeviceModel: Send {
    /// Short name, e.g. "pci-testdev".
    fn name(&self) -> &str;
    fn ids(&self) -> PciIds;
    fn bars(&self) -> Vec<BarSpec>;
    /// Called once before the first access.
    fn attach(&mut self, ctx: DeviceContext);
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]);
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]);
    /// Stops device threads and folds pending ioeventfd kicks into counters.
    fn quiesce(&mut self) {}
    fn counters(&self) -> Vec<Counter>;
}

/// Little-endian value of an access of 1..=8 bytes.
pub fn le_value(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

/// Fills an access of 1..=8 bytes with the low bytes of `v`.
pub fn le_fill(data: &mut [u8], v: u64) {
    let b = v.to_le_bytes();
    for (i, d) in data.iter_mut().enumerate() {
        *d = if i < 8 { b[i] } else { 0xff };
    }
}

/// Reads `data.len()` bytes at `offset` of a little-endian register file,
/// all-ones past its end.
pub fn read_regs(regs: &[u8], offset: u64, data: &mut [u8]) {
    for (i, d) in data.iter_mut().enumerate() {
        *d = offset
            .checked_add(i as u64)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|o| regs.get(o).copied())
            .unwrap_or(0xff);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn le_helpers() {
        assert_eq!(le_value(&[0x34, 0x12]), 0x1234);
        let mut d = [0u8; 4];
        le_fill(&mut d, 0xaabbccdd);
        assert_eq!(d, [0xdd, 0xcc, 0xbb, 0xaa]);
        let mut r = [0u8; 4];
        read_regs(&[1, 2, 3], 1, &mut r);
        assert_eq!(r, [2, 3, 0xff, 0xff]);
        read_regs(&[1, 2, 3], u64::MAX, &mut r);
        assert_eq!(r, [0xff; 4]);
    }
}
