//! A peer that makes the device process log as fast as it can send (D9 of
//! the hostile-peer review: 27 MB of stderr in 20 s). The log is rate
//! limited per call site and per process, so stderr grows by a bounded
//! number of lines a second whatever the peer sends, and the peer is still
//! answered.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A vfio-user request header (no payload): msg_id, command, size, flags, error.
fn request(id: u16, cmd: u16) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..2].copy_from_slice(&id.to_le_bytes());
    h[2..4].copy_from_slice(&cmd.to_le_bytes());
    h[4..8].copy_from_slice(&16u32.to_le_bytes());
    h
}

#[test]
fn a_flood_of_refused_requests_makes_a_bounded_log() {
    let dir = std::env::temp_dir().join(format!("iopath-logflood-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock_path = dir.join("dev.sock");
    let err_path = dir.join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--transport", "vfio-user", "--once", "--socket"])
        .arg(&sock_path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("start iopath serve");
    let t0 = Instant::now();
    let sock = loop {
        match UnixStream::connect(&sock_path) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(10) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("connect {}: {e}", sock_path.display()),
        }
    };
    // A command before VERSION (DMA_MAP, 2) is refused with an error reply and a
    // warning, every time. Send for at least 2 s, reading every reply.
    let mut w = sock.try_clone().unwrap();
    let (mut r, start) = (sock, Instant::now());
    let (mut sent, mut batch) = (0u64, Vec::new());
    while sent < 50_000 || start.elapsed() < Duration::from_secs(2) {
        batch.clear();
        for i in 0..256u64 {
            batch.extend_from_slice(&request((sent + i) as u16, 2));
        }
        w.write_all(&batch).unwrap();
        let mut replies = vec![0u8; 256 * 16];
        r.read_exact(&mut replies).expect("every refused request is answered");
        for rep in replies.chunks(16) {
            let flags = u32::from_le_bytes(rep[8..12].try_into().unwrap());
            assert_eq!(flags & 0x2f, 0x21, "an error reply (flags {flags:#x})");
        }
        sent += 256;
    }
    let secs = start.elapsed().as_secs_f64();
    drop((w, r));
    let st = child.wait().unwrap();
    assert!(st.success(), "iopath serve: {st}");
    let log = std::fs::read_to_string(&err_path).unwrap();
    let warnings = log.lines().filter(|l| l.contains("VERSION must come first")).count();
    // Burst plus the process's rate for the time the flood lasted (and a second of slack).
    let bound = 50.0 + 10.0 * (secs + 1.0);
    assert!(
        (warnings as f64) <= bound && log.len() < 64 * 1024,
        "{sent} refused requests in {secs:.1} s made {warnings} warnings ({} bytes of stderr), bound {bound:.0}",
        log.len()
    );
    assert!(log.contains("dropped by the log rate limit"), "the log says lines were dropped:\n{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
