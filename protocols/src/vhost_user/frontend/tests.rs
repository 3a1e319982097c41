//! The frontend against a recording fake backend on a socketpair: what it
//! sends when, with which fds, and what the driver sees.

use super::*;
use crate::socket::recv_exact;
use iopath_devices::virtio::transport::NO_VECTOR;
use iopath_devices::{GuestMemoryMmap, Interrupts};
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use vm_memory::{FileOffset, GuestAddress};

const RAM: usize = 1 << 20;
const VERSION_1: u64 = 1 << 32;
const EVENT_IDX: u64 = 1 << 29;
/// Offered by the fake backend: CONFIG_WCE (11), MQ (12) and bit 34 must not reach the driver.
const BACKEND_FEATURES: u64 = VERSION_1 | EVENT_IDX | (1 << 30) | (1 << 2) | (1 << 11) | (1 << 12) | (1 << 34);
const CAPACITY: u64 = 4242;

/// (request, first 8 bytes of the body, fds) of each message.
type Log = Arc<Mutex<Vec<(u32, u64, usize)>>>;
/// The call fds the backend was given (SET_VRING_CALL), to call through.
type Calls = Arc<Mutex<Vec<std::fs::File>>>;

/// How the fake backend behaves.
#[derive(Clone, Copy, Default)]
struct Opts {
    /// Hangs up after answering this request.
    last: Option<u32>,
    /// Hangs up on the `n`th message (counting from 1), unanswered.
    hang_up_at: Option<usize>,
    /// Answers nothing from this request on (the socket stays open).
    stall_from: Option<u32>,
    /// Waits this long before each answer of the connect handshake.
    slow_handshake: Duration,
    /// Waits this long before each answer after the handshake.
    slow_ring: Duration,
    /// Offers protocol feature MQ and answers GET_QUEUE_NUM with this.
    queue_num: Option<u64>,
    /// The queues the frontend asks for (0: 1).
    queues: u16,
    /// Offers INFLIGHT_SHMFD and answers GET_INFLIGHT_FD with a memfd.
    inflight: bool,
}

/// Answers as a backend would, as `o` says.
fn fake_backend(s: UnixStream, log: Log, o: Opts, calls: Calls) {
    let mut connected = false;
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
        let n = {
            let mut l = iopath_devices::lock(&log);
            l.push((req, u64::from_le_bytes(first), fds.len()));
            l.len()
        };
        if o.hang_up_at == Some(n) {
            return;
        }
        if req == 13 {
            iopath_devices::lock(&calls).extend(fds);
        }
        if o.stall_from == Some(req) {
            let _ = std::io::Read::read_to_end(&mut &s, &mut Vec::new());
            return;
        }
        let answer = |b: &[u8]| {
            std::thread::sleep(if connected { o.slow_ring } else { o.slow_handshake });
            let mut h = Vec::new();
            for v in [req, 0x5, b.len() as u32] {
                h.extend_from_slice(&v.to_le_bytes());
            }
            let _ = crate::socket::send(&s, &[&h, b], &[]);
        };
        match req {
            1 => answer(&BACKEND_FEATURES.to_le_bytes()),
            15 => answer(
                &(0x200u64 | 0x8 | o.queue_num.map_or(0, |_| 1) | if o.inflight { 1 << 12 } else { 0 }).to_le_bytes(),
            ),
            31 => {
                // The region the frontend asked for, as a memfd of two pages.
                // SAFETY: a valid C string; the fd is owned by the File.
                let fd = unsafe { libc::memfd_create(c"vu-inflight".as_ptr(), libc::MFD_CLOEXEC) };
                assert!(fd >= 0);
                // SAFETY: just created, owned here.
                let f = unsafe { std::fs::File::from_raw_fd(fd) };
                f.set_len(8192).unwrap();
                let mut b = body.clone();
                b[..8].copy_from_slice(&8192u64.to_le_bytes());
                b[8..16].copy_from_slice(&0u64.to_le_bytes());
                let mut h = Vec::new();
                for v in [req, 0x5, b.len() as u32] {
                    h.extend_from_slice(&v.to_le_bytes());
                }
                let _ = crate::socket::send(&s, &[&h, &b], &[std::os::fd::AsRawFd::as_raw_fd(&f)]);
            }
            17 => answer(&o.queue_num.unwrap_or(0).to_le_bytes()),
            24 => {
                let mut b = body[..12].to_vec();
                let mut cfg = vec![0u8; body.len() - 12];
                cfg[..8].copy_from_slice(&CAPACITY.to_le_bytes());
                b.extend_from_slice(&cfg);
                answer(&b);
                connected = true;
            }
            11 => answer(&[0, 0, 0, 0, 7, 0, 0, 0]), // vring state {index 0, num 7}
            _ if flags & 0x8 != 0 => answer(&0u64.to_le_bytes()),
            _ => {}
        }
        if o.last == Some(req) {
            return;
        }
    }
}

