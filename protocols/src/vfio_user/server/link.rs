//! The session's socket as both sides use it: the client's commands and the
//! server's own requests (DMA_READ / DMA_WRITE, the fallback for guest RAM
//! offered without an fd) on the one socket.
//!
//! Once a client has mapped memory without an fd (before that the server
//! sends no request, and the session's one thread reads the socket itself),
//! one reader thread per session reads every message. A reply goes, by its
//! message id, to the thread that waits for it (a device thread, or the
//! handler itself: doorbell=mmio serves a queue inside the doorbell's
//! REGION_WRITE); a command goes to the handler, in order. The write side is
//! behind a mutex, so the handler's replies and any thread's requests never
//! interleave. Server message ids come from a counter (ids belong to their
//! sender, so they may equal the client's).
//!
//! Every wait is bounded ([`DMA_TIMEOUT`] by default): a client that does not
//! answer makes the access fail (counted as `dma.timeouts`), and the session
//! is dead for DMA from then on: every request still waiting and every later
//! one fails at once (the device's commands get errors), the socket is shut
//! down and the session ends with a log line saying why. So a client that
//! stops answering costs one deadline, not one per queued command. A late
//! reply that still comes is dropped. When the session ends, every waiter
//! fails at once and later requests fail without a message.
//!
//! Deadlock note (QEMU): QEMU answers DMA requests from its main loop, which
//! needs the big lock, and a vCPU holds that lock while it waits for the
//! reply to a non-posted access (REGION_READ, a config access, any
//! REGION_WRITE once a BAR has an mmap area). A DMA request the server must
//! have answered before it can reply to such an access waits until one side
//! times out (QEMU's `x-msg-timeout`, 5 s). The NVMe controller avoids it
//! where Linux drives it: doorbell writes are posted in `mmio` mode, and in
//! `bar` mode doorbells never reach the socket and the poller sends DMA only
//! for commands the guest submitted; a register access then waits only for
//! commands in flight.

use super::super::wire::{message, Command, DmaAccess, FLAGS_TYPE_COMMAND};
use super::super::{recv, send, Received};
use crate::{Error, Result};
use iopath_devices::mem::{DmaPort, MemError};
use iopath_devices::Counter;
use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a DMA request waits for the client's reply.
pub const DMA_TIMEOUT: Duration = Duration::from_secs(5);

/// Ids of requests that timed out, kept to recognise their late replies.
const LATE_IDS: usize = 64;

/// The server's DMA requests, over every session (the device's report).
#[derive(Default)]
pub struct DmaStats {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
    late: AtomicU64,
}

impl DmaStats {
    pub fn counters(&self) -> Vec<Counter> {
        [
            ("dma.reads", &self.reads),
            ("dma.writes", &self.writes),
            ("dma.bytes", &self.bytes),
            ("dma.timeouts", &self.timeouts),
            ("dma.errors", &self.errors),
            ("dma.late-replies", &self.late),
        ]
        .into_iter()
        .map(|(n, v)| Counter { name: n.into(), value: v.load(Ordering::Relaxed) })
        .collect()
    }
}

/// Requests waiting for their reply.
#[derive(Default)]
struct Pending {
    /// The session is over: nothing waits, nothing is sent.
    closed: bool,
    /// A request went unanswered past its deadline: why. Nothing waits and
    /// nothing is sent from then on (the session ends).
    dead: Option<String>,
    waiting: HashMap<u16, SyncSender<Received>>,
    late: VecDeque<u16>,
}

pub(super) struct Link {
    /// A copy of the session's socket, for writing.
    sock: UnixStream,
    write: Mutex<()>,
    peer: String,
    next_id: AtomicU16,
    pending: Mutex<Pending>,
    /// The most data one DMA message carries (the session's max_data_xfer_size).
    max_xfer: AtomicU32,
    timeout: Duration,
    stats: Arc<DmaStats>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    iopath_devices::lock(m)
}

impl Link {
    pub fn new(sock: UnixStream, peer: &str, timeout: Duration, stats: Arc<DmaStats>) -> Self {
        Link {
            sock,
            write: Mutex::new(()),
            peer: peer.into(),
            next_id: AtomicU16::new(0),
            pending: Mutex::default(),
            max_xfer: AtomicU32::new(super::super::wire::DEFAULT_MAX_DATA_XFER_SIZE),
            timeout,
            stats,
        }
    }

    pub fn set_max_xfer(&self, n: u32) {
        self.max_xfer.store(n.max(1), Ordering::Relaxed);
    }

    /// Sends one whole message.
    pub fn send(&self, msg: &[u8], fds: &[RawFd]) -> Result<()> {
        let _w = lock(&self.write);
        send(&self.sock, msg, fds)
    }

