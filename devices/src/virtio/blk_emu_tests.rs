//! Error injection and the timing model on virtio-blk (`blk_emu.rs`),
//! through the PCI function as a driver drives it: a reference image of
//! the disk checks every read; the rules' hits are the requests a test
//! names; held completions are checked against a fake clock and an
//! independent [`TimingModel`] fed the same arrivals (no timed assertion).

use super::*;
use crate::block::inject::{parse_rules, Corrupt};
use crate::block::timing::{OpKind, TimingModel, TimingSpec};
use crate::virtio::blk::{S_IOERR, S_UNSUPP};
use std::sync::atomic::AtomicU64;

const DISK: u64 = 1 << 20;
/// Where reads land and writes come from.
const BUF: u64 = DATA + 0x4000;
const LEN: u32 = 4096;

/// A ram disk's rig with `inject` rules and `timing`, the device thread
/// not running (tests serve as that thread would), its clock `clock`.
fn emu_rig(inject: &str, timing: Option<&str>, clock: &Arc<AtomicU64>) -> Rig {
    let c = VirtioBlkConfig {
        notify: NotifyMode::Ioeventfd, // no ioeventfd here: notifies are served on the "vCPU"
        inject: if inject.is_empty() { Vec::new() } else { parse_rules(inject).unwrap() },
        timing: timing.map(|t| Box::new(t.parse().unwrap())),
        ..cfg(StorageKind::Ram)
    };
    let r = rig(c);
    let k = clock.clone();
    crate::lock(r.dev.shared()).e.emu.clock = Arc::new(move || k.load(Ordering::SeqCst));
    assert!(r.init(F_VERSION_1));
    r
}

/// The driver's view: requests at descriptor 0, each completed before the next.
struct Disk {
    r: Rig,
    image: Vec<u8>,
    completed: u16,
}

impl Disk {
    fn new(r: Rig) -> Disk {
        Disk { r, image: vec![0u8; DISK as usize], completed: 0 }
    }

    /// Writes `LEN` bytes of `fill` at `sector`: its status, if completed.
    fn write(&mut self, sector: u64, fill: u8) -> Option<u8> {
        self.r.d.ram.write_slice(&[fill; LEN as usize], GuestAddress(BUF)).unwrap();
        let st = self.issue(T_OUT, sector);
        if st == Some(S_OK) {
            let at = (sector * 512) as usize;
            self.image[at..at + LEN as usize].fill(fill);
        }
        st
    }

    /// Reads `LEN` bytes at `sector`: its status (if completed) and the data.
    fn read(&mut self, sector: u64) -> (Option<u8>, Vec<u8>) {
        self.r.d.ram.write_slice(&[0xee; LEN as usize], GuestAddress(BUF)).unwrap();
        let st = self.issue(T_IN, sector);
        let mut back = vec![0u8; LEN as usize];
        self.r.d.ram.read_slice(&mut back, GuestAddress(BUF)).unwrap();
        (st, back)
    }

    /// What the reference image holds at `sector`.
    fn want(&self, sector: u64) -> &[u8] {
        &self.image[(sector * 512) as usize..(sector * 512) as usize + LEN as usize]
    }

    fn issue(&mut self, kind: u32, sector: u64) -> Option<u8> {
        let st = self.r.request(0, kind, sector, BUF, LEN);
        if self.r.d.used_idx() == self.completed {
            return None;
        }
        self.completed += 1;
        assert_eq!(self.r.d.used_idx(), self.completed, "one completion per request");
        Some(st)
    }
}

/// Serves as the device thread does until no request is on the file's
/// io_uring (waiting on the ring between passes).
fn settle(r: &Rig) {
    for _ in 0..10_000 {
        let mut s = crate::lock(r.dev.shared());
        s.serve();
        if s.e.flight.requests() == 0 {
            return;
        }
        let Storage::File(f) = &mut s.e.blk.storage else { panic!("a file disk") };
        f.wait();
    }
    panic!("requests never left the io_uring");
}

