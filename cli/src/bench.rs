//! `iopath bench [exits|nvme|blk|floor|spdk|reconnect|all]`: the subcommands. Each
//! bench's options are declared once, in the bench crate next to the
//! options they become (`iopath_bench::args`); `bench all`'s are here.

use clap::{Args, Subcommand};
pub use iopath_bench::args::{FloorArgs, Output};
pub use iopath_bench::blk::BlkArgs;
pub use iopath_bench::exits::ExitsArgs;
pub use iopath_bench::nvme::NvmeArgs;
pub use iopath_bench::reconnect::ReconnectArgs;
pub use iopath_bench::spdk::SpdkArgs;
use std::path::PathBuf;

/// `iopath bench`: with no subcommand, the exit-cost table (`bench exits`).
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchCmd {
    #[command(subcommand)]
    pub which: Option<Which>,
    #[command(flatten)]
    pub exits: ExitsArgs,
}

#[derive(Subcommand, Debug)]
pub enum Which {
    /// The exit-cost table: cpu, in-kernel, VMM exits, pci-testdev, doorbell round trips, transports.
    Exits(ExitsArgs),
    /// The guest's polled NVMe driver against iopath's NVMe controller (and QEMU's with --vs qemu).
    Nvme(Box<NvmeArgs>),
    /// One block workload on every path to a guest's disk: NVMe, virtio-blk (exit, ioeventfd,
    /// poll), vfio-user, vhost-user, QEMU's virtio-blk-pci and vhost-user-blk-pci, same backend.
    Blk(BlkArgs),
    /// The polled SQ/CQ ring between two host threads at QD 1/16/64: the floor under `bench nvme`.
    Floor(FloorArgs),
    /// SPDK's stock spdk_nvme_perf against `iopath serve nvme` (default doorbell mode) and against
    /// SPDK's own nvmf_tgt VFIOUSER target, side by side, rounds interleaved.
    Spdk(SpdkArgs),
    /// The pause each kill -9 of a device process causes the guest (NVMe over vfio-user in each
    /// resuming doorbell mode, virtio-blk over vhost-user), over --kills kills; file read back.
    Reconnect(ReconnectArgs),
    /// Every benchmark in its default matrix; writes report.md, results.json, results.csv and SVG plots to --out.
    All(AllArgs),
}

/// `iopath bench blk`: runs it and hands its table, JSON and fio's JSON (if
/// asked for) to `emit`; the exit status (1 if a target failed or a routing
/// check did not hold).
pub fn blk(
    a: &BlkArgs,
    emit: impl FnOnce(&str, &serde_json::Value, Option<iopath_bench::fioout::Output>) -> anyhow::Result<()>,
) -> anyhow::Result<i32> {
    use iopath_bench::fioout::Format;
    let o = a.options()?;
    a.format.check(&a.out)?;
    let bytes = iopath_bench::nvme::namespace_size(&o.backend, Some(o.size_mb));
    iopath_bench::backing::prepare(&o.backend, bytes, a.create)?;
    let r = iopath_bench::blk::run_blk(&o)?;
    let fio =
        (a.format.output_format != Format::Normal).then(|| r.fio_output(a.format.output_format == Format::JsonPlus));
    emit(&r.table(), &r.json(), fio)?;
    Ok(crate::status(&r.errors))
}

#[derive(Args, Debug)]
pub struct AllArgs {
    /// Directory for report.md, results.json, results.csv and the SVG plots (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// A short matrix: 1 round, short runs, the NVMe sweep at iodepths 1, 4, 16 (not 64).
    #[arg(long, conflicts_with_all = ["rounds"])]
    pub quick: bool,
    /// Rounds of every benchmark.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Leave QEMU out even where it is installed.
    #[arg(long)]
    pub no_qemu: bool,
    /// Only a few exit rows over one out-of-process transport, NVMe shm and
    /// mmio at iodepths 1 and 16 in the VMM and over vfio-user, and blk on two
    /// virtio-blk targets: a smoke run of the whole pipeline (tests use it).
    #[arg(long, requires = "quick")]
    pub smoke: bool,
    /// No progress bar, no tables: only the files.
    #[arg(long, short)]
    pub quiet: bool,
    /// Thread placement for nvme and floor (see `bench nvme --pin`).
    #[arg(long, default_value = "auto", value_name = "auto|off|VCPU,DEVICE")]
    pub pin: iopath_bench::pin::PinChoice,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use iopath_bench::args::{parse_runtime, parse_size};

