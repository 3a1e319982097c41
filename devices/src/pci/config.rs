//! The PCI type-0 configuration header with BAR sizing and a capability list.
//!
//! Owns the 256-byte header and its write masks. It knows nothing of buses:
//! the host (VMM PCI host, or a device process) reads the decoded BAR
//! placements from [`ConfigSpace::bar_placement`] after each write.

use super::*;
use crate::{BarKind, BarSpec, Error, PciIds, Result};

#[derive(Clone)]
pub struct ConfigSpace {
    regs: [u8; CONFIG_SIZE],
    wmask: [u8; CONFIG_SIZE],
    bars: [Option<BarSpec>; 6],
    /// The Power Management capability's offset, if there is one: a write
    /// of a power state its PMC does not offer is ignored.
    pm: Option<usize>,
}

impl ConfigSpace {
    /// Builds the header for `ids` and `bars`. BAR sizes must be powers of two
    /// (at least 16 bytes for memory, 4 for I/O); a 64-bit BAR takes two slots.
    pub fn new(ids: PciIds, bars: &[BarSpec]) -> Result<Self> {
        let mut c = ConfigSpace { regs: [0; CONFIG_SIZE], wmask: [0; CONFIG_SIZE], bars: [None; 6], pm: None };
        c.put16(0x00, ids.vendor);
        c.put16(0x02, ids.device);
        c.put32(0x08, (ids.class << 8) | ids.revision as u32);
        c.put16(0x2c, ids.subsystem_vendor);
        c.put16(0x2e, ids.subsystem);
        c.regs[PCI_INTERRUPT_LINE + 1] = ids.interrupt_pin;
        c.put16(PCI_STATUS, 0x0000); // status: no capabilities list yet
        let cmd_mask = PCI_COMMAND_IO | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE;
        c.wmask[PCI_COMMAND..PCI_COMMAND + 2].copy_from_slice(&cmd_mask.to_le_bytes());
        c.wmask[PCI_INTERRUPT_LINE] = 0xff;
        for b in bars {
            let i = b.index as usize;
            let slots = if b.kind == BarKind::Mem64 { 2 } else { 1 };
            if i + slots > 6 || (i..i + slots).any(|s| c.bars[s].is_some() || c.is_upper_half(s)) {
                return Err(Error::Config(format!("BAR{i} overlaps another BAR or is out of range")));
            }
            let min = if b.kind == BarKind::Io { 4 } else { 16 };
            if !b.size.is_power_of_two() || b.size < min {
                return Err(Error::Config(format!(
                    "BAR{i} size {:#x} is not a power of two of at least {min}",
                    b.size
                )));
            }
            // PCI: a function must not take more than 256 bytes of I/O space per BAR.
            if b.kind == BarKind::Io && b.size > 256 {
                return Err(Error::Config(format!("BAR{i}: {:#x} bytes of I/O space; PCI allows 256 at most", b.size)));
            }
            if b.kind == BarKind::Mem32 && b.size > 1 << 31 {
                return Err(Error::Config(format!("BAR{i} too large for a 32-bit BAR")));
            }
            c.bars[i] = Some(*b);
            let off = PCI_BAR0 + 4 * i;
            let mask = !(b.size - 1);
            match b.kind {
                BarKind::Io => {
                    c.put32(off, 0x1);
                    c.putmask32(off, (mask as u32) & 0xffff_fffc);
                }
                BarKind::Mem32 => {
                    c.put32(off, 0x0);
                    c.putmask32(off, (mask as u32) & 0xffff_fff0);
                }
                BarKind::Mem64 => {
                    c.put32(off, 0x4);
                    c.putmask32(off, (mask as u32) & 0xffff_fff0);
                    c.putmask32(off + 4, (mask >> 32) as u32);
                }
            }
        }
        Ok(c)
    }

    fn is_upper_half(&self, slot: usize) -> bool {
        slot > 0 && matches!(self.bars[slot - 1], Some(BarSpec { kind: BarKind::Mem64, .. }))
    }

