//! vfio-user wire codec: the message header and every command payload this
//! project speaks, as plain structs with `parse` / `to_bytes`.
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

pub const DMA_MAP_FLAG_READ: u32 = 1 << 0;
pub const DMA_MAP_FLAG_WRITE: u32 = 1 << 1;
pub const DMA_UNMAP_FLAG_GET_DIRTY_BITMAP: u32 = 1 << 0;
pub const DMA_UNMAP_FLAG_ALL: u32 = 1 << 1;

pub const DEVICE_FLAGS_RESET: u32 = 1 << 0;
pub const DEVICE_FLAGS_PCI: u32 = 1 << 1;

pub const REGION_INFO_FLAG_READ: u32 = 1 << 0;
pub const REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
pub const REGION_INFO_FLAG_MMAP: u32 = 1 << 2;
pub const REGION_INFO_FLAG_CAPS: u32 = 1 << 3;
pub const REGION_INFO_CAP_SPARSE_MMAP: u16 = 1;
pub const REGION_INFO_CAP_TYPE: u16 = 2;

pub const IO_FD_TYPE_IOEVENTFD: u32 = 0;
pub const IO_FD_TYPE_IOREGIONFD: u32 = 1;
/// `KVM_IOEVENTFD_FLAG_*` as in `<linux/kvm.h>` (bit 2 is DEASSIGN, not sent).
pub const KVM_IOEVENTFD_FLAG_DATAMATCH: u32 = 1 << 0;
pub const KVM_IOEVENTFD_FLAG_PIO: u32 = 1 << 1;
pub const KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY: u32 = 1 << 3;
pub const KVM_IOREGION_PIO: u32 = 1 << 0;
pub const KVM_IOREGION_POSTED_WRITES: u32 = 1 << 1;

pub const IRQ_INFO_EVENTFD: u32 = 1 << 0;
pub const IRQ_INFO_MASKABLE: u32 = 1 << 1;
pub const IRQ_INFO_AUTOMASKED: u32 = 1 << 2;
pub const IRQ_INFO_NORESIZE: u32 = 1 << 3;

pub const IRQ_SET_DATA_NONE: u32 = 1 << 0;
pub const IRQ_SET_DATA_BOOL: u32 = 1 << 1;
pub const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
pub const IRQ_SET_ACTION_MASK: u32 = 1 << 3;
pub const IRQ_SET_ACTION_UNMASK: u32 = 1 << 4;
pub const IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
const IRQ_SET_DATA_ALL: u32 = IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_DATA_EVENTFD;
const IRQ_SET_ACTION_ALL: u32 = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER;

pub const DEVICE_FEATURE_MASK: u32 = 0xffff;
pub const DEVICE_FEATURE_GET: u32 = 1 << 16;
pub const DEVICE_FEATURE_SET: u32 = 1 << 17;
pub const DEVICE_FEATURE_PROBE: u32 = 1 << 18;

/// PCI region indexes: BAR0..BAR5 are 0..5.
pub const PCI_ROM_REGION_INDEX: u32 = 6;
pub const PCI_CONFIG_REGION_INDEX: u32 = 7;
pub const PCI_VGA_REGION_INDEX: u32 = 8;
pub const PCI_NUM_REGIONS: u32 = 9;
pub const PCI_INTX_IRQ_INDEX: u32 = 0;
pub const PCI_MSI_IRQ_INDEX: u32 = 1;
pub const PCI_MSIX_IRQ_INDEX: u32 = 2;
pub const PCI_ERR_IRQ_INDEX: u32 = 3;
pub const PCI_REQ_IRQ_INDEX: u32 = 4;
pub const PCI_NUM_IRQS: u32 = 5;

/// Data bytes one REGION_WRITE_MULTI entry can carry.
pub const WRITE_MULTI_DATA: usize = 8;

const DMA_MAP_SIZE: usize = 32;
const DMA_UNMAP_SIZE: usize = 24;
const INFO16_SIZE: usize = 16;
const REGION_INFO_SIZE: usize = 32;
const SPARSE_CAP_SIZE: usize = 16;
const SPARSE_AREA_SIZE: usize = 16;
const IO_FD_ENTRY_SIZE: usize = 40;
const IRQ_SET_SIZE: usize = 20;
const ACCESS_SIZE: usize = 16;
const WRITE_ONE_SIZE: usize = 24;

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

/// Checks that a payload which must be empty (DEVICE_RESET, most replies) is.
pub fn expect_empty(what: &'static str, b: &[u8]) -> Result<(), WireError> {
    Rd::new(what, b, 0, true).map(|_| ())
}

/// Session capabilities negotiated in VERSION.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub max_msg_fds: u32,
    pub max_data_xfer_size: u32,
    pub max_dma_maps: u32,
    pub pgsizes: u64,
    pub write_multiple: bool,
}

impl Default for Capabilities {
    /// The values the spec says to assume when a capability is absent.
    fn default() -> Self {
        let max_data_xfer_size = DEFAULT_MAX_DATA_XFER_SIZE;
        Capabilities { max_msg_fds: 1, max_data_xfer_size, max_dma_maps: 65535, pgsizes: 4096, write_multiple: false }
    }
}

impl Capabilities {
    pub fn to_json(&self) -> Value {
        let mut caps = Map::new();
        caps.insert("max_msg_fds".into(), self.max_msg_fds.into());
        caps.insert("max_data_xfer_size".into(), self.max_data_xfer_size.into());
        caps.insert("max_dma_maps".into(), self.max_dma_maps.into());
        caps.insert("pgsizes".into(), self.pgsizes.into());
        caps.insert("write_multiple".into(), self.write_multiple.into());
        Value::Object(Map::from_iter([("capabilities".to_string(), Value::Object(caps))]))
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

/// DMA_MAP request (32 bytes; no reply payload). `argsz` is written as 32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaMap {
    pub flags: u32,
    /// Offset into the file descriptor sent with the message (0 if none).
    pub offset: u64,
    pub address: u64,
    pub size: u64,
}

impl DmaMap {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma_map", b, DMA_MAP_SIZE, true)?;
        check_argsz("dma_map", r.u32()?, DMA_MAP_SIZE)?;
        let m = DmaMap { flags: r.u32()?, offset: r.u64()?, address: r.u64()?, size: r.u64()? };
        if m.flags & !(DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE) != 0 {
            return Err(invalid(format!("dma_map: unknown flags {:#x}", m.flags)));
        }
        Ok(m)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wr::new(DMA_MAP_SIZE).u32(DMA_MAP_SIZE as u32).u32(self.flags);
        w.u64(self.offset).u64(self.address).u64(self.size).0
    }
}

