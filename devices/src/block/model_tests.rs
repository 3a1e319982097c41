//! Each kind of storage against a reference model (a `Vec<u8>` image, all
//! zeros at first): random sequences of read, write, flush, discard and
//! write zeroes (with and without deallocation) at random offsets and
//! lengths, in range, across the end, far past it and overflowing. An
//! operation inside succeeds and does what the model does; one outside is
//! an `OutOfRange` error that changes nothing. Reads match the model (a
//! null storage's leave the buffer as it was); at the end the whole storage
//! (and a file's bytes on disk) match it. A file's sequences also push
//! reads and writes through its io_uring, between the synchronous
//! operations, as NVMe's front end does; discards then punch holes next to
//! O_DIRECT transfers.

use super::*;

/// A fixed sequence per seed.
use crate::rng::SplitMix64 as Rng;

/// Not a multiple of a page: the ends of ram's page-wise deallocation and
/// of a file's last block are reached.
const SIZE: u64 = (1 << 20) + 3 * 512;
/// The longest range an operation takes (more than a slot, a few pages).
const MAX_LEN: u64 = 3 * 65536 + 512;

/// A range: mostly inside (some up to the very end), some across the end,
/// far past it, overflowing, or empty at the very end; half of them sector
/// aligned.
fn range(rng: &mut Rng) -> (u64, u64) {
    let (mut off, mut len) = match rng.below(20) {
        0..=13 => {
            let off = rng.below(SIZE);
            (off, rng.below((SIZE - off).min(MAX_LEN) + 1))
        }
        14 => (SIZE - rng.below(4096), 4097 + rng.below(8192)),
        15 => {
            let n = 1 + rng.below(MAX_LEN);
            (SIZE - n, n)
        }
        16 => (SIZE + rng.below(1 << 20), rng.below(4096)),
        17 => (u64::MAX - rng.below(4096), 8192),
        18 => (SIZE, 0),
        _ => (rng.below(SIZE), u64::MAX - rng.below(1 << 20)),
    };
    if rng.below(2) == 0 {
        (off, len) = (off & !511, len & !511);
    }
    (off, len)
}

fn inside(off: u64, len: u64) -> bool {
    off.checked_add(len).is_some_and(|e| e <= SIZE)
}

/// Checks `r`, the result of an operation on `len` bytes at `off`: Ok
/// inside, OutOfRange outside.
fn expect(r: std::result::Result<(), StorageError>, off: u64, len: u64, what: &str) {
    match r {
        Ok(()) => assert!(inside(off, len), "{what} {len} at {off}: accepted outside"),
        Err(StorageError::OutOfRange { off: o, len: l, size }) => {
            assert!(!inside(off, len), "{what} {len} at {off}: refused inside");
            assert_eq!((o, l, size), (off, len, SIZE), "{what}: the error names the range");
        }
        Err(e) => panic!("{what} {len} at {off}: {e}"),
    }
}

/// Pushes a write and a read of random aligned ranges through a file's
/// io_uring (and one past the end, refused), reaps them, and checks the
/// read against the model. Nothing if the file has no O_DIRECT ring.
fn through_the_ring(f: &mut FileStorage, rng: &mut Rng, model: &mut [u8]) {
    if !f.is_async() {
        return;
    }
    let align = f.uring.as_ref().map_or(4096, |u| u.dio_align.1.max(u.dio_align.0)) as u64;
    let blocks = SIZE / align;
    let n = 1 + rng.below((MAX_IO as u64 / align).min(blocks));
    let (w, r) = (align * rng.below(blocks - n + 1), align * rng.below(blocks - n + 1));
    let len = (n * align) as usize;
    let sw = f.take_slot().unwrap();
    let fill = rng.next_u64() as u8;
    f.buffer(sw, len).fill(fill);
    assert!(f.push(sw, FileOp::Write { dsync: rng.below(4) == 0 }, w, len));
    f.submit();
    reap_one(f, sw);
    model[w as usize..w as usize + len].fill(fill);
    let sr = f.take_slot().unwrap();
    f.buffer(sr, len).fill(!fill);
    assert!(f.push(sr, FileOp::Read, r, len));
    f.submit();
    reap_one(f, sr);
    assert!(f.buffer(sr, len) == &model[r as usize..r as usize + len], "ring read {len} at {r}");
    // Past the end: refused before the ring, the slot still the caller's.
    let s = f.take_slot().unwrap();
    assert!(!f.push(s, FileOp::Read, SIZE - (SIZE % align), len + align as usize));
    f.release(s);
    assert_eq!(f.in_flight(), 0);
}

/// Waits for slot `slot`'s operation (the only one in flight), which must succeed.
fn reap_one(f: &mut FileStorage, slot: u16) {
    loop {
        match f.reap() {
            Some((s, r)) => {
                assert_eq!(s, slot);
                r.unwrap();
                f.release(s);
                return;
            }
            None => assert!(f.wait(), "an operation is in flight"),
        }
    }
}

