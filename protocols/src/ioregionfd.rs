//! ioregionfd (proposed KVM API, RFC v3 2021, never merged): a guest access
//! to a region is written as a 32-byte `ioregionfd_cmd` to the region's fd;
//! the device answers reads and non-posted writes with a 32-byte
//! `ioregionfd_resp`. Posted writes (KVM_IOREGION_POSTED_WRITES) get no
//! reply: the vCPU goes on at once, and order on the fd is kept.
//!
//! Upstream KVM has no KVM_SET_IOREGION (0x49 is KVM_SET_USER_MEMORY_REGION2
//! there, and capability 191 is KVM_CAP_SYS_HYPERV_CPUID), so iopath's VMM
//! plays KVM's part in userspace: a vCPU exit on the region becomes a
//! command on the fd ([`RegionClient`]). `iopath_vmm::kvm::ioregionfd_support` looks for a
//! patched kernel. The device process announces its regions and creates
//! the fds (vfio-user GET_REGION_IO_FDS, type IOREGIONFD), as the RFC's
//! review asked; [`spawn_server`] serves one fd.
//!
//! `cmd` layout: u8 cmd (READ 0, WRITE 1); u8 {size_exponent:4, resp:1};
//! 6 bytes padding; u64 user_data; u64 offset; u64 data. `resp`: u64 data,
//! 24 bytes padding. Values are host endian.

use crate::function::PciFunction;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

pub const CMD_READ: u8 = 0;
pub const CMD_WRITE: u8 = 1;
pub const MSG_SIZE: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cmd {
    pub cmd: u8,
    /// Access size is 1 << size_exponent (0..=3).
    pub size_exponent: u8,
    pub resp: bool,
    pub user_data: u64,
    pub offset: u64,
    pub data: u64,
}

impl Cmd {
    pub fn encode(&self) -> [u8; MSG_SIZE] {
        let mut b = [0u8; MSG_SIZE];
        b[0] = self.cmd;
        b[1] = (self.size_exponent & 0xf) | ((self.resp as u8) << 4);
        b[8..16].copy_from_slice(&self.user_data.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.data.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; MSG_SIZE]) -> Result<Self, String> {
        let c = Cmd {
            cmd: b[0],
            size_exponent: b[1] & 0xf,
            resp: b[1] & 0x10 != 0,
            user_data: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            offset: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            data: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        };
        if c.cmd > CMD_WRITE {
            return Err(format!("unknown ioregionfd command {}", c.cmd));
        }
        if c.size_exponent > 3 {
            return Err(format!("size exponent {} (accesses are 1..8 bytes)", c.size_exponent));
        }
        if c.cmd == CMD_READ && !c.resp {
            return Err("a read without resp=1".into());
        }
        Ok(c)
    }