/// DMA_UNMAP request and reply (the server echoes the request). Flags 0 and
/// `DMA_UNMAP_FLAG_ALL` only: dirty bitmaps are not supported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaUnmap {
    pub argsz: u32,
    pub flags: u32,
    pub address: u64,
    pub size: u64,
}

impl DmaUnmap {
    pub fn new(flags: u32, address: u64, size: u64) -> Self {
        DmaUnmap { argsz: DMA_UNMAP_SIZE as u32, flags, address, size }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma_unmap", b, DMA_UNMAP_SIZE, true)?;
        let u = DmaUnmap { argsz: r.u32()?, flags: r.u32()?, address: r.u64()?, size: r.u64()? };
        check_argsz("dma_unmap", u.argsz, DMA_UNMAP_SIZE)?;
        match u.flags {
            0 => Ok(u),
            DMA_UNMAP_FLAG_ALL if u.address == 0 && u.size == 0 => Ok(u),
            f => Err(invalid(format!("dma_unmap: unsupported flags {f:#x} (or ALL with a range)"))),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(DMA_UNMAP_SIZE).u32(self.argsz).u32(self.flags).u64(self.address).u64(self.size).0
    }
}

/// DEVICE_GET_INFO request and reply (16 bytes). A request sets only `argsz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
}

impl DeviceInfo {
    pub fn request() -> Self {
        DeviceInfo { argsz: INFO16_SIZE as u32, flags: 0, num_regions: 0, num_irqs: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("device_info", b, INFO16_SIZE, true)?;
        let d = DeviceInfo { argsz: r.u32()?, flags: r.u32()?, num_regions: r.u32()?, num_irqs: r.u32()? };
        check_argsz("device_info", d.argsz, INFO16_SIZE).map(|_| d)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(self.flags).u32(self.num_regions).u32(self.num_irqs).0
    }
}

/// The fixed 32-byte `vfio_region_info`: the GET_REGION_INFO request, and
/// the start of its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

impl RegionInfo {
    /// A request for region `index` accepting up to `argsz` bytes of reply.
    pub fn request(index: u32, argsz: u32) -> Self {
        RegionInfo { argsz, flags: 0, index, cap_offset: 0, size: 0, offset: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        Self::read(&mut Rd::new("region_info", b, REGION_INFO_SIZE, true)?)
    }

    fn read(r: &mut Rd) -> Result<Self, WireError> {
        let (argsz, flags, index, cap_offset) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let i = RegionInfo { argsz, flags, index, cap_offset, size: r.u64()?, offset: r.u64()? };
        check_argsz(r.what, i.argsz, REGION_INFO_SIZE).map(|_| i)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let w = Wr::new(REGION_INFO_SIZE).u32(self.argsz).u32(self.flags).u32(self.index).u32(self.cap_offset);
        w.u64(self.size).u64(self.offset).0
    }
}

/// One mmap-able window of a region, relative to the region's `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseMmapArea {
    pub offset: u64,
    pub size: u64,
}

/// GET_REGION_INFO reply: the fixed struct plus an optional sparse mmap
/// capability (the only one produced; other capabilities are skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfoReply {
    pub info: RegionInfo,
    pub sparse_mmap: Option<Vec<SparseMmapArea>>,
}

impl RegionInfoReply {
    /// A full reply: `argsz` is the size needed; with `sparse_mmap` the CAPS
    /// flag is set and `cap_offset` is 32.
    pub fn new(index: u32, flags: u32, size: u64, offset: u64, sparse_mmap: Option<Vec<SparseMmapArea>>) -> Self {
        let caps_len = sparse_mmap.as_ref().map_or(0, |a| SPARSE_CAP_SIZE + a.len() * SPARSE_AREA_SIZE);
        let (flags, cap_offset) = match sparse_mmap {
            Some(_) => (flags | REGION_INFO_FLAG_CAPS, REGION_INFO_SIZE as u32),
            None => (flags & !REGION_INFO_FLAG_CAPS, 0),
        };
        let argsz = len_u32(REGION_INFO_SIZE + caps_len);
        RegionInfoReply { info: RegionInfo { argsz, flags, index, cap_offset, size, offset }, sparse_mmap }
    }

    /// The reply for a request that allowed `req_argsz` bytes: all of it if it
    /// fits, else (as VFIO does) the fixed struct alone, CAPS cleared, and
    /// `argsz` still the size needed so the client can retry.
    pub fn fit(mut self, req_argsz: u32) -> Self {
        if req_argsz < self.info.argsz {
            self.info.flags &= !REGION_INFO_FLAG_CAPS;
            self.info.cap_offset = 0;
            self.sparse_mmap = None;
        }
        self
    }