    /// The reader thread: every message off `sock` until the end of the
    /// stream, replies to their waiters, commands (or the error that ended
    /// the stream) to `commands`. Closes the link when it stops.
    pub fn read_loop(&self, sock: &UnixStream, commands: Sender<Result<Received>>) {
        loop {
            let m = match recv(sock) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    let _ = commands.send(Err(e));
                    break;
                }
            };
            if !m.hdr.is_reply() {
                if commands.send(Ok(m)).is_err() {
                    break; // the handler is gone
                }
                continue;
            }
            if let Err(e) = self.deliver(m) {
                let _ = commands.send(Err(e));
                break;
            }
        }
        self.close();
    }

    /// A reply: to its waiter, or dropped if its request timed out; a reply
    /// to nothing the server sent ends the session.
    fn deliver(&self, m: Received) -> Result<()> {
        let id = m.hdr.msg_id;
        let mut p = lock(&self.pending);
        if let Some(tx) = p.waiting.remove(&id) {
            let _ = tx.send(m);
            return Ok(());
        }
        if let Some(i) = p.late.iter().position(|&l| l == id) {
            p.late.remove(i);
            self.stats.late.fetch_add(1, Ordering::Relaxed);
            log::info!("vfio-user {}: late reply to DMA request {id} dropped", self.peer);
            return Ok(());
        }
        Err(Error::protocol(format!("message {id} is a reply to nothing the server sent")))
    }

    /// The session is over: every waiter fails now, later requests at once.
    pub fn close(&self) {
        let mut p = lock(&self.pending);
        p.closed = true;
        p.waiting.clear();
    }

    /// Why the session is dead for DMA, if it is: a request went unanswered
    /// past its deadline.
    pub fn dead(&self) -> Option<String> {
        lock(&self.pending).dead.clone()
    }

    /// A request went unanswered past its deadline: the session is dead for
    /// DMA. The requests still waiting fail now, later ones at once, and the
    /// socket is shut down, which ends the session (its reader sees the end
    /// of the stream, its handler [`dead`](Self::dead)'s reason).
    fn give_up(&self, p: &mut Pending, why: &str) {
        log::error!(
            "vfio-user {}: {why}: the session is dead for DMA (every later DMA request fails at once, the \
             device's commands get errors) and ends",
            self.peer
        );
        p.dead = Some(why.to_string());
        p.waiting.clear();
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }

    /// Sends a request about `n` bytes at `gpa` and waits for its reply, at
    /// most the link's timeout.
    fn request(&self, cmd: Command, payload: &[u8], gpa: u64, n: usize) -> Result<Received, MemError> {
        let gone = || match self.dead() {
            Some(why) => self.failed(gpa, n, why),
            None => self.failed(gpa, n, "the client has left".into()),
        };
        let (tx, rx) = sync_channel(1);
        let id = {
            let mut p = lock(&self.pending);
            if let Some(why) = &p.dead {
                return Err(self.failed(gpa, n, why.clone()));
            }
            if p.closed {
                return Err(gone());
            }
            let id = loop {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                if !p.waiting.contains_key(&id) && !p.late.contains(&id) {
                    break id;
                }
            };
            p.waiting.insert(id, tx);
            id
        };
        if let Err(e) = self.send(&message(id, cmd, FLAGS_TYPE_COMMAND, payload), &[]) {
            lock(&self.pending).waiting.remove(&id);
            return Err(self.failed(gpa, n, format!("sending {cmd:?}: {e}")));
        }
        let m = match rx.recv_timeout(self.timeout) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                let mut p = lock(&self.pending);
                if p.waiting.remove(&id).is_none() {
                    // The reply came as the wait ended (or the session did).
                    drop(p);
                    rx.try_recv().map_err(|_| gone())?
                } else {
                    if p.late.len() == LATE_IDS {
                        p.late.pop_front();
                    }
                    p.late.push_back(id);
                    self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                    let why = format!("the client did not answer {cmd:?} {id} within {:?}", self.timeout);
                    self.give_up(&mut p, &why);
                    return Err(self.failed(gpa, n, why));
                }
            }
            Err(RecvTimeoutError::Disconnected) => return Err(gone()),
        };
        if m.hdr.cmd != cmd as u16 {
            return Err(self.failed(gpa, n, format!("reply {id} is for command {}", m.hdr.cmd)));
        }
        if m.hdr.is_error() {
            return Err(self.failed(gpa, n, format!("{cmd:?} refused: errno {}", m.hdr.error_no)));
        }
        Ok(m)
    }

    /// Pieces of at most max_data_xfer_size bytes: (gpa, offset, length).
    fn pieces(&self, gpa: u64, len: usize) -> impl Iterator<Item = (u64, usize, usize)> {
        let max = self.max_xfer.load(Ordering::Relaxed) as usize;
        (0..len).step_by(max).map(move |off| (gpa + off as u64, off, max.min(len - off)))
    }

    fn failed(&self, gpa: u64, len: usize, reason: String) -> MemError {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        MemError::Remote { gpa, len, reason }
    }
}

impl DmaPort for Link {
    fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<(), MemError> {
        for (a, off, n) in self.pieces(gpa, buf.len()) {
            self.stats.reads.fetch_add(1, Ordering::Relaxed);
            let q = DmaAccess { address: a, count: n as u64 }.to_bytes();
            let m = self.request(Command::DmaRead, &q, a, n)?;
            let (r, data) = DmaAccess::parse_with_data(&m.payload)
                .map_err(|e| self.failed(a, n, format!("DMA_READ reply: {e}")))?;
            if r.address != a || data.len() != n {
                let e = format!("DMA_READ reply of {} bytes at {:#x}", data.len(), r.address);
                return Err(self.failed(a, n, e));
            }
            buf[off..off + n].copy_from_slice(data);
            self.stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn write(&self, gpa: u64, data: &[u8]) -> Result<(), MemError> {
        for (a, off, n) in self.pieces(gpa, data.len()) {
            self.stats.writes.fetch_add(1, Ordering::Relaxed);
            let q = DmaAccess::to_bytes_with_data(a, &data[off..off + n]);
            let m = self.request(Command::DmaWrite, &q, a, n)?;
            // The reply: QEMU's is the header alone, libvfio-user's
            // {address u64, count u64}, the spec's table {address, count u32}.
            let p = &m.payload;
            let address = p.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
            if !matches!(p.len(), 0 | 12 | 16) || address.is_some_and(|r| r != a) {
                return Err(self.failed(a, n, format!("DMA_WRITE reply of {} bytes", p.len())));
            }
            self.stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}
