//! The acceptor of `iopath serve --socket PATH` (thread `serve-acceptor`):
//! takes every connection on the listening socket, and keeps none waiting
//! behind another.
//!
//! One poll loop over the listening socket, a wake-up eventfd (the serving
//! thread is free, or the process stops) and the connections that wait:
//! at most [`MAX_PENDING`], each with its own deadlines, all at once.
//! - A connection waits for its first message (its first byte) up to the
//!   handshake bound, then is dropped with a log line. One that closes
//!   before its first byte is dropped at once. Neither is a client: no
//!   counters line, and `--once` goes on waiting.
//! - As soon as one has spoken and the serving thread is free, it is handed
//!   over (the first to have spoken first).
//! - While a client is served, one that comes is given `refusal` from its
//!   connect for the serving thread to free (a VMM that reconnects at once
//!   is often faster than the server's read of its end of stream), then is
//!   refused: the transport says so if it spoke ([`FunctionTransport::refuse`]:
//!   vfio-user answers its first message with EBUSY), and the connection is
//!   closed and logged; one that has said nothing is just closed. A refusal
//!   reads a first message that is there (it waits [`SETTLE`] after its
//!   first byte) with socket timeouts of [`REFUSE_STALL`]: a client that
//!   trickles it is closed unanswered, and the loop never waits on it.
//! - Beyond [`MAX_PENDING`], the connection that has been silent longest is
//!   closed to make room, so a flood of idle connections costs nothing but
//!   themselves: a client that speaks as soon as it connects is served.
//!   (Closing the newcomer instead would hand every slot to whoever came
//!   first, a flood that came before the client.) When none is silent,
//!   the newcomer is closed.
//!
//! What a peer can make it spend: fds, [`MAX_PENDING`] connections (plus the
//! listening socket and the eventfd); threads: this one; memory: a slot per
//! connection; log lines: one per connection dropped or refused, which the
//! process's logger rate-limits.
//!
//! [`FunctionTransport::refuse`]: crate::FunctionTransport::refuse

use super::Refuse;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::EventFd;

/// Connections that may wait at once (for their first message, or for the
/// serving thread). Each is an fd; the fd budget DMA maps are given keeps
/// 128 spare (`vfio_user::server`).
pub const MAX_PENDING: usize = 64;
/// How long after its first byte a connection to be refused is left to
/// send the rest of its first message.
pub const SETTLE: Duration = Duration::from_millis(20);
/// The socket timeouts of a refusal: the first message is there, and an
/// answer to a peer that was never sent anything does not wait for room.
pub const REFUSE_STALL: Duration = Duration::from_millis(5);
/// Connections accepted in a row before the rest of the loop runs.
const ACCEPT_BURST: usize = 64;
/// How long the listening socket is left alone after accept fails for
/// want of fds (with no silent connection to close).
const BACKOFF: Duration = Duration::from_millis(100);

/// What the acceptor works with; [`Acceptor::run`] is the thread's body.
pub(super) struct Acceptor<'a> {
    /// Non-blocking.
    pub l: &'a UnixListener,
    /// Written when the serving thread frees, or to stop.
    pub wake: &'a EventFd,
    pub tx: SyncSender<(UnixStream, u64)>,
    /// The serving thread has a client (set here, cleared by it).
    pub busy: &'a AtomicBool,
    pub stop: &'a AtomicBool,
    pub refuse: Refuse,
    pub handshake: Duration,
    pub refusal: Duration,
    /// What is served ("pci-testdev over vfio-user"), for log lines.
    pub banner: &'a str,
    /// The socket's path, for log lines.
    pub where_: &'a str,
}

/// A connection that waits.
struct Conn {
    sock: UnixStream,
    n: u64,
    at: Instant,
    /// When its first byte was seen.
    spoke: Option<Instant>,
}

/// What becomes of a connection at a deadline.
enum Fate {
    Wait,
    Silent,
    Refuse,
    Close,
}

