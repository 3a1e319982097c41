//! [`DeviceHist`]: what the device itself saw of its timing model, for the
//! counters (`timing.*`): each timed completion's device time (posted −
//! fetched) and lateness (posted − due), on the controller's clock. The
//! guest's histogram adds the path to and from the device and the guest's
//! own waits; this one says whether the device kept its due times.
//!
//! Log-linear buckets of relaxed atomic counts (any device thread records,
//! no lock, no allocation after creation): values below 64 ns exact, then
//! 64 buckets per power of two (at most 1/64 = 1.6 % wide), up to 2^40 ns.

use std::sync::atomic::{AtomicU64, Ordering};

const SUB_BITS: u32 = 6;
const SUB: usize = 1 << SUB_BITS;
/// The largest exponent kept (2^40 ns: 18 minutes); longer ones count there.
const MAX_EXP: u32 = 40;
const BUCKETS: usize = SUB + (MAX_EXP - SUB_BITS + 1) as usize * SUB;

/// One histogram (see the module doc).
pub struct Hist {
    counts: Box<[AtomicU64]>,
    max: AtomicU64,
}

impl Default for Hist {
    fn default() -> Self {
        Hist { counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(), max: AtomicU64::new(0) }
    }
}

fn index(v: u64) -> usize {
    if v < SUB as u64 {
        return v as usize;
    }
    let e = (63 - v.leading_zeros()).min(MAX_EXP);
    let v = v.min((1u64 << (MAX_EXP + 1)) - 1);
    let m = ((v >> (e - SUB_BITS)) as usize) & (SUB - 1);
    SUB + (e - SUB_BITS) as usize * SUB + m
}

/// The middle of bucket `i` (its value, below 64).
fn value(i: usize) -> f64 {
    if i < SUB {
        return i as f64;
    }
    let e = (i - SUB) / SUB + SUB_BITS as usize;
    let m = ((i - SUB) % SUB) as u64;
    let width = 1u64 << (e - SUB_BITS as usize);
    ((SUB as u64 + m) * width) as f64 + (width as f64 - 1.0) / 2.0
}

impl Hist {
    pub fn record(&self, v: u64) {
        self.counts[index(v)].fetch_add(1, Ordering::Relaxed);
        self.max.fetch_max(v, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Relaxed)
    }

    /// The `q` quantile (0..=1), ns, within 1.6 %; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c.load(Ordering::Relaxed);
            if seen >= rank {
                return (value(i).round() as u64).min(self.max());
            }
        }
        self.max()
    }
}

/// A controller's (or a namespace's) device-side timing figures.
#[derive(Default)]
pub struct DeviceHist {
    /// Posted − fetched.
    pub device: Hist,
    /// Posted − due (0 when posted at its due time or, due before the
    /// command was carried out, at once).
    pub late: Hist,
}

impl DeviceHist {
    /// A completion fetched at `arrival`, due at `due`, posted at `posted` (ns).
    pub fn record(&self, arrival: u64, due: u64, posted: u64) {
        self.device.record(posted.saturating_sub(arrival));
        self.late.record(posted.saturating_sub(due));
    }

    /// As counters: `{prefix}.posted`, `{prefix}.device-p50-ns`, `-p99-ns`,
    /// `{prefix}.late-p50-ns`, `-p99-ns`, `-max-ns`.
    pub fn counters(&self, prefix: &str) -> Vec<(String, u64)> {
        let n = self.device.count();
        if n == 0 {
            return Vec::new();
        }
        vec![
            (format!("{prefix}.posted"), n),
            (format!("{prefix}.device-p50-ns"), self.device.quantile(0.5)),
            (format!("{prefix}.device-p99-ns"), self.device.quantile(0.99)),
            (format!("{prefix}.late-p50-ns"), self.late.quantile(0.5)),
            (format!("{prefix}.late-p99-ns"), self.late.quantile(0.99)),
            (format!("{prefix}.late-max-ns"), self.late.max()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_exact_below_64_and_within_two_percent_above() {
        for v in [0u64, 1, 63, 64, 65, 127, 128, 1000, 20_000, 80_000, 300_000, 1 << 39, u64::MAX] {
            let i = index(v);
            assert!(i < BUCKETS, "{v}");
            let m = value(i);
            if v < 64 {
                assert_eq!(m, v as f64);
            } else if v < 1 << 41 {
                assert!((m - v as f64).abs() / v as f64 <= 1.0 / 64.0, "{v}: {m}");
            }
        }
        // Monotonic: a larger value never goes to an earlier bucket.
        let mut last = 0;
        for v in (0..200_000u64).step_by(37) {
            assert!(index(v) >= last);
            last = index(v);
        }
    }

    #[test]
    fn quantiles_of_a_known_set() {
        let h = DeviceHist::default();
        for k in 0..1000u64 {
            // Device time 20 us + k ns; lateness k ns, due at 20 us.
            h.record(0, 20_000, 20_000 + k);
        }
        assert_eq!(h.device.count(), 1000);
        let p50 = h.device.quantile(0.5) as f64;
        assert!((p50 - 20_499.0).abs() / 20_499.0 < 0.016, "{p50}");
        let late99 = h.late.quantile(0.99) as f64;
        assert!((late99 - 989.0).abs() / 989.0 < 0.016, "{late99}");
        assert_eq!(h.late.max(), 999);
        assert_eq!(h.late.quantile(0.0), 0);
        let c = h.counters("timing");
        assert_eq!(c[0], ("timing.posted".to_string(), 1000));
        assert_eq!(c[5], ("timing.late-max-ns".to_string(), 999));
        assert!(DeviceHist::default().counters("timing").is_empty());
    }
}
