//! The queue oracle (`devices::nvme::oracle`) over vfio-user: its reference
//! driver reaches iopath's controller in a server the way the VMM does,
//! through iopath's vfio-user proxy, with the ioeventfds and the doorbell
//! page the server announces played as KVM plays them. Every doorbell mode;
//! random schedules and the driver shape that met replayed commands.

mod common;
use iopath_devices::nvme::oracle::{Driver, LocalPort, Rng, Shape, RAM};
use iopath_devices::SharedDevice;
use iopath_protocols::function::{map_guest_memory, SharedRegion};
use iopath_protocols::vfio_user::VfioUserProxy;
use std::sync::{Arc, Mutex};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap};

const MODES: [&str; 7] = ["auto", "mmio", "ioeventfd", "shm", "bar", "adaptive", "bar-adaptive"];

/// A server of `device` in a thread, and the proxy of it hosted on the oracle's RAM.
fn port(device: &str, name: &str) -> (LocalPort, std::thread::JoinHandle<()>) {
    let (path, server) = common::serve(device, name);
    let proxy = VfioUserProxy::connect(common::dial(&path), None).expect("the proxy connects");
    let dev: SharedDevice = Arc::new(Mutex::new(proxy));
    let file = common::memfd(RAM, true);
    let ram = GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(0),
        RAM as usize,
        Some(FileOffset::new(file.try_clone().unwrap(), 0)),
    )])
    .unwrap();
    let owner = iopath_protocols::sigbus::Owner::new(None::<&std::fs::File>).unwrap();
    let (mem, _) = map_guest_memory(vec![SharedRegion { gpa: 0, size: RAM, offset: 0, file }], &owner).unwrap();
    (LocalPort::hosting(dev, ram, mem, false).unwrap(), server)
}

fn run(mode: &str, pollers: u8, seed: u64, shape: impl FnOnce(&mut Rng) -> Shape) {
    let device = format!("nvme,doorbell={mode},backend=ram,size_mb=2,pollers={pollers}");
    let name = format!("oracle-{mode}-{pollers}-{seed}");
    let (port, server) = port(&device, &name);
    let mut rng = Rng::new(seed);
    let mut shape = shape(&mut rng);
    // ioeventfd and adaptive serve only drivers with shadow doorbells out of process.
    shape.shadow |= matches!(mode, "ioeventfd" | "adaptive");
    let r = Driver::new(&port, rng, shape).run();
    drop(port); // the proxy goes: the one-client server returns
    server.join().unwrap();
    if let Err(e) = r {
        panic!("{device} seed={seed}: {e}");
    }
}

#[test]
fn the_driver_that_met_replayed_commands_over_vfio_user_in_every_mode() {
    for mode in MODES {
        run(mode, 1, 1, |_| Shape::replay_case(3000));
    }
}

#[test]
fn random_schedules_over_vfio_user_in_every_mode() {
    let seeds = std::env::var("IOPATH_ORACLE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(4u64);
    for mode in MODES {
        for seed in 0..seeds {
            run(
                mode,
                1 + (seed % 2) as u8 * u8::from(!matches!(mode, "auto" | "bar-adaptive" | "mmio" | "ioeventfd")),
                500 + seed,
                |r| Shape::random(r, 400),
            );
        }
    }
}
