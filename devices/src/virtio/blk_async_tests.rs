//! virtio-blk on a file disk's io_uring (`blk_async.rs`) against an
//! oracle: a random schedule of reads, writes, flushes and GET_IDs of
//! random sizes (up to 1.5 MiB, over MAX_TRANSFER and many io_uring
//! pieces) on four queues, many in flight (more pieces than slots), with
//! resets in mid-flight. A reference image of the disk checks every read's
//! data; each chain's head completes exactly once with its used length
//! and S_OK; every byte of a request's guest region outside its writable
//! buffers is left as it was; after a reset or the end of the run nothing
//! completes and nothing is in flight.

use super::*;
use crate::virtio::blk::{ID_LEN, T_FLUSH, T_GET_ID};

const QUEUES: u16 = 4;
/// Queue size; chains of 4 descriptors, so 8 in flight per queue.
const NUM: u16 = 32;
const CHAINS: u16 = NUM / 4;
const DISK: u64 = 32 << 20;
/// Each chain's guest region: header, status, then its data in two buffers.
const REGION: u64 = 2 << 20;
const REGIONS_AT: u64 = 2 << 20;
const RAM: u64 = REGIONS_AT + REGION * (QUEUES * CHAINS) as u64;
const STATUS_AT: u64 = 0x100;
const DATA_AT: u64 = 0x1000;
/// The gap between a request's two data buffers (never written).
const GAP: u64 = 0x200;

use crate::rng::SplitMix64 as Rng;

/// A request the driver made available and has not seen complete.
struct Out {
    kind: u32,
    /// Byte range on the disk (IN, OUT).
    off: u64,
    len: u64,
    /// The region as it must look after completion, over `[0, span)`.
    want: Vec<u8>,
    /// The region as it was made available (what a cancelled one keeps).
    before: Vec<u8>,
    /// An OUT's data before it (the disk's bytes there may be either after a reset).
    old: Vec<u8>,
    used_len: u32,
}

struct Sched {
    dev: VirtioBlk,
    ram: vm_memory::GuestMemoryMmap,
    drivers: Vec<Driver>,
    /// Per queue, per chain: what is out.
    out: Vec<Vec<Option<Out>>>,
    /// Per queue: used elements seen.
    seen: Vec<u16>,
    image: Vec<u8>,
    path: std::path::PathBuf,
    rng: Rng,
    completed: u64,
    cancelled: u64,
    /// Every IN and OUT is of 1 ..= 1.5 MiB (a burst that runs out of slots).
    big: bool,
}

fn region(q: u16, c: u16) -> u64 {
    REGIONS_AT + REGION * (q * CHAINS + c) as u64
}

