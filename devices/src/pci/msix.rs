//! MSI-X, kept once: the vector table, the Pending Bit Array (PBA), and the
//! two bits of Message Control a guest writes (PCI Local Bus 3.0, 6.8.2).
//!
//! A device model that signals vectors (the NVMe controller) and a proxy
//! that routes a device's vectors in the VMM (vfio-user) use the same
//! [`MsixTable`]:
//!
//! ```text
//! MsixTable::new(vectors, bar, table, pba, cap_offset)  all vectors masked, MSI-X off
//! MsixTable::find(header, max_vectors)                  the same, from a 256-byte header
//! capability()                       the MSI-X capability at cap_offset (DeviceModel::capabilities)
//! claims / read / write              BAR accesses to the table and PBA; `write` gives the vector
//!                                    an accepted table write landed in
//! config_write                       configuration writes; true when the write reached Message
//!                                    Control's high byte (Enable, bit 15; Function Mask, bit 14)
//! enabled / function_masked / masked(v) / route(v)     (address, data) of an unmasked vector
//! set_pending(v, p) / pending(v)     the PBA bit the model keeps while a vector is masked
//! ```
//!
//! After `write` returns `Some(v)` the caller brings vector `v`'s route up to
//! date (and fires it if it is pending and now unmasked); after
//! `config_write` returns true it does that for every vector. Both report
//! the accepted write even when it changed nothing, so a caller can retry a
//! route its host did not take.
//!
//! The capability's offset is a value the device chooses and passes here;
//! the host places the capability there ([`Capability::offset`]). Table and
//! PBA offsets are 8-byte aligned and below 4 GiB (the capability holds
//! them in 32 bits whose low 3 are the BAR indicator; those are dropped). Accesses follow the spec: table
//! writes are a DWORD or a QWORD, naturally aligned, and anything else is
//! claimed and dropped; reads may have any size, and bytes past the table or
//! the PBA read as all-ones. Vector Control keeps only its mask bit (the
//! rest is reserved). The PBA is read-only. Nothing here panics on a
//! guest-chosen offset, size or vector number.

use super::{
    Capability, CONFIG_SIZE, PCI_CAPABILITY_LIST, PCI_CAP_ID_MSIX, PCI_CAP_START, PCI_STATUS, PCI_STATUS_CAP_LIST,
};

/// Most vectors a function can have (Table Size is 11 bits).
pub const MSIX_MAX_VECTORS: usize = 2048;
/// Bytes of one table entry: address low, address high, data, vector control.
pub const MSIX_ENTRY_SIZE: u64 = 16;
/// Bytes of the MSI-X capability (ID, next, Message Control, table, PBA).
pub const MSIX_CAP_LEN: usize = 12;

/// MSI-X state of one function. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MsixTable {
    cap_offset: usize,
    bar: u8,
    table: u64,
    pba_bar: u8,
    pba: u64,
    /// Per vector: address low, address high, data, vector control.
    entries: Vec<[u32; 4]>,
    pending: Vec<bool>,
    enabled: bool,
    function_masked: bool,
}

impl MsixTable {
    /// `vectors` (1..=2048; clamped) vectors with the table at `table` and
    /// the PBA at `pba` in BAR `bar`, and the capability at `cap_offset` in
    /// configuration space. Every vector starts masked, MSI-X disabled.
    pub fn new(vectors: u16, bar: u8, table: u64, pba: u64, cap_offset: usize) -> Self {
        Self::with_pba_bar(vectors as usize, bar, table, bar, pba, cap_offset)
    }

    fn with_pba_bar(vectors: usize, bar: u8, table: u64, pba_bar: u8, pba: u64, cap_offset: usize) -> Self {
        let n = vectors.clamp(1, MSIX_MAX_VECTORS);
        MsixTable {
            cap_offset,
            bar,
            table: table & !7,
            pba_bar,
            pba: pba & !7,
            entries: vec![[0, 0, 0, 1]; n],
            pending: vec![false; n],
            enabled: false,
            function_masked: false,
        }
    }

