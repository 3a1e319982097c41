//! Errors of the VMM: what KVM refused, what the host could not give, a
//! guest image that does not load, a PCI layout that does not fit, and how
//! a guest run ended when it did not end well.

use crate::loader::LoadError;
use crate::pci::PciError;

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot open /dev/kvm: {0} (is KVM enabled, and may this user open /dev/kvm?)")]
    NoKvm(#[source] kvm_ioctls::Error),
    /// A KVM ioctl failed.
    #[error("{what}: {source}")]
    Kvm {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A host resource (thread, eventfd, memfd) could not be had.
    #[error("{what}: {source}")]
    Host {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} panicked")]
    Panicked(&'static str),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("guest image: {0}")]
    Load(#[from] LoadError),
    #[error("PCI: {0}")]
    Pci(#[from] PciError),
    #[error("bus: {0}")]
    Bus(#[from] crate::bus::Overlap),
    /// A device stopped the run (its device process died, say).
    #[error("device: {0}")]
    Device(String),
    #[error("{reason} (guest RIP {rip:#x})")]
    Guest { reason: String, rip: u64 },
    #[error("the guest did not finish in time (guest RIP {rip:#x})")]
    Timeout { rip: u64 },
    /// The caller's cancel flag (`VmConfig::cancel`) stopped the run.
    #[error("the run was cancelled (interrupted by a signal)")]
    Cancelled,
}
