//! vfio-user wire codec: the message header and every command payload this
//! project speaks, as plain structs with `parse` / `to_bytes`, one file per
//! concern: `header` (header, commands, VERSION), `device` (GET_INFO,
//! DEVICE_FEATURE), `dma`, `region` (REGION_INFO and region access),
//! `io_fds` (GET_REGION_IO_FDS), `irq`, `state` (iopath's state memory
//! extension). This file holds the bounds-checked
//! reader and writer they share.
//!
//! The protocol is QEMU's `docs/interop/vfio-user.rst`; layouts were checked
//! against libvfio-user (`include/vfio-user.h` and its server), which is
//! followed where the two disagree (DMA_WRITE reply, GET_REGION_IO_FDS entry
//! offsets). Integers are little endian (the spec says host endian; this
//! project runs on x86-64) and structs are packed.
//!
//! No I/O and no `unsafe`. Input comes from the other side of a socket and is
//! hostile: every parse is length-checked with checked arithmetic, returns a
//! [`WireError`] instead of panicking, and never allocates more than the input
//! could describe. Fixed-size payloads must have exactly their size. File
//! descriptors travel out of band (SCM_RIGHTS); payloads only index them.
//! A server takes requests longer than their fixed part ([`fixed_part`]).

mod device;
mod dma;
mod header;
mod io_fds;
mod irq;
mod region;
mod state;

pub use device::*;
pub use dma::*;
pub use header::*;
pub use io_fds::*;
pub use irq::*;
pub use region::*;
pub use state::*;

/// Size of the `{argsz, flags, index, count}` structs (DEVICE_GET_INFO,
/// GET_IRQ_INFO, the GET_REGION_IO_FDS head).
pub const INFO16_SIZE: usize = 16;
/// Size of the `{offset/address, region/count}` head of a region or DMA access.
const ACCESS_SIZE: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{what}: too short, need {need} bytes, got {got}")]
    Short { what: &'static str, need: usize, got: usize },
    #[error("{what}: too long, expected {expected} bytes, got {got}")]
    Trailing { what: &'static str, expected: usize, got: usize },
    #[error("{what}: {got} exceeds the limit of {max}")]
    TooLarge { what: &'static str, max: usize, got: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("version: bad capabilities JSON: {0}")]
    Json(String),
}

fn invalid(msg: impl Into<String>) -> WireError {
    WireError::Invalid(msg.into())
}

fn check_argsz(what: &str, argsz: u32, min: usize) -> Result<(), WireError> {
    if (argsz as usize) < min {
        return Err(invalid(format!("{what}: argsz {argsz} < {min}")));
    }
    Ok(())
}

/// Bounds-checked little-endian cursor over a payload.
struct Rd<'a> {
    what: &'static str,
    b: &'a [u8],
    pos: usize,
}

impl<'a> Rd<'a> {
    /// `b` must hold at least `min` bytes, and exactly `min` if `exact`.
    fn new(what: &'static str, b: &'a [u8], min: usize, exact: bool) -> Result<Self, WireError> {
        if b.len() < min {
            return Err(WireError::Short { what, need: min, got: b.len() });
        }
        if exact && b.len() > min {
            return Err(WireError::Trailing { what, expected: min, got: b.len() });
        }
        Ok(Rd { what, b, pos: 0 })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let got = self.b.len();
        let short = WireError::Short { what: self.what, need: self.pos.saturating_add(n), got };
        let s = self.pos.checked_add(n).and_then(|end| self.b.get(self.pos..end)).ok_or(short)?;
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        self.arr().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        self.arr().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        self.arr().map(u64::from_le_bytes)
    }

    fn rest(&mut self) -> &'a [u8] {
        let s = self.b.get(self.pos..).unwrap_or(&[]);
        self.pos = self.b.len();
        s
    }
}

/// Little-endian builder.
struct Wr(Vec<u8>);

