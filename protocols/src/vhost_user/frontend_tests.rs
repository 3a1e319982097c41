//! The frontend against a recording fake backend on a socketpair: what it
//! sends when, with which fds, and what the driver sees.

use super::*;
use crate::socket::recv_exact;
use iopath_devices::{GuestMemoryMmap, Interrupts};
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use vm_memory::{FileOffset, GuestAddress};

const RAM: usize = 1 << 20;
const VERSION_1: u64 = 1 << 32;
const EVENT_IDX: u64 = 1 << 29;
const BACKEND_FEATURES: u64 = VERSION_1 | EVENT_IDX | (1 << 30) | (1 << 2) | (1 << 12) | (1 << 34);
const CAPACITY: u64 = 4242;

/// (request, first 8 bytes of the body, fds) of each message.
type Log = Arc<Mutex<Vec<(u32, u64, usize)>>>;
/// The call fds the backend was given (SET_VRING_CALL), to call through.
type Calls = Arc<Mutex<Vec<std::fs::File>>>;

/// Answers as a backend would; hangs up after answering `last` if given.
fn fake_backend(s: UnixStream, log: Log, last: Option<u32>, calls: Calls) {
    loop {
        let mut hdr = [0u8; 12];
        let Ok(fds) = recv_exact(&s, &mut hdr) else { return };
        let f = |i: usize| u32::from_le_bytes(hdr[4 * i..4 * i + 4].try_into().unwrap());
        let (req, flags, size) = (f(0), f(1), f(2));
        let mut body = vec![0u8; size as usize];
        if recv_exact(&s, &mut body).is_err() {
            return;
        }
        let mut first = [0u8; 8];
        let n = body.len().min(8);
        first[..n].copy_from_slice(&body[..n]);
        iopath_devices::lock(&log).push((req, u64::from_le_bytes(first), fds.len()));
        if req == 13 {
            iopath_devices::lock(&calls).extend(fds);
        }
        let answer = |b: &[u8]| {
            let mut h = Vec::new();
            for v in [req, 0x5, b.len() as u32] {
                h.extend_from_slice(&v.to_le_bytes());
            }
            crate::socket::send(&s, &[&h, b], &[]).unwrap();
        };
        match req {
            1 => answer(&BACKEND_FEATURES.to_le_bytes()),
            15 => answer(&(0x200u64 | 0x8).to_le_bytes()),
            24 => {
                let mut b = body[..12].to_vec();
                let mut cfg = vec![0u8; body.len() - 12];
                cfg[..8].copy_from_slice(&CAPACITY.to_le_bytes());
                b.extend_from_slice(&cfg);
                answer(&b);
            }
            11 => answer(&[0, 0, 0, 0, 7, 0, 0, 0]), // vring state {index 0, num 7}
            _ if flags & 0x8 != 0 => answer(&0u64.to_le_bytes()),
            _ => {}
        }
        if last == Some(req) {
            return;
        }
    }
}

