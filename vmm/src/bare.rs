//! The floor: the same guest image under a bare KVM_RUN loop.
//!
//! No buses, no devices, no PCI: the loop keeps serial bytes (0x3f8), stops at
//! isa-debug-exit (0xf4), answers every read with all-ones and re-enters KVM
//! at once for everything else. The guest's `floor` workload makes the same
//! accesses as its exit rows, so iopath's exit path can be stated as a ratio
//! to this loop, measured in the same run.

use crate::vcpu::ExitStats;
use crate::vm::{boot, watched, Machine};
use crate::VmmError;
use kvm_ioctls::VcpuExit;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub struct BareReport {
    pub status: i32,
    pub lines: Vec<String>,
    pub exits: ExitStats,
    pub tsc_khz: u32,
}

pub fn run_bare(image: &[u8], cmdline: &str, mem_size: u64, timeout: Duration) -> Result<BareReport, VmmError> {
    let Machine { vm, ram, mut vcpu, tsc_khz } = boot(image, cmdline, mem_size, crate::memory::RamKind::Auto)?;
    let (r, out) = watched(timeout, None, None, move |stop| {
        let mut out = Vec::<u8>::new();
        let mut s = ExitStats::default();
        let r = loop {
            match vcpu.run() {
                Ok(VcpuExit::IoOut(port, data)) => {
                    s.io_out += 1;
                    match port {
                        0x3f8 if out.len() < (16 << 20) => out.push(data[0]),
                        0xf4 => break Ok(((data[0] as i32) << 1) | 1),
                        _ => {}
                    }
                }
                Ok(VcpuExit::IoIn(_, data)) => {
                    s.io_in += 1;
                    data.fill(0xff)
                }
                Ok(VcpuExit::MmioRead(_, data)) => {
                    s.mmio_read += 1;
                    data.fill(0xff)
                }
                Ok(VcpuExit::MmioWrite(..)) => s.mmio_write += 1,
                Ok(other) => break Err(Some(format!("unexpected exit {other:?}"))),
                Err(e) if e.errno() == libc::EINTR => {
                    if stop.load(Ordering::Acquire) {
                        break Err(None);
                    }
                }
                Err(e) => break Err(Some(format!("KVM_RUN: {e}"))),
            }
        };
        let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or(0);
        ((r, s, rip), out)
    })?;
    drop(vm);
    drop(ram);
    let (r, exits, rip) = r;
    let lines = String::from_utf8_lossy(&out).lines().map(|l| l.trim_end_matches('\r').to_string()).collect();
    match r {
        Ok(status) => Ok(BareReport { status, lines, exits, tsc_khz }),
        // None: stopped by the watchdog.
        Err(None) => Err(VmmError::Timeout { rip }),
        Err(Some(reason)) => Err(VmmError::Guest { reason, rip }),
    }
}
