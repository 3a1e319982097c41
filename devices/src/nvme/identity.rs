//! The controller's identity: its serial number (Identify Controller SN),
//! the subsystem's NQN (SUBNQN) and its controller id (CNTLID), as the
//! options `serial=`, `nqn=` and `cntlid=` give them, and the namespace's
//! NGUID and UUID, derived from the serial number and the NQN (and, past
//! namespace 1, the NSID).
//!
//! A host keys controllers by these: Linux groups controllers into a
//! subsystem by SUBNQN (plus SN and MN), refuses a second controller of one
//! subsystem with the same CNTLID, and takes namespaces with the same
//! NGUID or UUID for paths to one namespace. So what an option leaves
//! unset is made unique per controller instance: a random serial number
//! (the NQN follows from it) and a random CNTLID, drawn once when the
//! controller is made (`Nvme::new`), and kept for its life, across the
//! clients of a device process. The derived ids have no randomness of
//! their own: the same serial number and NQN give the same NGUID and UUID.

use crate::{Error, Result};

/// Serial number: at most 20 bytes (Identify Controller SN, space padded).
pub const SERIAL_LEN: usize = 20;
/// SUBNQN: at most 223 bytes (the field is 256, NUL-terminated).
pub const NQN_MAX: usize = 223;
/// CNTLID: 0 and 0xfff0..=0xffff are reserved (dynamic and static
/// controller models use them).
pub const CNTLID_MAX: u16 = 0xffef;

/// The identity options as typed: each one may be left to the controller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdentityOptions {
    pub serial: Option<String>,
    pub nqn: Option<String>,
    pub cntlid: Option<u16>,
}

fn bad(option: &str, reason: String) -> Error {
    Error::Option { device: "nvme", option: option.into(), reason }
}

/// Checks a serial number: 1 to 20 printable ASCII characters, not
/// starting or ending with a space (the field is padded with spaces).
pub fn check_serial(s: &str) -> Result<()> {
    if s.is_empty() || s.len() > SERIAL_LEN {
        return Err(bad("serial", format!("{s:?} has {} characters (1 ..= {SERIAL_LEN})", s.len())));
    }
    if !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(bad("serial", format!("{s:?} is not printable ASCII")));
    }
    if s.starts_with(' ') || s.ends_with(' ') {
        return Err(bad("serial", format!("{s:?} starts or ends with a space (the field's padding)")));
    }
    Ok(())
}

/// Checks an NQN (NVMe Base Specification, NVMe Qualified Names):
/// `nqn.YYYY-MM.reverse.domain` optionally followed by `:` and a string of
/// the owner's choosing (the UUID form `nqn.2014-08.org.nvmexpress:uuid:...`
/// is one such), at most 223 bytes, no control characters.
pub fn check_nqn(s: &str) -> Result<()> {
    let e = |why: &str| Err(bad("nqn", format!("{s:?} {why}")));
    if s.len() > NQN_MAX {
        return e(&format!("has {} bytes (at most {NQN_MAX})", s.len()));
    }
    if s.chars().any(char::is_control) {
        return e("has a control character");
    }
    let Some(rest) = s.strip_prefix("nqn.") else { return e("does not start with \"nqn.\"") };
    let date = rest.as_bytes();
    let digits = |r: std::ops::Range<usize>| date.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    if !(digits(0..4) && date.get(4) == Some(&b'-') && digits(5..7) && date.get(7) == Some(&b'.')) {
        return e("is not nqn.YYYY-MM.domain[:name]");
    }
    let month = (date[5] - b'0') * 10 + (date[6] - b'0');
    if !(1..=12).contains(&month) {
        return e(&format!("has month {month:02}"));
    }
    let (domain, name) = match rest[8..].split_once(':') {
        Some((d, n)) => (d, Some(n)),
        None => (&rest[8..], None),
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if !domain.split('.').all(label_ok) {
        return e(&format!("has no valid reverse domain name ({domain:?})"));
    }
    if name == Some("") {
        return e("has nothing after its ':'");
    }
    Ok(())
}

impl IdentityOptions {
    /// Checks the options that are set.
    pub fn validate(&self) -> Result<()> {
        if let Some(s) = &self.serial {
            check_serial(s)?;
        }
        if let Some(n) = &self.nqn {
            check_nqn(n)?;
        }
        if let Some(c) = self.cntlid {
            if !(1..=CNTLID_MAX).contains(&c) {
                return Err(bad("cntlid", format!("{c} (1 ..= {CNTLID_MAX})")));
            }
        }
        Ok(())
    }

    /// Every option set: those left unset drawn for a new controller (a
    /// random serial number and CNTLID; the NQN from the serial number).
    pub fn resolved(&self) -> IdentityOptions {
        let r = random_u64();
        let serial = self.serial.clone().unwrap_or_else(|| format!("IOPATH{:014X}", r >> 8));
        let nqn = self.nqn.clone().unwrap_or_else(|| format!("nqn.2026-11.io.iopath:nvme:{serial}"));
        let cntlid = self.cntlid.unwrap_or(1 + (r as u16 % CNTLID_MAX));
        IdentityOptions { serial: Some(serial), nqn: Some(nqn), cntlid: Some(cntlid) }
    }
}

/// A controller's identity as Identify reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// SN, space padded.
    pub serial: [u8; SERIAL_LEN],
    pub nqn: String,
    pub cntlid: u16,
    /// The namespace's NGUID and UUID (RFC 9562 version 8, variant 10b).
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
}