impl Wr {
    fn new(cap: usize) -> Self {
        Wr(Vec::with_capacity(cap))
    }
    fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

/// A buffer length as a wire `u32`; buffers are bounded by [`MAX_MSG_SIZE`].
fn len_u32(n: usize) -> u32 {
    debug_assert!(n <= u32::MAX as usize);
    n as u32
}

/// The fixed part of a request: its first `n` bytes, or all of it if it is
/// shorter (which its parse then refuses). A request may be longer than its
/// fixed part: `argsz` is the size of the client's reply buffer, and some
/// clients send that whole buffer (SPDK's NVMe driver: 4064 bytes of
/// GET_REGION_INFO). What follows the fixed part has no meaning there.
pub fn fixed_part(b: &[u8], n: usize) -> &[u8] {
    b.get(..n).unwrap_or(b)
}

/// Checks that a payload which must be empty (DEVICE_RESET, most replies) is.
pub fn expect_empty(what: &'static str, b: &[u8]) -> Result<(), WireError> {
    Rd::new(what, b, 0, true).map(|_| ())
}

/// Checks that what follows a 16-byte access header is exactly `count` bytes.
fn access_data<'a>(what: &'static str, r: &mut Rd<'a>, count: u64) -> Result<&'a [u8], WireError> {
    if count > MAX_MSG_SIZE as u64 {
        return Err(WireError::TooLarge { what, max: MAX_MSG_SIZE, got: count as usize });
    }
    let data = r.take(count as usize)?;
    expect_empty(what, r.rest()).map(|_| data)
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    /// Little-endian concatenation of `(value, width <= 8)` fields.
    pub fn le(fields: &[(u64, usize)]) -> Vec<u8> {
        fields.iter().flat_map(|&(v, n)| v.to_le_bytes()[..n].to_vec()).collect()
    }

    /// Every strict prefix of `enc` fails to parse, except the lengths in `except`.
    pub fn prefixes_fail(enc: &[u8], ok: impl Fn(&[u8]) -> bool, except: &[usize]) {
        for n in (0..enc.len()).filter(|n| !except.contains(n)) {
            assert!(!ok(&enc[..n]), "prefix of {n}/{} bytes parsed", enc.len());
        }
    }

    /// Round trip; every prefix and one extra byte fail.
    pub fn check<T: PartialEq + std::fmt::Debug>(v: &T, enc: &[u8], parse: impl Fn(&[u8]) -> Result<T, WireError>) {
        assert_eq!(&parse(enc).unwrap(), v);
        prefixes_fail(enc, |b| parse(b).is_ok(), &[]);
        assert!(parse(&[enc, &[0]].concat()).is_err(), "oversize parsed");
    }

    pub fn set32(b: &[u8], at: usize, v: u32) -> Vec<u8> {
        let mut b = b.to_vec();
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_never_panics() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..5000 {
            let len = (next() % 140) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if len >= 16 && next() % 2 == 0 {
                // Plausible argsz/size and small counts so the deeper checks run.
                b[..4].copy_from_slice(&(len as u32).to_le_bytes());
                b[8] &= 0x0f;
                b[12..16].copy_from_slice(&((next() % 4) as u32).to_le_bytes());
            }
            let _ = (parse_message(&b), Version::parse(&b), DmaMap::parse(&b), DmaUnmap::parse(&b));
            let _ = (DeviceInfo::parse(&b), RegionInfo::parse(&b), RegionInfoReply::parse(&b));
            let _ = (IoFdsRequest::parse(&b), IoFdsReply::parse(&b), IrqInfo::parse(&b), IrqSet::parse(&b));
            let _ = (RegionAccess::parse(&b), RegionAccess::parse_with_data(&b), DmaAccess::parse(&b));
            let _ = (DmaAccess::parse_with_data(&b), RegionWriteMulti::parse(&b), RegionWriteMultiReply::parse(&b));
            let _ = DeviceFeature::parse(&b);
        }
    }
}