    /// True if the server had more to say than the request's `argsz` allowed.
    pub fn is_truncated(&self) -> bool {
        self.info.flags & REGION_INFO_FLAG_CAPS == 0 && self.info.argsz as usize > REGION_INFO_SIZE
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr(self.info.to_bytes());
        if let Some(areas) = &self.sparse_mmap {
            w = w.u16(REGION_INFO_CAP_SPARSE_MMAP).u16(1).u32(0).u32(len_u32(areas.len())).u32(0);
            for a in areas {
                w = w.u64(a.offset).u64(a.size);
            }
        }
        w.0
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_info reply";
        let mut r = Rd::new(WHAT, b, REGION_INFO_SIZE, false)?;
        let info = RegionInfo::read(&mut r)?;
        let argsz = info.argsz as usize;
        if info.flags & REGION_INFO_FLAG_CAPS == 0 {
            // Truncated replies are the fixed struct, which libvfio-user pads
            // with zeros up to the request's argsz (< this argsz).
            if b.len() > argsz.max(REGION_INFO_SIZE) {
                return Err(WireError::Trailing { what: WHAT, expected: argsz, got: b.len() });
            }
            return Ok(RegionInfoReply { info, sparse_mmap: None });
        }
        if b.len() != argsz {
            return Err(invalid(format!("{WHAT}: CAPS set but argsz {argsz} != payload size {}", b.len())));
        }
        let (mut sparse, mut off, mut min) = (None, info.cap_offset as usize, REGION_INFO_SIZE);
        loop {
            // Each capability must start after the previous one ends, so the
            // walk only moves forward and ends within the payload.
            if off < min {
                return Err(invalid(format!("{WHAT}: capability at {off} overlaps or points backwards")));
            }
            r.pos = off;
            let (id, version, next) = (r.u16()?, r.u16()?, r.u32()?);
            if id == REGION_INFO_CAP_SPARSE_MMAP {
                if sparse.is_some() || version != 1 {
                    return Err(invalid(format!("{WHAT}: duplicate sparse mmap cap or version {version}")));
                }
                let (nr, _reserved) = (r.u32()? as usize, r.u32()?);
                let len = nr.checked_mul(SPARSE_AREA_SIZE).ok_or_else(|| invalid("sparse mmap: too many areas"))?;
                let mut a = Rd::new(WHAT, r.take(len)?, len, true)?;
                let mut areas = Vec::with_capacity(nr);
                for _ in 0..nr {
                    let area = SparseMmapArea { offset: a.u64()?, size: a.u64()? };
                    if area.offset.checked_add(area.size).map_or(true, |end| end > info.size) {
                        return Err(invalid(format!("{WHAT}: sparse area {area:?} lies outside the region")));
                    }
                    areas.push(area);
                }
                sparse = Some(areas);
            }
            if next == 0 {
                return Ok(RegionInfoReply { info, sparse_mmap: sparse });
            }
            (min, off) = (r.pos, next as usize);
        }
    }
}

/// GET_REGION_IO_FDS request (16 bytes; `flags` and `count` are 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoFdsRequest {
    pub argsz: u32,
    pub index: u32,
}

impl IoFdsRequest {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("region_io_fds request", b, INFO16_SIZE, true)?;
        let (argsz, flags, index, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        if flags != 0 || count != 0 {
            return Err(invalid(format!("region_io_fds request: flags {flags:#x} and count {count} must be 0")));
        }
        check_argsz(r.what, argsz, INFO16_SIZE).map(|_| IoFdsRequest { argsz, index })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(0).u32(self.index).u32(0).0
    }
}

/// One sub-region of a GET_REGION_IO_FDS reply (40 bytes on the wire).
/// `fd_index` indexes the file descriptors sent with the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoFdEntry {
    IoEventFd { offset: u64, size: u64, fd_index: u32, flags: u32, datamatch: u64 },
    IoRegionFd { offset: u64, size: u64, fd_index: u32, flags: u32, user_data: u64 },
}

impl IoFdEntry {
    pub fn fd_index(&self) -> u32 {
        match *self {
            IoFdEntry::IoEventFd { fd_index, .. } | IoFdEntry::IoRegionFd { fd_index, .. } => fd_index,
        }
    }

    fn read(r: &mut Rd) -> Result<Self, WireError> {
        let (offset, size, fd_index, ty, flags) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?, r.u32()?);
        let (_padding, last) = (r.u32()?, r.u64()?);
        let ioeventfd_flags =
            KVM_IOEVENTFD_FLAG_DATAMATCH | KVM_IOEVENTFD_FLAG_PIO | KVM_IOEVENTFD_FLAG_VIRTIO_CCW_NOTIFY;
        match ty {
            IO_FD_TYPE_IOEVENTFD if flags & !ioeventfd_flags == 0 => {
                Ok(IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: last })
            }
            IO_FD_TYPE_IOREGIONFD
                if flags & !(KVM_IOREGION_PIO | KVM_IOREGION_POSTED_WRITES) == 0
                    && (size != 0 || flags & KVM_IOREGION_POSTED_WRITES != 0) =>
            {
                Ok(IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: last })
            }
            IO_FD_TYPE_IOEVENTFD | IO_FD_TYPE_IOREGIONFD => {
                Err(invalid(format!("io fd sub-region type {ty}: bad flags {flags:#x} for size {size}")))
            }
            _ => Err(invalid(format!("io fd sub-region: unknown type {ty}"))),
        }
    }

    fn write(&self, w: Wr) -> Wr {
        let (offset, size, fd_index, ty, flags, last) = match *self {
            IoFdEntry::IoEventFd { offset, size, fd_index, flags, datamatch: d } => {
                (offset, size, fd_index, IO_FD_TYPE_IOEVENTFD, flags, d)
            }
            IoFdEntry::IoRegionFd { offset, size, fd_index, flags, user_data: u } => {
                (offset, size, fd_index, IO_FD_TYPE_IOREGIONFD, flags, u)
            }
        };
        w.u64(offset).u64(size).u32(fd_index).u32(ty).u32(flags).u32(0).u64(last)
    }
}

/// GET_REGION_IO_FDS reply: 16-byte head then `count` entries. If the
/// request's `argsz` was too small the reply is the head alone, `count` and
/// `argsz` saying what is needed, and `entries` is empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoFdsReply {
    pub argsz: u32,
    pub index: u32,
    pub count: u32,
    pub entries: Vec<IoFdEntry>,
}

impl IoFdsReply {
    pub fn new(index: u32, entries: Vec<IoFdEntry>) -> Self {
        let argsz = len_u32(INFO16_SIZE + entries.len() * IO_FD_ENTRY_SIZE);
        IoFdsReply { argsz, index, count: len_u32(entries.len()), entries }
    }

