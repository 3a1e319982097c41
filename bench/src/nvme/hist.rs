//! The guest's latency histogram: parsed from its `@KIND-hist` lines
//! (`@nvme-hist` from nvmeperf, `@vblk-hist` from the virtio-blk driver: the
//! shared load generator prints both), merged over rounds, and read for percentiles.
//!
//! The layout is the load generator's `hist_add` (guest/c/load.c): a
//! latency of `c` cycles with its highest set bit `m` goes to bucket
//! `64 m + s`, where `s` is `c`'s six bits below the top one (for `m >= 6`)
//! or `c` itself (for `c < 64`). A bucket of `m >= 6` holds the cycles
//! `(64 + s) << (m - 6)` up to `((65 + s) << (m - 6)) - 1`, a 64th of a
//! power of two (at most 1.6 % of its value, finer than the 2 % a timing
//! model is judged by); the smaller ones hold one value each.

use std::collections::BTreeMap;

/// Bits of a latency below its top one that pick its bucket: 64 a power of two.
const SUB_BITS: u32 = 6;
const SUB: u32 = 1 << SUB_BITS;
/// Buckets in the guest's histogram.
pub const BUCKETS: u32 = 64 * SUB;
/// Most `@KIND-hist` lines one run may print (the guest prints 32 buckets a line).
pub const MAX_LINES: usize = 128;

/// A malformed histogram from the guest.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HistError {
    #[error("latency histogram: {0:?} is not BUCKET:COUNT")]
    Pair(String),
    #[error("latency histogram: bucket {0} is not one the guest's layout has")]
    Bucket(u32),
    #[error("latency histogram: bucket {0} given twice")]
    Twice(u32),
    #[error("latency histogram: more than {MAX_LINES} lines")]
    TooLong,
    #[error("latency histogram: no -hist-end line, or it does not match ({0})")]
    End(String),
    #[error("latency histogram: the buckets hold {got} I/Os, the record {want}")]
    Total { got: u64, want: u64 },
}

/// Latency counts by bucket index (non-empty buckets only).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatHist {
    pub counts: BTreeMap<u32, u64>,
}

/// Whether nvmeperf's `hist_add` can produce bucket `b`.
fn valid(b: u32) -> bool {
    let (m, s) = (b / SUB, b % SUB);
    b < BUCKETS && (m >= SUB_BITS || (s >> m == 1) || (m == 0 && s == 0))
}

/// The lowest and highest cycle count of bucket `b` (a valid one).
pub fn edges(b: u32) -> (f64, f64) {
    let (m, s) = (b / SUB, (b % SUB) as u128);
    if m < SUB_BITS {
        return (s as f64, s as f64);
    }
    let lo = (SUB as u128 + s) << (m - SUB_BITS);
    let hi = ((SUB as u128 + 1 + s) << (m - SUB_BITS)) - 1;
    (lo as f64, hi as f64)
}

/// The bucket of a latency of `c` cycles (nvmeperf's `hist_add`).
pub fn bucket_of(c: u64) -> u32 {
    let m = 63 - (c | 1).leading_zeros();
    let s = if m >= SUB_BITS { (c >> (m - SUB_BITS)) as u32 & (SUB - 1) } else { c as u32 & (SUB - 1) };
    m * SUB + s
}

impl LatHist {
    /// The histogram, in nvmeperf's buckets, of latencies given as (ns,
    /// count) points (fio's bins, each about 1.5 % wide: finer than these),
    /// at `tsc_khz`: a row measured on the host reads as the guest's do.
    pub fn from_ns_points(points: &[(u64, u64)], tsc_khz: u64) -> LatHist {
        let mut h = LatHist::default();
        for &(ns, c) in points.iter().filter(|p| p.1 > 0) {
            let cycles = (ns as u128 * tsc_khz as u128 / 1_000_000).min(u64::MAX as u128) as u64;
            let e = h.counts.entry(bucket_of(cycles)).or_insert(0);
            *e = e.saturating_add(c);
        }
        h
    }

    /// Parses nvmeperf's `@nvme-hist` lines of one run: `parse_kind(lines, "nvme", ios)`.
    pub fn parse<S: AsRef<str>>(lines: &[S], ios: u64) -> Result<Option<LatHist>, HistError> {
        Self::parse_kind(lines, "nvme", ios)
    }