impl Acceptor<'_> {
    /// Until `stop` is set or the serving thread is gone.
    pub(super) fn run(self) {
        let mut pending: Vec<Conn> = Vec::with_capacity(MAX_PENDING);
        let mut n = 0u64;
        let mut listen_after: Option<Instant> = None;
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_PENDING + 2);
        let mut silent: Vec<usize> = Vec::with_capacity(MAX_PENDING);
        loop {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if !self.hand_over(&mut pending) {
                return;
            }
            let now = Instant::now();
            self.expire(&mut pending, now);
            let listening = listen_after.is_none_or(|t| now >= t);
            if listening {
                listen_after = None;
            }
            fds.clear();
            silent.clear();
            fds.push(pollfd(self.wake.as_raw_fd()));
            fds.push(pollfd(if listening { self.l.as_raw_fd() } else { -1 }));
            for (i, c) in pending.iter().enumerate() {
                if c.spoke.is_none() {
                    fds.push(pollfd(c.sock.as_raw_fd()));
                    silent.push(i);
                }
            }
            let next = self.next_deadline(&pending, listen_after);
            // SAFETY: poll on our array of its length.
            let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms(next, now)) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    log::error!("serve-acceptor: poll: {e}");
                    std::thread::sleep(BACKOFF);
                }
                continue;
            }
            if fds[0].revents != 0 {
                let _ = self.wake.read();
            }
            let now = Instant::now();
            let mut gone = Vec::new();
            for (k, &i) in silent.iter().enumerate() {
                if fds[2 + k].revents == 0 {
                    continue;
                }
                match first_byte(&pending[i].sock) {
                    Ok(true) => pending[i].spoke = Some(now),
                    Ok(false) => {}
                    Err(e) => {
                        log::info!("client {} on {}: closed before its first message ({e})", pending[i].n, self.where_);
                        gone.push(i);
                    }
                }
            }
            for i in gone.into_iter().rev() {
                pending.remove(i);
            }
            if fds[1].revents != 0 && !self.accept(&mut pending, &mut n) {
                listen_after = Some(now + BACKOFF);
            }
        }
    }

    /// Hands the connection that spoke first to the serving thread if it is
    /// free; false if that thread is gone.
    fn hand_over(&self, pending: &mut Vec<Conn>) -> bool {
        if self.busy.load(Ordering::Acquire) {
            return true;
        }
        let Some(i) = (0..pending.len()).filter(|&i| pending[i].spoke.is_some()).min_by_key(|&i| pending[i].spoke)
        else {
            return true;
        };
        if self.busy.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return true;
        }
        let c = pending.remove(i);
        // The serving thread took the last one before it cleared `busy`:
        // the channel is empty, this does not block.
        self.tx.send((c.sock, c.n)).is_ok()
    }

    /// What becomes of `c` now (`busy`: a client is being served).
    fn fate(&self, c: &Conn, busy: bool, now: Instant) -> Fate {
        if c.spoke.is_none() && now >= c.at + self.handshake {
            return Fate::Silent;
        }
        if busy && now >= c.at + self.refusal {
            return match c.spoke {
                None => Fate::Close,
                Some(t) if now >= t + SETTLE => Fate::Refuse,
                Some(_) => Fate::Wait,
            };
        }
        Fate::Wait
    }

    /// Drops, closes or refuses the connections whose deadline has come.
    fn expire(&self, pending: &mut Vec<Conn>, now: Instant) {
        let busy = self.busy.load(Ordering::Acquire);
        let mut i = 0;
        while i < pending.len() {
            let c = &pending[i];
            let (n, w) = (c.n, self.where_);
            match self.fate(c, busy, now) {
                Fate::Wait => {
                    i += 1;
                    continue;
                }
                Fate::Silent => {
                    log::warn!("{}: client {n} on {w}: no message within {:?}; dropped", self.banner, self.handshake)
                }
                Fate::Close => log::warn!(
                    "client {n} on {w}: another client is being served, and it said nothing within {:?}; closed",
                    self.refusal
                ),
                Fate::Refuse => {
                    let s = &c.sock;
                    let r = s
                        .set_read_timeout(Some(REFUSE_STALL))
                        .and_then(|_| s.set_write_timeout(Some(REFUSE_STALL)))
                        .map_err(|e| crate::Error::io("setting its socket timeouts", e))
                        .and_then(|_| (self.refuse)(s));
                    match r {
                        Ok(()) => log::warn!("client {n} on {w}: another client is being served; refused"),
                        Err(e) => log::warn!("client {n} on {w}: another client is being served; refused ({e})"),
                    }
                }
            }
            pending.remove(i);
        }
    }

    /// The earliest deadline of a connection, or the end of a backoff.
    fn next_deadline(&self, pending: &[Conn], listen_after: Option<Instant>) -> Option<Instant> {
        let busy = self.busy.load(Ordering::Acquire);
        let each = pending.iter().map(|c| {
            let handshake = c.spoke.is_none().then(|| c.at + self.handshake);
            let refusal = busy.then(|| match c.spoke {
                None => c.at + self.refusal,
                Some(t) => (c.at + self.refusal).max(t + SETTLE),
            });
            handshake.into_iter().chain(refusal).min()
        });
        each.flatten().chain(listen_after).min()
    }

    /// Accepts what the listening socket has (up to [`ACCEPT_BURST`]); false
    /// if it is to be left alone for [`BACKOFF`].
    fn accept(&self, pending: &mut Vec<Conn>, n: &mut u64) -> bool {
        for _ in 0..ACCEPT_BURST {
            match self.l.accept() {
                Ok((sock, _)) => {
                    *n += 1;
                    self.admit(pending, Conn { sock, n: *n, at: Instant::now(), spoke: None });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    // Out of fds: the one silent longest makes room, or wait.
                    if self.make_room(pending, "the process is out of fds").is_none() {
                        log::warn!("accept on {}: {e}", self.where_);
                        return false;
                    }
                }
                Err(e) => {
                    log::warn!("accept on {}: {e}", self.where_);
                    return false;
                }
            }
        }
        true
    }

    /// Adds `c` to the connections that wait, making room if they are
    /// [`MAX_PENDING`] (see the module doc).
    fn admit(&self, pending: &mut Vec<Conn>, c: Conn) {
        if pending.len() >= MAX_PENDING
            && self.make_room(pending, &format!("{MAX_PENDING} connections wait, a new one came")).is_none()
        {
            log::warn!(
                "client {} on {}: {MAX_PENDING} connections wait for the one served; closed at once",
                c.n,
                self.where_
            );
            return;
        }
        pending.push(c);
    }

    /// Closes the connection that has been silent longest (`pending` is in
    /// the order they came); its number, if there was one.
    fn make_room(&self, pending: &mut Vec<Conn>, why: &str) -> Option<u64> {
        let i = pending.iter().position(|c| c.spoke.is_none())?;
        let c = pending.remove(i);
        log::warn!("client {} on {}: said nothing yet and {why}; closed", c.n, self.where_);
        Some(c.n)
    }
}

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd { fd, events: libc::POLLIN, revents: 0 }
}