impl Identity {
    /// The identity of `o` (validated), its unset options drawn first.
    pub fn new(o: &IdentityOptions) -> Identity {
        let o = if o.serial.is_none() || o.nqn.is_none() || o.cntlid.is_none() { o.resolved() } else { o.clone() };
        let (sn, nqn) = (o.serial.unwrap_or_default(), o.nqn.unwrap_or_default());
        let mut serial = [b' '; SERIAL_LEN];
        serial[..sn.len().min(SERIAL_LEN)].copy_from_slice(&sn.as_bytes()[..sn.len().min(SERIAL_LEN)]);
        let key = [nqn.as_bytes(), b"\0", sn.as_bytes()].concat();
        let mut uuid = derived_id(&key, b"uuid");
        uuid[6] = (uuid[6] & 0x0f) | 0x80;
        uuid[8] = (uuid[8] & 0x3f) | 0x80;
        Identity { serial, nqn, cntlid: o.cntlid.unwrap_or(1), nguid: derived_id(&key, b"nguid"), uuid }
    }
}

impl Identity {
    /// Namespace `nsid`'s NGUID and UUID: namespace 1's are [`Identity`]'s
    /// own (as before there were several), the others' are derived from the
    /// same serial number and NQN and the NSID, so each is unique.
    pub fn namespace_ids(&self, nsid: u32) -> ([u8; 16], [u8; 16]) {
        if nsid == 1 {
            return (self.nguid, self.uuid);
        }
        let sn = std::str::from_utf8(&self.serial).unwrap_or("").trim_end_matches(' ');
        let key = [self.nqn.as_bytes(), b"\0", sn.as_bytes(), b"\0", &nsid.to_le_bytes()].concat();
        let mut uuid = derived_id(&key, b"uuid");
        uuid[6] = (uuid[6] & 0x0f) | 0x80;
        uuid[8] = (uuid[8] & 0x3f) | 0x80;
        (derived_id(&key, b"nguid"), uuid)
    }
}

