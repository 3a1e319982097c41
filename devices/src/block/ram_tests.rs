//! `Ram` on its own memory and in a state memory: bounds, deallocation,
//! the map of written pages, the move into state memory and the resume.

use super::Ram;
use crate::state::{place_ram, RamPlace, StateMemory};

#[test]
fn copies_stay_inside_the_namespace() {
    let r = Ram::new(8192).unwrap();
    assert!(r.write(4096, &[7u8; 512]));
    let mut b = [0u8; 512];
    assert!(r.read(4096, &mut b) && b == [7u8; 512]);
    assert!(r.zero(4096, 256) && r.read(4096, &mut b) && b[..256] == [0u8; 256] && b[256..] == [7u8; 256]);
    assert!(!r.write(8192 - 511, &[1u8; 512]), "past the end");
    assert!(!r.read(u64::MAX, &mut b), "offset overflow");
    assert!(!r.zero(1, u64::MAX), "length overflow");
}

/// Pages of the mapping in memory, per mincore(2).
fn resident(r: &Ram) -> Vec<bool> {
    let pages = r.len.div_ceil(4096);
    let mut v = vec![0u8; pages];
    // SAFETY: the mapping is ours, page aligned, `pages` pages long; `v` has a byte per page.
    assert_eq!(unsafe { libc::mincore(r.ptr.cast(), r.len, v.as_mut_ptr()) }, 0);
    v.iter().map(|&b| b & 1 == 1).collect()
}

/// A deallocated range reads as zeros and its whole pages leave memory;
/// the pages it only partly covers keep their other bytes.
#[test]
fn deallocation_gives_whole_pages_back_and_zeroes_the_edges() {
    let r = Ram::new(16 * 4096).unwrap();
    assert!(r.write(0, &[9u8; 16 * 4096]));
    assert!(resident(&r).iter().all(|&p| p), "written: every page in memory");
    assert_eq!(r.written_bytes(), 16 * 4096);
    // From the middle of page 2 to the middle of page 9.
    let (off, len) = (2 * 4096 + 100, 7 * 4096);
    assert!(r.deallocate(off, len));
    let res = resident(&r);
    assert!(res[3..9].iter().all(|&p| !p), "whole pages given back: {res:?}");
    assert!(res[2] && res[9], "the edge pages stay: {res:?}");
    assert_eq!(r.written_bytes(), 10 * 4096, "pages 3..9 no longer written");
    let mut all = vec![0xffu8; 16 * 4096];
    assert!(r.read(0, &mut all));
    let (a, b) = (off as usize, (off + len) as usize);
    assert!(all[..a].iter().all(|&x| x == 9) && all[b..].iter().all(|&x| x == 9), "outside kept");
    assert!(all[a..b].iter().all(|&x| x == 0), "inside reads as zeros");
    // Inside one page: zeroed only; bounds as for every operation.
    assert!(r.deallocate(4096 + 10, 20) && r.read(4096, &mut all[..64]) && all[10..30] == [0u8; 20]);
    assert!(!r.deallocate(16 * 4096 - 10, 11), "past the end");
    assert!(!r.deallocate(u64::MAX - 1, 4), "offset overflow");
    assert!(r.deallocate(16 * 4096, 0), "empty at the end");
    let empty = Ram::new(0).unwrap();
    assert!(empty.is_empty() && empty.deallocate(0, 0) && !empty.write(0, &[1]));
}

/// The host backs a memfd with 4 KiB pages (shmem huge pages off), so
/// that the memory it takes is counted here page by page.
fn small_pages() -> bool {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").unwrap_or_default();
    let small = s.is_empty() || s.contains("[never]") || s.contains("[deny]") || s.contains("[advise]");
    if !small {
        eprintln!("shmem huge pages on ({}): the memory counts are not checked", s.trim());
    }
    small
}

/// A state memory with one ram storage of `len` bytes after 4 KiB of words.
fn state_with(len: u64) -> (StateMemory, RamPlace) {
    let (places, total) = place_ram(4096, &[Some(len)]).unwrap();
    (StateMemory::create(total).unwrap(), places[0].unwrap())
}

