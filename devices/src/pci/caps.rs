//! Capabilities a PCI Express endpoint carries besides MSI-X: the PCI
//! Express capability (version 2, an Endpoint) and Power Management
//! (version 3, D0 and D3hot). Each is a [`Capability`] a device returns from
//! `capabilities()`; [`ConfigSpace`](super::ConfigSpace) lays it out and
//! keeps its read-only fields so (the write masks here) and its power
//! state to the states PMC offers.
//!
//! The values describe a x4 link at 8 GT/s with no ASPM, 128-byte payloads,
//! no FLR, no PME, no extended capabilities: what a driver reads to place
//! the function, nothing it could use to ask for more than the model does.

use super::Capability;

pub const PCI_CAP_ID_PM: u8 = 0x01;
pub const PCI_CAP_ID_EXP: u8 = 0x10;

/// Power Management capability length (ID, next, PMC, PMCSR, BSE, Data).
pub const PM_CAP_LEN: usize = 8;
/// PCI Express capability length, version 2 (through Slot Status 2).
pub const EXP_CAP_LEN: usize = 0x3c;

/// PMC: version 3 (PCI PM 1.2), no PME, no D1/D2, no aux current.
pub const PMC: u16 = 0x0003;
/// PMC's D1 and D2 Support bits.
pub const PMC_D1: u16 = 1 << 9;
pub const PMC_D2: u16 = 1 << 10;
/// PMCSR: No_Soft_Reset (D3hot to D0 keeps the function's state), in D0.
pub const PMCSR_NO_SOFT_RESET: u16 = 1 << 3;

/// Power Management at `offset`: D0 and D3hot (PowerState, PMCSR bits 1:0,
/// writable; D1 and D2 are not offered and a write of either is ignored),
/// No_Soft_Reset set: the device keeps its state across D3hot.
pub fn power_management(offset: usize) -> Capability {
    let mut body = vec![0u8; PM_CAP_LEN - 2];
    body[0..2].copy_from_slice(&PMC.to_le_bytes());
    body[2..4].copy_from_slice(&PMCSR_NO_SOFT_RESET.to_le_bytes());
    // Only PowerState is writable (PME_En and PME_Status are read-only 0: no PME).
    let wmask = vec![0, 0, 0x03, 0, 0, 0];
    Capability { offset, id: PCI_CAP_ID_PM, body, wmask }
}

// Register offsets in the PCI Express capability (from its ID byte).
pub const EXP_FLAGS: usize = 0x02;
pub const EXP_DEVCAP: usize = 0x04;
pub const EXP_DEVCTL: usize = 0x08;
pub const EXP_LNKCAP: usize = 0x0c;
pub const EXP_LNKCTL: usize = 0x10;
pub const EXP_LNKSTA: usize = 0x12;
pub const EXP_LNKCAP2: usize = 0x2c;
pub const EXP_LNKCTL2: usize = 0x30;

/// PCI Express Capabilities: version 2, Device/Port Type 0 (Endpoint).
pub const EXP_FLAGS_VALUE: u16 = 0x0002;
/// Device Capabilities: Max_Payload_Size 128 bytes, no phantom functions or
/// extended tags, L0s/L1 acceptable latency unlimited (7, 7), Role-Based
/// Error Reporting, no FLR.
pub const DEVCAP: u32 = 7 << 6 | 7 << 9 | 1 << 15;
/// Device Control at reset: Relaxed Ordering, No Snoop, Max_Read_Request 512 B.
pub const DEVCTL: u16 = 1 << 4 | 1 << 11 | 2 << 12;
/// Device Control's writable bits: error reporting enables (3:0), Relaxed
/// Ordering (4), Max_Payload_Size (7:5), No Snoop (11), Max_Read_Request
/// (14:12). Extended Tag, Phantom Functions, Aux Power and Initiate FLR are
/// hardwired to 0 (not supported).
pub const DEVCTL_WMASK: u16 = 0x00ff | 1 << 11 | 0x7000;
/// Link Capabilities: 8 GT/s (Supported Link Speeds Vector bit 2), x4, no
/// ASPM, ASPM Optionality Compliance.
pub const LNKCAP: u32 = 3 | 4 << 4 | 1 << 22;
/// Link Control's writable bits for an Endpoint: Read Completion Boundary
/// (3), Common Clock Configuration (6), Extended Synch (7). ASPM Control is
/// 0 (no ASPM offered); the rest is reserved for Endpoints or not supported.
pub const LNKCTL_WMASK: u16 = 1 << 3 | 1 << 6 | 1 << 7;
/// Link Status: at 8 GT/s, x4, Slot Clock Configuration.
pub const LNKSTA: u16 = 3 | 4 << 4 | 1 << 12;
/// Link Capabilities 2: Supported Link Speeds 2.5, 5 and 8 GT/s.
pub const LNKCAP2: u32 = 0b1110;
/// Link Control 2 at reset: Target Link Speed 8 GT/s.
pub const LNKCTL2: u16 = 3;
/// Link Control 2's writable bits: all but Selectable De-emphasis (6, HwInit).
pub const LNKCTL2_WMASK: u16 = !(1 << 6);

