//! `bench blk`'s command line (see `crate::args`).

use super::BlkOptions;
use crate::args::{parse_bs, parse_runtime, parse_size_mb, size_fits_backend, FioFormat, Output};
use clap::Args;

/// `bench blk`: seq/rand read/write for throughput (128 KiB at --iodepth) and
/// latency (4 KiB at QD1) on each target, interleaved round by round.
#[derive(Args, Debug)]
pub struct BlkArgs {
    /// Targets, comma-separated (default: all): nvme-mmio, nvme-shm, nvme-bar, virtio-exit,
    /// virtio-ioeventfd, virtio-poll, virtio@vfio-user, vhost-user, qemu-virtio-blk-pci,
    /// qemu-vhost-user-blk-pci.
    #[arg(long)]
    pub targets: Option<String>,
    /// The backend every target stands on: null, ram, or file:PATH (QEMU: null-co, a /dev/shm image, the file;
    /// PATH an existing file of at least 1 MiB or a block device, a missing one only with --create).
    #[arg(long, default_value = "null")]
    pub backend: String,
    /// With --backend file:PATH: make PATH if it is missing (--size-mb),
    /// every byte written before it is measured (as fio lays out its files).
    /// Without it a missing PATH is an error; an existing file or block
    /// device is never created over, truncated or extended.
    #[arg(long)]
    pub create: bool,
    /// Disk size in MiB (null and ram backends, and the file --create lays out; default 64).
    #[arg(long, visible_alias = "size_mb", value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub size_mb: Option<u64>,
    /// The disk size as fio's size (whole MiB: 64m, 1g), instead of --size-mb.
    #[arg(long, value_parser = parse_size_mb, conflicts_with = "size_mb")]
    pub size: Option<u64>,
    /// Queue depth of the throughput jobs (1..=64; the latency jobs run at 1).
    #[arg(long, default_value_t = BlkOptions::default().tput_qd, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub iodepth: u32,
    /// Block size of every job (512 .. 128k, a multiple of 512; fio's suffixes).
    /// Without it: 128k for the throughput jobs, 4k for the latency jobs.
    #[arg(long, value_parser = parse_bs)]
    pub bs: Option<u64>,
    /// Length of each run: seconds, or with a suffix (500ms, 2s, 1m).
    #[arg(long, alias = "time", value_parser = parse_runtime, default_value_t = BlkOptions::default().time_ms as f64 / 1000.0)]
    pub runtime: f64,
    /// Rounds; each round runs every target once per job (interleaved).
    #[arg(long, default_value_t = BlkOptions::default().rounds)]
    pub rounds: u32,
    /// A short run: 1 round of 0.3 s runs.
    #[arg(long, conflicts_with_all = ["rounds", "runtime"])]
    pub quick: bool,
    /// The target the ratio column divides by.
    #[arg(long, default_value_t = crate::blk::DEFAULT_REFERENCE.to_string())]
    pub reference: String,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = BlkOptions::default().mem_mb)]
    pub mem: u64,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = BlkOptions::default().timeout_s)]
    pub timeout: u64,
    /// Thread placement (see `bench nvme --pin`): auto, off, or VCPU,DEVICE.
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: crate::pin::PinChoice,
    #[command(flatten)]
    pub format: FioFormat,
    #[command(flatten)]
    pub out: Output,
}

impl BlkArgs {
    pub fn options(&self) -> anyhow::Result<BlkOptions> {
        let d = BlkOptions::default();
        let backend = self.backend.parse()?;
        let size_mb = self.size.or(self.size_mb);
        size_fits_backend(size_mb, &backend)?;
        Ok(BlkOptions {
            targets: match &self.targets {
                Some(t) => crate::blk::parse_targets(t).map_err(|e| anyhow::anyhow!("--targets: {e}"))?,
                None => d.targets.clone(),
            },
            backend,
            size_mb: size_mb.unwrap_or(d.size_mb),
            tput_bs: self.bs.unwrap_or(d.tput_bs),
            lat_bs: self.bs.unwrap_or(d.lat_bs),
            tput_qd: self.iodepth,
            time_ms: if self.quick { 300 } else { (self.runtime * 1000.0).max(10.0) as u64 },
            rounds: if self.quick { 1 } else { self.rounds.max(1) },
            reference: match crate::blk::parse_targets(&self.reference) {
                Ok(t) if t.len() == 1 => t[0],
                _ => anyhow::bail!(
                    "--reference: {:?} is not one target of {}",
                    self.reference,
                    crate::blk::Target::all().iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
                ),
            },
            mem_mb: self.mem,
            timeout_s: self.timeout,
            progress: !self.out.quiet,
            pin: self.pin.placement(),
            ..d
        })
    }
}