/// poll(2)'s timeout until `next` (rounded up), -1 for none.
fn timeout_ms(next: Option<Instant>, now: Instant) -> i32 {
    match next {
        None => -1,
        Some(t) => {
            let left = t.saturating_duration_since(now);
            left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        }
    }
}

/// Whether a connection poll reported has data (true), nothing after all
/// (false), or is closed (`Err`: end of stream or an error).
fn first_byte(sock: &UnixStream) -> io::Result<bool> {
    let mut b = [0u8; 1];
    // SAFETY: a peek into a local buffer of its length.
    let r = unsafe { libc::recv(sock.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    match r {
        0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "end of stream")),
        r if r > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                _ => Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(at: Instant, spoke: Option<Instant>) -> Conn {
        let (a, _b) = UnixStream::pair().unwrap();
        Conn { sock: a, n: 1, at, spoke }
    }

    /// The deadlines of the module doc, on a fixed clock.
    #[test]
    fn each_connection_meets_its_own_deadline() {
        let l = UnixListener::bind(std::env::temp_dir().join(format!("iopath-acc-{}.sock", std::process::id())));
        let l = l.unwrap();
        let _ = std::fs::remove_file(l.local_addr().unwrap().as_pathname().unwrap());
        let wake = EventFd::new(0).unwrap();
        let (tx, _rx) = std::sync::mpsc::sync_channel(1);
        let (busy, stop) = (AtomicBool::new(false), AtomicBool::new(false));
        let a = Acceptor {
            l: &l,
            wake: &wake,
            tx,
            busy: &busy,
            stop: &stop,
            refuse: Box::new(|_| Ok(())),
            handshake: Duration::from_secs(10),
            refusal: Duration::from_secs(1),
            banner: "test",
            where_: "here",
        };
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let silent = conn(t0, None);
        let spoke = conn(t0, Some(t0 + s(2)));
        // Free: a silent one waits for its handshake bound, one that spoke waits to be handed over.
        assert!(matches!(a.fate(&silent, false, t0 + s(9)), Fate::Wait));
        assert!(matches!(a.fate(&silent, false, t0 + s(10)), Fate::Silent));
        assert!(matches!(a.fate(&spoke, false, t0 + s(60)), Fate::Wait));
        // Busy: the refusal bound from the connect; one that spoke is refused SETTLE after its first byte.
        assert!(matches!(a.fate(&silent, true, t0 + s(1) / 2), Fate::Wait));
        assert!(matches!(a.fate(&silent, true, t0 + s(1)), Fate::Close));
        assert!(matches!(a.fate(&spoke, true, t0 + s(2)), Fate::Wait));
        assert!(matches!(a.fate(&spoke, true, t0 + s(2) + SETTLE), Fate::Refuse));
        let all = [silent, spoke];
        assert_eq!(a.next_deadline(&all, None), Some(t0 + s(10)));
        busy.store(true, Ordering::Release);
        assert_eq!(a.next_deadline(&all, None), Some(t0 + s(1)));
        assert_eq!(timeout_ms(Some(t0 + Duration::from_micros(1500)), t0), 2);
        assert_eq!(timeout_ms(None, t0), -1);
    }
}
