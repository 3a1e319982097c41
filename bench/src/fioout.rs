//! fio's JSON output format (`--output-format=json|json+`), written for the
//! benches that run I/O (`bench nvme`, `bench blk`, `bench spdk`) so that
//! the scripts and tools that read fio's output read theirs: `jobs[]`, each
//! with `jobname`, `groupid`, `job options`, and `read` / `write` / `trim`
//! objects (`iops`, `bw` in KiB/s, `bw_bytes`, `io_bytes`, `runtime` in ms,
//! `total_ios`, `slat_ns` / `clat_ns` / `lat_ns` {min, max, mean, stddev, N,
//! `percentile` {"99.000000": ns, ..}, json+ `bins` {"ns": count}}).
//!
//! One job per target and job of the bench (the rounds that stand, taken
//! together: their I/Os and windows added, their histograms merged), except
//! `bench spdk`, whose perf prints no histogram to merge: one job per run.
//! Only what was measured is given: the guest stamps a command once, before
//! it writes it, and again when it sees the completion, so there is no
//! separate submission latency (`slat_ns` is fio's empty one, N 0) and
//! `clat_ns` and `lat_ns` are that one measurement; a direction the job did
//! not run is fio's empty one (zeros, no percentiles). A randrw job fills
//! `read` and `write` apart, as fio does by default (the guest counts and
//! times them apart); a verify job, whose writes and reads back are phases
//! of one set, is reported as fio's `unified_rw_reporting=mixed` does, in
//! one `mixed` object. A stddev is the histogram's (bucket midpoints;
//! buckets up to 1/64 of their value wide), fio's own is of every latency.
//!
//! The header names iopath (`"iopath version"`), never fio: these are not
//! fio's measurements (the host's own fio rows of `bench nvme` excepted,
//! whose `clat_ns` iopath does not keep: N 0).

use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::BTreeMap;

/// fio's default latency percentiles (`percentile_list`).
pub const PERCENTILES: [f64; 17] =
    [1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99];

/// `--output-format`: fio's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The bench's own table.
    Normal,
    /// fio's JSON.
    Json,
    /// fio's JSON with the latency histograms (`bins`).
    JsonPlus,
}

/// The values `--output-format` takes, as its help lists them.
pub const FORMATS: [&str; 3] = ["normal", "json", "json+"];

/// An `--output-format` that is none of [`FORMATS`].
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an output format ({formats})", formats = FORMATS.join(", "))]
pub struct UnknownFormat(pub String);

impl std::str::FromStr for Format {
    type Err = UnknownFormat;
    fn from_str(s: &str) -> Result<Self, UnknownFormat> {
        match s {
            "normal" => Ok(Format::Normal),
            "json" => Ok(Format::Json),
            "json+" => Ok(Format::JsonPlus),
            _ => Err(UnknownFormat(s.to_string())),
        }
    }
}

/// fio's key of a percentile: six decimals ("99.900000").
pub fn percentile_key(p: f64) -> String {
    format!("{p:.6}")
}

/// A JSON object of numeric keys (percentiles, bins) kept in numeric order,
/// as fio prints them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NumMap(pub Vec<(String, u64)>);

impl Serialize for NumMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for NumMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let m = BTreeMap::<String, u64>::deserialize(d)?;
        let mut v: Vec<(String, u64)> = m.into_iter().collect();
        v.sort_by(|a, b| a.0.parse::<f64>().unwrap_or(f64::MAX).total_cmp(&b.0.parse::<f64>().unwrap_or(f64::MAX)));
        Ok(NumMap(v))
    }
}

/// fio's `slat_ns`, `clat_ns`, `lat_ns`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Lat {
    pub min: u64,
    pub max: u64,
    pub mean: f64,
    /// None where nothing measured it (spdk_nvme_perf prints none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stddev: Option<f64>,
    #[serde(rename = "N")]
    pub n: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percentile: Option<NumMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bins: Option<NumMap>,
}

impl Lat {
    /// fio's latency object of nothing measured.
    pub fn empty() -> Lat {
        Lat { stddev: Some(0.0), ..Lat::default() }
    }
}

/// fio's `read`, `write`, `trim` or `mixed` object (the fields iopath measures).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Dir {
    pub io_bytes: u64,
    pub io_kbytes: u64,
    pub bw_bytes: u64,
    /// KiB/s.
    pub bw: u64,
    pub iops: f64,
    /// Milliseconds.
    pub runtime: u64,
    pub total_ios: u64,
    pub short_ios: u64,
    pub drop_ios: u64,
    pub slat_ns: Lat,
    pub clat_ns: Lat,
    pub lat_ns: Lat,
}