    #[derive(Parser, Debug)]
    struct T {
        #[command(subcommand)]
        cmd: Top,
    }

    #[derive(clap::Subcommand, Debug)]
    enum Top {
        Bench(BenchCmd),
    }

    fn parse(args: &[&str]) -> Result<BenchCmd, clap::Error> {
        let mut v = vec!["iopath", "bench"];
        v.extend_from_slice(args);
        T::try_parse_from(v).map(|t| match t.cmd {
            Top::Bench(b) => b,
        })
    }

    fn nvme(args: &[&str]) -> NvmeArgs {
        let mut v = vec!["nvme"];
        v.extend_from_slice(args);
        match parse(&v).unwrap().which {
            Some(Which::Nvme(n)) => *n,
            w => panic!("not nvme: {w:?}"),
        }
    }

    #[test]
    fn exits_takes_cpl_lists_and_the_guards_budget() {
        let e = |args: &[&str]| {
            let mut v = vec!["exits"];
            v.extend_from_slice(args);
            match parse(&v).unwrap().which {
                Some(Which::Exits(e)) => e.options().unwrap(),
                w => panic!("not exits: {w:?}"),
            }
        };
        assert_eq!(e(&[]).cpls, vec![3]);
        assert_eq!(e(&["--cpl", "0,3"]).cpls, vec![0, 3]);
        let o = e(&["--reruns", "0", "--max-spread", "1.5"]);
        assert_eq!((o.guard.reruns, o.guard.max_spread, o.guard.min_floor_ratio), (0, 1.5, 0.95));
        let j = &nvme(&["--rw", "randrw", "--rwmixread", "70"]).options().unwrap().jobs[0];
        assert_eq!((j.rw.as_str(), j.rwmixread, j.label()), ("randrw", 70, "randrw 4k qd16 x1 70% reads".to_string()));
        assert!(parse(&["nvme", "--rwmixread", "101"]).is_err());
        let j = &nvme(&["--rw", "randrw", "--rwmix-read", "0"]).options().unwrap().jobs[0];
        assert_eq!(j.rwmixread, 0, "fio's spelling and the hyphenated one");
        let e = nvme(&["--rw", "randread", "--rwmixread", "70"]).options().unwrap_err();
        assert!(e.to_string().contains("--rw randrw"), "{e}");
        assert!(nvme(&["--rwmixread", "70"]).options().is_err(), "randread by default");
        let j = &nvme(&["--bs", "512", "--iodepth_batch_submit", "4"]).options().unwrap().jobs[0];
        assert_eq!((j.batch_submit, j.label()), (4, "randread 512 qd16 x1 batch 4".to_string()));
        let o = nvme(&["--backend", "file:/x", "--submit-batch", "0,1"]).options().unwrap();
        assert_eq!(o.submit_batch, [0, 1]);
        for bad in [
            &["--submit-batch", "1"][..],
            &["--backend", "file:/x", "--submit-batch", "257"],
            &["--backend", "file:/x", "--submit-batch", "1,1"],
        ] {
            assert!(nvme(bad).options().is_err(), "{bad:?}");
        }
        let n = nvme(&["--reruns", "1"]).options().unwrap();
        assert_eq!((n.guard.reruns, n.guard.max_spread), (1, 2.0));
        assert!(parse(&["exits", "--cpl", "7"]).is_err());
        assert!(parse(&["exits", "--reruns", "9"]).is_err());
    }

