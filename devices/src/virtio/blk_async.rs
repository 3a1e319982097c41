//! virtio-blk requests on a `file:` disk's io_uring (the block layer's
//! `FileStorage` slots, as NVMe's `io.rs` uses them), served by the
//! `virtio-blk` thread (notify=ioeventfd or poll).
//!
//! An IN or OUT request is cut into pieces of [`MAX_IO`], one slot (and
//! its bounce buffer) each; an OUT's data is gathered into the buffers
//! before its pieces are pushed, an IN's scattered to the chain's writable
//! buffers as each piece is reaped. A request completes once, when its
//! last piece is reaped: S_OK if every piece did, else S_IOERR (an IN then
//! reports no data). A FLUSH is one fdatasync that starts only when every
//! operation submitted before it has completed (IOSQE_IO_DRAIN), so it
//! covers every write the driver saw complete before it made the FLUSH
//! available (virtio 1.2, 5.2.6.2), and more. Completions reach the used
//! ring in the order they are reaped, which virtio allows.
//!
//! A request whose pieces need more slots than are free is left in the
//! available ring ([`Queue::unpop`](crate::virtio::queue::Queue::unpop)) until a
//! reap frees them. Data moves only through the slots' own buffers, never
//! on guest pages in place, so the kernel writes no guest memory: a
//! request cancelled by a reset or the end of a run ([`Flight::cancel`])
//! writes nothing to the guest when its operations are reaped, and
//! `cancel` waits (bounded) until none is in flight. Each request carries
//! its [`Plan`] (`blk_emu.rs`): an IN's data is corrupted, if a rule said
//! so, when its last piece is reaped, and its due time goes back with it.

use crate::block::{FileOp, Storage, FILE_SLOTS, MAX_IO};
use crate::virtio::blk::{self, Blk, Done, Part, T_IN, T_OUT};
use crate::virtio::blk_emu::{self, Plan};
use crate::virtio::queue::Desc;
use crate::GuestMem;
use std::time::Duration;

// Every request fits in the slots at once, so one always starts once the
// slots are free.
const _: () = assert!(blk::MAX_REQUEST.div_ceil(MAX_IO as u64) <= FILE_SLOTS as u64);

/// How long a reset or the end of a run waits for the operations in flight.
const CANCEL_WAIT: Duration = Duration::from_secs(10);

/// A request whose pieces are in flight.
struct Req {
    queue: u16,
    head: u16,
    kind: u32,
    descs: Vec<Desc>,
    /// Pieces pushed and not yet reaped.
    left: u32,
    /// A piece failed (or could not be started).
    failed: bool,
    plan: Plan,
}

/// What [`Flight::start`] did with a chain.
pub(super) enum Started {
    /// Served at once (not a file transfer, or nothing could be pushed).
    Done(Done),
    /// Its pieces are in flight; it completes from [`Flight::reap`].
    InFlight,
    /// Too few slots free: the caller gives the chain back to the ring.
    NoRoom,
}

/// A request a reap completed: its queue, head, result and due time.
pub(super) type Completed = (u16, u16, Done, Option<u64>);

/// The requests in flight on a file disk's io_uring.
pub(super) struct Flight {
    reqs: Vec<Option<Req>>,
    free: Vec<u32>,
    /// Per io_uring slot: its request, and its piece's offset and length
    /// in the request's data.
    slots: Vec<Option<(u32, u64, usize)>>,
    /// Times a chain waited for slots.
    pub(super) slot_waits: u64,
}

impl Default for Flight {
    fn default() -> Self {
        Flight { reqs: Vec::new(), free: Vec::new(), slots: vec![None; FILE_SLOTS], slot_waits: 0 }
    }
}

impl Flight {
    /// Requests in flight.
    pub(super) fn requests(&self) -> usize {
        self.reqs.len() - self.free.len()
    }

