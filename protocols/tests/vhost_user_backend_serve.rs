//! `iopath serve virtio-blk --transport vhost-user --socket PATH --once`'s
//! loop (`vhost_user::backend::run`): one frontend at a time (another that
//! comes meanwhile is closed), a connection that sends nothing within the
//! handshake bound is dropped and is not the one client `--once` waits for.

use iopath_devices::nvme::backend::BackendKind;
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
use iopath_protocols::serve::{Listen, Timeouts};
use iopath_protocols::vhost_user::backend::{run, VhostUserServeOptions, FEATURES};
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vhost::vhost_user::Frontend;
use vhost::VhostBackend;

fn sock(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("iopath-vub-serve-{tag}-{}.sock", std::process::id()))
}

fn start(path: &PathBuf, handshake: Duration) -> std::thread::JoinHandle<iopath_protocols::Result<()>> {
    let _ = std::fs::remove_file(path);
    let o = VhostUserServeOptions {
        device: VirtioBlkConfig { backend: BackendKind::Null, size: 1 << 20, notify: NotifyMode::Ioeventfd },
        listen: Listen::Socket(path.clone()),
        once: true,
        timeouts: Timeouts { handshake, ..Timeouts::default() },
        seccomp: false,
    };
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