/// `ops` random operations on `s` (opened on `SIZE` bytes) against the
/// model; returns the model.
fn run(s: &mut Storage, seed: u64, ops: usize) -> Vec<u8> {
    let null = matches!(s, Storage::Null { .. });
    let mut rng = Rng(seed);
    let mut model = vec![0u8; SIZE as usize];
    for i in 0..ops {
        let (off, len) = range(&mut rng);
        let what = format!("seed {seed} op {i}");
        match rng.below(8) {
            0 | 1 => {
                // A buffer that fits; one past the end is only described, never allocated.
                let n = if inside(off, len) { len } else { len.min(MAX_LEN) };
                let canary = rng.next_u64() as u8;
                let mut buf = vec![canary; n as usize];
                let r = s.read(off, &mut buf);
                expect(r, off, n, &format!("{what}: read"));
                if inside(off, n) && !null {
                    assert!(buf == model[off as usize..(off + n) as usize], "{what}: read {n} at {off}");
                } else {
                    assert!(buf.iter().all(|&b| b == canary), "{what}: a refused or null read left the buffer");
                }
            }
            2 | 3 => {
                let n = if inside(off, len) { len } else { len.min(MAX_LEN) };
                let data: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                expect(s.write(off, &data), off, n, &format!("{what}: write"));
                if inside(off, n) {
                    model[off as usize..(off + n) as usize].copy_from_slice(&data);
                }
            }
            4 => s.flush().unwrap(),
            k => {
                let r = match k {
                    5 => s.discard(off, len),
                    6 => s.write_zeroes(off, len, true),
                    _ => s.write_zeroes(off, len, false),
                };
                expect(r, off, len, &format!("{what}: zeroes {k}"));
                if inside(off, len) {
                    model[off as usize..(off + len) as usize].fill(0);
                }
            }
        }
        if let Storage::File(f) = s {
            if rng.below(4) == 0 {
                through_the_ring(f, &mut rng, &mut model);
            }
        }
    }
    model
}

/// The whole storage read back equals `model` (null: reads nothing).
fn matches_model(s: &mut Storage, model: &[u8], what: &str) {
    let mut all = vec![0x77u8; SIZE as usize];
    s.read(0, &mut all).unwrap();
    if matches!(s, Storage::Null { .. }) {
        assert!(all.iter().all(|&b| b == 0x77), "{what}: null moved data");
    } else {
        let first = all.iter().zip(model).position(|(a, b)| a != b);
        assert_eq!(first, None, "{what}: the first byte that differs from the model");
    }
}

#[test]
fn null_and_ram_follow_the_model_through_random_operations() {
    for kind in [StorageKind::Null, StorageKind::Ram] {
        for seed in 1..=6 {
            let mut s = Storage::open(&kind, SIZE).unwrap();
            let model = run(&mut s, seed, 400);
            matches_model(&mut s, &model, &format!("{kind} seed {seed}"));
        }
    }
}

#[test]
fn a_file_follows_the_model_through_random_operations_and_its_ring() {
    for seed in 1..=4 {
        let path = std::env::temp_dir().join(format!("iopath-block-model-{}-{seed}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut s = crate::backing::open(&StorageKind::File(path.clone()), SIZE, true).unwrap();
        let Storage::File(f) = &s else { unreachable!() };
        assert!(f.is_async(), "no O_DIRECT io_uring on {}: the ring's half is not tested", path.display());
        let model = run(&mut s, seed, 300);
        matches_model(&mut s, &model, &format!("file seed {seed}"));
        s.flush().unwrap();
        let disk = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(disk.len() as u64, SIZE, "the file keeps its size (KEEP_SIZE)");
        assert!(disk == model, "seed {seed}: the file on disk differs from the model");
    }
}

#[test]
fn the_ranges_cover_every_kind_of_bound() {
    // The generator reaches each case the model tests rely on.
    let mut rng = Rng(1);
    let rs: Vec<_> = (0..2000).map(|_| range(&mut rng)).collect();
    assert!(rs.iter().any(|&(o, l)| inside(o, l) && o + l == SIZE && l > 0), "up to the end");
    assert!(rs.iter().any(|&(o, l)| o < SIZE && !inside(o, l) && o.checked_add(l).is_some()), "across the end");
    assert!(rs.iter().any(|&(o, _)| o > SIZE && o < u64::MAX / 2), "past the end");
    assert!(rs.iter().any(|&(o, l)| o.checked_add(l).is_none()), "overflowing");
    assert!(rs.iter().any(|&(o, l)| o == SIZE && l == 0), "empty at the end");
    assert!(rs.iter().any(|&(o, l)| inside(o, l) && (o % 512 != 0 || l % 512 != 0)), "unaligned");
}
