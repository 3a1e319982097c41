//! `bench spdk`'s command line (see `crate::args`).

use super::SpdkOptions;
use crate::args::{each_once, parse_bs, parse_size_mb, FioFormat, Output};
use clap::Args;
use std::path::PathBuf;

/// `bench spdk`: spdk_nvme_perf's jobs (one qpair each), every --rw x --bs x --iodepth.
#[derive(Args, Debug)]
pub struct SpdkArgs {
    /// perf's patterns, comma-separated: randread, randwrite, read, write.
    #[arg(long, default_value = "randread", value_delimiter = ',',
          value_parser = ["read", "write", "randread", "randwrite"])]
    pub rw: Vec<String>,
    /// Block sizes, comma-separated: bytes or with fio's suffixes (512 .. 128k, a multiple of the LBA).
    #[arg(long, default_value = "4k,512", value_delimiter = ',', value_parser = parse_bs)]
    pub bs: Vec<u64>,
    /// Queue depths, comma-separated (1..=1024).
    #[arg(long, default_value = "1,16,64,128", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub iodepth: Vec<u32>,
    /// Controller counts, comma-separated (1..=32): for each N, one `iopath serve --controllers N`
    /// process against one nvmf_tgt with N subsystems, perf driving all N (a qpair each at
    /// --iodepth) from its one core; the table adds each target's CPU per I/O.
    #[arg(long, default_value = "1", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=32))]
    pub controllers: Vec<u32>,
    /// Length of each perf run in whole seconds (perf's -t).
    #[arg(long, alias = "time", default_value_t = SpdkOptions::default().runtime_s, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub runtime: u64,
    /// Rounds; each runs every job against both targets (even rounds iopath first, odd rounds nvmf_tgt first).
    #[arg(long, default_value_t = SpdkOptions::default().rounds, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rounds: u32,
    /// A short run: 1 round of 1 s runs.
    #[arg(long, conflicts_with_all = ["rounds", "runtime"])]
    pub quick: bool,
    /// Namespace size in MiB, the same on both targets.
    #[arg(long, visible_alias = "size_mb", default_value_t = SpdkOptions::default().size_mb, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub size_mb: u64,
    /// The namespace size as fio's size (whole MiB: 64m, 1g), instead of --size-mb.
    #[arg(long, value_parser = parse_size_mb, conflicts_with = "size_mb")]
    pub size: Option<u64>,
    /// LBA size: 512 or 4096, the same on both targets.
    #[arg(long, default_value_t = SpdkOptions::default().lba,
          value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["512", "4096"]), |s| s.parse::<u32>().unwrap_or(512)))]
    pub lba: u32,
    /// iopath serve's doorbell mode (`doorbell=`); without it none is given: the controller's
    /// default, auto.
    #[arg(long, value_name = "MODE")]
    pub doorbell: Option<iopath_devices::nvme::DoorbellMode>,
    /// Where perf (-c) and the targets (iopath serve's affinity, nvmf_tgt's -m) run: auto (perf
    /// on the first allowed CPU, the targets on the second) or PERF,TARGET. SPDK pins its own
    /// threads, so there is no off.
    #[arg(long, default_value = "auto", value_name = "auto|PERF,TARGET")]
    pub pin: crate::pin::PinChoice,
    /// The SPDK install directory harness/spdk/build.sh printed (bin/spdk_nvme_perf, bin/nvmf_tgt,
    /// bin/rpc.py); default: run harness/spdk/build.sh of this source tree (cached; builds if missing).
    #[arg(long, value_name = "DIR")]
    pub spdk: Option<PathBuf>,
    #[command(flatten)]
    pub format: FioFormat,
    #[command(flatten)]
    pub out: Output,
}

impl SpdkArgs {
    pub fn options(&self) -> anyhow::Result<SpdkOptions> {
        use super::perf::PerfJob;
        use crate::pin::PinChoice;
        let pin = match self.pin {
            PinChoice::Off => anyhow::bail!(
                "--pin off: SPDK's perf and nvmf_tgt always pin their threads to the cores of their masks; give auto or PERF,TARGET"
            ),
            p => p.placement().ok_or_else(|| anyhow::anyhow!("--pin auto needs two CPUs this process may use"))?,
        };
        let rw = each_once("--rw", self.rw.clone(), |r| r.clone())?;
        let bs = each_once("--bs", self.bs.clone(), |&b| b)?;
        let qd = each_once("--iodepth", self.iodepth.clone(), |&q| q)?;
        let mut jobs = Vec::new();
        for rw in &rw {
            for &bs in &bs {
                jobs.extend(qd.iter().map(|&iodepth| PerfJob { rw: rw.clone(), bs, iodepth }));
            }
        }
        Ok(SpdkOptions {
            jobs,
            controllers: each_once("--controllers", self.controllers.clone(), |&n| n)?,
            runtime_s: if self.quick { 1 } else { self.runtime },
            rounds: if self.quick { 1 } else { self.rounds },
            size_mb: match self.size {
                Some(m) if m > 65536 => anyhow::bail!("--size: at most 64g (65536 MiB)"),
                Some(m) => m,
                None => self.size_mb,
            },
            lba: self.lba,
            doorbell: self.doorbell,
            pin,
            spdk: self.spdk.clone(),
            iopath_exe: None,
            progress: !self.out.quiet,
        })
    }
}