fn counter(r: &Rig, name: &str) -> u64 {
    r.dev.counters().iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

#[test]
fn a_read_rule_fails_exactly_the_reads_of_its_lbas_and_nothing_else() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("op=read/lba=8-15/status=2:0x81+op=flush/status=0:0x01", None, &clock));
    for (k, sector) in [0u64, 8, 16, 24].into_iter().enumerate() {
        assert_eq!(d.write(sector, 0x10 + k as u8), Some(S_OK), "writes are not matched");
    }
    // 8 sectors per read: 0..=7, 16..=23 and 23..=30 miss 8..=15; 1..=8, 4..=11, 7..=14 and
    // 15..=22 overlap it.
    for (sector, hit) in
        [(0, false), (4, true), (8, true), (15, true), (16, false), (24, false), (1, true), (7, true), (23, false)]
    {
        let (st, data) = d.read(sector);
        if hit {
            assert_eq!(st, Some(S_IOERR), "sector {sector}");
            assert!(data.iter().all(|&x| x == 0xee), "sector {sector}: a failed read is not carried out");
        } else {
            assert_eq!(st, Some(S_OK), "sector {sector}");
            assert_eq!(data, d.want(sector), "sector {sector}: the reference image");
        }
    }
    // Invalid Opcode is S_UNSUPP, with a used length of the status byte alone.
    assert_eq!(d.issue(blk::T_FLUSH, 0), Some(S_UNSUPP));
    assert_eq!(d.r.d.used_elem(d.completed - 1).1, 1);
    assert_eq!(counter(&d.r, "inject.fired"), 6);
}

#[test]
fn a_rule_added_through_the_devices_injector_applies_to_the_next_request() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("", None, &clock));
    assert_eq!(d.write(0, 0x5a), Some(S_OK));
    // The handle a control socket holds (`DeviceModel::injector`) is the one the device asks.
    let rules = d.r.dev.injector().expect("virtio-blk takes rules");
    let id = rules.add(parse_rules("op=read/lba=0-7/status=2:0x81").unwrap()[0]).unwrap();
    assert_eq!(d.read(0).0, Some(S_IOERR));
    assert!(rules.add(parse_rules("event=smart:0x01").unwrap()[0]).is_err(), "an event is refused");
    rules.remove(id).unwrap();
    let (st, data) = d.read(0);
    assert_eq!((st, data.as_slice() == d.want(0)), (Some(S_OK), true));
    assert_eq!(counter(&d.r, "inject.fired"), 1);
}

#[test]
fn every_n_fires_on_the_nth_matching_request() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("op=read/status=2:0x81/every=3", None, &clock));
    d.write(0, 0x42);
    let failed: Vec<usize> = (1..=9).filter(|_| d.read(0).0 == Some(S_IOERR)).collect();
    assert_eq!(failed, [3, 6, 9]);
}

#[test]
fn a_dropped_request_never_completes_and_a_reset_forgets_it() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("op=write/lba=0-0/drop", None, &clock));
    assert_eq!(d.write(8, 0x11), Some(S_OK));
    assert_eq!(d.write(0, 0x22), None, "dropped: no completion");
    assert_eq!(d.r.d.ram.read_obj::<u8>(GuestAddress(DATA + 0x80)).unwrap(), 0xaa, "no status written");
    let (st, data) = d.read(0);
    assert_eq!((st, data.as_slice()), (Some(S_OK), d.want(0)), "the dropped write was not carried out");
    assert_eq!(counter(&d.r, "inject.dropped"), 1);
    d.r.w(0x14, 0, 1); // reset
    clock.store(u64::MAX / 2, Ordering::SeqCst);
    crate::lock(d.r.dev.shared()).serve();
    assert_eq!(crate::lock(d.r.dev.shared()).in_flight(), 0);
    assert!(d.r.init(F_VERSION_1));
    d.r.d.avail_idx = 0;
    d.r.d.w16(USED + 2, 0);
    d.completed = 0;
    assert_eq!(d.write(16, 0x33), Some(S_OK));
    assert_eq!(d.r.d.used_elem(0).0, 0, "the one completion after the reset is the new request's");
}

