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

/// A vfio-user message: header (msg id, command, size, flags, error) and payload.
fn vfio_user_msg(id: u16, cmd: u16, payload: &[u8]) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&id.to_le_bytes());
    m.extend_from_slice(&cmd.to_le_bytes());
    m.extend_from_slice(&(16 + payload.len() as u32).to_le_bytes());
    m.extend_from_slice(&[0; 8]);
    m.extend_from_slice(payload);
    m
}

/// The reply to the message in flight: (command, error).
fn vfio_user_reply(s: &mut std::os::unix::net::UnixStream) -> std::io::Result<(u16, u32)> {
    use std::io::Read;
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    let size = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    s.read_exact(&mut vec![0u8; size.saturating_sub(16)])?;
    Ok((u16::from_le_bytes(h[2..4].try_into().unwrap()), u32::from_le_bytes(h[12..16].try_into().unwrap())))
}

/// A client's message may reach the server in pieces (QEMU's 128 KiB DMA_READ
/// replies do: more than a socket buffer). The thread that reads the client's
/// messages while the device waits for a DMA reply (started by a DMA_MAP
/// without an fd) waits for the rest under its own filter; it once asked the
/// socket for its timeout there, a system call its role did not allow, and
/// the whole device process died of SIGSYS (QEMU 11 then aborted on the reset
/// connection).
#[test]
fn a_message_that_arrives_in_pieces_is_read_under_the_reader_filter() {
    use std::io::Write;
    let dir = std::env::temp_dir().join(format!("iopath-seccomp-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s.sock");
    let _ = std::fs::remove_file(&sock);
    let mut child = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "nvme", "--transport", "vfio-user", "--socket"])
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(seccomp_mode(&child, &sock), "2");
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let caps = b"{\"capabilities\":{\"max_msg_fds\":8,\"max_data_xfer_size\":1048576}}\0";
    s.write_all(&vfio_user_msg(1, 1, &[&[0, 0, 1, 0][..], caps].concat())).unwrap();
    assert_eq!(vfio_user_reply(&mut s).unwrap().1, 0, "VERSION");
    // DMA_MAP of 1 MiB at 0 without an fd: read/write, reached by message.
    let map: Vec<u8> = [32u32.to_le_bytes(), 3u32.to_le_bytes()]
        .concat()
        .into_iter()
        .chain([0u64, 0, 0x10_0000].iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    s.write_all(&vfio_user_msg(2, 2, &map)).unwrap();
    assert_eq!(vfio_user_reply(&mut s).unwrap().1, 0, "DMA_MAP");
    // DEVICE_GET_INFO with its payload in two pieces, 300 ms apart.
    let m = vfio_user_msg(3, 4, &[16u32.to_le_bytes(), [0; 4], [0; 4], [0; 4]].concat());
    s.write_all(&m[..20]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let reply = s.write_all(&m[20..]).and_then(|_| vfio_user_reply(&mut s));
    let alive = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let status = child.wait().unwrap();
    let mut log = String::new();
    let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut log);
    assert!(alive, "iopath serve died ({status}):\n{log}");
    assert_eq!(reply.ok(), Some((4, 0)), "DEVICE_GET_INFO:\n{log}");
    let _ = std::fs::remove_dir_all(&dir);
}
