//! Dataset Management's deallocate and Write Zeroes (with and without
//! DEAC) as a driver sees them: the blocks read as zeros after (DLFEAT
//! 001b, and bit 3: Write Zeroes may deallocate), their neighbours keep
//! their data, a file namespace's image gets holes where blocks were
//! deallocated and keeps them where they were only zeroed, and a range
//! list with one range outside fails before any range is touched.

use super::*;

const MIB: usize = 1 << 20;
/// The pattern every block holds before the commands.
const FULL: u8 = 0x5a;

/// Dataset Management with Attribute Deallocate over `ranges` (slba, nlb).
fn deallocate(d: &mut Drv, ranges: &[(u64, u32)]) -> u16 {
    let mut list = vec![0u8; ranges.len() * 16];
    for (r, &(slba, n)) in list.chunks_mut(16).zip(ranges) {
        r[4..8].copy_from_slice(&n.to_le_bytes());
        r[8..16].copy_from_slice(&slba.to_le_bytes());
    }
    d.mem.write_slice(&list, GuestAddress(DATA)).unwrap();
    // CDW10: NR (0-based); CDW11: AD.
    d.io(0x09, (ranges.len() as u64 - 1) | 4 << 32, 0, DATA, 0, 16)
}

/// Write Zeroes of `n` blocks at `slba`, with DEAC if `deac`.
fn write_zeroes(d: &mut Drv, slba: u64, n: u32, deac: bool) -> u16 {
    d.io(0x08, slba, (n - 1) | (deac as u32) << 25, 0, 0, 16)
}

/// Every block of the 1 MiB namespace, read through the controller 8 KiB at a time.
fn read_all(d: &mut Drv) -> Vec<u8> {
    let mut all = vec![0u8; MIB];
    for (i, chunk) in all.chunks_mut(8192).enumerate() {
        d.mem.write_slice(&[0xeeu8; 8192], GuestAddress(DATA)).unwrap();
        assert_eq!(d.io(0x02, i as u64 * 16, 15, DATA, DATA + 4096, 16), 0, "read at {}", i * 16);
        d.mem.read_slice(chunk, GuestAddress(DATA)).unwrap();
    }
    all
}

/// The bytes of `p` on disk.
fn allocated(p: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).unwrap().blocks() * 512
}

/// Runs the commands on `d` (its I/O queue pair made), whose namespace
/// holds FULL everywhere; `image` is the file behind it, if any: its
/// allocated bytes after each step are checked.
fn commands(mut d: Drv, image: Option<&std::path::Path>) {
    let blocks = |p: Option<&std::path::Path>| p.map(allocated);
    let (_, ns) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!(ns[33], 0b1001, "DLFEAT: deallocated blocks read as zeros, Write Zeroes may deallocate");
    let full = blocks(image);
    // LBA 256..512 and 1024..1152 (128 KiB and 64 KiB, whole file system blocks).
    assert_eq!(deallocate(&mut d, &[(256, 256), (1024, 128)]), 0);
    let after_dsm = blocks(image);
    // One range outside: LBA Out of Range, and the range inside is left as it was.
    assert_eq!(deallocate(&mut d, &[(0, 8), (2040, 16)]), status::LBA_OUT_OF_RANGE);
    assert_eq!(write_zeroes(&mut d, 2040, 16, true), status::LBA_OUT_OF_RANGE);
    // Attributes without AD: hints only.
    d.mem.write_slice(&[0u8; 16], GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x09, 0, 0, DATA, 0, 16), 0);
    // Write Zeroes with DEAC over LBA 1536..1792, without over 1792..1920.
    assert_eq!(write_zeroes(&mut d, 1536, 256, true), 0);
    let after_deac = blocks(image);
    assert_eq!(write_zeroes(&mut d, 1792, 128, false), 0);
    let after_zeroes = blocks(image);
    let all = read_all(&mut d);
    let zeroed = |lba: usize| (256..512).contains(&lba) || (1024..1152).contains(&lba) || (1536..1920).contains(&lba);
    for lba in 0..2048 {
        let want = if zeroed(lba) { 0 } else { FULL };
        let block = &all[lba * 512..(lba + 1) * 512];
        assert!(block.iter().all(|&b| b == want), "LBA {lba}: want {want:#x}, got {:?}", &block[..8]);
    }
    if let (Some(full), Some(a), Some(b), Some(c)) = (full, after_dsm, after_deac, after_zeroes) {
        eprintln!("allocated: {full} full, {a} after DSM, {b} after Write Zeroes DEAC, {c} after Write Zeroes");
        assert!(a <= full - 192 * 1024, "DSM deallocate punched no holes: {full} -> {a}");
        assert!(b <= a - 128 * 1024, "Write Zeroes with DEAC punched no hole: {a} -> {b}");
        assert_eq!(c, b, "Write Zeroes without DEAC kept the blocks");
    }
    assert_eq!(counter(&d.n, "errors"), 2, "the two commands with a range outside, and no other");
}

#[test]
fn deallocated_blocks_read_as_zeros_and_a_file_namespace_gets_holes() {
    // The file's reads go through its io_uring (reaped at once in mmio mode).
    let img = TempImage::new("deallocate");
    std::fs::write(&img.0, vec![FULL; MIB]).unwrap();
    let mut d = Drv::new(img.cfg(DoorbellMode::Mmio));
    d.io_queues(16);
    commands(d, Some(&img.0));
    let mut d = Drv::new(mmio(StorageKind::Ram));
    d.io_queues(16);
    for i in 0..MIB / 8192 {
        d.mem.write_slice(&[FULL; 8192], GuestAddress(DATA)).unwrap();
        assert_eq!(d.io(0x01, i as u64 * 16, 15, DATA, DATA + 4096, 16), 0);
    }
    commands(d, None);
}
