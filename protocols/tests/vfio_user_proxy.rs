//! iopath's vfio-user proxy (the VMM side) against servers that are not
//! iopath's own: the rust-vmm `vfio_user` crate's `Server` with a backend
//! written here, and a scripted server that answers GET_REGION_IO_FDS as
//! libvfio-user does. No guest: the tests drive the proxy as the VMM's bus
//! and PCI host would (`cli/tests/vfio_user_proxy.rs` boots one).

mod common;
use common::memfd;
use iopath_devices::{DeviceContext, DeviceModelMut, FailFn, Interrupts, IoEventSpec, IoEvents, NoIoEvents};
use iopath_protocols::function::{map_guest_memory, SharedRegion};
use iopath_protocols::vfio_user::VfioUserProxy;
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use vfio_user::{IrqInfo, Server, ServerBackend, ServerRegion};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

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

/// What the VMM gives the proxy: 1 MiB of memfd RAM, `irq`, `ioevents`, and
/// a fail hook that records why the run would stop.
fn context(
    irq: Arc<dyn iopath_devices::Interrupts>,
    ioevents: Arc<dyn IoEvents>,
) -> (DeviceContext, Arc<Mutex<Vec<String>>>) {
    let owner = iopath_protocols::sigbus::Owner::new(None::<&std::fs::File>).unwrap();
    let ram = SharedRegion { gpa: 0, size: 1 << 20, offset: 0, file: memfd(1 << 20, true) };
    let (mem, _) = map_guest_memory(vec![ram], &owner).unwrap();
    let fails = Arc::new(Mutex::new(Vec::new()));
    let f = fails.clone();
    let fail: FailFn = Arc::new(move |m: String| f.lock().unwrap().push(m));
    (DeviceContext { mem, ioevents, irq, fail }, fails)
}

/// The VMM's interrupt host as a proxy sees it (what `vmm::irq::VmIrq`
/// does with KVM): INTx eventfds, and per MSI-X vector an eventfd that is
/// "in KVM" while routed. KVM's part is played by [`Host::delivered`]:
/// a routed vector's signal is taken from its eventfd with the message it
/// has then; a masked (unrouted) vector's signal stays in the eventfd.
struct Host {
    intx: (EventFd, EventFd),
    vectors: Mutex<Vec<Option<HostVector>>>,
}

/// A vector's eventfd and, while routed, its message.
type HostVector = (EventFd, Option<Msg>);

/// An MSI message: address, data.
type Msg = (u64, u32);

impl Host {
    fn new() -> Arc<Self> {
        let fd = || EventFd::new(EFD_NONBLOCK).unwrap();
        Arc::new(Host { intx: (fd(), fd()), vectors: Mutex::default() })
    }

    /// The messages KVM would have injected since the last call.
    fn delivered(&self) -> Vec<(u16, Msg)> {
        let v = self.vectors.lock().unwrap();
        let routed = v.iter().enumerate().filter_map(|(i, x)| Some((i as u16, x.as_ref()?)));
        routed.filter_map(|(i, (fd, msg))| Some((i, (*msg)?)).filter(|_| fd.read().is_ok_and(|n| n > 0))).collect()
    }
}

impl Interrupts for Host {
    fn set_intx(&self, _: bool) {}

    fn signal_msix(&self, vector: u16) -> bool {
        match self.vectors.lock().unwrap().get(vector as usize) {
            Some(Some((fd, Some(_)))) => fd.write(1).is_ok(),
            _ => false,
        }
    }

    fn intx_eventfds(&self) -> Option<(EventFd, EventFd)> {
        Some((self.intx.0.try_clone().ok()?, self.intx.1.try_clone().ok()?))
    }

    fn msix_eventfd(&self, vector: u16) -> Option<EventFd> {
        self.vectors.lock().unwrap().get(vector as usize)?.as_ref()?.0.try_clone().ok()
    }

