//! `iopath serve` confines itself with seccomp once it listens, unless
//! told `--no-seccomp` (the filters themselves: protocols/tests/seccomp.rs;
//! serving under them: every test that starts `iopath serve`).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Seccomp mode of a running process (0 off, 2 filter), once it listens on `sock`.
fn seccomp_mode(child: &Child, sock: &std::path::Path) -> String {
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "iopath serve never listened on {}", sock.display());
        std::thread::sleep(Duration::from_millis(10));
    }
    // The filter goes on right after the bind: give it a moment past the socket's appearance.
    let t0 = Instant::now();
    loop {
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
        let mode = status.lines().find_map(|l| l.strip_prefix("Seccomp:")).unwrap().trim().to_string();
        if mode != "0" || t0.elapsed() > Duration::from_secs(2) {
            return mode;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn serve(sock: &std::path::Path, extra: &[&str]) -> Child {
    let _ = std::fs::remove_file(sock);
    Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--socket"])
        .arg(sock)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn serve_confines_itself_by_default_and_not_with_no_seccomp() {
    let dir = std::env::temp_dir().join(format!("iopath-seccomp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (extra, want) in [(&[][..], "2"), (&["--no-seccomp"][..], "0")] {
        let sock = dir.join("s.sock");
        let mut child = serve(&sock, extra);
        let mode = seccomp_mode(&child, &sock);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(mode, want, "iopath serve {extra:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
