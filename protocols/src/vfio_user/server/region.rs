//! Regions: GET_REGION_INFO (with the BAR parts the device shares as a
//! sparse mmap), GET_REGION_IO_FDS, and REGION_READ / REGION_WRITE /
//! REGION_WRITE_MULTI checked against the region.

use super::{no_fds, ok, IoFds, Reply, Session};
use crate::function::PciFunction;
use crate::vfio_user::ioregionfd;
use crate::vfio_user::wire::*;
use crate::vfio_user::{Received, CONFIG_REGION_SIZE};
use crate::{Error, Result};
use iopath_devices::BarKind;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

impl Session<'_> {
    pub(super) fn region_info(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let q = RegionInfo::parse(fixed_part(&m.payload, REGION_INFO_SIZE))?;
        let g = self.srv.function();
        let size = region_size(&g, q.index).ok_or_else(|| Error::protocol(format!("no region {}", q.index)))?;
        let mut flags = if size > 0 { REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE } else { 0 };
        // Parts of this BAR the device shares as memory: a sparse mmap of one fd.
        let areas: Vec<_> = g.device.mapped_areas().into_iter().filter(|a| a.bar as u32 == q.index).collect();
        drop(g);
        let base = areas.first().map(|a| a.fd_offset.wrapping_sub(a.offset)).unwrap_or(0);
        let sparse: Vec<SparseMmapArea> = areas
            .iter()
            .filter(|a| a.fd_offset.wrapping_sub(a.offset) == base)
            .map(|a| SparseMmapArea { offset: a.offset, size: a.size })
            .collect();
        let Some(first) = areas.into_iter().next().filter(|_| !sparse.is_empty()) else {
            return ok(RegionInfoReply::new(q.index, flags, size, 0, None).fit(q.argsz).to_bytes());
        };
        flags |= REGION_INFO_FLAG_MMAP;
        let reply = RegionInfoReply::new(q.index, flags, size, base, Some(sparse)).fit(q.argsz);
        // The fd goes with the sparse mmap capability it belongs to: a reply too small for
        // that (the client asks again with the argsz it says) carries neither, as libvfio-user
        // answers. Its clients read such a reply with no room for an fd, and one there cuts
        // the message (MSG_CTRUNC: the client fails with EFAULT); QEMU and the rust-vmm client
        // drop an fd that came with it and take the one of the full reply.
        let fds = if reply.is_truncated() { Vec::new() } else { vec![OwnedFd::from(first.fd)] };
        Ok(Reply::Data(reply.to_bytes(), fds))
    }

    /// The BAR's announced ioeventfds, or its ioregionfd region, by the
    /// server's [`IoFds`]. A BAR has one region per session, made on the
    /// first request: a repeated request hands out another copy of its fd
    /// (a new region only if the client broke the old one's rules).
    pub(super) fn region_io_fds(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let q = IoFdsRequest::parse(fixed_part(&m.payload, INFO16_SIZE))?;
        let spec = self.srv.function().config.bar_specs().find(|b| b.index as u32 == q.index);
        let spec = spec.ok_or_else(|| Error::protocol(format!("no BAR {}", q.index)))?;
        let (mut entries, mut fds) = (Vec::new(), Vec::new());
        match self.srv.io_fds {
            IoFds::IoEventFds => {
                let pio = if spec.kind == BarKind::Io { KVM_IOEVENTFD_FLAG_PIO } else { 0 };
                let announced = iopath_devices::lock(&self.srv.announced.0);
                // One fd per eventfd, however many entries ring it.
                let mut sent = Vec::new();
                for (e, _, fd) in announced.iter().filter(|(e, _, _)| e.bar == spec.index) {
                    let raw = fd.as_raw_fd();
                    let fd_index = match sent.iter().position(|r| *r == raw) {
                        Some(i) => i,
                        None => {
                            // SAFETY: the eventfd is open while `announced` is locked; the copy is ours.
                            let fd = unsafe { BorrowedFd::borrow_raw(raw) };
                            fds.push(fd.try_clone_to_owned().map_err(|e| Error::io("dup of an ioeventfd", e))?);
                            sent.push(raw);
                            sent.len() - 1
                        }
                    };
                    let dm = if e.datamatch.is_some() { KVM_IOEVENTFD_FLAG_DATAMATCH } else { 0 };
                    entries.push(IoFdEntry::IoEventFd {
                        offset: e.offset,
                        size: e.len as u64,
                        fd_index: fd_index as u32,
                        flags: dm | pio,
                        datamatch: e.datamatch.unwrap_or(0),
                    });
                }
            }
            IoFds::IoRegionFds { posted } => {
                let region = match self.regions.remove(&spec.index) {
                    Some(r) if r.served() => r,
                    old => {
                        drop(old); // its thread is over: joined
                        ioregionfd::Region::new(self.srv.f.clone(), spec, posted)?
                    }
                };
                let (entry, theirs) = self.regions.entry(spec.index).or_insert(region).offer()?;
                entries.push(entry);
                fds.push(theirs);
            }
        }
        // No more fds than the client takes in one message: the sub-regions
        // beyond them are left out (their accesses come as messages).
        let max = self.client.max_msg_fds as usize;
        if fds.len() > max {
            log::info!("vfio-user {}: BAR{}: {} io fds, the client takes {max}", self.peer, q.index, fds.len());
            entries.retain(|e| (e.fd_index() as usize) < max);
            fds.truncate(max);
        }
        let r = IoFdsReply::new(q.index, entries).fit(q.argsz);
        if r.is_truncated() {
            fds.clear();
        }
        Ok(Reply::Data(r.to_bytes(), fds))
    }

    pub(super) fn region_read(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let a = RegionAccess::parse(&m.payload)?;
        let mut f = self.srv.function();
        let size = region_size(&f, a.region).ok_or_else(|| Error::protocol(format!("no region {}", a.region)))?;
        if a.count as u64 > size {
            return Err(Error::protocol(format!("REGION_READ of {} bytes from a region of {size}", a.count)));
        }
        let mut data = vec![0u8; a.count as usize];
        region_access(&mut f, a.region, a.offset, Access::Read(&mut data))?;
        ok(RegionAccess::to_bytes_with_data(a.offset, a.region, &data))
    }

    pub(super) fn region_write(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let (a, data) = RegionAccess::parse_with_data(&m.payload)?;
        region_access(&mut self.srv.function(), a.region, a.offset, Access::Write(data))?;
        ok(a.to_bytes())
    }

    pub(super) fn region_write_multi(&mut self, m: &Received) -> Result<Reply> {
        no_fds(m)?;
        let w = RegionWriteMulti::parse(&m.payload)?;
        let mut f = self.srv.function();
        for x in &w.writes {
            region_access(&mut f, x.region, x.offset, Access::Write(x.bytes()))?;
        }
        ok(RegionWriteMultiReply { wr_cnt: w.writes.len() as u64 }.to_bytes())
    }
}

