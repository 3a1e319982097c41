//! The message header, the command numbers, whole messages, and VERSION
//! with its capabilities JSON.

use super::*;
use serde_json::{Map, Value};

pub const HEADER_SIZE: usize = 16;
/// Default (and this project's) `max_data_xfer_size`.
pub const DEFAULT_MAX_DATA_XFER_SIZE: u32 = 1 << 20;
/// Largest message accepted: the data limit plus headroom for fixed parts.
pub const MAX_MSG_SIZE: usize = DEFAULT_MAX_DATA_XFER_SIZE as usize + 4096;
pub const VERSION_MAJOR: u16 = 0;
pub const VERSION_MINOR: u16 = 2;

pub const FLAGS_TYPE_MASK: u32 = 0xf;
pub const FLAGS_TYPE_COMMAND: u32 = 0;
pub const FLAGS_TYPE_REPLY: u32 = 1;
pub const FLAGS_NO_REPLY: u32 = 1 << 4;
pub const FLAGS_ERROR: u32 = 1 << 5;

/// Commands this codec knows. Others (the obsolete DIRTY_PAGES 14, the
/// migration data commands 17/18) map to `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    Version = 1,
    DmaMap = 2,
    DmaUnmap = 3,
    DeviceGetInfo = 4,
    DeviceGetRegionInfo = 5,
    DeviceGetRegionIoFds = 6,
    DeviceGetIrqInfo = 7,
    DeviceSetIrqs = 8,
    RegionRead = 9,
    RegionWrite = 10,
    DmaRead = 11,
    DmaWrite = 12,
    DeviceReset = 13,
    RegionWriteMulti = 15,
    DeviceFeature = 16,
    /// iopath's extension, outside the spec's numbers: the client hands
    /// the server the state memory VERSION agreed on (see `state`).
    StateMemory = STATE_MEMORY_COMMAND,
}

impl Command {
    pub fn from_u16(v: u16) -> Option<Self> {
        use Command::*;
        Some(match v {
            1 => Version,
            2 => DmaMap,
            3 => DmaUnmap,
            4 => DeviceGetInfo,
            5 => DeviceGetRegionInfo,
            6 => DeviceGetRegionIoFds,
            7 => DeviceGetIrqInfo,
            8 => DeviceSetIrqs,
            9 => RegionRead,
            10 => RegionWrite,
            11 => DmaRead,
            12 => DmaWrite,
            13 => DeviceReset,
            15 => RegionWriteMulti,
            16 => DeviceFeature,
            STATE_MEMORY_COMMAND => StateMemory,
            _ => return None,
        })
    }
}

/// The 16-byte header in front of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub msg_id: u16,
    pub cmd: u16,
    /// Size of the whole message, header included.
    pub msg_size: u32,
    pub flags: u32,
    pub error_no: u32,
}

impl Header {
    pub fn parse(b: &[u8; HEADER_SIZE]) -> Self {
        let w = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let (id_cmd, msg_size, flags, error_no) = (w(0), w(4), w(8), w(12));
        Header { msg_id: id_cmd as u16, cmd: (id_cmd >> 16) as u16, msg_size, flags, error_no }
    }

    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let v = Wr::new(HEADER_SIZE).u16(self.msg_id).u16(self.cmd).u32(self.msg_size).u32(self.flags);
        let mut a = [0u8; HEADER_SIZE];
        a.copy_from_slice(&v.u32(self.error_no).0);
        a
    }

    pub fn command(&self) -> Option<Command> {
        Command::from_u16(self.cmd)
    }

    pub fn is_reply(&self) -> bool {
        self.flags & FLAGS_TYPE_MASK == FLAGS_TYPE_REPLY
    }

    pub fn no_reply(&self) -> bool {
        self.flags & FLAGS_NO_REPLY != 0
    }

    pub fn is_error(&self) -> bool {
        self.flags & FLAGS_ERROR != 0
    }

    /// Validates type and size; returns the payload length that follows.
    pub fn payload_len(&self) -> Result<usize, WireError> {
        let ty = self.flags & FLAGS_TYPE_MASK;
        if ty != FLAGS_TYPE_COMMAND && ty != FLAGS_TYPE_REPLY {
            return Err(invalid(format!("header: unknown message type {ty}")));
        }
        let size = self.msg_size as usize;
        if size < HEADER_SIZE {
            return Err(WireError::Short { what: "header msg_size", need: HEADER_SIZE, got: size });
        }
        if size > MAX_MSG_SIZE {
            return Err(WireError::TooLarge { what: "header msg_size", max: MAX_MSG_SIZE, got: size });
        }
        Ok(size - HEADER_SIZE)
    }
}