/// 128 bits derived from `key` and a label, with no randomness (FNV-1a,
/// then two SplitMix64 finalisers).
fn derived_id(key: &[u8], label: &[u8]) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in label.iter().chain(b"/").chain(key) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&mix(h).to_be_bytes());
    id[8..].copy_from_slice(&mix(h ^ 0x9e37_79b9_7f4a_7c15).to_be_bytes());
    id
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64 random bits from the kernel; where getrandom fails, the time, the
/// process id and a counter, mixed (still distinct per instance).
fn random_u64() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static DRAWN: AtomicU64 = AtomicU64::new(0);
    let n = DRAWN.fetch_add(1, Ordering::Relaxed);
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into the 8-byte buffer.
    let got = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if got == 8 {
        return u64::from_ne_bytes(b);
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    mix(t ^ (std::process::id() as u64) << 32 ^ mix(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_nqns_and_cntlids_are_checked() {
        for ok in ["A", "SN-123 x", "12345678901234567890", "~!#$%^&*()"] {
            check_serial(ok).unwrap();
        }
        for bad in ["", "123456789012345678901", "tab\there", " lead", "trail ", "é"] {
            assert!(check_serial(bad).unwrap_err().to_string().contains("serial"), "{bad:?}");
        }
        for ok in [
            "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
            "nqn.2026-11.io.iopath:nvme:IOPATH1",
            "nqn.2014-08.com.example",
            "nqn.1999-12.a-b.c1:x:y z",
        ] {
            check_nqn(ok).unwrap();
        }
        let long = format!("nqn.2014-08.com.example:{}", "x".repeat(NQN_MAX + 1 - 24));
        assert_eq!(long.len(), NQN_MAX + 1);
        for bad in [
            "",
            "iqn.2014-08.com.example:x",
            "nqn.14-08.com.example:x",
            "nqn.2014-13.com.example:x",
            "nqn.2014-00.com.example",
            "nqn.2014-08:x",
            "nqn.2014-08..com:x",
            "nqn.2014-08.com_example:x",
            "nqn.2014-08.com.example:",
            "nqn.2014-08.com.example:a\nb",
            long.as_str(),
        ] {
            assert!(check_nqn(bad).unwrap_err().to_string().contains("nqn"), "{bad:?}");
        }
        check_nqn(&long[..NQN_MAX]).unwrap();
        for (c, ok) in [(0u16, false), (1, true), (0xffef, true), (0xfff0, false), (0xffff, false)] {
            let o = IdentityOptions { cntlid: Some(c), ..Default::default() };
            assert_eq!(o.validate().is_ok(), ok, "cntlid {c:#x}");
        }
    }

    #[test]
    fn unset_options_are_drawn_per_instance_and_derived_ids_follow_serial_and_nqn() {
        let a = Identity::new(&IdentityOptions::default());
        let b = Identity::new(&IdentityOptions::default());
        assert_ne!(a.serial, b.serial);
        assert_ne!((&a.nqn, a.nguid, a.uuid), (&b.nqn, b.nguid, b.uuid));
        let sn = std::str::from_utf8(&a.serial).unwrap();
        check_serial(sn).unwrap();
        check_nqn(&a.nqn).unwrap();
        assert_eq!(a.nqn, format!("nqn.2026-11.io.iopath:nvme:{sn}"));
        assert!((1..=CNTLID_MAX).contains(&a.cntlid));
        // Given options: the same ones give the same ids, another serial or NQN others.
        let given =
            |sn: &str, nqn: &str| IdentityOptions { serial: Some(sn.into()), nqn: Some(nqn.into()), cntlid: Some(7) };
        let x = Identity::new(&given("S1", "nqn.2014-08.com.example:a"));
        assert_eq!(x, Identity::new(&given("S1", "nqn.2014-08.com.example:a")));
        assert_eq!(&x.serial, b"S1                  ");
        assert_eq!(x.cntlid, 7);
        for other in [given("S2", "nqn.2014-08.com.example:a"), given("S1", "nqn.2014-08.com.example:b")] {
            let y = Identity::new(&other);
            assert!(y.nguid != x.nguid && y.uuid != x.uuid);
        }
        for u in [x.uuid, a.uuid] {
            assert_eq!((u[6] >> 4, u[8] >> 6), (8, 0b10), "RFC 9562 version 8, variant 10b");
        }
        // A serial alone: the NQN follows it, so the ids are the same for the same serial.
        let s = IdentityOptions { serial: Some("S9".into()), ..Default::default() };
        let (p, q) = (Identity::new(&s), Identity::new(&s));
        assert_eq!((&p.nqn, p.nguid, p.uuid), (&q.nqn, q.nguid, q.uuid));
        // Each namespace its own ids, the same for the same controller identity.
        let ids: Vec<_> = (1..=32).map(|n| p.namespace_ids(n)).collect();
        assert_eq!(ids[0], (p.nguid, p.uuid));
        assert_eq!(ids, (1..=32).map(|n| q.namespace_ids(n)).collect::<Vec<_>>());
        let mut all: Vec<[u8; 16]> = ids.iter().flat_map(|&(g, u)| [g, u]).collect();
        all.extend((2..=32).flat_map(|n| <[[u8; 16]; 2]>::from(x.namespace_ids(n))));
        let k = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), k, "no two namespaces share an id");
        for (_, u) in ids {
            assert_eq!((u[6] >> 4, u[8] >> 6), (8, 0b10));
        }
    }
}
