//! The benches' command-line options (`iopath bench ...`), declared once,
//! here, next to the options they become: each bench's clap arguments
//! (`exits::ExitsArgs`, `nvme::NvmeArgs`, `blk::BlkArgs`, `spdk::SpdkArgs`,
//! [`FloorArgs`]; the guard's [`crate::guard::GuardConfig`] is its own),
//! with their names (fio's where fio has one), help, defaults and checks,
//! and what they resolve to (`options()`: lists split and each value taken
//! once, `--quick` applied). A default the options' own `Default` has too is
//! taken from it; `bench nvme`'s are the command line's own
//! (`NvmeOptions::default()`, the base of `bench all`'s matrix, runs 1 round
//! with a 120 s timeout, unpinned). The CLI only names the subcommands.
//! Here: what several benches share.

use crate::floor::{FloorOptions, DEPTHS};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum, PartialEq, Debug)]
pub enum Peer {
    /// QEMU + KVM with its own devices, same guest image, interleaved.
    Qemu,
}

/// Options every benchmark has.
#[derive(Args, Debug)]
pub struct Output {
    /// Write the results as JSON to PATH ("-" for standard output).
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// No progress lines: the table only (nothing but the JSON with --json -).
    #[arg(long, short)]
    pub quiet: bool,
}

/// `--output-format` of the benches that run I/O (fio's option).
#[derive(Args, Debug)]
pub struct FioFormat {
    /// normal: the table; json, json+: fio's JSON on standard output (json+ with
    /// the latency histograms' bins), the table on standard error (none with --quiet).
    #[arg(long = "output-format", visible_alias = "output_format", default_value = "normal",
          value_parser = clap::builder::TypedValueParser::map(
              clap::builder::PossibleValuesParser::new(crate::fioout::FORMATS),
              |s| s.parse::<crate::fioout::Format>().unwrap_or(crate::fioout::Format::Normal)))]
    pub output_format: crate::fioout::Format,
}

impl FioFormat {
    /// Refuses `--json -` beside fio's JSON: both would go to standard output.
    pub fn check(&self, out: &Output) -> anyhow::Result<()> {
        if self.output_format != crate::fioout::Format::Normal && out.json.as_deref() == Some(std::path::Path::new("-"))
        {
            anyhow::bail!("--json - and --output-format json both write to standard output: give --json a file");
        }
        Ok(())
    }
}

/// A list option's values, each once, in the order given: a value given
/// twice would run the same target twice under one name. `key` is how the
/// option spells a value.
pub fn each_once<T, K: PartialEq + std::fmt::Display>(
    opt: &str,
    v: Vec<T>,
    key: impl Fn(&T) -> K,
) -> anyhow::Result<Vec<T>> {
    for (i, x) in v.iter().enumerate() {
        if v[..i].iter().any(|y| key(y) == key(x)) {
            anyhow::bail!("{opt} {} given twice", key(x));
        }
    }
    if v.is_empty() {
        anyhow::bail!("{opt}: no value");
    }
    Ok(v)
}

#[derive(Args, Debug)]
pub struct FloorArgs {
    /// Rounds.
    #[arg(long, default_value_t = FloorOptions::default().rounds)]
    pub rounds: u32,
    /// Milliseconds per queue depth and round.
    #[arg(long, default_value_t = FloorOptions::default().time_ms, value_name = "T")]
    pub time_ms: u64,
    /// One queue depth instead of 1, 16 and 64.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub iodepth: Option<u32>,
    /// A short run: 1 round of 100 ms per queue depth.
    #[arg(long, conflicts_with_all = ["rounds", "time_ms"])]
    pub quick: bool,
    /// Thread placement: auto (submitter on the first allowed CPU, poller on
    /// the next), off (the scheduler's), or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: crate::pin::PinChoice,
    #[command(flatten)]
    pub out: Output,
}

impl FloorArgs {
    // `..default()` sets whatever fields FloorOptions gains later.
    #[allow(clippy::needless_update)]
    pub fn options(&self) -> FloorOptions {
        FloorOptions {
            depths: self.iodepth.map_or(DEPTHS.to_vec(), |d| vec![d]),
            rounds: if self.quick { 1 } else { self.rounds.max(1) },
            time_ms: if self.quick { 100 } else { self.time_ms.max(1) },
            cpus: self.pin.placement().map(|p| p.pair()),
            progress: !self.out.quiet,
            ..FloorOptions::default()
        }
    }
}

/// A size as fio writes one: a number of bytes with an optional binary
/// suffix (k, kb, kib = 1024; m, mb, mib = 1024^2; g, gb, gib = 1024^3), any case.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, suffix) = t.split_at(digits);
    let n: u64 = n.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512, 4k, 64k)"))?;
    let unit: u64 = match suffix {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown size suffix {suffix:?} (k, m, g)")),
    };
    n.checked_mul(unit).ok_or_else(|| format!("{s:?} is too large"))
}

/// `--size`: fio's size, in whole MiB (1 MiB .. 1 TiB).
pub fn parse_size_mb(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v == 0 || !v.is_multiple_of(1 << 20) || v > 1 << 40 {
        return Err(format!("{s:?} = {v} bytes: the size must be whole MiB (e.g. 64m, 1g), 1m .. 1024g"));
    }
    Ok(v >> 20)
}

/// `--size` is a null or ram disk's size, or the size of the file `--create`
/// lays out: with an existing file the namespace is the whole file, and a
/// size given there would be ignored, so it is an error.
pub fn size_fits_backend(size_mb: Option<u64>, backend: &iopath_devices::block::StorageKind) -> anyhow::Result<()> {
    if let (Some(_), iopath_devices::block::StorageKind::File(p)) = (size_mb, backend) {
        if p.exists() {
            anyhow::bail!(
                "--size: {} exists, and its namespace is the whole file or device; a size applies to a null or \
                 ram backend, or to a missing file that --create lays out",
                p.display()
            );
        }
    }
    Ok(())
}

/// `--bs`: a size nvmeperf can issue: 512 .. 128 KiB (the controller's MDTS), a multiple of 512.
pub fn parse_bs(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if !(512..=131_072).contains(&v) || !v.is_multiple_of(512) {
        return Err(format!("{s:?} = {v} bytes: the block size must be 512 .. 131072 (128k), a multiple of 512"));
    }
    Ok(v)
}

/// `--runtime`: seconds, or a number with ms, s or m (fio's time suffixes); 0.01 .. 3600 s.
pub fn parse_runtime(s: &str) -> Result<f64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t.as_str(), 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("{s:?} is not a run time (e.g. 2, 500ms, 10s)"))?;
    let secs = v * scale;
    if !(0.01..=3600.0).contains(&secs) {
        return Err(format!("{s:?}: the run time must be 10ms .. 3600s"));
    }
    Ok(secs)
}