/// Splits one complete message into its validated header and payload.
pub fn parse_message(buf: &[u8]) -> Result<(Header, &[u8]), WireError> {
    let mut r = Rd::new("message", buf, HEADER_SIZE, false)?;
    let hdr = Header::parse(&r.arr()?);
    let len = hdr.payload_len()?;
    let payload = r.rest();
    if payload.len() != len {
        let (what, expected, got) = ("message", HEADER_SIZE + len, buf.len());
        if payload.len() < len {
            return Err(WireError::Short { what, need: expected, got });
        }
        return Err(WireError::Trailing { what, expected, got });
    }
    Ok((hdr, payload))
}

/// Builds a message: header (with `msg_size` filled in) followed by `payload`.
pub fn message(msg_id: u16, cmd: Command, flags: u32, payload: &[u8]) -> Vec<u8> {
    build(Header { msg_id, cmd: cmd as u16, msg_size: 0, flags, error_no: 0 }, payload)
}

/// Builds a successful reply to `req` carrying `payload`.
pub fn reply(req: &Header, payload: &[u8]) -> Vec<u8> {
    build(Header { msg_id: req.msg_id, cmd: req.cmd, msg_size: 0, flags: FLAGS_TYPE_REPLY, error_no: 0 }, payload)
}

/// Builds an error reply to `req`: header only, ERROR flag, `error_no = errno`.
pub fn error_reply(req: &Header, errno: i32) -> Vec<u8> {
    let flags = FLAGS_TYPE_REPLY | FLAGS_ERROR;
    build(Header { msg_id: req.msg_id, cmd: req.cmd, msg_size: 0, flags, error_no: errno.unsigned_abs() }, &[])
}

fn build(mut hdr: Header, payload: &[u8]) -> Vec<u8> {
    hdr.msg_size = len_u32(HEADER_SIZE + payload.len());
    Wr::new(HEADER_SIZE + payload.len()).bytes(&hdr.to_bytes()).bytes(payload).0
}

/// Session capabilities negotiated in VERSION.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub max_msg_fds: u32,
    pub max_data_xfer_size: u32,
    pub max_dma_maps: u32,
    pub pgsizes: u64,
    pub write_multiple: bool,
    /// iopath's state memory ([`STATE_MEMORY_CAP`]): in a proposal, the
    /// most bytes the client will hold; in an answer, the bytes the
    /// server's device keeps its state in (at most the proposal). Absent
    /// unless both sides know it.
    pub state_memory: Option<u64>,
}

impl Default for Capabilities {
    /// The values the spec says to assume when a capability is absent.
    fn default() -> Self {
        let max_data_xfer_size = DEFAULT_MAX_DATA_XFER_SIZE;
        Capabilities {
            max_msg_fds: 1,
            max_data_xfer_size,
            max_dma_maps: 65535,
            pgsizes: 4096,
            write_multiple: false,
            state_memory: None,
        }
    }
}

impl Capabilities {
    pub fn to_json(&self) -> Value {
        let mut caps = Map::new();
        caps.insert("max_msg_fds".into(), self.max_msg_fds.into());
        caps.insert("max_data_xfer_size".into(), self.max_data_xfer_size.into());
        caps.insert("max_dma_maps".into(), self.max_dma_maps.into());
        caps.insert("pgsizes".into(), self.pgsizes.into());
        if self.write_multiple {
            // Absent means false; a reply names only what it agrees to.
            caps.insert("write_multiple".into(), true.into());
        }
        if let Some(n) = self.state_memory {
            caps.insert(STATE_MEMORY_CAP.into(), n.into());
        }
        Value::Object(Map::from_iter([("capabilities".to_string(), Value::Object(caps))]))
    }

