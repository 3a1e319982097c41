//! Out-of-process device protocols: how a guest's BAR access reaches a
//! device model that runs in another process.
//!
//! Each protocol is a folder with its wire codec, its proxy (the VMM side: a
//! `DeviceModel` the VMM hosts) and its server (the device side, in
//! `iopath serve`):
//! - [`mpqemu`]: QEMU's multi-process protocol.
//! - [`vfio_user`]: vfio-user, and [`vfio_user::ioregionfd`], its extension
//!   that carries BAR accesses on ioregionfd region fds.
//!
//! Each one is a [`Transport`] with one entry in [`TRANSPORTS`]; [`attach`]
//! (the VMM side), [`serve`] (the device process) and the benches find it
//! there by name. Shared by all: [`socket`] (messages with SCM_RIGHTS fds),
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
pub use transport::{transport, Server, Transport, TRANSPORTS};
