//! virtio-blk requests (virtio 1.2, 5.2.6) on the block layer's storage
//! ([`Storage`]: null, ram or file), which NVMe shares.
//!
//! A request is a chain: a 16-byte header (type, reserved, sector) in
//! readable buffers, data (readable for OUT, writable for IN and GET_ID),
//! and a status byte, the last writable byte. Everything is checked: a
//! request with no room for the status is dropped (used length 0), a bad
//! header, length or range gets VIRTIO_BLK_S_IOERR, an unknown type
//! VIRTIO_BLK_S_UNSUPP.

use super::queue::Desc;
use crate::block::Storage;
use crate::mem::GuestMem;

pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;
/// Segments per DISCARD or WRITE_ZEROES request (max_discard_seg, max_write_zeroes_seg).
pub const MAX_RANGE_SEGS: u32 = 1;
/// Sectors per DISCARD or WRITE_ZEROES segment (max_discard_sectors,
/// max_write_zeroes_sectors): bounds the time one request takes.
pub const MAX_RANGE_SECTORS: u32 = 1 << 16;
/// The segment flag of WRITE_ZEROES that allows deallocation.
const SEG_F_UNMAP: u32 = 1;
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;
/// Sector size of the protocol (capacity and `sector` count these).
pub const SECTOR: u64 = 512;
/// Largest data transfer of one request; more is S_IOERR. Bounds the
/// bounce buffer a guest can make the device allocate.
pub const MAX_TRANSFER: u64 = 1 << 20;

/// Most data one IN or OUT request moves: served in pieces of
/// [`MAX_TRANSFER`] through the bounce buffer. The device offers no
/// VIRTIO_BLK_F_SIZE_MAX, and Linux builds requests of up to its
/// max_sectors_kb (1280 KiB by default, more if raised), so a request larger
/// than the bounce buffer must work; this bounds the time one request takes.
pub const MAX_REQUEST: u64 = 32 << 20;
/// Length of the GET_ID answer.
pub const ID_LEN: usize = 20;

/// What a request did, for the used ring and the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// Bytes written into the chain's writable buffers (the used length).
    pub written: u32,
    /// The status byte written, or None if the chain had no room for it.
    pub status: Option<u8>,
    pub kind: u32,
}

/// A view of a chain's readable or writable buffers as one byte range.
pub(super) struct Part<'a> {
    descs: Vec<&'a Desc>,
    pub(super) len: u64,
}

impl<'a> Part<'a> {
    pub(super) fn new(descs: impl Iterator<Item = &'a Desc>) -> Self {
        let descs: Vec<&Desc> = descs.collect();
        let len = descs.iter().map(|d| d.len as u64).sum();
        Part { descs, len }
    }

    /// Calls `f(gpa, offset in the range, n)` for each piece of `[off, off + len)`.
    fn each(&self, off: u64, len: u64, mut f: impl FnMut(u64, usize, usize) -> bool) -> bool {
        let (mut skip, mut left, mut done) = (off, len, 0usize);
        for d in &self.descs {
            if left == 0 {
                break;
            }
            let dl = d.len as u64;
            if skip >= dl {
                skip -= dl;
                continue;
            }
            let n = (dl - skip).min(left);
            if !f(d.addr + skip, done, n as usize) {
                return false;
            }
            (skip, left, done) = (0, left - n, done + n as usize);
        }
        left == 0
    }

    pub(super) fn read(&self, mem: &GuestMem, off: u64, buf: &mut [u8]) -> bool {
        self.each(off, buf.len() as u64, |gpa, o, n| mem.read_slice(&mut buf[o..o + n], gpa).is_ok())
    }

    pub(super) fn write(&self, mem: &GuestMem, off: u64, data: &[u8]) -> bool {
        self.each(off, data.len() as u64, |gpa, o, n| mem.write_slice(&data[o..o + n], gpa).is_ok())
    }
}

/// An IN, OUT or FLUSH request as one file transfer ([`Blk::plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Transfer {
    /// T_IN, T_OUT or T_FLUSH.
    pub(super) kind: u32,
    /// Byte offset on the disk and length (0 for FLUSH).
    pub(super) off: u64,
    pub(super) len: u64,
}

/// The block device's request engine: its storage and capacity.
pub struct Blk {
    pub storage: Storage,
    /// Capacity in bytes (a multiple of [`SECTOR`]).
    pub size: u64,
    /// The GET_ID answer (NUL-padded).
    pub id: [u8; ID_LEN],
    bounce: Vec<u8>,
}

impl Blk {
    pub fn new(storage: Storage, size: u64, id: &str) -> Self {
        let mut b = [0u8; ID_LEN];
        let n = id.len().min(ID_LEN);
        b[..n].copy_from_slice(&id.as_bytes()[..n]);
        Blk { storage, size, id: b, bounce: Vec::new() }
    }