/// Data moved into a state memory (only the pages written: what the memfd
/// takes) and resumed by a new `Ram` on the same memfd, in place: what was
/// written reads back, pages never written read as zeros without taking
/// memory, deallocated pages leave the memfd.
#[test]
fn in_state_memory_the_data_outlives_its_ram_and_reads_of_holes_take_no_memory() {
    const LEN: u64 = 64 << 20;
    let old = Ram::new(LEN).unwrap();
    assert!(old.write(5 << 20, &[3u8; 8192]) && old.write(LEN - 512, &[4u8; 512]));
    let (mem, place) = state_with(LEN);
    let before = mem.allocated().unwrap();
    let ram = Ram::in_state(&mem, place, Some(&old)).unwrap();
    drop(old);
    assert!(ram.in_state_memory());
    assert_eq!(ram.written_bytes(), 3 * 4096);
    let small = small_pages();
    let moved = mem.allocated().unwrap() - before;
    assert!(!small || moved == 4 * 4096, "the written pages and the map's one page: {moved}");
    // Reading the whole disk takes nothing more.
    let mut buf = vec![0xeeu8; 1 << 20];
    for mb in 0..64 {
        assert!(ram.read(mb << 20, &mut buf));
        let want = |i: usize| match (mb << 20) + i as u64 {
            o if (5 << 20..(5 << 20) + 8192).contains(&o) => 3,
            o if o >= LEN - 512 => 4,
            _ => 0,
        };
        assert!(buf.iter().enumerate().all(|(i, &b)| b == want(i)), "MiB {mb}");
    }
    assert!(!small || mem.allocated().unwrap() - before == moved, "reads of pages never written allocate none");
    // A write lands in the memfd: a new Ram on another mapping of it sees it (a resume).
    assert!(ram.write(7 << 20, &[5u8; 600]));
    drop(ram);
    let again = StateMemory::from_fd(mem.try_clone_fd().unwrap(), mem.len()).unwrap();
    let ram = Ram::in_state(&again, place, None).unwrap();
    assert_eq!(ram.written_bytes(), 4 * 4096, "counted from the map");
    let mut b = [0u8; 600];
    assert!(ram.read(7 << 20, &mut b) && b == [5u8; 600]);
    assert!(ram.read(5 << 20, &mut b) && b == [3u8; 600]);
    // Deallocation frees the memfd's pages.
    let full = mem.allocated().unwrap();
    assert!(ram.deallocate(5 << 20, 8192));
    assert!(!small || full - mem.allocated().unwrap() == 8192, "two pages back");
    assert!(ram.read(5 << 20, &mut b) && b == [0u8; 600]);
    assert_eq!(ram.written_bytes(), 2 * 4096);
    // Zeroing pages never written takes nothing either.
    let now = mem.allocated().unwrap();
    assert!(ram.zero(20 << 20, 1 << 20));
    assert!(!small || mem.allocated().unwrap() == now);
}

/// A fresh move clears what the memory held before; a move of another
/// size, or a place outside the memory, is refused.
#[test]
fn a_fresh_move_replaces_what_the_memory_held_and_bad_places_are_refused() {
    let (mem, place) = state_with(1 << 20);
    let first = Ram::in_state(&mem, place, None).unwrap();
    assert!(first.write(0, &[1u8; 4096]) && first.write(8192, &[2u8; 100]));
    drop(first);
    let old = Ram::new(1 << 20).unwrap();
    assert!(old.write(4096, &[6u8; 10]));
    let ram = Ram::in_state(&mem, place, Some(&old)).unwrap();
    let mut b = vec![0xeeu8; 3 * 4096];
    assert!(ram.read(0, &mut b));
    assert!(b[..4096].iter().all(|&x| x == 0) && b[8192..].iter().all(|&x| x == 0), "the old data is gone");
    assert!(b[4096..4106] == [6u8; 10] && b[4106..8192].iter().all(|&x| x == 0));
    assert_eq!(ram.written_bytes(), 4096);
    let other = Ram::new(2 << 20).unwrap();
    let e = Ram::in_state(&mem, place, Some(&other)).err().unwrap().to_string();
    assert!(e.contains("moved into"), "{e}");
    let far = RamPlace { at: place.at + 4096, len: place.len };
    let e = Ram::in_state(&mem, far, None).err().unwrap().to_string();
    assert!(e.contains("no ram data"), "{e}");
    let odd = RamPlace { at: place.at + 8, len: 4096 };
    assert!(Ram::in_state(&mem, odd, None).is_err(), "not page aligned");
}

/// A map a client filled with ones (bits past the data's pages too): the
/// count stops at the data's pages, every read stays inside.
#[test]
fn a_map_of_any_bits_is_read_as_it_is() {
    let len = 5 * 4096 + 512;
    let (mem, place) = state_with(len);
    let w = mem.words();
    for word in &w[place.map_at() / 8..place.end() / 8] {
        word.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
    let ram = Ram::in_state(&mem, place, None).unwrap();
    assert_eq!(ram.written_bytes(), 6 * 4096);
    let mut b = vec![1u8; len as usize];
    assert!(ram.read(0, &mut b) && b.iter().all(|&x| x == 0));
}

#[test]
fn ram_places_are_aligned_apart_and_bounded() {
    let (p, total) = place_ram(100, &[Some(1 << 20), None, Some(3 << 20)]).unwrap();
    let (a, c) = (p[0].unwrap(), p[2].unwrap());
    assert_eq!(p[1], None);
    assert_eq!((a.at, a.len), (2 << 20, 1 << 20));
    assert_eq!(a.map_at(), 3 << 20);
    assert_eq!(a.map_len(), 256 / 8);
    assert_eq!(c.at, 4 << 20, "the next multiple of 2 MiB after the first's map");
    assert_eq!(total, c.end());
    assert_eq!(place_ram(64, &[None]).unwrap().1, 64, "no ram: the words alone");
    let e = place_ram(64, &[Some(1 << 40)]).unwrap_err().to_string();
    assert!(e.contains("do not fit"), "{e}");
    assert!(place_ram(64, &[Some(u64::MAX)]).is_err());
}