/// Guest RAM in a memfd, as the VMM's is.
fn ram() -> GuestMemoryMmap {
    // SAFETY: a valid C string; the fd is owned by the File.
    let fd = unsafe { libc::memfd_create(c"vu-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd was just created and is owned here.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(RAM as u64).unwrap();
    GuestMemoryMmap::from_ranges_with_files([(GuestAddress(0), RAM, Some(FileOffset::new(f, 0)))]).unwrap()
}

/// MSI-X: vector 1 is an eventfd (an irqfd in the VMM).
struct Irqs(EventFd);
impl Interrupts for Irqs {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        true
    }
    fn msix_eventfd(&self, v: u16) -> Option<EventFd> {
        (v == 1).then(|| self.0.try_clone().unwrap())
    }
}

struct IoEvents;
impl iopath_devices::IoEvents for IoEvents {
    fn register(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
}

fn w(d: &SharedDevice, off: u64, v: u64, len: usize) {
    d.bar_write(0, off, &v.to_le_bytes()[..len]);
}
fn r(d: &SharedDevice, off: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    d.bar_read(0, off, &mut b[..len]);
    u64::from_le_bytes(b)
}
fn counter(d: &SharedDevice, name: &str) -> u64 {
    d.counters().iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

#[test]
fn nothing_reaches_the_backend_before_driver_ok_which_sets_up_ring_kick_and_irqfd() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    std::thread::spawn(move || fake_backend(theirs, l, None, Calls::default()));
    let d = connect(mine, None, "vhost-user-blk").unwrap();
    let mut ctx = DeviceContext::detached(ram());
    ctx.ioevents = Arc::new(IoEvents);
    ctx.irq = Arc::new(Irqs(EventFd::new(0).unwrap()));
    d.attach(ctx);
    let reqs = |from: usize| iopath_devices::lock(&log)[from..].iter().map(|x| x.0).collect::<Vec<_>>();
    // Connect: owner, features, protocol features, configuration.
    assert_eq!(reqs(0), [3, 1, 15, 16, 24]);

    // The driver: features (what the backend offers that the transport passes).
    w(&d, 0x14, 0, 1);
    w(&d, 0x14, 3, 1);
    let offered = (0..2).map(|sel| (w(&d, 0x00, sel, 4), r(&d, 0x04, 4) << (32 * sel)).1).sum::<u64>();
    assert_eq!(offered, VERSION_1 | EVENT_IDX | (1 << 2), "no MQ, no bit 34, no PROTOCOL_FEATURES");
    assert_eq!(r(&d, 0x2000, 8), CAPACITY, "the backend's configuration");
    let want = VERSION_1 | EVENT_IDX;
    for sel in 0..2u64 {
        w(&d, 0x08, sel, 4);
        w(&d, 0x0c, (want >> (32 * sel)) & 0xffff_ffff, 4);
    }
    w(&d, 0x14, 3 | 8, 1);
    assert_eq!(r(&d, 0x14, 1), 3 | 8);
    // MSI-X on, queue 0 on vector 1, rings in RAM.
    let msix = d.capabilities().iter().find(|c| c.id == 0x11).unwrap().offset;
    d.config_write(msix + 3, &[0x80]);
    w(&d, 0x16, 0, 2);
    w(&d, 0x18, 8, 2);
    w(&d, 0x1a, 1, 2);
    w(&d, 0x20, 0x1000, 8);
    w(&d, 0x28, 0x2000, 8);
    w(&d, 0x30, 0x3000, 8);
    w(&d, 0x1c, 1, 2);
    assert_eq!(reqs(5), [] as [u32; 0], "nothing is sent before DRIVER_OK");

    w(&d, 0x14, 3 | 8 | 4, 1);
    let l = iopath_devices::lock(&log)[5..].to_vec();
    let got: Vec<u32> = l.iter().map(|x| x.0).collect();
    assert_eq!(got, [2, 5, 8, 9, 10, 12, 13, 18], "{l:?}");
    assert_eq!(l[0].1, want | (1 << 30), "the driver's features and PROTOCOL_FEATURES");
    assert_eq!((l[1].2, l[5].2, l[6].2), (1, 1, 1), "memfd, kick and call fds");
    assert_eq!(l[2].1 >> 32, 8, "vring num");
    assert_eq!(r(&d, 0x14, 1), 3 | 8 | 4, "no NEEDS_RESET");
    assert_eq!((counter(&d, "activations"), counter(&d, "call_irqfd"), counter(&d, "kick_ioeventfd")), (1, 1, 1));

    // Reset stops the ring.
    w(&d, 0x14, 0, 1);
    assert_eq!(reqs(13), [11]);
    assert_eq!(counter(&d, "backend_errors"), 0);
    d.quiesce();
}

#[test]
fn a_backend_that_hangs_up_before_driver_ok_makes_the_device_need_reset_and_stops_the_run() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    std::thread::spawn(move || fake_backend(theirs, l, Some(24), Calls::default()));
    let d = connect(mine, None, "vhost-user-blk").unwrap();
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = failed.clone();
    let mut ctx = DeviceContext::detached(ram());
    ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
    d.attach(ctx);
    w(&d, 0x14, 3, 1);
    w(&d, 0x08, 1, 4);
    w(&d, 0x0c, 1, 4);
    w(&d, 0x14, 3 | 8, 1);
    w(&d, 0x20, 0x1000, 8);
    w(&d, 0x28, 0x2000, 8);
    w(&d, 0x30, 0x3000, 8);
    w(&d, 0x1c, 1, 2);
    w(&d, 0x14, 3 | 8 | 4, 1);
    assert_eq!(r(&d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    assert_eq!((counter(&d, "ring_errors"), counter(&d, "backend_errors"), counter(&d, "activations")), (1, 1, 0));
    let failed = iopath_devices::lock(&failed).clone();
    assert!(failed.iter().any(|m| m.contains("SET_FEATURES")), "the run stops: {failed:?}");
    // Nothing more is sent to a backend given up on; a reset is no error.
    w(&d, 0x14, 0, 1);
    assert_eq!(counter(&d, "backend_errors"), 1);
    d.quiesce();
}

/// Records INTx.
#[derive(Default)]
struct Intx(std::sync::atomic::AtomicBool);
impl Interrupts for Intx {
    fn set_intx(&self, level: bool) {
        self.0.store(level, std::sync::atomic::Ordering::SeqCst);
    }
    fn signal_msix(&self, _: u16) -> bool {
        false
    }
}

#[test]
fn without_ioeventfd_or_msix_the_vmm_passes_kicks_on_and_relays_calls_as_intx() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let (log, calls): (Log, Calls) = Default::default();
    let (l, c) = (log.clone(), calls.clone());
    std::thread::spawn(move || fake_backend(theirs, l, None, c));
    let d = connect(mine, None, "vhost-user-blk").unwrap();
    let intx = Arc::new(Intx::default());
    let mut ctx = DeviceContext::detached(ram()); // no ioeventfds
    ctx.irq = intx.clone();
    d.attach(ctx);
    w(&d, 0x14, 3, 1);
    w(&d, 0x08, 1, 4);
    w(&d, 0x0c, 1, 4);
    w(&d, 0x14, 3 | 8, 1);
    w(&d, 0x20, 0x1000, 8);
    w(&d, 0x28, 0x2000, 8);
    w(&d, 0x30, 0x3000, 8);
    w(&d, 0x1c, 1, 2);
    w(&d, 0x14, 3 | 8 | 4, 1);
    assert_eq!((counter(&d, "kick_ioeventfd"), counter(&d, "call_irqfd"), counter(&d, "activations")), (0, 0, 1));
    // A notify write exits to the VMM, which kicks the backend's eventfd.
    w(&d, 0x3000, 0, 2);
    assert_eq!((counter(&d, "notifies"), counter(&d, "kicks_forwarded")), (1, 1));
    // The backend calls: the relay raises INTx with ISR bit 0 (bounded wait, liveness only).
    let call = iopath_devices::lock(&calls).pop().expect("a call fd");
    (&call).write_all(&1u64.to_ne_bytes()).unwrap();
    let t = std::time::Instant::now();
    while !intx.0.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(t.elapsed() < Duration::from_secs(10), "no INTx");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(counter(&d, "calls_relayed"), 1);
    assert_eq!(r(&d, 0x1000, 1), 1, "ISR: a queue interrupt");
    d.quiesce();
}

#[test]
fn driver_ok_without_the_queue_enabled_needs_reset_but_sends_nothing_and_runs_on() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let log: Log = Arc::default();
    let l = log.clone();
    std::thread::spawn(move || fake_backend(theirs, l, None, Calls::default()));
    let d = connect(mine, None, "vhost-user-blk").unwrap();
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = failed.clone();
    let mut ctx = DeviceContext::detached(ram());
    ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
    d.attach(ctx);
    w(&d, 0x14, 3, 1);
    w(&d, 0x08, 1, 4);
    w(&d, 0x0c, 1, 4);
    w(&d, 0x14, 3 | 8, 1);
    w(&d, 0x14, 3 | 8 | 4, 1);
    assert_eq!(r(&d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    assert_eq!(iopath_devices::lock(&log).len(), 5, "only the connect handshake was sent");
    assert!(iopath_devices::lock(&failed).is_empty(), "a driver's mistake does not stop the run");
    d.quiesce();
}