impl Sched {
    /// A disk of random bytes, its io_uring O_DIRECT if `direct`, else buffered.
    fn new(seed: u64, direct: bool) -> Sched {
        let path = std::env::temp_dir().join(format!("iopath-vblk-aio-{}-{seed}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let mut rng = Rng(seed);
        let image: Vec<u8> = (0..DISK).map(|_| rng.next_u64() as u8).collect();
        std::fs::write(&path, &image).unwrap();
        let cfg = VirtioBlkConfig {
            backend: StorageKind::File(path.clone()),
            size: DISK,
            notify: NotifyMode::Exit,
            queues: Some(QUEUES),
            direct,
            ..VirtioBlkConfig::default()
        };
        let dev = VirtioBlk::new(cfg).unwrap();
        let d = Driver::with_ram(NUM, RAM);
        dev.attach(DeviceContext::detached(d.mem.clone()));
        {
            let mut s = crate::lock(dev.shared());
            let Storage::File(f) = &s.e.blk.storage else { panic!("a file disk") };
            assert!(f.is_async(), "{} refuses O_DIRECT or io_uring: this test needs both", path.display());
            let flags = f.ring_fd_flags().expect("a ring");
            assert_eq!(flags & libc::O_DIRECT != 0, direct, "the ring's fd: {flags:#o}");
            assert_eq!(f.is_direct(), direct);
            s.e.aio = true; // as the device thread sets it; the test is that thread here
        }
        let ram = d.ram.clone();
        let drivers = (0..QUEUES).map(|q| d.another(0x8000 * q as u64)).collect();
        let out = (0..QUEUES).map(|_| (0..CHAINS).map(|_| None).collect()).collect();
        let mut s = Sched {
            dev,
            ram,
            drivers,
            out,
            seen: vec![0; QUEUES as usize],
            image,
            path,
            rng,
            completed: 0,
            cancelled: 0,
            big: false,
        };
        s.init();
        s
    }

    fn w(&self, off: u64, v: u64, len: usize) {
        self.dev.bar_write(0, off, &v.to_le_bytes()[..len]);
    }

    /// Driver initialisation (3.1.1) with fresh rings on every queue.
    fn init(&mut self) {
        self.w(0x14, 0, 1);
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER) as u64, 1);
        let f = F_VERSION_1 | F_EVENT_IDX | F_MQ;
        for sel in 0..2u64 {
            self.w(0x08, sel, 4);
            self.w(0x0c, (f >> (32 * sel)) & 0xffff_ffff, 4);
        }
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK) as u64, 1);
        for q in 0..QUEUES {
            let d = &mut self.drivers[q as usize];
            d.avail_idx = 0;
            let zero = vec![0u8; 0x2000];
            self.ram.write_slice(&zero, GuestAddress(d.avail)).unwrap(); // avail and used rings
            let (desc, avail, used) = (d.desc, d.avail, d.used);
            self.w(0x16, q as u64, 2);
            self.w(0x18, NUM as u64, 2);
            self.w(0x20, desc, 8);
            self.w(0x28, avail, 8);
            self.w(0x30, used, 8);
            self.w(0x1c, 1, 2);
            self.seen[q as usize] = 0;
        }
        self.w(0x14, (S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK) as u64, 1);
        assert_eq!(self.dev.bar_read_u8(0x14) & S_NEEDS_RESET, 0);
    }

    fn overlaps(&self, off: u64, len: u64, write: bool) -> bool {
        self.out
            .iter()
            .flatten()
            .flatten()
            .any(|o| (write || o.kind == T_OUT) && o.len > 0 && off < o.off + o.len && o.off < off + len)
    }

    /// Makes a random request available on a free chain of a random queue.
    fn submit(&mut self) {
        let q = self.rng.below(QUEUES as u64) as u16;
        let Some(c) = (0..CHAINS).find(|&c| self.out[q as usize][c as usize].is_none()) else { return };
        let kind = match self.rng.below(20) {
            0 => T_FLUSH,
            1 => T_GET_ID,
            2..=10 => T_OUT,
            _ => T_IN,
        };
        let sectors = match self.rng.below(20) {
            _ if self.big => 2048 + self.rng.below(1024),
            0..=9 => 1 + self.rng.below(32),
            10..=16 => 1 + self.rng.below(512),
            _ => 1 + self.rng.below(3 * 1024), // up to 1.5 MiB
        };
        let (mut off, mut len) = (0, 0);
        if kind == T_IN || kind == T_OUT {
            len = sectors * 512;
            let mut tries = 0;
            loop {
                off = self.rng.below((DISK - len) / 512 + 1) * 512;
                if !self.overlaps(off, len, kind == T_OUT) {
                    break;
                }
                tries += 1;
                if tries == 8 {
                    return;
                }
            }
        }
        if kind == T_GET_ID {
            len = ID_LEN as u64;
        }
        let base = region(q, c);
        let split = if len > 0 { self.rng.below(len / 512 + 1) * 512 } else { 0 };
        let (a, b) = (base + DATA_AT, base + DATA_AT + split + GAP);
        let span = (DATA_AT + len + GAP + 0x1000) as usize;
        // The region: canary bytes, header, status 0xaa, an OUT's data.
        let mut before: Vec<u8> = (0..span).map(|i| (i as u64 ^ base >> 12) as u8 ^ 0x5c).collect();
        before[0..4].copy_from_slice(&kind.to_le_bytes());
        before[8..16].copy_from_slice(&(off / 512).to_le_bytes());
        before[STATUS_AT as usize] = 0xaa;
        let data_at = |k: u64| if k < split { DATA_AT + k } else { DATA_AT + GAP + k } as usize;
        let mut old = Vec::new();
        if kind == T_OUT {
            let data: Vec<u8> = (0..len).map(|_| self.rng.next_u64() as u8).collect();
            old = self.image[off as usize..(off + len) as usize].to_vec();
            for k in 0..len {
                before[data_at(k)] = data[k as usize];
            }
            self.image[off as usize..(off + len) as usize].copy_from_slice(&data);
        }
        let mut want = before.clone();
        want[STATUS_AT as usize] = blk::S_OK;
        let used_len = match kind {
            T_IN => {
                for k in 0..len {
                    want[data_at(k)] = self.image[(off + k) as usize];
                }
                len as u32 + 1
            }
            T_GET_ID => {
                let id = b"iopath-virtio-blk";
                for k in 0..len {
                    want[data_at(k)] = id.get(k as usize).copied().unwrap_or(0);
                }
                len as u32 + 1
            }
            _ => 1,
        };
        self.ram.write_slice(&before, GuestAddress(base)).unwrap();
        let wr = kind == T_IN || kind == T_GET_ID;
        let mut bufs = vec![(base, 16, false)];
        if len > 0 {
            bufs.push((a, split as u32, wr));
            bufs.push((b, (len - split) as u32, wr));
        }
        bufs.push((base + STATUS_AT, 1, true));
        bufs.retain(|&(_, n, _)| n > 0);
        let d = &mut self.drivers[q as usize];
        d.chain_at(d.desc, 4 * c, &bufs);
        d.publish(4 * c);
        self.out[q as usize][c as usize] = Some(Out { kind, off, len, want, before, old, used_len });
        if self.rng.below(3) > 0 {
            self.w(notify_offset(q), q as u64, 2);
        }
    }

    /// Checks every used element that appeared since the last look.
    fn check_used(&mut self) {
        for q in 0..QUEUES as usize {
            let d = &self.drivers[q];
            let idx = d.used_idx();
            while self.seen[q] != idx {
                let (id, len) = d.used_elem(self.seen[q]);
                self.seen[q] = self.seen[q].wrapping_add(1);
                assert!(id % 4 == 0 && id < NUM as u32, "queue {q}: used id {id} is no head");
                let c = (id / 4) as usize;
                let Some(o) = self.out[q][c].take() else { panic!("queue {q}: head {id} completed twice") };
                assert_eq!(len, o.used_len, "queue {q} head {id}: used length of kind {}", o.kind);
                let mut got = vec![0u8; o.want.len()];
                self.ram.read_slice(&mut got, GuestAddress(region(q as u16, c as u16))).unwrap();
                assert_eq!(got[STATUS_AT as usize], blk::S_OK, "queue {q} head {id}: status of kind {}", o.kind);
                if let Some(k) = (0..got.len()).find(|&k| got[k] != o.want[k]) {
                    panic!(
                        "queue {q} head {id} kind {} ({} bytes at {}): region byte {k:#x} is {:#x}, want {:#x}",
                        o.kind, o.len, o.off, got[k], o.want[k]
                    );
                }
                self.completed += 1;
            }
        }
    }

    fn serve(&self) {
        crate::lock(self.dev.shared()).serve();
    }

    /// Blocks until a file operation completes (or 50 ms pass).
    fn wait(&self) {
        let mut s = crate::lock(self.dev.shared());
        if let Storage::File(f) = &mut s.e.blk.storage {
            f.wait_for(std::time::Duration::from_millis(50));
        }
    }

    fn file_in_flight(&self) -> usize {
        let s = crate::lock(self.dev.shared());
        match &s.e.blk.storage {
            Storage::File(f) => f.in_flight(),
            _ => 0,
        }
    }

    /// After a reset or the end of the run: nothing in flight, no
    /// completion lands and no byte of a request still out changes after
    /// it. Such a request's status is not written, every byte outside its
    /// writable data is as it was, and each data byte is as it was or the
    /// right data (an IN's pieces reaped before the reset); an OUT's
    /// sectors on the disk hold the old or the new data.
    /// `reset`: the queues are forgotten, so a pass serves nothing (after
    /// the end of a run nothing serves them: no pass is made).
    fn check_cancelled(&mut self, reset: bool) {
        assert_eq!(crate::lock(self.dev.shared()).in_flight(), 0, "requests in flight after a reset");
        assert_eq!(self.file_in_flight(), 0, "file operations in flight after a reset");
        let idx: Vec<u16> = self.drivers.iter().map(|d| d.used_idx()).collect();
        let regions = |s: &Sched| -> Vec<Vec<u8>> {
            let mut v = Vec::new();
            for (q, c) in (0..QUEUES).flat_map(|q| (0..CHAINS).map(move |c| (q, c))) {
                if let Some(o) = &s.out[q as usize][c as usize] {
                    let mut got = vec![0u8; o.before.len()];
                    s.ram.read_slice(&mut got, GuestAddress(region(q, c))).unwrap();
                    v.push(got);
                }
            }
            v
        };
        let snap = regions(self);
        if reset {
            self.serve();
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(idx, self.drivers.iter().map(|d| d.used_idx()).collect::<Vec<_>>(), "a completion after a reset");
        assert!(snap == regions(self), "guest memory written after a reset");
        let on_disk = std::fs::read(&self.path).unwrap();
        let mut got = snap.into_iter();
        for q in 0..QUEUES {
            for c in 0..CHAINS {
                let Some(o) = self.out[q as usize][c as usize].take() else { continue };
                let got = got.next().unwrap();
                assert_eq!(got[STATUS_AT as usize], 0xaa, "queue {q} chain {c}: status written, not completed");
                if let Some(k) = (0..got.len()).find(|&k| got[k] != o.before[k] && got[k] != o.want[k]) {
                    panic!("queue {q} chain {c} (kind {}): region byte {k:#x} is {:#x}", o.kind, got[k]);
                }
                if o.kind == T_OUT {
                    let (a, b) = (o.off as usize, (o.off + o.len) as usize);
                    for (k, sector) in on_disk[a..b].chunks(512).enumerate() {
                        let new = &self.image[a + 512 * k..a + 512 * (k + 1)];
                        let old = &o.old[512 * k..512 * (k + 1)];
                        assert!(sector == new || sector == old, "sector {} is neither old nor new", a / 512 + k);
                    }
                    self.image[a..b].copy_from_slice(&on_disk[a..b]);
                }
                self.cancelled += 1;
            }
        }
    }
}