    /// The reply for a request that allowed `req_argsz` bytes.
    pub fn fit(mut self, req_argsz: u32) -> Self {
        if req_argsz < self.argsz {
            self.entries.clear();
        }
        self
    }

    /// True if the server has sub-regions that were not sent.
    pub fn is_truncated(&self) -> bool {
        self.entries.len() != self.count as usize
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr::new(INFO16_SIZE + self.entries.len() * IO_FD_ENTRY_SIZE);
        w = w.u32(self.argsz).u32(0).u32(self.index).u32(self.count);
        for e in &self.entries {
            w = e.write(w);
        }
        w.0
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_io_fds reply";
        let mut r = Rd::new(WHAT, b, INFO16_SIZE, false)?;
        let (argsz, flags, index, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        let (argsz_n, count_n) = (argsz as usize, count as usize);
        // Entry i is at 16 + i * (argsz - 16) / count: 40 today, not to be relied on.
        let stride = argsz_n.saturating_sub(INFO16_SIZE).checked_div(count_n).unwrap_or(0);
        let fits = match count_n {
            0 => argsz_n == INFO16_SIZE,
            _ => stride >= IO_FD_ENTRY_SIZE && INFO16_SIZE + stride * count_n == argsz_n,
        };
        if flags != 0 || !fits {
            return Err(invalid(format!("{WHAT}: flags {flags:#x}, argsz {argsz} and count {count} disagree")));
        }
        let mut entries = Vec::new();
        if b.len() != INFO16_SIZE {
            // More than the head: all entries must be there.
            if b.len() != argsz_n {
                return Err(invalid(format!("{WHAT}: payload size {} != argsz {argsz}", b.len())));
            }
            entries.reserve(count_n);
            for i in 0..count_n {
                r.pos = INFO16_SIZE + i * stride;
                entries.push(IoFdEntry::read(&mut r)?);
            }
        }
        Ok(IoFdsReply { argsz, index, count, entries })
    }
}

/// GET_IRQ_INFO request and reply (16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqInfo {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

impl IrqInfo {
    pub fn request(index: u32) -> Self {
        IrqInfo { argsz: INFO16_SIZE as u32, flags: 0, index, count: 0 }
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("irq_info", b, INFO16_SIZE, true)?;
        let i = IrqInfo { argsz: r.u32()?, flags: r.u32()?, index: r.u32()?, count: r.u32()? };
        check_argsz("irq_info", i.argsz, INFO16_SIZE).map(|_| i)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(INFO16_SIZE).u32(self.argsz).u32(self.flags).u32(self.index).u32(self.count).0
    }
}

/// SET_IRQS request (20 bytes + data; no reply payload). `argsz` is the
/// request size, computed on encode and checked on decode. `data` is `count`
/// bool bytes for DATA_BOOL, else empty (DATA_EVENTFD's fds are out of band).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IrqSet {
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
    pub data: Vec<u8>,
}

impl IrqSet {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("set_irqs", b, IRQ_SET_SIZE, false)?;
        let (argsz, flags, index, start, count) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
        if argsz as usize != b.len() {
            return Err(invalid(format!("set_irqs: argsz {argsz} != payload size {}", b.len())));
        }
        let (data, action) = (flags & IRQ_SET_DATA_ALL, flags & IRQ_SET_ACTION_ALL);
        if flags & !(IRQ_SET_DATA_ALL | IRQ_SET_ACTION_ALL) != 0 || data.count_ones() != 1 || action.count_ones() != 1 {
            return Err(invalid(format!("set_irqs: flags {flags:#x} need exactly one DATA_* and one ACTION_*")));
        }
        if start.checked_add(count).is_none() {
            return Err(invalid(format!("set_irqs: start {start} + count {count} overflows")));
        }
        let want = if data == IRQ_SET_DATA_BOOL { count as usize } else { 0 };
        let data = r.take(want)?.to_vec();
        expect_empty("set_irqs", r.rest())?;
        Ok(IrqSet { flags, index, start, count, data })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let argsz = len_u32(IRQ_SET_SIZE + self.data.len());
        let w = Wr::new(argsz as usize).u32(argsz).u32(self.flags).u32(self.index).u32(self.start);
        w.u32(self.count).bytes(&self.data).0
    }
}

/// Checks that what follows a 16-byte access header is exactly `count` bytes.
fn access_data<'a>(what: &'static str, r: &mut Rd<'a>, count: u64) -> Result<&'a [u8], WireError> {
    if count > MAX_MSG_SIZE as u64 {
        return Err(WireError::TooLarge { what, max: MAX_MSG_SIZE, got: count as usize });
    }
    let data = r.take(count as usize)?;
    expect_empty(what, r.rest()).map(|_| data)
}

/// `{offset u64, region u32, count u32}`: alone for the REGION_READ request
/// and REGION_WRITE reply; followed by exactly `count` data bytes for the
/// REGION_READ reply and REGION_WRITE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionAccess {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
}

impl RegionAccess {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("region access", b, ACCESS_SIZE, true)?;
        Ok(RegionAccess { offset: r.u64()?, region: r.u32()?, count: r.u32()? })
    }

    pub fn parse_with_data(b: &[u8]) -> Result<(Self, &[u8]), WireError> {
        let mut r = Rd::new("region access", b, ACCESS_SIZE, false)?;
        let a = RegionAccess { offset: r.u64()?, region: r.u32()?, count: r.u32()? };
        Ok((a, access_data("region access data", &mut r, a.count.into())?))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(ACCESS_SIZE).u64(self.offset).u32(self.region).u32(self.count).0
    }

    /// Header and data; `count` is `data.len()`.
    pub fn to_bytes_with_data(offset: u64, region: u32, data: &[u8]) -> Vec<u8> {
        Wr::new(ACCESS_SIZE + data.len()).u64(offset).u32(region).u32(len_u32(data.len())).bytes(data).0
    }
}

