//! A small deterministic generator (SplitMix64) for the oracle's
//! schedules, or a fuzzer's bytes standing in for it.

/// Random choices of a schedule: from a seed, or from a fuzzer's input
/// (each choice takes the next bytes; zeros once they run out).
pub struct Rng {
    state: u64,
    bytes: Option<(Vec<u8>, usize)>,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed, bytes: None }
    }

    /// Choices taken from `data` (a fuzzer's input).
    pub fn from_bytes(data: &[u8]) -> Rng {
        Rng { state: 0, bytes: Some((data.to_vec(), 0)) }
    }

    /// True once a byte-driven generator has used its input up.
    pub fn exhausted(&self) -> bool {
        self.bytes.as_ref().is_some_and(|(b, at)| *at >= b.len())
    }

    pub fn next_u64(&mut self) -> u64 {
        if let Some((b, at)) = &mut self.bytes {
            let mut w = [0u8; 8];
            for x in w.iter_mut().take(2) {
                *x = b.get(*at).copied().unwrap_or(0);
                *at += 1;
            }
            return u64::from_le_bytes(w);
        }
        crate::rng::next(&mut self.state)
    }

    /// A value in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `pct` percent.
    pub fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// The bytes of an LBA's pattern: a function of (lba, seq, word) only.
pub fn pattern_word(lba: u64, seq: u64, word: u64) -> u64 {
    let mut r = Rng::new(lba.wrapping_mul(0x1000_0000_01b3) ^ seq.rotate_left(29) ^ word.wrapping_mul(0x9e37));
    r.next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_repeats_and_bytes_drive_choices_until_they_run_out() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
        let mut f = Rng::from_bytes(&[5, 0, 1]);
        assert_eq!(f.below(10), 5);
        assert!(!f.exhausted());
        assert_eq!(f.below(1000), 1);
        assert!(f.exhausted());
        assert_eq!(f.below(10), 0);
        assert_ne!(pattern_word(1, 2, 3), pattern_word(1, 3, 3));
    }
}
