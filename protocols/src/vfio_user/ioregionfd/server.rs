//! The device process's half of a region: a thread per region fd that
//! serves its commands on the function, and the GET_REGION_IO_FDS entry
//! that hands the other end to the client.

use super::wire::{resp, Cmd, CMD_WRITE, MSG_SIZE};
use crate::function::PciFunction;
use crate::vfio_user::wire::{IoFdEntry, KVM_IOREGION_PIO, KVM_IOREGION_POSTED_WRITES};
use crate::{Error, Result};
use iopath_devices::{le_value, BarKind, BarSpec};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A region covering all of BAR `bar` (GET_REGION_IO_FDS of type
/// IOREGIONFD): its entry (fd index 0) and the client's end of the fd. A
/// thread serves the device's end until the client closes its end. With
/// `posted`, writes get no response.
pub(crate) fn offer(f: Arc<Mutex<PciFunction>>, bar: BarSpec, posted: bool) -> Result<(IoFdEntry, OwnedFd)> {
    let (mine, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
    spawn_server(mine, f, bar.index, 0, bar.size).map_err(|e| Error::io("ioregionfd thread", e))?;
    let pio = if bar.kind == BarKind::Io { KVM_IOREGION_PIO } else { 0 };
    let flags = pio | if posted { KVM_IOREGION_POSTED_WRITES } else { 0 };
    let entry = IoFdEntry::IoRegionFd { offset: 0, size: bar.size, fd_index: 0, flags, user_data: bar.index as u64 };
    Ok((entry, OwnedFd::from(theirs)))
}

/// Serves one region fd in a thread until the client closes it: commands
/// go to BAR `bar` of `f` at `start + offset`. A malformed command or one
/// outside the region ends the channel with a log line.
pub fn spawn_server(
    fd: UnixStream,
    f: Arc<Mutex<PciFunction>>,
    bar: u8,
    start: u64,
    size: u64,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(format!("ioregionfd-bar{bar}")).spawn(move || {
        iopath_devices::sandbox::enter(iopath_devices::sandbox::Role::Region);
        let mut fd = fd;
        let mut b = [0u8; MSG_SIZE];
        loop {
            crate::socket::spin_until_readable(std::os::fd::AsRawFd::as_raw_fd(&fd));
            if fd.read_exact(&mut b).is_err() {
                return; // client gone
            }
            let c = match Cmd::decode(&b) {
                Ok(c) => c,
                Err(e) => {
                    log::error!("ioregionfd BAR{bar}: {e}; closing the region");
                    return;
                }
            };
            if c.offset.checked_add(c.len() as u64).is_none_or(|e| e > size) {
                log::error!("ioregionfd BAR{bar}: access at {:#x} outside the region; closing it", c.offset);
                return;
            }
            let mut data = [0u8; 8];
            let n = c.len();
            let value = {
                let mut g = iopath_devices::lock(&f);
                if c.cmd == CMD_WRITE {
                    data.copy_from_slice(&c.data.to_le_bytes());
                    g.bar_write(bar, start + c.offset, &data[..n]);
                    0
                } else {
                    g.bar_read(bar, start + c.offset, &mut data[..n]);
                    le_value(&data[..n])
                }
            };
            if c.resp && fd.write_all(&resp(value)).is_err() {
                return;
            }
        }
    })
}
