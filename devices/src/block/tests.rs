//! Tests of the storage layer: each kind keeps (or drops) data, and a
//! file namespace's ring does its operations and nothing else.

use super::uring::{Arena, SLOT_BYTES, SUBMIT_BYTES};
use super::*;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// A scratch image under the temp directory, named by this process and a
/// counter (tests run in parallel), removed on drop: also when a test fails.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("iopath-block-{what}-{}-{n}.img", std::process::id()));
        let _ = std::fs::remove_file(&path); // ours: a run of this pid left it
        Scratch(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn kind(&self) -> StorageKind {
        StorageKind::File(self.0.clone())
    }

    /// Laid out at `bytes` (create=on) and opened as a file namespace.
    fn open(&self, bytes: u64) -> FileStorage {
        crate::backing::prepare(&self.kind(), bytes, true).unwrap();
        FileStorage::open(&self.0, bytes, true).unwrap()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `direct=off` opens the ring's fd without O_DIRECT (the default with
/// it), and what is written through it reads back, also with the
/// buffered fd, at offsets and lengths O_DIRECT would refuse.
#[test]
fn a_buffered_ring_has_no_o_direct_and_keeps_unaligned_data() {
    let file = Scratch::new("buffered");
    crate::backing::prepare(&file.kind(), 1 << 20, true).unwrap();
    for direct in [true, false] {
        let mut f = FileStorage::open(file.path(), 1 << 20, direct).unwrap();
        let flags = f.ring_fd_flags().expect("io_uring here");
        assert_eq!(flags & libc::O_DIRECT != 0, direct, "{flags:#o}");
        assert_eq!(f.dio_align().unwrap() == (1, 1), !direct);
        if direct {
            continue;
        }
        let slot = f.take_slot().unwrap();
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        f.buffer(slot, 1000).copy_from_slice(&data);
        assert!(f.push(slot, FileOp::Write { dsync: false }, 513, 1000));
        f.submit();
        let (s, r) = wait_one(&mut f);
        assert_eq!(s, slot);
        r.unwrap();
        let mut back = vec![0u8; 1000];
        f.read_at(513, &mut back).unwrap();
        assert_eq!(back, data, "the buffered fd sees what the ring wrote");
        assert!(f.push(slot, FileOp::Read, 513, 1000));
        f.buffer(slot, 1000).fill(0);
        f.submit();
        let (_, r) = wait_one(&mut f);
        r.unwrap();
        assert_eq!(f.buffer(slot, 1000), &data[..]);
        assert_eq!(f.direct_ops, 2, "both went through the ring, not the EINVAL fallback");
        f.release(slot);
    }
}

/// Reaps one completion, waiting for it.
fn wait_one(f: &mut FileStorage) -> (u16, std::io::Result<()>) {
    loop {
        if let Some(c) = f.reap() {
            return c;
        }
        assert!(f.wait(), "nothing in flight to wait for");
    }
}

#[test]
fn ram_and_file_keep_data_null_keeps_none() {
    let file = Scratch::new("kinds");
    for kind in [StorageKind::Ram, file.kind(), StorageKind::Null] {
        let mut b = crate::backing::open(&kind, 1 << 20, kind == file.kind()).unwrap();
        b.write(4096, b"abcd").unwrap();
        let mut r = [0u8; 4];
        b.read(4096, &mut r).unwrap();
        assert_eq!(&r, if kind == StorageKind::Null { b"\0\0\0\0" } else { b"abcd" }, "{kind:?}");
        // Whole aligned transfers go O_DIRECT through io_uring where the file system allows.
        let mut bounce = Bounce::new(8192);
        let buf = bounce.get(8192);
        buf.fill(0x5a);
        b.write(8192, buf).unwrap();
        buf.fill(0);
        b.read(8192, buf).unwrap();
        if kind != StorageKind::Null {
            assert!(buf.iter().all(|&x| x == 0x5a), "{kind:?}");
        }
        b.write_zeroes(4096, 4096, false).unwrap();
        b.read(4096, &mut r).unwrap();
        assert_eq!(r, [0; 4]);
    }
    drop(file);
    assert!("floppy".parse::<StorageKind>().is_err());
    assert_eq!("file:/x".parse::<StorageKind>().unwrap(), StorageKind::File("/x".into()));
    for s in ["null", "ram", "file:/x/y z.img"] {
        assert_eq!(s.parse::<StorageKind>().unwrap().to_string(), s, "round trip");
    }
    let e = "file:".parse::<StorageKind>().unwrap_err();
    assert!(matches!(&e, Error::Option { option, .. } if option == "backend"), "{e}");
}

/// Reaps `n` operations, each successful, waiting for them.
fn reap_all(f: &mut FileStorage, n: usize) {
    for _ in 0..n {
        loop {
            match f.reap() {
                Some((s, r)) => {
                    r.unwrap();
                    f.release(s);
                    break;
                }
                None => assert!(f.wait()),
            }
        }
    }
}

#[test]
fn pushed_operations_go_to_the_kernel_once_they_add_up_to_submit_bytes() {
    let file = Scratch::new("batch");
    let mut f = file.open(1 << 20);
    if !f.is_async() {
        eprintln!("no O_DIRECT io_uring here: nothing to check");
        return;
    }
    let per = SUBMIT_BYTES / 4;
    let unsent = |f: &mut FileStorage| f.uring.as_mut().unwrap().ring.submission().len();
    let mut slots = Vec::new();
    for i in 0..5 {
        let s = f.take_slot().unwrap();
        f.buffer(s, per).fill(i as u8);
        assert!(f.push(s, FileOp::Write { dsync: false }, (i * per) as u64, per));
        slots.push(s);
        // The fourth push made SUBMIT_BYTES: those four went without a submit call.
        assert_eq!(unsent(&mut f), if i < 3 { i + 1 } else { i - 3 }, "after push {i}");
    }
    f.submit();
    assert_eq!(unsent(&mut f), 0);
    reap_all(&mut f, 5);
}

#[test]
fn with_a_submit_batch_pushed_reads_go_to_the_kernel_every_that_many() {
    let file = Scratch::new("sbatch");
    let mut f = file.open(1 << 20);
    if !f.is_async() {
        eprintln!("no O_DIRECT io_uring here: nothing to check");
        return;
    }
    let unsent = |f: &mut FileStorage| f.uring.as_mut().unwrap().ring.submission().len();
    let read = |f: &mut FileStorage, i: u64| {
        let s = f.take_slot().unwrap();
        assert!(f.push(s, FileOp::Read, i * 4096, 4096));
    };
    // 0 (the default): reads wait for the pass's submit; they copy nothing first.
    for i in 0..3 {
        read(&mut f, i);
    }
    assert_eq!(unsent(&mut f), 3);
    f.submit();
    // 1: each goes at its push; 2: every second one.
    f.submit_batch = 1;
    read(&mut f, 3);
    assert_eq!(unsent(&mut f), 0);
    f.submit_batch = 2;
    read(&mut f, 4);
    assert_eq!(unsent(&mut f), 1);
    read(&mut f, 5);
    assert_eq!(unsent(&mut f), 0);
    reap_all(&mut f, 6);
}

/// The ring does this namespace's operations and nothing else: an open,
/// a no-op, a read of a plain fd and a registration other than a buffer
/// update all get EACCES, while a read of fixed file 0 goes through.
#[test]
fn the_ring_refuses_every_operation_but_the_namespaces_own() {
    use io_uring::{opcode, types};
    let file = Scratch::new("restrict");
    let mut f = file.open(1 << 20);
    drop(file); // the namespace keeps its fd
    if !f.is_async() {
        eprintln!("no O_DIRECT io_uring here: nothing to check");
        return;
    }
    let plain_fd = f.file.as_raw_fd();
    let u = f.uring.as_mut().unwrap();
    let buf = u.arena.get(0, 4096).as_mut_ptr();
    let probes = [
        ("openat", opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c"/etc/hostname".as_ptr()).build()),
        ("nop", opcode::Nop::new().build()),
        ("read of a plain fd", opcode::Read::new(types::Fd(plain_fd), buf, 4096).build()),
        ("read of fixed file 0", opcode::Read::new(types::Fixed(0), buf, 4096).build()),
    ];
    let mut got = Vec::new();
    for (what, e) in probes {
        // SAFETY: the path and the buffer outlive the operation, which is waited for here.
        unsafe { u.ring.submission().push(&e.user_data(0)).unwrap() };
        u.ring.submit_and_wait(1).unwrap();
        got.push((what, u.ring.completion().next().unwrap().result()));
    }
    let eacces = -libc::EACCES;
    assert_eq!(
        got,
        [("openat", eacces), ("nop", eacces), ("read of a plain fd", eacces), ("read of fixed file 0", 4096)]
    );
    let e = u.ring.submitter().register_files_update(0, &[plain_fd]).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{e}");
}

#[test]
fn operations_in_flight_on_a_file_complete_with_their_data_through_fixed_buffers() {
    let file = Scratch::new("uring");
    let mut f = file.open(1 << 20);
    if !f.is_async() {
        eprintln!("no O_DIRECT io_uring here: nothing to check");
        return;
    }
    // 16 writes of growing sizes in flight at once, then a flush after them, then reads.
    let sizes = |i: usize| 512 * (i + 1);
    let mut slots = Vec::new();
    for i in 0..16 {
        let s = f.take_slot().unwrap();
        f.buffer(s, sizes(i)).fill(i as u8 + 1);
        assert!(f.push(s, FileOp::Write { dsync: i == 3 }, (i as u64) << 16, sizes(i)));
        slots.push(s);
    }
    let flush = f.take_slot().unwrap();
    assert!(f.push(flush, FileOp::Flush, 0, 0));
    f.submit();
    assert_eq!(f.max_in_flight, 17);
    let mut done = Vec::new();
    while done.len() < 17 {
        match f.reap() {
            Some((s, r)) => {
                r.unwrap();
                done.push(s);
            }
            None => assert!(f.wait()),
        }
    }
    assert_eq!(done.last(), Some(&flush), "the flush drained the writes before it");
    for &s in &done {
        f.release(s);
    }
    for (i, &s) in slots.iter().enumerate() {
        f.buffer(s, sizes(i)).fill(0);
        assert!(f.push(s, FileOp::Read, (i as u64) << 16, sizes(i)));
    }
    f.submit();
    for _ in 0..16 {
        let (s, r) = loop {
            match f.reap() {
                Some(x) => break x,
                None => assert!(f.wait()),
            }
        };
        r.unwrap();
        let i = slots.iter().position(|&x| x == s).unwrap();
        assert!(f.buffer(s, sizes(i)).iter().all(|&b| b == i as u8 + 1), "read {i}");
    }
    // The largest transfer, MDTS, through two slots' buffers.
    let (w, r) = (slots[0], slots[1]);
    f.buffer(w, 128 << 10).fill(0x77);
    assert!(f.push(w, FileOp::Write { dsync: false }, 0x80000, 128 << 10));
    f.submit();
    let reap_one = |f: &mut FileStorage| loop {
        match f.reap() {
            Some(x) => break x,
            None => assert!(f.wait()),
        }
    };
    reap_one(&mut f).1.unwrap();
    f.buffer(r, 128 << 10).fill(0);
    assert!(f.push(r, FileOp::Read, 0x80000, 128 << 10));
    f.submit();
    reap_one(&mut f).1.unwrap();
    assert!(f.buffer(r, 128 << 10).iter().all(|&b| b == 0x77), "read of a whole slot");
    assert_eq!(f.direct_ops, 34);
    assert_eq!(f.in_flight(), 0);
    let u = f.uring.as_ref().unwrap();
    if u.fixed_bufs {
        assert!(slots.iter().all(|&s| u.slots[s as usize].registered), "fixed buffers");
    }
    // The slots' buffers: 2 MiB aligned (a whole slot never straddles a
    // huge page), advised for huge pages.
    assert_eq!(u.arena.base as usize % Arena::HUGE, 0);
    assert_eq!(Arena::HUGE % SLOT_BYTES, 0);
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let base = format!("{:x}-", u.arena.base as usize);
    let flags = smaps.split('\n').skip_while(|l| !l.starts_with(&base)).find(|l| l.starts_with("VmFlags:"));
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok();
    assert!(!thp || flags.is_some_and(|f| f.contains(" hg")), "MADV_HUGEPAGE: {flags:?}");
}

/// The bytes of `f` on disk (st_blocks counts 512-byte units).
fn allocated(f: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(f).unwrap().blocks() * 512
}

/// A thin image stays thin: a discard and a write zeroes with deallocation
/// punch holes (the file's allocated bytes drop by what they covered),
/// a write zeroes without it keeps the blocks; each range reads as zeros.
#[test]
fn discard_punches_a_hole_in_a_file_and_write_zeroes_keeps_blocks_unless_deallocating() {
    const MIB: u64 = 1 << 20;
    let file = Scratch::new("holes");
    let path = file.path();
    let mut s = crate::backing::open(&file.kind(), 4 * MIB, true).unwrap();
    for i in 0..4 {
        s.write(i * MIB, &vec![0x5a; MIB as usize]).unwrap();
    }
    s.flush().unwrap();
    let full = allocated(path);
    assert!(full >= 4 * MIB, "written: {full} bytes allocated");
    s.discard(MIB, MIB).unwrap();
    let after_discard = allocated(path);
    s.write_zeroes(2 * MIB, MIB, false).unwrap();
    let after_zeroes = allocated(path);
    s.write_zeroes(3 * MIB, MIB, true).unwrap();
    let after_dealloc = allocated(path);
    // Unaligned: the whole blocks inside become a hole, the edges are zeroed.
    s.discard(1000, 100_000).unwrap();
    let mut back = vec![0xffu8; (4 * MIB) as usize];
    s.read(0, &mut back).unwrap();
    drop(file);
    eprintln!("allocated: {full} written, {after_discard} after a 1 MiB discard, {after_zeroes} after write zeroes, {after_dealloc} after write zeroes with deallocation");
    assert!(after_discard <= full - MIB, "a discard punched no hole: {full} -> {after_discard}");
    assert_eq!(after_zeroes, after_discard, "write zeroes without deallocation kept the blocks");
    assert!(after_dealloc <= after_zeroes - MIB, "deallocation punched no hole: {after_zeroes} -> {after_dealloc}");
    assert!(back[..1000].iter().all(|&b| b == 0x5a) && back[1000..101_000].iter().all(|&b| b == 0));
    assert!(back[101_000..MIB as usize].iter().all(|&b| b == 0x5a));
    assert!(back[MIB as usize..].iter().all(|&b| b == 0), "the zeroed megabytes read as zeros");
}
