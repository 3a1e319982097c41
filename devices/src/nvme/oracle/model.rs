//! What the oracle knows: the namespace's expected contents, guest memory's
//! expected image, and the violations it reports.

use super::rng::pattern_word;

/// A broken rule of the queue protocol, with what the oracle saw.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("completion for a command that is not outstanding: {0}")]
    UnexpectedCompletion(String),
    #[error("no completion: {0}")]
    LostCompletion(String),
    #[error("a command executed twice, or executed and never completed: {0}")]
    Execution(String),
    #[error("SQ head: {0}")]
    SqHead(String),
    #[error("wrong status: {0}")]
    Status(String),
    #[error("wrong data: {0}")]
    Data(String),
    #[error("guest memory written outside a command's data pointers: {0}")]
    Memory(String),
    #[error("controller: {0}")]
    Controller(String),
}

/// A block read back that holds none of what its LBA may hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("LBA {lba} holds none of {can_be:?} (first words {})", hex_words(.first_words))]
pub struct WrongData {
    pub lba: u64,
    /// What the LBA may hold.
    pub can_be: Vec<Content>,
    /// The first words of the block read back.
    pub first_words: Vec<u64>,
}

fn hex_words(w: &[u64]) -> String {
    w.iter().map(|x| format!("{x:#x}")).collect::<Vec<_>>().join(" ")
}

/// A schedule that ended in a violation: where it was and what was
/// outstanding then.
#[derive(Debug, Clone, thiserror::Error)]
#[error("step {step} of {shape:?}: {violation}\n  outstanding: {outstanding}\n  counters: {counters}")]
pub struct Failure {
    pub step: u32,
    pub shape: Box<super::Shape>,
    pub violation: Violation,
    /// The commands in flight, per queue.
    pub outstanding: String,
    /// The device's counters then.
    pub counters: String,
}

/// What an LBA may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Content {
    Zero,
    /// The pattern of write number `seq`.
    Data(u64),
    /// A block whose metadata word `at` is a protection information tuple
    /// (`tuple`, as the host sees it: `pi.rs`) a write gave or the
    /// controller generated, over the pattern of write `seq`, or over zeros
    /// (None: Write Zeroes with PRACT; every other metadata byte of the
    /// block then reads 0). `data`: the block's data words.
    Tagged {
        seq: Option<u64>,
        data: u16,
        at: u16,
        tuple: u64,
    },
}

impl Content {
    /// Word `i` of the block of `lba` holding this content.
    pub fn word(self, lba: u64, i: u64) -> u64 {
        match self {
            Content::Zero => 0,
            Content::Data(seq) => pattern_word(lba, seq, i),
            // Metadata words are kept inverted (the driver's `Meta::stored`):
            // these give the tuple, and zeros, as the host sees them.
            Content::Tagged { at, tuple, .. } if i == at as u64 => !tuple,
            Content::Tagged { seq: Some(seq), .. } => pattern_word(lba, seq, i),
            Content::Tagged { seq: None, data, .. } => {
                if i < data as u64 {
                    0
                } else {
                    !0
                }
            }
        }
    }
}

/// The namespace as the oracle expects it: each LBA's possible contents
/// (one, or several after a write whose fate a reset left open), and
/// which LBAs in-flight commands cover.
pub struct Lbas {
    can_be: Vec<Vec<Content>>,
    readers: Vec<u16>,
    writer: Vec<bool>,
}

impl Lbas {
    pub fn new(n: u64) -> Lbas {
        Lbas {
            can_be: vec![vec![Content::Zero]; n as usize],
            readers: vec![0; n as usize],
            writer: vec![false; n as usize],
        }
    }

    pub fn len(&self) -> u64 {
        self.can_be.len() as u64
    }

    /// True if a command on `slba..slba+n` (a write when `write`) may go out
    /// now: it overlaps no command in flight that writes, and a write
    /// overlaps no command in flight at all.
    pub fn free(&self, slba: u64, n: u64, write: bool) -> bool {
        (slba..slba + n).all(|l| !self.writer[l as usize] && (!write || self.readers[l as usize] == 0))
    }

    pub fn claim(&mut self, slba: u64, n: u64, write: bool, on: bool) {
        for l in slba..slba + n {
            let l = l as usize;
            if write {
                self.writer[l] = on;
            } else if on {
                self.readers[l] += 1;
            } else {
                self.readers[l] -= 1;
            }
        }
    }

    /// A write (or zeroing) completed: the blocks hold `c` now.
    pub fn set(&mut self, slba: u64, n: u64, c: Content) {
        for l in slba..slba + n {
            self.can_be[l as usize] = vec![c];
        }
    }

    /// A write a reset or queue deletion dropped: it may or may not have
    /// reached the blocks.
    pub fn maybe(&mut self, slba: u64, n: u64, c: Content) {
        for l in slba..slba + n {
            let v = &mut self.can_be[l as usize];
            if !v.contains(&c) {
                v.push(c);
            }
        }
    }

