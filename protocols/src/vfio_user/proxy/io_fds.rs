//! GET_REGION_IO_FDS: the fds a server offers for a BAR's accesses, read at
//! `connect` (see `discovery`). An ioeventfd is installed in KVM at the
//! attach; an ioregionfd region carries the accesses it covers instead of
//! REGION_READ/WRITE messages.
//!
//! It owns the validation of each offer (within the BAR, the BAR's space,
//! a size KVM matches) and both entry layouts deployed servers send
//! (`wire::io_fds`). io fds are optional: an offer this client cannot take
//! is skipped with a log line and its accesses go as messages; an error
//! reply means no offer.

use super::channel::{bad_reply, Channel};
use crate::vfio_user::ioregionfd::RegionClient;
use crate::vfio_user::wire::*;
use crate::{Error, Result};
use iopath_devices::{BarKind, BarSpec, IoEventSpec};
use std::fs::File;
use std::os::unix::net::UnixStream;
use vmm_sys_util::eventfd::EventFd;

/// What the server offered for its BARs' accesses.
#[derive(Default)]
pub(super) struct IoFdOffers {
    /// Ioeventfds: installed as KVM ioeventfds at attach.
    pub(super) ioevents: Vec<(IoEventSpec, EventFd)>,
    /// ioregionfd regions, by BAR.
    pub(super) regions: Vec<(u8, RegionClient)>,
}

impl IoFdOffers {
    /// Asks for, and takes what it can of, the io fds of BAR `b`.
    pub(super) fn ask(&mut self, chan: &mut Channel, b: BarSpec) -> Result<()> {
        let Some((reply, fds)) = request(chan, b)? else { return Ok(()) };
        let name = chan.peer.name.clone();
        for e in reply.entries {
            let fd = match fds.get(e.fd_index() as usize).map(|f| f.try_clone()) {
                Some(Ok(fd)) => fd,
                Some(Err(err)) => return Err(Error::io("dup of an io fd", err)),
                None => {
                    skip(&name, b, &e, &format!("no fd {} among the {} sent", e.fd_index(), fds.len()));
                    continue;
                }
            };
            if let Err(why) = self.take(b, &e, fd) {
                skip(&name, b, &e, &why.to_string());
            }
        }
        Ok(())
    }

    /// Takes entry `e` with its fd, or says why it cannot.
    fn take(&mut self, b: BarSpec, e: &IoFdEntry, fd: File) -> std::result::Result<(), Untaken> {
        let io = b.kind == BarKind::Io;
        match *e {
            IoFdEntry::IoEventFd { offset, size, flags, datamatch, .. } => {
                if offset.checked_add(size.max(1)).is_none_or(|x| x > b.size)
                    || (flags & KVM_IOEVENTFD_FLAG_PIO != 0) != io
                    || !matches!(size, 0 | 1 | 2 | 4 | 8)
                {
                    return Err(Untaken::BadIoEventFd);
                }
                let dm = (flags & KVM_IOEVENTFD_FLAG_DATAMATCH != 0).then_some(datamatch);
                let spec = IoEventSpec { bar: b.index, offset, len: size as u32, datamatch: dm };
                self.ioevents.push((spec, iopath_devices::irq::eventfd_from(fd)));
            }
            IoFdEntry::IoRegionFd { offset, size, flags, user_data, .. } => {
                if offset.checked_add(size).is_none_or(|x| x > b.size) || (flags & KVM_IOREGION_PIO != 0) != io {
                    return Err(Untaken::BadIoRegionFd);
                }
                let posted = flags & KVM_IOREGION_POSTED_WRITES != 0;
                let s = UnixStream::from(std::os::fd::OwnedFd::from(fd));
                self.regions.push((b.index, RegionClient::new(s, offset, size, user_data, posted)));
            }
            IoFdEntry::ShadowIoEventFd { .. } => return Err(Untaken::Shadow),
            IoFdEntry::Other { ty, flags, .. } => return Err(Untaken::Unknown { ty, flags }),
        }
        Ok(())
    }
}

/// Why an io fd sub-region the server offers is not taken (it is skipped).
#[derive(Debug, thiserror::Error)]
enum Untaken {
    #[error("outside the BAR, the wrong space or an access size KVM does not match")]
    BadIoEventFd,
    #[error("outside the BAR or the wrong space")]
    BadIoRegionFd,
    #[error("a shadow ioeventfd (libvfio-user's; it needs a patched KVM, which this one is not)")]
    Shadow,
    #[error("type {ty} with flags {flags:#x} is unknown")]
    Unknown { ty: u32, flags: u32 },
}

/// GET_REGION_IO_FDS of BAR `b`, asked again with the size a truncated
/// reply names (below 1 MiB); None if the server answers with an error.
fn request(chan: &mut Channel, b: BarSpec) -> Result<Option<(IoFdsReply, Vec<File>)>> {
    let mut argsz = 16 + 40 * 8;
    loop {
        let q = IoFdsRequest { argsz, index: b.index as u32 };
        let r = match chan.request(Command::DeviceGetRegionIoFds, &q.to_bytes(), &[]) {
            Ok(r) => r,
            Err(e @ Error::Remote { .. }) => {
                log::info!("{}: no io fds for BAR{}: {e}", chan.peer.name, b.index);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let reply = IoFdsReply::parse(&r.payload).map_err(bad_reply(format!("REGION_IO_FDS {}", b.index)))?;
        if reply.is_truncated() && reply.argsz > argsz && reply.argsz < 1 << 20 {
            argsz = reply.argsz;
            continue;
        }
        return Ok(Some((reply, r.fds)));
    }
}

fn skip(name: &str, b: BarSpec, e: &IoFdEntry, why: &str) {
    log::info!("{name}: BAR{}: skipping io fd sub-region {e:?}: {why}", b.index);
}
