//! `bench exits`'s command line (see `crate::args`).

use super::ExitsOptions;
use crate::args::{each_once, Output, Peer};
use crate::guard::GuardConfig;
use clap::Args;

#[derive(Args, Debug)]
pub struct ExitsArgs {
    /// Also run the same workload on this peer, in the same run, interleaved.
    #[arg(long, value_enum)]
    pub vs: Option<Peer>,
    /// Rounds; each round runs every target once (A/B interleaving).
    #[arg(long, default_value_t = ExitsOptions::default().rounds)]
    pub rounds: u32,
    /// Timed batches per row and round (1..=64).
    #[arg(long, default_value_t = ExitsOptions::default().batches, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub batches: u32,
    /// Target length of one batch, in microseconds.
    #[arg(long, default_value_t = ExitsOptions::default().batch_us)]
    pub batch_us: u64,
    /// Only rows whose names start with one of these (comma-separated).
    #[arg(long)]
    pub only: Option<String>,
    /// Skip the bare KVM_RUN floor.
    #[arg(long)]
    pub no_floor: bool,
    /// Seconds one guest run may take before it is stopped.
    #[arg(long, default_value_t = ExitsOptions::default().timeout_s)]
    pub timeout: u64,
    /// A short run: 1 round, 5 batches of 5 ms.
    #[arg(long, conflicts_with_all = ["rounds", "batches", "batch_us"])]
    pub quick: bool,
    /// Out-of-process transports to run pci-testdev over, comma-separated
    /// (mpqemu, vfio-user, ioregionfd, ioregionfd-posted), or "none".
    #[arg(long, default_value_t = ExitsOptions::default().transports.join(","))]
    pub transports: String,
    /// Poll a socket this long for a reply or request before sleeping
    /// (client and the device processes it starts); 0 sleeps at once, as QEMU.
    #[arg(long, default_value_t = ExitsOptions::default().spin_us, value_name = "US")]
    pub spin_us: u64,
    /// Run N busy threads (at most 64) during the measured runs, QEMU's included.
    #[arg(long, default_value_t = ExitsOptions::default().contend, value_name = "N")]
    pub contend: u32,
    /// Guest privilege levels to run the access loops at, comma-separated:
    /// 3 (ring 3, the default), 0 (ring 0), or 0,3 (both, with the r0/r3 ratio).
    /// The QEMU and device-process targets run at 3.
    #[arg(long, default_value = "3", value_delimiter = ',', value_parser = clap::value_parser!(u8).range(0..=3))]
    pub cpl: Vec<u8>,
    #[command(flatten)]
    pub guard: GuardConfig,
    #[command(flatten)]
    pub out: Output,
}

impl ExitsArgs {
    pub fn options(&self) -> anyhow::Result<ExitsOptions> {
        let (rounds, batches, batch_us) =
            if self.quick { (1, 5, 5000) } else { (self.rounds.max(1), self.batches, self.batch_us.max(10)) };
        let transports: Vec<String> = self
            .transports
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty() && *t != "none")
            .map(String::from)
            .collect();
        Ok(ExitsOptions {
            rounds,
            batches,
            batch_us,
            only: self.only.clone(),
            vs_qemu: self.vs == Some(Peer::Qemu),
            floor: !self.no_floor,
            timeout_s: self.timeout,
            progress: !self.out.quiet,
            // "none" alone is no transport; a list may not repeat one.
            transports: if transports.is_empty() {
                transports
            } else {
                each_once("--transports", transports, |t: &String| t.clone())?
            },
            spin_us: self.spin_us,
            contend: self.contend,
            cpls: each_once("--cpl", self.cpl.clone(), |&c| c)?,
            guard: self.guard,
            ..ExitsOptions::default()
        })
    }
}
