//! Out-of-process device protocols: how a guest's BAR access reaches a
//! device model that runs in another process.
//!
//! Each protocol is a folder with both its sides: the VMM's (a
//! `DeviceModel` the VMM hosts) and the device process's (in `iopath serve`).
//! The function transports carry a whole PCI function (a wire codec, a
//! proxy, a server):
//! - [`mpqemu`]: QEMU's multi-process protocol.
//! - [`vfio_user`]: vfio-user, and [`vfio_user::ioregionfd`], its extension
//!   that carries BAR accesses on ioregionfd region fds.
//!
//! The queue transports carry a device's queues, its function staying in
//! the VMM (a frontend, a backend):
//! - [`vhost_user`]: vhost-user, virtio-blk's queues.
//!
//! Each one is a [`Transport`] ([`FunctionTransport`] or
//! [`QueueTransport`]) with one entry in [`TRANSPORTS`]; [`attach`] (the VMM
//! side), [`serve`] (the device process) and the benches find it there by
//! name. Shared by all: [`socket`] (messages with SCM_RIGHTS fds),
//! [`peer`] (what a proxy keeps about its device process), [`process`]
//! (starting one, reading its report), [`function`] (a model and its
//! configuration space, as a device process hosts it).
//!
//! This crate knows the device model trait and hands interrupt eventfds
//! around; it does not call KVM and does not know the VMM's buses.

pub mod attach;
pub mod error;
pub mod function;
pub mod landlock;
pub mod mpqemu;
pub mod nopath;
pub mod peer;
pub mod process;
pub mod respawn;
pub mod seccomp;
pub mod serve;
pub mod sigbus;
pub mod socket;
pub mod transport;
pub mod vfio_user;
pub mod vhost_user;

#[cfg(test)]
mod testing;

pub use error::{Error, Result};
pub use transport::{function_transports, transport, FunctionTransport, QueueTransport, Server, Transport, TRANSPORTS};
