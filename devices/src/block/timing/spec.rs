//! `timing=`'s value: a [`TimingSpec`], parsed from and written as text
//! that fits inside the device-option syntax (no `,`, `@` or `=`).
//!
//! Grammar: items joined by `+`, each `KEY:VALUE[:VALUE]`, each key at
//! most once, in any order (`Display` writes them in the order below):
//! ```text
//! spec     = item *("+" item)
//! item     = op ":" latency | "channels:" N | "iops:" RATE | "bw:" RATE | "seed:" N
//! op       = "read" | "write" | "flush" | "discard"   (discard also covers write zeroes)
//! latency  = DUR                                     a constant
//!          | ("uniform" | "u") ":" DUR ":" DUR       uniform between lo and hi, lo < hi
//!          | ("lognormal" | "ln") ":" DUR ":" DUR    log-normal with this p50 and p99, p50 < p99
//! DUR      = DECIMAL ("ns" | "us" | "ms" | "s")      a whole number of ns, 1 ns ..= 10 s
//! RATE     = DECIMAL ["k" | "m" | "g" | "t"]         powers of 1000, a whole number
//! ```
//! Examples, one per form:
//! - `read:10us`: every read takes 10 us (a constant);
//! - `read:uniform:50us:150us` (or `read:u:50us:150us`): uniform in [50, 150] us;
//! - `read:lognormal:80us:300us` (or `read:ln:80us:300us`): p50 80 us, p99 300 us;
//! - `write:20us+flush:1.5ms+discard:200us`: one latency per operation;
//! - `read:80us+channels:8`: 8 channels (dies), a command waits for a free one;
//! - `read:80us+iops:500k`: at most 500 000 completions per second;
//! - `read:80us+bw:3g`: at most 3 GB/s (3·10⁹ bytes per second) of data;
//! - `read:ln:80us:300us+seed:7`: the model's random draws from seed 7.
//!
//! An operation given no latency takes none (it still counts against the
//! ceilings); no `channels` means unbounded parallelism; no `iops` or `bw`
//! means no ceiling. Bounds: channels 1 ..= 1024, iops 10 ..= 100m, bw
//! 1m ..= 1t bytes per second. Units and suffixes are case-insensitive.

use std::fmt;
use std::str::FromStr;

/// The longest latency a spec may set: 10 s.
pub const MAX_DURATION_NS: u64 = 10_000_000_000;
/// The most channels: 1024.
pub const MAX_CHANNELS: u32 = 1024;
/// IOPS ceiling bounds: 10 ..= 100 M.
pub const IOPS_RANGE: (u64, u64) = (10, 100_000_000);
/// Bandwidth ceiling bounds, bytes per second: 1 MB/s ..= 1 TB/s.
pub const BW_RANGE: (u64, u64) = (1_000_000, 1_000_000_000_000);
/// The model's seed when the spec gives none.
pub const DEFAULT_SEED: u64 = 0x696f_7061_7468; // "iopath"

/// The kind of a command, as the timing model tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    Read,
    Write,
    Flush,
    /// Discard (NVMe Deallocate, virtio DISCARD) and write zeroes.
    Discard,
}

impl OpKind {
    pub const ALL: [OpKind; 4] = [OpKind::Read, OpKind::Write, OpKind::Flush, OpKind::Discard];

    /// The spec's key for it.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Discard => "discard",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// One operation's service time, nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Latency {
    Constant(u64),
    /// Uniform over `lo ..= hi`.
    Uniform {
        lo: u64,
        hi: u64,
    },
    /// Log-normal with these median and 99th percentile (draws are
    /// clamped to 1 ns ..= 10 s).
    LogNormal {
        p50: u64,
        p99: u64,
    },
}

/// z such that Φ(z) = 0.99, the standard normal's 99th percentile.
pub const Z_99: f64 = 2.326_347_874_040_840_8;