/// A frontend against a fake backend, its log, the call fds it sent and the run's failures.
struct Rig {
    d: SharedDevice,
    dev: Arc<VirtioPci<VhostUserBlk>>,
    log: Log,
    calls: Calls,
    failed: Arc<Mutex<Vec<String>>>,
}

impl Rig {
    fn new(o: Opts, irq: Arc<dyn Interrupts>, child: Option<DeviceProcess>) -> Rig {
        let (mine, theirs) = UnixStream::pair().unwrap();
        let (log, calls): (Log, Calls) = Default::default();
        let (l, c) = (log.clone(), calls.clone());
        std::thread::spawn(move || fake_backend(theirs, l, o, c));
        let e = VhostUserBlk::handshake(mine, child, "vhost-user-blk", o.queues.max(1)).unwrap();
        let dev = Arc::new(VirtioPci::with_engine(e));
        iopath_devices::lock(dev.shared()).e.me = Arc::downgrade(dev.shared());
        let d: SharedDevice = dev.clone();
        let failed: Arc<Mutex<Vec<String>>> = Arc::default();
        let rig = Rig { d, dev, log, calls, failed };
        rig.d.attach(rig.ctx(irq));
        rig
    }

    fn ctx(&self, irq: Arc<dyn Interrupts>) -> DeviceContext {
        let mut ctx = DeviceContext::detached(ram());
        ctx.ioevents = Arc::new(IoEvents);
        ctx.irq = irq;
        let f = self.failed.clone();
        ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
        ctx
    }

    /// The requests sent from the `from`th on.
    fn reqs(&self, from: usize) -> Vec<u32> {
        iopath_devices::lock(&self.log)[from..].iter().map(|x| x.0).collect()
    }

    fn sent(&self) -> usize {
        iopath_devices::lock(&self.log).len()
    }

    /// The driver: reset, features, MSI-X on or off, queue 0 on `vector`, DRIVER_OK.
    fn driver_up(&self, msix: bool, vector: u16) {
        let d = &self.d;
        w(d, 0x14, 0, 1);
        w(d, 0x14, 3, 1);
        for sel in 0..2u64 {
            w(d, 0x08, sel, 4);
            w(d, 0x0c, ((VERSION_1 | EVENT_IDX) >> (32 * sel)) & 0xffff_ffff, 4);
        }
        w(d, 0x14, 3 | 8, 1);
        self.msix(msix);
        w(d, 0x16, 0, 2);
        w(d, 0x18, 8, 2);
        w(d, 0x1a, vector as u64, 2);
        start_queue(d, 0);
        w(d, 0x14, 3 | 8 | 4, 1);
    }

    /// MSI-X enable (message control's high byte).
    fn msix(&self, on: bool) {
        let msix = self.d.capabilities().iter().find(|c| c.id == 0x11).unwrap().offset;
        self.d.config_write(msix + 3, &[if on { 0x80 } else { 0 }]);
    }

    /// The last call fd the backend was given.
    fn last_call(&self) -> std::fs::File {
        iopath_devices::lock(&self.calls).last().expect("a call fd").try_clone().unwrap()
    }

    fn failures(&self) -> Vec<String> {
        iopath_devices::lock(&self.failed).clone()
    }
}

/// Waits (bounded: liveness only) until `f` holds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t = std::time::Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
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

