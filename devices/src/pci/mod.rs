//! PCI as a device carries it: the type-0 configuration header
//! ([`ConfigSpace`], in `config.rs`) and MSI-X ([`MsixTable`], in `msix.rs`).
//!
//! Neither knows buses. The host (the VMM's PCI host, a device process)
//! builds a [`ConfigSpace`] from a model's ids, BARs and [`Capability`]s,
//! (the PCI Express and Power Management ones in `caps.rs`)
//! and reads the decoded BAR placements from [`ConfigSpace::bar_placement`]
//! after each write. A capability says where it sits
//! ([`Capability::offset`]): the model and the host agree on its offset
//! through that value, never through a constant kept in two places.

pub mod caps;
mod config;
mod msix;

pub use config::ConfigSpace;
pub use msix::{MsixTable, MSIX_CAP_LEN, MSIX_ENTRY_SIZE, MSIX_MAX_VECTORS};

use crate::BarSpec;

pub const PCI_COMMAND: usize = 0x04;
pub const PCI_COMMAND_IO: u16 = 0x1;
pub const PCI_COMMAND_MEMORY: u16 = 0x2;
pub const PCI_COMMAND_MASTER: u16 = 0x4;
pub const PCI_COMMAND_INTX_DISABLE: u16 = 0x400;
pub const PCI_STATUS: usize = 0x06;
/// Status register: the header has a capability list.
pub const PCI_STATUS_CAP_LIST: u8 = 0x10;
pub const PCI_BAR0: usize = 0x10;
pub const PCI_CAPABILITY_LIST: usize = 0x34;
pub const PCI_INTERRUPT_LINE: usize = 0x3c;
pub const CONFIG_SIZE: usize = 256;
/// The first byte a capability may use (the end of the type-0 header).
pub const PCI_CAP_START: usize = 0x40;

pub const PCI_CAP_ID_MSIX: u8 = 0x11;

/// A PCI capability a device declares: where it sits in the header, its ID,
/// its body (the bytes after the ID and next pointer) and which body bits
/// the guest may write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capability {
    /// Offset of the capability (its ID byte) in the header: at least
    /// [`PCI_CAP_START`], dword aligned. [`ConfigSpace::add_capabilities`]
    /// puts it exactly there, and the device uses the same value to
    /// recognise configuration writes to it.
    pub offset: usize,
    pub id: u8,
    pub body: Vec<u8>,
    pub wmask: Vec<u8>,
}

/// Where a BAR currently decodes, if it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BarPlacement {
    pub spec: BarSpec,
    pub addr: u64,
}

/// What a configuration write changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConfigChange {
    /// A BAR register or the command register's decode bits changed.
    pub decode: bool,
}
