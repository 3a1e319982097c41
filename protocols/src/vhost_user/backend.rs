//! vhost-user-blk backend: iopath's virtio-blk served to a vhost-user
//! frontend (QEMU's `vhost-user-blk-pci`, iopath's VMM) from a device
//! process: `iopath serve virtio-blk[,opts] --transport vhost-user`.
//!
//! The `vhost` crate's `BackendReqHandler` reads and checks the messages
//! (header, size, fds) and dispatches them to `Session` (`backend_req.rs`),
//! this module's `VhostUserBackendReqHandlerMut`; the device behind it is
//! the one every other host serves: requests by
//! [`Blk`](iopath_devices::virtio::blk::Blk) on the NVMe backends' storage,
//! rings by [`Queue`](iopath_devices::virtio::queue::Queue) over
//! [`GuestMem`](iopath_devices::GuestMem) (EVENT_IDX, indirect tables,
//! every index and address checked). Not the `vhost-user-backend` daemon
//! framework: iopath maps a client's memory only if it cannot shrink
//! (F_SEAL_SHRINK, see [`crate::function`]), which has to be checked on
//! the fd before it is mapped, and the framework maps it itself.
//!
//! Offered: the device's virtio features (VERSION_1, EVENT_IDX,
//! INDIRECT_DESC, FLUSH, DISCARD, WRITE_ZEROES, BLK_SIZE, SEG_MAX), MQ and
//! PROTOCOL_FEATURES; protocol features CONFIG (GET_CONFIG: the
//! configuration space, [`blk::config_space`](iopath_devices::virtio::blk::config_space)
//! with num_queues), MQ (up to [`NUM_QUEUES`] queues: QEMU's
//! vhost-user-blk-pci asks for one per vCPU by default) and REPLY_ACK (the
//! crate's). Each started ring has a thread (`backend_worker.rs`) that serves it on
//! kicks or polls it (`notify=poll`), and signals the call fd as the driver
//! asks; the rings share the disk behind one lock.
//!
//! A session ends when the frontend leaves, or at the first request it
//! refuses, with a log line (and, if the frontend asked, an error reply
//! first); then nothing the frontend gave is kept: ring threads joined,
//! memory unmapped, kick, call and error fds closed. The disk (a ram
//! backend's data) and the counters stay for the next frontend.
//!
//! Bounds on what a frontend can make the process spend: one message at
//! a time, at most 4 KiB (the crate) and [`MAX_REGIONS`] memory regions
//! with one fd each; one thread per ring ([`NUM_QUEUES`]); a message, once
//! begun, whole within the session socket's receive timeout.

#[path = "backend_dev.rs"]
mod dev;
#[path = "backend_mem.rs"]
mod mem;
#[path = "backend_req.rs"]
mod req;
#[path = "backend_serve.rs"]
mod serve;
#[path = "backend_worker.rs"]
mod worker;

pub use mem::MAX_REGIONS;
pub use serve::{run, VhostUserServeOptions, TRANSPORT};
pub use worker::POLL_IDLE;

use crate::{Error, Result};
use dev::Dev;
use iopath_devices::nvme::backend::Backend;
use iopath_devices::virtio::blk::{self, Blk};
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
use iopath_devices::Counter;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use vhost::vhost_user::{BackendReqHandler, Error as VuError, VhostUserProtocolFeatures};

/// Queues the device has (config num_queues, GET_QUEUE_NUM).
pub const NUM_QUEUES: usize = 4;
/// VIRTIO_BLK_F_MQ.
pub const F_MQ: u64 = 1 << 12;
/// VHOST_USER_F_PROTOCOL_FEATURES (a virtio feature bit vhost-user uses).
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// Virtio features offered: the device's, MQ and PROTOCOL_FEATURES.
pub const FEATURES: u64 = iopath_devices::virtio::pci::FEATURES | F_MQ | F_PROTOCOL_FEATURES;
/// Protocol features offered (the crate adds REPLY_ACK).
pub const PROTOCOL_FEATURES: VhostUserProtocolFeatures =
    VhostUserProtocolFeatures::CONFIG.union(VhostUserProtocolFeatures::MQ);

/// The configuration space GET_CONFIG serves: the device's
/// ([`blk::config_space`]) with num_queues (offset 34) set.
pub fn config_space(size: u64) -> [u8; blk::CONFIG_LEN] {
    let mut c = blk::config_space(size);
    c[34..36].copy_from_slice(&(NUM_QUEUES as u16).to_le_bytes());
    c
}

/// The device a vhost-user device process serves, kept across sessions.
pub struct BlkBackend {
    dev: Arc<Mutex<Dev>>,
    notify: NotifyMode,
}

impl BlkBackend {
    /// A virtio-blk on `cfg`'s backend and size; `notify=poll` polls the
    /// rings, any other mode serves them on kicks.
    pub fn new(cfg: &VirtioBlkConfig) -> Result<Self> {
        if cfg.size == 0 || !cfg.size.is_multiple_of(blk::SECTOR) {
            return Err(Error::Config(format!("virtio-blk: a disk of {} bytes", cfg.size)));
        }
        let backend = Backend::open(&cfg.backend, cfg.size)?;
        let b = Blk::new(backend, cfg.size, "iopath-vhost-user-blk");
        Ok(BlkBackend { dev: Arc::new(Mutex::new(Dev::new(b, NUM_QUEUES))), notify: cfg.notify })
    }

    /// Serves one frontend on `sock` until it leaves (`Ok`) or a request
    /// is refused or the channel breaks (`Err`, which says why); then
    /// forgets everything it gave. Waits between messages without bound; a
    /// begun message must arrive within `sock`'s receive timeout.
    pub fn session(&self, sock: &UnixStream) -> Result<()> {
        let s = Arc::new(Mutex::new(req::Session::new(self.dev.clone(), self.notify)));
        let ch = sock.try_clone().map_err(|e| Error::io("the session socket", e))?;
        let mut h = BackendReqHandler::from_stream(ch, s.clone());
        let r = loop {
            if let Err(e) = wait_readable(sock) {
                break Err(Error::io("waiting for a message", e));
            }
            match h.handle_request() {
                Ok(()) => {}
                Err(VuError::Disconnected) => break Ok(()),
                Err(e) => {
                    let why = iopath_devices::lock(&s).refusal.take();
                    let what = match why {
                        Some(w) => w,
                        None => {
                            iopath_devices::lock(&self.dev).st.refused += 1;
                            format!("vhost-user: {e}")
                        }
                    };
                    break Err(Error::protocol(what));
                }
            }
        };
        drop(h);
        iopath_devices::lock(&s).end();
        r
    }

    /// The device's counters (requests, kicks, interrupts, errors...).
    pub fn counters(&self) -> Vec<Counter> {
        iopath_devices::lock(&self.dev).counters()
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
