//! iopath's VMM attaches vfio-user devices it does not know, on the real
//! /dev/kvm: `--device vfio-user:PATH` against the rust-vmm `vfio_user`
//! crate's `Server` (an implementation that is not iopath's other half),
//! with backends written here. The guest enumerates what the server serves
//! and a pci-testdev-shaped device gets the exit rows as usual, its BAR
//! accesses counted at the backend.
//!
//! Where that server departs from the spec (handled in the proxy): it
//! answers VERSION 0.0 with `migration` in its capabilities JSON, its
//! commands stop at 14, and a command it does not know leaves its payload
//! in the socket, so the proxy does not ask it GET_REGION_IO_FDS; its error
//! replies carry errno 0.

mod common;
use common::{kvm, programs};

use iopath_bench::record::GuestOutput;
use iopath_protocols::attach::{instantiate, Device as Attached, DeviceSpec};
use iopath_vmm::{run, VmConfig};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use vfio_user::{IrqInfo, Server, ServerBackend, ServerRegion};

const CONFIG_REGION: u32 = 7;

fn socket_path() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("iopath-vfio-user-proxy-{}-{n}.sock", std::process::id()))
}

/// What reached the backend, per BAR.
#[derive(Debug, Default)]
struct Counts {
    reads: [u64; 6],
    writes: [u64; 6],
    /// Writes to the selected test's offset (what pci-testdev counts).
    test_writes: [u64; 6],
}

/// One BAR: kind (BAR register low bits), size, and for pci-testdev's
/// BARs the test it offers: (name, offset).
#[derive(Clone)]
struct Bar {
    index: usize,
    flags: u32,
    size: u64,
    test: Option<(&'static str, u32)>,
}

/// A PCI function behind the rust-vmm server: a configuration space that
/// keeps no write (the VMM answers BAR registers itself), and BARs that
/// either run pci-testdev's header protocol or are plain storage.
struct Backend {
    config: [u8; 256],
    bars: Vec<Bar>,
    /// Per BAR: the selected test, its count, and storage.
    selected: [Option<u8>; 6],
    count: [u32; 6],
    mem: Vec<Vec<u8>>,
    counts: Arc<Mutex<Counts>>,
}

impl Backend {
    fn new(vendor: u16, device: u16, class: u32, bars: Vec<Bar>) -> Self {
        let mut c = [0u8; 256];
        c[0..2].copy_from_slice(&vendor.to_le_bytes());
        c[2..4].copy_from_slice(&device.to_le_bytes());
        c[8..12].copy_from_slice(&(class << 8).to_le_bytes());
        for b in &bars {
            let at = 0x10 + 4 * b.index;
            c[at..at + 4].copy_from_slice(&b.flags.to_le_bytes());
        }
        let mem =
            (0..6).map(|i| vec![0u8; bars.iter().find(|b| b.index == i).map_or(0, |b| b.size as usize)]).collect();
        Backend { config: c, bars, selected: [None; 6], count: [0; 6], mem, counts: Arc::default() }
    }

    /// QEMU's pci-testdev, one test per BAR: BAR0 4 KiB of memory, BAR1 256 ports.
    fn testdev() -> Self {
        let bars = vec![
            Bar { index: 0, flags: 0, size: 4096, test: Some(("mmio-no-eventfd", 2048)) },
            Bar { index: 1, flags: 1, size: 256, test: Some(("portio-no-eventfd", 128)) },
        ];
        Backend::new(0x1b36, 0x0005, 0xff0000, bars)
    }

    fn regions(&self) -> Vec<ServerRegion> {
        (0..9u32)
            .map(|i| {
                let mut r = ServerRegion { region_info: Default::default(), sparse_areas: Vec::new(), mmap_fd: None };
                let size = match i {
                    CONFIG_REGION => 256,
                    i => self.bars.iter().find(|b| b.index == i as usize).map_or(0, |b| b.size),
                };
                (r.region_info.argsz, r.region_info.index, r.region_info.size) = (32, i, size);
                r.region_info.flags = if size > 0 { 3 } else { 0 }; // READ | WRITE
                r
            })
            .collect()
    }

