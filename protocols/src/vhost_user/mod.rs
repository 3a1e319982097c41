//! vhost-user, the registry's queue transport ([`VhostUser`]): a virtio
//! device's queues served by another process, which maps the guest's RAM
//! from fds and is kicked and calls back through eventfds; the function
//! (registers, configuration, interrupts) stays in the VMM. `backend` is
//! iopath's device side ([`VhostUserBackend`](backend::VhostUserBackend):
//! virtio-blk behind the `vhost` crate's backend request handler),
//! `frontend` the VMM side (iopath's VMM driving any vhost-user-blk backend
//! through the `vhost` crate).

pub mod backend;
pub mod frontend;

use crate::process::DeviceProcess;
use crate::serve::ServeOptions;
use crate::transport::QueueTransport;
use crate::Result;
use iopath_devices::SharedDevice;
use std::os::unix::net::UnixStream;

/// vhost-user as a [`QueueTransport`]: virtio-blk's queues
/// (`virtio-blk@vhost-user`, `vhost-user-blk:PATH`,
/// `iopath serve virtio-blk --transport vhost-user`).
pub struct VhostUser;

impl QueueTransport for VhostUser {
    fn name(&self) -> &'static str {
        "vhost-user"
    }

    fn device(&self) -> &'static str {
        "virtio-blk"
    }

    fn any_backend(&self) -> &'static str {
        "vhost-user-blk"
    }

    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, queues: u16) -> Result<SharedDevice> {
        frontend::connect(sock, child, self.any_backend(), queues)
    }

    fn connect_again(
        &self,
        sock: UnixStream,
        child: Option<DeviceProcess>,
        queues: u16,
        again: Option<crate::respawn::Reconnect>,
    ) -> Result<SharedDevice> {
        frontend::connect_again(sock, child, self.any_backend(), queues, again)
    }

    fn serve(&self, o: &ServeOptions) -> Result<()> {
        backend::serve(self, o)
    }
}