    /// Locates MSI-X in a 256-byte configuration header (a proxy reading a
    /// remote device's header) and returns its state at reset, with at most
    /// `max_vectors` vectors. The capability list is walked with a bound, so
    /// a looping or out-of-range list ends the search; None without a list,
    /// without MSI-X, with no vector, or with a BAR indicator past BAR5.
    pub fn find(config: &[u8], max_vectors: u32) -> Option<Self> {
        if config.len() < CONFIG_SIZE || config[PCI_STATUS] & PCI_STATUS_CAP_LIST == 0 {
            return None;
        }
        let dword = |o: usize| u32::from_le_bytes([config[o], config[o + 1], config[o + 2], config[o + 3]]);
        let mut p = config[PCI_CAPABILITY_LIST] as usize & 0xfc;
        // At most one capability per dword of the header after 0x40.
        for _ in 0..(CONFIG_SIZE - PCI_CAP_START) / 4 {
            if p < PCI_CAP_START || p + 2 > CONFIG_SIZE {
                return None;
            }
            if config[p] == PCI_CAP_ID_MSIX {
                if p + MSIX_CAP_LEN > CONFIG_SIZE {
                    return None;
                }
                let size = (u16::from_le_bytes([config[p + 2], config[p + 3]]) & 0x7ff) as u32 + 1;
                let n = size.min(max_vectors) as usize;
                let (t, b) = (dword(p + 4), dword(p + 8));
                let (bir, pba_bir) = ((t & 7) as u8, (b & 7) as u8);
                return (n > 0 && bir < 6 && pba_bir < 6)
                    .then(|| Self::with_pba_bar(n, bir, (t & !7) as u64, pba_bir, (b & !7) as u64, p));
            }
            p = config[p + 1] as usize & 0xfc;
        }
        None
    }

    /// The MSI-X capability, at the offset given to [`new`](Self::new), as at
    /// reset: Table Size, table and PBA offsets with their BARs; the guest
    /// may write MSI-X Enable and Function Mask.
    pub fn capability(&self) -> Capability {
        let mut body = Vec::with_capacity(MSIX_CAP_LEN - 2);
        body.extend_from_slice(&(self.entries.len() as u16 - 1).to_le_bytes());
        body.extend_from_slice(&(self.table as u32 | self.bar as u32).to_le_bytes());
        body.extend_from_slice(&(self.pba as u32 | self.pba_bar as u32).to_le_bytes());
        Capability { offset: self.cap_offset, id: PCI_CAP_ID_MSIX, body, wmask: vec![0, 0xc0] }
    }

    /// Offset of the capability in configuration space.
    pub fn cap_offset(&self) -> usize {
        self.cap_offset
    }

    /// The BAR that holds the table.
    pub fn bar(&self) -> u8 {
        self.bar
    }

    pub fn vectors(&self) -> usize {
        self.entries.len()
    }

    fn table_index(&self, bar: u8, offset: u64) -> Option<u64> {
        let o = offset.checked_sub(self.table)?;
        (bar == self.bar && o < MSIX_ENTRY_SIZE * self.entries.len() as u64).then_some(o)
    }

    fn pba_len(&self) -> u64 {
        self.entries.len().div_ceil(64) as u64 * 8
    }

    fn pba_index(&self, bar: u8, offset: u64) -> Option<u64> {
        let o = offset.checked_sub(self.pba)?;
        (bar == self.pba_bar && o < self.pba_len()).then_some(o)
    }

    /// True if an access starting at `offset` of BAR `bar` is the table's or the PBA's.
    pub fn claims(&self, bar: u8, offset: u64) -> bool {
        self.table_index(bar, offset).is_some() || self.pba_index(bar, offset).is_some()
    }

    fn table_byte(&self, o: u64) -> Option<u8> {
        let e = self.entries.get(usize::try_from(o / MSIX_ENTRY_SIZE).ok()?)?;
        Some((e[(o % MSIX_ENTRY_SIZE / 4) as usize] >> (8 * (o % 4))) as u8)
    }

    fn pba_byte(&self, o: u64) -> Option<u8> {
        if o >= self.pba_len() {
            return None;
        }
        let first = o as usize * 8;
        Some((0..8).filter(|b| self.pending.get(first + b).copied().unwrap_or(false)).fold(0, |a, b| a | 1 << b))
    }

    /// Reads the table or the PBA; false (and `data` untouched) if neither
    /// claims `offset`.
    pub fn read(&self, bar: u8, offset: u64, data: &mut [u8]) -> bool {
        let (o, table) = match (self.table_index(bar, offset), self.pba_index(bar, offset)) {
            (Some(o), _) => (o, true),
            (None, Some(o)) => (o, false),
            (None, None) => return false,
        };
        for (i, d) in data.iter_mut().enumerate() {
            let at = o.checked_add(i as u64);
            let b = at.and_then(|o| if table { self.table_byte(o) } else { self.pba_byte(o) });
            *d = b.unwrap_or(0xff);
        }
        true
    }

