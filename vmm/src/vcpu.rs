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
use iopath_devices::lock;
use kvm_bindings::kvm_segment;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

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

/// Most marks a run records; later mark lines are ignored.
pub const MAX_MARKS: usize = 64;

/// The exit counts at a guest line that starts with one of `VmConfig::exit_marks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitMark {
    pub line: String,
    /// Bytes of the line with its newline: the PIO writes the line itself
    /// took (inside `exits`), for a guest that writes each byte with one OUT.
    pub bytes: u64,
    /// Counts after the exit that ended the line.
    pub exits: ExitStats,
}

/// Marks requested by the console (a line ended) and taken by the vCPU loop.
#[derive(Debug, Default)]
pub struct ExitMarks {
    prefixes: Vec<String>,
    pending: AtomicBool,
    waiting: Mutex<Option<(String, u64)>>,
    taken: Mutex<Vec<ExitMark>>,
}

impl ExitMarks {
    pub fn new(prefixes: Vec<String>) -> Self {
        ExitMarks { prefixes, ..Default::default() }
    }

    /// Called by the console for each line (`bytes` with its newline).
    pub fn on_line(&self, line: &str, bytes: u64) {
        if self.prefixes.iter().any(|p| line.starts_with(p.as_str())) && self.len() < MAX_MARKS {
            *lock(&self.waiting) = Some((line.to_string(), bytes));
            self.pending.store(true, Ordering::Release);
        }
    }

    fn take(&self, exits: &ExitStats) {
        if self.pending.swap(false, Ordering::Acquire) {
            if let Some((line, bytes)) = lock(&self.waiting).take() {
                lock(&self.taken).push(ExitMark { line, bytes, exits: *exits });
            }
        }
    }

    fn len(&self) -> usize {
        lock(&self.taken).len()
    }

    /// The marks taken, in order.
    pub fn marks(&self) -> Vec<ExitMark> {
        lock(&self.taken).clone()
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
/// (watchdog), or an exit the VMM cannot serve. `marks`, if given, gets the
/// counts at the guest lines it asked for (checked after PIO writes only).
pub fn run_loop(
    vcpu: &mut VcpuFd,
    pio: &Bus,
    mmio: &Bus,
    status: &ExitStatus,
    stop: &AtomicBool,
    marks: Option<&ExitMarks>,
) -> Result<ExitStats, VmmError> {
    let mut s = ExitStats::default();
    loop {
        let fatal = match vcpu.run() {
            Ok(VcpuExit::IoOut(port, data)) => {
                s.io_out += 1;
                if !pio.write(port as u64, data) {
                    s.unclaimed_pio_write += 1;
                }
                if let Some(m) = marks {
                    m.take(&s);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_take_the_counts_at_the_lines_asked_for_and_are_bounded() {
        let m = ExitMarks::new(vec!["@win ".into()]);
        let mut s = ExitStats { io_out: 10, ..Default::default() };
        m.on_line("@other x", 9);
        m.take(&s);
        assert!(m.marks().is_empty(), "a line not asked for is no mark");
        m.on_line("@win start", 11);
        s.io_out = 11;
        m.take(&s);
        m.take(&ExitStats { io_out: 99, ..Default::default() });
        assert_eq!(
            m.marks(),
            vec![ExitMark {
                line: "@win start".into(),
                bytes: 11,
                exits: ExitStats { io_out: 11, ..Default::default() }
            }]
        );
        for _ in 0..2 * MAX_MARKS {
            m.on_line("@win again", 11);
            m.take(&s);
        }
        assert_eq!(m.marks().len(), MAX_MARKS, "a guest cannot make the host keep more");
    }
}