    /// Parses the `@KIND-hist` lines of one run (`kind` "nvme", "vblk"),
    /// which must end with an `@KIND-hist-end buckets=N lines=L` line that
    /// matches them and hold `ios` I/Os in all; other kinds' lines are not
    /// looked at. None when the run printed no histogram of that kind at all.
    pub fn parse_kind<S: AsRef<str>>(lines: &[S], kind: &str, ios: u64) -> Result<Option<LatHist>, HistError> {
        let (line_prefix, end_prefix) = (format!("@{kind}-hist "), format!("@{kind}-hist-end"));
        let mut h = LatHist::default();
        let (mut n_lines, mut end) = (0usize, None);
        for l in lines.iter().map(|l| l.as_ref()) {
            if let Some(rest) = l.strip_prefix(end_prefix.as_str()) {
                end = Some(rest.trim().to_string());
                break;
            }
            let Some(rest) = l.strip_prefix(line_prefix.as_str()) else { continue };
            n_lines += 1;
            if n_lines > MAX_LINES {
                return Err(HistError::TooLong);
            }
            for w in rest.split_whitespace() {
                let (b, c) = w
                    .split_once(':')
                    .and_then(|(b, c)| Some((b.parse::<u32>().ok()?, c.parse::<u64>().ok()?)))
                    .ok_or_else(|| HistError::Pair(w.chars().take(40).collect()))?;
                if !valid(b) {
                    return Err(HistError::Bucket(b));
                }
                if h.counts.insert(b, c).is_some() {
                    return Err(HistError::Twice(b));
                }
            }
        }
        let Some(end) = end else {
            return if n_lines == 0 { Ok(None) } else { Err(HistError::End("missing".into())) };
        };
        let want = format!("buckets={} lines={n_lines}", h.counts.len());
        if end != want {
            return Err(HistError::End(format!("{end:?}, expected {want:?}")));
        }
        h.counts.retain(|_, c| *c > 0);
        let got = h.counts.values().try_fold(0u64, |a, &c| a.checked_add(c)).unwrap_or(u64::MAX);
        if got != ios {
            return Err(HistError::Total { got, want: ios });
        }
        Ok(Some(h))
    }

    /// Adds `other`'s counts (saturating: a count near 2^64 is a lie already
    /// refused by `parse`'s total check, never a panic).
    pub fn merge(&mut self, other: &LatHist) {
        for (&b, &c) in &other.counts {
            let e = self.counts.entry(b).or_insert(0);
            *e = e.saturating_add(c);
        }
    }

