//! `nvme_queues` input: two setup bytes, then the schedule's choices.
//!
//! ```text
//! byte 0   doorbell mode: (b % 16) 0..=9 mmio, 10 ioeventfd, 11 shm, 12 bar, 13 adaptive,
//!          14 bar-adaptive, 15 auto (so most inputs run deterministic mmio)
//! byte 1   bit 0: 4096-byte LBAs (else 512); bit 1: hosted as a device process's client hosts
//!          it (ioeventfds announced once, the doorbell page mapped for good; else as the VMM);
//!          bit 2: two pollers (shm, bar and adaptive only; else one); bits 3-4: at most
//!          16 << n steps (16, 32, 64, 128)
//! rest     the choices of `oracle::Rng::from_bytes`: the schedule's shape, then step by step
//!          (the run ends when they run out, or at the step limit)
//! ```
//! Bounded: 128 steps at most. A step submits up to 64 commands, reaps, waits for a completion
//! (at most the oracle's patience, 10 s, which is then its violation) or idles, in the polled
//! modes' favour, for 50 us to 25 ms; an input made of nothing but the longest idles runs 3.2 s.

use iopath_devices::nvme::DoorbellMode;

/// Namespace size: as the oracle's unit tests (2 MiB, ram backend).
pub const NS_SIZE: u64 = 2 << 20;
/// The most steps an input runs.
pub const MAX_STEPS: u32 = 128;

/// The controller and host an input runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setup {
    pub doorbell: DoorbellMode,
    pub pollers: u8,
    pub lba_size: u32,
    pub static_host: bool,
    pub steps: u32,
}

/// Mode byte values (mod 16) past the mmio ones.
const POLLED: [DoorbellMode; 6] = [
    DoorbellMode::Ioeventfd,
    DoorbellMode::Shm,
    DoorbellMode::Bar,
    DoorbellMode::Adaptive,
    DoorbellMode::BarAdaptive,
    DoorbellMode::Auto,
];

/// Flag bits of byte 1.
pub const LBA_4K: u8 = 1 << 0;
pub const STATIC_HOST: u8 = 1 << 1;
pub const TWO_POLLERS: u8 = 1 << 2;
pub const STEPS_SHIFT: u8 = 3;

/// The setup and the choices; missing setup bytes read as 0 (mmio, 512-byte LBAs, the VMM's
/// host, 16 steps).
pub fn decode(data: &[u8]) -> (Setup, &[u8]) {
    let mode = data.first().copied().unwrap_or(0) % 16;
    let flags = data.get(1).copied().unwrap_or(0);
    let doorbell = match mode {
        0..=9 => DoorbellMode::Mmio,
        m => POLLED[m as usize - 10],
    };
    // Two pollers where the controller takes them (not bar-adaptive or auto: one page).
    let two =
        flags & TWO_POLLERS != 0 && matches!(doorbell, DoorbellMode::Shm | DoorbellMode::Bar | DoorbellMode::Adaptive);
    let setup = Setup {
        doorbell,
        pollers: if two { 2 } else { 1 },
        lba_size: if flags & LBA_4K != 0 { 4096 } else { 512 },
        static_host: flags & STATIC_HOST != 0,
        steps: 16 << (flags >> STEPS_SHIFT & 3),
    };
    (setup, data.get(2..).unwrap_or(&[]))
}

/// An input: the setup bytes for `mode` (its index in 0..16 as above) and `flags`, then `choices`.
pub fn encode(mode: u8, flags: u8, choices: &[u8]) -> Vec<u8> {
    [&[mode, flags][..], choices].concat()
}
