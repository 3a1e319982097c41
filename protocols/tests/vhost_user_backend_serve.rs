//! `iopath serve virtio-blk --transport vhost-user --socket PATH --once`'s
//! loop (`serve::run` over the registry's `vhost-user`): one frontend at a time (another that
//! comes meanwhile is closed), a connection that sends nothing within the
//! handshake bound is dropped and is not the one client `--once` waits for.

use iopath_devices::block::StorageKind;
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
use iopath_devices::DeviceConfig;
use iopath_protocols::serve::{run, Listen, ServeOptions, Timeouts};
use iopath_protocols::vhost_user::backend::FEATURES;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vhost::vhost_user::Frontend;
use vhost::VhostBackend;

mod common;

fn sock(tag: &str) -> PathBuf {
    common::scratch(tag).join("vhost-user.sock")
}

/// `iopath serve virtio-blk,backend=null,size_mb=1,notify=ioeventfd
/// --transport vhost-user --socket PATH`, found in the registry by name.
fn options(path: &Path, once: bool, timeouts: Timeouts) -> ServeOptions {
    let device = VirtioBlkConfig {
        backend: StorageKind::Null,
        size: 1 << 20,
        notify: NotifyMode::Ioeventfd,
        ..VirtioBlkConfig::default()
    };
    ServeOptions {
        device: DeviceConfig::VirtioBlk(device),
        transport: iopath_protocols::transport("vhost-user").unwrap(),
        listen: Listen::Socket(path.to_path_buf()),
        once,
        keep_state: false,
        timeouts,
        seccomp: false,
        control: None,
        controllers: 1,
        pollers: None,
    }
}

fn start(path: &PathBuf, handshake: Duration) -> std::thread::JoinHandle<iopath_protocols::Result<()>> {
    let _ = std::fs::remove_file(path);
    let o = options(path, true, Timeouts { handshake, ..Timeouts::default() });
    let t = std::thread::spawn(move || run(&o));
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    t
}

/// Waits (bounded) for the serve loop to return.
fn ended(t: std::thread::JoinHandle<iopath_protocols::Result<()>>) -> iopath_protocols::Result<()> {
    let t0 = Instant::now();
    while !t.is_finished() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the serve loop did not return");
        std::thread::sleep(Duration::from_millis(10));
    }
    t.join().unwrap()
}

#[test]
fn a_second_frontend_is_closed_while_one_is_served() {
    let path = sock("busy");
    let t = start(&path, Duration::from_secs(10));
    let a = Frontend::connect(&path, 1).unwrap();
    a.set_owner().unwrap();
    assert_eq!(a.get_features().unwrap(), FEATURES);
    // The second one is closed (EOF) within the refusal bound, unanswered.
    let mut b = UnixStream::connect(&path).unwrap();
    b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(b.read(&mut buf).unwrap(), 0, "the second frontend was not closed");
    // The first one is still served.
    assert_eq!(a.get_features().unwrap(), FEATURES);
    drop(a);
    ended(t).unwrap();
}

#[test]
fn a_silent_connection_is_dropped_and_once_waits_for_a_frontend() {
    let path = sock("silent");
    let t = start(&path, Duration::from_millis(300));
    let mut silent = UnixStream::connect(&path).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(silent.read(&mut buf).unwrap(), 0, "a silent connection was kept");
    assert!(!t.is_finished(), "--once took the silent connection for its client");
    let a = Frontend::connect(&path, 1).unwrap();
    assert_eq!(a.get_features().unwrap(), FEATURES);
    drop(a);
    ended(t).unwrap();
}