    /// A server's answer to the client's `proposed` capabilities, `self`
    /// being what the server can do. The spec's rule: the reply is a subset
    /// of the proposal. Each limit is no larger than the client's (and none
    /// larger than the server's), the page sizes are those the client
    /// offered that the server maps (QEMU also refuses a reply with a page
    /// size below 4 KiB), and REGION_WRITE_MULTI is on only if both do it.
    /// Twin sockets and migration are never part of an answer, nor state
    /// memory (the server adds it for a device that has some, within the
    /// proposal). `None` if no page size is left.
    ///
    /// Deployed servers differ: libvfio-user answers with its own limits
    /// whatever the client proposed, and rust-vmm's server with its defaults.
    pub fn answer(&self, proposed: &Capabilities) -> Option<Capabilities> {
        let pgsizes = self.pgsizes & proposed.pgsizes;
        (pgsizes != 0).then(|| Capabilities {
            max_msg_fds: self.max_msg_fds.min(proposed.max_msg_fds),
            max_data_xfer_size: self.max_data_xfer_size.min(proposed.max_data_xfer_size),
            max_dma_maps: self.max_dma_maps.min(proposed.max_dma_maps),
            pgsizes,
            write_multiple: self.write_multiple && proposed.write_multiple,
            state_memory: None,
        })
    }

    /// Reads `{"capabilities": {...}}`: absent keys keep their defaults,
    /// unknown keys are ignored, known keys of the wrong type are errors.
    /// `twin_socket` and `migration` must be objects but are not used.
    pub fn from_json(v: &Value) -> Result<Self, WireError> {
        let json = |m: String| WireError::Json(m);
        let top = v.as_object().ok_or_else(|| json("top level is not an object".into()))?;
        let mut c = Capabilities::default();
        let Some(caps) = top.get("capabilities") else { return Ok(c) };
        let caps = caps.as_object().ok_or_else(|| json("\"capabilities\" is not an object".into()))?;
        let num = |key: &str, max: u64| -> Result<Option<u64>, WireError> {
            let Some(v) = caps.get(key) else { return Ok(None) };
            match v.as_u64() {
                Some(n) if n <= max => Ok(Some(n)),
                _ => Err(json(format!("\"{key}\" is not an unsigned integer up to {max}"))),
            }
        };
        let u32max = u32::MAX as u64;
        c.max_msg_fds = num("max_msg_fds", u32max)?.map_or(c.max_msg_fds, |n| n as u32);
        c.max_data_xfer_size = num("max_data_xfer_size", u32max)?.map_or(c.max_data_xfer_size, |n| n as u32);
        c.max_dma_maps = num("max_dma_maps", u32max)?.map_or(c.max_dma_maps, |n| n as u32);
        c.pgsizes = num("pgsizes", u64::MAX)?.unwrap_or(c.pgsizes);
        if let Some(v) = caps.get("write_multiple") {
            c.write_multiple = v.as_bool().ok_or_else(|| json("\"write_multiple\" is not a boolean".into()))?;
        }
        c.state_memory = num(STATE_MEMORY_CAP, MAX_STATE_MEMORY)?;
        if c.state_memory == Some(0) {
            return Err(json(format!("\"{STATE_MEMORY_CAP}\" is 0")));
        }
        for key in ["twin_socket", "migration"] {
            if caps.get(key).is_some_and(|v| !v.is_object()) {
                return Err(json(format!("\"{key}\" is not an object")));
            }
        }
        if c.max_data_xfer_size == 0 || c.pgsizes == 0 {
            return Err(json("max_data_xfer_size and pgsizes must be non-zero".into()));
        }
        Ok(c)
    }
}

/// VERSION request and reply: major, minor, optional NUL-terminated JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    pub major: u16,
    pub minor: u16,
    /// `None` when no JSON was sent (all defaults apply).
    pub capabilities: Option<Capabilities>,
}