    /// What `lba` may hold.
    pub fn can_be(&self, lba: u64) -> &[Content] {
        &self.can_be[lba as usize]
    }

    /// Checks a block read back (`words`) against what `lba` may hold; the
    /// content found is what it holds from now on.
    pub fn observe(&mut self, lba: u64, words: &[u64]) -> Result<(), WrongData> {
        let v = &mut self.can_be[lba as usize];
        let found = v.iter().copied().find(|c| words.iter().enumerate().all(|(i, &w)| w == c.word(lba, i as u64)));
        match found {
            Some(c) => {
                *v = vec![c];
                Ok(())
            }
            None => Err(WrongData { lba, can_be: v.clone(), first_words: words.iter().take(4).copied().collect() }),
        }
    }
}

/// The canary a word of guest memory holds where nobody may write.
pub fn canary(gpa: u64) -> u64 {
    0xc0de_0000_0000_0000 | gpa
}

/// Guest memory as the driver expects it, a word at a time: a word it cares
/// about must hold `words[i]`; the others (CQ rings, EventIdx, a read's
/// buffer in flight) are the device's to write.
pub struct Image {
    words: Vec<u64>,
    care: Vec<bool>,
}

impl Image {
    pub fn new(bytes: u64) -> Image {
        let n = (bytes / 8) as usize;
        Image { words: (0..n as u64).map(|i| canary(i * 8)).collect(), care: vec![true; n] }
    }

    /// The expected bytes at `gpa` (8-byte aligned, a multiple of 8 long).
    pub fn put(&mut self, gpa: u64, data: &[u8]) {
        for (i, c) in data.chunks_exact(8).enumerate() {
            let w = (gpa / 8) as usize + i;
            self.words[w] = u64::from_le_bytes(c.try_into().unwrap());
            self.care[w] = true;
        }
    }

    /// `len` bytes at `gpa` are the device's to write (or no longer).
    pub fn release(&mut self, gpa: u64, len: u64, device: bool) {
        let (a, b) = ((gpa / 8) as usize, (gpa + len).div_ceil(8) as usize);
        self.care[a..b].iter_mut().for_each(|c| *c = !device);
    }

    /// Canary again at `gpa..gpa+len`.
    pub fn canary(&mut self, gpa: u64, len: u64) {
        let (a, b) = ((gpa / 8) as usize, (gpa + len).div_ceil(8) as usize);
        for w in a..b {
            self.words[w] = canary(w as u64 * 8);
            self.care[w] = true;
        }
    }

    /// The first word of `mem` (the memory as read back, `base` its first
    /// word's address) that differs from what it must hold.
    pub fn first_difference(&self, base: u64, mem: &[u64]) -> Option<(u64, u64, u64)> {
        let first = (base / 8) as usize;
        mem.iter().enumerate().find_map(|(i, &got)| {
            let w = first + i;
            (self.care[w] && self.words[w] != got).then(|| (w as u64 * 8, self.words[w], got))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_conflict_as_nvme_leaves_them_unordered() {
        let mut l = Lbas::new(16);
        l.claim(2, 4, false, true);
        assert!(l.free(0, 2, true));
        assert!(!l.free(5, 2, true), "a write over a read in flight");
        assert!(l.free(3, 4, false), "reads share");
        l.claim(8, 2, true, true);
        assert!(!l.free(9, 1, false), "a read over a write in flight");
        l.claim(8, 2, true, false);
        assert!(l.free(9, 1, false));
    }

    #[test]
    fn a_block_read_back_must_hold_one_of_its_possible_contents() {
        let mut l = Lbas::new(4);
        let block = |c: Content, lba| (0..64u64).map(|i| c.word(lba, i)).collect::<Vec<_>>();
        assert!(l.observe(1, &block(Content::Zero, 1)).is_ok());
        l.set(1, 1, Content::Data(7));
        assert!(l.observe(1, &block(Content::Zero, 1)).is_err());
        assert!(l.observe(1, &block(Content::Data(7), 2)).is_err(), "another LBA's pattern");
        l.maybe(1, 1, Content::Data(9));
        assert!(l.observe(1, &block(Content::Data(9), 1)).is_ok());
        assert!(l.observe(1, &block(Content::Data(7), 1)).is_err(), "settled by the read");
    }

    #[test]
    fn the_image_reports_the_first_word_it_cares_about_that_differs() {
        let mut im = Image::new(64);
        let mut mem: Vec<u64> = (0..8).map(|i| canary(i * 8)).collect();
        assert_eq!(im.first_difference(0, &mem), None);
        mem[3] = 1;
        assert_eq!(im.first_difference(0, &mem), Some((24, canary(24), 1)));
        im.release(24, 8, true);
        assert_eq!(im.first_difference(0, &mem), None);
        im.put(16, &5u64.to_le_bytes());
        assert_eq!(im.first_difference(16, &mem[2..]), Some((16, 5, canary(16))));
    }
}
