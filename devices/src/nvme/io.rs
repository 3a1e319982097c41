//! I/O commands on namespace 1 (Flush, Read, Write, Write Zeroes, Dataset
//! Management) and the data movement between guest pages (PRPs) and the
//! backend. The opcodes are listed once, for the effects log, in `admin.rs`.

use super::admin::IO_LBA_CHANGING;
use super::backend::Backend;
use super::controller::Core;
use super::queue::{prp_segments, status, Sqe, PAGE};
use super::MDTS;

/// The namespace: its storage and geometry.
pub(super) struct Namespace {
    pub backend: Backend,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// Size in LBAs.
    pub nlbas: u64,
}

impl Core {
    /// Executes an I/O command; returns its status.
    pub(super) fn io(&mut self, c: &Sqe) -> u16 {
        if c.nsid != 1 {
            return status::INVALID_NAMESPACE;
        }
        let st = match c.opcode {
            0x00 => match self.ns.backend.flush() {
                Ok(()) => status::SUCCESS,
                Err(_) => status::INTERNAL,
            },
            0x01 | 0x02 => self.rw(c, c.opcode == 0x01),
            0x08 => {
                let (slba, n) = (c.cdw10 as u64 | (c.cdw11 as u64) << 32, (c.cdw12 & 0xffff) as u64 + 1);
                if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
                    return status::LBA_OUT_OF_RANGE;
                }
                match self.ns.backend.zero(slba << self.ns.lba_shift, n << self.ns.lba_shift) {
                    Ok(()) => status::SUCCESS,
                    Err(_) => status::INTERNAL,
                }
            }
            0x09 => self.dsm(c),
            _ => status::INVALID_OPCODE,
        };
        // Volatile write cache off (Set Features 06h): what changed is stable before it completes.
        if st == status::SUCCESS && !self.feat.write_cache && IO_LBA_CHANGING.contains(&c.opcode) {
            if let Err(e) = self.ns.backend.flush() {
                log::warn!("nvme: flush with the write cache off: {e}");
                return status::INTERNAL;
            }
        }
        st
    }

    fn rw(&mut self, c: &Sqe, write: bool) -> u16 {
        let slba = c.cdw10 as u64 | (c.cdw11 as u64) << 32;
        let n = (c.cdw12 & 0xffff) as u64 + 1;
        if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
            return status::LBA_OUT_OF_RANGE;
        }
        let bytes = n << self.ns.lba_shift;
        if bytes > PAGE << MDTS {
            return status::INVALID_FIELD;
        }
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let st = match prp_segments(&self.mem, c.prp1, c.prp2, bytes, &mut segs) {
            Err(st) => st,
            Ok(()) => self.transfer(&segs, slba << self.ns.lba_shift, write),
        };
        self.scratch.segs = segs;
        if st == status::SUCCESS {
            if write {
                self.st.writes += 1;
                self.smart.write_units += bytes / 512;
            } else {
                self.st.reads += 1;
                self.smart.read_units += bytes / 512;
            }
        }
        st
    }

    /// Moves data between the backend and the guest pages: a run of pages
    /// that follow each other in guest memory is one access (one message
    /// each way where the host reaches that memory by message).
    fn transfer(&mut self, segs: &[(u64, u64)], mut off: u64, write: bool) -> u16 {
        if matches!(self.ns.backend, Backend::Null) {
            return status::SUCCESS;
        }
        if matches!(self.ns.backend, Backend::File(_)) {
            return self.transfer_whole(segs, off, write);
        }
        for (a, n) in runs(segs) {
            let n = n as usize;
            if self.scratch.buf.len() < n {
                self.scratch.buf.resize(n, 0);
            }
            let buf = &mut self.scratch.buf[..n];
            let (mem, backend) = (&self.mem, &mut self.ns.backend);
            let r = if write {
                mem.read_slice(buf, a).map_err(|_| ()).and_then(|()| backend.write(off, buf).map_err(|_| ()))
            } else {
                backend.read(off, buf).map_err(|_| ()).and_then(|()| mem.write_slice(buf, a).map_err(|_| ()))
            };
            if r.is_err() {
                return status::DATA_TRANSFER_ERROR;
            }
            off += n as u64;
        }
        status::SUCCESS
    }

    /// A file transfer as one aligned backend operation (O_DIRECT-able),
    /// gathered from or scattered to the guest pages.
    fn transfer_whole(&mut self, segs: &[(u64, u64)], off: u64, write: bool) -> u16 {
        let len: u64 = segs.iter().map(|s| s.1).sum();
        let (mem, backend) = (&self.mem, &mut self.ns.backend);
        let buf = self.scratch.bounce.get(len as usize);
        let mut pos = 0usize;
        let mut ok = true;
        if write {
            for (a, n) in runs(segs) {
                ok &= mem.read_slice(&mut buf[pos..pos + n as usize], a).is_ok();
                pos += n as usize;
            }
            ok = ok && backend.write(off, buf).is_ok();
        } else {
            ok = backend.read(off, buf).is_ok();
            for (a, n) in runs(segs) {
                if !ok {
                    break;
                }
                ok = mem.write_slice(&buf[pos..pos + n as usize], a).is_ok();
                pos += n as usize;
            }
        }
        if ok {
            status::SUCCESS
        } else {
            status::DATA_TRANSFER_ERROR
        }
    }

    /// Dataset Management: checks every range, deallocates (zeroes) them
    /// when asked.
    fn dsm(&mut self, c: &Sqe) -> u16 {
        let nr = (c.cdw10 & 0xff) as usize + 1;
        let mut ranges = vec![0u8; nr * 16];
        let mut segs = std::mem::take(&mut self.scratch.segs);
        let r = prp_segments(&self.mem, c.prp1, c.prp2, ranges.len() as u64, &mut segs);
        let mut done = 0;
        let mut st = match r {
            Ok(()) => status::SUCCESS,
            Err(s) => s,
        };
        if st == status::SUCCESS {
            for &(a, n) in &segs {
                if self.mem.read_slice(&mut ranges[done..done + n as usize], a).is_err() {
                    st = status::DATA_TRANSFER_ERROR;
                }
                done += n as usize;
            }
        }
        self.scratch.segs = segs;
        if st != status::SUCCESS {
            return st;
        }
        let deallocate = c.cdw11 & 4 != 0;
        for r in ranges.chunks(16) {
            let n = u32::from_le_bytes(r[4..8].try_into().unwrap()) as u64;
            let slba = u64::from_le_bytes(r[8..16].try_into().unwrap());
            if slba.checked_add(n).is_none_or(|e| e > self.ns.nlbas) {
                return status::LBA_OUT_OF_RANGE;
            }
            if deallocate && self.ns.backend.zero(slba << self.ns.lba_shift, n << self.ns.lba_shift).is_err() {
                return status::INTERNAL;
            }
        }
        status::SUCCESS
    }
}

/// The segments with each run of adjacent ones (one ending where the next
/// begins) merged.
fn runs(segs: &[(u64, u64)]) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let &(a, mut n) = segs.get(i)?;
        i += 1;
        while let Some(&(b, m)) = segs.get(i) {
            if a.checked_add(n) != Some(b) {
                break;
            }
            n += m;
            i += 1;
        }
        Some((a, n))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn adjacent_segments_merge_into_runs() {
        let segs = [(0x1800, 0x800), (0x2000, 0x1000), (0x5000, 0x1000), (0x6000, 0x200), (0x9000, 0x10)];
        let r: Vec<_> = super::runs(&segs).collect();
        assert_eq!(r, [(0x1800, 0x1800), (0x5000, 0x1200), (0x9000, 0x10)]);
        assert_eq!(super::runs(&[]).count(), 0);
    }
}
