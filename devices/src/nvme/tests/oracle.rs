//! The queue oracle (`nvme::oracle`) over random schedules, in every
//! doorbell mode, with one and two pollers, hosted as the VMM hosts the
//! controller and as a device process's client does.

use super::super::oracle::{Driver, LocalPort, Report, Rng, Shape};
use super::super::{DoorbellMode, NvmeConfig};
use crate::block::StorageKind;

const MODES: [DoorbellMode; 7] = [
    DoorbellMode::Auto,
    DoorbellMode::Mmio,
    DoorbellMode::Ioeventfd,
    DoorbellMode::Shm,
    DoorbellMode::Bar,
    DoorbellMode::Adaptive,
    DoorbellMode::BarAdaptive,
];

fn cfg(doorbell: DoorbellMode, pollers: u8, lba: u32) -> NvmeConfig {
    NvmeConfig { backend: StorageKind::Ram, size: 2 << 20, lba_size: lba, doorbell, pollers, ..NvmeConfig::default() }
}

/// A namespace on `backend` (0 ram, 1 a file, 2 null).
fn on(mut c: NvmeConfig, backend: u64, file: &std::path::Path) -> NvmeConfig {
    c.backend = match backend {
        0 => StorageKind::Ram,
        1 => StorageKind::File(file.to_path_buf()),
        _ => StorageKind::Null,
    };
    c.create = backend == 1;
    c
}

/// Runs `shape` from `seed` against a fresh controller; panics with the violation.
fn run(c: NvmeConfig, static_host: bool, seed: u64, shape: impl FnOnce(&mut Rng) -> Shape) -> Report {
    let port = LocalPort::new(c.clone(), static_host).unwrap();
    let mut rng = Rng::new(seed);
    let mut shape = shape(&mut rng);
    shape.data = c.backend != StorageKind::Null;
    // Out of process, ioeventfd and adaptive serve only drivers with shadow
    // doorbells (Create I/O SQ is refused otherwise: a test of its own).
    shape.shadow |= static_host && c.doorbell.kicked();
    match Driver::new(&port, rng, shape).run() {
        Ok(r) => r,
        Err(e) => panic!("{} pollers={} static={static_host} seed={seed}: {e}", c.doorbell, c.pollers),
    }
}

/// What injection the schedules met, summed.
#[derive(Default, Debug)]
struct Met {
    injected: u64,
    corrupted: u64,
    timed: u64,
}

impl Met {
    fn add(&mut self, r: Report) {
        self.injected += r.injected;
        self.corrupted += r.corrupted;
        self.timed += r.timed;
    }
}

