//! The VMM's half of one region: what KVM would do on an access to it.

use super::wire::{exponent, Cmd, CMD_READ, CMD_WRITE, MSG_SIZE};
use crate::peer::REPLY_TIMEOUT;
use crate::{Error, Result};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

/// One region of a BAR served on an fd the device process created.
pub struct RegionClient {
    fd: UnixStream,
    /// Region start and size inside its BAR.
    pub start: u64,
    pub size: u64,
    pub user_data: u64,
    pub posted_writes: bool,
    /// Commands sent on the fd.
    pub commands: u64,
}

impl RegionClient {
    pub fn new(fd: UnixStream, start: u64, size: u64, user_data: u64, posted_writes: bool) -> Self {
        let _ = fd.set_read_timeout(Some(REPLY_TIMEOUT));
        let _ = fd.set_write_timeout(Some(REPLY_TIMEOUT));
        RegionClient { fd, start, size, user_data, posted_writes, commands: 0 }
    }

    /// True if a `len`-byte access at BAR offset `off` falls in the region.
    pub fn covers(&self, off: u64, len: usize) -> bool {
        off >= self.start && off.checked_add(len as u64).is_some_and(|e| e <= self.start.saturating_add(self.size))
    }

    fn send(&mut self, c: Cmd) -> Result<()> {
        self.commands += 1;
        self.fd.write_all(&c.encode()).map_err(|e| Error::io("ioregionfd command", e))
    }

    fn reply(&mut self) -> Result<u64> {
        let mut b = [0u8; MSG_SIZE];
        crate::socket::spin_until_readable(std::os::fd::AsRawFd::as_raw_fd(&self.fd));
        self.fd.read_exact(&mut b).map_err(|e| Error::io("ioregionfd response", e))?;
        Ok(u64::from_le_bytes(b[..8].try_into().unwrap()))
    }

    /// A read of `len` bytes at BAR offset `off` (inside the region).
    pub fn read(&mut self, off: u64, len: usize) -> Result<u64> {
        let size_exponent = exponent(len).ok_or_else(|| Error::protocol(format!("access of {len} bytes")))?;
        let c = Cmd {
            cmd: CMD_READ,
            size_exponent,
            resp: true,
            user_data: self.user_data,
            offset: off - self.start,
            data: 0,
        };
        self.send(c)?;
        self.reply()
    }

    /// A write; a posted one returns once the command is on the fd.
    pub fn write(&mut self, off: u64, len: usize, data: u64) -> Result<()> {
        let size_exponent = exponent(len).ok_or_else(|| Error::protocol(format!("access of {len} bytes")))?;
        let resp = !self.posted_writes;
        let c = Cmd { cmd: CMD_WRITE, size_exponent, resp, user_data: self.user_data, offset: off - self.start, data };
        self.send(c)?;
        if resp {
            self.reply()?;
        }
        Ok(())
    }
}
