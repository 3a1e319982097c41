//! The NVMe controller (`devices::nvme`) under the queue oracle (`devices::nvme::oracle`): the
//! oracle's reference driver runs a schedule whose every choice comes from the fuzzer's bytes
//! (`Rng::from_bytes`): queue counts and sizes, shadow doorbells or not, how late doorbells are
//! rung, batches, reaps, queue deletions, resets and shutdowns with commands in flight. The
//! oracle reports any violation (a completion for a command not published, a command executed
//! twice or lost, wrong data, guest memory written outside a command's data pointers, a
//! controller that hangs) and this target panics with its text. Input format:
//! `iopath_fuzz::nvme_queues`.
//!
//! Most inputs run in `mmio` mode, where every command runs on this thread: a run is then
//! deterministic. The input may also pick a polled mode (one or two poller threads) and the host
//! a device process's client is (`static_host`); those runs are bounded but not repeatable,
//! and a violation there prints the mode with its text.

#![no_main]

use iopath_devices::block::StorageKind;
use iopath_devices::nvme::oracle::{Driver, LocalPort, Rng, Shape};
use iopath_devices::nvme::NvmeConfig;
use iopath_fuzz::nvme_queues::{decode, Setup, NS_SIZE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (setup, choices) = decode(data);
    let Setup { doorbell, pollers, lba_size, static_host, steps } = setup;
    let cfg =
        NvmeConfig { backend: StorageKind::Ram, size: NS_SIZE, lba_size, doorbell, pollers, ..NvmeConfig::default() };
    let port = LocalPort::new(cfg, static_host).expect("the oracle's controller and RAM");
    let mut rng = Rng::from_bytes(choices);
    let mut shape = Shape::random(&mut rng, steps);
    // Out of process, the kicked modes serve only drivers with shadow doorbells: Create I/O SQ
    // is refused otherwise, as it must be (devices/src/nvme/tests/oracle.rs does the same).
    shape.shadow |= static_host && doorbell.kicked();
    let verbose = verbose();
    match Driver::new(&port, rng, shape).run() {
        Ok(r) if verbose => eprintln!("nvme_queues: {setup:?}: {r:?}"),
        Ok(_) => {}
        Err(e) => panic!("queue oracle violation ({setup:?}): {e}"),
    }
});

/// IOPATH_FUZZ_VERBOSE=1: print the setup and the oracle's report after each input.
fn verbose() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var_os("IOPATH_FUZZ_VERBOSE").is_some_and(|v| v != "0"))
}
