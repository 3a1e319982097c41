//! mpqemu wire format (QEMU `include/hw/remote/mpqemu-link.h`): native
//! layout, host endian, no version. A 16-byte header `{i32 cmd; u32 pad;
//! u64 size}` then `size` bytes of the data union; fds travel as SCM_RIGHTS
//! with the header. Commands: SYNC_SYSMEM 0 (guest RAM as up to 8 fds with
//! gpas/sizes/offsets; no reply), RET 1 (the reply, u64), PCI_CFGWRITE 2 /
//! PCI_CFGREAD 3 `{u32 addr; u32 val; i32 len}`, BAR_WRITE 4 / BAR_READ 5
//! `{u64 addr; u64 val; u32 size; u8 memory; pad}` where addr is the absolute
//! guest address or port, SET_IRQFD 6 (two fds: INTx trigger and resample;
//! no reply) and DEVICE_RESET 7. Every request but SYNC_SYSMEM and SET_IRQFD
//! is answered by RET; an error answers u64::MAX.
//!
//! Input is hostile: [`Msg::decode`] checks sizes and fd counts as QEMU's
//! `mpqemu_msg_valid` does and never panics.

use crate::socket;
use crate::{Error, Result};
use std::fs::File;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;

pub const HEADER_SIZE: usize = 16;
/// sizeof the data union (SyncSysmemMsg: 3 x 8 x u64).
pub const MAX_DATA: usize = 192;
pub const MAX_FDS: usize = 8;

pub const SYNC_SYSMEM: i32 = 0;
pub const RET: i32 = 1;
pub const PCI_CFGWRITE: i32 = 2;
pub const PCI_CFGREAD: i32 = 3;
pub const BAR_WRITE: i32 = 4;
pub const BAR_READ: i32 = 5;
pub const SET_IRQFD: i32 = 6;
pub const DEVICE_RESET: i32 = 7;

const CONF_SIZE: usize = 12;
const BAR_SIZE: usize = 24;

/// One memory region of SYNC_SYSMEM (its fd travels beside it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SysmemRegion {
    pub gpa: u64,
    pub size: u64,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    SyncSysmem(Vec<SysmemRegion>),
    Ret(u64),
    CfgWrite { addr: u32, val: u32, len: i32 },
    CfgRead { addr: u32, len: i32 },
    BarWrite { addr: u64, val: u64, size: u32, memory: bool },
    BarRead { addr: u64, size: u32, memory: bool },
    SetIrqfd,
    DeviceReset,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

impl Msg {
    pub fn cmd(&self) -> i32 {
        match self {
            Msg::SyncSysmem(_) => SYNC_SYSMEM,
            Msg::Ret(_) => RET,
            Msg::CfgWrite { .. } => PCI_CFGWRITE,
            Msg::CfgRead { .. } => PCI_CFGREAD,
            Msg::BarWrite { .. } => BAR_WRITE,
            Msg::BarRead { .. } => BAR_READ,
            Msg::SetIrqfd => SET_IRQFD,
            Msg::DeviceReset => DEVICE_RESET,
        }
    }

