//! `iopath serve` confines itself (Landlock and seccomp) once it listens,
//! unless told `--no-seccomp` (the sandbox itself: protocols/tests/seccomp.rs;
//! serving under it: every test that starts `iopath serve`, and here with a
//! terminal for stderr, where the runtime's terminal-only paths show).

mod common;

use std::collections::BTreeMap;
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

/// `iopath run ARGS` with a pseudo-terminal for stdin, stdout and stderr
/// (util-linux `script`), so its device process (which inherits stderr)
/// logs to a terminal: its exit code and everything it printed.
fn run_at_a_terminal(args: &str) -> (i32, String) {
    let line = format!("'{}' run {args}", env!("CARGO_BIN_EXE_iopath"));
    let out = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("util-linux script (a terminal for the run): {e}"));
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).replace("\r\n", "\n"))
}

/// Every `key=value` of `line`.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect()
}

/// The guest's `@nvme` record and the device's counters (`iopath run`
/// prints them on the line after the device's `00:01.0 nvme ...`).
fn record_and_counters(out: &str) -> (BTreeMap<String, String>, BTreeMap<String, u64>) {
    let rec = out.lines().find(|l| l.starts_with("@nvme ")).map(fields).unwrap_or_default();
    let mut lines = out.lines().skip_while(|l| !l.starts_with("00:01.0 nvme"));
    let counters = lines.nth(1).map(fields).unwrap_or_default();
    (rec, counters.into_iter().filter_map(|(k, v)| Some((k, v.parse().ok()?))).collect())
}

/// At a terminal the device process's log lines once cost it an ioctl (the
/// logger asked at each line whether stderr was a terminal), which no role
/// allows: every NVMe run whose device process logged (ioeventfd and
/// adaptive over mpqemu and ioregionfd, which have no ioeventfds: "no
/// ioeventfd for the doorbell") died of SIGSYS, and a terminal was the only
/// place it showed. Now the logger decides its colours once, before the
/// sandbox: the same runs complete at a terminal, coloured, every I/O
/// served. And a file namespace in place on guest pages, over vfio-user,
/// its data verified, through the restricted io_uring.
#[test]
fn nvme_device_processes_that_log_at_a_terminal_run_to_the_end() {
    common::kvm();
    for t in ["mpqemu", "ioregionfd"] {
        for m in ["ioeventfd", "adaptive"] {
            let dev = format!("nvme,doorbell={m},backend=null@{t}");
            let (code, out) = run_at_a_terminal(&format!(
                "--device {dev} --workload nvme --mem 128 --append 'rw=randread bs=4096 iodepth=1 time_ms=300'"
            ));
            assert!(!out.contains("seccomp: forbidden"), "{dev}: {out}");
            assert_eq!(code, 0, "{dev}: {out}");
            let warn = out.lines().find(|l| l.contains("no ioeventfd for the doorbell")).unwrap_or_default();
            assert!(warn.contains("\x1b["), "{dev}: the device process logged, in colour, to a terminal: {out}");
            let (rec, c) = record_and_counters(&out);
            assert_eq!(rec.get("errors").map(String::as_str), Some("0"), "{dev}: {out}");
            let ios = rec.get("ios").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            assert!(ios > 0, "{dev}: {out}");
            assert_eq!(c.get("io.commands"), Some(&ios), "{dev}: the device served every I/O: {out}");
        }
    }
    let img = std::env::temp_dir().join(format!("iopath-seccomp-tty-{}.img", std::process::id()));
    let dev =
        format!("nvme,doorbell=adaptive,backend=file:{},create=on,size_mb=8,in_place=on@vfio-user", img.display());
    let (code, out) = run_at_a_terminal(&format!(
        "--device {dev} --workload nvme --mem 128 --append 'verify=1 bs=4096 iodepth=8 size_mb=4'"
    ));
    let _ = std::fs::remove_file(&img);
    assert_eq!(code, 0, "{dev}: {out}");
    let (rec, c) = record_and_counters(&out);
    assert_eq!((rec.get("errors"), rec.get("mismatches")), (Some(&"0".into()), Some(&"0".into())), "{out}");
    let n = |k: &str| c.get(k).copied().unwrap_or(0);
    assert!(n("backend.in-place-ops") > 0, "{dev}: transfers in place on guest pages: {out}");
    assert_eq!(n("backend.in-place-ops"), n("backend.direct-ops"), "{dev}: every transfer in place: {out}");
}
