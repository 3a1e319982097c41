//! virtio 1.x devices: split virtqueues ([`queue`]), the block device
//! ([`blk`]), the modern PCI transport ([`transport`]: up to 16 queues, a
//! [`QueueEngine`](transport::QueueEngine) serving them) and virtio-blk
//! served in the VMM ([`pci`]; a file disk's io_uring side in `blk_async`)
//! with its options ([`options`]), error injection and the timing model
//! between its rings and its storage (`blk_emu`).

pub mod blk;
mod blk_async;
pub mod blk_emu;
pub mod inflight;
pub mod options;
pub mod pci;
pub mod queue;
pub mod transport;
mod worker;

#[cfg(test)]
mod fake;
