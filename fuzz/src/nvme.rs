//! `nvme` input: a setup byte, a guest memory image, then operations on the controller.
//!
//! ```text
//! byte 0        setup flags (SETUP_*)
//! bytes 1..3    u16 LE: length L of the memory image (clamped to what is left)
//! L bytes       the memory image, written at IMAGE_BASE (the admin queues and the pages after them)
//! rest          operations, each an opcode byte (mod OPS) and its fixed arguments, all LE
//! ```
//! The harness plays a driver that keeps, for queue pairs 0..=3 at fixed places (admin: ASQ/ACQ
//! with 32 entries; I/O pair q: IOSQ(q)/IOCQ(q) with 16), the SQ tail and the CQ head and phase
//! it would keep: `Submit` writes a raw 64-byte SQE at its tail and rings the doorbell, `Reap`
//! consumes completions and writes the CQ head doorbell. Nothing else in the controller is
//! assumed: every register, doorbell and memory byte can also be written directly.
//!
//! With `SETUP_REMOTE` guest RAM is what a vfio-user client without a memory fd gives: the
//! controller's `GuestMem` has `REMOTE` (the data pages, and the CQ of the third I/O queue
//! pair) reached through a `DmaPort` (in-process and deterministic here) and the rest mapped, so
//! queues, PRP lists and transfers can lie in, or straddle, memory reached by message.

use crate::Cursor;

/// Guest RAM: 1 MiB at GPA 0.
pub const MEM_SIZE: u64 = 1 << 20;
/// Where the memory image goes (up to 64 KiB: ASQ, ACQ, the I/O queues, data pages).
pub const IMAGE_BASE: u64 = 0x10000;
/// The admin queues `Enable` and the `BRING_UP` setup program (as the unit tests do).
pub const ASQ: u64 = 0x10000;
pub const ACQ: u64 = 0x11000;
pub const ADMIN_ENTRIES: u16 = 32;
pub const IO_ENTRIES: u16 = 16;
/// First page of the data area (PRPs of seeds point here).
pub const DATA: u64 = 0x20000;
/// `SETUP_REMOTE`: the range reached through the DMA port; the rest of RAM stays mapped.
pub const REMOTE: (u64, u64) = (0x17000, 0x28000);
/// Namespace size (bytes).
pub const NS_SIZE: u64 = 64 << 10;
/// Most operations run per input.
pub const MAX_OPS: usize = 512;

/// I/O SQ of pair `q` (1..=3).
pub fn iosq(q: u8) -> u64 {
    0x12000 + (q as u64 - 1) * 0x2000
}

/// I/O CQ of pair `q` (1..=3).
pub fn iocq(q: u8) -> u64 {
    iosq(q) + 0x1000
}

/// Backend null (else ram).
pub const SETUP_NULL: u8 = 1 << 0;
/// 4096-byte LBAs (else 512).
pub const SETUP_LBA4K: u8 = 1 << 1;
/// Program AQA (32/32), ASQ, ACQ and CC (EN, IOSQES 6, IOCQES 4) before the operations.
pub const SETUP_BRING_UP: u8 = 1 << 2;
/// The host's `signal_msix` succeeds (else every vector stays pending).
pub const SETUP_IRQ_ACCEPT: u8 = 1 << 3;
/// The host keeps the MSI-X table (QEMU's vfio-user-pci).
pub const SETUP_HOST_TABLE: u8 = 1 << 4;
/// MSI-X Enable set in configuration space before the operations.
pub const SETUP_MSIX_ON: u8 = 1 << 5;
/// Part of RAM (`REMOTE`) reached through a DMA port instead of mapped.
pub const SETUP_REMOTE: u8 = 1 << 6;

/// CC the bring-up writes: EN, IOSQES 6, IOCQES 4.
pub const CC_ENABLE: u32 = 0x0046_0001;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A 4-byte BAR0 write (registers, doorbells, MSI-X table: anything).
    W32 { off: u16, v: u32 },
    /// An 8-byte BAR0 write.
    W64 { off: u16, v: u64 },
    /// A write of any size (0..=16 bytes) to BAR `bar` (0..=7).
    Write { bar: u8, off: u16, data: Vec<u8> },
    /// A read of `len` (0..=16) bytes.
    Read { bar: u8, off: u16, len: u8 },
    /// A 4-byte write to doorbell register `idx` (BAR0 0x1000 + 4 * idx).
    Doorbell { idx: u8, v: u32 },
    /// Queue pair `q` (mod 4): write `sqe` at the harness's SQ tail, ring the new tail.
    Submit { q: u8, sqe: [u8; 64] },
    /// Queue pair `q` (mod 4): consume the completions whose phase is the expected one, write
    /// the CQ head doorbell.
    Reap { q: u8 },
    /// Guest memory write at `gpa` (mod the RAM size, cut at its end).
    Mem { gpa: u32, data: Vec<u8> },
    /// Configuration-space write (the MSI-X capability is at 0x40).
    Config { off: u8, data: Vec<u8> },
    /// AQA = aqa, ASQ, ACQ at their places, then CC = cc.
    Enable { aqa: u32, cc: u32 },
    /// DeviceModel::reset; the harness's queue state back to zero.
    Reset,
    /// DeviceModel::attach again: with the same RAM, or (`gone`) with none, as a device process
    /// does when its client leaves.
    Attach { gone: bool },
    /// `SETUP_REMOTE`: from now on the DMA port fails every access (the client went away or
    /// refused), or works again.
    PortFail { on: bool },
}

