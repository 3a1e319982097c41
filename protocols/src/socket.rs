//! Message I/O on an AF_UNIX stream socket with file descriptors passed as
//! SCM_RIGHTS, shared by every protocol, and the receive polling budget
//! (`--spin-us`). Plain `io::Result`: the protocols add what was being read.
//!
//! A message is read whole: the fixed-size header first (fds travel with its
//! first byte), then the body. Received fds are owned [`File`]s at once, so
//! an error path closes them.
//!
//! # Stalls
//! A read waits for the first byte of what it reads as the socket's blocking
//! read does: for ever, or the socket's read timeout (SO_RCVTIMEO, which a
//! proxy sets to bound its wait for a reply, and `iopath serve` to bound a
//! client's stall inside a message); [`recv_exact_idle`] waits for ever
//! whatever the timeout, for a server between two requests of a client that
//! may legitimately be idle. Once the first byte has come, the rest must come
//! within the read timeout in all, however the peer splits it (a peer that
//! trickles a byte at a time gains nothing).
//!
//! Why this way: the hot path costs no syscall more than a plain blocking
//! read (a poll(-1) before each message would cost one per message): the
//! first recvmsg blocks as it did, the rest is one non-blocking recv that
//! usually takes it all, and the deadline is only computed (one getsockopt)
//! when the rest is not there yet. The price is that an idle server wakes
//! once per read timeout (seconds), finds nothing and waits again.

use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

/// Most fds accepted with one message; more is a protocol error.
pub const MAX_FDS: usize = 16;

/// How long a receiver polls its socket before it sleeps in the kernel
/// (0: it sleeps at once, as QEMU does). Polling keeps the thread on its
/// CPU, so a reply that comes within the budget costs no wake-up.
static SPIN_NS: AtomicU64 = AtomicU64::new(0);

/// Sets the polling budget of every receive in this process.
pub fn set_spin(d: Duration) {
    SPIN_NS.store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
}

/// Polls `fd` for input for up to the spin budget; returns early when
/// input is there. The caller then does its (blocking) read.
pub fn spin_until_readable(fd: std::os::fd::RawFd) {
    let budget = SPIN_NS.load(Ordering::Relaxed);
    if budget == 0 {
        return;
    }
    let t0 = Instant::now();
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd on the stack; timeout 0 never blocks.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 || t0.elapsed().as_nanos() as u64 >= budget {
            return;
        }
        std::hint::spin_loop();
    }
}

/// Sends `parts` as one message with `fds` attached to its first byte.
pub fn send(sock: &UnixStream, parts: &[&[u8]], fds: &[RawFd]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let sent = if fds.is_empty() {
        let slices: Vec<IoSlice> = parts.iter().map(|p| IoSlice::new(p)).collect();
        (&*sock).write_vectored(&slices)?
    } else {
        sock.send_with_fds(parts, fds).map_err(|e| io::Error::from_raw_os_error(e.errno()))?
    };
    if sent < total {
        // A short stream write: the rest goes without fds.
        let mut rest = Vec::with_capacity(total - sent);
        parts.iter().for_each(|p| rest.extend_from_slice(p));
        (&*sock).write_all(&rest[sent..])?;
    }
    Ok(())
}

/// Bytes of control buffer for exactly [`MAX_FDS`] descriptors, in 8-byte
/// words so it is aligned for `cmsghdr`. The kernel installs no more fds
/// than fit (it closes the rest and sets MSG_CTRUNC), so a bigger buffer
/// (CMSG_SPACE rounding up) must not be handed to it.
const CMSG_WORDS: usize = (std::mem::size_of::<libc::cmsghdr>() + MAX_FDS * std::mem::size_of::<RawFd>()).div_ceil(8);