    /// Starts chain `head` of queue `queue`: a file transfer is pushed
    /// (submitted by the caller's [`FileStorage::submit`]), anything else
    /// is served by [`Blk::handle`].
    ///
    /// [`FileStorage::submit`]: crate::block::FileStorage::submit
    /// `plan`'s corruption is applied to an IN's data before it completes.
    pub(super) fn start(
        &mut self,
        b: &mut Blk,
        mem: &GuestMem,
        (queue, head): (u16, u16),
        descs: Vec<Desc>,
        plan: Plan,
    ) -> Started {
        let transfer = b.plan(mem, &descs);
        let (Some(io), Storage::File(f)) = (transfer, &mut b.storage) else {
            return Started::Done(blk_emu::corrupted(mem, &descs, b.handle(mem, &descs), &plan));
        };
        if !f.is_async() {
            return Started::Done(blk_emu::corrupted(mem, &descs, b.handle(mem, &descs), &plan));
        }
        let pieces = io.len.div_ceil(MAX_IO as u64).max(1) as usize;
        if f.free_slots() < pieces {
            if f.in_flight() == 0 {
                return Started::Done(blk_emu::corrupted(mem, &descs, b.handle(mem, &descs), &plan));
                // cannot be: every slot would be free
            }
            self.slot_waits += 1;
            return Started::NoRoom;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.reqs.push(None);
                (self.reqs.len() - 1) as u32
            }
        };
        let op = match io.kind {
            T_IN => FileOp::Read,
            T_OUT => FileOp::Write { dsync: false },
            _ => FileOp::Flush,
        };
        let r = Part::new(descs.iter().filter(|d| !d.write));
        let (mut left, mut failed) = (0u32, false);
        for k in 0..pieces {
            let at = (k * MAX_IO) as u64;
            let n = (io.len - at).min(MAX_IO as u64) as usize;
            let Some(slot) = f.take_slot() else {
                failed = true;
                break;
            };
            if op == (FileOp::Write { dsync: false }) && !r.read(mem, 16 + at, f.buffer(slot, n)) {
                f.release(slot);
                failed = true;
                break;
            }
            if !f.push(slot, op, io.off + at, n) {
                f.release(slot);
                failed = true;
                break;
            }
            self.slots[slot as usize] = Some((id, at, n));
            left += 1;
        }
        if left == 0 {
            self.free.push(id);
            return Started::Done(blk::finish(mem, &descs, io.kind, false));
        }
        self.reqs[id as usize] = Some(Req { queue, head, kind: io.kind, descs, left, failed, plan });
        Started::InFlight
    }

    /// Reaps what the file completed, without waiting (after sending what
    /// an earlier submit left in the ring); returns the requests whose last
    /// piece it reaped. An IN's data goes to the guest as its pieces are
    /// reaped, and only while `live(queue)`; a request of a queue that is
    /// not live completes with nothing written and is not returned.
    pub(super) fn reap(&mut self, b: &mut Blk, mem: &GuestMem, live: impl Fn(u16) -> bool) -> Vec<Completed> {
        let mut out = Vec::new();
        let Storage::File(f) = &mut b.storage else { return out };
        f.submit();
        while let Some((slot, r)) = f.reap() {
            let Some((id, at, n)) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
                f.release(slot); // cancelled by a reset
                continue;
            };
            let Some(req) = self.reqs.get_mut(id as usize).and_then(Option::as_mut) else {
                f.release(slot);
                continue;
            };
            let mut ok = match r {
                Ok(()) => true,
                Err(e) => {
                    log::debug!("virtio-blk: file {}: {e}", if req.kind == T_IN { "read" } else { "write or flush" });
                    false
                }
            };
            let live = live(req.queue);
            if ok && live && req.kind == T_IN && !req.failed {
                let w = Part::new(req.descs.iter().filter(|d| d.write));
                ok = w.write(mem, at, f.buffer(slot, n));
            }
            f.release(slot);
            req.failed |= !ok;
            req.left -= 1;
            if req.left > 0 {
                continue;
            }
            let req = self.reqs[id as usize].take().expect("the request just looked at");
            self.free.push(id);
            if live {
                let ok = match req.plan.corrupt {
                    Some(c) if !req.failed && req.kind == T_IN => blk_emu::corrupt(mem, &req.descs, &c),
                    _ => !req.failed,
                };
                out.push((req.queue, req.head, blk::finish(mem, &req.descs, req.kind, ok), req.plan.due));
            }
        }
        out
    }

    /// Forgets every request in flight (none will complete) and waits, at
    /// most [`CANCEL_WAIT`], until the file has no operation in flight; their
    /// slots are freed as they are reaped. True if none is left in flight.
    pub(super) fn cancel(&mut self, b: &mut Blk) -> bool {
        self.reqs.clear();
        self.free.clear();
        self.slots.iter_mut().for_each(|s| *s = None);
        let Storage::File(f) = &mut b.storage else { return true };
        if f.drain(CANCEL_WAIT) {
            return true;
        }
        log::error!("virtio-blk: {} file operations still in flight {CANCEL_WAIT:?} after a reset", f.in_flight());
        false
    }
}