    /// Serves one VMM on a new socket: (spec, counts, server thread).
    fn serve(self) -> (DeviceSpec, Arc<Mutex<Counts>>, JoinHandle<()>) {
        let path = socket_path();
        // INTx and MSI-X indexes without interrupts: the proxy wires none.
        let irqs = (0..5).map(|index| IrqInfo { index, flags: 1, count: 0 }).collect();
        let server = Server::new(&path, true, irqs, self.regions()).unwrap();
        let counts = self.counts.clone();
        let mut b = self;
        let h = std::thread::spawn(move || server.run(&mut b).unwrap());
        let spec: DeviceSpec = format!("vfio-user:{}", path.display()).parse().unwrap();
        (spec, counts, h)
    }

    /// pci-testdev's header of BAR `i`: {test, width, pad, offset, data, count, name}.
    fn header(&self, i: usize) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[0] = self.selected[i].unwrap_or(0);
        if let (Some(0), Some((name, offset))) = (self.selected[i], self.bar(i).and_then(|b| b.test)) {
            h[1] = 1;
            h[4..8].copy_from_slice(&offset.to_le_bytes());
            h[8..12].copy_from_slice(&0xfau32.to_le_bytes());
            h[12..16].copy_from_slice(&self.count[i].to_le_bytes());
            h[16..16 + name.len()].copy_from_slice(name.as_bytes());
        }
        h
    }

    fn bar(&self, i: usize) -> Option<&Bar> {
        self.bars.iter().find(|b| b.index == i)
    }
}

fn outside() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, "outside the region")
}

impl ServerBackend for Backend {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), std::io::Error> {
        let (i, o, end) = (region as usize, offset as usize, offset as usize + data.len());
        if region == CONFIG_REGION {
            data.copy_from_slice(self.config.get(o..end).ok_or_else(outside)?);
            return Ok(());
        }
        let b = self.bar(i).cloned().ok_or_else(outside)?;
        self.counts.lock().unwrap().reads[i] += 1;
        if b.test.is_some() && end <= 64 {
            data.copy_from_slice(&self.header(i)[o..end]);
        } else {
            data.copy_from_slice(self.mem[i].get(o..end).ok_or_else(outside)?);
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let (i, o, end) = (region as usize, offset as usize, offset as usize + data.len());
        if region == CONFIG_REGION {
            return Ok(()); // kept nowhere
        }
        let b = self.bar(i).cloned().ok_or_else(outside)?;
        let mut c = self.counts.lock().unwrap();
        c.writes[i] += 1;
        match b.test {
            Some(_) if o == 0 => {
                self.selected[i] = Some(data[0]);
                self.count[i] = 0;
            }
            Some((_, at)) if self.selected[i] == Some(0) && o == at as usize => {
                self.count[i] += 1;
                c.test_writes[i] += 1;
            }
            _ => self.mem[i].get_mut(o..end).ok_or_else(outside)?.copy_from_slice(data),
        }
        Ok(())
    }

    fn dma_map(
        &mut self,
        _: vfio_user::DmaMapFlags,
        _: u64,
        _: u64,
        _: u64,
        _: Option<File>,
    ) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn dma_unmap(&mut self, _: vfio_user::DmaUnmapFlags, _: u64, _: u64) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn reset(&mut self) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn set_irqs(&mut self, _: u32, _: u32, _: u32, _: u32, _: Vec<File>) -> Result<(), std::io::Error> {
        Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "no interrupts"))
    }
}

/// The `@pci` records of the guest, by vendor:device.
fn pci_records(out: &GuestOutput) -> BTreeMap<String, BTreeMap<String, String>> {
    out.pci.iter().map(|r| (r["id"].clone(), r.clone())).collect()
}

/// A BAR field of a `@pci` record, `kind:0xADDR:SIZE`, as (kind, address, size).
fn bar_field(v: &str) -> (String, u64, u64) {
    let p: Vec<&str> = v.split(':').collect();
    (p[0].to_string(), u64::from_str_radix(p[1].trim_start_matches("0x"), 16).unwrap(), p[2].parse().unwrap())
}

const ROWS: &str = "mmio-no-eventfd,portio-no-eventfd,mmio-read,portio-read";