/// Seeds per configuration: `IOPATH_ORACLE_SEEDS` for a longer campaign.
fn seeds() -> u64 {
    std::env::var("IOPATH_ORACLE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(12)
}

#[test]
fn the_driver_that_met_replayed_commands_sees_each_completion_once_in_every_mode() {
    for mode in MODES {
        for static_host in [false, true] {
            run(cfg(mode, 1, 512), static_host, 1, |_| Shape::replay_case(3000));
        }
    }
}

#[test]
fn several_sqs_on_a_small_cq_keep_their_held_commands_served_in_every_mode() {
    for mode in MODES {
        for seed in 0..4 {
            run(cfg(mode, 1, 512), seed % 2 == 1, 3000 + seed, |r| {
                let mut s = Shape::shared_small_cq(800);
                s.admin = r.pick(&[2, 32]);
                s
            });
        }
    }
}

#[test]
fn random_schedules_in_every_doorbell_mode_with_one_poller() {
    let file = std::env::temp_dir().join(format!("iopath-oracle-{}.img", std::process::id()));
    for mode in MODES {
        for seed in 0..seeds() {
            let lba = if seed % 4 == 3 { 4096 } else { 512 };
            let _ = std::fs::remove_file(&file);
            run(on(cfg(mode, 1, lba), seed % 3, &file), seed % 2 == 1, 1000 + seed, |r| Shape::random(r, 600));
        }
    }
    let _ = std::fs::remove_file(&file);
}

#[test]
fn random_schedules_with_two_pollers() {
    for mode in MODES.into_iter().filter(|m| m.polled() && !matches!(m, DoorbellMode::BarAdaptive | DoorbellMode::Auto))
    {
        for seed in 0..seeds() {
            run(cfg(mode, 2, 512), seed % 2 == 1, 2000 + seed, |r| Shape::random(r, 600));
        }
    }
}

/// Four namespaces (ram 512, a file at 4096, ram 4096, a second file at
/// 512, whose rings share the controller's eventfd): commands spread over
/// the NSIDs, each namespace with its own model, bad NSIDs answered 0x0b
/// with their buffers untouched, Flush to FFFFFFFFh now and then; resets
/// and queue deletions mid-flight as the shape draws them.
#[test]
fn random_schedules_over_four_namespaces_in_every_doorbell_mode() {
    use crate::nvme::namespaces::NsConfig;
    let dir = std::env::temp_dir();
    let (a, b) = (
        dir.join(format!("iopath-oracle-ns-{}-a.img", std::process::id())),
        dir.join(format!("iopath-oracle-ns-{}-b.img", std::process::id())),
    );
    for mode in MODES {
        for seed in 0..seeds() / 2 {
            let _ = (std::fs::remove_file(&a), std::fs::remove_file(&b));
            let file = |p: &std::path::Path, lba_size| NsConfig {
                backend: StorageKind::File(p.to_path_buf()),
                size: 2 << 20,
                lba_size,
                create: true,
                ..Default::default()
            };
            let c = NvmeConfig {
                ns: vec![
                    file(&a, 4096),
                    NsConfig { backend: StorageKind::Ram, size: 2 << 20, lba_size: 4096, ..Default::default() },
                    file(&b, 512),
                ],
                ..cfg(mode, 1, 512)
            };
            run(c, seed % 2 == 1, 4000 + seed, |r| Shape::random(r, 600));
        }
    }
    let _ = (std::fs::remove_file(&a), std::fs::remove_file(&b));
}

/// Namespaces with metadata (issue 36): separate buffers (MPTR) and extended LBAs, 8 to 64
/// bytes per block, with and without PI type 1, on ram and on a file. Every write carries
/// metadata of its own, every read must return the data and the metadata of the last write
/// (all FFh where none was written, zeroed or deallocated), and nothing outside a command's
/// PRPs and MPTR buffer changes. On the PI namespaces most commands carry PRINFO: PRACT
/// (the tuple generated on a write or write zeroes, stripped with 8 bytes of metadata),
/// PRCHK with tags right or wrong, tuples spoiled in one field: each command gets the check
/// error the oracle predicts (or success) and a failed one writes nothing.
#[test]
fn random_schedules_over_namespaces_with_metadata_in_every_doorbell_mode() {
    use crate::nvme::namespaces::{NsConfig, NsMeta};
    let path = std::env::temp_dir().join(format!("iopath-oracle-meta-{}.img", std::process::id()));
    let meta = |ms, ext, pi| NsMeta { ms, ext, pi, pi_first: false };
    let ram =
        |lba_size, meta| NsConfig { backend: StorageKind::Ram, size: 2 << 20, lba_size, meta, ..Default::default() };
    let (mut prinfo, mut pi_errors) = (0, 0);
    for mode in MODES {
        for seed in 0..seeds() / 2 {
            let _ = std::fs::remove_file(&path);
            let file =
                NsConfig { backend: StorageKind::File(path.clone()), create: true, ..ram(512, meta(16, false, 0)) };
            let c = NvmeConfig {
                meta: meta(8, false, 1),
                ns: vec![
                    ram(512, NsMeta { pi_first: true, ..meta(16, true, 1) }),
                    ram(4096, meta(64, false, 1)),
                    ram(4096, meta(8, true, 1)),
                    file,
                ],
                ..cfg(mode, 1, 512)
            };
            let r = run(c, seed % 2 == 1, 7000 + seed, |r| Shape::random(r, 500));
            (prinfo, pi_errors) = (prinfo + r.prinfo, pi_errors + r.pi_errors);
        }
    }
    let _ = std::fs::remove_file(&path);
    eprintln!("PRINFO on {prinfo} commands, {pi_errors} of them failed a check as predicted");
    assert!(prinfo > 100 && pi_errors > 10, "the schedules met PRINFO: {prinfo}, check errors: {pi_errors}");
}

/// Injection rules (`oracle::injection_rules`) on the namespace a config gives.
fn with_rules(mut c: NvmeConfig, seed: u64) -> (NvmeConfig, Vec<crate::block::inject::Rule>) {
    let rules = super::super::oracle::injection_rules(c.size / c.lba_size as u64, seed);
    c.inject = rules.clone();
    (c, rules)
}

#[test]
fn injected_errors_in_random_schedules_in_every_doorbell_mode() {
    let mut met = Met::default();
    let file = std::env::temp_dir().join(format!("iopath-oracle-inject-{}.img", std::process::id()));
    for mode in MODES {
        for seed in 0..seeds().div_ceil(3) {
            let lba = if seed % 2 == 1 { 4096 } else { 512 };
            let _ = std::fs::remove_file(&file);
            let (c, rules) = with_rules(on(cfg(mode, 1, lba), seed % 2, &file), 7 + seed);
            met.add(run(c, seed % 2 == 1, 5000 + seed, |r| Shape { rules, ..Shape::random(r, 600) }));
        }
    }
    let _ = std::fs::remove_file(&file);
    eprintln!("met: {met:?}");
    // The schedules met every action the oracle predicts (statuses, aborted drops, corruptions, delays).
    assert!(met.injected > 0 && met.corrupted > 0 && met.timed > 0, "{met:?}");
}

#[test]
fn injected_errors_with_two_pollers() {
    let mut met = Met::default();
    for mode in [DoorbellMode::Shm, DoorbellMode::Bar, DoorbellMode::Adaptive] {
        for seed in 0..seeds().div_ceil(4) {
            let (c, rules) = with_rules(cfg(mode, 2, 512), seed);
            met.add(run(c, seed % 2 == 1, 6000 + seed, |r| Shape { rules, ..Shape::random(r, 600) }));
        }
    }
    eprintln!("met: {met:?}");
    assert!(met.injected > 0 && met.timed > 0, "{met:?}");
}

#[test]
fn a_timing_model_in_random_schedules() {
    let file = std::env::temp_dir().join(format!("iopath-oracle-timing-{}.img", std::process::id()));
    let spec = "read:u:5us:60us+write:20us+flush:50us+discard:10us+channels:4+iops:200k";
    for mode in MODES.into_iter().filter(|&m| m != DoorbellMode::Mmio) {
        for seed in 0..seeds().div_ceil(4) {
            let _ = std::fs::remove_file(&file);
            let mut c = on(cfg(mode, 1, 512), seed % 2, &file);
            c.timing = Some(Box::new(spec.parse().unwrap()));
            let r = run(c, seed % 2 == 1, 7000 + seed, |r| Shape::random(r, 600));
            assert!(r.timed > 0 || r.completed == 0, "{mode} seed {seed}: {r:?}");
        }
    }
    // Device times past an adaptive poller's margin: it sleeps until just
    // before each is due (every decision checked against the machine's invariants).
    let slow = "read:u:100us:900us+write:400us+flush:200us+discard:150us";
    for mode in MODES.into_iter().filter(|m| m.adaptive()) {
        let mut c = cfg(mode, 1, 512);
        c.timing = Some(Box::new(slow.parse().unwrap()));
        let r = run(c, false, 7200, |r| Shape::random(r, 300));
        assert!(r.timed > 0 || r.completed == 0, "{mode} slow: {r:?}");
    }
    for mode in [DoorbellMode::Shm, DoorbellMode::Adaptive] {
        let mut c = cfg(mode, 2, 512);
        c.timing = Some(Box::new(spec.parse().unwrap()));
        let (c, rules) = with_rules(c, 3);
        run(c, false, 7100, |r| Shape { rules, ..Shape::random(r, 600) });
    }
    let _ = std::fs::remove_file(&file);
}
