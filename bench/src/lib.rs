//! Benchmarks: scenarios that run the guest on iopath's VMM, on the bare
//! KVM_RUN floor and on QEMU, collect the guest's `@row` records and the
//! devices' counters, verify routing, and report medians and ratios.

pub mod backing;
pub mod blk;
pub mod contend;
pub mod cpu;
pub mod exits;
pub mod fio;
pub mod fiojobs;
pub mod fioout;
pub mod floor;
pub mod guard;
pub mod guestline;
pub mod host;
pub mod interrupt;
pub mod nvme;
pub mod pin;
pub mod progress;
pub mod qemu;
pub mod qmp;
pub mod record;
pub mod remote;
pub mod report;
pub mod spdk;
pub mod stats;
pub mod wake;
