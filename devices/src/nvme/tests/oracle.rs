//! The queue oracle (`nvme::oracle`) over random schedules, in every
//! doorbell mode, with one and two pollers, hosted as the VMM hosts the
//! controller and as a device process's client does.

use super::super::oracle::{Driver, LocalPort, Rng, Shape};
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
fn run(c: NvmeConfig, static_host: bool, seed: u64, shape: impl FnOnce(&mut Rng) -> Shape) {
    let port = LocalPort::new(c.clone(), static_host).unwrap();
    let mut rng = Rng::new(seed);
    let mut shape = shape(&mut rng);
    shape.data = c.backend != StorageKind::Null;
    // Out of process, ioeventfd and adaptive serve only drivers with shadow
    // doorbells (Create I/O SQ is refused otherwise: a test of its own).
    shape.shadow |= static_host && c.doorbell.kicked();
    if let Err(e) = Driver::new(&port, rng, shape).run() {
        panic!("{} pollers={} static={static_host} seed={seed}: {e}", c.doorbell, c.pollers);
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
            };
            let c = NvmeConfig {
                ns: vec![
                    file(&a, 4096),
                    NsConfig { backend: StorageKind::Ram, size: 2 << 20, lba_size: 4096, create: false },
                    file(&b, 512),
                ],
                ..cfg(mode, 1, 512)
            };
            run(c, seed % 2 == 1, 4000 + seed, |r| Shape::random(r, 600));
        }
    }
    let _ = (std::fs::remove_file(&a), std::fs::remove_file(&b));
}
