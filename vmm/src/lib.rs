//! The iopath VMM: a small KVM virtual machine built on rust-vmm crates.
//!
//! - [`memory`]: guest RAM backed by a memfd (shareable with device processes).
//! - [`bus`]: PIO and MMIO buses, a range map of [`bus::BusDevice`]s.
//! - [`pci`]: the PCI host (type-1 config access at 0xCF8/0xCFC), BAR placement
//!   and the mapping of BARs onto the buses and onto KVM ioeventfds.
//! - [`serial`], [`debug_exit`]: a 16550 at 0x3f8 and isa-debug-exit at 0xf4.
//! - [`loader`]: Multiboot ELF loading; [`vcpu`]: vCPU state and the exit loop.
//! - [`vm`]: puts these together and runs a guest; [`bare`]: a bare KVM_RUN
//!   loop with no buses, the floor that the VMM's exit path is compared with.

pub mod bar;
pub mod bar_area;
pub mod bare;
pub mod bus;
pub mod debug_exit;
pub mod error;
pub mod ioeventfd;
pub mod irq;
pub mod kvm;
pub mod loader;
pub mod memory;
pub mod pci;
pub mod serial;
pub mod vcpu;
pub mod vm;

pub use memory::RamKind;
pub use vm::{run, RunReport, VmConfig, VmmError};