/// The selected queue's rings at `base` + 0x1000 (descriptors), + 0x2000
/// (available) and + 0x3000 (used), then the queue enabled.
fn start_queue(d: &SharedDevice, base: u64) {
    w(d, 0x20, base + 0x1000, 8);
    w(d, 0x28, base + 0x2000, 8);
    w(d, 0x30, base + 0x3000, 8);
    w(d, 0x1c, 1, 2);
}

/// The driver's least before DRIVER_OK: ACKNOWLEDGE | DRIVER, VERSION_1
/// (high feature word 1), FEATURES_OK.
fn features_ok(d: &SharedDevice) {
    w(d, 0x14, 3, 1);
    w(d, 0x08, 1, 4);
    w(d, 0x0c, 1, 4);
    w(d, 0x14, 3 | 8, 1);
}

/// A device as the VMM makes it ([`connect`]) against a fake backend
/// acting as `o`, attached: its log, the call fds it was given and the
/// run's failures.
struct Attached {
    d: SharedDevice,
    log: Log,
    calls: Calls,
    failed: Arc<Mutex<Vec<String>>>,
}

/// [`Attached`] to guest RAM, with interrupts `irq` (None: none), the
/// VMM's ioeventfds if `ioevents` (else none) and failures recorded.
fn attached(o: Opts, irq: Option<Arc<dyn Interrupts>>, ioevents: bool) -> Attached {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let (log, calls): (Log, Calls) = Default::default();
    let (l, c) = (log.clone(), calls.clone());
    std::thread::spawn(move || fake_backend(theirs, l, o, c));
    let d = connect(mine, None, "vhost-user-blk", 1).unwrap();
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = failed.clone();
    let mut ctx = DeviceContext::detached(ram());
    if ioevents {
        ctx.ioevents = Arc::new(IoEvents);
    }
    if let Some(irq) = irq {
        ctx.irq = irq;
    }
    ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
    d.attach(ctx);
    Attached { d, log, calls, failed }
}

#[test]
fn nothing_reaches_the_backend_before_driver_ok_which_sets_up_ring_kick_and_irqfd() {
    let Attached { d, log, .. } = attached(Opts::default(), Some(Arc::new(Irqs(EventFd::new(0).unwrap()))), true);
    let reqs = |from: usize| iopath_devices::lock(&log)[from..].iter().map(|x| x.0).collect::<Vec<_>>();
    // Connect: owner, features, protocol features, configuration.
    assert_eq!(reqs(0), [3, 1, 15, 16, 24]);

    // The driver: features (what the backend offers that the transport passes).
    w(&d, 0x14, 0, 1);
    w(&d, 0x14, 3, 1);
    let offered = (0..2).map(|sel| (w(&d, 0x00, sel, 4), r(&d, 0x04, 4) << (32 * sel)).1).sum::<u64>();
    assert_eq!(offered, VERSION_1 | EVENT_IDX | (1 << 2) | (1 << 12), "no CONFIG_WCE, no bit 34, no PROTOCOL_FEATURES");
    assert_eq!(r(&d, 0x2000, 8), CAPACITY, "the backend's configuration");
    assert_eq!((r(&d, 0x2000 + 34, 2), r(&d, 0x12, 2)), (1, 1), "MQ with num_queues 1: the function's one queue");
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
    start_queue(&d, 0);
    assert_eq!(reqs(5), [] as [u32; 0], "nothing is sent before DRIVER_OK");

    w(&d, 0x14, 3 | 8 | 4, 1);
    let l = iopath_devices::lock(&log)[5..].to_vec();
    let got: Vec<u32> = l.iter().map(|x| x.0).collect();
    // The call fd goes before the kick, so the backend never runs the ring without one.
    assert_eq!(got, [2, 5, 8, 9, 10, 13, 12, 18], "{l:?}");
    assert_eq!(l[0].1, want | (1 << 30), "the driver's features and PROTOCOL_FEATURES");
    assert_eq!((l[1].2, l[5].2, l[6].2), (1, 1, 1), "memfd, call and kick fds");
    assert_eq!(l[2].1 >> 32, 8, "vring num");
    assert_eq!(r(&d, 0x14, 1), 3 | 8 | 4, "no NEEDS_RESET");
    assert_eq!((counter(&d, "activations"), counter(&d, "call_irqfd"), counter(&d, "kick_ioeventfd")), (1, 1, 1));

    // Reset disables the ring, then stops it (GET_VRING_BASE), as QEMU does.
    w(&d, 0x14, 0, 1);
    assert_eq!(reqs(13), [18, 11]);
    assert_eq!(iopath_devices::lock(&log)[13].1, 0, "SET_VRING_ENABLE {{index 0, num 0}}");
    assert_eq!(counter(&d, "backend_errors"), 0);
    d.quiesce();
}