impl Version {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("version", b, 4, false)?;
        let (major, minor) = (r.u16()?, r.u16()?);
        let capabilities = match r.rest().split_last() {
            None => None,
            Some((0, json)) => {
                let v: Value = serde_json::from_slice(json).map_err(|e| WireError::Json(e.to_string()))?;
                Some(Capabilities::from_json(&v)?)
            }
            Some(_) => return Err(invalid("version: JSON data is not NUL-terminated")),
        };
        Ok(Version { major, minor, capabilities })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wr::new(64).u16(self.major).u16(self.minor);
        match &self.capabilities {
            Some(c) => w.bytes(c.to_json().to_string().as_bytes()).bytes(&[0]).0,
            None => w.0,
        }
    }

    /// The sender's capabilities, defaults if it sent none.
    pub fn caps(&self) -> Capabilities {
        self.capabilities.unwrap_or_default()
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::wire::testutil::*;
    use serde_json::json;

    #[test]
    fn header_and_commands() {
        let h = Header { msg_id: 0x1234, cmd: 9, msg_size: 32, flags: FLAGS_TYPE_REPLY | FLAGS_ERROR, error_no: 22 };
        assert_eq!(h.to_bytes(), [0x34, 0x12, 9, 0, 32, 0, 0, 0, 0x21, 0, 0, 0, 22, 0, 0, 0]);
        assert_eq!(Header::parse(&h.to_bytes()), h);
        assert!(h.is_reply() && h.is_error() && !h.no_reply());
        assert_eq!((h.command(), h.payload_len().unwrap()), (Some(Command::RegionRead), 16));
        for (size, flags) in [(15, 0), (MAX_MSG_SIZE as u32 + 1, 0), (16, 2)] {
            assert!(Header { msg_size: size, flags, ..h }.payload_len().is_err());
        }
        let known: Vec<u16> = (0..=u16::MAX).filter(|&n| Command::from_u16(n).is_some_and(|c| c as u16 == n)).collect();
        assert_eq!(known, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, STATE_MEMORY_COMMAND]);
    }

    #[test]
    fn messages_and_error_reply() {
        let m = message(3, Command::DeviceReset, FLAGS_NO_REPLY, &[]);
        let (h, p) = parse_message(&m).unwrap();
        assert_eq!((h.msg_id, h.cmd, h.msg_size, h.flags), (3, 13, 16, FLAGS_NO_REPLY));
        assert!(h.no_reply() && expect_empty("device_reset", p).is_ok() && expect_empty("x", &[0]).is_err());
        prefixes_fail(&m, |b| parse_message(b).is_ok(), &[]);
        assert!(parse_message(&[&m[..], &[0]].concat()).is_err());
        let (rh, rp) = parse_message(&reply(&h, &[9])).map(|(h, p)| (h, p.to_vec())).unwrap();
        assert!(rh.is_reply() && !rh.is_error());
        assert_eq!((rh.msg_id, rh.cmd, rp), (3, 13, vec![9]));
        let req = Header { msg_id: 7, cmd: 10, msg_size: 33, flags: 0, error_no: 0 };
        let e = error_reply(&req, 22);
        assert_eq!(e, [7, 0, 10, 0, 16, 0, 0, 0, 0x21, 0, 0, 0, 22, 0, 0, 0]);
        let (eh, ep) = parse_message(&e).unwrap();
        assert!(eh.is_reply() && eh.is_error() && ep.is_empty() && eh.error_no == 22);
    }

    #[test]
    fn capabilities_json() {
        let d = Capabilities::default();
        assert_eq!((d.max_msg_fds, d.max_data_xfer_size, d.max_dma_maps, d.pgsizes), (1, 1048576, 65535, 4096));
        assert!(!d.write_multiple);
        assert_eq!(Capabilities::from_json(&json!({})).unwrap(), d);
        assert_eq!(Capabilities::from_json(&json!({"capabilities": {}})).unwrap(), d);
        let v = json!({"capabilities": {"max_msg_fds": 8, "pgsizes": 8192, "write_multiple": true,
            "twin_socket": {"supported": true}, "migration": {"pgsize": 4096}, "future": [1]}, "other": 1});
        let c = Capabilities::from_json(&v).unwrap();
        assert_eq!((c.max_msg_fds, c.pgsizes, c.write_multiple, c.max_data_xfer_size), (8, 8192, true, 1 << 20));
        let c2 = Capabilities {
            max_msg_fds: 16,
            max_data_xfer_size: 4096,
            max_dma_maps: 7,
            pgsizes: 3 << 12,
            write_multiple: true,
            state_memory: Some(64),
        };
        assert_eq!(Capabilities::from_json(&c2.to_json()).unwrap(), c2);
        for bad in [
            json!([]),
            json!({"capabilities": 3}),
            json!({"capabilities": {"max_msg_fds": "8"}}),
            json!({"capabilities": {"max_msg_fds": -1}}),
            json!({"capabilities": {"max_msg_fds": 1.5}}),
            json!({"capabilities": {"max_dma_maps": 4294967296u64}}),
            json!({"capabilities": {"write_multiple": 1}}),
            json!({"capabilities": {"twin_socket": true}}),
            json!({"capabilities": {"max_data_xfer_size": 0}}),
        ] {
            assert!(Capabilities::from_json(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_answer_is_a_subset_of_the_proposal() {
        let server = Capabilities {
            max_msg_fds: 16,
            max_data_xfer_size: 1 << 20,
            max_dma_maps: 65535,
            pgsizes: !0xfff,
            write_multiple: true,
            state_memory: None,
        };
        let a = server.answer(&Capabilities::default()).unwrap();
        assert_eq!(a, Capabilities::default(), "the defaults are the most a client without JSON takes");
        assert_eq!(
            a.to_json(),
            json!({"capabilities": {"max_msg_fds": 1, "max_data_xfer_size": 1048576,
            "max_dma_maps": 65535, "pgsizes": 4096}}),
            "write_multiple false is left out"
        );
        let big = Capabilities { max_msg_fds: 64, max_data_xfer_size: 64 << 20, max_dma_maps: 1 << 20, ..server };
        assert_eq!(server.answer(&big).unwrap(), server, "the server's own limits");
        let small = Capabilities { max_msg_fds: 0, max_data_xfer_size: 512, max_dma_maps: 3, pgsizes: 0x20_1800, ..a };
        let s = server.answer(&small).unwrap();
        assert_eq!((s.max_msg_fds, s.max_data_xfer_size, s.max_dma_maps), (0, 512, 3));
        assert_eq!((s.pgsizes, s.write_multiple), (0x20_1000, false));
        assert_eq!(server.answer(&Capabilities { pgsizes: 0x800, ..a }), None, "no page size in common");
    }

    #[test]
    fn version() {
        let bare = Version { major: 0, minor: 2, capabilities: None };
        assert_eq!(bare.to_bytes(), [0, 0, 2, 0]);
        check(&bare, &bare.to_bytes(), Version::parse);
        assert_eq!(bare.caps(), Capabilities::default());
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(Capabilities::default()) };
        let enc = v.to_bytes();
        assert_eq!(Version::parse(&enc).unwrap(), v);
        // The 4-byte prefix is a valid version without JSON; all others fail.
        prefixes_fail(&enc, |b| Version::parse(b).is_ok(), &[4]);
        assert!(Version::parse(&[&enc[..], &[0]].concat()).is_err());
        let raw = [&[0, 0, 1, 0][..], b"{\"capabilities\":{\"max_msg_fds\":4}}\0"].concat();
        assert_eq!(Version::parse(&raw).unwrap().caps().max_msg_fds, 4);
        for junk in [&b"\0"[..], b"{\0", b"{}}\0", b"\xff\0", b"{}\0\0", b"{} x\0", b"{}"] {
            assert!(Version::parse(&[&[0, 0, 0, 0][..], junk].concat()).is_err());
        }
    }
}
