//! Medians with min and max, over batches.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

/// Median (mean of the middle two for an even count), min and max.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    Some(Summary { median, min: v[0], max: v[n - 1], n })
}

/// Cycles to nanoseconds at `tsc_khz`.
pub fn ns(cycles: f64, tsc_khz: u64) -> f64 {
    if tsc_khz == 0 {
        return f64::NAN;
    }
    cycles * 1e6 / tsc_khz as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_min_max() {
        let s = summarize(&[5.0, 1.0, 3.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (3.0, 1.0, 5.0, 3));
        assert_eq!(summarize(&[4.0, 1.0, 3.0, 2.0]).unwrap().median, 2.5);
        assert!(summarize(&[]).is_none());
        assert!(summarize(&[f64::NAN]).is_none());
        assert_eq!(ns(2000.0, 2_000_000), 1000.0);
    }
}