impl Dir {
    /// fio's object of a direction the job did not run.
    pub fn empty() -> Dir {
        Dir { slat_ns: Lat::empty(), clat_ns: Lat::empty(), lat_ns: Lat::empty(), ..Dir::default() }
    }
}

/// One job of fio's `jobs[]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Job {
    pub jobname: String,
    pub groupid: u32,
    /// An errno, as fio's: 0, or EIO (5) when I/Os failed.
    pub error: i32,
    #[serde(rename = "job options")]
    pub job_options: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<Dir>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write: Option<Dir>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trim: Option<Dir>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed: Option<Dir>,
    /// Milliseconds.
    pub job_runtime: u64,
    /// iopath's: the rounds this job's figures come from (bench spdk: the round).
    #[serde(rename = "iopath rounds", default, skip_serializing_if = "Option::is_none")]
    pub rounds: Option<u32>,
    #[serde(rename = "iopath round", default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
}

/// The whole output.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Output {
    #[serde(rename = "iopath version")]
    pub iopath_version: String,
    pub timestamp: u64,
    pub timestamp_ms: u64,
    /// Ctrl-C stopped the bench: the runs measured before it.
    #[serde(rename = "iopath partial")]
    pub partial: bool,
    pub jobs: Vec<Job>,
}

impl Output {
    pub fn new(jobs: Vec<Job>, partial: bool) -> Output {
        let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Output {
            iopath_version: format!("iopath-{}", env!("CARGO_PKG_VERSION")),
            timestamp: ms / 1000,
            timestamp_ms: ms,
            partial,
            jobs,
        }
    }
}

/// What a target measured for one job: its I/Os, bytes and window, and its
/// latencies, from which a [`Dir`] is made.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub ios: u64,
    pub bytes: u64,
    /// The timed windows' length, in seconds.
    pub secs: f64,
    pub lat: Option<LatFigures>,
}

/// Latency figures in ns.
#[derive(Clone, Debug, Default)]
pub struct LatFigures {
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    pub stddev: Option<f64>,
    /// (percent, ns), ascending.
    pub percentiles: Vec<(f64, f64)>,
    /// (ns, count), for json+; empty where there is no histogram.
    pub bins: Vec<(u64, u64)>,
    /// Whether `clat_ns` is this measurement too (a guest's or perf's
    /// submission-to-completion time), or not measured (fio's own rows).
    pub is_clat: bool,
}

/// The latency object of `f` over `n` I/Os.
fn lat_of(f: &LatFigures, n: u64, plus: bool) -> Lat {
    let r = |v: f64| if v.is_finite() && v > 0.0 { v.round() as u64 } else { 0 };
    // fio's min and max are whole ns: the measured range rounded outwards,
    // so that min <= mean <= max still holds.
    let (lo, hi) = (|v: f64| r(v.floor()), |v: f64| r(v.ceil()));
    let mut bins: BTreeMap<u64, u64> = BTreeMap::new();
    for &(ns, c) in &f.bins {
        let e = bins.entry(ns).or_insert(0);
        *e = e.saturating_add(c);
    }
    Lat {
        min: lo(f.min),
        max: hi(f.max),
        mean: if f.mean.is_finite() { f.mean } else { 0.0 },
        stddev: f.stddev.filter(|s| s.is_finite()),
        n,
        percentile: (!f.percentiles.is_empty())
            .then(|| NumMap(f.percentiles.iter().map(|&(p, ns)| (percentile_key(p), r(ns))).collect())),
        bins: (plus && !bins.is_empty()).then(|| NumMap(bins.into_iter().map(|(k, c)| (k.to_string(), c)).collect())),
    }
}

impl Measured {
    /// fio's object of these I/Os (`plus`: with `bins`).
    pub fn dir(&self, plus: bool) -> Dir {
        let secs = if self.secs.is_finite() && self.secs > 0.0 { self.secs } else { 0.0 };
        let per_s = |v: f64| if secs > 0.0 { v / secs } else { 0.0 };
        let bw_bytes = per_s(self.bytes as f64).round() as u64;
        let (clat_ns, lat_ns) = match &self.lat {
            Some(f) if self.ios > 0 => {
                let l = lat_of(f, self.ios, plus);
                (if f.is_clat { l.clone() } else { Lat::empty() }, l)
            }
            _ => (Lat::empty(), Lat::empty()),
        };
        Dir {
            io_bytes: self.bytes,
            io_kbytes: self.bytes / 1024,
            bw_bytes,
            bw: bw_bytes / 1024,
            iops: per_s(self.ios as f64),
            runtime: (secs * 1000.0).round() as u64,
            total_ios: self.ios,
            short_ios: 0,
            drop_ios: 0,
            slat_ns: Lat::empty(),
            clat_ns,
            lat_ns,
        }
    }
}