    #[test]
    fn list_options_take_each_value_once() {
        let o = nvme(&["--doorbell", "shm,adaptive", "--pollers", "1,2", "--forecast", "on,off"]).options().unwrap();
        assert_eq!((o.doorbells.len(), o.pollers, o.forecast), (2, vec![1, 2], vec![true, false]));
        assert_eq!(nvme(&["--transport", "vmm,vfio-user"]).options().unwrap().transports.len(), 2);
        assert_eq!(nvme(&["--contend", "2,0"]).options().unwrap().contend, vec![2, 0]);
        assert_eq!(nvme(&["--dbbuf", "0,1"]).options().unwrap().dbbuf, [false, true]);
        assert_eq!(nvme(&[]).options().unwrap().dbbuf, [true]);
        assert!(parse(&["nvme", "--dbbuf", "2"]).is_err());
        let o = nvme(&["--backend", "file:/x", "--in-place", "on,off"]).options().unwrap();
        assert_eq!(o.in_place, [iopath_devices::nvme::InPlace::On, iopath_devices::nvme::InPlace::Off]);
        let e = nvme(&["--in-place", "on"]).options().unwrap_err().to_string();
        assert!(e.contains("--backend file:PATH"), "{e}");
        assert!(nvme(&["--backend", "file:/x", "--in-place", "sometimes"]).options().is_err());
        let exits = |args: &[&str]| match parse(&[&["exits"], args].concat()).unwrap().which {
            Some(Which::Exits(e)) => e.options(),
            w => panic!("not exits: {w:?}"),
        };
        assert_eq!(exits(&["--cpl", "0,3"]).unwrap().cpls, vec![0, 3]);
        assert_eq!(exits(&["--cpl", "3,3"]).unwrap_err().to_string(), "--cpl 3 given twice");
        let e = exits(&["--transports", "mpqemu,vfio-user,mpqemu"]).unwrap_err().to_string();
        assert_eq!(e, "--transports mpqemu given twice");
        assert!(exits(&["--transports", "none"]).unwrap().transports.is_empty());
        for (opt, v, said) in [
            ("--doorbell", "shm,bar,shm", "--doorbell shm given twice"),
            ("--pollers", "2,2", "--pollers 2 given twice"),
            ("--forecast", "on,on", "--forecast on given twice"),
            ("--in-place", "off,auto,off", "--in-place off given twice"),
            ("--transport", "vfio-user,vmm,vfio-user", "--transport vfio-user given twice"),
            ("--contend", "0,0", "--contend 0 given twice"),
            ("--dbbuf", "1,1", "--dbbuf 1 given twice"),
            ("--doorbell", ",", "--doorbell: no value"),
        ] {
            let e = nvme(&[opt, v]).options().expect_err(v).to_string();
            assert_eq!(e, said);
        }
    }

    #[test]
    fn state_memory_is_a_list_for_a_transport_that_offers_it_and_refused_elsewhere() {
        use iopath_protocols::vfio_user::StateMemoryMode::{Off, On};
        assert_eq!(nvme(&[]).options().unwrap().state_memory, [On]);
        let o = nvme(&["--transport", "vfio-user", "--state-memory", "on,off"]).options().unwrap();
        assert_eq!(o.state_memory, [On, Off]);
        assert_eq!(
            nvme(&["--transport", "vmm,ioregionfd", "--state-memory", "off"]).options().unwrap().state_memory,
            [Off]
        );
        for t in ["vmm", "mpqemu"] {
            let e = nvme(&["--transport", t, "--state-memory", "on,off"]).options().unwrap_err().to_string();
            assert!(e.contains("--state-memory on,off") && e.contains("--transport vfio-user"), "{t}: {e}");
        }
        let e = nvme(&["--transport", "vfio-user", "--state-memory", "off,off"]).options().unwrap_err();
        assert_eq!(e.to_string(), "--state-memory off given twice");
        assert!(parse(&["nvme", "--state-memory", "maybe"]).is_err());
    }

