//! The ioregionfd messages (RFC v3): a 32-byte `ioregionfd_cmd` for each
//! access, a 32-byte `ioregionfd_resp` for reads and non-posted writes.
//!
//! `cmd` layout: u8 cmd (READ 0, WRITE 1); u8 {size_exponent:4, resp:1};
//! 6 bytes padding; u64 user_data; u64 offset; u64 data. `resp`: u64 data,
//! 24 bytes padding. Values are host endian.

use crate::{Error, Result};

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

    pub fn decode(b: &[u8; MSG_SIZE]) -> Result<Self> {
        let c = Cmd {
            cmd: b[0],
            size_exponent: b[1] & 0xf,
            resp: b[1] & 0x10 != 0,
            user_data: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            offset: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            data: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        };
        if c.cmd > CMD_WRITE {
            return Err(Error::protocol(format!("unknown ioregionfd command {}", c.cmd)));
        }
        if c.size_exponent > 3 {
            return Err(Error::protocol(format!("size exponent {} (accesses are 1..8 bytes)", c.size_exponent)));
        }
        if c.cmd == CMD_READ && !c.resp {
            return Err(Error::protocol("a read without resp=1"));
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

/// The size exponent of an access of `len` bytes (1, 2, 4 or 8).
pub fn exponent(len: usize) -> Option<u8> {
    match len {
        1 => Some(0),
        2 => Some(1),
        4 => Some(2),
        8 => Some(3),
        _ => None,
    }
}

/// A response carrying `data`.
pub fn resp(data: u64) -> [u8; MSG_SIZE] {
    let mut b = [0u8; MSG_SIZE];
    b[..8].copy_from_slice(&data.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
