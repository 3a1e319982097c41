//! vhost-user-blk backend: iopath's virtio-blk served to a vhost-user
//! frontend (QEMU's `vhost-user-blk-pci`, iopath's VMM) from a device
//! process: `iopath serve virtio-blk[,opts] --transport vhost-user`.
//!
//! The `vhost` crate's `BackendReqHandler` reads and checks the messages
//! (header, size, fds) and dispatches them to `Session` (`req.rs`),
//! this module's `VhostUserBackendReqHandlerMut`; the device behind it is
//! the one every other host serves: requests by
//! [`Blk`](iopath_devices::virtio::blk::Blk) on the NVMe backends' storage,
//! rings by [`Queue`](iopath_devices::virtio::queue::Queue) over
//! [`GuestMem`](iopath_devices::GuestMem) (EVENT_IDX, indirect tables,
//! every index and address checked). Not the `vhost-user-backend` daemon
//! framework: iopath maps a client's memory registered with its SIGBUS
//! handler (a frontend that shrinks it ends its own session, see
//! [`crate::function`]), and the framework maps it itself.
//!
//! Offered: the device's virtio features (VERSION_1, EVENT_IDX,
//! INDIRECT_DESC, FLUSH, DISCARD, WRITE_ZEROES, BLK_SIZE, SEG_MAX), MQ and
//! PROTOCOL_FEATURES; protocol features CONFIG (GET_CONFIG: the
//! configuration space, [`blk::config_space`](iopath_devices::virtio::blk::config_space)
//! with num_queues), MQ (GET_QUEUE_NUM: `queues=N` of the device's options,
//! or by default [`NUM_QUEUES`], since QEMU's vhost-user-blk-pci asks for
//! one per vCPU unless told `num-queues`), INFLIGHT_SHMFD (GET/SET_INFLIGHT_FD,
//! `inflight.rs`: each ring notes the chains it took and has not completed
//! in a region the frontend keeps, so a device process started after one
//! that died resubmits them, in order, each once; QEMU's vhost-user-blk
//! with a reconnecting chardev survives a `kill -9` of the backend) and
//! REPLY_ACK (the crate's). Each started ring has a thread (`worker.rs`) that serves it on
//! kicks or polls it (`notify=poll`), and signals the call fd as the driver
//! asks; the rings share the disk behind one lock.
//!
//! A session ends when the frontend leaves, at the first request it
//! refuses (`refused`), when the channel breaks or is too slow
//! (`socket_errors`), or when the frontend shrinks memory it shared, with a log line (and, if the frontend asked, an
//! error reply first); then nothing the frontend gave is kept: ring
//! threads joined, memory unmapped, kick, call and error fds closed. The
//! disk (a ram backend's data) and the counters stay for the next frontend.
//!
//! Bounds on what a frontend can make the process spend: one message at a
//! time, at most 4 KiB (the crate) and [`MAX_REGIONS`] memory regions with
//! one fd each; one thread per started ring ([`NUM_QUEUES`]), which looks
//! at its stop between passes; kick, call and error fds eventfds only
//! (made non-blocking: a signal that finds one full is dropped, never
//! waited for); with a receive timeout on the session socket, a message's
//! header, once begun, whole within it (peeked before the crate reads it;
//! a frontend that leaves inside one ends its session at once), and each
//! request done (read, served, answered) within it plus the send
//! timeout, or a watchdog shuts the socket down: the crate retries
//! timed-out reads and writes for ever.

mod dev;
mod inflight;
mod mem;
mod req;
mod serve;
mod watchdog;
mod worker;

pub use mem::MAX_REGIONS;
pub(super) use serve::serve;
pub use worker::POLL_IDLE;

use crate::{Error, Result};
use dev::Dev;
use iopath_devices::virtio::blk::{self, Blk};
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
use iopath_devices::Counter;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vhost::vhost_user::{BackendReqHandler, Error as VuError, VhostUserProtocolFeatures};

/// A vhost-user message header: request, flags, size (u32 each).
const HEADER: usize = 12;

