//! The sandboxing hook of device threads. Each thread a device process runs
//! calls [`enter`] with its [`Role`] as the first thing it does; a binary
//! that confines itself (`iopath serve`'s seccomp filters, in
//! `iopath_protocols::seccomp`) sets the hook once with [`set_hook`] and
//! narrows each thread to what its role needs. Without a hook (the VMM,
//! library users, tests) `enter` does nothing. This module knows no
//! system call: the policy lives with the binary that sets the hook.

use std::sync::OnceLock;

/// What a thread does, which bounds the system calls it may make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A session's own thread: accepts clients, receives messages with fds,
    /// maps guest memory, builds and drives the device. Whatever the
    /// process may do at all.
    Session,
    /// Serves the BAR accesses of one region fd (ioregionfd): reads and
    /// writes its socket, and does whatever a BAR access makes the device
    /// do, which may start device threads.
    Region,
    /// A session's reader: receives the client's messages (with fds) and
    /// hands them on.
    Reader,
    /// A device thread: doorbell pollers, eventfd waiters, and the NVMe
    /// queues they serve with their backend I/O and DMA.
    Device,
    /// Waits on one eventfd and signals another (INTx resample).
    Irq,
}

impl Role {
    /// Every role, for policies that build one filter per role.
    pub const ALL: [Role; 5] = [Role::Session, Role::Region, Role::Reader, Role::Device, Role::Irq];

    /// The role's name, lower case (for reports).
    pub fn name(self) -> &'static str {
        match self {
            Role::Session => "session",
            Role::Region => "region",
            Role::Reader => "reader",
            Role::Device => "device",
            Role::Irq => "irq",
        }
    }
}

/// What [`enter`] calls: confines the calling thread to its role.
pub type Hook = fn(Role);

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Sets the process's hook; false if one was already set (it stays).
pub fn set_hook(hook: Hook) -> bool {
    HOOK.set(hook).is_ok()
}

/// Confines the calling thread to `role` if the process has a hook; call it
/// first in every thread body a device process may run.
pub fn enter(role: Role) {
    if let Some(h) = HOOK.get() {
        h(role);
    }
}
