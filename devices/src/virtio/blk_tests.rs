use super::*;
use crate::block::StorageKind;
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
    Blk::new(crate::block::Storage::open(&StorageKind::Ram, 1 << 20).unwrap(), 1 << 20, "iopath-vblk")
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
    header(&d, 12, 0); // a type nobody defined
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(ST, 1)]).status, Some(S_UNSUPP));
    assert_eq!(status(&d), S_UNSUPP);
}

#[test]
fn bad_requests_get_ioerr_or_are_dropped() {
    let d = Driver::new(8);
    let mut b = ram_blk();
    let sectors = (1u64 << 20) / SECTOR;
    for (kind, sector, len) in [
        (T_IN, sectors, 512),                  // past the end
        (T_IN, sectors - 1, 1024),             // runs past the end
        (T_OUT, u64::MAX / 256, 512),          // sector * 512 overflows
        (T_IN, 0, 100),                        // not whole sectors
        (T_IN, 0, (MAX_REQUEST + 512) as u32), // more than one request may move
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
    let mut b = Blk::new(crate::block::Storage::Null { bytes: 1 << 30 }, 1 << 30, "x");
    header(&d, T_OUT, 8);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(BUF, 4096), wr(ST, 1)]).status, Some(S_OK));
    // The guest's data was not even copied in.
    assert!(b.bounce.is_empty());
    // The range is still checked.
    header(&d, T_OUT, (1 << 30) / SECTOR - 7);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(BUF, 4096), wr(ST, 1)]).status, Some(S_IOERR));
    header(&d, T_IN, (1 << 30) / SECTOR - 8);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(BUF, 4096), wr(ST, 1)]).status, Some(S_OK));
}

fn segment(d: &Driver, at: u64, sector: u64, n: u32, flags: u32) {
    let mut s = [0u8; 16];
    s[0..8].copy_from_slice(&sector.to_le_bytes());
    s[8..12].copy_from_slice(&n.to_le_bytes());
    s[12..16].copy_from_slice(&flags.to_le_bytes());
    d.ram.write_slice(&s, GuestAddress(at)).unwrap();
}

#[test]
fn write_zeroes_and_discard_zero_the_range_and_check_it() {
    let d = Driver::new(8);
    let mut b = ram_blk();
    b.storage.write(0, &[0xee; 4096]).unwrap();
    let seg = BUF + 0x3000;
    for (kind, flags) in [(T_WRITE_ZEROES, 1), (T_DISCARD, 0)] {
        b.storage.write(512, &[0xee; 1024]).unwrap();
        header(&d, kind, 0);
        segment(&d, seg, 1, 2, flags);
        assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(seg, 16), wr(ST, 1)]).status, Some(S_OK), "{kind}");
        let mut back = [0u8; 4096];
        b.storage.read(0, &mut back).unwrap();
        assert!(back[..512].iter().all(|&x| x == 0xee) && back[512..1536].iter().all(|&x| x == 0), "{kind}");
        assert!(back[1536..].iter().all(|&x| x == 0xee), "{kind}: only the range");
    }
    let sectors = (1u64 << 20) / SECTOR;
    for (kind, sector, n, flags, want) in [
        (T_DISCARD, 0, 1, 1, S_UNSUPP),                    // unmap is not a discard flag
        (T_WRITE_ZEROES, 0, 1, 2, S_UNSUPP),               // unknown flag
        (T_WRITE_ZEROES, sectors - 1, 2, 0, S_IOERR),      // past the end
        (T_WRITE_ZEROES, u64::MAX / 2, 1, 0, S_IOERR),     // overflows
        (T_DISCARD, 0, MAX_RANGE_SECTORS + 1, 0, S_IOERR), // more than advertised
    ] {
        header(&d, kind, 0);
        segment(&d, seg, sector, n, flags);
        assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(seg, 16), wr(ST, 1)]).status, Some(want), "{kind} {sector} {n}");
    }
    // No segment, a partial one, two segments (max 1).
    header(&d, T_DISCARD, 0);
    for segs in [&[][..], &[rd(seg, 8)][..], &[rd(seg, 32)][..]] {
        let chain: Vec<Desc> = [rd(HDR, 16)].iter().chain(segs).chain(&[wr(ST, 1)]).copied().collect();
        assert_eq!(b.handle(&d.mem, &chain).status, Some(S_IOERR), "{segs:?}");
    }
}

