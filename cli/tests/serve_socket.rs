//! `iopath serve --socket PATH` and the file at PATH: a file that is not a
//! socket is refused and left as it was, a live server's socket is refused
//! without its server seeing a client, a stale socket is replaced, and the
//! socket file is gone once the process is, however it ended (the binary,
//! confined by seccomp as it runs for users).

mod common;
use common::TempDir;

use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

/// A liveness bound on every wait.
const HUNG: Duration = Duration::from_secs(20);

/// A server process, killed if a test fails before it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Server {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// `iopath serve pci-testdev --transport vfio-user --socket PATH [extra]`,
/// its stdout and stderr in `DIR/NAME.out` and `DIR/NAME.err`.
fn serve(path: &Path, name: &str, extra: &[&str]) -> Server {
    let d = path.parent().unwrap();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--transport", "vfio-user", "--socket"])
        .arg(path)
        .args(extra)
        .stdout(std::fs::File::create(d.join(format!("{name}.out"))).unwrap())
        .stderr(std::fs::File::create(d.join(format!("{name}.err"))).unwrap())
        .spawn()
        .unwrap();
    Server(child)
}

fn output(path: &Path, name: &str, which: &str) -> String {
    std::fs::read_to_string(path.parent().unwrap().join(format!("{name}.{which}"))).unwrap_or_default()
}

/// Waits until `child` listens on `path` (its banner is on stderr).
fn listening(child: &mut Child, path: &Path, name: &str) {
    let t0 = Instant::now();
    while !output(path, name, "err").contains("iopath serve: pci-testdev over vfio-user on ") {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("{name} exited ({s}) before it listened: {}", output(path, name, "err"));
        }
        assert!(t0.elapsed() < HUNG, "{name} never listened on {}", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait(child: &mut Child) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(t0.elapsed() < HUNG, "the server did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A vfio-user client's VERSION on PATH: true if it was served.
fn served(path: &Path) -> bool {
    let s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(HUNG)).unwrap();
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: None }.to_bytes();
    socket::send(&s, &[&message(1, Command::Version, FLAGS_TYPE_COMMAND, &v)], &[]).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    socket::recv_exact(&s, &mut h).is_ok() && !Header::parse(&h).is_error()
}

/// Counters lines (one per client served) on a server's stdout.
fn clients(path: &Path, name: &str) -> usize {
    output(path, name, "out").lines().filter(|l| l.contains("\"disconnected\"")).count()
}

/// A disk image named by mistake: refused, the error names it and says
/// why, the file is as it was.
#[test]
fn a_file_that_is_not_a_socket_is_refused_and_left_intact() {
    let d = TempDir::new("serve-socket-file");
    let img = d.join("disk.img");
    std::fs::write(&img, b"the user's data").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--transport", "vfio-user", "--socket"])
        .arg(&img)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(&img.display().to_string()) && err.contains("a regular file, not a socket"), "{err}");
    assert_eq!(std::fs::read(&img).unwrap(), b"the user's data");
    // A directory is refused the same way, and stays.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "virtio-blk", "--transport", "vhost-user", "--socket"])
        .arg(&d)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("a directory, not a socket"));
    assert!(img.exists());
}

/// A second `iopath serve` on a live server's socket is refused, and the
/// live server saw no client (the old check connected to it): no counters
/// line until a real client comes, and it is served.
#[test]
fn a_live_server_is_detected_without_a_connection() {
    let d = TempDir::new("serve-socket-live");
    let path = d.join("dev.sock");
    let mut a = serve(&path, "a", &[]);
    listening(&mut a, &path, "a");
    let ino = std::fs::metadata(&path).unwrap().ino();
    let mut b = serve(&path, "b", &[]);
    let s = wait(&mut b);
    let err = output(&path, "b", "err");
    assert_eq!(s.code(), Some(2), "{err}");
    assert!(err.contains("another process listens"), "{err}");
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "the live socket was replaced");
    // Time for a connection, had there been one, to reach A and end.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(clients(&path, "a"), 0, "the live server saw a client: {}", output(&path, "a", "err"));
    assert!(served(&path), "the live server no longer serves");
    let t0 = Instant::now();
    while clients(&path, "a") != 1 {
        assert!(t0.elapsed() < HUNG, "no counters line for the one client");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(a);
}

/// A socket nobody has bound any more is replaced, served, and gone once
/// the server ends (`--once`: a normal exit).
#[test]
fn a_stale_socket_is_replaced_and_removed_at_a_normal_exit() {
    let d = TempDir::new("serve-socket-stale");
    let path = d.join("dev.sock");
    drop(UnixListener::bind(&path).unwrap());
    assert!(UnixStream::connect(&path).is_err(), "a stale socket refuses connections");
    let mut a = serve(&path, "a", &["--once"]);
    listening(&mut a, &path, "a");
    assert!(served(&path), "the stale socket was not replaced by a live one");
    let s = wait(&mut a);
    assert!(s.success(), "{s}: {}", output(&path, "a", "err"));
    assert!(!path.exists(), "the socket file outlived a normal exit");
}

/// SIGTERM and SIGINT: the socket file is gone by the time the process is,
/// which still dies of the signal; SIGKILL: it goes right after.
#[test]
fn the_socket_file_is_gone_after_a_signal() {
    let d = TempDir::new("serve-socket-signal");
    for (sig, name) in [(libc::SIGTERM, "term"), (libc::SIGINT, "int")] {
        let path = d.join(format!("{name}.sock"));
        let mut a = serve(&path, name, &[]);
        listening(&mut a, &path, name);
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(a.id() as libc::pid_t, sig) };
        let s = wait(&mut a);
        assert_eq!(s.signal(), Some(sig), "{s}: {}", output(&path, name, "err"));
        assert!(!path.exists(), "{name}: the socket file outlived the process");
    }
    let path = d.join("kill.sock");
    let mut a = serve(&path, "kill", &[]);
    listening(&mut a, &path, "kill");
    a.kill().unwrap();
    let _ = a.wait();
    let t0 = Instant::now();
    while path.exists() {
        assert!(t0.elapsed() < HUNG, "the socket file outlived SIGKILL by {HUNG:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