    /// The merged histogram of several.
    pub fn merged<'a>(hs: impl IntoIterator<Item = &'a LatHist>) -> LatHist {
        let mut m = LatHist::default();
        for h in hs {
            m.merge(h);
        }
        m
    }

    pub fn total(&self) -> u64 {
        self.counts.values().fold(0u64, |a, &c| a.saturating_add(c))
    }

    /// The latency in cycles at quantile `q` (0 < q <= 1): the bucket where
    /// the rank `q * total` falls, interpolated linearly between its lowest
    /// and highest value by the rank's place among the bucket's counts (the
    /// highest value when the rank is the bucket's last). None when empty.
    pub fn quantile_cycles(&self, q: f64) -> Option<f64> {
        let total = self.total();
        if total == 0 || !(q > 0.0 && q <= 1.0) {
            return None;
        }
        let rank = q * total as f64;
        let mut before = 0u64;
        for (&b, &c) in &self.counts {
            let after = before.saturating_add(c);
            if after as f64 >= rank {
                let (lo, hi) = edges(b);
                let f = ((rank - before as f64) / c as f64).clamp(0.0, 1.0);
                return Some(lo + f * (hi - lo));
            }
            before = after;
        }
        self.counts.keys().next_back().map(|&b| edges(b).1)
    }

    /// `quantile_cycles` in nanoseconds at `tsc_khz` (NaN when empty).
    pub fn quantile_ns(&self, q: f64, tsc_khz: u64) -> f64 {
        self.quantile_cycles(q).map_or(f64::NAN, |c| crate::stats::ns(c, tsc_khz))
    }

    /// The `[upper_edge_ns, count]` pairs of the JSON's `hist`.
    pub fn pairs_ns(&self, tsc_khz: u64) -> Vec<(f64, u64)> {
        self.counts.iter().map(|(&b, &c)| (crate::stats::ns(edges(b).1, tsc_khz), c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(u32, u64)]) -> LatHist {
        LatHist { counts: pairs.iter().copied().collect() }
    }

    use super::bucket_of as bucket;

    #[test]
    fn the_layout_is_the_guests() {
        for c in [0u64, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 100, 1000, 4095, 123_456, 1 << 40, u64::MAX] {
            let b = bucket(c);
            assert!(valid(b), "{c}: bucket {b}");
            let (lo, hi) = edges(b);
            assert!(lo <= c as f64 && c as f64 <= hi, "{c} not in bucket {b} = [{lo}, {hi}]");
        }
        // Neighbouring buckets meet: each starts one cycle after the last ends.
        let mut prev: Option<f64> = None;
        for b in (0..BUCKETS).filter(|&b| valid(b)) {
            let (lo, hi) = edges(b);
            if let Some(p) = prev {
                assert_eq!(lo, p + 1.0, "bucket {b}");
            }
            prev = Some(hi);
        }
        assert_eq!((bucket(100), edges(420)), (420, (100.0, 100.0)));
        assert_eq!((bucket(2560), edges(720)), (720, (2560.0, 2591.0)));
        assert_eq!((bucket(5), edges(133)), (133, (5.0, 5.0)));
        assert!(!valid(2) && !valid(17) && !valid(100) && !valid(BUCKETS));
    }

    #[test]
    fn parses_the_guests_lines() {
        let lines = [
            "@nvme ios=6 cycles=10",
            "@nvme-hist 133:1 420:2",
            "@nvme-hist 421:3",
            "@nvme-hist-end buckets=3 lines=2",
            "@done rc=0",
        ];
        assert_eq!(LatHist::parse(&lines, 6), Ok(Some(h(&[(133, 1), (420, 2), (421, 3)]))));
        assert_eq!(LatHist::parse(&["@nvme ios=0"], 0), Ok(None));
        assert_eq!(LatHist::parse(&["@nvme-hist-end buckets=0 lines=0"], 0), Ok(Some(h(&[]))));
    }

    #[test]
    fn each_kind_reads_only_its_own_lines() {
        // A run's output may hold another driver's lines (nvmeperf's and vblk's share the format).
        let lines = [
            "@nvme-hist 420:9",
            "@nvme-hist-end buckets=1 lines=1",
            "@vblk ios=3 cycles=10",
            "@vblk-hist 133:1 421:2",
            "@vblk-hist-end buckets=2 lines=1",
        ];
        assert_eq!(LatHist::parse_kind(&lines, "vblk", 3), Ok(Some(h(&[(133, 1), (421, 2)]))));
        assert_eq!(LatHist::parse_kind(&lines, "nvme", 9), Ok(Some(h(&[(420, 9)]))));
        assert_eq!(LatHist::parse(&lines, 9), LatHist::parse_kind(&lines, "nvme", 9));
        // vblk's total is checked against vblk's record, not nvme's.
        assert_eq!(LatHist::parse_kind(&lines, "vblk", 9), Err(HistError::Total { got: 3, want: 9 }));
        // An nvme end line does not end a vblk histogram.
        let cut = ["@vblk-hist 133:1", "@nvme-hist-end buckets=1 lines=1"];
        assert!(matches!(LatHist::parse_kind(&cut, "vblk", 1), Err(HistError::End(_))));
        assert_eq!(LatHist::parse_kind(&["@nvme-hist 133:1"], "vblk", 0), Ok(None));
    }

    #[test]
    fn malformed_histograms_are_errors() {
        let bad = |lines: &[&str], ios| LatHist::parse(lines, ios).unwrap_err();
        assert_eq!(bad(&["@nvme-hist 420:x", "@nvme-hist-end buckets=1 lines=1"], 1), HistError::Pair("420:x".into()));
        assert_eq!(bad(&["@nvme-hist 420", "@nvme-hist-end buckets=1 lines=1"], 1), HistError::Pair("420".into()));
        assert_eq!(bad(&["@nvme-hist 2:1", "@nvme-hist-end buckets=1 lines=1"], 1), HistError::Bucket(2));
        assert_eq!(bad(&["@nvme-hist 5000:1", "@nvme-hist-end buckets=1 lines=1"], 1), HistError::Bucket(5000));
        assert_eq!(bad(&["@nvme-hist 420:1 420:1", "@nvme-hist-end buckets=1 lines=1"], 2), HistError::Twice(420));
        assert!(matches!(bad(&["@nvme-hist 420:1"], 1), HistError::End(_)), "a cut-off dump");
        assert!(matches!(bad(&["@nvme-hist 420:1", "@nvme-hist-end buckets=2 lines=1"], 1), HistError::End(_)));
        assert_eq!(
            bad(&["@nvme-hist 420:1 421:2", "@nvme-hist-end buckets=2 lines=1"], 4),
            HistError::Total { got: 3, want: 4 }
        );
        let max = format!("@nvme-hist 420:{} 421:1", u64::MAX);
        assert!(matches!(bad(&[&max, "@nvme-hist-end buckets=2 lines=1"], 5), HistError::Total { .. }));
        let many: Vec<String> = (0..=MAX_LINES).map(|i| format!("@nvme-hist {}:1", 420 + i)).collect();
        assert_eq!(LatHist::parse(&many, 65), Err(HistError::TooLong));
    }

    #[test]
    fn ns_points_land_in_the_guests_buckets() {
        // At 1 GHz a ns is a cycle: 400 and 403 ns share bucket 548, 10300 ns is in 848.
        let h = LatHist::from_ns_points(&[(400, 2), (403, 1), (10300, 4), (7, 0)], 1_000_000);
        assert_eq!(h, LatHist { counts: [(548, 3), (848, 4)].into_iter().collect() });
        // At 2 GHz, 200 ns is 400 cycles.
        assert_eq!(LatHist::from_ns_points(&[(200, 1)], 2_000_000).counts.keys().next(), Some(&548));
        assert_eq!(LatHist::from_ns_points(&[(u64::MAX, 1)], u64::MAX).total(), 1, "no overflow");
    }

    #[test]
    fn merging_adds_counts_bucket_by_bucket() {
        let mut a = h(&[(548, 2), (549, 1)]);
        a.merge(&h(&[(549, 4), (800, 1)]));
        assert_eq!(a, h(&[(548, 2), (549, 5), (800, 1)]));
        assert_eq!(LatHist::merged([&h(&[(133, 1)]), &h(&[(133, u64::MAX)])]).counts[&133], u64::MAX);
    }

    #[test]
    fn percentiles_interpolate_within_the_bucket() {
        // Bucket 548 (m=8, s=36) holds 400..=403 cycles: 4 I/Os there, p50 is
        // rank 2 of 4, halfway: 401.5; the last rank is the upper edge.
        let one = h(&[(548, 4)]);
        assert_eq!(one.quantile_cycles(0.5), Some(401.5));
        assert_eq!(one.quantile_cycles(1.0), Some(403.0));
        assert_eq!(one.quantile_cycles(0.25), Some(400.75));
        // Two buckets: 548 (400..=403) x10 and 848 (m=13, s=16: 10240..=10367) x10.
        let two = h(&[(548, 10), (848, 10)]);
        assert_eq!(edges(848), (10240.0, 10367.0));
        assert_eq!(two.quantile_cycles(0.5), Some(403.0));
        assert_eq!(two.quantile_cycles(0.9), Some(10240.0 + 0.8 * 127.0));
        assert_eq!(two.quantile_cycles(0.99), Some(10240.0 + 0.98 * 127.0));
        // Single-value buckets are exact.
        assert_eq!(h(&[(133, 3)]).quantile_cycles(0.5), Some(5.0));
        assert_eq!(h(&[]).quantile_cycles(0.5), None);
        assert_eq!(one.quantile_cycles(0.0), None);
        // ns at 2 GHz, and the JSON pairs carry each bucket's upper edge.
        assert_eq!(one.quantile_ns(1.0, 2_000_000), 201.5);
        assert_eq!(two.pairs_ns(1_000_000), vec![(403.0, 10), (10367.0, 10)]);
    }

    #[test]
    fn merged_percentiles_are_not_medians_of_percentiles() {
        // Three rounds: two fast (all in bucket 548, 400..=403 cycles), one slow (all in 848).
        // The median of per-round p99s is the fast rounds' 403; over the merged
        // I/Os the p99 is in the slow bucket.
        let rounds = [h(&[(548, 100)]), h(&[(548, 100)]), h(&[(848, 100)])];
        let m = LatHist::merged(&rounds);
        let p99 = m.quantile_cycles(0.99).unwrap();
        assert!(p99 > 10240.0 && p99 < 10367.0, "{p99}");
        // p50: rank 150 of the 200 I/Os in bucket 548 (400..=403): 400 + 0.75 * 3.
        assert_eq!(m.quantile_cycles(0.5), Some(402.25));
    }
}
