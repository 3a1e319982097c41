//! vCPU state and the exit loop.
//!
//! The guest starts as a Multiboot kernel: 32-bit protected mode, paging off,
//! flat segments, EAX = 0x2BADB002, EBX = the information structure. The loop
//! matches each exit and hands it to a bus; nothing else runs on the hot path
//! but a counter increment. An exit the VMM cannot handle stops the run with
//! the exit reason and the guest RIP.

use crate::bus::Bus;
use crate::debug_exit::ExitStatus;
use crate::VmmError;
use kvm_bindings::kvm_segment;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// Counts of exits by kind, and of accesses no device claimed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExitStats {
    pub io_in: u64,
    pub io_out: u64,
    pub mmio_read: u64,
    pub mmio_write: u64,
    pub unclaimed_pio_read: u64,
    pub unclaimed_pio_write: u64,
    pub unclaimed_mmio_read: u64,
    pub unclaimed_mmio_write: u64,
    /// KVM_RUN returned EINTR (a watchdog kick).
    pub interrupted: u64,
}

impl ExitStats {
    pub fn total(&self) -> u64 {
        self.io_in + self.io_out + self.mmio_read + self.mmio_write
    }
    pub fn fields(&self) -> [(&'static str, u64); 9] {
        [
            ("io_in", self.io_in),
            ("io_out", self.io_out),
            ("mmio_read", self.mmio_read),
            ("mmio_write", self.mmio_write),
            ("unclaimed_pio_read", self.unclaimed_pio_read),
            ("unclaimed_pio_write", self.unclaimed_pio_write),
            ("unclaimed_mmio_read", self.unclaimed_mmio_read),
            ("unclaimed_mmio_write", self.unclaimed_mmio_write),
            ("interrupted", self.interrupted),
        ]
    }
}

fn flat(selector: u16, type_: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Puts the vCPU in the state the Multiboot specification defines.
pub fn setup_multiboot(kvm: &Kvm, vcpu: &VcpuFd, entry: u64, mbi: u64) -> Result<(), VmmError> {
    let k = |what: &'static str, source: kvm_ioctls::Error| VmmError::Kvm { what, source };
    let cpuid =
        kvm.get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES).map_err(|e| k("KVM_GET_SUPPORTED_CPUID", e))?;
    vcpu.set_cpuid2(&cpuid).map_err(|e| k("KVM_SET_CPUID2", e))?;
    let mut sregs = vcpu.get_sregs().map_err(|e| k("KVM_GET_SREGS", e))?;
    sregs.cs = flat(0x18, 0xb);
    let data = flat(0x10, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.cr0 = (sregs.cr0 | 0x1 | 0x10) & !0x8000_0000;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs).map_err(|e| k("KVM_SET_SREGS", e))?;
    let mut regs = vcpu.get_regs().map_err(|e| k("KVM_GET_REGS", e))?;
    regs.rip = entry;
    regs.rax = crate::loader::MULTIBOOT_BOOTLOADER_MAGIC as u64;
    regs.rbx = mbi;
    regs.rflags = 0x2;
    regs.rsp = 0x8000;
    vcpu.set_regs(&regs).map_err(|e| k("KVM_SET_REGS", e))?;
    Ok(())
}

fn rip(vcpu: &VcpuFd) -> u64 {
    vcpu.get_regs().map(|r| r.rip).unwrap_or(u64::MAX)
}

/// The exit loop: runs until the guest writes isa-debug-exit, `stop` is set
/// (watchdog), or an exit the VMM cannot serve.
pub fn run_loop(
    vcpu: &mut VcpuFd,
    pio: &Bus,
    mmio: &Bus,
    status: &ExitStatus,
    stop: &AtomicBool,
) -> Result<ExitStats, VmmError> {
    let mut s = ExitStats::default();
    loop {
        let fatal = match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                s.io_out += 1;
                if !pio.write(port as u64, data) {
                    s.unclaimed_pio_write += 1;
                }
                if status.get().is_some() {
                    return Ok(s);
                }
                continue;
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                s.io_in += 1;
                if !pio.read(port as u64, data) {
                    s.unclaimed_pio_read += 1;
                    data.fill(0xff);
                }
                continue;
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                s.mmio_write += 1;
                if !mmio.write(addr, data) {
                    s.unclaimed_mmio_write += 1;
                }
                continue;
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                s.mmio_read += 1;
                if !mmio.read(addr, data) {
                    s.unclaimed_mmio_read += 1;
                    data.fill(0xff);
                }
                continue;
            }
            Ok(VcpuExit::Hlt) => "the guest halted (HLT) without writing isa-debug-exit".to_string(),
            Ok(VcpuExit::Shutdown) => "the guest shut down (triple fault)".to_string(),
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                format!("KVM entry failed: hardware reason {reason:#x} on cpu {cpu}")
            }
            Ok(VcpuExit::InternalError) => "KVM internal error (emulation failure)".to_string(),
            Ok(VcpuExit::SystemEvent(t, _)) => format!("system event {t}"),
            Ok(other) => format!("unexpected exit {other:?}"),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                s.interrupted += 1;
                if stop.load(Ordering::Acquire) {
                    return Err(VmmError::Timeout { rip: rip(vcpu) });
                }
                continue;
            }
            Err(e) => format!("KVM_RUN: {e}"),
        };
        return Err(VmmError::Guest { reason: fatal, rip: rip(vcpu) });
    }
}
