//! A file namespace's operations in flight: slots taken, operations
//! pushed onto its io_uring (a queue pass pushes many, then submits once),
//! waited for, and their completions reaped, each with its slot and result.
//! A front end maps slots to its commands (NVMe's `io.rs`) or to the
//! pieces of its requests (virtio-blk's `blk_async.rs`).

use super::uring::{FileOp, SUBMIT_BYTES};
use super::FileStorage;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use vmm_sys_util::eventfd::EventFd;

impl FileStorage {
    /// True when commands go through io_uring (asynchronously).
    pub fn is_async(&self) -> bool {
        self.uring.is_some()
    }

    /// The eventfd io_uring signals on each completion.
    pub fn completion_fd(&self) -> Option<Arc<EventFd>> {
        self.uring.as_ref().map(|u| u.done.clone())
    }

    /// Operations pushed and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.uring.as_ref().map_or(0, |u| u.in_flight)
    }

    /// Takes a free slot (None: all [`FILE_SLOTS`](super::FILE_SLOTS) are taken, or no io_uring).
    pub fn take_slot(&mut self) -> Option<u16> {
        self.uring.as_mut()?.free.pop()
    }

    /// True if a slot is free (or commands are served synchronously).
    pub fn has_room(&self) -> bool {
        self.uring.as_ref().is_none_or(|u| !u.free.is_empty())
    }

    /// Slots free now (0 without an io_uring).
    pub fn free_slots(&self) -> usize {
        self.uring.as_ref().map_or(0, |u| u.free.len())
    }

    /// Gives a slot back; its operation must have been reaped (or never pushed).
    pub fn release(&mut self, slot: u16) {
        if let Some(u) = self.uring.as_mut() {
            debug_assert!(!u.free.contains(&slot));
            u.free.push(slot);
        }
    }

    /// Slot `slot`'s buffer, `len` bytes, 4 KiB aligned (not while its
    /// operation is in flight).
    pub fn buffer(&mut self, slot: u16, len: usize) -> &mut [u8] {
        self.uring.as_mut().expect("a slot is taken from the io_uring").arena.get(slot, len)
    }

    /// Queues slot `slot`'s operation on the ring (sent at the next
    /// [`submit`](Self::submit)); `len` bytes of its buffer at byte `off`.
    /// False if the ring refused it, or it does not lie inside the
    /// namespace (the slot is still the caller's).
    pub fn push(&mut self, slot: u16, op: FileOp, off: u64, len: usize) -> bool {
        use io_uring::{opcode, squeue::Flags, types};
        if off.checked_add(len as u64).is_none_or(|end| end > self.bytes()) {
            return false; // past the namespace: the front end checked, this is the layer's guard
        }
        let Some(u) = self.uring.as_mut() else { return false };
        let ptr = u.arena.get(slot, len).as_mut_ptr();
        let fixed = op != FileOp::Flush && u.register(slot);
        let s = &mut u.slots[slot as usize];
        (s.op, s.off, s.len, s.guest) = (op, off, len, false);
        let fd = types::Fixed(0);
        let (n, flags) = (len as u32, if op == (FileOp::Write { dsync: true }) { libc::RWF_DSYNC } else { 0 });
        let e = match op {
            FileOp::Read if fixed => opcode::ReadFixed::new(fd, ptr, n, slot).offset(off).build(),
            FileOp::Read => opcode::Read::new(fd, ptr, n).offset(off).build(),
            FileOp::Write { .. } if fixed => {
                opcode::WriteFixed::new(fd, ptr, n, slot).offset(off).rw_flags(flags).build()
            }
            FileOp::Write { .. } => opcode::Write::new(fd, ptr, n).offset(off).rw_flags(flags).build(),
            FileOp::Flush => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().flags(Flags::IO_DRAIN),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer is the slot's own and stays put (it is neither
        // resized nor freed) until this operation's completion is reaped:
        // the slot is not given back before that, and Drop waits for it.
        if unsafe { u.ring.submission().push(&e) }.is_err() {
            return false;
        }
        self.pushed(if matches!(op, FileOp::Write { .. }) { len } else { 0 });
        true
    }

    /// Counts an operation just pushed, `copied` bytes gathered into its
    /// bounce buffer before; submits what was pushed once the copies add up
    /// to [`SUBMIT_BYTES`] or [`submit_batch`](Self::submit_batch) operations wait.
    pub(super) fn pushed(&mut self, copied: usize) {
        let batch_full = match self.uring.as_mut() {
            Some(u) => {
                u.in_flight += 1;
                self.submit_batch > 0 && u.ring.submission().len() >= self.submit_batch
            }
            None => false,
        };
        // A queue pass pushes many and submits once, but bounced writes are
        // copied into their slots as they are pushed (64 KiB: several us
        // each): the first would wait for every copy after it. Submitted
        // every SUBMIT_BYTES of copies instead, so the file sees them while
        // the rest copy. Reads and transfers in place copy nothing first.
        self.unsent_bytes += copied;
        if self.unsent_bytes >= SUBMIT_BYTES || batch_full {
            self.submit();
        }
    }

    /// Sends every pushed operation to the kernel, without waiting. What
    /// the kernel does not take stays in the ring for the next submit; the
    /// first time, the completion eventfd is signalled so that the device
    /// thread wakes (no completion may come to wake it) and retries.
    pub fn submit(&mut self) {
        self.unsent_bytes = 0;
        let Some(u) = self.uring.as_mut() else { return };
        while !u.ring.submission().is_empty() {
            #[cfg(test)]
            if self.fail_submits > 0 {
                self.fail_submits -= 1;
                break;
            }
            match u.ring.submit() {
                Ok(0) => break, // nothing taken: try again next time rather than spin
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                // Kept in the ring: the next submit (each pass, each reap) sends them.
                Err(e) => {
                    log::debug!("nvme: io_uring submit: {e}");
                    break;
                }
            }
        }
        let unsent = u.ring.submission().len();
        self.max_in_flight = self.max_in_flight.max((u.in_flight - unsent) as u64);
        if unsent > 0 && !self.stalled {
            let _ = u.done.write(1);
        }
        self.stalled = unsent > 0;
    }

    /// Tests: what the taken slots do.
    #[cfg(test)]
    pub fn taken_ops(&self) -> Vec<FileOp> {
        let Some(u) = &self.uring else { return Vec::new() };
        (0..super::FILE_SLOTS as u16).filter(|s| !u.free.contains(s)).map(|s| u.slots[s as usize].op).collect()
    }

    /// Operations wait in the ring for a submit the kernel refused.
    pub fn stalled(&self) -> bool {
        self.stalled
    }

    /// Blocks until an operation completes; false if none is in flight or
    /// waiting failed.
    pub fn wait(&mut self) -> bool {
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        loop {
            match u.ring.submit_and_wait(1) {
                Ok(_) => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("nvme: io_uring wait: {e}");
                    return false;
                }
            }
        }
    }

    /// Blocks until an operation completes or `timeout` passed (sends what
    /// an earlier submit left in the ring first); false if none is in
    /// flight, the time passed or waiting failed.
    pub fn wait_for(&mut self, timeout: std::time::Duration) -> bool {
        use std::os::fd::AsRawFd;
        self.submit();
        let Some(u) = self.uring.as_mut() else { return false };
        if u.in_flight == 0 {
            return false;
        }
        if !u.ring.completion().is_empty() {
            return true;
        }
        // The ring's fd is readable while its completion queue holds an entry.
        let mut p = libc::pollfd { fd: u.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            n if n > 0 => true,
            0 => false,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    log::warn!("block: io_uring wait: {e}");
                    return false;
                }
                true // the caller looks again (and checks its deadline)
            }
        }
    }

    /// Reaps and frees every operation in flight, waiting at most `timeout`
    /// for the last of them (a front end that forgot its commands: a reset,
    /// the end of a run). True if none is left in flight.
    pub fn drain(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            while let Some((slot, _)) = self.reap() {
                self.release(slot);
            }
            if self.in_flight() == 0 {
                return true;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || !self.wait_for(left) {
                return false;
            }
        }
    }

    /// The next completed operation, without waiting: its slot and result.
    /// The slot stays taken (its buffer holds the data read) until
    /// [`release`](Self::release). A read or write the filesystem refuses
    /// O_DIRECT for (EINVAL: its block size) is done here with the buffered fd.
    pub fn reap(&mut self) -> Option<(u16, std::io::Result<()>)> {
        let u = self.uring.as_mut()?;
        let c = u.ring.completion().next()?;
        u.in_flight -= 1;
        let slot = c.user_data() as u16;
        let Some(&s) = u.slots.get(slot as usize) else {
            return self.reap(); // not one of ours (cannot be: user_data is a slot)
        };
        let n = c.result();
        if s.guest {
            let r = self.reap_guest(slot, n);
            return Some((slot, r));
        }
        let r = match s.op {
            FileOp::Flush if n == 0 => Ok(()),
            FileOp::Read | FileOp::Write { .. } if n >= 0 && n as usize == s.len => {
                self.direct_ops += 1;
                Ok(())
            }
            FileOp::Read if n == -libc::EINVAL => self.file.read_exact_at(u.arena.get(slot, s.len), s.off),
            FileOp::Write { dsync } if n == -libc::EINVAL => {
                let r = self.file.write_all_at(u.arena.get(slot, s.len), s.off);
                if dsync {
                    r.and_then(|()| self.file.sync_data())
                } else {
                    r
                }
            }
            _ if n < 0 => Err(std::io::Error::from_raw_os_error(-n)),
            _ => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short O_DIRECT transfer")),
        };
        Some((slot, r))
    }
}
