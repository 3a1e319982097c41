//! End-to-end protection information in the oracle: what a command's
//! PRINFO (CDW12 bits 29:26), EILBRT (CDW14) and ELBAT/ELBATM (CDW15) ask
//! of a namespace formatted with PI type 1, and what the controller must
//! answer. Written from the NVM Command Set specification, independently
//! of the controller's `meta.rs` (its own CRC, bit by bit).
//!
//! The tuple (8 bytes, big endian): the CRC16 T10-DIF guard of the block's
//! data, the application tag, the reference tag (for block k of a command:
//! EILBRT + k). The oracle keeps a tuple as the host sees its 8 bytes, one
//! little-endian word (`u64::from_le_bytes`), as it keeps every other word.

use super::rng::Rng;

/// PRACT: the controller generates the PI (write) or strips it (read,
/// with 8 bytes of metadata per block, which then never cross the bus).
const PRACT: u32 = 1 << 29;

/// End-to-end Guard, Application Tag and Reference Tag Check Errors (SCT 2h).
pub const GUARD_CHECK: u16 = 0x282;
pub const APP_TAG_CHECK: u16 = 0x283;
pub const REF_TAG_CHECK: u16 = 0x284;

/// CRC16 T10-DIF (polynomial 8BB7h, initial 0, not reflected), a bit at a time.
pub fn crc16(data: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x8bb7 } else { crc << 1 };
        }
    }
    crc
}

/// What a command asks of PI.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prinfo {
    pub pract: bool,
    /// PRCHK: 4 the guard, 2 the application tag, 1 the reference tag.
    pub prchk: u8,
    /// EILBRT (a read's or a checked write's expected tag of its first
    /// block) or ILBRT (a generated one).
    pub ref_tag: u32,
    pub app_tag: u16,
    pub app_mask: u16,
}

impl Prinfo {
    /// A random PRINFO for a command starting at `slba`: mostly the tags a
    /// host uses (the LBA's low 32 bits, a full mask), sometimes others.
    pub fn draw(rng: &mut Rng, slba: u64) -> Prinfo {
        let ref_tag = if rng.chance(80) { slba as u32 } else { rng.below(1 << 32) as u32 };
        Prinfo {
            pract: rng.chance(40),
            prchk: rng.below(8) as u8,
            ref_tag,
            app_tag: rng.pick(&[0, 0x1234, 0xbeef]),
            app_mask: rng.pick(&[0xffff, 0xffff, 0, 0xff00]),
        }
    }

    /// CDW12's PRINFO bits (to be or-ed with NLB).
    pub fn cdw12(&self) -> u32 {
        (u32::from(self.pract) * PRACT) | ((self.prchk as u32) << 26)
    }

    /// CDW14 and CDW15.
    pub fn cdw14_15(&self) -> (u32, u32) {
        (self.ref_tag, (self.app_mask as u32) << 16 | self.app_tag as u32)
    }

    /// The tuple the controller generates for block `k` holding `data`.
    pub fn generate(&self, k: u64, data: &[u8]) -> u64 {
        tuple(crc16(data), self.app_tag, self.ref_tag.wrapping_add(k as u32))
    }

    /// The status checking block `k` (its `data`, its stored `tuple`) must
    /// give: 0 (success, or checks disabled by the application tag FFFFh of
    /// type 1), else the first check of guard, application tag, reference
    /// tag that PRCHK asks for and fails.
    pub fn check(&self, k: u64, data: &[u8], tuple: u64) -> u16 {
        let b = tuple.to_le_bytes();
        let app = u16::from_be_bytes([b[2], b[3]]);
        if app == 0xffff {
            return 0;
        }
        if self.prchk & 4 != 0 && u16::from_be_bytes([b[0], b[1]]) != crc16(data) {
            return GUARD_CHECK;
        }
        if self.prchk & 2 != 0 && app & self.app_mask != self.app_tag & self.app_mask {
            return APP_TAG_CHECK;
        }
        let reft = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        if self.prchk & 1 != 0 && reft != self.ref_tag.wrapping_add(k as u32) {
            return REF_TAG_CHECK;
        }
        0
    }
}

/// The word of a tuple (guard, application tag, reference tag), as the
/// host sees its 8 bytes.
pub fn tuple(guard: u16, app: u16, reft: u32) -> u64 {
    let mut b = [0u8; 8];
    b[0..2].copy_from_slice(&guard.to_be_bytes());
    b[2..4].copy_from_slice(&app.to_be_bytes());
    b[4..8].copy_from_slice(&reft.to_be_bytes());
    u64::from_le_bytes(b)
}

/// A tuple with one field made wrong (`which`: 0 guard, 1 application tag
/// (never to FFFFh, which would disable the checks), 2 reference tag).
pub fn spoil(t: u64, which: u64) -> u64 {
    let mut b = t.to_le_bytes();
    match which {
        0 => b[1] ^= 0x01,
        1 => b[3] = if b[2] == 0xff && b[3] == 0xfe { 0xfd } else { b[3] ^ 0x01 },
        _ => b[7] ^= 0x01,
    }
    u64::from_le_bytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crc_is_t10_dif() {
        // The catalogued check value of CRC-16/T10-DIF.
        assert_eq!(crc16(b"123456789"), 0xd0db);
        assert_eq!(crc16(&[0; 4096]), 0);
    }

    #[test]
    fn checks_follow_prchk_in_order_and_the_escape() {
        let data = [7u8; 512];
        let p = Prinfo { pract: false, prchk: 7, ref_tag: 10, app_tag: 0x1234, app_mask: 0xffff };
        let good = p.generate(2, &data);
        assert_eq!(p.check(2, &data, good), 0);
        assert_eq!(p.check(3, &data, good), REF_TAG_CHECK);
        assert_eq!(p.check(2, &data, spoil(good, 0)), GUARD_CHECK);
        assert_eq!(p.check(2, &data, spoil(good, 1)), APP_TAG_CHECK);
        assert_eq!(p.check(2, &data, spoil(spoil(good, 1), 0)), GUARD_CHECK, "the guard first");
        assert_eq!(Prinfo { prchk: 3, ..p }.check(2, &data, spoil(good, 0)), 0, "guard not asked");
        assert_eq!(Prinfo { app_mask: 0xff00, ..p }.check(2, &data, spoil(good, 1)), 0, "masked");
        assert_eq!(p.check(9, &[1; 512], tuple(0, 0xffff, 0)), 0, "application tag FFFFh");
        assert_eq!(p.cdw12(), 7 << 26);
        assert_eq!(Prinfo { pract: true, prchk: 0, ..p }.cdw12(), 1 << 29);
    }
}
