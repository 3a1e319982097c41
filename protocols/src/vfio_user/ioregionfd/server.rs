//! The device process's half of a region: a thread per region fd that
//! serves its commands on the function, and the region a vfio-user session
//! owns, whose client end GET_REGION_IO_FDS hands out.

use super::wire::{resp, Cmd, CMD_WRITE, MSG_SIZE};
use crate::function::PciFunction;
use crate::vfio_user::wire::{IoFdEntry, KVM_IOREGION_PIO, KVM_IOREGION_POSTED_WRITES};
use crate::{Error, Result};
use iopath_devices::{le_value, BarKind, BarSpec};
use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// A region covering all of BAR `bar` (GET_REGION_IO_FDS of type
/// IOREGIONFD), owned by one vfio-user session: one thread serves the
/// device's end; every offer hands out a copy of the same client end. Its
/// drop (the session's end) shuts the device's end down both ways, so a
/// client that kept a copy reads EOF and gets EPIPE, and joins the thread:
/// nothing sent on an old copy reaches the device once the session is over.
pub(crate) struct Region {
    entry: IoFdEntry,
    theirs: OwnedFd,
    /// The device's end (a copy of the one the thread reads), to shut down.
    mine: UnixStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Region {
    /// Creates the region of BAR `bar` and starts its thread. With
    /// `posted`, writes get no response.
    pub(crate) fn new(f: Arc<Mutex<PciFunction>>, bar: BarSpec, posted: bool) -> Result<Region> {
        let (mine, theirs) = UnixStream::pair().map_err(|e| Error::io("socketpair", e))?;
        let served = mine.try_clone().map_err(|e| Error::io("dup of a region fd", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread =
            spawn(served, f, bar.index, 0, bar.size, stop.clone()).map_err(|e| Error::io("ioregionfd thread", e))?;
        let pio = if bar.kind == BarKind::Io { KVM_IOREGION_PIO } else { 0 };
        let flags = pio | if posted { KVM_IOREGION_POSTED_WRITES } else { 0 };
        let entry =
            IoFdEntry::IoRegionFd { offset: 0, size: bar.size, fd_index: 0, flags, user_data: bar.index as u64 };
        Ok(Region { entry, theirs: OwnedFd::from(theirs), mine, stop, thread: Some(thread) })
    }

    /// False once its thread ended (the client broke the rules on it).
    pub(crate) fn served(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Its entry (fd index 0) and a copy of the client's end.
    pub(crate) fn offer(&self) -> Result<(IoFdEntry, OwnedFd)> {
        let fd = self.theirs.try_clone().map_err(|e| Error::io("dup of a region fd", e))?;
        Ok((self.entry, fd))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the thread (EOF on its read, EPIPE on its write) and the
        // client's copies (EOF, EPIPE).
        let _ = self.mine.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves one region fd in a thread until the client closes it: commands
/// go to BAR `bar` of `f` at `start + offset`. A malformed command or one
/// outside the region ends the channel (shut down both ways) with a log line.
pub fn spawn_server(
    fd: UnixStream,
    f: Arc<Mutex<PciFunction>>,
    bar: u8,
    start: u64,
    size: u64,
) -> std::io::Result<JoinHandle<()>> {
    spawn(fd, f, bar, start, size, Arc::new(AtomicBool::new(false)))
}

/// [`spawn_server`], ending also at the first command read once `stop` is set.
fn spawn(
    fd: UnixStream,
    f: Arc<Mutex<PciFunction>>,
    bar: u8,
    start: u64,
    size: u64,
    stop: Arc<AtomicBool>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(format!("ioregionfd-bar{bar}")).spawn(move || {
        iopath_devices::sandbox::enter(iopath_devices::sandbox::Role::Region);
        let mut fd = fd;
        serve(&mut fd, &f, bar, start, size, &stop);
        // Closed for the client too, whoever else holds a copy of this end.
        let _ = fd.shutdown(Shutdown::Both);
    })
}

/// The commands on one region fd, until it closes, breaks the rules or `stop`.
fn serve(fd: &mut UnixStream, f: &Mutex<PciFunction>, bar: u8, start: u64, size: u64, stop: &AtomicBool) {
    let mut b = [0u8; MSG_SIZE];
    loop {
        crate::socket::spin_until_readable(std::os::fd::AsRawFd::as_raw_fd(fd));
        // A command queued before the region was shut down is dropped.
        if fd.read_exact(&mut b).is_err() || stop.load(Ordering::Acquire) {
            return; // client gone, or its session over
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
            let mut g = iopath_devices::lock(f);
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
}