    /// Header and body, as QEMU lays them out.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Msg::SyncSysmem(r) => {
                let mut d = [0u64; 24];
                for (i, x) in r.iter().take(MAX_FDS).enumerate() {
                    (d[i], d[8 + i], d[16 + i]) = (x.gpa, x.size, x.offset);
                }
                d.iter().for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
            }
            Msg::Ret(v) => body.extend_from_slice(&v.to_le_bytes()),
            Msg::CfgWrite { addr, val, len } => {
                body.extend_from_slice(&addr.to_le_bytes());
                body.extend_from_slice(&val.to_le_bytes());
                body.extend_from_slice(&len.to_le_bytes());
            }
            Msg::CfgRead { addr, len } => {
                body.extend_from_slice(&addr.to_le_bytes());
                body.extend_from_slice(&0u32.to_le_bytes());
                body.extend_from_slice(&len.to_le_bytes());
            }
            Msg::BarWrite { addr, val, size, memory } => bar_body(&mut body, *addr, *val, *size, *memory),
            Msg::BarRead { addr, size, memory } => bar_body(&mut body, *addr, 0, *size, *memory),
            Msg::SetIrqfd | Msg::DeviceReset => {}
        }
        let mut m = Vec::with_capacity(HEADER_SIZE + body.len());
        m.extend_from_slice(&self.cmd().to_le_bytes());
        m.extend_from_slice(&[0; 4]);
        m.extend_from_slice(&(body.len() as u64).to_le_bytes());
        m.extend_from_slice(&body);
        m
    }

    /// Decodes and validates a message as QEMU's `mpqemu_msg_valid` does:
    /// the size must be exactly the command's, and the fd count right.
    pub fn decode(cmd: i32, body: &[u8], nfds: usize) -> Result<Msg> {
        let need = |n: usize| {
            if body.len() == n {
                Ok(())
            } else {
                Err(Error::protocol(format!("command {cmd}: {} bytes of data, expected {n}", body.len())))
            }
        };
        let fds = |n: std::ops::RangeInclusive<usize>| {
            if n.contains(&nfds) {
                Ok(())
            } else {
                Err(Error::protocol(format!("command {cmd}: {nfds} fds, expected {n:?}")))
            }
        };
        Ok(match cmd {
            SYNC_SYSMEM => {
                need(MAX_DATA)?;
                fds(1..=MAX_FDS)?;
                let r = (0..nfds)
                    .map(|i| SysmemRegion {
                        gpa: u64_at(body, 8 * i),
                        size: u64_at(body, 64 + 8 * i),
                        offset: u64_at(body, 128 + 8 * i),
                    })
                    .collect();
                Msg::SyncSysmem(r)
            }
            RET => {
                // QEMU's remote answers DEVICE_RESET with an empty RET.
                fds(0..=0)?;
                match body.len() {
                    0 => Msg::Ret(0),
                    _ => {
                        need(8)?;
                        Msg::Ret(u64_at(body, 0))
                    }
                }
            }
            PCI_CFGWRITE | PCI_CFGREAD => {
                need(CONF_SIZE)?;
                fds(0..=0)?;
                let (addr, val, len) = (u32_at(body, 0), u32_at(body, 4), u32_at(body, 8) as i32);
                if cmd == PCI_CFGWRITE {
                    Msg::CfgWrite { addr, val, len }
                } else {
                    Msg::CfgRead { addr, len }
                }
            }
            BAR_WRITE | BAR_READ => {
                need(BAR_SIZE)?;
                fds(0..=0)?;
                let (addr, val, size, memory) = (u64_at(body, 0), u64_at(body, 8), u32_at(body, 16), body[20] != 0);
                if cmd == BAR_WRITE {
                    Msg::BarWrite { addr, val, size, memory }
                } else {
                    Msg::BarRead { addr, size, memory }
                }
            }
            SET_IRQFD => {
                need(0)?;
                fds(2..=2)?;
                Msg::SetIrqfd
            }
            DEVICE_RESET => {
                need(0)?;
                fds(0..=0)?;
                Msg::DeviceReset
            }
            _ => return Err(Error::protocol(format!("unknown command {cmd}"))),
        })
    }
}

fn bar_body(body: &mut Vec<u8>, addr: u64, val: u64, size: u32, memory: bool) {
    body.extend_from_slice(&addr.to_le_bytes());
    body.extend_from_slice(&val.to_le_bytes());
    body.extend_from_slice(&size.to_le_bytes());
    body.extend_from_slice(&[memory as u8, 0, 0, 0]);
}

/// Sends a message with `fds`; `what` names it in the error.
pub fn send(sock: &UnixStream, msg: &Msg, fds: &[RawFd], what: &str) -> Result<()> {
    socket::send(sock, &[&msg.encode()], fds).map_err(|e| Error::io(what, e))
}

/// Receives a peer's next message as a server does: the peer may be idle
/// between messages for as long as it likes; once a message has begun, the
/// rest must come within the socket's read timeout (see [`socket`]).
/// `Ok(None)` is a clean end of stream between messages.
pub fn recv(sock: &UnixStream) -> Result<Option<(Msg, Vec<File>)>> {
    recv_with(sock, true)
}

