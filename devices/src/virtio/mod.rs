//! virtio 1.x devices: split virtqueues ([`queue`]), the block device
//! ([`blk`]) and the modern PCI transport ([`pci`]).

pub mod blk;
pub mod queue;

#[cfg(test)]
mod fake;