    pub fn len(&self) -> usize {
        1 << self.size_exponent
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

fn exponent(len: usize) -> Option<u8> {
    match len {
        1 => Some(0),
        2 => Some(1),
        4 => Some(2),
        8 => Some(3),
        _ => None,
    }
}

fn resp(data: u64) -> [u8; MSG_SIZE] {
    let mut b = [0u8; MSG_SIZE];
    b[..8].copy_from_slice(&data.to_le_bytes());
    b
}

/// The VMM's half of one region: what KVM would do on an access.
pub struct RegionClient {
    fd: UnixStream,
    /// Region start and size inside its BAR.
    pub start: u64,
    pub size: u64,
    pub user_data: u64,
    pub posted_writes: bool,
    pub commands: u64,
}

impl RegionClient {
    pub fn new(fd: UnixStream, start: u64, size: u64, user_data: u64, posted_writes: bool) -> Self {
        let _ = fd.set_read_timeout(Some(crate::peer::REPLY_TIMEOUT));
        let _ = fd.set_write_timeout(Some(crate::peer::REPLY_TIMEOUT));
        RegionClient { fd, start, size, user_data, posted_writes, commands: 0 }
    }

    /// True if a `len`-byte access at BAR offset `off` falls in the region.
    pub fn covers(&self, off: u64, len: usize) -> bool {
        off >= self.start && off.checked_add(len as u64).is_some_and(|e| e <= self.start.saturating_add(self.size))
    }

    fn send(&mut self, c: Cmd) -> Result<(), String> {
        self.commands += 1;
        self.fd.write_all(&c.encode()).map_err(|e| format!("ioregionfd command: {e}"))
    }

    fn reply(&mut self) -> Result<u64, String> {
        let mut b = [0u8; MSG_SIZE];
        crate::socket::spin_until_readable(std::os::fd::AsRawFd::as_raw_fd(&self.fd));
        self.fd.read_exact(&mut b).map_err(|e| format!("ioregionfd response: {e}"))?;
        Ok(u64::from_le_bytes(b[..8].try_into().unwrap()))
    }

    pub fn read(&mut self, off: u64, len: usize) -> Result<u64, String> {
        let size_exponent = exponent(len).ok_or_else(|| format!("access of {len} bytes"))?;
        let c = Cmd { cmd: CMD_READ, size_exponent, resp: true, user_data: self.user_data, offset: off - self.start, data: 0 };
        self.send(c)?;
        self.reply()
    }

    pub fn write(&mut self, off: u64, len: usize, data: u64) -> Result<(), String> {
        let size_exponent = exponent(len).ok_or_else(|| format!("access of {len} bytes"))?;
        let resp = !self.posted_writes;
        let c = Cmd { cmd: CMD_WRITE, size_exponent, resp, user_data: self.user_data, offset: off - self.start, data };
        self.send(c)?;
        if resp {
            self.reply()?;
        }
        Ok(())
    }
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
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name(format!("ioregionfd-bar{bar}")).spawn(move || {
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
                let mut g = f.lock().unwrap();
                if c.cmd == CMD_WRITE {
                    data.copy_from_slice(&c.data.to_le_bytes());
                    g.bar_write(bar, start + c.offset, &data[..n]);
                    0
                } else {
                    g.bar_read(bar, start + c.offset, &mut data[..n]);
                    iopath_devices::le_value(&data[..n])
                }
            };
            if c.resp && fd.write_all(&resp(value)).is_err() {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::testdev::PciTestDev;

    #[test]
    fn command_layout_is_the_rfc_v3_one() {
        let c = Cmd { cmd: CMD_WRITE, size_exponent: 2, resp: true, user_data: 0x11, offset: 0x800, data: 0xfa };
        let b = c.encode();
        assert_eq!(b[0], 1);
        assert_eq!(b[1], 0x12);
        assert_eq!(&b[2..8], &[0; 6]);
        assert_eq!(&b[8..16], &0x11u64.to_le_bytes());
        assert_eq!(&b[16..24], &0x800u64.to_le_bytes());
        assert_eq!(Cmd::decode(&b).unwrap(), c);
        let mut bad = b;
        bad[0] = 2;
        assert!(Cmd::decode(&bad).is_err());
        bad = b;
        bad[1] = 0x04;
        assert!(Cmd::decode(&bad).is_err(), "size exponent 4");
        bad = b;
        bad[0] = CMD_READ;
        bad[1] = 0x02;
        assert!(Cmd::decode(&bad).is_err(), "read without resp");
    }

    #[test]
    fn sync_and_posted_writes_reach_the_device_in_order() {
        let f = Arc::new(Mutex::new(PciFunction::new(Arc::new(Mutex::new(PciTestDev::new()))).unwrap()));
        for posted in [false, true] {
            let (a, b) = UnixStream::pair().unwrap();
            let h = spawn_server(b, f.clone(), 0, 0, 4096).unwrap();
            let mut c = RegionClient::new(a, 0, 4096, 0, posted);
            c.write(0, 1, 0).unwrap(); // select test 0
            for _ in 0..100 {
                c.write(2048, 1, 0xfa).unwrap();
            }
            // A read is answered after every posted write before it.
            assert_eq!(c.read(12, 4).unwrap(), 100);
            assert!(c.covers(4092, 4) && !c.covers(4093, 4));
            drop(c);
            h.join().unwrap();
        }
    }

    #[test]
    fn a_command_outside_the_region_closes_it() {
        let f = Arc::new(Mutex::new(PciFunction::new(Arc::new(Mutex::new(PciTestDev::new()))).unwrap()));
        let (mut a, b) = UnixStream::pair().unwrap();
        let h = spawn_server(b, f, 0, 0, 16).unwrap();
        let c = Cmd { cmd: CMD_READ, size_exponent: 3, resp: true, user_data: 0, offset: 12, data: 0 };
        a.write_all(&c.encode()).unwrap();
        h.join().unwrap();
        let mut r = [0u8; 32];
        assert_eq!(a.read(&mut r).unwrap(), 0, "channel closed, no reply");
    }
}
