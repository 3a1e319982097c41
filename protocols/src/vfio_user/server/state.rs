//! The server's half of iopath's state memory extension (`wire::state`):
//! VERSION answers it only to a client that proposed it, for a device
//! that keeps state (`DeviceModel::state_len`), within the client's
//! proposal; STATE_MEMORY hands the client's memfd to the device
//! (`DeviceModel::adopt_state`). Every refusal is an error reply whose
//! errno says which kind, with the reason logged here.

use super::{no_fds, Reply, Session};
use crate::vfio_user::wire::{StateMemoryMsg, MAX_STATE_MEMORY};
use crate::{Error, Result};
use iopath_devices::state::StateMemory;
use std::os::fd::OwnedFd;

impl Session<'_> {
    /// The state memory VERSION answers to a client's proposal: the
    /// device's size, if it keeps state and the client holds that much.
    pub(super) fn state_answer(&self, proposed: Option<u64>) -> Option<u64> {
        let max = proposed?;
        let want = self.srv.function().device.state_len()?.next_multiple_of(8) as u64;
        if want == 0 || want > max.min(MAX_STATE_MEMORY) {
            let peer = self.peer;
            log::warn!("vfio-user {peer}: the device keeps {want} bytes of state; the client holds {max}: none");
            return None;
        }
        Some(want)
    }

    /// STATE_MEMORY: the memfd to the device, fresh or to resume from.
    /// ENOTSUP if VERSION agreed on none, EINVAL for a bad message or
    /// memory, EIO if the device refuses it.
    pub(super) fn state_memory(&mut self, m: &crate::vfio_user::Received) -> Result<Reply> {
        let peer = self.peer;
        let Some(len) = self.caps.state_memory else {
            log::warn!("vfio-user {peer}: STATE_MEMORY without state memory agreed in VERSION");
            no_fds(m).ok();
            return Ok(Reply::Error(libc::ENOTSUP));
        };
        let msg = StateMemoryMsg::parse(&m.payload)?;
        let [fd] = m.fds.as_slice() else {
            return Err(Error::protocol(format!("STATE_MEMORY with {} fds, not 1", m.fds.len())));
        };
        if msg.size != len {
            return Err(Error::protocol(format!("STATE_MEMORY of {} bytes; VERSION agreed on {len}", msg.size)));
        }
        let fd = OwnedFd::from(fd.try_clone().map_err(|e| Error::io("dup of the state memory", e))?);
        let mem = match StateMemory::from_fd(fd, len as usize) {
            Ok(mem) if mem.len() as u64 == len => mem,
            Ok(mem) => return Err(Error::protocol(format!("state memory of {} bytes, not {len}", mem.len()))),
            Err(e) => return Err(Error::protocol(e.to_string())),
        };
        let device = self.srv.function().device.clone();
        match device.adopt_state(mem, msg.resume()) {
            Ok(()) => {
                let how = if msg.resume() { "resumed from" } else { "recording in" };
                log::info!("vfio-user {peer}: {} {how} {len} bytes of state memory", device.name());
                Ok(Reply::Data(Vec::new(), Vec::new()))
            }
            Err(e) => {
                log::warn!("vfio-user {peer}: {} refused its state memory: {e}", device.name());
                Ok(Reply::Error(libc::EIO))
            }
        }
    }
}