/// Receives the reply a proxy waits for, as the socket's read timeout bounds it.
pub fn recv_reply(sock: &UnixStream) -> Result<Option<(Msg, Vec<File>)>> {
    recv_with(sock, false)
}

fn recv_with(sock: &UnixStream, idle: bool) -> Result<Option<(Msg, Vec<File>)>> {
    let mut h = [0u8; HEADER_SIZE];
    let head = if idle { socket::recv_exact_idle(sock, &mut h) } else { socket::recv_exact(sock, &mut h) };
    let files = match head {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("receiving a header", e)),
    };
    let cmd = u32_at(&h, 0) as i32;
    let size = u64_at(&h, 8);
    if size > MAX_DATA as u64 {
        return Err(Error::protocol(format!("command {cmd}: {size} bytes of data, more than {MAX_DATA}")));
    }
    if files.len() > MAX_FDS {
        return Err(Error::protocol(format!("command {cmd}: {} fds, more than {MAX_FDS}", files.len())));
    }
    let mut body = vec![0u8; size as usize];
    socket::recv_exact(sock, &mut body)
        .map_err(|e| Error::io(format!("command {cmd}: receiving {size} bytes of data"), e))?;
    let msg = Msg::decode(cmd, &body, files.len())?;
    Ok(Some((msg, files)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings_match_qemu_layout() {
        let m = Msg::BarWrite { addr: 0xfe00_0800, val: 0xfa, size: 1, memory: true };
        let b = m.encode();
        assert_eq!(b.len(), 16 + 24);
        assert_eq!(&b[..16], &[4, 0, 0, 0, 0, 0, 0, 0, 24, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[16..24], &0xfe00_0800u64.to_le_bytes());
        assert_eq!(&b[24..32], &0xfau64.to_le_bytes());
        assert_eq!(&b[32..40], &[1, 0, 0, 0, 1, 0, 0, 0]);
        let c = Msg::CfgRead { addr: 0x10, len: 4 }.encode();
        assert_eq!(c.len(), 16 + 12);
        assert_eq!(&c[16..], &[0x10, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0]);
        let s = Msg::SyncSysmem(vec![SysmemRegion { gpa: 0, size: 64 << 20, offset: 0 }]).encode();
        assert_eq!(s.len(), 16 + 192);
        assert_eq!(&s[16 + 64..16 + 72], &(64u64 << 20).to_le_bytes());
        assert_eq!(Msg::Ret(7).encode().len(), 24);
        for m in [
            Msg::Ret(u64::MAX),
            Msg::CfgWrite { addr: 4, val: 3, len: 2 },
            Msg::CfgRead { addr: 0x3c, len: 1 },
            Msg::BarRead { addr: 0xc083, size: 4, memory: false },
            m,
        ] {
            let e = m.encode();
            assert_eq!(Msg::decode(m.cmd(), &e[16..], 0).unwrap(), m);
        }
    }

    #[test]
    fn bad_messages_are_refused() {
        assert!(Msg::decode(99, &[], 0).unwrap_err().to_string().contains("unknown"));
        assert!(Msg::decode(BAR_WRITE, &[0; 23], 0).is_err());
        assert!(Msg::decode(BAR_WRITE, &[0; 24], 1).unwrap_err().to_string().contains("fds"));
        assert!(Msg::decode(SYNC_SYSMEM, &[0; 192], 0).is_err());
        assert!(Msg::decode(SET_IRQFD, &[], 1).is_err());
        assert!(Msg::decode(RET, &[0; 4], 0).is_err());
        assert_eq!(Msg::decode(RET, &[], 0).unwrap(), Msg::Ret(0), "QEMU's reply to DEVICE_RESET");
        // Every truncation of a valid body fails, none panics.
        let e = Msg::BarWrite { addr: 1, val: 2, size: 4, memory: true }.encode();
        for n in 0..24 {
            assert!(Msg::decode(BAR_WRITE, &e[16..16 + n], 0).is_err());
        }
    }
}