pub const OPS: u8 = 13;

/// The setup flags, the memory image and the operations of an input.
pub fn decode(data: &[u8]) -> (u8, &[u8], Vec<Op>) {
    let mut c = Cursor::new(data);
    let setup = c.u8().unwrap_or(0);
    let len = c.u16().unwrap_or(0) as usize;
    let image = c.up_to(len);
    let mut ops = Vec::new();
    while ops.len() < MAX_OPS && !c.is_empty() {
        match decode_op(&mut c) {
            Some(op) => ops.push(op),
            None => break,
        }
    }
    (setup, image, ops)
}

fn decode_op(c: &mut Cursor) -> Option<Op> {
    Some(match c.u8()? % OPS {
        0 => Op::W32 { off: c.u16()?, v: c.u32()? },
        1 => Op::W64 { off: c.u16()?, v: c.u64()? },
        2 => {
            let (bar, off, len) = (c.u8()? % 8, c.u16()?, c.u8()? % 17);
            Op::Write { bar, off, data: c.bytes(len as usize)?.to_vec() }
        }
        3 => Op::Read { bar: c.u8()? % 8, off: c.u16()?, len: c.u8()? % 17 },
        4 => Op::Doorbell { idx: c.u8()?, v: c.u32()? },
        5 => Op::Submit { q: c.u8()? % 4, sqe: c.bytes(64)?.try_into().unwrap() },
        6 => Op::Reap { q: c.u8()? % 4 },
        7 => {
            let (gpa, len) = (c.u32()?, c.u8()?);
            Op::Mem { gpa, data: c.bytes(len as usize)?.to_vec() }
        }
        8 => {
            let (off, len) = (c.u8()?, c.u8()? % 5);
            Op::Config { off, data: c.bytes(len as usize)?.to_vec() }
        }
        9 => Op::Enable { aqa: c.u32()?, cc: c.u32()? },
        10 => Op::Reset,
        11 => Op::Attach { gone: c.u8()? & 1 != 0 },
        _ => Op::PortFail { on: c.u8()? & 1 != 0 },
    })
}

/// Encodes an input (the inverse of [`decode`] for well-formed arguments).
pub fn encode(setup: u8, image: &[u8], ops: &[Op]) -> Vec<u8> {
    let mut v = vec![setup];
    let len = u16::try_from(image.len()).expect("a memory image of at most 64 KiB");
    v.extend_from_slice(&len.to_le_bytes());
    v.extend_from_slice(image);
    for op in ops {
        match op {
            Op::W32 { off, v: x } => {
                v.push(0);
                v.extend_from_slice(&off.to_le_bytes());
                v.extend_from_slice(&x.to_le_bytes());
            }
            Op::W64 { off, v: x } => {
                v.push(1);
                v.extend_from_slice(&off.to_le_bytes());
                v.extend_from_slice(&x.to_le_bytes());
            }
            Op::Write { bar, off, data } => {
                v.extend_from_slice(&[2, *bar]);
                v.extend_from_slice(&off.to_le_bytes());
                v.push(data.len() as u8);
                v.extend_from_slice(data);
            }
            Op::Read { bar, off, len } => {
                v.extend_from_slice(&[3, *bar]);
                v.extend_from_slice(&off.to_le_bytes());
                v.push(*len);
            }
            Op::Doorbell { idx, v: x } => {
                v.extend_from_slice(&[4, *idx]);
                v.extend_from_slice(&x.to_le_bytes());
            }
            Op::Submit { q, sqe } => {
                v.extend_from_slice(&[5, *q]);
                v.extend_from_slice(sqe);
            }
            Op::Reap { q } => v.extend_from_slice(&[6, *q]),
            Op::Mem { gpa, data } => {
                v.push(7);
                v.extend_from_slice(&gpa.to_le_bytes());
                v.push(data.len() as u8);
                v.extend_from_slice(data);
            }
            Op::Config { off, data } => {
                v.extend_from_slice(&[8, *off, data.len() as u8]);
                v.extend_from_slice(data);
            }
            Op::Enable { aqa, cc } => {
                v.push(9);
                v.extend_from_slice(&aqa.to_le_bytes());
                v.extend_from_slice(&cc.to_le_bytes());
            }
            Op::Reset => v.push(10),
            Op::Attach { gone } => v.extend_from_slice(&[11, *gone as u8]),
            Op::PortFail { on } => v.extend_from_slice(&[12, *on as u8]),
        }
    }
    v
}

/// A 64-byte SQE: opcode, command id, namespace, PRP1, PRP2, CDW10..15.
pub fn sqe(opcode: u8, cid: u16, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 6]) -> [u8; 64] {
    let mut e = [0u8; 64];
    e[0] = opcode;
    e[2..4].copy_from_slice(&cid.to_le_bytes());
    e[4..8].copy_from_slice(&nsid.to_le_bytes());
    e[24..32].copy_from_slice(&prp1.to_le_bytes());
    e[32..40].copy_from_slice(&prp2.to_le_bytes());
    for (i, v) in cdw.iter().enumerate() {
        e[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
    e
}