#[test]
fn corrupt_flips_exactly_the_bytes_flips_names() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("op=read/lba=32-39/corrupt=5:77", None, &clock));
    for s in [0u64, 32] {
        d.write(s, 0x5c);
    }
    let (st, data) = d.read(0);
    assert_eq!((st, data.as_slice()), (Some(S_OK), d.want(0)), "not matched: intact");
    let (st, data) = d.read(32);
    assert_eq!(st, Some(S_OK));
    let mut want = d.want(32).to_vec();
    let flips = Corrupt { bytes: 5, seed: 77 }.flips(LEN as usize);
    assert_eq!(flips.len(), 5);
    for &(off, x) in &flips {
        want[off] ^= x;
    }
    assert_eq!(data, want);
    let differ: Vec<usize> = (0..LEN as usize).filter(|&i| data[i] != d.want(32)[i]).collect();
    assert_eq!(differ, flips.iter().map(|f| f.0).collect::<Vec<_>>());
    let (_, again) = d.read(0);
    assert_eq!(again, d.want(0), "the disk itself is intact");
}

#[test]
fn fatal_sets_needs_reset_and_completes_nothing() {
    let clock = Arc::default();
    let mut d = Disk::new(emu_rig("op=flush/fatal", None, &clock));
    assert_eq!(d.write(0, 1), Some(S_OK));
    assert_eq!(d.issue(blk::T_FLUSH, 0), None);
    assert_eq!(d.r.status() & S_NEEDS_RESET, S_NEEDS_RESET);
    assert_eq!(d.write(8, 2), None, "nothing is served until a reset");
}

/// Each completion is posted at its due time, not a ns earlier: the due
/// times of an independent model fed the same (arrival, op, bytes).
#[test]
fn completions_wait_for_their_due_time_and_a_reset_drops_them() {
    let spec = "read:lognormal:20us:300us+write:uniform:10us:90us+channels:2";
    let clock = Arc::new(AtomicU64::new(1_000));
    let mut r = emu_rig("op=read/lba=64-64/delay=2ms", Some(spec), &clock);
    let mut oracle = TimingModel::new(&spec.parse::<TimingSpec>().unwrap());
    let mut due = Vec::new();
    // Two requests out at once (descriptors 0..=2 and 3..=5), arriving 7 us apart.
    for (h, kind, sector, at) in
        [(0u16, T_OUT, 8u64, 1_000u64), (3, T_IN, 64, 8_000), (0, T_IN, 8, 0), (3, T_OUT, 0, 0)]
    {
        if h == 0 && !due.is_empty() {
            // The first two posted: the next two, arriving at the last due time.
            let last: u64 = *due.iter().max().unwrap();
            clock.store(last, Ordering::SeqCst);
        } else if at > 0 {
            clock.store(at, Ordering::SeqCst);
        }
        let now = clock.load(Ordering::SeqCst);
        let op = if kind == T_IN { OpKind::Read } else { OpKind::Write };
        let mut d = oracle.admit(now, op, LEN as u64);
        if sector == 64 {
            d = d.max(now + 2_000_000); // the delay rule
        }
        let before = r.d.used_idx();
        r.request(h, kind, sector, BUF + 0x1000 * h as u64, LEN);
        assert_eq!(r.d.used_idx(), before, "held, not posted at once");
        due.push(d);
        if due.len() % 2 == 1 {
            continue;
        }
        let pair = [due[due.len() - 2], due[due.len() - 1]];
        let mut order = pair.to_vec();
        order.sort();
        let base = before;
        for (k, &t) in order.iter().enumerate() {
            let until = crate::lock(r.dev.shared()).until_due().unwrap();
            assert_eq!(until, t - clock.load(Ordering::SeqCst), "the thread sleeps until the next due time");
            clock.store(t - 1, Ordering::SeqCst);
            crate::lock(r.dev.shared()).serve();
            assert_eq!(r.d.used_idx(), base + k as u16, "not posted before its due time {t}");
            clock.store(t, Ordering::SeqCst);
            crate::lock(r.dev.shared()).serve();
            assert_eq!(r.d.used_idx(), base + k as u16 + 1, "posted at its due time {t}");
        }
    }
    assert_eq!(counter(&r, "held"), 4);
    // A reset drops what is held: nothing reaches the used ring after it.
    clock.store(10_000_000, Ordering::SeqCst);
    r.request(0, T_IN, 0, BUF, LEN);
    assert_eq!(crate::lock(r.dev.shared()).in_flight(), 1);
    let used = r.d.used_idx();
    r.w(0x14, 0, 1);
    assert_eq!(crate::lock(r.dev.shared()).in_flight(), 0);
    clock.store(u64::MAX / 2, Ordering::SeqCst);
    crate::lock(r.dev.shared()).serve();
    assert_eq!(r.d.used_idx(), used);
}