    fn put16(&mut self, off: usize, v: u16) {
        self.regs[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put32(&mut self, off: usize, v: u32) {
        self.regs[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn putmask32(&mut self, off: usize, v: u32) {
        self.wmask[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn get32(&self, off: usize) -> u32 {
        u32::from_le_bytes(self.regs[off..off + 4].try_into().unwrap())
    }

    pub fn command(&self) -> u16 {
        u16::from_le_bytes([self.regs[PCI_COMMAND], self.regs[PCI_COMMAND + 1]])
    }

    pub fn bar_specs(&self) -> impl Iterator<Item = BarSpec> + '_ {
        self.bars.iter().flatten().copied()
    }

    /// Reads `data.len()` bytes at `offset`; bytes past the header read as 0
    /// (a conventional device with no extended capabilities), never panics.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        for (i, d) in data.iter_mut().enumerate() {
            *d = offset.checked_add(i).and_then(|o| self.regs.get(o)).copied().unwrap_or(0);
        }
    }

    /// Writes through the write mask; returns what changed.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> ConfigChange {
        let mut change = ConfigChange::default();
        let power_state = self.pm.map_or(0, |pm| self.regs[pm + 4] & 3);
        for (i, &v) in data.iter().enumerate() {
            let Some(o) = offset.checked_add(i).filter(|&o| o < CONFIG_SIZE) else {
                break;
            };
            let old = self.regs[o];
            let new = (old & !self.wmask[o]) | (v & self.wmask[o]);
            if new != old && ((PCI_BAR0..PCI_BAR0 + 24).contains(&o) || o == PCI_COMMAND) {
                change.decode = true;
            }
            self.regs[o] = new;
        }
        self.keep_power_state(offset, data.len(), power_state);
        change
    }

    /// A write of PowerState (PMCSR bits 1:0) that names a state PMC does not
    /// offer (D1, D2) completes but changes nothing (PCI PM 1.2).
    fn keep_power_state(&mut self, offset: usize, len: usize, before: u8) {
        let Some(pm) = self.pm else { return };
        let at = pm + 4;
        if !(offset..offset.saturating_add(len)).contains(&at) {
            return;
        }
        let pmc = u16::from_le_bytes([self.regs[pm + 2], self.regs[pm + 3]]);
        let offered = match self.regs[at] & 3 {
            1 => pmc & super::caps::PMC_D1 != 0,
            2 => pmc & super::caps::PMC_D2 != 0,
            _ => true,
        };
        if !offered {
            self.regs[at] = (self.regs[at] & !3) | before;
        }
    }

    /// The offset of the first capability with `id`, walking the list as a
    /// guest does (bounded: a loop ends it).
    pub fn find_capability(&self, id: u8) -> Option<usize> {
        if self.regs[PCI_STATUS] & PCI_STATUS_CAP_LIST == 0 {
            return None;
        }
        let mut p = (self.regs[PCI_CAPABILITY_LIST] & 0xfc) as usize;
        for _ in 0..48 {
            if p < PCI_CAP_START {
                return None;
            }
            if self.regs[p] == id {
                return Some(p);
            }
            p = (self.regs[p + 1] & 0xfc) as usize;
        }
        None
    }

    /// Programs a BAR's address directly (firmware-style placement).
    pub fn set_bar_addr(&mut self, index: u8, addr: u64) {
        let Some(spec) = self.bars.get(index as usize).copied().flatten() else {
            return;
        };
        let off = PCI_BAR0 + 4 * index as usize;
        let low = self.get32(off);
        let mask = u32::from_le_bytes(self.wmask[off..off + 4].try_into().unwrap());
        self.put32(off, (low & !mask) | (addr as u32 & mask));
        if spec.kind == BarKind::Mem64 {
            let hmask = u32::from_le_bytes(self.wmask[off + 4..off + 8].try_into().unwrap());
            self.put32(off + 4, (addr >> 32) as u32 & hmask);
        }
    }

    /// Routes INTx pin A to interrupt line `line` (the GSI), as firmware would.
    pub fn set_intx_line(&mut self, line: u8) {
        self.regs[PCI_INTERRUPT_LINE] = line;
        self.regs[PCI_INTERRUPT_LINE + 1] = 1;
    }

    /// Lays out `caps` as the capability list, each at its own
    /// [`Capability::offset`], chained in offset order; sets the capability
    /// pointer and the status bit. Every capability must start at a dword
    /// offset from 0x40, fit the header, and overlap no other one; nothing
    /// is written unless all of them do. Called once (a second list is
    /// refused); no capabilities leave the header without a list.
    pub fn add_capabilities(&mut self, caps: &[Capability]) -> Result<()> {
        if caps.is_empty() {
            return Ok(());
        }
        if self.regs[PCI_STATUS] & PCI_STATUS_CAP_LIST != 0 {
            return Err(Error::Config("the capability list is already laid out".into()));
        }
        let mut order: Vec<&Capability> = caps.iter().collect();
        order.sort_by_key(|c| c.offset);
        let mut free = PCI_CAP_START;
        for c in &order {
            let (id, at) = (c.id, c.offset);
            if at < PCI_CAP_START || !at.is_multiple_of(4) {
                return Err(Error::Config(format!("capability {id:#x} at {at:#x}: not a dword offset from 0x40")));
            }
            let end = at.checked_add(2 + c.body.len()).filter(|&e| e <= CONFIG_SIZE);
            let Some(end) = end.filter(|_| c.wmask.len() <= c.body.len()) else {
                return Err(Error::Config(format!("capability {id:#x} at {at:#x} does not fit the header")));
            };
            if at < free {
                return Err(Error::Config(format!("capability {id:#x} at {at:#x} overlaps the one before it")));
            }
            free = end;
        }
        for (i, c) in order.iter().enumerate() {
            let (at, len) = (c.offset, 2 + c.body.len());
            self.regs[at] = c.id;
            self.regs[at + 1] = order.get(i + 1).map_or(0, |n| n.offset as u8);
            self.regs[at + 2..at + len].copy_from_slice(&c.body);
            self.wmask[at + 2..at + 2 + c.wmask.len()].copy_from_slice(&c.wmask);
        }
        self.pm = order.iter().find(|c| c.id == super::caps::PCI_CAP_ID_PM && c.body.len() >= 4).map(|c| c.offset);
        self.regs[PCI_CAPABILITY_LIST] = order[0].offset as u8;
        self.regs[PCI_STATUS] |= PCI_STATUS_CAP_LIST;
        Ok(())
    }

    /// Enables decoding bits in the command register.
    pub fn enable(&mut self, bits: u16) {
        let c = self.command() | bits;
        self.put16(PCI_COMMAND, c);
    }

    /// The BAR's programmed address (decoding enabled or not).
    pub fn bar_addr(&self, index: u8) -> Option<u64> {
        let spec = self.bars.get(index as usize).copied().flatten()?;
        let off = PCI_BAR0 + 4 * index as usize;
        let low = self.get32(off) as u64;
        Some(match spec.kind {
            BarKind::Io => low & !0x3,
            BarKind::Mem32 => low & !0xf,
            BarKind::Mem64 => (low & !0xf) | ((self.get32(off + 4) as u64) << 32),
        })
    }

    /// Where BAR `index` decodes now: None while its space is disabled in the
    /// command register, while it is unassigned (0), or when it does not fit
    /// its address space.
    pub fn bar_placement(&self, index: u8) -> Option<BarPlacement> {
        let spec = self.bars.get(index as usize).copied().flatten()?;
        let addr = self.bar_addr(index)?;
        let cmd = self.command();
        let enabled = match spec.kind {
            BarKind::Io => cmd & PCI_COMMAND_IO != 0,
            _ => cmd & PCI_COMMAND_MEMORY != 0,
        };
        let limit = if spec.kind == BarKind::Io { 0x1_0000 } else { u64::MAX };
        let fits = addr.checked_add(spec.size).is_some_and(|end| end <= limit);
        (enabled && addr != 0 && fits).then_some(BarPlacement { spec, addr })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msix_cap(offset: usize) -> Capability {
        let body = vec![0x3f, 0, 0, 0x20, 0, 0, 0, 0x30, 0, 0];
        Capability { offset, id: PCI_CAP_ID_MSIX, body, wmask: vec![0, 0xc0] }
    }

    #[test]
    fn capabilities_sit_where_declared_chained_in_offset_order_and_only_their_writable_bits_change() {
        let mut c = ConfigSpace::new(ids(), &[]).unwrap();
        let other = Capability { offset: 0x40, id: 0x10, body: vec![0; 2], wmask: vec![] };
        c.add_capabilities(&[msix_cap(0x50), other]).unwrap();
        let mut b = [0u8; 4];
        c.read(PCI_CAPABILITY_LIST, &mut b[..1]);
        assert_eq!(b[0], 0x40, "the list starts at the lowest offset");
        c.read(0x40, &mut b);
        assert_eq!(b, [0x10, 0x50, 0, 0]);
        c.read(0x50, &mut b);
        assert_eq!(b, [0x11, 0x00, 0x3f, 0x00], "MSI-X at 0x50, the last one");
        c.write(0x50, &[0xff, 0xff, 0xff, 0xff]);
        c.read(0x50, &mut b);
        assert_eq!(b, [0x11, 0x00, 0x3f, 0xc0], "only enable and function mask are writable");
        let mut st = [0u8; 2];
        c.read(PCI_STATUS, &mut st);
        assert_eq!(st[0] & PCI_STATUS_CAP_LIST, PCI_STATUS_CAP_LIST);
        assert!(c.add_capabilities(&[msix_cap(0x80)]).is_err(), "one list per header");
        // MsixTable's own capability lands at the offset it was given.
        let mut c = ConfigSpace::new(ids(), &[]).unwrap();
        c.add_capabilities(&[MsixTable::new(65, 0, 0x2000, 0x3000, 0x60).capability()]).unwrap();
        let cfg: Vec<u8> = (0..CONFIG_SIZE)
            .map(|o| {
                let mut b = [0u8];
                c.read(o, &mut b);
                b[0]
            })
            .collect();
        let m = MsixTable::find(&cfg, 2048).unwrap();
        assert_eq!((m.cap_offset(), m.vectors()), (0x60, 65));
    }

    #[test]
    fn misplaced_capabilities_are_refused_and_nothing_is_written() {
        let bad: [&[Capability]; 5] = [
            &[msix_cap(0x3c)],
            &[msix_cap(0x42)],
            &[msix_cap(0xf8)],
            &[msix_cap(0x40), msix_cap(0x48)],
            &[Capability { offset: 0x40, id: 9, body: vec![0], wmask: vec![0, 0] }],
        ];
        for caps in bad {
            let mut c = ConfigSpace::new(ids(), &[]).unwrap();
            assert!(matches!(c.add_capabilities(caps), Err(Error::Config(_))), "{caps:?}");
            let mut b = [0u8; 4];
            c.read(PCI_CAPABILITY_LIST, &mut b[..1]);
            c.read(PCI_STATUS, &mut b[1..2]);
            c.read(0x40, &mut b[2..4]);
            assert_eq!(b, [0; 4], "{caps:?}");
        }
        let mut c = ConfigSpace::new(ids(), &[]).unwrap();
        c.add_capabilities(&[msix_cap(0xf4)]).unwrap(); // 12 bytes: 0xf4..0x100 fits exactly
        c.add_capabilities(&[]).unwrap();
    }

    fn ids() -> PciIds {
        PciIds {
            vendor: 0x1b36,
            device: 0x0005,
            class: 0xff0000,
            revision: 1,
            subsystem_vendor: 0,
            subsystem: 0,
            interrupt_pin: 0,
        }
    }

    fn rd32(c: &ConfigSpace, off: usize) -> u32 {
        let mut b = [0u8; 4];
        c.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn wr32(c: &mut ConfigSpace, off: usize, v: u32) -> ConfigChange {
        c.write(off, &v.to_le_bytes())
    }

    fn bars() -> Vec<BarSpec> {
        vec![
            BarSpec { index: 0, kind: BarKind::Mem64, size: 0x4000 },
            BarSpec { index: 2, kind: BarKind::Io, size: 0x100 },
            BarSpec { index: 3, kind: BarKind::Mem32, size: 0x1000 },
        ]
    }

    #[test]
    fn identity_and_class() {
        let c = ConfigSpace::new(ids(), &bars()).unwrap();
        assert_eq!(rd32(&c, 0), 0x0005_1b36);
        assert_eq!(rd32(&c, 8), 0xff00_0001);
        assert_eq!(rd32(&c, 0x0c) >> 16 & 0x7f, 0, "header type 0");
    }

    #[test]
    fn bar_sizing_reads_back_size_mask_and_type() {
        let mut c = ConfigSpace::new(ids(), &bars()).unwrap();
        for off in [0x10, 0x14, 0x18, 0x1c, 0x20, 0x24] {
            wr32(&mut c, off, 0xffff_ffff);
        }
        assert_eq!(rd32(&c, 0x10), 0xffff_c004, "64-bit memory BAR low half");
        assert_eq!(rd32(&c, 0x14), 0xffff_ffff, "64-bit memory BAR high half");
        assert_eq!(rd32(&c, 0x18), 0xffff_ff01, "256-byte I/O BAR (bits 31:16 as QEMU does)");
        assert_eq!(rd32(&c, 0x1c), 0xffff_f000, "4 KiB 32-bit memory BAR");
        assert_eq!(rd32(&c, 0x20), 0, "unimplemented BAR reads 0");
        assert_eq!(rd32(&c, 0x24), 0);
    }

    #[test]
    fn placement_needs_address_and_decode_enable() {
        let mut c = ConfigSpace::new(ids(), &bars()).unwrap();
        assert!(wr32(&mut c, 0x10, 0xe000_0000).decode);
        wr32(&mut c, 0x14, 0x1);
        wr32(&mut c, 0x18, 0xc000);
        assert_eq!(c.bar_placement(0), None, "memory decode is off");
        c.write(PCI_COMMAND, &[0x3, 0]);
        let p = c.bar_placement(0).unwrap();
        assert_eq!(p.addr, 0x1_e000_0000);
        assert_eq!(c.bar_placement(2).unwrap().addr, 0xc000);
        assert_eq!(c.bar_placement(3), None, "unassigned BAR does not decode");
        assert_eq!(c.bar_placement(1), None, "upper half of a 64-bit BAR is not a BAR");
        // Misaligned address bits are masked off.
        wr32(&mut c, 0x1c, 0xe000_1234);
        assert_eq!(c.bar_placement(3).unwrap().addr, 0xe000_1000);
    }

    #[test]
    fn readonly_fields_ignore_writes() {
        let mut c = ConfigSpace::new(ids(), &bars()).unwrap();
        wr32(&mut c, 0, 0xdead_beef);
        assert_eq!(rd32(&c, 0), 0x0005_1b36);
        assert!(!wr32(&mut c, 0x3c, 0x0b).decode);
        assert_eq!(rd32(&c, 0x3c) & 0xff, 0x0b);
        // Out-of-range accesses neither panic nor wrap.
        let mut b = [0u8; 4];
        c.read(254, &mut b);
        assert_eq!(b[2..], [0, 0]);
        c.write(usize::MAX - 1, &[1, 2, 3]);
    }

    #[test]
    fn io_bar_past_64k_does_not_decode() {
        let mut c = ConfigSpace::new(ids(), &bars()).unwrap();
        c.enable(PCI_COMMAND_IO);
        wr32(&mut c, 0x18, 0x1_ff00);
        assert_eq!(c.bar_placement(2), None);
    }

    #[test]
    fn invalid_bar_layouts_are_rejected() {
        let bad = [BarSpec { index: 5, kind: BarKind::Mem64, size: 0x1000 }];
        assert!(ConfigSpace::new(ids(), &bad).is_err());
        let bad = [BarSpec { index: 0, kind: BarKind::Mem32, size: 0x1001 }];
        assert!(ConfigSpace::new(ids(), &bad).is_err());
        let bad = [
            BarSpec { index: 0, kind: BarKind::Mem64, size: 0x1000 },
            BarSpec { index: 1, kind: BarKind::Io, size: 0x10 },
        ];
        assert!(ConfigSpace::new(ids(), &bad).is_err());
        // A 16 KiB I/O BAR (libvfio-user's server sample has one): a power of two, over PCI's
        // 256 bytes, and the error says which.
        let bad = [BarSpec { index: 1, kind: BarKind::Io, size: 0x4000 }];
        let e = ConfigSpace::new(ids(), &bad).err().expect("refused").to_string();
        assert!(e.contains("BAR1: 0x4000 bytes of I/O space; PCI allows 256 at most"), "{e}");
        assert!(ConfigSpace::new(ids(), &[BarSpec { index: 1, kind: BarKind::Io, size: 0x100 }]).is_ok());
    }
}
