//! vhost-user: a virtio device's queues served by another process, which
//! maps the guest's RAM from fds and is kicked and calls back through
//! eventfds. `backend` is iopath's device side (virtio-blk behind the
//! `vhost` crate's backend request handler), `frontend` the VMM side (iopath's VMM
//! driving any vhost-user-blk backend through the `vhost` crate).

pub mod backend;
pub mod frontend;