impl VirtioBlk {
    fn bar_read_u8(&self, off: u64) -> u8 {
        let mut b = [0u8];
        self.bar_read(0, off, &mut b);
        b[0]
    }
}

fn run(seed: u64, steps: usize, direct: bool) -> (u64, u64, u64) {
    let mut s = Sched::new(seed, direct);
    let mut resets = 0;
    for step in 0..steps {
        match s.rng.below(100) {
            0..=54 => s.submit(),
            55..=79 => s.serve(),
            80..=97 => {
                s.wait();
                s.serve();
            }
            98 => {
                // A burst of large requests: more pieces than io_uring slots.
                s.big = true;
                for _ in 0..2 * QUEUES * CHAINS {
                    s.submit();
                }
                s.big = false;
                s.serve();
            }
            _ if step > steps / 10 => {
                s.check_used();
                s.w(0x14, 0, 1); // reset, requests in flight
                resets += 1;
                s.check_cancelled(true);
                s.init();
            }
            _ => {}
        }
        s.check_used();
    }
    // Drain what is out, then end the run with more in flight.
    for _ in 0..10_000 {
        if s.out.iter().flatten().all(Option::is_none) {
            break;
        }
        s.wait();
        s.serve();
        s.check_used();
    }
    assert!(s.out.iter().flatten().all(Option::is_none), "requests never completed");
    for _ in 0..3 * CHAINS {
        s.submit();
    }
    s.dev.quiesce();
    s.check_used(); // those served at once (GET_ID) or reaped before the end
    assert!(!crate::lock(s.dev.shared()).e.aio, "the end of the run leaves io_uring");
    s.check_cancelled(false);
    let waits = crate::lock(s.dev.shared()).e.flight.slot_waits;
    let _ = std::fs::remove_file(&s.path);
    eprintln!("seed {seed}: {} completed, {} cancelled, {resets} resets, {waits} slot waits", s.completed, s.cancelled);
    (s.completed, resets, waits)
}