/// `{address u64, count u64}`: alone for the DMA_READ request and DMA_WRITE
/// reply; followed by exactly `count` data bytes for the DMA_READ reply and
/// DMA_WRITE request. (The DMA_WRITE reply is this 16-byte form, as
/// libvfio-user sends and checks it; the spec's table gives count 4 bytes.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaAccess {
    pub address: u64,
    pub count: u64,
}

impl DmaAccess {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("dma access", b, ACCESS_SIZE, true)?;
        Ok(DmaAccess { address: r.u64()?, count: r.u64()? })
    }

    pub fn parse_with_data(b: &[u8]) -> Result<(Self, &[u8]), WireError> {
        let mut r = Rd::new("dma access", b, ACCESS_SIZE, false)?;
        let a = DmaAccess { address: r.u64()?, count: r.u64()? };
        Ok((a, access_data("dma access data", &mut r, a.count)?))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(ACCESS_SIZE).u64(self.address).u64(self.count).0
    }

    pub fn to_bytes_with_data(address: u64, data: &[u8]) -> Vec<u8> {
        Wr::new(ACCESS_SIZE + data.len()).u64(address).u64(data.len() as u64).bytes(data).0
    }
}

/// One coalesced write of REGION_WRITE_MULTI (24 bytes, up to 8 data bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteOne {
    pub offset: u64,
    pub region: u32,
    pub count: u32,
    pub data: [u8; WRITE_MULTI_DATA],
}

impl WriteOne {
    /// `None` if `data` is longer than 8 bytes.
    pub fn new(offset: u64, region: u32, data: &[u8]) -> Option<Self> {
        let mut d = [0u8; WRITE_MULTI_DATA];
        d.get_mut(..data.len())?.copy_from_slice(data);
        Some(WriteOne { offset, region, count: data.len() as u32, data: d })
    }

    /// The `count` bytes to write.
    pub fn bytes(&self) -> &[u8] {
        &self.data[..(self.count as usize).min(WRITE_MULTI_DATA)]
    }
}

/// REGION_WRITE_MULTI request: `wr_cnt u64` then `wr_cnt` [`WriteOne`]s.
/// The reply is [`RegionWriteMultiReply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionWriteMulti {
    pub writes: Vec<WriteOne>,
}

impl RegionWriteMulti {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        const WHAT: &str = "region_write_multi";
        let mut r = Rd::new(WHAT, b, 8, false)?;
        let n = r.u64()?;
        let size = n.checked_mul(WRITE_ONE_SIZE as u64).and_then(|x| x.checked_add(8));
        let size = size.filter(|s| *s <= MAX_MSG_SIZE as u64).ok_or_else(|| invalid(format!("{WHAT}: wr_cnt {n}")))?;
        Rd::new(WHAT, b, size as usize, true)?;
        let mut writes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let w = WriteOne { offset: r.u64()?, region: r.u32()?, count: r.u32()?, data: r.arr()? };
            if w.count as usize > WRITE_MULTI_DATA {
                return Err(invalid(format!("{WHAT}: count {} > {WRITE_MULTI_DATA}", w.count)));
            }
            writes.push(w);
        }
        Ok(RegionWriteMulti { writes })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = Wr::new(8 + self.writes.len() * WRITE_ONE_SIZE).u64(self.writes.len() as u64);
        for one in &self.writes {
            w = w.u64(one.offset).u32(one.region).u32(one.count).bytes(&one.data);
        }
        w.0
    }
}

/// REGION_WRITE_MULTI reply: the number of writes completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionWriteMultiReply {
    pub wr_cnt: u64,
}

impl RegionWriteMultiReply {
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        Ok(RegionWriteMultiReply { wr_cnt: Rd::new("region_write_multi reply", b, 8, true)?.u64()? })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.wr_cnt.to_le_bytes().to_vec()
    }
}

/// DEVICE_FEATURE request and reply: `argsz`, `flags` (feature index in bits
/// 0-15, GET/SET/PROBE above), then feature-specific data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFeature {
    pub argsz: u32,
    pub flags: u32,
    pub data: Vec<u8>,
}

impl DeviceFeature {
    pub fn feature(&self) -> u32 {
        self.flags & DEVICE_FEATURE_MASK
    }

    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("device_feature", b, 8, false)?;
        let (argsz, flags) = (r.u32()?, r.u32()?);
        let (ops, get_set) = (flags & !DEVICE_FEATURE_MASK, DEVICE_FEATURE_GET | DEVICE_FEATURE_SET);
        let known = ops & !(get_set | DEVICE_FEATURE_PROBE) == 0;
        if !known || ops == 0 || (ops & get_set == get_set && ops & DEVICE_FEATURE_PROBE == 0) {
            return Err(invalid(format!("device_feature: bad flags {flags:#x}")));
        }
        check_argsz("device_feature", argsz, 8)?;
        Ok(DeviceFeature { argsz, flags, data: r.rest().to_vec() })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(8 + self.data.len()).u32(self.argsz).u32(self.flags).bytes(&self.data).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Little-endian concatenation of `(value, width <= 8)` fields.
    fn le(fields: &[(u64, usize)]) -> Vec<u8> {
        fields.iter().flat_map(|&(v, n)| v.to_le_bytes()[..n].to_vec()).collect()
    }

    /// Every strict prefix of `enc` fails to parse, except the lengths in `except`.
    fn prefixes_fail(enc: &[u8], ok: impl Fn(&[u8]) -> bool, except: &[usize]) {
        for n in (0..enc.len()).filter(|n| !except.contains(n)) {
            assert!(!ok(&enc[..n]), "prefix of {n}/{} bytes parsed", enc.len());
        }
    }

    /// Round trip; every prefix and one extra byte fail.
    fn check<T: PartialEq + std::fmt::Debug>(v: &T, enc: &[u8], parse: impl Fn(&[u8]) -> Result<T, WireError>) {
        assert_eq!(&parse(enc).unwrap(), v);
        prefixes_fail(enc, |b| parse(b).is_ok(), &[]);
        assert!(parse(&[enc, &[0]].concat()).is_err(), "oversize parsed");
    }