    /// Serves one request chain (already range-checked by the queue).
    pub fn handle(&mut self, mem: &GuestMem, descs: &[Desc]) -> Done {
        let r = Part::new(descs.iter().filter(|d| !d.write));
        let w = Part::new(descs.iter().filter(|d| d.write));
        let mut hdr = [0u8; 16];
        let kind = if r.len >= 16 && r.read(mem, 0, &mut hdr) {
            u32::from_le_bytes(hdr[0..4].try_into().unwrap())
        } else {
            u32::MAX
        };
        if w.len == 0 {
            return Done { written: 0, status: None, kind };
        }
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
        let data_in = w.len - 1; // writable bytes before the status
        let data_out = r.len.saturating_sub(16);
        let (status, written) = match kind {
            u32::MAX => (S_IOERR, 0),
            T_IN => match self.range(sector, data_in) {
                Some(off) => {
                    // A null disk transfers no data, as the NVMe null namespace.
                    let null = matches!(self.storage, Storage::Null { .. });
                    let (mut done, mut ok) = (0u64, true);
                    while ok && done < data_in {
                        let n = (data_in - done).min(MAX_TRANSFER);
                        let buf = bounce(&mut self.bounce, n as usize);
                        ok = self.storage.read(off + done, buf).is_ok() && (null || w.write(mem, done, buf));
                        done += n;
                    }
                    if ok {
                        (S_OK, data_in)
                    } else {
                        (S_IOERR, 0)
                    }
                }
                None => (S_IOERR, 0),
            },
            // A null disk keeps no data: nothing is read from the guest (the queue
            // has range-checked the buffers), as the NVMe null namespace.
            T_OUT if matches!(self.storage, Storage::Null { .. }) => match self.range(sector, data_out) {
                Some(_) => (S_OK, 0),
                None => (S_IOERR, 0),
            },
            T_OUT => match self.range(sector, data_out) {
                Some(off) => {
                    let (mut done, mut ok) = (0u64, true);
                    while ok && done < data_out {
                        let n = (data_out - done).min(MAX_TRANSFER);
                        let buf = bounce(&mut self.bounce, n as usize);
                        ok = r.read(mem, 16 + done, buf) && self.storage.write(off + done, buf).is_ok();
                        done += n;
                    }
                    (if ok { S_OK } else { S_IOERR }, 0)
                }
                None => (S_IOERR, 0),
            },
            T_FLUSH => (if self.storage.flush().is_ok() { S_OK } else { S_IOERR }, 0),
            T_DISCARD | T_WRITE_ZEROES => (self.zero_ranges(mem, &r, data_out, kind), 0),
            T_GET_ID => {
                let n = data_in.min(ID_LEN as u64) as usize;
                if w.write(mem, 0, &self.id[..n]) {
                    (S_OK, n as u64)
                } else {
                    (S_IOERR, 0)
                }
            }
            _ => (S_UNSUPP, 0),
        };
        if !w.write(mem, w.len - 1, &[status]) {
            return Done { written: 0, status: None, kind };
        }
        Done { written: (written + 1) as u32, status: Some(status), kind }
    }

    /// The transfer a chain asks for, if it is one the file disk's io_uring
    /// can serve as [`handle`](Self::handle) would: an IN or OUT of one
    /// sector or more inside the disk, or a FLUSH, each with room for the
    /// status. None: anything else (GET_ID, DISCARD, an error, ...), which
    /// [`handle`](Self::handle) serves.
    pub(super) fn plan(&self, mem: &GuestMem, descs: &[Desc]) -> Option<Transfer> {
        let r = Part::new(descs.iter().filter(|d| !d.write));
        let w = Part::new(descs.iter().filter(|d| d.write));
        let mut hdr = [0u8; 16];
        if r.len < 16 || w.len == 0 || !r.read(mem, 0, &mut hdr) {
            return None;
        }
        let kind = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
        let sector = u64::from_le_bytes(hdr[8..16].try_into().unwrap());
        let len = match kind {
            T_IN => w.len - 1,
            T_OUT => r.len - 16,
            T_FLUSH => return Some(Transfer { kind, off: 0, len: 0 }),
            _ => return None,
        };
        let off = self.range(sector, len).filter(|_| len > 0)?;
        Some(Transfer { kind, off, len })
    }