/// Serves with `message` as both the message and the send bound, without
/// `--once` (the stalled frontend's session counts as a client's): the
/// loop's thread is left running when the test ends.
fn start_bounded(path: &PathBuf, message: Duration) {
    let _ = std::fs::remove_file(path);
    let o = options(path, false, Timeouts { message, send: message, ..Timeouts::default() });
    std::thread::spawn(move || run(&o));
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A frontend is served within 10 s of the stalled one's connecting: the
/// stalled one is closed (EOF).
fn next_frontend_served(path: &PathBuf, stalled: Option<UnixStream>) {
    let t0 = Instant::now();
    loop {
        assert!(t0.elapsed() < Duration::from_secs(10), "the stalled frontend still holds the one client slot");
        // Refused (closed) while the stalled one is served: try again.
        if let Ok(a) = Frontend::connect(path, 1) {
            if a.get_features().ok() == Some(FEATURES) {
                drop(a);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some(mut stalled) = stalled {
        stalled.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(stalled.read(&mut buf).unwrap_or(0), 0, "the stalled frontend was not closed");
    }
}

/// One byte of a header, then silence: the crate would wait for the rest
/// for ever; the session ends once the message bound has passed.
#[test]
fn a_frontend_that_stops_in_a_header_does_not_hold_the_slot() {
    use std::io::Write;
    let path = sock("header");
    start_bounded(&path, Duration::from_millis(500));
    let mut stalled = UnixStream::connect(&path).unwrap();
    stalled.write_all(&[1]).unwrap();
    next_frontend_served(&path, Some(stalled));
}

/// A frontend that sends requests and never reads the replies: the
/// crate's reply write would wait for room for ever once the socket is
/// full; the watchdog shuts the socket down once the request's bound has
/// passed.
#[test]
fn a_frontend_that_reads_no_replies_does_not_hold_the_slot() {
    use std::io::Write;
    let path = sock("noreader");
    start_bounded(&path, Duration::from_millis(500));
    let mut stalled = UnixStream::connect(&path).unwrap();
    stalled.set_nonblocking(true).unwrap();
    let mut hdr = [0u8; 12];
    hdr[0..4].copy_from_slice(&1u32.to_le_bytes()); // GET_FEATURES
    hdr[4..8].copy_from_slice(&1u32.to_le_bytes()); // version 1
                                                    // Requests until both directions are full (the backend blocked on a reply).
    let t0 = Instant::now();
    let mut idle = 0;
    while idle < 20 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the socket never filled");
        match stalled.write(&hdr) {
            Ok(_) => idle = 0,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                idle += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => break, // already shut down
        }
    }
    // Its replies stay unread while the next frontend comes.
    next_frontend_served(&path, None);
    drop(stalled);
}

/// Five bytes of a header, then the frontend leaves: its session ends at
/// once, not after the message bound (a minute here): the next frontend is
/// served within `next_frontend_served`'s 10 s.
#[test]
fn a_frontend_that_leaves_inside_a_header_is_dropped_at_once() {
    use std::io::Write;
    let path = sock("partial");
    start_bounded(&path, Duration::from_secs(60));
    // The file is there from bind(2), the socket listens from listen(2): retry.
    let t0 = Instant::now();
    let mut gone = loop {
        match UnixStream::connect(&path) {
            Ok(s) => break s,
            Err(e) => assert!(t0.elapsed() < Duration::from_secs(10), "{e}"),
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    gone.write_all(&[1, 0, 0, 0, 1]).unwrap();
    drop(gone);
    next_frontend_served(&path, None);
}

/// A device vhost-user does not carry, or --keep-state, is refused before
/// anything is bound: typed errors, and no socket file at PATH.
#[test]
fn what_vhost_user_cannot_serve_is_refused_before_the_socket_is_bound() {
    let path = sock("refused");
    let _ = std::fs::remove_file(&path);
    for device in ["nvme", "pci-testdev"] {
        let o = ServeOptions { device: device.parse().unwrap(), ..options(&path, true, Timeouts::default()) };
        let e = run(&o).unwrap_err();
        assert!(
            matches!(&e, iopath_protocols::Error::Carry { transport: "vhost-user", device: d, .. } if d == device),
            "{e:?}"
        );
        assert!(e.to_string().contains("virtio-blk@vhost-user"), "{e}");
    }
    let o = ServeOptions { keep_state: true, ..options(&path, true, Timeouts::default()) };
    let e = run(&o).unwrap_err().to_string();
    assert!(e.contains("--keep-state does not apply to --transport vhost-user"), "{e}");
    assert!(!path.exists(), "nothing bound");
}