/// The PCI Express capability of an Endpoint at `offset`, version 2.
pub fn express_endpoint(offset: usize) -> Capability {
    let mut body = vec![0u8; EXP_CAP_LEN - 2];
    let mut wmask = vec![0u8; EXP_CAP_LEN - 2];
    let put = |v: &mut Vec<u8>, at: usize, bytes: &[u8]| v[at - 2..at - 2 + bytes.len()].copy_from_slice(bytes);
    put(&mut body, EXP_FLAGS, &EXP_FLAGS_VALUE.to_le_bytes());
    put(&mut body, EXP_DEVCAP, &DEVCAP.to_le_bytes());
    put(&mut body, EXP_DEVCTL, &DEVCTL.to_le_bytes());
    put(&mut body, EXP_LNKCAP, &LNKCAP.to_le_bytes());
    put(&mut body, EXP_LNKSTA, &LNKSTA.to_le_bytes());
    put(&mut body, EXP_LNKCAP2, &LNKCAP2.to_le_bytes());
    put(&mut body, EXP_LNKCTL2, &LNKCTL2.to_le_bytes());
    put(&mut wmask, EXP_DEVCTL, &DEVCTL_WMASK.to_le_bytes());
    put(&mut wmask, EXP_LNKCTL, &LNKCTL_WMASK.to_le_bytes());
    put(&mut wmask, EXP_LNKCTL2, &LNKCTL2_WMASK.to_le_bytes());
    Capability { offset, id: PCI_CAP_ID_EXP, body, wmask }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::StorageKind;
    use crate::nvme::{DoorbellMode, Nvme, NvmeConfig};
    use crate::pci::{ConfigSpace, CONFIG_SIZE, PCI_CAPABILITY_LIST, PCI_CAP_ID_MSIX, PCI_STATUS, PCI_STATUS_CAP_LIST};
    use crate::DeviceModel;

    /// The NVMe function's header as a host builds it.
    fn nvme_header() -> ConfigSpace {
        let cfg = NvmeConfig { backend: StorageKind::Null, doorbell: DoorbellMode::Mmio, ..NvmeConfig::default() };
        let n = Nvme::new(cfg).unwrap();
        let mut c = ConfigSpace::new(n.ids(), &n.bars()).unwrap();
        c.add_capabilities(&n.capabilities()).unwrap();
        c
    }

    fn rd(c: &ConfigSpace, off: usize, n: usize) -> u32 {
        let mut b = [0u8; 4];
        c.read(off, &mut b[..n]);
        u32::from_le_bytes(b)
    }

    /// The list as Linux's pci_find_capability walks it: from the pointer
    /// at 0x34, dword-aligned pointers from 0x40, no loop, each capability
    /// inside the header and ending before the next begins.
    #[test]
    fn the_nvme_function_lists_msix_pm_and_a_version_2_express_endpoint_in_a_valid_chain() {
        let c = nvme_header();
        assert_ne!(rd(&c, PCI_STATUS, 2) as u8 & PCI_STATUS_CAP_LIST, 0, "Status: capability list");
        let mut p = rd(&c, PCI_CAPABILITY_LIST, 1) as usize;
        let mut found = Vec::new();
        while p != 0 {
            assert!(p >= 0x40 && p.is_multiple_of(4) && p < CONFIG_SIZE, "pointer {p:#x}");
            assert!(found.iter().all(|&(q, _)| q < p), "the chain goes forward: {found:x?}, then {p:#x}");
            found.push((p, rd(&c, p, 1) as u8));
            p = rd(&c, p + 1, 1) as usize;
        }
        assert_eq!(found, [(0x40, PCI_CAP_ID_MSIX), (0x50, PCI_CAP_ID_PM), (0x60, PCI_CAP_ID_EXP)]);
        for (w, len) in found.windows(2).zip([crate::pci::MSIX_CAP_LEN, PM_CAP_LEN]) {
            assert!(w[0].0 + len <= w[1].0, "{:#x} overlaps {:#x}", w[0].0, w[1].0);
        }
        const { assert!(0x60 + EXP_CAP_LEN <= CONFIG_SIZE) };
        assert_eq!(c.find_capability(PCI_CAP_ID_EXP), Some(0x60));
        // lspci's "Express (v2) Endpoint": version 2, Device/Port Type 0.
        let flags = rd(&c, 0x60 + EXP_FLAGS, 2);
        assert_eq!((flags & 0xf, flags >> 4 & 0xf), (2, 0));
        assert_eq!(rd(&c, 0x60 + EXP_DEVCAP, 4) & 7, 0, "128-byte Max_Payload_Size");
        assert_eq!(rd(&c, 0x60 + EXP_DEVCAP, 4) >> 28 & 1, 0, "no FLR");
        assert_eq!(rd(&c, 0x60 + EXP_LNKSTA, 2) & 0x3ff, 0x43, "8 GT/s x4");
        assert_eq!(rd(&c, 0x50 + 2, 2) & 7, 3, "PM version 3");
        assert_eq!(rd(&c, 0x50 + 4, 2) & 3, 0, "in D0");
        // No extended capabilities: a 0 header at 0x100, as Linux takes for none.
        assert_eq!(rd(&c, 0x100, 4), 0);
    }

    #[test]
    fn read_only_capability_fields_ignore_writes_and_control_fields_keep_theirs() {
        let mut c = nvme_header();
        let before: Vec<u32> = (0x50..0x9c).step_by(4).map(|o| rd(&c, o, 4)).collect();
        for o in (0x50..0x9c).step_by(4) {
            c.write(o, &u32::MAX.to_le_bytes());
        }
        let after: Vec<u32> = (0x50..0x9c).step_by(4).map(|o| rd(&c, o, 4)).collect();
        for (i, (b, a)) in before.iter().zip(&after).enumerate() {
            let o = 0x50 + 4 * i;
            let writable: u32 = match o {
                0x54 => 0x3,                  // PMCSR PowerState (D3hot)
                0x68 => DEVCTL_WMASK as u32,  // Device Control (Device Status RW1C, at 0)
                0x70 => LNKCTL_WMASK as u32,  // Link Control (Link Status read-only)
                0x90 => LNKCTL2_WMASK as u32, // Link Control 2
                _ => 0,
            };
            assert_eq!(a & !writable, b & !writable, "read-only bits at {o:#x} changed: {b:#x} -> {a:#x}");
            assert_eq!(a & writable, writable, "writable bits at {o:#x} did not take: {a:#x}");
        }
        assert_eq!((rd(&c, 0x50, 2), rd(&c, 0x60, 2)), (0x6001, 0x0010), "IDs and next pointers");
        // Power states: D3hot kept, D1 and D2 (not in PMC) ignored, D0 back.
        assert_eq!(rd(&c, 0x54, 2) & 3, 3, "D3hot");
        assert_ne!(rd(&c, 0x54, 2) & PMCSR_NO_SOFT_RESET as u32, 0);
        c.write(0x54, &[1]);
        assert_eq!(rd(&c, 0x54, 2) & 3, 3, "D1 is not offered: the state stays");
        c.write(0x54, &0u16.to_le_bytes());
        assert_eq!(rd(&c, 0x54, 2) & 3, 0, "D0");
        c.write(0x54, &2u32.to_le_bytes());
        assert_eq!(rd(&c, 0x54, 2) & 3, 0, "D2 is not offered");
    }
}
