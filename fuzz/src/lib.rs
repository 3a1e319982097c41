//! Input formats of the fuzz targets that take more than plain bytes, shared by the targets
//! (which decode them) and the seed generator `examples/gen_corpus.rs` (which encodes them).
//! Decoding never fails: whatever bytes the fuzzer makes are some input, and a truncated
//! operation at the end is dropped.

pub mod nvme;
pub mod nvme_queues;

/// A byte reader that runs out quietly (`None`).
pub struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Cursor { b }
    }

    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }

    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            self.b = &[];
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }

    /// Up to `n` bytes: fewer if the input ends first.
    pub fn up_to(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.b.len());
        self.bytes(n).unwrap_or(&[])
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.bytes(1).map(|b| b[0])
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.bytes(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.bytes(4).map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.bytes(8).map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

/// `mpqemu_wire` input: one byte, the number of fds received with the message (mod 10, so
/// 0..=9: one more than SYNC_SYSMEM's maximum), then the message as it comes off the socket
/// (16-byte header, then data).
pub mod mpqemu {
    pub fn encode(nfds: u8, msg: &[u8]) -> Vec<u8> {
        [&[nfds][..], msg].concat()
    }
}