/// Most queues the device has (config num_queues, GET_QUEUE_NUM), and how
/// many without `queues=N`: QEMU's vhost-user-blk-pci sets up one per vCPU
/// (up to this many; `-smp 16`). A queue costs its state here; a thread
/// only once the frontend starts it (SET_VRING_KICK): at most this many
/// ring threads per session.
pub const NUM_QUEUES: usize = iopath_devices::virtio::transport::MAX_QUEUES as usize;
pub use iopath_devices::virtio::pci::F_MQ;
/// VHOST_USER_F_PROTOCOL_FEATURES (a virtio feature bit vhost-user uses).
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// Virtio features offered: the device's, MQ and PROTOCOL_FEATURES.
pub const FEATURES: u64 = iopath_devices::virtio::pci::FEATURES | F_MQ | F_PROTOCOL_FEATURES;
/// Protocol features offered (the crate adds REPLY_ACK).
pub const PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::CONFIG
    .union(VhostUserProtocolFeatures::MQ)
    .union(VhostUserProtocolFeatures::INFLIGHT_SHMFD);

/// The configuration space GET_CONFIG serves: the device's
/// ([`blk::config_space`]) with its `queues` as num_queues.
pub fn config_space(size: u64, queues: usize) -> [u8; blk::CONFIG_LEN] {
    blk::config_space(size, queues as u16)
}

/// The device a vhost-user device process serves, kept across sessions.
pub struct VhostUserBackend {
    dev: Arc<Mutex<Dev>>,
    notify: NotifyMode,
}

impl VhostUserBackend {
    /// A virtio-blk on `cfg`'s backend and size, with its `queues`
    /// (default [`NUM_QUEUES`]); `notify=poll` polls the rings, any other
    /// mode serves them on kicks.
    pub fn new(cfg: &VirtioBlkConfig) -> Result<Self> {
        if cfg.size == 0 || !cfg.size.is_multiple_of(blk::SECTOR) {
            return Err(Error::Config(format!("virtio-blk: a disk of {} bytes", cfg.size)));
        }
        let queues = cfg.queues.map_or(NUM_QUEUES, usize::from);
        if !(1..=NUM_QUEUES).contains(&queues) {
            return Err(Error::Config(format!("virtio-blk: {queues} queues (1 ..= {NUM_QUEUES})")));
        }
        if cfg.timing.is_some() || !cfg.inject.is_empty() {
            return Err(Error::Config(
                "virtio-blk over vhost-user: timing= and inject= are served in the VMM's \
                 and the PCI device process's virtio-blk only"
                    .into(),
            ));
        }
        let backend = iopath_devices::backing::open_with(&cfg.backend, cfg.size, cfg.create, cfg.direct)?;
        let b = Blk::new(backend, cfg.size, "iopath-vhost-user-blk");
        Ok(VhostUserBackend { dev: Arc::new(Mutex::new(Dev::new(b, queues))), notify: cfg.notify })
    }