impl Latency {
    /// A log-normal's (mu, sigma) of ln(ns): mu = ln p50, sigma =
    /// ln(p99 / p50) / z₀.₉₉. None for the other kinds.
    pub fn lognormal_params(&self) -> Option<(f64, f64)> {
        match *self {
            Latency::LogNormal { p50, p99 } => Some(((p50 as f64).ln(), (p99 as f64 / p50 as f64).ln() / Z_99)),
            _ => None,
        }
    }
}

/// A namespace's timing model, as `timing=` gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimingSpec {
    /// Per [`OpKind`] (index: `Read, Write, Flush, Discard`); None: no latency.
    pub latency: [Option<Latency>; 4],
    /// Parallelism: None is unbounded.
    pub channels: Option<u32>,
    /// Completions per second at most.
    pub iops: Option<u64>,
    /// Bytes per second at most.
    pub bw: Option<u64>,
    pub seed: Option<u64>,
}

impl TimingSpec {
    pub fn latency(&self, op: OpKind) -> Option<Latency> {
        self.latency[op.index()]
    }
}

/// Why a `timing=` value was refused; `piece` is the `+`-separated item
/// at fault, as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    #[error("empty timing spec (e.g. read:80us)")]
    Empty,
    #[error("{piece:?}: unknown item (read, write, flush, discard, channels, iops, bw, seed)")]
    Unknown { piece: String },
    #[error("{piece:?}: {key} given twice")]
    Duplicate { piece: String, key: &'static str },
    #[error("{piece:?}: expected {expected}")]
    Shape { piece: String, expected: &'static str },
    #[error("{piece:?}: {value:?} is not {expected}")]
    Number { piece: String, value: String, expected: &'static str },
    #[error("{piece:?}: {value:?} is outside {range}")]
    Range { piece: String, value: String, range: &'static str },
    #[error("{piece:?}: {what}")]
    Order { piece: String, what: &'static str },
}

const LATENCY_SHAPE: &str = "OP:DUR, OP:uniform:LO:HI or OP:lognormal:P50:P99";
const DUR_WORD: &str = "a duration (e.g. 80us, 1.5ms; units ns, us, ms, s) of a whole number of ns";
const DUR_RANGE: &str = "1ns ..= 10s";

impl FromStr for TimingSpec {
    type Err = TimingError;
    fn from_str(s: &str) -> Result<Self, TimingError> {
        if s.is_empty() {
            return Err(TimingError::Empty);
        }
        let mut spec = TimingSpec { latency: [None; 4], channels: None, iops: None, bw: None, seed: None };
        for piece in s.split('+') {
            let fields: Vec<&str> = piece.split(':').collect();
            let p = || piece.to_string();
            let key = fields[0].to_ascii_lowercase();
            let dup = |k: &'static str| TimingError::Duplicate { piece: p(), key: k };
            let one = |expected| match fields.len() {
                2 => Ok(fields[1]),
                _ => Err(TimingError::Shape { piece: p(), expected }),
            };
            if let Some(op) = OpKind::ALL.into_iter().find(|o| o.name() == key) {
                let slot = &mut spec.latency[op.index()];
                if slot.is_some() {
                    return Err(dup(op.name()));
                }
                *slot = Some(latency(piece, &fields[1..])?);
                continue;
            }
            match key.as_str() {
                "channels" if spec.channels.is_some() => return Err(dup("channels")),
                "channels" => {
                    let n = plain(piece, one("channels:N")?, "a number of channels")?;
                    spec.channels = Some(bounded(piece, n, (1, MAX_CHANNELS as u64), "1 ..= 1024")? as u32);
                }
                "iops" if spec.iops.is_some() => return Err(dup("iops")),
                "iops" => {
                    let n = rate(piece, one("iops:RATE")?)?;
                    spec.iops = Some(bounded(piece, n, IOPS_RANGE, "10 ..= 100m")?);
                }
                "bw" if spec.bw.is_some() => return Err(dup("bw")),
                "bw" => {
                    let n = rate(piece, one("bw:RATE (bytes per second, e.g. 3g)")?)?;
                    spec.bw = Some(bounded(piece, n, BW_RANGE, "1m ..= 1t bytes per second")?);
                }
                "seed" if spec.seed.is_some() => return Err(dup("seed")),
                "seed" => spec.seed = Some(plain(piece, one("seed:N")?, "a seed (0 ..= 2^64-1)")?),
                _ => return Err(TimingError::Unknown { piece: p() }),
            }
        }
        Ok(spec)
    }
}

/// An operation's latency from the fields after its key.
fn latency(piece: &str, f: &[&str]) -> Result<Latency, TimingError> {
    let shape = || TimingError::Shape { piece: piece.to_string(), expected: LATENCY_SHAPE };
    let order = |what| TimingError::Order { piece: piece.to_string(), what };
    match f {
        [d] => Ok(Latency::Constant(duration(piece, d)?)),
        [kind, a, b] => {
            let (a, b) = (duration(piece, a)?, duration(piece, b)?);
            match kind.to_ascii_lowercase().as_str() {
                "uniform" | "u" if a < b => Ok(Latency::Uniform { lo: a, hi: b }),
                "uniform" | "u" => Err(order("uniform needs lo < hi (equal: give a constant)")),
                "lognormal" | "ln" if a < b => Ok(Latency::LogNormal { p50: a, p99: b }),
                "lognormal" | "ln" => Err(order("lognormal needs p50 < p99 (equal: give a constant)")),
                _ => Err(shape()),
            }
        }
        _ => Err(shape()),
    }
}

/// A whole number from `DIGITS[.DIGITS]` times `mult`, None if it is not
/// one (bad digits, a fraction left over, overflow).
fn scaled(num: &str, mult: u64) -> Option<u64> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !digits(int) || !digits(frac) || (num.contains('.') && frac.is_empty()) || frac.len() > 18 {
        return None;
    }
    let int: u128 = int.parse().ok()?;
    let f: u128 = if frac.is_empty() { 0 } else { frac.parse().ok()? };
    let den = 10u128.pow(frac.len() as u32);
    let fpart = f.checked_mul(mult as u128)?;
    if fpart % den != 0 {
        return None;
    }
    u64::try_from(int.checked_mul(mult as u128)?.checked_add(fpart / den)?).ok()
}

/// Splits `v` into its number and its (lowercased) suffix.
fn split_suffix(v: &str) -> (&str, String) {
    let at = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    (&v[..at], v[at..].to_ascii_lowercase())
}

fn duration(piece: &str, v: &str) -> Result<u64, TimingError> {
    let bad = || TimingError::Number { piece: piece.to_string(), value: v.to_string(), expected: DUR_WORD };
    let (num, unit) = split_suffix(v);
    let mult = match unit.as_str() {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return Err(bad()),
    };
    let ns = scaled(num, mult).ok_or_else(bad)?;
    bounded(piece, ns, (1, MAX_DURATION_NS), DUR_RANGE).map_err(|_| TimingError::Range {
        piece: piece.to_string(),
        value: v.to_string(),
        range: DUR_RANGE,
    })
}

fn rate(piece: &str, v: &str) -> Result<u64, TimingError> {
    let bad = || TimingError::Number {
        piece: piece.to_string(),
        value: v.to_string(),
        expected: "a rate (e.g. 500k, 3g; suffixes k, m, g, t: powers of 1000) that is a whole number",
    };
    let (num, suffix) = split_suffix(v);
    let mult = match suffix.as_str() {
        "" => 1,
        "k" => 1_000,
        "m" => 1_000_000,
        "g" => 1_000_000_000,
        "t" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    scaled(num, mult).ok_or_else(bad)
}

fn plain(piece: &str, v: &str, expected: &'static str) -> Result<u64, TimingError> {
    v.parse::<u64>().ok().filter(|_| v.bytes().all(|b| b.is_ascii_digit())).ok_or_else(|| TimingError::Number {
        piece: piece.to_string(),
        value: v.to_string(),
        expected,
    })
}

fn bounded(piece: &str, n: u64, (lo, hi): (u64, u64), range: &'static str) -> Result<u64, TimingError> {
    if (lo..=hi).contains(&n) {
        Ok(n)
    } else {
        Err(TimingError::Range { piece: piece.to_string(), value: n.to_string(), range })
    }
}

/// `ns` in the largest unit that writes it exactly.
struct Dur(u64);

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [(1_000_000_000, "s"), (1_000_000, "ms"), (1_000, "us")];
        match units.iter().find(|(m, _)| self.0.is_multiple_of(*m)) {
            Some((m, u)) => write!(f, "{}{u}", self.0 / m),
            None => write!(f, "{}ns", self.0),
        }
    }
}

/// A rate with the largest suffix that writes it exactly.
struct Rate(u64);

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let units = [(1_000_000_000_000, "t"), (1_000_000_000, "g"), (1_000_000, "m"), (1_000, "k")];
        match units.iter().find(|(m, _)| self.0.is_multiple_of(*m)) {
            Some((m, u)) => write!(f, "{}{u}", self.0 / m),
            None => write!(f, "{}", self.0),
        }
    }
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Latency::Constant(d) => write!(f, "{}", Dur(d)),
            Latency::Uniform { lo, hi } => write!(f, "uniform:{}:{}", Dur(lo), Dur(hi)),
            Latency::LogNormal { p50, p99 } => write!(f, "lognormal:{}:{}", Dur(p50), Dur(p99)),
        }
    }
}

