//! Cheap connections against `iopath serve --socket PATH`'s acceptor: many
//! idle ones, ones that close before a byte, ones that trickle their first
//! message. None may keep a good client waiting, and what they cost the
//! server is bounded. The server runs in a thread of this process with the
//! default bounds (a 10 s handshake); each wait here is a liveness bound,
//! none measures speed (`examples/acceptor_bench.rs` does).

mod common;

use iopath_protocols::serve::{run, Listen, ServeOptions, Timeouts, MAX_PENDING};
use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a client waits for anything before it calls the server hung
/// (the old acceptor kept a client out 9 s behind 5 idle connections).
const HUNG: Duration = Duration::from_secs(10);

fn serve(name: &str, transport: &str, once: bool, timeouts: Timeouts) -> (PathBuf, JoinHandle<()>) {
    let path = common::scratch(&format!("idle-{name}")).join("dev.sock");
    let o = ServeOptions {
        device: "pci-testdev".parse().unwrap(),
        transport: iopath_protocols::transport(transport).unwrap(),
        listen: Listen::Socket(path.clone()),
        once,
        keep_state: false,
        timeouts,
        seccomp: false, // in a thread of the test process
        control: None,
        controllers: 1,
        pollers: None,
    };
    let h = std::thread::spawn(move || run(&o).unwrap());
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < HUNG, "the server never listened on {}", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
    (path, h)
}

fn dial(path: &Path) -> UnixStream {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(HUNG)).unwrap();
    s.set_write_timeout(Some(HUNG)).unwrap();
    s
}

/// `n` connections that never send a byte.
fn idle(path: &Path, n: usize) -> Vec<UnixStream> {
    (0..n).map(|_| UnixStream::connect(path).unwrap()).collect()
}

/// VERSION on `s`: Ok, or the errno of its error reply.
fn version(s: &UnixStream) -> Result<(), u32> {
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: None }.to_bytes();
    socket::send(s, &[&message(1, Command::Version, FLAGS_TYPE_COMMAND, &v)], &[]).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(s, &mut h).unwrap_or_else(|e| panic!("no reply to VERSION within {HUNG:?}: {e}"));
    let r = Header::parse(&h);
    let mut p = vec![0u8; r.payload_len().unwrap()];
    socket::recv_exact(s, &mut p).unwrap();
    if r.is_error() {
        Err(r.error_no)
    } else {
        Ok(())
    }
}

/// pci-testdev's vendor id, read through configuration space.
fn vendor(s: &UnixStream) -> u16 {
    let q = RegionAccess { offset: 0, region: PCI_CONFIG_REGION_INDEX, count: 4 }.to_bytes();
    socket::send(s, &[&message(2, Command::RegionRead, FLAGS_TYPE_COMMAND, &q)], &[]).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(s, &mut h).unwrap();
    let mut p = vec![0u8; Header::parse(&h).payload_len().unwrap()];
    socket::recv_exact(s, &mut p).unwrap();
    let (_, data) = RegionAccess::parse_with_data(&p).unwrap();
    u16::from_le_bytes([data[0], data[1]])
}

/// True if the server has closed `s` (end of stream or reset) by now.
fn closed_now(s: &UnixStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 64];
    let r = (&*s).read(&mut b);
    s.set_nonblocking(false).unwrap();
    match r {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == ErrorKind::WouldBlock => false,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => true,
        Err(e) => panic!("reading: {e}"),
    }
}

/// Runs `f` on its own thread, failing the test if it takes more than
/// [`HUNG`] (a vhost-user frontend waits for its replies for ever).
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(HUNG).unwrap_or_else(|e| panic!("{what}: not served within {HUNG:?} ({e})"))
}

/// Waits (bounded) for a server with `once` to return.
fn joined(h: JoinHandle<()>) {
    let t0 = Instant::now();
    while !h.is_finished() {
        assert!(t0.elapsed() < HUNG, "the server still runs {HUNG:?} after its one client");
        std::thread::sleep(Duration::from_millis(5));
    }
    h.join().expect("the server panicked");
}

/// 50 idle connections (each would have held the old acceptor's one slot,
/// or 2 s of its refusals): a client that speaks is served at once, as if
/// they were not there.
#[test]
fn a_client_is_served_while_50_idle_connections_are_held() {
    let (path, h) = serve("fifty", "vfio-user", true, Timeouts::default());
    let held = idle(&path, 50);
    let c = dial(&path);
    assert_eq!(version(&c), Ok(()), "the good client was refused");
    assert_eq!(vendor(&c), 0x1b36);
    drop(c);
    joined(h);
    drop(held);
}

