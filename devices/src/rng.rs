//! SplitMix64 (Steele, Lea, Flood 2014): the one small deterministic
//! generator of the crate. A bijection of a counter (no short cycles),
//! fast, and good enough for what uses it: the timing model's draws, error
//! injection's probabilities and corruptions, and the tests' schedules.
//! Not for anything secret.

/// The generator's state: a seed, advanced by each draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        next(&mut self.0)
    }

    /// A value in `0..n` (`n` of 0 is taken as 1).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in (0, 1]: never 0, so its logarithm is finite.
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Advances `state` and returns the next 64 random bits (for a state kept
/// as a bare `u64`).
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_repeats_its_sequence_and_the_first_value_is_the_published_one() {
        // SplitMix64's first output for seed 0 (its reference implementation).
        assert_eq!(SplitMix64(0).next_u64(), 0xe220_a839_7b1d_cdaf);
        let (mut a, mut b) = (SplitMix64(42), SplitMix64(42));
        assert!((0..100).all(|_| a.next_u64() == b.next_u64()));
        let mut c = SplitMix64(7);
        assert!((0..10_000).all(|_| c.below(10) < 10));
        assert!((0..10_000).all(|_| (f64::MIN_POSITIVE..=1.0).contains(&c.unit())));
    }
}