#[test]
fn a_file_disk_keeps_data_synchronously() {
    let path = std::env::temp_dir().join(format!("iopath-vblk-{}.img", std::process::id()));
    let storage = crate::backing::open(&StorageKind::File(path.clone()), 1 << 20, true).unwrap();
    let mut b = Blk::new(storage, 1 << 20, "f");
    let d = Driver::new(8);
    d.ram.write_slice(&[0x3c; 512], GuestAddress(BUF)).unwrap();
    header(&d, T_OUT, 2);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(BUF, 512), wr(ST, 1)]).status, Some(S_OK));
    header(&d, T_FLUSH, 0);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(ST, 1)]).status, Some(S_OK));
    let on_disk = std::fs::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(&on_disk[1024..1536], &[0x3c; 512][..]);
    header(&d, T_IN, 2);
    assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(BUF + 0x1000, 512), wr(ST, 1)]).status, Some(S_OK));
    assert_eq!(d.ram.read_obj::<u8>(GuestAddress(BUF + 0x1000)).unwrap(), 0x3c);
}

#[test]
fn a_request_larger_than_the_bounce_buffer_moves_in_pieces() {
    // 3 MiB + 512 B out, then in, on a 4 MiB disk in 8 MiB of guest RAM.
    let ram = vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
    let mem: crate::mem::GuestMem = ram.clone().into();
    let disk = 4u64 << 20;
    let mut b = Blk::new(crate::block::Storage::open(&StorageKind::Ram, disk).unwrap(), disk, "x");
    let n = 3 * MAX_TRANSFER + 512;
    let (src, dst) = (0x10_0000u64, 0x40_0000u64);
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    ram.write_slice(&data, GuestAddress(src)).unwrap();
    header_at(&ram, T_OUT, 2);
    let out = b.handle(&mem, &[rd(HDR, 16), rd(src, n as u32), wr(ST, 1)]);
    assert_eq!(out.status, Some(S_OK));
    header_at(&ram, T_IN, 2);
    let inn = b.handle(&mem, &[rd(HDR, 16), wr(dst, (n / 2) as u32), wr(dst + n / 2, (n - n / 2) as u32), wr(ST, 1)]);
    assert_eq!(inn, Done { written: n as u32 + 1, status: Some(S_OK), kind: T_IN });
    let mut back = vec![0u8; n as usize];
    ram.read_slice(&mut back, GuestAddress(dst)).unwrap();
    assert!(back == data, "the data came back changed");
}

fn header_at(ram: &vm_memory::GuestMemoryMmap<()>, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    ram.write_slice(&h, GuestAddress(HDR)).unwrap();
}

/// On a file disk, DISCARD and WRITE_ZEROES with the UNMAP flag punch holes
/// (the image's allocated bytes drop by the range), WRITE_ZEROES without it
/// keeps the blocks; every range reads as zeros through the device after.
#[test]
fn a_file_disk_gets_holes_where_the_driver_discards_or_unmaps() {
    use std::os::unix::fs::MetadataExt;
    const MIB: u64 = 1 << 20;
    let path = std::env::temp_dir().join(format!("iopath-vblk-holes-{}.img", std::process::id()));
    std::fs::write(&path, vec![0x5au8; 4 * MIB as usize]).unwrap();
    let allocated = || std::fs::metadata(&path).unwrap().blocks() * 512;
    let storage = crate::block::Storage::open(&StorageKind::File(path.clone()), 4 * MIB).unwrap();
    let mut b = Blk::new(storage, 4 * MIB, "f");
    let d = Driver::new(8);
    let seg = BUF + 0x3000;
    let mut sizes = vec![allocated()];
    // 1 MiB each: DISCARD at 1 MiB, WRITE_ZEROES with UNMAP at 2 MiB, without at 3 MiB.
    for (kind, at, flags) in [(T_DISCARD, MIB, 0), (T_WRITE_ZEROES, 2 * MIB, 1), (T_WRITE_ZEROES, 3 * MIB, 0)] {
        header(&d, kind, 0);
        segment(&d, seg, at / SECTOR, (MIB / SECTOR) as u32, flags);
        assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), rd(seg, 16), wr(ST, 1)]).status, Some(S_OK), "{kind} at {at}");
        sizes.push(allocated());
    }
    let _ = std::fs::remove_file(&path);
    eprintln!("allocated: {sizes:?}");
    assert!(sizes[1] <= sizes[0] - MIB, "DISCARD punched no hole: {sizes:?}");
    assert!(sizes[2] <= sizes[1] - MIB, "WRITE_ZEROES with UNMAP punched no hole: {sizes:?}");
    assert_eq!(sizes[3], sizes[2], "WRITE_ZEROES without UNMAP kept the blocks");
    for (sector, want) in [(0, 0x5a), (MIB / SECTOR, 0), (2 * MIB / SECTOR, 0), (3 * MIB / SECTOR, 0)] {
        for at in [sector, sector + MIB / SECTOR - 8] {
            header(&d, T_IN, at);
            assert_eq!(b.handle(&d.mem, &[rd(HDR, 16), wr(BUF, 4096), wr(ST, 1)]).status, Some(S_OK));
            let mut back = [0u8; 4096];
            d.ram.read_slice(&mut back, GuestAddress(BUF)).unwrap();
            assert!(back.iter().all(|&x| x == want), "sector {at}: want {want:#x}");
        }
    }
}