#[test]
fn events_and_threadless_timing_are_refused_when_given() {
    let e = |s: &str| s.parse::<crate::DeviceConfig>().unwrap_err().to_string();
    let msg = e("virtio-blk,inject=op=read/event=ns-changed");
    assert!(msg.contains("inject") && msg.contains("virtio-blk has none of"), "{msg}");
    let msg = e("virtio-blk,timing=read:80us");
    assert!(msg.contains("timing= needs notify=ioeventfd or poll"), "{msg}");
    let msg = e("virtio-blk,inject=op=write/delay=1ms");
    assert!(msg.contains("a delay rule needs notify"), "{msg}");
    let ok: crate::DeviceConfig =
        "virtio-blk,notify=poll,timing=read:80us,inject=op=read/status=2:0x81/once+op=write/drop".parse().unwrap();
    assert_eq!(ok.to_string().parse::<crate::DeviceConfig>().unwrap(), ok);
    assert!(ok.to_string().contains(",timing=read:80us,inject=op=read/status=2:0x81/once+op=write/drop"), "{ok}");
}

/// On a file disk's io_uring (`blk_async.rs`) too: a read is corrupted as
/// it is reaped, and its completion held until its due time.
#[test]
fn on_io_uring_a_read_is_corrupted_when_reaped_and_held_until_due() {
    let path = std::env::temp_dir().join(format!("iopath-vblk-emu-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let c = VirtioBlkConfig {
        notify: NotifyMode::Ioeventfd,
        create: true,
        inject: parse_rules("op=read/lba=0-7/corrupt=3:5").unwrap(),
        timing: Some(Box::new("read:50us".parse().unwrap())),
        ..cfg(StorageKind::File(path.clone()))
    };
    let mut r = rig(c);
    let clock = Arc::new(AtomicU64::new(0));
    {
        let k = clock.clone();
        let mut s = crate::lock(r.dev.shared());
        s.e.emu.clock = Arc::new(move || k.load(Ordering::SeqCst));
        let Storage::File(f) = &s.e.blk.storage else { panic!("a file disk") };
        assert!(f.is_async(), "{} refuses O_DIRECT or io_uring: this test needs both", path.display());
        s.e.aio = true; // as the device thread sets it; the test is that thread here
    }
    assert!(r.init(F_VERSION_1));
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 13) as u8).collect();
    r.d.ram.write_slice(&pattern, GuestAddress(BUF)).unwrap();
    r.request(0, T_OUT, 0, BUF, LEN);
    settle(&r);
    assert_eq!(r.d.used_idx(), 1, "no write latency: posted when reaped");
    r.d.ram.write_slice(&[0u8; LEN as usize], GuestAddress(BUF)).unwrap();
    r.request(0, T_IN, 0, BUF, LEN);
    settle(&r);
    assert_eq!((r.d.used_idx(), crate::lock(r.dev.shared()).in_flight()), (1, 1), "reaped and held");
    clock.store(49_999, Ordering::SeqCst);
    crate::lock(r.dev.shared()).serve();
    assert_eq!(r.d.used_idx(), 1, "not before its due time");
    clock.store(50_000, Ordering::SeqCst);
    crate::lock(r.dev.shared()).serve();
    assert_eq!(r.d.used_idx(), 2, "at its due time");
    assert_eq!(r.d.used_elem(1), (0, LEN + 1));
    let mut want = pattern.clone();
    Corrupt { bytes: 3, seed: 5 }.apply(&mut want);
    let mut back = vec![0u8; LEN as usize];
    r.d.ram.read_slice(&mut back, GuestAddress(BUF)).unwrap();
    assert_eq!(back, want);
    assert_eq!(back.iter().zip(&pattern).filter(|(a, b)| a != b).count(), 3);
    r.dev.quiesce();
    let _ = std::fs::remove_file(&path);
}

