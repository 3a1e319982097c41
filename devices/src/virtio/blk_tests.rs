use super::*;
use crate::nvme::backend::BackendKind;
use crate::virtio::fake::{Driver, DATA, RAM};
use crate::virtio::queue::Desc;
use vm_memory::{Bytes, GuestAddress};

const HDR: u64 = DATA;
const BUF: u64 = DATA + 0x1000;
const ST: u64 = DATA + 0x800;

fn header(d: &Driver, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    d.ram.write_slice(&h, GuestAddress(HDR)).unwrap();
}

fn rd(addr: u64, len: u32) -> Desc {
    Desc { addr, len, write: false }
}
fn wr(addr: u64, len: u32) -> Desc {
    Desc { addr, len, write: true }
}

fn status(d: &Driver) -> u8 {
    d.ram.read_obj(GuestAddress(ST)).unwrap()
}

fn ram_blk() -> Blk {
    Blk::new(crate::nvme::backend::Backend::open(&BackendKind::Ram, 1 << 20).unwrap(), 1 << 20, "iopath-vblk")
}

#[test]
fn write_then_read_back_across_split_buffers() {
    let d = Driver::new(8);
    let mut b = ram_blk();
    let data: Vec<u8> = (0..1024u32).map(|i| (i * 7) as u8).collect();
    d.ram.write_slice(&data, GuestAddress(BUF)).unwrap();
    header(&d, T_OUT, 3);
    // Header split over two buffers, data over two, status on its own.
    let done = b.handle(&d.mem, &[rd(HDR, 8), rd(HDR + 8, 8), rd(BUF, 100), rd(BUF + 100, 924), wr(ST, 1)]);
    assert_eq!(done, Done { written: 1, status: Some(S_OK), kind: T_OUT });
    header(&d, T_IN, 3);
    let out = BUF + 0x1000;
    let done = b.handle(&d.mem, &[rd(HDR, 16), wr(out, 512), wr(out + 512, 512), wr(ST, 1)]);
    assert_eq!(done, Done { written: 1025, status: Some(S_OK), kind: T_IN });
    let mut back = vec![0u8; 1024];
    d.ram.read_slice(&mut back, GuestAddress(out)).unwrap();
    assert_eq!(back, data);
    // The status may share a buffer with the data (its last byte).
    header(&d, T_IN, 3);
    let done = b.handle(&d.mem, &[rd(HDR, 16), wr(out, 513)]);
    assert_eq!(done.status, Some(S_OK));
    assert_eq!(d.ram.read_obj::<u8>(GuestAddress(out + 512)).unwrap(), S_OK);
}

#[test]
fn flush_get_id_and_unknown_types() {
    let d = Driver::new(8);
    let mut b = ram_blk();
    header(&d, T_FLUSH, 0);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(ST, 1)]).status, Some(S_OK));
    header(&d, T_GET_ID, 0);
    let done = b.handle(&d.mem, &[rd(HDR, 16), wr(BUF, 20), wr(ST, 1)]);
    assert_eq!(done, Done { written: 21, status: Some(S_OK), kind: T_GET_ID });
    let mut id = [0u8; 20];
    d.ram.read_slice(&mut id, GuestAddress(BUF)).unwrap();
    assert_eq!(&id[..11], b"iopath-vblk");
    header(&d, 11, 0); // DISCARD: not offered, not served
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(ST, 1)]).status, Some(S_UNSUPP));
    assert_eq!(status(&d), S_UNSUPP);
}

#[test]
fn bad_requests_get_ioerr_or_are_dropped() {
    let d = Driver::new(8);
    let mut b = ram_blk();
    let sectors = (1u64 << 20) / SECTOR;
    for (kind, sector, len) in [
        (T_IN, sectors, 512),                   // past the end
        (T_IN, sectors - 1, 1024),              // runs past the end
        (T_OUT, u64::MAX / 256, 512),           // sector * 512 overflows
        (T_IN, 0, 100),                         // not whole sectors
        (T_IN, 0, (MAX_TRANSFER + 512) as u32), // more than one transfer may hold
    ] {
        header(&d, kind, sector);
        let data = if kind == T_IN { wr(BUF, len) } else { rd(BUF, len) };
        let len_ok = (BUF + len as u64) < RAM;
        let done = if len_ok {
            b.handle(&d.mem, &[rd(HDR, 16), data, wr(ST, 1)])
        } else {
            b.handle(&d.mem, &[rd(HDR, 16), wr(0, len), wr(ST, 1)])
        };
        assert_eq!(done.status, Some(S_IOERR), "{kind} {sector} {len}");
        assert_eq!(done.written, 1);
    }
    // A short header.
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 15), wr(ST, 1)]).status, Some(S_IOERR));
    // No writable byte for the status: dropped, nothing written.
    header(&d, T_FLUSH, 0);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16)]), Done { written: 0, status: None, kind: T_FLUSH });
}

#[test]
fn null_backend_moves_no_data() {
    let d = Driver::new(8);
    let mut b = Blk::new(crate::nvme::backend::Backend::Null, 1 << 30, "x");
    header(&d, T_OUT, 8);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(BUF, 4096), wr(ST, 1)]).status, Some(S_OK));
    header(&d, T_IN, (1 << 30) / SECTOR - 8);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(BUF, 4096), wr(ST, 1)]).status, Some(S_OK));
}