    #[test]
    fn sizes_take_fio_suffixes() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert!(parse_size("4x").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999999999999k").is_err());
        assert_eq!(nvme(&["--bs", "64k"]).bs, Some(65536));
        assert_eq!(nvme(&["--bs", "512"]).bs, Some(512));
        // 1m is a size, but past the controller's 128 KiB transfer limit.
        assert!(parse(&["nvme", "--bs", "1m"]).is_err());
        assert!(parse(&["nvme", "--bs", "1000"]).is_err());
    }

    #[test]
    fn fio_spellings_and_hyphenated_ones_are_the_same_option() {
        for (a, b) in [
            ("--iodepth_batch_submit", "--iodepth-batch-submit"),
            ("--submit-batch", "--submit_batch"),
            ("--in-place", "--in_place"),
            ("--irq-wait", "--irq_wait"),
        ] {
            let value: &[&str] = match a {
                "--iodepth_batch_submit" => &["4"],
                "--submit-batch" => &["0,1"],
                "--in-place" => &["on"],
                _ => &[],
            };
            let args = |o: &'static str| [&["--backend", "file:/x", o][..], value].concat();
            let (x, y) = (nvme(&args(a)).options().unwrap(), nvme(&args(b)).options().unwrap());
            assert_eq!(format!("{:?}", x.jobs), format!("{:?}", y.jobs), "{a} {b}");
            assert_eq!((x.submit_batch, x.in_place), (y.submit_batch, y.in_place), "{a} {b}");
        }
        assert_eq!(nvme(&["--iodepth-batch-submit", "3"]).options().unwrap().jobs[0].batch_submit, 3);
        let blk = |args: &[&str]| match parse(&[&["blk"], args].concat()) {
            Ok(BenchCmd { which: Some(Which::Blk(b)), .. }) => b.options(),
            Ok(w) => panic!("not blk: {w:?}"),
            Err(e) => Err(anyhow::anyhow!("{e}")),
        };
        assert_eq!(blk(&["--size_mb", "32"]).unwrap().size_mb, 32);
        assert_eq!(blk(&["--size", "1g"]).unwrap().size_mb, 1024);
        assert!(blk(&["--size", "1g", "--size-mb", "3"]).is_err());
    }