    /// DISCARD and WRITE_ZEROES (5.2.6.2): segments of {sector, num_sectors,
    /// flags} after the header, every one checked before any is done.
    /// DISCARD and WRITE_ZEROES with VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
    /// deallocate (a file's blocks become a hole, a ram disk's pages are
    /// freed); WRITE_ZEROES without it keeps the blocks. Either range reads
    /// as zeros after (null keeps nothing anyway).
    fn zero_ranges(&mut self, mem: &GuestMem, r: &Part<'_>, len: u64, kind: u32) -> u8 {
        if len == 0 || !len.is_multiple_of(16) || len / 16 > MAX_RANGE_SEGS as u64 {
            return S_IOERR;
        }
        let mut segs = Vec::new();
        for k in 0..len / 16 {
            let mut b = [0u8; 16];
            if !r.read(mem, 16 + 16 * k, &mut b) {
                return S_IOERR;
            }
            let sector = u64::from_le_bytes(b[0..8].try_into().unwrap());
            let n = u32::from_le_bytes(b[8..12].try_into().unwrap());
            let flags = u32::from_le_bytes(b[12..16].try_into().unwrap());
            let known = if kind == T_WRITE_ZEROES { SEG_F_UNMAP } else { 0 };
            if flags & !known != 0 {
                return S_UNSUPP;
            }
            if n > MAX_RANGE_SECTORS {
                return S_IOERR;
            }
            let Some(off) =
                sector.checked_mul(SECTOR).filter(|o| o.checked_add(n as u64 * SECTOR).is_some_and(|e| e <= self.size))
            else {
                return S_IOERR;
            };
            // DISCARD deallocates; WRITE_ZEROES does where its UNMAP flag allows.
            let deallocate = kind == T_DISCARD || flags & SEG_F_UNMAP != 0;
            segs.push((off, n as u64 * SECTOR, deallocate));
        }
        for (off, bytes, deallocate) in segs {
            if let Err(e) = self.storage.write_zeroes(off, bytes, deallocate) {
                log::warn!("virtio-blk: {}: {e}", if kind == T_DISCARD { "discard" } else { "write zeroes" });
                return S_IOERR;
            }
        }
        S_OK
    }

    /// The byte offset of a transfer of `len` bytes at `sector`, if it is a
    /// whole number of sectors, at most [`MAX_REQUEST`], and inside the disk.
    fn range(&self, sector: u64, len: u64) -> Option<u64> {
        if !len.is_multiple_of(SECTOR) || len > MAX_REQUEST {
            return None;
        }
        let off = sector.checked_mul(SECTOR)?;
        (off.checked_add(len)? <= self.size).then_some(off)
    }
}

/// Ends a request served in pieces: its status byte written as the last
/// writable byte (S_OK if `ok`, else S_IOERR), and what [`Blk::handle`]
/// would have answered: the used length counts an IN's data (when `ok`)
/// and the status; 0 if the status could not be written.
pub(super) fn finish(mem: &GuestMem, descs: &[Desc], kind: u32, ok: bool) -> Done {
    let w = Part::new(descs.iter().filter(|d| d.write));
    let status = if ok { S_OK } else { S_IOERR };
    let data = if ok && kind == T_IN { w.len.saturating_sub(1) } else { 0 };
    if w.len == 0 || !w.write(mem, w.len - 1, &[status]) {
        return Done { written: 0, status: None, kind };
    }
    Done { written: (data + 1) as u32, status: Some(status), kind }
}

/// Ends a request that was not carried out (an injected status): `status`
/// as its last writable byte, used length 1; 0 if it has no room for it.
pub(super) fn status_only(mem: &GuestMem, descs: &[Desc], kind: u32, status: u8) -> Done {
    let w = Part::new(descs.iter().filter(|d| d.write));
    if w.len == 0 || !w.write(mem, w.len - 1, &[status]) {
        return Done { written: 0, status: None, kind };
    }
    Done { written: 1, status: Some(status), kind }
}

/// Where num_queues sits in the configuration space (after the
/// geometry, blk_size, topology and writeback fields; 5.2.4).
pub const NUM_QUEUES_AT: usize = 34;
/// Length of the virtio-blk configuration space [`config_space`] builds.
pub const CONFIG_LEN: usize = 0x40;

/// The virtio-blk device configuration (5.2.4) of a disk of `size` bytes
/// with `num_queues` request queues, as the device offers it with
/// [`FEATURES`](super::pci::FEATURES): capacity, seg_max, blk_size,
/// num_queues (MQ), and the DISCARD and WRITE_ZEROES limits. Every host of
/// the device serves these bytes (a vhost-user backend in GET_CONFIG).
pub fn config_space(size: u64, num_queues: u16) -> [u8; CONFIG_LEN] {
    let mut r = [0u8; CONFIG_LEN];
    r[0..8].copy_from_slice(&(size / SECTOR).to_le_bytes());
    r[12..16].copy_from_slice(&super::pci::SEG_MAX.to_le_bytes());
    r[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
    r[NUM_QUEUES_AT..NUM_QUEUES_AT + 2].copy_from_slice(&num_queues.to_le_bytes());
    // max_discard_sectors, max_discard_seg, discard_sector_alignment,
    // max_write_zeroes_sectors, max_write_zeroes_seg; write_zeroes_may_unmap.
    for (at, v) in
        [(36, MAX_RANGE_SECTORS), (40, MAX_RANGE_SEGS), (44, 1), (48, MAX_RANGE_SECTORS), (52, MAX_RANGE_SEGS)]
    {
        r[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    r[56] = 1;
    r
}

/// The first `len` bytes of the bounce buffer, grown to fit (len <= MAX_TRANSFER).
fn bounce(b: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if b.len() < len {
        b.resize(len, 0);
    }
    &mut b[..len]
}

#[cfg(test)]
#[path = "blk_tests.rs"]
mod tests;