    /// Serves one frontend on `sock` until it leaves (`Ok`) or a request
    /// is refused or the channel breaks (`Err`, which says why); then
    /// forgets everything it gave. Waits between messages without bound;
    /// with a receive timeout on `sock` (`T`), a begun message's header
    /// must be whole within `T`, and the request (its body read, served,
    /// answered) done within `T` plus the send timeout, or the session ends.
    pub fn session(&self, sock: &UnixStream) -> Result<()> {
        // The SIGBUS handler shuts `sock` down for reading if the frontend
        // shrinks memory it shared: the wait below ends at once.
        let owner = crate::sigbus::Owner::new(Some(sock))?;
        let s = Arc::new(Mutex::new(req::Session::new(self.dev.clone(), self.notify, owner.clone())));
        let ch = sock.try_clone().map_err(|e| Error::io("the session socket", e))?;
        let header = sock.read_timeout().ok().flatten();
        let request = header.map(|t| t + sock.write_timeout().ok().flatten().unwrap_or(t));
        // The crate retries a read or write that times out for ever: a
        // watchdog shuts the socket down when a request outlives its bound.
        let dog = match request {
            Some(_) => {
                let c = sock.try_clone().map_err(|e| Error::io("the session socket", e))?;
                let d = watchdog::Watchdog::new(c).map_err(|e| Error::io("the session's watchdog thread", e))?;
                Some(d)
            }
            None => None,
        };
        let mut h = BackendReqHandler::from_stream(ch, s.clone());
        let r = loop {
            if owner.poisoned() {
                break Ok(()); // said below
            }
            if let Err(e) = wait_readable(sock) {
                break Err(Error::io("waiting for a message", e));
            }
            if let Some(t) = header {
                match header_within(sock, t) {
                    Ok(true) => {}
                    Ok(false) => {
                        self.lock().st.socket_errors += 1;
                        break Err(Error::protocol(format!("vhost-user: a message header not whole within {t:?}")));
                    }
                    Err(e) => {
                        self.lock().st.socket_errors += 1;
                        break Err(Error::io("peeking at a message", e));
                    }
                }
            }
            iopath_devices::lock(&s).refusal = None;
            let (res, late) = match (&dog, request) {
                (Some(d), Some(t)) => d.run(t, || h.handle_request()),
                _ => (h.handle_request(), false),
            };
            if late {
                self.lock().st.socket_errors += 1;
                let t = request.unwrap_or_default();
                break Err(Error::protocol(format!(
                    "vhost-user: a request not read, served and answered within {t:?}"
                )));
            }
            match res {
                // The crate answers some refusals with an error reply and
                // goes on (SET_DEVICE_STATE_FD, CHECK_DEVICE_STATE): a
                // refused request ends the session all the same.
                Ok(()) => {
                    if let Some(w) = iopath_devices::lock(&s).refusal.take() {
                        break Err(Error::protocol(w));
                    }
                }
                Err(VuError::Disconnected) => break Ok(()),
                Err(e) => {
                    let why = iopath_devices::lock(&s).refusal.take();
                    let what = match why {
                        Some(w) => w,
                        None => {
                            self.lock().st.socket_errors += 1;
                            format!("vhost-user: {e}")
                        }
                    };
                    break Err(Error::protocol(what));
                }
            }
        };
        drop(h);
        drop(dog);
        let mut s = iopath_devices::lock(&s);
        let shrunk = owner.poisoned().then(|| {
            s.shrunk().unwrap_or_else(|| Error::protocol("vhost-user: the frontend shrank memory it had shared"))
        });
        s.end();
        shrunk.map_or(r, Err)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dev> {
        iopath_devices::lock(&self.dev)
    }

    /// The device's counters (requests, kicks, interrupts, errors...).
    pub fn counters(&self) -> Vec<Counter> {
        self.lock().counters()
    }
}

/// Waits until the 12-byte header of the message `sock` has input of is
/// whole (true), or the peer left before it began (true: the crate reads
/// the end), for at most `t` (false). A peer that leaves inside the header
/// is an `UnexpectedEof` error at once: the peek sees its bytes, never the
/// end of stream behind them, so that is asked of poll (POLLRDHUP).
fn header_within(sock: &UnixStream, t: Duration) -> std::io::Result<bool> {
    let end = Instant::now() + t;
    let mut b = [0u8; HEADER];
    // SAFETY: a peek into a local buffer of its length.
    let peek = |b: &mut [u8; HEADER]| unsafe {
        libc::recv(sock.as_raw_fd(), b.as_mut_ptr().cast(), HEADER, libc::MSG_PEEK | libc::MSG_DONTWAIT)
    };
    loop {
        let n = peek(&mut b);
        if n == 0 || n >= HEADER as isize {
            return Ok(true);
        }
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted) {
                return Err(e);
            }
        } else if crate::socket::peer_closed(sock, 0) {
            // The rest may have come just before the end: a whole header
            // (and the message behind it) is still served.
            let n = peek(&mut b);
            if n >= HEADER as isize {
                return Ok(true);
            }
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the frontend closed its socket inside a message header ({n} of {HEADER} bytes)"),
            ));
        }
        let now = Instant::now();
        if now >= end {
            return Ok(false);
        }
        // Part of a header is there (poll would return at once): look again soon.
        std::thread::sleep((end - now).min(Duration::from_millis(2)));
    }
}

/// Waits until `sock` has input or its peer left (no time bound: a
/// frontend whose guest leaves the disk alone sends nothing).
fn wait_readable(sock: &UnixStream) -> std::io::Result<()> {
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd on the stack.
        if unsafe { libc::poll(&mut p, 1, -1) } >= 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A frontend that sends 5 bytes of a header and leaves: an error at
    /// once, not a wait for the bound (a minute here, which would be a
    /// `false` after it).
    #[test]
    fn a_frontend_that_leaves_inside_a_header_is_seen_at_once() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[1, 0, 0, 0, 1]).unwrap();
        drop(a);
        let e = header_within(&b, Duration::from_secs(60)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "{e}");
        assert!(e.to_string().contains("5 of 12 bytes"), "{e}");
    }

    /// One that leaves before a byte: the crate reads the end (true); one
    /// that stays inside a header: false once the bound has passed.
    #[test]
    fn an_end_before_a_header_is_for_the_crate_and_a_stall_is_bounded() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert!(header_within(&b, Duration::from_secs(60)).unwrap());
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[1, 0, 0]).unwrap();
        assert!(!header_within(&b, Duration::from_millis(50)).unwrap());
        drop(a);
    }
}