    #[test]
    fn size_is_the_namespace_of_a_null_ram_or_created_disk_never_an_ignored_one() {
        assert_eq!(nvme(&["--size", "128m"]).options().unwrap().size_mb, Some(128));
        assert_eq!(nvme(&[]).options().unwrap().size_mb, None);
        for bad in ["100k", "0", "1m1", "2048g"] {
            assert!(parse(&["nvme", "--size", bad]).is_err(), "{bad}");
        }
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        // An existing file is its own size: --size there would be ignored.
        let f = std::env::temp_dir().join(format!("iopath-size-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        let backend = format!("file:{}", f.display());
        let e = nvme(&["--backend", &backend, "--size", "8m"]).options().unwrap_err().to_string();
        assert!(e.contains("exists"), "{e}");
        let blk = match parse(&["blk", "--backend", &backend, "--size-mb", "8"]).unwrap().which {
            Some(Which::Blk(b)) => b,
            w => panic!("{w:?}"),
        };
        assert!(blk.options().is_err());
        std::fs::remove_file(&f).unwrap();
        // A missing one (--create lays it out at that size) takes it.
        assert_eq!(nvme(&["--backend", &backend, "--size", "8m"]).options().unwrap().size_mb, Some(8));
    }

    #[test]
    fn blk_bs_is_every_jobs_block_size() {
        let b = match parse(&["blk", "--bs", "64k"]).unwrap().which {
            Some(Which::Blk(b)) => b.options().unwrap(),
            w => panic!("{w:?}"),
        };
        assert_eq!((b.tput_bs, b.lat_bs), (65536, 65536));
        assert!(b.jobs().iter().all(|j| j.job.bs == 65536 && j.name.contains("64k")));
        let d = match parse(&["blk"]).unwrap().which {
            Some(Which::Blk(b)) => b.options().unwrap(),
            w => panic!("{w:?}"),
        };
        assert_eq!((d.tput_bs, d.lat_bs), (128 << 10, 4096));
        assert!(parse(&["blk", "--bs", "256k"]).is_err());
    }

    #[test]
    fn runtime_takes_seconds_and_suffixes_and_time_is_its_alias() {
        assert_eq!(parse_runtime("2"), Ok(2.0));
        assert_eq!(parse_runtime("500ms"), Ok(0.5));
        assert_eq!(parse_runtime("1m"), Ok(60.0));
        assert!(parse_runtime("0").is_err());
        assert!(parse_runtime("fast").is_err());
        assert_eq!(nvme(&["--time", "0.3"]).options().unwrap().time_ms, 300);
        assert_eq!(nvme(&["--runtime", "750ms"]).options().unwrap().time_ms, 750);
    }

    #[test]
    fn numjobs_is_the_queue_count_and_queues_its_alias() {
        let o = nvme(&["--numjobs", "4"]).options().unwrap();
        assert_eq!(o.jobs.len(), 1);
        assert_eq!(o.jobs[0].queues, 4);
        assert_eq!(nvme(&["--queues", "2"]).numjobs, Some(2));
        assert!(parse(&["nvme", "--numjobs", "17"]).is_err());
    }

    #[test]
    fn quick_conflicts_with_an_explicit_runtime_or_rounds() {
        for extra in [&["--runtime", "3"][..], &["--time", "3"], &["--rounds", "2"]] {
            let mut a = vec!["nvme", "--quick"];
            a.extend_from_slice(extra);
            let e = parse(&a).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{a:?}");
        }
        let e = parse(&["exits", "--quick", "--batches", "3"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let e = parse(&["floor", "--quick", "--time-ms", "5"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
        let o = nvme(&["--quick"]).options().unwrap();
        assert_eq!((o.rounds, o.time_ms), (1, 500));
    }

    #[test]
    fn each_bench_takes_only_its_own_options() {
        // nvme has no exit-row options, exits no block size, floor neither.
        assert!(parse(&["nvme", "--transports", "vfio-user"]).is_err());
        assert!(parse(&["nvme", "--only", "cpuid"]).is_err());
        assert!(parse(&["nvme", "--batches", "3"]).is_err());
        assert!(parse(&["exits", "--bs", "4k"]).is_err());
        assert!(parse(&["floor", "--doorbell", "shm"]).is_err());
        assert!(parse(&["floor", "--vs", "qemu"]).is_err());
    }

    #[test]
    fn bare_bench_is_exits_with_its_options() {
        let b = parse(&["--quick", "--vs", "qemu"]).unwrap();
        assert!(b.which.is_none());
        let o = b.exits.options().unwrap();
        assert!(o.vs_qemu);
        assert_eq!((o.rounds, o.batches, o.batch_us), (1, 5, 5000));
        let o = parse(&["exits", "--transports", "none", "--quiet"]).unwrap();
        match o.which {
            Some(Which::Exits(e)) => {
                let o = e.options().unwrap();
                assert!(o.transports.is_empty());
                assert!(!o.progress);
            }
            w => panic!("{w:?}"),
        }
    }

    #[test]
    fn blk_takes_targets_a_backend_and_quick() {
        let blk = |args: &[&str]| {
            let mut v = vec!["blk"];
            v.extend_from_slice(args);
            match parse(&v).unwrap().which {
                Some(Which::Blk(b)) => b.options(),
                w => panic!("not blk: {w:?}"),
            }
        };
        let o = blk(&[]).unwrap();
        assert_eq!(
            (o.targets.len(), o.rounds, o.time_ms, o.tput_qd),
            (iopath_bench::blk::Target::all().len(), 3, 2000, 16)
        );
        assert_eq!(o.reference.to_string(), "virtio-ioeventfd");
        assert_eq!(o.backend.to_string(), "null");
        let o = blk(&["--quick", "--targets", "nvme-bar,virtio-poll", "--backend", "ram", "--iodepth", "8"]).unwrap();
        let names: Vec<String> = o.targets.iter().map(|t| t.to_string()).collect();
        assert_eq!((names, o.rounds, o.time_ms, o.tput_qd), (vec!["nvme-bar".into(), "virtio-poll".into()], 1, 300, 8));
        assert!(blk(&["--targets", "nvme-foo"]).unwrap_err().to_string().contains("nvme-foo"));
        let o = blk(&["--targets", "vhost-user,virtio@vfio-user,qemu-vhost-user-blk-pci"]).unwrap();
        let names: Vec<String> = o.targets.iter().map(|t| t.to_string()).collect();
        assert_eq!(names, ["vhost-user", "virtio@vfio-user", "qemu-vhost-user-blk-pci"], "the spellings users type");
        assert_eq!(blk(&["--reference", "nvme-bar"]).unwrap().reference.to_string(), "nvme-bar");
        assert!(blk(&["--reference", "nvme-bar,virtio-poll"]).is_err());
        assert!(blk(&["--reference", "qemu"]).is_err());
        assert!(parse(&["blk", "--quick", "--rounds", "2"]).is_err());
        assert!(parse(&["blk", "--iodepth", "65"]).is_err());
    }

    #[test]
    fn spdk_takes_lists_of_patterns_sizes_and_depths_and_no_unpinned_run() {
        let spdk = |args: &[&str]| match parse(&[&["spdk"], args].concat()) {
            Ok(BenchCmd { which: Some(Which::Spdk(s)), .. }) => s.options(),
            Ok(w) => panic!("not spdk: {w:?}"),
            Err(e) => Err(anyhow::anyhow!("{e}")),
        };
        let o = spdk(&["--pin", "0,1"]).unwrap();
        assert_eq!(o.jobs.len(), 8);
        assert_eq!((o.jobs[0].label(), o.jobs[7].label()), ("randread 4k qd1".into(), "randread 512 qd128".into()));
        assert_eq!((o.rounds, o.runtime_s, o.size_mb, o.lba, o.doorbell), (3, 2, 64, 512, None));
        let o = spdk(&["--pin", "0,1", "--doorbell", "bar"]).unwrap();
        assert_eq!(o.doorbell, Some(iopath_devices::nvme::DoorbellMode::Bar));
        assert!(spdk(&["--doorbell", "fast"]).is_err());
        let o =
            spdk(&["--pin", "1,0", "--quick", "--bs", "4k", "--iodepth", "16", "--rw", "randread,randwrite"]).unwrap();
        assert_eq!((o.rounds, o.runtime_s, o.jobs.len()), (1, 1, 2));
        assert_eq!((o.pin.vcpu, o.pin.device), (1, 0));
        assert!(spdk(&["--pin", "off"]).unwrap_err().to_string().contains("--pin off"));
        assert_eq!(spdk(&["--pin", "0,1", "--iodepth", "1,1"]).unwrap_err().to_string(), "--iodepth 1 given twice");
        assert!(spdk(&["--quick", "--rounds", "2"]).is_err());
        assert!(spdk(&["--rw", "randrw"]).is_err());
        assert!(spdk(&["--runtime", "0"]).is_err());
    }

    #[test]
    fn all_needs_a_directory_and_smoke_needs_quick() {
        assert!(parse(&["all"]).is_err());
        assert!(parse(&["all", "--out", "/tmp/x", "--smoke"]).is_err());
        assert!(parse(&["all", "--out", "/tmp/x", "--quick", "--rounds", "2"]).is_err());
        assert!(matches!(parse(&["all", "--out", "/tmp/x", "--quick", "--smoke"]).unwrap().which, Some(Which::All(_))));
    }
}