#[test]
fn a_file_disk_on_io_uring_survives_a_random_schedule_against_a_reference_image() {
    let (mut completed, mut resets, mut waits) = (0, 0, 0);
    for seed in 1..=3 {
        let (c, r, w) = run(seed, 1500, true);
        (completed, resets, waits) = (completed + c, resets + r, waits + w);
    }
    assert!(completed > 1000, "{completed} requests completed");
    assert!(resets > 0, "no reset in mid-flight was exercised");
    assert!(waits > 0, "the slots never ran out");
}

/// `direct=off`: the same schedule against the reference image, on a ring
/// whose fd is opened without O_DIRECT (checked in [`Sched::new`]): the
/// data goes through the page cache, and still reads back as written.
#[test]
fn a_buffered_file_disk_survives_the_same_schedule_against_a_reference_image() {
    let (completed, resets, _) = run(7, 1500, false);
    assert!(completed > 300, "{completed} requests completed");
    assert!(resets > 0, "no reset in mid-flight was exercised");
}

/// The device thread (notify=ioeventfd and poll) serves a file disk
/// through io_uring: four 64 KiB writes in flight from one kick, then four
/// reads, which bring the data back; the thread reaped them on the ring's
/// completion eventfd.
#[test]
fn the_device_thread_serves_a_file_disk_through_io_uring() {
    for notify in [NotifyMode::Ioeventfd, NotifyMode::Poll] {
        let path = std::env::temp_dir().join(format!("iopath-vblk-aio-thread-{}-{notify}.img", std::process::id()));
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let d = Driver::new(8);
        let c = VirtioBlkConfig { notify, ..cfg(StorageKind::File(path.clone())) };
        let dev = VirtioBlk::new(c).unwrap();
        let io = Arc::new(FakeIoEvents::default());
        let mut ctx = DeviceContext::detached(d.mem.clone());
        ctx.ioevents = io.clone();
        dev.attach(ctx);
        let (_, kick) = io.0.lock().unwrap().pop().expect("notify registered as an ioeventfd");
        assert!(crate::lock(dev.shared()).e.aio, "{notify}: a file disk on io_uring");
        let mut r = Rig { dev, d, irqs: Arc::new(Irqs::default()) };
        assert!(r.init(F_VERSION_1 | F_EVENT_IDX));
        let buf = |k: u64| 0x20000 + 0x10000 * k;
        for (round, kind) in [(1u16, T_OUT), (2, T_IN)] {
            for k in 0..4u64 {
                if kind == T_OUT {
                    r.d.ram.write_slice(&[k as u8 + 1; 0x10000], GuestAddress(buf(k))).unwrap();
                }
                let at = DATA + 0x100 * k;
                let mut hdr = [0u8; 16];
                hdr[0..4].copy_from_slice(&kind.to_le_bytes());
                hdr[8..16].copy_from_slice(&(k * 128).to_le_bytes());
                r.d.ram.write_slice(&hdr, GuestAddress(at)).unwrap();
                let data = if kind == T_IN { buf(k + 4) } else { buf(k) };
                // Each through an indirect table of its own (the ring has 8 descriptors).
                let (h, table) = (k as u16, DATA + 0x1000 + 0x100 * k);
                r.d.chain_at(table, 0, &[(at, 16, false), (data, 0x10000, kind == T_IN), (at + 0x80, 1, true)]);
                r.d.indirect(h, table, 3);
                r.d.publish(h);
            }
            kick.write(1).unwrap();
            eventually("the requests complete", || r.d.used_idx() == 4 * round);
            for k in 0..4u64 {
                assert_eq!(r.d.ram.read_obj::<u8>(GuestAddress(DATA + 0x100 * k + 0x80)).unwrap(), S_OK);
            }
        }
        for k in 0..4u64 {
            let mut back = vec![0u8; 0x10000];
            r.d.ram.read_slice(&mut back, GuestAddress(buf(k + 4))).unwrap();
            assert!(back.iter().all(|&x| x == k as u8 + 1), "{notify}: read {k} brought other data back");
        }
        let direct = match &crate::lock(r.dev.shared()).e.blk.storage {
            Storage::File(f) => f.direct_ops,
            _ => 0,
        };
        assert_eq!(direct, 8, "{notify}: every transfer went through io_uring");
        r.dev.quiesce();
        let _ = std::fs::remove_file(&path);
    }
}