/// The items in grammar order, `+`-joined, as [`FromStr`] takes them back.
impl fmt::Display for TimingSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items = Vec::new();
        for op in OpKind::ALL {
            if let Some(l) = self.latency(op) {
                items.push(format!("{}:{l}", op.name()));
            }
        }
        if let Some(n) = self.channels {
            items.push(format!("channels:{n}"));
        }
        if let Some(n) = self.iops {
            items.push(format!("iops:{}", Rate(n)));
        }
        if let Some(n) = self.bw {
            items.push(format!("bw:{}", Rate(n)));
        }
        if let Some(n) = self.seed {
            items.push(format!("seed:{n}"));
        }
        f.write_str(&items.join("+"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<TimingSpec, TimingError> {
        s.parse()
    }

    #[test]
    fn the_issue_example_parses_to_its_values() {
        let s = parse("read:lognormal:80us:300us+write:20us+flush:1ms+channels:8+iops:500k+bw:3g").unwrap();
        assert_eq!(s.latency(OpKind::Read), Some(Latency::LogNormal { p50: 80_000, p99: 300_000 }));
        assert_eq!(s.latency(OpKind::Write), Some(Latency::Constant(20_000)));
        assert_eq!(s.latency(OpKind::Flush), Some(Latency::Constant(1_000_000)));
        assert_eq!(s.latency(OpKind::Discard), None);
        assert_eq!((s.channels, s.iops, s.bw, s.seed), (Some(8), Some(500_000), Some(3_000_000_000), None));
        assert_eq!(s.to_string(), "read:lognormal:80us:300us+write:20us+flush:1ms+channels:8+iops:500k+bw:3g");
    }

    #[test]
    fn every_form_round_trips_through_display() {
        let cases = [
            ("read:10us", "read:10us"),
            ("read:u:50us:150us", "read:uniform:50us:150us"),
            ("READ:Uniform:50US:0.15ms", "read:uniform:50us:150us"),
            ("read:ln:80us:300us", "read:lognormal:80us:300us"),
            ("discard:1.5ms+write:1500ns+flush:2s", "write:1500ns+flush:2s+discard:1500us"),
            ("read:1ns+channels:1024", "read:1ns+channels:1024"),
            ("iops:1500000", "iops:1500k"),
            ("bw:2.5g+iops:1.5m", "iops:1500k+bw:2500m"),
            ("bw:1t+iops:100m+seed:18446744073709551615", "iops:100m+bw:1t+seed:18446744073709551615"),
            ("read:10s", "read:10s"),
            ("write:0.000001ms", "write:1ns"),
        ];
        for (text, canon) in cases {
            let s = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(s.to_string(), canon, "{text}");
            assert_eq!(parse(canon).unwrap(), s, "{canon}");
            assert!(!canon.contains([',', '@', '=']), "{canon} fits the option syntax");
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors_naming_the_piece() {
        use TimingError as E;
        let p = |s: &str| s.to_string();
        assert_eq!(parse(""), Err(E::Empty));
        assert_eq!(parse("read:10us+reed:5us"), Err(E::Unknown { piece: p("reed:5us") }));
        assert_eq!(parse("read:10us+read:5us"), Err(E::Duplicate { piece: p("read:5us"), key: "read" }));
        assert_eq!(parse("iops:1k+iops:2k"), Err(E::Duplicate { piece: p("iops:2k"), key: "iops" }));
        assert!(matches!(parse("read"), Err(E::Shape { piece, .. }) if piece == "read"));
        assert!(matches!(parse("read:ln:80us"), Err(E::Shape { .. })));
        assert!(matches!(parse("read:gauss:80us:90us"), Err(E::Shape { .. })));
        assert!(matches!(parse("channels:8:9"), Err(E::Shape { .. })));
        assert!(matches!(parse("read:10"), Err(E::Number { value, .. }) if value == "10"));
        assert!(matches!(parse("read:10xs"), Err(E::Number { .. })));
        assert!(matches!(parse("read:0.5ns"), Err(E::Number { .. })));
        assert!(matches!(parse("read:1.us"), Err(E::Number { .. })));
        assert!(matches!(parse("read:-1us"), Err(E::Number { .. })));
        assert!(matches!(parse("read:99999999999999999999999s"), Err(E::Number { .. })));
        assert!(matches!(parse("read:0us"), Err(E::Range { .. })));
        assert!(matches!(parse("read:11s"), Err(E::Range { piece, .. }) if piece == "read:11s"));
        assert!(matches!(parse("read:u:2us:2us"), Err(E::Order { .. })));
        assert!(matches!(parse("read:ln:300us:80us"), Err(E::Order { .. })));
        assert!(matches!(parse("channels:0"), Err(E::Range { .. })));
        assert!(matches!(parse("channels:1025"), Err(E::Range { .. })));
        assert!(matches!(parse("channels:8k"), Err(E::Number { .. })));
        assert!(matches!(parse("iops:9"), Err(E::Range { .. })));
        assert!(matches!(parse("iops:101m"), Err(E::Range { .. })));
        assert!(matches!(parse("iops:1.5"), Err(E::Number { .. })));
        assert!(matches!(parse("bw:3"), Err(E::Range { .. })));
        assert!(matches!(parse("bw:3gb"), Err(E::Number { .. })));
        assert!(matches!(parse("seed:x"), Err(E::Number { .. })));
        assert!(matches!(parse("read:10us+"), Err(E::Unknown { piece }) if piece.is_empty()));
        // The message names the piece.
        assert!(parse("read:10us+write:0us").unwrap_err().to_string().contains("\"write:0us\""));
    }

    #[test]
    fn lognormal_parameters_are_exact() {
        let (mu, sigma) = Latency::LogNormal { p50: 80_000, p99: 300_000 }.lognormal_params().unwrap();
        assert!((mu - 80_000f64.ln()).abs() < 1e-12);
        assert!((sigma - (300.0f64 / 80.0).ln() / 2.326_347_874_040_840_8).abs() < 1e-12);
        // exp(mu + sigma * z99) is the p99 back.
        assert!(((mu + sigma * Z_99).exp() - 300_000.0).abs() < 1e-6);
    }
}