    fn set32(b: &[u8], at: usize, v: u32) -> Vec<u8> {
        let mut b = b.to_vec();
        b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        b
    }

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
        assert_eq!(known, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16]);
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

    #[test]
    fn dma_map_and_unmap() {
        let m =
            DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0x1000, address: 1 << 31, size: 1 << 30 };
        let enc = m.to_bytes();
        assert_eq!(enc, le(&[(32, 4), (3, 4), (0x1000, 8), (1 << 31, 8), (1 << 30, 8)]));
        check(&m, &enc, DmaMap::parse);
        assert!(DmaMap::parse(&set32(&enc, 4, 4)).is_err());
        assert!(DmaMap::parse(&set32(&enc, 0, 31)).is_err());
        let u = DmaUnmap::new(0, 1 << 31, 1 << 30);
        assert_eq!(u.to_bytes(), le(&[(24, 4), (0, 4), (1 << 31, 8), (1 << 30, 8)]));
        check(&u, &u.to_bytes(), DmaUnmap::parse);
        let all = DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 0, 0);
        check(&all, &all.to_bytes(), DmaUnmap::parse);
        assert!(DmaUnmap::parse(&DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 1, 0).to_bytes()).is_err());
        assert!(DmaUnmap::parse(&DmaUnmap::new(DMA_UNMAP_FLAG_GET_DIRTY_BITMAP, 0, 4096).to_bytes()).is_err());
    }

    #[test]
    fn device_info_and_irq_info() {
        let req = DeviceInfo::request();
        assert_eq!(req.to_bytes(), le(&[(16, 4), (0, 4), (0, 4), (0, 4)]));
        check(&req, &req.to_bytes(), DeviceInfo::parse);
        let rep = DeviceInfo { argsz: 16, flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET, num_regions: 9, num_irqs: 5 };
        check(&rep, &rep.to_bytes(), DeviceInfo::parse);
        assert!(DeviceInfo::parse(&DeviceInfo { argsz: 4, ..rep }.to_bytes()).is_err());
        let q = IrqInfo::request(PCI_MSIX_IRQ_INDEX);
        assert_eq!(q.to_bytes(), le(&[(16, 4), (0, 4), (2, 4), (0, 4)]));
        check(&q, &q.to_bytes(), IrqInfo::parse);
        let a = IrqInfo { argsz: 16, flags: IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, index: 2, count: 64 };
        check(&a, &a.to_bytes(), IrqInfo::parse);
    }

    #[test]
    fn region_info_plain() {
        let q = RegionInfo::request(PCI_CONFIG_REGION_INDEX, 256);
        assert_eq!(q.to_bytes(), le(&[(256, 4), (0, 4), (7, 4), (0, 4), (0, 8), (0, 8)]));
        check(&q, &q.to_bytes(), RegionInfo::parse);
        let r = RegionInfoReply::new(7, REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE, 256, 0, None);
        assert!(r.info.argsz == 32 && !r.is_truncated());
        check(&r, &r.to_bytes(), RegionInfoReply::parse);
    }

    #[test]
    fn region_info_reply_sparse_bytes() {
        let areas = vec![SparseMmapArea { offset: 0x1000, size: 0x3000 }];
        let flags = REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE | REGION_INFO_FLAG_MMAP;
        let r = RegionInfoReply::new(0, flags, 0x4000, 0, Some(areas));
        let want = le(&[
            (64, 4),     // argsz: 32 + cap header 8 + nr_areas/reserved 8 + one area 16
            (0xf, 4),    // flags: READ | WRITE | MMAP | CAPS
            (0, 4),      // index
            (32, 4),     // cap_offset
            (0x4000, 8), // size
            (0, 8),      // offset
            (1, 2),      // cap id: SPARSE_MMAP
            (1, 2),      // cap version
            (0, 4),      // next
            (1, 4),      // nr_areas
            (0, 4),      // reserved
            (0x1000, 8), // area offset
            (0x3000, 8), // area size
        ]);
        assert_eq!(r.to_bytes(), want);
        check(&r, &want, RegionInfoReply::parse);
    }

    #[test]
    fn region_info_reply_fit() {
        let areas = vec![SparseMmapArea { offset: 0, size: 0x1000 }, SparseMmapArea { offset: 0x2000, size: 0x1000 }];
        let full = RegionInfoReply::new(2, REGION_INFO_FLAG_READ | REGION_INFO_FLAG_MMAP, 0x4000, 1 << 40, Some(areas));
        assert_eq!(full.info.argsz, 80);
        check(&full, &full.to_bytes(), RegionInfoReply::parse);
        assert_eq!(full.clone().fit(80), full);
        let short = full.fit(79);
        assert!(short.is_truncated() && short.sparse_mmap.is_none());
        assert_eq!((short.info.argsz, short.info.cap_offset, short.info.flags), (80, 0, REGION_INFO_FLAG_READ | 4));
        let enc = short.to_bytes();
        assert_eq!(enc.len(), 32);
        assert_eq!(RegionInfoReply::parse(&enc).unwrap(), short);
        // libvfio-user zero-pads a truncated reply up to the request's argsz.
        assert_eq!(RegionInfoReply::parse(&[&enc[..], &[0; 16]].concat()).unwrap(), short);
        assert!(RegionInfoReply::parse(&[&enc[..], &[0; 49]].concat()).is_err());
    }

    #[test]
    fn region_info_reply_hostile_chains() {
        let r = RegionInfoReply::new(0, 0, 0x4000, 0, Some(vec![SparseMmapArea { offset: 0, size: 0x1000 }]));
        let good = r.to_bytes();
        // cap_offset: 0 with CAPS set, backwards, running off the end.
        for v in [0, 16, 60, 64, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 12, v)).is_err(), "cap_offset {v}");
        }
        // next: itself (a loop), backwards, into the areas, past the end.
        for v in [32, 8, 40, 64, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 36, v)).is_err(), "next {v}");
        }
        for nr in [2, u32::MAX] {
            assert!(RegionInfoReply::parse(&set32(&good, 40, nr)).is_err(), "nr_areas {nr}");
        }
        assert!(RegionInfoReply::parse(&set32(&good, 0, 72)).is_err()); // argsz != size
        assert!(RegionInfoReply::parse(&set32(&good, 32, 0x0002_0001)).is_err()); // cap version 2
        let outside = RegionInfoReply::new(0, 0, 0x800, 0, Some(vec![SparseMmapArea { offset: 0, size: 0x1000 }]));
        assert!(RegionInfoReply::parse(&outside.to_bytes()).is_err());
        // An unknown capability (TYPE, 16 bytes) chained before the sparse one is skipped.
        let typed = [&set32(&good[..32], 0, 80), &le(&[(2, 2), (1, 2), (48, 4), (3, 4), (1, 4)])[..], &good[32..]];
        assert_eq!(RegionInfoReply::parse(&typed.concat()).unwrap().sparse_mmap, r.sparse_mmap);
    }

    #[test]
    fn io_fds_request() {
        let q = IoFdsRequest { argsz: 1024, index: 1 };
        assert_eq!(q.to_bytes(), le(&[(1024, 4), (0, 4), (1, 4), (0, 4)]));
        check(&q, &q.to_bytes(), IoFdsRequest::parse);
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 12, 1)).is_err());
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 4, 1)).is_err());
        assert!(IoFdsRequest::parse(&set32(&q.to_bytes(), 0, 8)).is_err());
    }

    #[test]
    fn io_fds_reply_ioeventfd_bytes() {
        let flags = KVM_IOEVENTFD_FLAG_DATAMATCH;
        let r = IoFdsReply::new(
            0,
            vec![IoFdEntry::IoEventFd { offset: 0x1000, size: 4, fd_index: 0, flags, datamatch: 0x1234 }],
        );
        let want = le(&[
            (56, 4),     // argsz: 16 + 40
            (0, 4),      // flags
            (0, 4),      // index
            (1, 4),      // count
            (0x1000, 8), // offset
            (4, 8),      // size
            (0, 4),      // fd_index
            (0, 4),      // type: IOEVENTFD
            (1, 4),      // flags: DATAMATCH
            (0, 4),      // padding
            (0x1234, 8), // datamatch
        ]);
        assert_eq!(r.to_bytes(), want);
        assert_eq!(IoFdsReply::parse(&want).unwrap(), r);
        // The 16-byte head alone is the legitimate "argsz too small" reply.
        prefixes_fail(&want, |b| IoFdsReply::parse(b).is_ok(), &[16]);
        assert!(IoFdsReply::parse(&[&want[..], &[0]].concat()).is_err());
    }

    #[test]
    fn io_fds_reply_mixed_and_fit() {
        let posted = KVM_IOREGION_POSTED_WRITES;
        let r = IoFdsReply::new(
            4,
            vec![
                IoFdEntry::IoEventFd { offset: 0, size: 0, fd_index: 0, flags: 0, datamatch: 0 },
                IoFdEntry::IoRegionFd { offset: 0x100, size: 0, fd_index: 1, flags: posted, user_data: 9 },
                IoFdEntry::IoRegionFd { offset: 0x200, size: 8, fd_index: 1, flags: KVM_IOREGION_PIO, user_data: 10 },
            ],
        );
        assert_eq!((r.argsz, r.count, r.entries[1].fd_index()), (136, 3, 1));
        assert_eq!(r.to_bytes()[56..96], le(&[(0x100, 8), (0, 8), (1, 4), (1, 4), (2, 4), (0, 4), (9, 8)])[..]);
        assert_eq!(IoFdsReply::parse(&r.to_bytes()).unwrap(), r);
        assert_eq!(r.clone().fit(136), r);
        let short = r.fit(135);
        assert!(short.is_truncated());
        assert_eq!(short.to_bytes(), le(&[(136, 4), (0, 4), (4, 4), (3, 4)]));
        assert_eq!(IoFdsReply::parse(&short.to_bytes()).unwrap(), short);
        let empty = IoFdsReply::new(1, vec![]);
        check(&empty, &empty.to_bytes(), IoFdsReply::parse);
    }

    #[test]
    fn io_fds_reply_hostile() {
        let e = IoFdEntry::IoEventFd { offset: 0, size: 4, fd_index: 0, flags: 0, datamatch: 0 };
        let good = IoFdsReply::new(0, vec![e, e]).to_bytes();
        // count huge / not matching argsz, argsz too small / huge, flags, entry type 2 (libvfio-user's
        // shadow ioeventfd) and 7, unknown ioeventfd flag (4 is DEASSIGN).
        for (at, v) in [(12, u32::MAX), (12, 3), (0, 40), (0, u32::MAX), (4, 1), (36, 2), (36, 7), (40, 4)] {
            assert!(IoFdsReply::parse(&set32(&good, at, v)).is_err(), "field at {at} = {v}");
        }
        let bad = IoFdEntry::IoRegionFd { offset: 0, size: 0, fd_index: 0, flags: KVM_IOREGION_PIO, user_data: 0 };
        assert!(IoFdsReply::parse(&IoFdsReply::new(0, vec![bad]).to_bytes()).is_err());
        // A stride larger than 40 is honoured; the extra bytes are skipped.
        let wide: Vec<u8> = good[16..].chunks(40).flat_map(|c| [c, &[0xee; 8]].concat()).collect();
        let wide = [&set32(&good[..16], 0, 16 + 2 * 48), &wide[..]].concat();
        assert_eq!(IoFdsReply::parse(&wide).unwrap().entries, vec![e, e]);
    }

    #[test]
    fn set_irqs() {
        let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
        let efd = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: 0, count: 4, data: vec![] };
        assert_eq!(efd.to_bytes(), le(&[(20, 4), (0x24, 4), (2, 4), (0, 4), (4, 4)]));
        check(&efd, &efd.to_bytes(), IrqSet::parse);
        let bools = IrqSet {
            flags: IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_MASK,
            index: 1,
            start: 2,
            count: 3,
            data: vec![1, 0, 1],
        };
        check(&bools, &bools.to_bytes(), IrqSet::parse);
        let none =
            IrqSet { flags: IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER, index: 0, start: 0, count: 0, data: vec![] };
        check(&none, &none.to_bytes(), IrqSet::parse);
        for flags in [0, IRQ_SET_DATA_NONE, IRQ_SET_ACTION_MASK, 0x3 | 0x20, 0x1 | 0x18, 0x1 | 0x20 | 0x40] {
            assert!(IrqSet::parse(&IrqSet { flags, ..none.clone() }.to_bytes()).is_err(), "{flags:#x}");
        }
        assert!(IrqSet::parse(&IrqSet { count: 4, ..bools }.to_bytes()).is_err()); // 3 bools for count 4
        assert!(IrqSet::parse(&IrqSet { start: u32::MAX, count: 1, ..efd }.to_bytes()).is_err());
    }

    #[test]
    fn region_write_one_byte_bytes() {
        let m = message(7, Command::RegionWrite, 0, &RegionAccess::to_bytes_with_data(0x10, 2, &[0xab]));
        let want = le(&[
            (7, 2),    // msg_id
            (10, 2),   // cmd: REGION_WRITE
            (33, 4),   // msg_size: 16 + 16 + 1
            (0, 4),    // flags: command
            (0, 4),    // error
            (0x10, 8), // offset
            (2, 4),    // region
            (1, 4),    // count
            (0xab, 1), // data
        ]);
        assert_eq!(m, want);
        let (h, p) = parse_message(&m).unwrap();
        assert_eq!(h.command(), Some(Command::RegionWrite));
        let (a, data) = RegionAccess::parse_with_data(p).unwrap();
        assert_eq!((a, data), (RegionAccess { offset: 0x10, region: 2, count: 1 }, &[0xab][..]));
        prefixes_fail(p, |b| RegionAccess::parse_with_data(b).is_ok(), &[]);
        assert!(RegionAccess::parse_with_data(&[p, &[0]].concat()).is_err());
        check(&a, &a.to_bytes(), RegionAccess::parse); // the reply
    }

    #[test]
    fn region_read_and_dma_access() {
        let req = RegionAccess { offset: 0x40, region: PCI_CONFIG_REGION_INDEX, count: 4 };
        check(&req, &req.to_bytes(), RegionAccess::parse);
        let rep = RegionAccess::to_bytes_with_data(0x40, 7, &[1, 2, 3, 4]);
        assert_eq!(RegionAccess::parse_with_data(&rep).unwrap(), (req, &[1u8, 2, 3, 4][..]));
        prefixes_fail(&rep, |b| RegionAccess::parse_with_data(b).is_ok(), &[]);
        let d = DmaAccess { address: 0x1000, count: 3 };
        assert_eq!(d.to_bytes(), le(&[(0x1000, 8), (3, 8)]));
        check(&d, &d.to_bytes(), DmaAccess::parse);
        let w = DmaAccess::to_bytes_with_data(0x1000, &[5, 6, 7]);
        assert_eq!(DmaAccess::parse_with_data(&w).unwrap(), (d, &[5u8, 6, 7][..]));
        prefixes_fail(&w, |b| DmaAccess::parse_with_data(b).is_ok(), &[]);
        assert!(DmaAccess::parse_with_data(&[&w[..], &[0]].concat()).is_err());
        let huge = DmaAccess { address: 0, count: u64::MAX }.to_bytes();
        assert!(matches!(DmaAccess::parse_with_data(&huge), Err(WireError::TooLarge { .. })));
    }

    #[test]
    fn write_multi() {
        let writes = vec![WriteOne::new(0x10, 0, &[1, 2, 3, 4]).unwrap(), WriteOne::new(0x18, 2, &[9; 8]).unwrap()];
        let m = RegionWriteMulti { writes };
        let enc = m.to_bytes();
        assert_eq!(enc[..32], le(&[(2, 8), (0x10, 8), (0, 4), (4, 4), (0x04030201, 8)])[..]);
        assert_eq!(enc.len(), 8 + 48);
        check(&m, &enc, RegionWriteMulti::parse);
        assert_eq!(m.writes[0].bytes(), &[1, 2, 3, 4]);
        assert!(WriteOne::new(0, 0, &[0; 9]).is_none());
        assert!(RegionWriteMulti::parse(&set32(&enc, 20, 9)).is_err()); // count 9
        assert!(RegionWriteMulti::parse(&[&u64::MAX.to_le_bytes()[..], &enc[8..]].concat()).is_err());
        let r = RegionWriteMultiReply { wr_cnt: 2 };
        check(&r, &r.to_bytes(), RegionWriteMultiReply::parse);
    }

    #[test]
    fn device_feature() {
        let probe = DeviceFeature { argsz: 8, flags: 1 | DEVICE_FEATURE_PROBE | DEVICE_FEATURE_GET, data: vec![] };
        assert_eq!(DeviceFeature::parse(&probe.to_bytes()).unwrap(), probe);
        prefixes_fail(&probe.to_bytes(), |b| DeviceFeature::parse(b).is_ok(), &[]);
        let get = DeviceFeature { argsz: 16, flags: 1 | DEVICE_FEATURE_GET, data: vec![1, 0, 0, 0, 0, 0, 0, 0] };
        assert_eq!((DeviceFeature::parse(&get.to_bytes()).unwrap(), get.feature()), (get.clone(), 1));
        // Data has no length field of its own: only prefixes shorter than 8 bytes fail.
        prefixes_fail(&get.to_bytes(), |b| DeviceFeature::parse(b).is_ok(), &[8, 9, 10, 11, 12, 13, 14, 15]);
        for flags in [1, 1 | DEVICE_FEATURE_GET | DEVICE_FEATURE_SET, 1 << 20 | DEVICE_FEATURE_GET] {
            assert!(DeviceFeature::parse(&DeviceFeature { flags, ..probe.clone() }.to_bytes()).is_err());
        }
    }

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