    fn msix_route(&self, vector: u16, msg: Option<Msg>) {
        let mut v = self.vectors.lock().unwrap();
        if v.len() <= vector as usize {
            v.resize_with(vector as usize + 1, || None);
        }
        match (&mut v[vector as usize], msg) {
            (Some((_, route)), m) => *route = m,
            (slot @ None, Some(m)) => *slot = Some((EventFd::new(EFD_NONBLOCK).unwrap(), Some(m))),
            (None, None) => {}
        }
    }
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
    /// Configuration writes as they arrived: (offset, length).
    config_writes: Vec<(u64, usize)>,
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
    /// The `argsz` of the region infos (the rust-vmm Server sends them as given).
    region_argsz: u32,
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
        Device { config: c, regs: vec![0; 0x1000], intx, refuse_unmask: false, region_argsz: 32, seen: Arc::default() }
    }

    fn regions(&self) -> Vec<ServerRegion> {
        (0..9u32)
            .map(|i| {
                let mut r = ServerRegion { region_info: Default::default(), sparse_areas: Vec::new(), mmap_fd: None };
                r.region_info.argsz = self.region_argsz;
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
        let server = Server::new(&path, true, self.irqs(), self.regions()).unwrap();
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
            CONFIG_REGION => self.seen.lock().unwrap().config_writes.push((offset, data.len())),
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
    let (ctx, fails) = context(Host::new(), Arc::new(NoIoEvents));
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

#[test]
fn a_device_without_intx_attaches_and_a_refused_optional_step_is_not_fatal() {
    // No INTx: GET_IRQ_INFO says count 0 and the server refuses SET_IRQS on index 0.
    let (path, seen, h) = Device::new(false).serve();
    let mut p = connect(&path);
    let (ctx, fails) = context(Host::new(), Arc::new(NoIoEvents));
    p.attach(ctx);
    assert!(fails.lock().unwrap().is_empty(), "the attach failed: {:?}", fails.lock().unwrap());
    assert!(seen.lock().unwrap().irq_sets.iter().all(|s| s.0 != INTX), "SET_IRQS for an INTx the device does not have");
    let mut b = [0u8; 4];
    p.bar_read(0, 0, &mut b);
    assert_eq!(b, [0; 4], "the device is up");
    drop(p);
    h.join().unwrap();
    // INTx, but the server takes only the trigger fd (it refuses ACTION_UNMASK): logged, and on.
    let mut d = Device::new(true);
    d.refuse_unmask = true;
    let (path, seen, h) = d.serve();
    let mut p = connect(&path);
    let (ctx, fails) = context(Host::new(), Arc::new(NoIoEvents));
    p.attach(ctx);
    assert!(fails.lock().unwrap().is_empty(), "the attach failed: {:?}", fails.lock().unwrap());
    assert!(seen.lock().unwrap().intx_trigger.is_some());
    p.bar_read(0, 0, &mut b);
    assert!(fails.lock().unwrap().is_empty());
    drop(p);
    h.join().unwrap();
}

// ---------------------------------------------------------------------------
// A scripted server whose GET_REGION_IO_FDS reply is laid out as
// libvfio-user's (include/vfio-user.h): 48-byte entries with
// shadow_mem_fd_index at 28, shadow_offset at 32 and datamatch at 40, and a
// shadow ioeventfd (type 2) among them; plus a type this client cannot know.

mod scripted {
    use iopath_protocols::socket;
    use iopath_protocols::vfio_user::wire::*;
    use std::os::fd::{AsRawFd, RawFd};
    use std::os::unix::net::UnixStream;

    /// One io fd entry at a 48-byte stride: (offset, size, fd_index, type, flags, datamatch).
    fn entry48(offset: u64, size: u64, fd_index: u32, ty: u32, flags: u32, datamatch: u64) -> Vec<u8> {
        let mut e = Vec::with_capacity(48);
        e.extend_from_slice(&offset.to_le_bytes());
        e.extend_from_slice(&size.to_le_bytes());
        e.extend_from_slice(&fd_index.to_le_bytes());
        e.extend_from_slice(&ty.to_le_bytes());
        e.extend_from_slice(&flags.to_le_bytes());
        e.extend_from_slice(&2u32.to_le_bytes()); // shadow_mem_fd_index
        e.extend_from_slice(&0x5000u64.to_le_bytes()); // shadow_offset (where the spec text has datamatch)
        e.extend_from_slice(&datamatch.to_le_bytes());
        e
    }

    /// The reply for BAR0: a datamatch ioeventfd, a wildcard one, a shadow
    /// ioeventfd and an unknown type 7, over fds [a, b, shadow memory].
    pub fn io_fds_reply() -> Vec<u8> {
        let entries = [
            entry48(0x10, 4, 0, IO_FD_TYPE_IOEVENTFD, KVM_IOEVENTFD_FLAG_DATAMATCH, 0x1234),
            entry48(0x20, 0, 1, IO_FD_TYPE_IOEVENTFD, 0, 0),
            entry48(0x30, 4, 0, 2, KVM_IOEVENTFD_FLAG_DATAMATCH, 0x77),
            entry48(0x40, 8, 1, 7, 0, 0),
        ]
        .concat();
        let head = [16 + entries.len() as u32, 0, 0, 4].map(u32::to_le_bytes).concat();
        [head, entries].concat()
    }

    pub fn config() -> [u8; 256] {
        let mut c = [0u8; 256];
        c[0..4].copy_from_slice(&0x0001_4e58u32.to_le_bytes()); // 4e58:0001, as SPDK's NVMe target
        c[8..12].copy_from_slice(&0x0108_0200u32.to_le_bytes());
        c
    }

    /// Serves one client until it leaves. Every SET_IRQS and DMA_MAP succeeds;
    /// the device has no interrupts.
    pub fn serve(sock: UnixStream, fds: [RawFd; 3]) {
        loop {
            let mut h = [0u8; HEADER_SIZE];
            if socket::recv_exact(&sock, &mut h).is_err() {
                return;
            }
            let hdr = Header::parse(&h);
            let mut payload = vec![0u8; hdr.payload_len().unwrap()];
            socket::recv_exact(&sock, &mut payload).unwrap();
            let (body, out_fds): (Vec<u8>, Vec<RawFd>) = match hdr.command().unwrap() {
                Command::Version => (Version { major: 0, minor: 2, capabilities: None }.to_bytes(), vec![]),
                Command::DeviceGetInfo => {
                    let i = DeviceInfo { argsz: 16, flags: DEVICE_FLAGS_PCI, num_regions: 9, num_irqs: 5 };
                    (i.to_bytes(), vec![])
                }
                Command::DeviceGetIrqInfo => {
                    let q = IrqInfo::parse(&payload).unwrap();
                    (IrqInfo { argsz: 16, flags: IRQ_INFO_EVENTFD, index: q.index, count: 0 }.to_bytes(), vec![])
                }
                Command::DeviceGetRegionInfo => {
                    let q = RegionInfo::parse(&payload).unwrap();
                    let size = if q.index == 0 { 0x1000 } else { 0 };
                    let flags = REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE;
                    (RegionInfoReply::new(q.index, flags, size, 0, None).to_bytes(), vec![])
                }
                Command::DeviceGetRegionIoFds => {
                    let q = IoFdsRequest::parse(&payload).unwrap();
                    if q.index == 0 {
                        (io_fds_reply(), fds.to_vec())
                    } else {
                        (IoFdsReply::new(q.index, vec![]).to_bytes(), vec![])
                    }
                }
                Command::RegionRead => {
                    let q = RegionAccess::parse(&payload).unwrap();
                    let mut data = vec![0u8; q.count as usize];
                    if q.region == PCI_CONFIG_REGION_INDEX {
                        let o = q.offset as usize;
                        data.copy_from_slice(&config()[o..o + q.count as usize]);
                    }
                    (RegionAccess::to_bytes_with_data(q.offset, q.region, &data), vec![])
                }
                Command::RegionWrite => {
                    let (q, _) = RegionAccess::parse_with_data(&payload).unwrap();
                    (q.to_bytes(), vec![])
                }
                Command::DmaMap | Command::DeviceSetIrqs | Command::DeviceReset => (vec![], vec![]),
                _ => {
                    socket::send(&sock, &[&error_reply(&hdr, libc::ENOSYS)], &[]).unwrap();
                    continue;
                }
            };
            socket::send(&sock, &[&reply(&hdr, &body)], &out_fds).unwrap();
        }
    }

    pub fn eventfd() -> vmm_sys_util::eventfd::EventFd {
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
        EventFd::new(EFD_NONBLOCK).unwrap()
    }

    pub fn raw(f: &impl AsRawFd) -> RawFd {
        f.as_raw_fd()
    }
}

/// Records the ioeventfds the proxy installs (what KVM_IOEVENTFD would get).
#[derive(Default)]
struct Recorder(Mutex<Vec<IoEventSpec>>);
impl IoEvents for Recorder {
    fn register(&self, s: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        self.0.lock().unwrap().push(s);
        Ok(())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
}

#[test]
fn libvfio_user_io_fds_install_the_right_datamatch_and_unknown_types_are_skipped() {
    let (a, b) = UnixStream::pair().unwrap();
    let (e1, e2, shadow) = (scripted::eventfd(), scripted::eventfd(), memfd(4096, true));
    let fds = [scripted::raw(&e1), scripted::raw(&e2), scripted::raw(&shadow)];
    let h = std::thread::spawn(move || scripted::serve(b, fds));
    let mut p = VfioUserProxy::connect(a, None).expect("the proxy refused libvfio-user's io fd layout");
    assert_eq!((p.ids().vendor, p.ids().device), (0x4e58, 0x0001));
    let rec = Arc::new(Recorder::default());
    let (ctx, fails) = context(Arc::new(iopath_devices::NoInterrupts), rec.clone());
    p.attach(ctx);
    assert!(fails.lock().unwrap().is_empty(), "{:?}", fails.lock().unwrap());
    assert_eq!(
        *rec.0.lock().unwrap(),
        [
            IoEventSpec { bar: 0, offset: 0x10, len: 4, datamatch: Some(0x1234) },
            IoEventSpec { bar: 0, offset: 0x20, len: 0, datamatch: None },
        ],
        "datamatch is at 40 in a 48-byte entry; the shadow ioeventfd and type 7 are skipped"
    );
    drop(p);
    h.join().unwrap();
    drop((e1, e2, shadow));
}

/// Signals MSI-X vector `v` from the device side (its SET_IRQS eventfd).
fn device_signals(seen: &Mutex<Seen>, v: usize) {
    use std::io::Write;
    let s = seen.lock().unwrap();
    let mut f = s.msix.get(v).and_then(Option::as_ref).expect("the device has no eventfd for the vector");
    f.write_all(&1u64.to_ne_bytes()).unwrap();
}

fn read32(p: &mut VfioUserProxy, bar: u8, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    p.bar_read(bar, offset, &mut b);
    u32::from_le_bytes(b)
}

fn write32(p: &mut VfioUserProxy, offset: u64, v: u32) {
    p.bar_write(0, offset, &v.to_le_bytes());
}

#[test]
fn the_msix_table_and_pba_are_emulated_in_the_vmm_and_masking_holds_a_vector_pending() {
    let (path, seen, h) = Device::new(false).serve();
    let mut p = connect(&path);
    let host = Host::new();
    let (ctx, fails) = context(host.clone(), Arc::new(NoIoEvents));
    p.attach(ctx);
    // Vector 1: message and unmask, as a driver programs it. The server refuses table
    // accesses; they must not reach it: the proxy keeps the table.
    write32(&mut p, TABLE + 16, 0xfee0_0000);
    write32(&mut p, TABLE + 20, 0);
    write32(&mut p, TABLE + 24, 0x41);
    write32(&mut p, TABLE + 28, 0);
    assert!(fails.lock().unwrap().is_empty(), "a table write was fatal: {:?}", fails.lock().unwrap());
    assert_eq!(read32(&mut p, 0, TABLE + 16), 0xfee0_0000, "the table reads back from the VMM");
    assert_eq!(read32(&mut p, 0, TABLE + 12), 1, "vector 0 is still masked");
    assert_eq!(read32(&mut p, 0, PBA), 0);
    assert!(seen.lock().unwrap().irq_sets.is_empty(), "MSI-X is off: no eventfd yet");
    // MSI-X Enable: vector 1's eventfd goes to the server. The server's configuration space
    // ignores the write; the guest reads back what the VMM keeps.
    p.config_write(MSIX_CAP + 3, &[0x80]);
    let mut ctl = [0u8; 4];
    assert!(p.config_read(MSIX_CAP, &mut ctl));
    assert_eq!(dword(&ctl) >> 16, 0x8000 | (VECTORS - 1), "Message Control: enabled, 4 vectors");
    assert_eq!(
        seen.lock().unwrap().irq_sets,
        [(MSIX, 0x24, 1, 1, 1)],
        "SET_IRQS MSI-X, TRIGGER | DATA_EVENTFD, vector 1"
    );
    let msg = |data| (1u16, (0xfee0_0000u64, data));
    device_signals(&seen, 1);
    assert_eq!(host.delivered(), [msg(0x41)]);
    // Masked: the signal does not reach the guest and shows in the PBA.
    write32(&mut p, TABLE + 28, 1);
    device_signals(&seen, 1);
    assert_eq!(host.delivered(), []);
    assert_eq!(read32(&mut p, 0, PBA), 1 << 1, "vector 1 pending");
    assert_eq!(read32(&mut p, 0, PBA), 1 << 1, "reading the PBA does not clear it");
    // A new message while masked, then unmask: delivered once, to the new message.
    write32(&mut p, TABLE + 24, 0x42);
    write32(&mut p, TABLE + 28, 0);
    assert_eq!(host.delivered(), [msg(0x42)]);
    assert_eq!(host.delivered(), []);
    assert_eq!(read32(&mut p, 0, PBA), 0);
    // Pending without a PBA read in between (the signal still in the eventfd).
    write32(&mut p, TABLE + 28, 1);
    device_signals(&seen, 1);
    write32(&mut p, TABLE + 28, 0);
    assert_eq!(host.delivered(), [msg(0x42)]);
    // Function Mask, and MSI-X off, hold it the same way.
    for (mask, unmask) in [(0xc0, 0x80), (0x00, 0x80)] {
        p.config_write(MSIX_CAP + 3, &[mask]);
        device_signals(&seen, 1);
        assert_eq!(host.delivered(), [], "control {mask:#x}");
        assert_eq!(read32(&mut p, 0, PBA), 1 << 1, "control {mask:#x}");
        p.config_write(MSIX_CAP + 3, &[unmask]);
        assert_eq!(host.delivered(), [msg(0x42)], "control {mask:#x}");
        assert_eq!(read32(&mut p, 0, PBA), 0);
    }
    let s = seen.lock().unwrap();
    assert_eq!(s.msix_accesses, 0, "a table or PBA access reached the server");
    assert_eq!(s.irq_sets.len(), 1, "the eventfd went over once");
    drop(s);
    assert!(fails.lock().unwrap().is_empty(), "{:?}", fails.lock().unwrap());
    drop(p);
    h.join().unwrap();
}

#[test]
fn bar_registers_are_answered_by_the_vmm_as_qemu_emulates_them() {
    // The server's configuration space keeps no write, so sizing BAR0 there would read 0
    // ("no BAR"): the BARs (and the expansion ROM BAR, not offered) come from the VMM's
    // header, which sizes and places them as it maps them; the rest from the server.
    let (path, seen, h) = Device::new(true).serve();
    let mut p = connect(&path);
    let mut b = [0u8; 4];
    for bar in (0x10..0x28).step_by(4).chain([0x30]) {
        assert!(!p.config_read(bar, &mut b), "BAR register {bar:#x} read from the server");
    }
    for reg in [0x00, 0x04, 0x08, 0x0c, 0x2c, 0x34, 0x3c, MSIX_CAP] {
        assert!(p.config_read(reg, &mut b), "register {reg:#x} not read from the server");
    }
    p.config_write(0x10, &0xffff_ffffu32.to_le_bytes());
    assert_eq!(seen.lock().unwrap().config_writes, [(0x10, 4)], "writes still go to the server");
    drop(p);
    h.join().unwrap();
}

#[test]
fn a_region_info_whose_argsz_the_rust_vmm_server_left_0_is_read_as_its_32_bytes() {
    // The rust-vmm Server sends a region's info as its backend filled it, and fills argsz
    // only when it adds capabilities: a backend that leaves it 0 gets argsz 0 on the wire
    // (the spec: the size of the whole reply).
    let mut d = Device::new(true);
    d.region_argsz = 0;
    let (path, seen, h) = d.serve();
    let mut p = VfioUserProxy::connect(UnixStream::connect(&path).unwrap(), None).expect("REGION_INFO with argsz 0");
    assert_eq!(p.bars().iter().map(|b| (b.index, b.size)).collect::<Vec<_>>(), [(0, BAR0_SIZE)]);
    let mut b = [0u8; 4];
    p.bar_read(0, 0x10, &mut b);
    assert_eq!(seen.lock().unwrap().bar_reads, 1);
    drop(p);
    h.join().unwrap();
}

/// A guest that enables MSI-X with one 32-bit write at the capability (iopath's guest did): the
/// VMM takes MSI-X Enable, and forwards Message Control alone, 16 bits at cap + 2, never the
/// capability's ID and next pointer, which libvfio-user refuses to have written (EPERM). Other
/// configuration writes go as they came.
#[test]
fn a_dword_write_at_the_msix_capability_reaches_the_server_as_its_message_control_alone() {
    let (path, seen, h) = Device::new(false).serve();
    let mut p = connect(&path);
    let (ctx, fails) = context(Host::new(), Arc::new(NoIoEvents));
    p.attach(ctx);
    let ctl = VECTORS - 1;
    p.config_write(MSIX_CAP, &(0x11 | (0x8000 | ctl) << 16).to_le_bytes());
    let mut b = [0u8; 2];
    assert!(p.config_read(MSIX_CAP + 2, &mut b));
    assert_eq!(u16::from_le_bytes(b) & 0x8000, 0x8000, "MSI-X enabled in the VMM");
    p.config_write(MSIX_CAP + 2, &(ctl as u16).to_le_bytes()); // off again, 16 bits
    p.config_write(MSIX_CAP, &[0x11]); // the ID alone: nothing to forward
    p.config_write(MSIX_CAP + 1, &[0, 0x80]); // next pointer and Message Control's low byte
    p.config_write(0x04, &0x0006u16.to_le_bytes()); // the command register
    let w = seen.lock().unwrap().config_writes.clone();
    let c = MSIX_CAP as u64;
    assert_eq!(w, [(c + 2, 2), (c + 2, 2), (c + 2, 1), (4, 2)], "forwarded (offset, size)");
    assert!(fails.lock().unwrap().is_empty(), "{:?}", fails.lock().unwrap());
    drop(p);
    h.join().unwrap();
}
