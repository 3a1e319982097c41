//! Transports: how a guest's BAR access reaches a device model.
//!
//! - [`exit`]: the access exits KVM to the VMM's vCPU thread, which calls the
//!   device model directly (KVM_EXIT_MMIO / KVM_EXIT_IO).
//! - [`ioeventfd`]: KVM consumes a matching write in the kernel and signals an
//!   eventfd that a device thread waits on (the value is lost, only counted).
//!
//! Out-of-process transports (mpqemu, ioregionfd, vfio-user) and the
//! shared-memory doorbell are added here, one file each. This crate knows the
//! device model trait and KVM; it does not know the VMM's buses.

pub mod attach;
pub mod function;
pub mod ioregionfd;
pub mod mpqemu;
pub mod peer;
pub mod process;
pub mod serve;
pub mod socket;
pub mod vfio_user;