/// A flood past [`MAX_PENDING`] (with a handshake bound of an hour, so that
/// only the bound closes them): the server closes all but the newest
/// `MAX_PENDING` at once, and the client that comes after them is served.
#[test]
fn a_flood_past_the_bound_is_closed_and_costs_the_client_nothing() {
    let t = Timeouts { handshake: Duration::from_secs(3600), ..Timeouts::default() };
    let (path, h) = serve("flood", "vfio-user", true, t);
    let n = 4 * MAX_PENDING;
    let held = idle(&path, n);
    let c = dial(&path);
    assert_eq!(version(&c), Ok(()));
    // The acceptor took the flood before the client (the kernel queues
    // connections in order), keeping no more than MAX_PENDING of them.
    let closed = held.iter().filter(|s| closed_now(s)).count();
    assert!(closed >= n - MAX_PENDING, "{closed} of {n} idle connections closed; at most {MAX_PENDING} may wait");
    // The oldest went first.
    assert!(closed_now(&held[0]) && !closed_now(&held[n - 1]), "not the oldest silent connections closed");
    drop(c);
    joined(h);
}

/// A connection closed before its first byte (the probe the old
/// `--socket` made of a live server) is not a client: `--once` goes on
/// waiting and serves the next one.
#[test]
fn a_connection_closed_before_a_byte_is_not_the_once_client() {
    let (path, h) = serve("empty", "vfio-user", true, Timeouts::default());
    for _ in 0..3 {
        drop(UnixStream::connect(&path).unwrap());
    }
    // Time for a server that took one of them for its client to end.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!h.is_finished(), "an empty connection was taken for the one client");
    let c = dial(&path);
    assert_eq!(version(&c), Ok(()));
    drop(c);
    joined(h);
}

/// While a client is served, 50 idle connections and 20 that send one byte
/// of a header and stall are held; a client that comes after them is told
/// EBUSY (not after them one by one), and the first is still served.
#[test]
fn a_second_client_is_refused_promptly_behind_idle_and_trickling_connections() {
    let (path, _server) = serve("busy", "vfio-user", false, Timeouts::default());
    let a = dial(&path);
    assert_eq!(version(&a), Ok(()));
    let held = idle(&path, 50);
    let trickling: Vec<UnixStream> = (0..20)
        .map(|_| {
            let s = UnixStream::connect(&path).unwrap();
            socket::send(&s, &[&[0u8]], &[]).unwrap();
            s
        })
        .collect();
    let b = dial(&path);
    assert_eq!(version(&b), Err(libc::EBUSY as u32), "the reply to a client that came second");
    assert_eq!(vendor(&a), 0x1b36, "the first client is still served");
    // Every refused or silent connection is closed by now or soon.
    let t0 = Instant::now();
    while !trickling.iter().chain(&held).all(closed_now) {
        assert!(t0.elapsed() < HUNG, "idle or trickling connections still open while a client is served");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The same for a vhost-user backend: a frontend is served while 50 idle
/// connections are held.
#[test]
fn a_vhost_user_frontend_is_served_while_50_idle_connections_are_held() {
    use iopath_devices::block::StorageKind;
    use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
    use iopath_protocols::serve::{run, ServeOptions};
    use iopath_protocols::vhost_user::backend::FEATURES;
    use vhost::vhost_user::Frontend;
    use vhost::VhostBackend;
    let path = common::scratch("idle-vhost").join("vhost.sock");
    let o = ServeOptions {
        device: iopath_devices::DeviceConfig::VirtioBlk(VirtioBlkConfig {
            backend: StorageKind::Null,
            size: 1 << 20,
            notify: NotifyMode::Ioeventfd,
            ..VirtioBlkConfig::default()
        }),
        transport: iopath_protocols::transport("vhost-user").unwrap(),
        listen: Listen::Socket(path.clone()),
        once: true,
        keep_state: false,
        timeouts: Timeouts::default(),
        seccomp: false,
        control: None,
        controllers: 1,
        pollers: None,
    };
    let h = std::thread::spawn(move || run(&o).unwrap());
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < HUNG, "no socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    let held = idle(&path, 50);
    let features = within("a frontend behind 50 idle connections", move || {
        let f = Frontend::connect(&path, 1).unwrap();
        f.get_features().unwrap()
    });
    assert_eq!(features, FEATURES);
    joined(h);
    drop(held);
}