/// One recvmsg into `iov` with SCM_RIGHTS fds: bytes read, the fds (owned
/// at once, so every path closes them), and whether the kernel had to drop
/// control data (MSG_CTRUNC).
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<File>, bool)> {
    let mut cbuf = [0u64; CMSG_WORDS];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: an all-zero msghdr is valid (no name, no iovec, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // Room for MAX_FDS fds and no more (see CMSG_WORDS).
    msg.msg_controllen = (std::mem::size_of::<libc::cmsghdr>() + MAX_FDS * std::mem::size_of::<RawFd>()) as _;
    let n = loop {
        // SAFETY: msg points at `iov` (into `buf`, borrowed mutably) and at
        // `cbuf`, both alive for the call, with their lengths.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r >= 0 {
            break r as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut files = Vec::new();
    // SAFETY: the CMSG_* walk stays within msg_control/msg_controllen as
    // the kernel filled them in; each SCM_RIGHTS payload is an array of
    // fds that recvmsg installed for us and nothing else owns.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    files.push(File::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n, files, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// Reads exactly `buf.len()` bytes; fds that arrive with them are returned.
/// The first byte is waited for as the socket's blocking read does (a read
/// timeout that expires is `WouldBlock`); the rest must come within the read
/// timeout (`TimedOut`, see the module doc). End of stream before the first
/// byte is `UnexpectedEof` with no data read. More than [`MAX_FDS`] fds (the
/// kernel truncated the control data) is `InvalidData`; every fd received is
/// closed on an error.
pub fn recv_exact(sock: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<File>> {
    recv_exact_with(sock, buf, false)
}

/// [`recv_exact`] for a server waiting for a client's next message: the
/// first byte is waited for as long as it takes (the socket's read timeout,
/// if any, bounds only the rest).
pub fn recv_exact_idle(sock: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<File>> {
    recv_exact_with(sock, buf, true)
}

fn recv_exact_with(sock: &UnixStream, buf: &mut [u8], idle: bool) -> io::Result<Vec<File>> {
    if buf.is_empty() {
        return Ok(Vec::new()); // a zero-length recvmsg would wait for data
    }
    spin_until_readable(sock.as_raw_fd());
    let (n, files, truncated) = loop {
        match recv_with_fds(sock, buf) {
            // The read timeout expired with nothing read: an idle peer.
            Err(e) if idle && e.kind() == io::ErrorKind::WouldBlock => continue,
            r => break r?,
        }
    };
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the socket"));
    }
    if truncated || files.len() > MAX_FDS {
        let what = if truncated { "control data truncated".to_string() } else { format!("{}", files.len()) };
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("more than {MAX_FDS} fds with one message ({what})"),
        ));
    }
    recv_rest(sock, &mut buf[n..])?;
    Ok(files)
}

/// Reads the rest of a message the peer has begun: non-blocking reads while
/// data is there (usually one, which takes it all); when it is not, waits
/// for more until the deadline the socket's read timeout sets from then
/// (none: for ever).
fn recv_rest(sock: &UnixStream, buf: &mut [u8]) -> io::Result<()> {
    let fd = sock.as_raw_fd();
    let mut got = 0;
    let mut deadline: Option<Option<Instant>> = None;
    while got < buf.len() {
        let rest = &mut buf[got..];
        // SAFETY: `rest` is a valid writable buffer of its length for the call.
        let r = unsafe { libc::recv(fd, rest.as_mut_ptr().cast(), rest.len(), libc::MSG_DONTWAIT) };
        if r > 0 {
            got += r as usize;
            continue;
        }
        if r == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the socket inside a message"));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {}
            _ => return Err(e),
        }
        let timeout = match deadline {
            Some(d) => d,
            None => *deadline.insert(sock.read_timeout()?.map(|t| Instant::now() + t)),
        };
        let ms = match timeout {
            None => -1,
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => left.as_millis().clamp(1, i32::MAX as u128) as i32,
                _ => return Err(stalled(sock, got, buf.len())),
            },
        };
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd on the stack.
        if unsafe { libc::poll(&mut p, 1, ms) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
    Ok(())
}

fn stalled(sock: &UnixStream, got: usize, want: usize) -> io::Error {
    let t = sock.read_timeout().ok().flatten().unwrap_or_default();
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("the peer stalled inside a message: {got} of its last {want} bytes came within {t:?}"),
    )
}

/// True once the peer has closed its end (POLLHUP/POLLRDHUP), without
/// consuming any data. `timeout_ms` as for poll(2).
pub fn peer_closed(sock: &UnixStream, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd on the stack.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    r > 0 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_body_and_fds_arrive_together() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        send(&a, &[b"head", b"body!"], &[f.as_raw_fd(), f.as_raw_fd()]).unwrap();
        let mut h = [0u8; 4];
        let fds = recv_exact(&b, &mut h).unwrap();
        assert_eq!((&h, fds.len()), (b"head", 2));
        let mut body = [0u8; 5];
        assert!(recv_exact(&b, &mut body).unwrap().is_empty());
        assert_eq!(&body, b"body!");
        assert!(!peer_closed(&b, 0));
        drop(a);
        assert!(peer_closed(&b, 0));
        assert_eq!(recv_exact(&b, &mut h).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn too_many_fds_is_an_error_and_closes_them() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let fds = vec![f.as_raw_fd(); MAX_FDS + 1];
        send(&a, &[b"x"], &fds).unwrap();
        let mut h = [0u8; 1];
        assert_eq!(recv_exact(&b, &mut h).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn an_idle_read_outlasts_the_read_timeout_but_a_stall_inside_a_message_does_not() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut h = [0u8; 4];
        assert_eq!(recv_exact(&b, &mut h).unwrap_err().kind(), io::ErrorKind::WouldBlock);
        let peer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            send(&a, &[b"he"], &[]).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            let _ = send(&a, &[b"ll"], &[]);
            a
        });
        let e = recv_exact_idle(&b, &mut h).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        drop(peer.join().unwrap());
    }

    #[test]
    fn a_message_trickled_a_byte_at_a_time_is_bounded_in_all() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let peer = std::thread::spawn(move || {
            for _ in 0..40 {
                if send(&a, &[b"x"], &[]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let mut m = [0u8; 40];
        let e = recv_exact_idle(&b, &mut m).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        drop(b);
        peer.join().unwrap();
    }
}