#[test]
fn a_backend_that_hangs_up_before_driver_ok_makes_the_device_need_reset_and_stops_the_run() {
    let Attached { d, failed, .. } = attached(Opts { last: Some(24), ..Opts::default() }, None, false);
    features_ok(&d);
    start_queue(&d, 0);
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
    let intx = Arc::new(Intx::default());
    let Attached { d, calls, .. } = attached(Opts::default(), Some(intx.clone()), false); // no ioeventfds
    features_ok(&d);
    start_queue(&d, 0);
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
    let Attached { d, log, failed, .. } = attached(Opts::default(), None, false);
    features_ok(&d);
    w(&d, 0x14, 3 | 8 | 4, 1);
    assert_eq!(r(&d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    assert_eq!(iopath_devices::lock(&log).len(), 5, "only the connect handshake was sent");
    assert!(iopath_devices::lock(&failed).is_empty(), "a driver's mistake does not stop the run");
    d.quiesce();
}

/// MSI-X: vector 1 is `irqfd` (an irqfd in the VMM); records INTx and the vectors signalled.
struct Irq {
    irqfd: EventFd,
    intx: std::sync::atomic::AtomicBool,
    msix: Mutex<Vec<u16>>,
}
impl Irq {
    fn new() -> Arc<Irq> {
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        Arc::new(Irq { irqfd, intx: Default::default(), msix: Mutex::default() })
    }
    fn intx(&self) -> bool {
        self.intx.load(std::sync::atomic::Ordering::SeqCst)
    }
}
impl Interrupts for Irq {
    fn set_intx(&self, level: bool) {
        self.intx.store(level, std::sync::atomic::Ordering::SeqCst);
    }
    fn signal_msix(&self, v: u16) -> bool {
        iopath_devices::lock(&self.msix).push(v);
        true
    }
    fn msix_eventfd(&self, v: u16) -> Option<EventFd> {
        (v == 1).then(|| self.irqfd.try_clone().unwrap())
    }
}

/// SET_VRING_CALL messages sent from the `from`th message on, each with its fd.
fn call_msgs(rig: &Rig, from: usize) -> usize {
    let log = iopath_devices::lock(&rig.log);
    assert!(log[from..].iter().all(|m| m.0 != 13 || m.2 == 1), "a call fd each: {log:?}");
    log[from..].iter().filter(|m| m.0 == 13).count()
}

#[test]
fn config_wce_is_not_offered_since_configuration_writes_are_not_forwarded() {
    let rig = Rig::new(Opts::default(), Irq::new(), None);
    w(&rig.d, 0x00, 0, 4);
    assert_eq!(BACKEND_FEATURES & (1 << 11), 1 << 11, "the backend offers it");
    assert_eq!(r(&rig.d, 0x04, 4) & (1 << 11), 0, "the driver is not offered CONFIG_WCE");
    rig.d.quiesce();
}

#[test]
fn a_vector_change_or_msix_disable_after_driver_ok_gives_the_backend_a_new_call_fd() {
    let irq = Irq::new();
    let rig = Rig::new(Opts::default(), irq.clone(), None);
    rig.driver_up(true, 1);
    assert_eq!(counter(&rig.d, "call_irqfd"), 1, "vector 1's irqfd");
    let call = |rig: &Rig| (&rig.last_call()).write_all(&1u64.to_ne_bytes()).unwrap();
    let is_irqfd = |rig: &Rig| {
        call(rig);
        irq.irqfd.read().is_ok_and(|n| n == 1)
    };

    // MSI-X off: INTx, which only the VMM can raise: a new call fd it relays.
    let sent = rig.sent();
    rig.msix(false);
    assert_eq!(call_msgs(&rig, sent), 1, "{:?}", rig.reqs(sent));
    r(&rig.d, 0x1000, 1); // the ISR read takes INTx down (the switch raised one, in case)
    assert!(!is_irqfd(&rig));
    eventually("INTx", || irq.intx());
    assert_eq!(counter(&rig.d, "calls_relayed"), 1);

    // MSI-X on again: vector 1's irqfd again.
    let sent = rig.sent();
    rig.msix(true);
    assert_eq!(call_msgs(&rig, sent), 1, "{:?}", rig.reqs(sent));
    assert!(is_irqfd(&rig), "the call fd is vector 1's irqfd");

    // The driver moves the queue to vector 0 (unmasked, no irqfd here): a
    // new call fd, which the VMM relays to vector 0.
    let table = |v: u64, off: u64, val: u64| w(&rig.d, 0x4000 + 16 * v + off, val, 4);
    table(0, 0, 0xfee0_0000);
    table(0, 8, 0x30);
    table(0, 12, 0);
    let sent = rig.sent();
    w(&rig.d, 0x1a, 0, 2);
    assert_eq!(call_msgs(&rig, sent), 1, "{:?}", rig.reqs(sent));
    iopath_devices::lock(&irq.msix).clear();
    call(&rig);
    eventually("vector 0 raised", || iopath_devices::lock(&irq.msix).contains(&0));
    assert!(counter(&rig.d, "calls_relayed") >= 2);

    // Back to vector 1: its irqfd.
    let sent = rig.sent();
    w(&rig.d, 0x1a, 1, 2);
    assert_eq!(call_msgs(&rig, sent), 1, "{:?}", rig.reqs(sent));
    assert!(is_irqfd(&rig), "the call fd is vector 1's irqfd");
    assert_eq!((counter(&rig.d, "call_irqfd"), counter(&rig.d, "call_changes")), (3, 4));
    // Writing what is already there sends nothing.
    let sent = rig.sent();
    w(&rig.d, 0x1a, 1, 2);
    rig.msix(true);
    table(1, 12, 0);
    assert_eq!(rig.reqs(sent), [] as [u32; 0]);
    assert_eq!((r(&rig.d, 0x14, 1) & 64, counter(&rig.d, "backend_errors")), (0, 0));
    rig.d.quiesce();
}

#[test]
fn a_second_driver_ok_after_reset_sets_memory_kick_and_call_again_and_the_old_relay_ends() {
    let rig = Rig::new(Opts::default(), Irq::new(), None);
    rig.driver_up(false, NO_VECTOR);
    assert_eq!(counter(&rig.d, "activations"), 1);
    let relays = iopath_devices::lock(rig.dev.shared()).e.relays.clone();
    assert_eq!(relays.load(std::sync::atomic::Ordering::Acquire), 1, "INTx: a relay");
    let sent = rig.sent();
    rig.driver_up(false, NO_VECTOR); // writes status 0 first: a reset
    let l = iopath_devices::lock(&rig.log)[sent..].to_vec();
    for (req, what) in [(5, "SET_MEM_TABLE"), (12, "SET_VRING_KICK"), (13, "SET_VRING_CALL")] {
        assert!(l.iter().any(|m| m.0 == req && m.2 == 1), "{what} with its fd again: {l:?}");
    }
    assert!(l.iter().position(|m| m.0 == 11) < l.iter().position(|m| m.0 == 2), "stopped before set up again");
    assert_eq!(counter(&rig.d, "activations"), 2);
    eventually("the first relay ends", || relays.load(std::sync::atomic::Ordering::Acquire) == 1);
    assert_eq!((r(&rig.d, 0x14, 1), counter(&rig.d, "backend_errors")), (3 | 8 | 4, 0));
    rig.d.quiesce();
    eventually("no relay after quiesce", || relays.load(std::sync::atomic::Ordering::Acquire) == 0);
}

#[test]
fn one_deadline_bounds_all_of_driver_ok_not_each_request() {
    // Each answer comes within the bound, but the 8 of DRIVER_OK together do not.
    let o = Opts { slow_ring: Duration::from_secs(1), ..Opts::default() };
    let rig = Rig::new(o, Irq::new(), None);
    rig.driver_up(true, 1);
    assert_eq!(r(&rig.d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    let f = rig.failures();
    assert!(f.iter().any(|m| m.contains("timed out")), "the run stops: {f:?}");
    rig.d.quiesce();
}

#[test]
fn one_deadline_bounds_the_whole_connect_handshake() {
    let (mine, theirs) = UnixStream::pair().unwrap();
    let o = Opts { slow_handshake: Duration::from_secs(2), ..Opts::default() };
    std::thread::spawn(move || fake_backend(theirs, Log::default(), o, Calls::default()));
    match VhostUserBlk::handshake(mine, None, "vhost-user-blk", 1) {
        Ok(_) => panic!("three answers 2 s apart passed the 5 s bound"),
        Err(e) => assert!(matches!(e, Error::Timeout { .. }), "{e}"),
    }
}

#[test]
fn a_backend_timeout_is_the_one_cause_given_not_also_a_closed_socket() {
    let rig = Rig::new(Opts { stall_from: Some(2), ..Opts::default() }, Irq::new(), None);
    rig.driver_up(true, 1);
    assert_eq!(r(&rig.d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    // The socket watcher polls every 100 ms: give it ten times that.
    std::thread::sleep(Duration::from_secs(1));
    let f = rig.failures();
    assert!(f.iter().any(|m| m.contains("timed out")), "{f:?}");
    assert!(!f.iter().any(|m| m.contains("closed its socket")), "a second, wrong cause: {f:?}");
    rig.d.quiesce();
}

#[test]
fn quiesce_waits_for_the_device_process_without_holding_the_device_lock() {
    // A "device process" that prints no counters and exits after 4 s.
    let dir = std::env::temp_dir().join(format!("iopath-vu-quiesce-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("slow-device");
    std::fs::write(&exe, "#!/bin/sh\nexec sleep 4\n").unwrap();
    std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (_keep, theirs) = UnixStream::pair().unwrap();
    let child = DeviceProcess::spawn(&exe, &[], theirs.into()).unwrap();
    let rig = Rig::new(Opts::default(), Irq::new(), Some(child));
    let d = rig.d.clone();
    let q = std::thread::spawn(move || d.quiesce());
    std::thread::sleep(Duration::from_millis(500));
    // A vCPU reading the device is not held up by the wait for the counters.
    r(&rig.d, 0x14, 1);
    assert!(!q.is_finished(), "the register read waited for quiesce");
    q.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn attaching_again_starts_no_second_socket_watcher() {
    let irq = Irq::new();
    let rig = Rig::new(Opts::default(), irq.clone(), None);
    rig.d.attach(rig.ctx(irq));
    assert_eq!(iopath_devices::lock(rig.dev.shared()).e.peer.watchers(), 1);
    rig.d.quiesce();
}

#[test]
fn a_backend_that_hangs_up_at_a_call_fd_change_needs_reset_and_a_reset_sends_it_nothing() {
    // Connect (5) and DRIVER_OK (8), then the new SET_VRING_CALL is the 14th message.
    let irq = Irq::new();
    let rig = Rig::new(Opts { hang_up_at: Some(14), ..Opts::default() }, irq, None);
    rig.driver_up(true, 1);
    assert_eq!(r(&rig.d, 0x14, 1), 3 | 8 | 4);
    rig.msix(false);
    assert_eq!(rig.reqs(13), [13]);
    assert_eq!(r(&rig.d, 0x14, 1) & 64, 64, "DEVICE_NEEDS_RESET");
    let f = rig.failures();
    assert!(f.iter().any(|m| m.contains("SET_VRING_CALL")), "the run stops: {f:?}");
    let errors = counter(&rig.d, "ring_errors");
    w(&rig.d, 0x14, 0, 1);
    assert_eq!((rig.sent(), counter(&rig.d, "ring_errors")), (14, errors), "nothing sent, no new error");
    rig.d.quiesce();
}

mod mq;
mod reconnect;