/// What a job measured, by the fio objects it fills.
#[derive(Clone, Copy, Debug)]
pub enum Figures<'a> {
    Read(&'a Measured),
    Write(&'a Measured),
    /// Reads and writes counted apart (randrw): fio's `read` and `write`.
    Split {
        read: &'a Measured,
        write: &'a Measured,
    },
    /// Reads and writes not counted apart (verify's write and read-back
    /// phases): fio's `mixed`.
    Mixed(&'a Measured),
}

impl<'a> Figures<'a> {
    /// The objects a job of `rw` fills: `all` (its every I/O) in `read` or
    /// `write`; a randrw job's reads and writes apart where `split` has
    /// them, else (and a verify job) `all` as `mixed`.
    pub fn of(rw: &str, verify: bool, all: &'a Measured, split: Option<(&'a Measured, &'a Measured)>) -> Figures<'a> {
        match (rw, split) {
            _ if verify => Figures::Mixed(all),
            ("read" | "randread", _) => Figures::Read(all),
            ("write" | "randwrite", _) => Figures::Write(all),
            (_, Some((read, write))) => Figures::Split { read, write },
            _ => Figures::Mixed(all),
        }
    }
}

/// A job of fio's output: the figures in their objects, the others fio's
/// empty ones (none beside `mixed`, as fio's `unified_rw_reporting=mixed`).
/// A randrw direction without I/O (rwmixread 0 or 100) is fio's empty one.
pub fn job(
    jobname: &str,
    groupid: u32,
    mut options: BTreeMap<String, String>,
    figures: Figures,
    errors: u64,
    plus: bool,
) -> Job {
    let mut j = Job { jobname: jobname.into(), groupid, error: if errors > 0 { 5 } else { 0 }, ..Job::default() };
    let (e, dir) = (Dir::empty, |m: &Measured| m.dir(plus));
    match figures {
        Figures::Mixed(m) => {
            options.insert("unified_rw_reporting".into(), "mixed".into());
            j.mixed = Some(dir(m));
        }
        Figures::Read(m) => (j.read, j.write, j.trim) = (Some(dir(m)), Some(e()), Some(e())),
        Figures::Write(m) => (j.read, j.write, j.trim) = (Some(e()), Some(dir(m)), Some(e())),
        Figures::Split { read, write } => {
            let some = |m: &Measured| if m.ios > 0 { dir(m) } else { e() };
            (j.read, j.write, j.trim) = (Some(some(read)), Some(some(write)), Some(e()));
        }
    }
    j.job_runtime = [&j.read, &j.write, &j.mixed].into_iter().flatten().map(|d| d.runtime).max().unwrap_or(0);
    j.job_options = options;
    j
}

/// A block size as fio's job options give it ("4k", "512").
pub fn bs_text(bs: u64) -> String {
    if bs.is_multiple_of(1024) {
        format!("{}k", bs / 1024)
    } else {
        bs.to_string()
    }
}

/// Latency figures from a guest histogram `h` (merged over rounds) at
/// `tsc_khz`, with its min, max and mean (ns) from the guest's records.
pub fn lat_from_hist(h: &crate::nvme::LatHist, tsc_khz: u64, min: f64, max: f64, mean: f64) -> LatFigures {
    let ns = |c: f64| crate::stats::ns(c, tsc_khz);
    let (mut n, mut sum, mut sq) = (0f64, 0f64, 0f64);
    let mut bins = Vec::new();
    for (&b, &c) in &h.counts {
        let (lo, hi) = crate::nvme::hist::edges(b);
        let mid = ns((lo + hi) / 2.0);
        (n, sum, sq) = (n + c as f64, sum + mid * c as f64, sq + mid * mid * c as f64);
        bins.push((mid.round() as u64, c));
    }
    // One I/O has no spread (fio: 0).
    let stddev = (n > 0.0).then(|| if n > 1.0 { ((sq - sum * sum / n) / (n - 1.0)).max(0.0).sqrt() } else { 0.0 });
    LatFigures {
        min,
        max,
        mean,
        stddev,
        // Within the measured range (a bucket's interpolated value may fall
        // past its run's shortest or longest latency).
        percentiles: PERCENTILES
            .iter()
            .map(|&p| (p, h.quantile_ns(p / 100.0, tsc_khz)))
            .map(|(p, v)| (p, if max > 0.0 && max >= min { v.clamp(min, max) } else { v }))
            .collect(),
        bins,
        is_clat: true,
    }
}

/// The output as fio prints it (pretty JSON and a newline).
pub fn to_text(o: &Output) -> String {
    let mut s = serde_json::to_string_pretty(o).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::LatHist;

    fn measured() -> Measured {
        // 1000 I/Os of 4 KiB in 0.5 s: 2000 IOPS, 8192000 B/s.
        let h = LatHist::from_ns_points(&[(1000, 900), (5000, 99), (100_000, 1)], 1_000_000);
        Measured {
            ios: 1000,
            bytes: 4096 * 1000,
            secs: 0.5,
            lat: Some(lat_from_hist(&h, 1_000_000, 990.0, 100_500.0, 1_600.0)),
        }
    }

    #[test]
    fn a_read_job_fills_read_and_leaves_write_and_trim_empty_as_fio() {
        let j = job("iopath-shm", 0, BTreeMap::new(), Figures::Read(&measured()), 0, false);
        let v = serde_json::to_value(&j).unwrap();
        let r = &v["read"];
        assert_eq!((r["total_ios"].as_u64(), r["iops"].as_f64()), (Some(1000), Some(2000.0)));
        assert_eq!(
            (r["bw_bytes"].as_u64(), r["bw"].as_u64(), r["runtime"].as_u64()),
            (Some(8192000), Some(8000), Some(500))
        );
        assert_eq!((r["io_bytes"].as_u64(), r["io_kbytes"].as_u64()), (Some(4096000), Some(4000)));
        let p = &r["clat_ns"]["percentile"];
        assert_eq!(p.as_object().unwrap().len(), PERCENTILES.len());
        // 900 of 1000 at ~1000 ns: p50 within that bucket (1/64 wide), p99.9 past 5000.
        let p50 = p["50.000000"].as_u64().unwrap();
        assert!((960..=1070).contains(&p50), "{p50}");
        assert!(p["99.990000"].as_u64().unwrap() > 90_000);
        assert_eq!(r["lat_ns"], r["clat_ns"], "one measurement");
        assert_eq!(
            (r["lat_ns"]["min"].as_u64(), r["lat_ns"]["max"].as_u64(), r["lat_ns"]["N"].as_u64()),
            (Some(990), Some(100500), Some(1000))
        );
        assert!(r["lat_ns"].get("bins").is_none(), "json, not json+");
        assert_eq!(r["slat_ns"]["N"].as_u64(), Some(0));
        for d in ["write", "trim"] {
            assert_eq!(v[d]["total_ios"].as_u64(), Some(0), "{d}");
            assert!(v[d]["clat_ns"].get("percentile").is_none(), "{d}");
        }
        assert!(v.get("mixed").is_none());
        assert_eq!(v["error"].as_i64(), Some(0));
    }

    #[test]
    fn json_plus_bins_add_up_to_the_ios_and_mixed_jobs_say_so() {
        let j = job("t", 1, BTreeMap::new(), Figures::Write(&measured()), 3, true);
        let bins = j.write.as_ref().unwrap().clat_ns.bins.as_ref().unwrap();
        assert_eq!(bins.0.iter().map(|b| b.1).sum::<u64>(), 1000);
        let keys: Vec<u64> = bins.0.iter().map(|b| b.0.parse().unwrap()).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
        assert_eq!(j.error, 5);
        let all = measured();
        let m = job("t", 0, BTreeMap::new(), Figures::of("randwrite", true, &all, None), 0, false);
        assert!(m.read.is_none() && m.write.is_none() && m.mixed.is_some(), "verify: one set");
        assert_eq!(m.job_options["unified_rw_reporting"], "mixed");
        assert!(matches!(Figures::of("randrw", false, &all, None), Figures::Mixed(_)), "not counted apart");
        assert!(matches!(Figures::of("randrw", false, &all, Some((&all, &all))), Figures::Split { .. }));
        assert!(matches!(Figures::of("randread", false, &all, Some((&all, &all))), Figures::Read(_)));
        assert!(matches!(Figures::of("write", false, &all, None), Figures::Write(_)));
    }

    /// `n` I/Os of 4 KiB in 0.5 s, at about `ns` each.
    fn measured_at(n: u64, ns: u64) -> Measured {
        let h = LatHist::from_ns_points(&[(ns, n - n / 10), (ns * 4, n / 10)], 1_000_000);
        let lat = lat_from_hist(&h, 1_000_000, ns as f64 * 0.97, ns as f64 * 4.1, ns as f64 * 1.3);
        Measured { ios: n, bytes: 4096 * n, secs: 0.5, lat: Some(lat) }
    }

    #[test]
    fn a_randrw_job_fills_read_and_write_apart_as_fio_does_by_default() {
        // 700 reads near 2 us, 300 writes near 9 us, in the same 0.5 s window.
        let (r, w) = (measured_at(700, 2000), measured_at(300, 9000));
        let mut opts = BTreeMap::new();
        opts.insert("rwmixread".to_string(), "70".to_string());
        let j = job("iopath-shm", 0, opts, Figures::of("randrw", false, &measured(), Some((&r, &w))), 0, true);
        assert!(j.mixed.is_none() && !j.job_options.contains_key("unified_rw_reporting"));
        let v = serde_json::to_value(&j).unwrap();
        for (d, n, ns) in [("read", 700u64, 2000u64), ("write", 300, 9000)] {
            let x = &v[d];
            assert_eq!((x["total_ios"].as_u64(), x["iops"].as_f64()), (Some(n), Some(n as f64 * 2.0)), "{d}");
            assert_eq!((x["io_bytes"].as_u64(), x["bw_bytes"].as_u64()), (Some(4096 * n), Some(8192 * n)), "{d}");
            assert_eq!((x["runtime"].as_u64(), x["lat_ns"]["N"].as_u64()), (Some(500), Some(n)), "{d}");
            let p: Vec<u64> =
                PERCENTILES.iter().map(|&q| x["clat_ns"]["percentile"][percentile_key(q)].as_u64().unwrap()).collect();
            assert!(p.windows(2).all(|w| w[0] <= w[1]), "{d}: {p:?}");
            assert!(p[6] >= ns * 9 / 10 && p[6] <= ns * 11 / 10, "{d}: p50 {} of {ns}", p[6]);
            let bins = x["clat_ns"]["bins"].as_object().unwrap();
            assert_eq!(bins.values().map(|c| c.as_u64().unwrap()).sum::<u64>(), n, "{d}");
            assert_eq!(x["lat_ns"], x["clat_ns"], "{d}: one measurement");
        }
        assert_eq!((v["trim"]["total_ios"].as_u64(), v["job_runtime"].as_u64()), (Some(0), Some(500)));
        // rwmixread 100: no writes, and the write object is fio's empty one.
        let none = Measured { ios: 0, bytes: 0, secs: 0.5, lat: None };
        let j = job("t", 0, BTreeMap::new(), Figures::Split { read: &r, write: &none }, 0, true);
        assert_eq!(j.write, Some(Dir::empty()));
        assert_eq!(j.read.as_ref().map(|d| d.total_ios), Some(700));
    }

    #[test]
    fn it_reads_back_what_it_writes_and_reads_fios_own_output() {
        let o = Output::new(vec![job("a", 0, BTreeMap::new(), Figures::Read(&measured()), 0, true)], false);
        let back: Output = serde_json::from_str(&to_text(&o)).unwrap();
        assert_eq!(back, o);
        // fio 3.33's own JSON (trimmed; a warning line before it): the same types read it.
        let text = include_str!("testdata/fio-randread.json");
        let fio: Output = serde_json::from_str(&text[text.find('{').unwrap()..]).unwrap();
        let r = fio.jobs[0].read.as_ref().unwrap();
        assert_eq!((r.total_ios, r.lat_ns.n, r.lat_ns.min), (191129, 191129, 64556));
        let p = r.lat_ns.percentile.as_ref().unwrap();
        assert_eq!((p.0[0].0.as_str(), p.0[6].1), ("1.000000", 432128), "numeric order");
        assert_eq!(fio.jobs[0].job_options["iodepth"], "32");
        assert_eq!(percentile_key(99.9), "99.900000");
        assert_eq!("json+".parse::<Format>(), Ok(Format::JsonPlus));
        assert!("xml".parse::<Format>().is_err());
    }
}
