//! iopath's vfio-user proxy (the VMM side) against servers that are not
//! iopath's own: the rust-vmm `vfio_user` crate's `Server` with a backend
//! written here, and a scripted server that answers GET_REGION_IO_FDS as
//! libvfio-user does. No guest: the tests drive the proxy as the VMM's bus
//! and PCI host would (`cli/tests/vfio_user_proxy.rs` boots one).

use iopath_devices::{DeviceContext, DeviceModelMut, FailFn, IoEvents, NoIoEvents};
use iopath_protocols::function::{map_guest_memory, SharedRegion};
use iopath_protocols::vfio_user::VfioUserProxy;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use vfio_user::{IrqInfo, Server, ServerBackend, ServerRegion};

const CONFIG_REGION: u32 = 7;
const INTX: u32 = 0;
const MSIX: u32 = 2;
/// VFIO_IRQ_INFO_EVENTFD.
const IRQ_EVENTFD: u32 = 1;

fn socket_path() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("iopath-proxy-test-{}-{n}.sock", std::process::id()))
}

/// An empty memfd of `len` bytes.
fn memfd(len: u64) -> File {
    // SAFETY: memfd_create with a NUL-terminated name; the fd is checked, then owned by the File.
    let fd = unsafe { libc::memfd_create(c"proxy-test".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(len).unwrap();
    f
}

/// What the VMM gives the proxy: 1 MiB of memfd RAM, `irq`, `ioevents`, and
/// a fail hook that records why the run would stop.
fn context(
    irq: Arc<dyn iopath_devices::Interrupts>,
    ioevents: Arc<dyn IoEvents>,
) -> (DeviceContext, Arc<Mutex<Vec<String>>>) {
    let mem = map_guest_memory(vec![SharedRegion { gpa: 0, size: 1 << 20, offset: 0, file: memfd(1 << 20) }]).unwrap();
    let fails = Arc::new(Mutex::new(Vec::new()));
    let f = fails.clone();
    let fail: FailFn = Arc::new(move |m: String| f.lock().unwrap().push(m));
    (DeviceContext { mem, ioevents, irq, fail }, fails)
}

/// INTx lines as the VMM has them (trigger and resample eventfds).
fn intx_lines() -> Arc<iopath_devices::irq::IrqLines> {
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    let l = iopath_devices::irq::IrqLines::new();
    l.connect_intx(EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap());
    l
}

fn dword(b: &[u8]) -> u32 {
    u32::from_le_bytes(b[..4].try_into().unwrap())
}

// ---------------------------------------------------------------------------
// A device behind the rust-vmm server.

/// BAR0: 8 KiB of memory: registers below 0x1000 (plain storage), the MSI-X
/// table at 0x1000 and its PBA at 0x1800.
const BAR0_SIZE: u64 = 0x2000;
const TABLE: u64 = 0x1000;
const PBA: u64 = 0x1800;
const MSIX_CAP: usize = 0x40;
const VECTORS: u32 = 4;

/// What reached the server.
#[derive(Default)]
struct Seen {
    bar_reads: u64,
    bar_writes: u64,
    /// BAR accesses to the MSI-X table or PBA (a client that emulates them sends none).
    msix_accesses: u64,
    config_writes: u64,
    dma_maps: u64,
    /// SET_IRQS: (index, flags, start, count, fds).
    irq_sets: Vec<(u32, u32, u32, u32, usize)>,
    /// MSI-X eventfds by vector, as SET_IRQS gave them.
    msix: Vec<Option<File>>,
    intx_trigger: Option<File>,
}

/// A minimal PCI function: a read-only configuration space (writes are
/// counted and dropped: the client must not depend on the server
/// emulating BARs or MSI-X Message Control), BAR0, MSI-X with 4 vectors
/// and, if `intx`, INTx. It refuses accesses to its MSI-X table and PBA,
/// and SET_IRQS on an index it does not have.
struct Device {
    config: [u8; 256],
    regs: Vec<u8>,
    intx: bool,
    /// Refuse SET_IRQS ACTION_UNMASK (the INTx resample fd) as some servers do.
    refuse_unmask: bool,
    seen: Arc<Mutex<Seen>>,
}

impl Device {
    fn new(intx: bool) -> Self {
        let mut c = [0u8; 256];
        c[0..4].copy_from_slice(&0xbeef_1234u32.to_le_bytes()); // 1234:beef
        c[6] = 0x10; // status: capability list
        c[8..12].copy_from_slice(&0xff00_0001u32.to_le_bytes()); // class ff0000, revision 1
        c[0x10..0x14].copy_from_slice(&0u32.to_le_bytes()); // BAR0: 32-bit memory
        c[0x34] = MSIX_CAP as u8;
        c[0x3d] = intx as u8; // interrupt pin A, or none
        c[MSIX_CAP] = 0x11;
        c[MSIX_CAP + 2..MSIX_CAP + 4].copy_from_slice(&(VECTORS as u16 - 1).to_le_bytes());
        c[MSIX_CAP + 4..MSIX_CAP + 8].copy_from_slice(&(TABLE as u32).to_le_bytes()); // BIR 0
        c[MSIX_CAP + 8..MSIX_CAP + 12].copy_from_slice(&(PBA as u32).to_le_bytes());
        Device { config: c, regs: vec![0; 0x1000], intx, refuse_unmask: false, seen: Arc::default() }
    }

    fn regions() -> Vec<ServerRegion> {
        (0..9u32)
            .map(|i| {
                let mut r = ServerRegion { region_info: Default::default(), sparse_areas: Vec::new(), mmap_fd: None };
                r.region_info.argsz = 32;
                r.region_info.index = i;
                let size = match i {
                    0 => BAR0_SIZE,
                    CONFIG_REGION => 256,
                    _ => 0,
                };
                r.region_info.size = size;
                r.region_info.flags = if size > 0 { 3 } else { 0 }; // READ | WRITE
                r
            })
            .collect()
    }

    fn irqs(&self) -> Vec<IrqInfo> {
        let count = |i: u32| match i {
            INTX => self.intx as u32,
            MSIX => VECTORS,
            _ => 0,
        };
        (0..5).map(|index| IrqInfo { index, flags: IRQ_EVENTFD, count: count(index) }).collect()
    }

    /// Serves one client on a new socket; returns its path and the server thread.
    fn serve(self) -> (PathBuf, Arc<Mutex<Seen>>, JoinHandle<()>) {
        let path = socket_path();
        let server = Server::new(&path, true, self.irqs(), Self::regions()).unwrap();
        let seen = self.seen.clone();
        let mut dev = self;
        let h = std::thread::spawn(move || server.run(&mut dev).unwrap());
        (path, seen, h)
    }
}

fn in_msix(offset: u64) -> bool {
    (TABLE..PBA + 8).contains(&offset)
}

fn refused(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, what.to_string())
}

impl ServerBackend for Device {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), std::io::Error> {
        let end = offset as usize + data.len();
        match region {
            CONFIG_REGION if end <= 256 => data.copy_from_slice(&self.config[offset as usize..end]),
            0 if in_msix(offset) => {
                self.seen.lock().unwrap().msix_accesses += 1;
                return Err(refused("the MSI-X table and PBA are the client's"));
            }
            0 if end <= self.regs.len() => {
                self.seen.lock().unwrap().bar_reads += 1;
                data.copy_from_slice(&self.regs[offset as usize..end]);
            }
            _ => return Err(refused("outside the region")),
        }
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let end = offset as usize + data.len();
        match region {
            CONFIG_REGION => self.seen.lock().unwrap().config_writes += 1,
            0 if in_msix(offset) => {
                self.seen.lock().unwrap().msix_accesses += 1;
                return Err(refused("the MSI-X table and PBA are the client's"));
            }
            0 if end <= self.regs.len() => {
                self.seen.lock().unwrap().bar_writes += 1;
                self.regs[offset as usize..end].copy_from_slice(data);
            }
            _ => return Err(refused("outside the region")),
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
        self.seen.lock().unwrap().dma_maps += 1;
        Ok(())
    }

    fn dma_unmap(&mut self, _: vfio_user::DmaUnmapFlags, _: u64, _: u64) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn reset(&mut self) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> Result<(), std::io::Error> {
        let mut s = self.seen.lock().unwrap();
        s.irq_sets.push((index, flags, start, count, fds.len()));
        const ACTION_UNMASK: u32 = 1 << 4;
        match index {
            INTX if !self.intx => Err(refused("no INTx")),
            INTX if flags & ACTION_UNMASK != 0 && self.refuse_unmask => Err(refused("no resample fd")),
            INTX => {
                s.intx_trigger = fds.into_iter().next();
                Ok(())
            }
            MSIX => {
                for (i, f) in fds.into_iter().enumerate() {
                    let v = start as usize + i;
                    if s.msix.len() <= v {
                        s.msix.resize_with(v + 1, || None);
                    }
                    s.msix[v] = Some(f);
                }
                Ok(())
            }
            _ => Err(refused("no such interrupt")),
        }
    }
}

fn connect(path: &PathBuf) -> VfioUserProxy {
    VfioUserProxy::connect(UnixStream::connect(path).unwrap(), None).unwrap()
}

#[test]
fn the_rust_vmm_server_attaches_and_its_bar_accesses_reach_the_backend() {
    let (path, seen, h) = Device::new(true).serve();
    let mut p = connect(&path);
    assert_eq!((p.ids().vendor, p.ids().device, p.ids().class), (0x1234, 0xbeef, 0xff0000));
    let bars: Vec<_> = p.bars().iter().map(|b| (b.index, b.size)).collect();
    assert_eq!(bars, [(0, BAR0_SIZE)]);
    let (ctx, fails) = context(intx_lines(), Arc::new(NoIoEvents));
    p.attach(ctx);
    assert!(fails.lock().unwrap().is_empty(), "{:?}", fails.lock().unwrap());
    assert_eq!(seen.lock().unwrap().dma_maps, 1, "guest RAM went over as DMA_MAP");
    assert!(seen.lock().unwrap().intx_trigger.is_some(), "the INTx trigger eventfd went over");
    p.bar_write(0, 0x10, &0xdead_beefu32.to_le_bytes());
    let mut b = [0u8; 4];
    p.bar_read(0, 0x10, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0xdead_beef);
    let mut cfg = [0u8; 4];
    assert!(p.config_read(0, &mut cfg));
    assert_eq!(dword(&cfg), 0xbeef_1234);
    let s = seen.lock().unwrap();
    assert_eq!((s.bar_writes, s.bar_reads), (1, 1));
    drop(s);
    assert!(fails.lock().unwrap().is_empty(), "{:?}", fails.lock().unwrap());
    drop(p);
    h.join().unwrap();
}