    /// Writes the table: `Some(vector)` for an accepted write (a naturally
    /// aligned DWORD or QWORD, which stays within one entry), even if it
    /// changed nothing. Other table writes and PBA writes are claimed and
    /// dropped (None), as are accesses nobody claims (see [`claims`](Self::claims)).
    pub fn write(&mut self, bar: u8, offset: u64, data: &[u8]) -> Option<usize> {
        let o = self.table_index(bar, offset)?;
        if !matches!(data.len(), 4 | 8) || !offset.is_multiple_of(data.len() as u64) {
            return None;
        }
        let v = crate::le_value(data);
        let first = (o / 4) as usize;
        for k in 0..data.len() / 4 {
            let (i, w) = (first + k, (v >> (32 * k)) as u32);
            if let Some(e) = self.entries.get_mut(i / 4) {
                e[i % 4] = if i % 4 == 3 { w & 1 } else { w };
            }
        }
        Some(first / 4)
    }

    /// Takes a configuration write: if it covers Message Control's high
    /// byte, MSI-X Enable and Function Mask are loaded from it and the
    /// answer is true (the caller re-syncs every vector), changed or not.
    pub fn config_write(&mut self, offset: usize, data: &[u8]) -> bool {
        let hi = self.cap_offset + 3;
        let Some(&b) = hi.checked_sub(offset).and_then(|i| data.get(i)) else {
            return false;
        };
        self.enabled = b & 0x80 != 0;
        self.function_masked = b & 0x40 != 0;
        true
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    pub fn function_masked(&self) -> bool {
        self.function_masked
    }

    /// True if vector `v` may not be signalled: MSI-X disabled, the function
    /// masked, the vector masked, or no such vector.
    pub fn masked(&self, v: usize) -> bool {
        !self.enabled || self.function_masked || self.entries.get(v).is_none_or(|e| e[3] & 1 != 0)
    }

    /// The message (address, data) of vector `v`, unless it is masked.
    pub fn route(&self, v: usize) -> Option<(u64, u32)> {
        let e = self.entries.get(v).filter(|_| !self.masked(v))?;
        Some((e[0] as u64 | (e[1] as u64) << 32, e[2]))
    }

    /// Sets or clears vector `v`'s pending bit (no such vector: nothing).
    pub fn set_pending(&mut self, v: usize, p: bool) {
        if let Some(b) = self.pending.get_mut(v) {
            *b = p;
        }
    }

    pub fn pending(&self, v: usize) -> bool {
        self.pending.get(v).copied().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 0x2000;
    const P: u64 = 0x3000;

    fn rd(m: &MsixTable, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        assert!(m.read(0, off, &mut b));
        b
    }

    fn unmasked_vector_1(m: &mut MsixTable) {
        assert_eq!(m.write(0, T + 16, &0xfee0_0000u64.to_le_bytes()), Some(1));
        assert_eq!(m.write(0, T + 24, &0x45u32.to_le_bytes()), Some(1));
        assert_eq!(m.write(0, T + 28, &0u32.to_le_bytes()), Some(1));
    }

    #[test]
    fn table_writes_route_only_when_enabled_and_unmasked() {
        let mut m = MsixTable::new(65, 0, T, P, 0x40);
        assert_eq!(m.vectors(), 65);
        assert!((0..65).all(|v| m.masked(v) && m.route(v).is_none()), "all masked at reset");
        assert_eq!(rd(&m, T + 12, 4), [1, 0, 0, 0], "vector control: masked");
        unmasked_vector_1(&mut m);
        assert_eq!(m.route(1), None, "MSI-X is off");
        assert!(m.config_write(0x40, &[0x11, 0, 0x40, 0x80]));
        assert!(m.enabled() && !m.function_masked());
        assert_eq!(m.route(1), Some((0xfee0_0000, 0x45)));
        assert_eq!(m.route(0), None, "vector 0 is still masked");
        assert_eq!(rd(&m, T + 16, 12), [0, 0, 0xe0, 0xfe, 0, 0, 0, 0, 0x45, 0, 0, 0]);
        // Mask and unmask; only the mask bit of vector control is kept.
        assert_eq!(m.write(0, T + 28, &0xffff_ffffu32.to_le_bytes()), Some(1));
        assert_eq!(rd(&m, T + 28, 4), [1, 0, 0, 0]);
        assert!(m.masked(1) && m.route(1).is_none());
        m.write(0, T + 28, &0u32.to_le_bytes());
        assert_eq!(m.route(1), Some((0xfee0_0000, 0x45)));
        // Out of range vectors are masked and route nowhere.
        assert!(m.masked(65) && m.route(usize::MAX).is_none());
    }

    #[test]
    fn qword_writes_fill_two_dwords_misaligned_or_odd_writes_are_dropped_but_claimed() {
        let mut m = MsixTable::new(4, 2, T, P, 0x40);
        assert_eq!(m.write(2, T + 32, &0x1_2345_6780u64.to_le_bytes()), Some(2));
        assert_eq!(m.write(2, T + 40, &(0x77u64 | 1 << 32).to_le_bytes()), Some(2), "data and vector control");
        assert_eq!(rd_bar(&m, 2, T + 32, 16), [0x80, 0x67, 0x45, 0x23, 1, 0, 0, 0, 0x77, 0, 0, 0, 1, 0, 0, 0]);
        let before = m.clone();
        for (off, len) in [(T + 17, 4), (T + 4, 8), (T + 16, 2), (T + 16, 1), (T + 48, 16), (T + 60, 8)] {
            assert!(m.claims(2, off));
            assert_eq!(m.write(2, off, &vec![0xab; len]), None, "{off:#x} {len}");
        }
        assert_eq!(m, before, "nothing changed");
        // Not the table's BAR, past the table, or before it: not claimed.
        assert!(!m.claims(0, T) && !m.claims(2, T + 64) && !m.claims(2, T - 4));
        assert_eq!(m.write(0, T, &[0; 4]), None);
        assert_eq!(m.write(2, u64::MAX - 3, &[0; 4]), None);
        let mut b = [7u8; 4];
        assert!(!m.read(2, T + 64, &mut b) && b == [7; 4]);
    }

    fn rd_bar(m: &MsixTable, bar: u8, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        assert!(m.read(bar, off, &mut b));
        b
    }

    #[test]
    fn pending_bits_read_in_the_pba_and_reads_past_the_end_are_all_ones() {
        let mut m = MsixTable::new(65, 0, T, P, 0x40);
        m.set_pending(1, true);
        m.set_pending(64, true);
        m.set_pending(5000, true);
        assert!(m.pending(1) && m.pending(64) && !m.pending(0) && !m.pending(5000));
        let pba = rd(&m, P, 16);
        assert_eq!(pba[0], 0b10);
        assert_eq!(pba[8], 1, "vector 64 in the second QWORD");
        assert_eq!(rd(&m, P + 12, 8), [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff], "16 bytes of PBA for 65 vectors");
        assert!(!m.claims(0, P + 16));
        assert_eq!(m.write(0, P, &u64::MAX.to_le_bytes()), None, "the PBA is read-only");
        assert_eq!(rd(&m, P, 1), [0b10]);
        m.set_pending(1, false);
        assert_eq!(rd(&m, P, 1), [0]);
        assert_eq!(rd(&m, T + 16 * 65 - 2, 4), [0, 0, 0xff, 0xff], "past the table");
    }

    #[test]
    fn enable_and_function_mask_come_from_any_write_covering_message_control_high_byte() {
        let mut m = MsixTable::new(8, 0, T, P, 0x70);
        unmasked_vector_1(&mut m);
        assert!(!m.config_write(0x70, &[0x11, 0, 0xff]), "low byte only");
        assert!(!m.config_write(0x74, &[0xc0; 4]) && !m.config_write(0x6c, &[0xc0; 4]), "next to it");
        assert!(!m.config_write(usize::MAX, &[0xc0; 4]));
        assert!(!m.enabled());
        assert!(m.config_write(0x73, &[0x80]), "byte write");
        assert!(m.enabled() && m.route(1).is_some());
        assert!(m.config_write(0x72, &0xc000u16.to_le_bytes()), "word write");
        assert!(m.enabled() && m.function_masked() && m.route(1).is_none() && m.masked(1));
        assert!(m.config_write(0x70, &0x8000_0011u32.to_le_bytes()), "dword write");
        assert!(!m.function_masked() && m.route(1).is_some());
        assert!(m.config_write(0x73, &[0x80]), "an unchanged value is still reported");
        assert!(m.config_write(0x71, &[0, 0, 0]), "a write from the next pointer on");
        assert!(!m.enabled() && m.route(1).is_none());
    }

    fn header(caps: &[(usize, u8, u8)]) -> Vec<u8> {
        let mut h = vec![0u8; 256];
        h[PCI_STATUS] = PCI_STATUS_CAP_LIST;
        h[PCI_CAPABILITY_LIST] = caps.first().map_or(0, |c| c.0 as u8);
        for &(at, id, next) in caps {
            h[at] = id;
            h[at + 1] = next;
        }
        h
    }

    #[test]
    fn find_walks_the_capability_list_and_survives_a_hostile_one() {
        // A vendor capability at 0x40, MSI-X at 0x60: 8 vectors, table in BAR4, PBA in BAR5.
        let mut h = header(&[(0x40, 0x09, 0x60), (0x60, PCI_CAP_ID_MSIX, 0)]);
        h[0x62..0x64].copy_from_slice(&7u16.to_le_bytes());
        h[0x64..0x68].copy_from_slice(&(0x1000u32 | 4).to_le_bytes());
        h[0x68..0x6c].copy_from_slice(&(0x1800u32 | 5).to_le_bytes());
        let m = MsixTable::find(&h, 2048).unwrap();
        assert_eq!((m.cap_offset(), m.vectors(), m.bar()), (0x60, 8, 4));
        assert!(m.claims(4, 0x1000 + 16 * 7) && m.claims(5, 0x1800) && !m.claims(4, 0x1800));
        assert!((0..8).all(|v| m.masked(v)));
        assert_eq!(m.capability().body, h[0x62..0x6c], "what it found is what it declares");
        assert_eq!(MsixTable::find(&h, 3).unwrap().vectors(), 3, "bounded by the caller");
        assert!(MsixTable::find(&h, 0).is_none());
        // BAR indicators past BAR5.
        let mut bad = h.clone();
        bad[0x64] |= 6;
        assert!(MsixTable::find(&bad, 2048).is_none());
        let mut bad = h.clone();
        bad[0x68] = 7;
        assert!(MsixTable::find(&bad, 2048).is_none());
        // No list bit, a short header, a loop, pointers into the header or past its end.
        let mut bad = h.clone();
        bad[PCI_STATUS] = 0;
        assert!(MsixTable::find(&bad, 2048).is_none());
        assert!(MsixTable::find(&h[..255], 2048).is_none());
        let looping = header(&[(0x40, 0x09, 0x50), (0x50, 0x05, 0x40)]);
        assert!(MsixTable::find(&looping, 2048).is_none());
        let self_loop = header(&[(0x40, 0x09, 0x40)]);
        assert!(MsixTable::find(&self_loop, 2048).is_none());
        assert!(MsixTable::find(&header(&[(0x40, 0x09, 0x10)]), 2048).is_none());
        assert!(MsixTable::find(&header(&[(0xf8, PCI_CAP_ID_MSIX, 0)]), 2048).is_none(), "MSI-X past the end");
        assert!(MsixTable::find(&header(&[(0xfc, 0x09, 0)]), 2048).is_none());
        // The low two bits of pointers are reserved (ignored).
        let mut h2 = h.clone();
        h2[PCI_CAPABILITY_LIST] = 0x43;
        h2[0x41] = 0x62;
        assert_eq!(MsixTable::find(&h2, 2048).unwrap().cap_offset(), 0x60);
    }

    #[test]
    fn sizes_are_clamped_and_offsets_aligned() {
        assert_eq!(MsixTable::new(0, 0, T, P, 0x40).vectors(), 1);
        assert_eq!(MsixTable::new(u16::MAX, 0, T, P, 0x40).vectors(), MSIX_MAX_VECTORS);
        let c = MsixTable::new(65, 1, T | 5, P, 0x40).capability();
        assert_eq!((c.offset, c.id), (0x40, PCI_CAP_ID_MSIX));
        assert_eq!(c.body, [64, 0, 0x01, 0x20, 0, 0, 0x01, 0x30, 0, 0]);
    }
}