#[test]
fn a_rust_vmm_vfio_user_server_is_enumerated_by_the_guest_and_gets_the_exit_rows() {
    kvm();
    let (spec, counts, h) = Backend::testdev().serve();
    assert_eq!(spec.device, Attached::Server);
    // A second device iopath knows nothing about: a 64-bit BAR and a 32-bit one, no test.
    let other = Backend::new(
        0x1234,
        0x11e9,
        0x088000,
        vec![Bar { index: 0, flags: 0x4, size: 16384, test: None }, Bar { index: 2, flags: 0, size: 8192, test: None }],
    );
    let (other_spec, other_counts, h2) = other.serve();
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &format!("workload=exits batches=3 batch_us=2000 only={ROWS}"));
    cfg.devices = vec![instantiate(&spec, &programs()).unwrap(), instantiate(&other_spec, &programs()).unwrap()];
    cfg.timeout = Duration::from_secs(120);
    let r = run(cfg).unwrap();
    assert_eq!(r.status, 1, "{:?}", r.lines);
    let out = GuestOutput::parse(&r.lines);
    // The guest lists what it found: ids, class, and each BAR's kind, address and size,
    // where the VMM placed it.
    let pci = pci_records(&out);
    let td = &pci["1b36:0005"];
    assert_eq!((td["bdf"].as_str(), td["class"].as_str()), ("00:01.0", "ff0000"));
    let placed = |slot: usize, bar: u8| r.devices[slot].bars.iter().find(|b| b.spec.index == bar).unwrap().addr;
    assert_eq!(bar_field(&td["bar0"]), ("mem32".into(), placed(0, 0), 4096));
    assert_eq!(bar_field(&td["bar1"]), ("io".into(), placed(0, 1), 256));
    let o = &pci["1234:11e9"];
    assert_eq!((o["bdf"].as_str(), o["class"].as_str()), ("00:02.0", "088000"));
    assert_eq!(bar_field(&o["bar0"]), ("mem64".into(), placed(1, 0), 16384));
    assert_eq!(bar_field(&o["bar2"]), ("mem32".into(), placed(1, 2), 8192));
    assert!(!o.contains_key("bar1") && !td.contains_key("bar2"), "{o:?} {td:?}");
    assert_eq!(r.devices[0].name, spec.to_string());
    // The exit rows, as for iopath's own pci-testdev: every write reached the backend.
    let rows: Vec<&str> = out.rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        rows,
        ["mmio-no-eventfd:pci-mem", "mmio-read:pci-mem", "portio-no-eventfd:pci-io", "portio-read:pci-io"]
    );
    let c = counts.lock().unwrap();
    for (row, bar) in [("mmio-no-eventfd:pci-mem", 0), ("portio-no-eventfd:pci-io", 1)] {
        let row = out.row(row).unwrap();
        assert!(row.accesses > 0 && row.status().is_none(), "{row:?}");
        assert_eq!(row.get_u64("count"), Some(row.accesses), "the device's count register: {row:?}");
        assert_eq!(c.test_writes[bar], row.accesses, "{}: writes that reached the backend", row.name);
    }
    for (row, bar) in [("mmio-read:pci-mem", 0), ("portio-read:pci-io", 1)] {
        let row = out.row(row).unwrap();
        assert!(
            c.reads[bar] >= row.accesses,
            "{}: {} reads reached the backend, {} made",
            row.name,
            c.reads[bar],
            row.accesses
        );
    }
    assert_eq!(r.exits.unclaimed_mmio_write, 0);
    drop(c);
    let o = other_counts.lock().unwrap();
    assert_eq!((o.reads, o.writes), ([0; 6], [0; 6]), "nobody touched the other device's BARs");
    drop(o);
    h.join().unwrap();
    h2.join().unwrap();
}

#[test]
fn iopath_run_takes_a_vfio_user_server_on_the_command_line() {
    kvm();
    let (spec, counts, h) = Backend::testdev().serve();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["run", "--device", &spec.to_string(), "--append", "batches=1 batch_us=1000 only=mmio-no-eventfd"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    let g = GuestOutput::parse(&lines);
    assert_eq!(pci_records(&g)["1b36:0005"]["class"], "ff0000");
    let row = g.row("mmio-no-eventfd:pci-mem").unwrap();
    assert_eq!(counts.lock().unwrap().test_writes[0], row.accesses);
    h.join().unwrap();
}
