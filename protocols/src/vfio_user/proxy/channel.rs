//! The proxy's request/reply channel to the server: one command at a time,
//! message ids in sequence, and the server's DMA_READ/DMA_WRITE served (by
//! [`DmaService`]) while a reply is awaited.
//!
//! It owns the failure policy of a request: an error reply is
//! [`Error::Remote`], the answer to that one request, and leaves the peer
//! up; any other error (a broken or out-of-step channel) ends the peer. It
//! knows nothing of what the commands mean beyond REGION_READ/WRITE's
//! payloads and the replies' framing.

use super::dma::DmaService;
use crate::peer::Peer;
use crate::vfio_user::wire::*;
use crate::vfio_user::{recv_reply, send, Received};
use crate::{Error, Result};
use std::os::fd::RawFd;

/// Most commands the server may send while one request waits for its reply.
const MAX_SERVED: u32 = 4096;

/// The socket to the server, its peer state, and what is counted of it.
pub(in crate::vfio_user) struct Channel {
    pub(in crate::vfio_user) peer: Peer,
    next_id: u16,
    /// Requests sent (one per access that crossed as a message).
    pub(in crate::vfio_user) requests: u64,
    /// Guest RAM for the server's DMA requests, served while a reply is awaited.
    pub(in crate::vfio_user) dma: DmaService,
    /// With reconnect on, a broken channel is not the peer's end: the
    /// first such error is kept here (the proxy then reconnects) and every
    /// later request fails at once.
    pub(super) reconnects: bool,
    pub(super) broken: Option<String>,
}

/// A reply payload that does not parse.
pub(super) fn bad_reply(what: impl std::fmt::Display) -> impl FnOnce(WireError) -> Error {
    move |e| Error::protocol(format!("{what}: {e}"))
}

impl Channel {
    pub(super) fn new(peer: Peer) -> Self {
        Channel { peer, next_id: 0, requests: 0, dma: DmaService::default(), reconnects: false, broken: None }
    }

    /// Sends a command and waits for its reply, serving the server's
    /// DMA_READ/DMA_WRITE commands that arrive meanwhile. An error reply is
    /// [`Error::Remote`] and leaves the peer up; any other error ends it
    /// (or, with reconnect on, marks the channel broken).
    pub(super) fn request(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received> {
        self.peer.alive()?;
        if let Some(b) = &self.broken {
            return Err(Error::PeerGone(b.clone()));
        }
        self.requests += 1;
        self.next_id = self.next_id.wrapping_add(1);
        let id = self.next_id;
        let r = self.exchange(id, cmd, payload, fds);
        match &r {
            Ok(_) | Err(Error::Remote { .. }) => {}
            Err(e) => self.broke(e),
        }
        r
    }

    /// A non-reply error on the channel: the peer's end, or with
    /// reconnect on the cause kept for the proxy's reconnect.
    pub(super) fn broke(&mut self, e: &Error) {
        if !self.reconnects {
            return self.peer.die(e);
        }
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
    }

    fn exchange(&mut self, id: u16, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<Received> {
        send(&self.peer.sock, &message(id, cmd, FLAGS_TYPE_COMMAND, payload), fds)?;
        let mut served = 0;
        loop {
            let m = recv_reply(&self.peer.sock)?
                .ok_or_else(|| Error::PeerGone("the device process closed the vfio-user socket".into()))?;
            if !m.hdr.is_reply() {
                served += 1;
                if served > MAX_SERVED {
                    let e = format!("the server sent {served} commands while {cmd:?} waited for its reply");
                    return Err(Error::protocol(e));
                }
                send(&self.peer.sock, &self.dma.serve(&m), &[])?;
                continue;
            }
            return reply_to(id, cmd, m);
        }
    }

    /// A request whose error reply is logged, not fatal (an optional step
    /// of the attach); true if it succeeded.
    pub(super) fn optional(&mut self, what: &str, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Result<bool> {
        match self.request(cmd, payload, fds) {
            Ok(_) => Ok(true),
            Err(e @ Error::Remote { .. }) => {
                log::warn!("{}: {what}: {e}; going on without it", self.peer.name);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// REGION_READ of `count` bytes; a reply of another length is a protocol error.
    pub(super) fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Result<Vec<u8>> {
        let q = RegionAccess { offset, region, count };
        let r = self.request(Command::RegionRead, &q.to_bytes(), &[])?;
        let (a, data) = RegionAccess::parse_with_data(&r.payload).map_err(bad_reply("REGION_READ reply"))?;
        if a.count != count || data.len() != count as usize {
            return Err(Error::protocol(format!("REGION_READ of {count} bytes answered with {}", data.len())));
        }
        Ok(data.to_vec())
    }

    pub(super) fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        let q = RegionAccess::to_bytes_with_data(offset, region, data);
        self.request(Command::RegionWrite, &q, &[]).map(|_| ())
    }
}

/// The reply `m` checked against the request it must answer (`id`, `cmd`):
/// another one is a protocol error, an error reply is [`Error::Remote`].
fn reply_to(id: u16, cmd: Command, m: Received) -> Result<Received> {
    if m.hdr.msg_id != id || m.hdr.cmd != cmd as u16 {
        let (got, c) = (m.hdr.msg_id, m.hdr.cmd);
        return Err(Error::protocol(format!("reply {got} to command {c} while waiting for {id}")));
    }
    if m.hdr.is_error() {
        return Err(Error::Remote { command: format!("{cmd:?}"), errno: m.hdr.error_no });
    }
    Ok(m)
}