enum Access<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

/// The size of region `index` (0 for a BAR the device lacks, ROM and VGA);
/// None past the last region.
fn region_size(f: &PciFunction, index: u32) -> Option<u64> {
    match index {
        0..=5 => Some(f.config.bar_specs().find(|b| b.index as u32 == index).map_or(0, |b| b.size)),
        PCI_CONFIG_REGION_INDEX => Some(config_region_size(f)),
        PCI_ROM_REGION_INDEX | PCI_VGA_REGION_INDEX => Some(0),
        _ => None,
    }
}

/// The configuration region: 4 KiB for a PCI Express function (extended
/// configuration space; with no extended capability, reads past the header
/// give 0, a 0 header at 0x100 ending an empty list), 256 bytes otherwise.
fn config_region_size(f: &PciFunction) -> u64 {
    match f.config.find_capability(iopath_devices::pci::caps::PCI_CAP_ID_EXP) {
        Some(_) => PCIE_CONFIG_REGION_SIZE,
        None => CONFIG_REGION_SIZE,
    }
}

/// A PCI Express function's configuration space.
const PCIE_CONFIG_REGION_SIZE: u64 = 4096;

/// A region access, checked against the region: BARs take 1/2/4/8-byte
/// accesses; config space any length, split into naturally aligned pieces.
fn region_access(f: &mut PciFunction, region: u32, offset: u64, a: Access) -> Result<()> {
    let size = region_size(f, region).ok_or_else(|| Error::protocol(format!("no region {region}")))?;
    let len = match &a {
        Access::Read(d) => d.len(),
        Access::Write(d) => d.len(),
    };
    if offset.checked_add(len as u64).is_none_or(|e| e > size) || len == 0 {
        return Err(Error::protocol(format!("{len} bytes at {offset:#x} outside region {region} ({size:#x} bytes)")));
    }
    if region == PCI_CONFIG_REGION_INDEX {
        let mut a = a;
        let mut pos = 0usize;
        while pos < len {
            let off = offset as usize + pos;
            let n = [4usize, 2, 1].into_iter().find(|n| off.is_multiple_of(*n) && pos + n <= len).unwrap_or(1);
            match &mut a {
                Access::Read(d) => f.config_read(off, &mut d[pos..pos + n]),
                Access::Write(d) => f.config_write(off, &d[pos..pos + n]),
            }
            pos += n;
        }
        return Ok(());
    }
    if !matches!(len, 1 | 2 | 4 | 8) {
        return Err(Error::protocol(format!("BAR access of {len} bytes (1, 2, 4 or 8)")));
    }
    match a {
        Access::Read(d) => f.bar_read(region as u8, offset, d),
        Access::Write(d) => f.bar_write(region as u8, offset, d),
    }
    Ok(())
}