/// The device thread (ioeventfd, poll) posts held completions by itself,
/// on the real clock: a kick serves the request, and its completion comes
/// at its due time with no further kick (liveness only, bounded wait).
#[test]
fn the_device_thread_posts_held_completions_without_a_kick() {
    for notify in [NotifyMode::Ioeventfd, NotifyMode::Poll] {
        let d = Driver::new(8);
        let c =
            VirtioBlkConfig { notify, timing: Some(Box::new("read:3ms".parse().unwrap())), ..cfg(StorageKind::Ram) };
        let dev = VirtioBlk::new(c).unwrap();
        let io = Arc::new(FakeIoEvents::default());
        let mut ctx = DeviceContext::detached(d.mem.clone());
        ctx.ioevents = io.clone();
        dev.attach(ctx);
        let (_, kick) = io.0.lock().unwrap().pop().expect("notify registered as an ioeventfd");
        let mut r = Rig { dev, d, irqs: Arc::new(Irqs::default()) };
        assert!(r.init(F_VERSION_1));
        let at = DATA;
        let mut hdr = [0u8; 16];
        hdr[0..4].copy_from_slice(&T_IN.to_le_bytes());
        r.d.ram.write_slice(&hdr, GuestAddress(at)).unwrap();
        r.d.chain(0, &[(at, 16, false), (BUF, LEN, true), (at + 0x80, 1, true)]);
        r.d.publish(0);
        kick.write(1).unwrap();
        eventually("the held read is posted", || r.d.used_idx() == 1);
        assert_eq!(r.d.ram.read_obj::<u8>(GuestAddress(at + 0x80)).unwrap(), S_OK, "{notify}");
        r.dev.quiesce();
    }
}

/// How each request type looks to a rule (the module doc's mapping).
#[test]
fn requests_look_to_rules_as_the_mapping_says() {
    use crate::block::inject::{CommandView, Kind, Lbas};
    use crate::virtio::blk_emu::view;
    use crate::virtio::queue::Desc;
    let d = Driver::new(8);
    let hdr = |kind: u32, sector: u64| {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        d.ram.write_slice(&h, GuestAddress(DATA)).unwrap();
    };
    let seg = |sector: u64, n: u32| {
        let mut s = [0u8; 16];
        s[0..8].copy_from_slice(&sector.to_le_bytes());
        s[8..12].copy_from_slice(&n.to_le_bytes());
        d.ram.write_slice(&s, GuestAddress(DATA + 16)).unwrap();
    };
    let desc = |addr, len, write| Desc { addr, len, write };
    let status = desc(DATA + 0x80, 1, true);
    let cv = |opcode, kind, lba: Option<(u64, u32)>, qid| CommandView {
        opcode,
        kind,
        nsid: 1,
        lba: lba.map(|(slba, nlb)| Lbas { slba, nlb }),
        qid,
    };
    hdr(T_IN, 40);
    let v = view(&d.mem, &[desc(DATA, 16, false), desc(BUF, 4096, true), status], 0).unwrap();
    assert_eq!(v, (cv(0x02, Kind::Read, Some((40, 7)), 1), T_IN, 4096));
    hdr(T_OUT, 7);
    let v = view(&d.mem, &[desc(DATA, 16, false), desc(BUF, 1024, false), status], 3).unwrap();
    assert_eq!(v, (cv(0x01, Kind::Write, Some((7, 1)), 4), T_OUT, 1024));
    hdr(blk::T_FLUSH, 99);
    let v = view(&d.mem, &[desc(DATA, 16, false), status], 1).unwrap();
    assert_eq!(v, (cv(0x00, Kind::Flush, None, 2), blk::T_FLUSH, 0));
    for (kind, k, op) in [(blk::T_DISCARD, Kind::Discard, 0x09), (blk::T_WRITE_ZEROES, Kind::WriteZeroes, 0x08)] {
        hdr(kind, 0);
        seg(100, 16);
        let v = view(&d.mem, &[desc(DATA, 32, false), status], 0).unwrap();
        assert_eq!(v, (cv(op, k, Some((100, 15)), 1), kind, 0));
    }
    hdr(blk::T_GET_ID, 0);
    let v = view(&d.mem, &[desc(DATA, 16, false), desc(BUF, 20, true), status], 0).unwrap();
    assert_eq!(v, (cv(0xff, Kind::Other, None, 1), blk::T_GET_ID, 0));
    hdr(T_IN, 0);
    let v = view(&d.mem, &[desc(DATA, 16, false), status], 0).unwrap();
    assert_eq!(v.0.lba, None, "no data, no LBAs");
    assert!(view(&d.mem, &[desc(DATA, 8, false), status], 0).is_none(), "no whole header: not shown");
}
