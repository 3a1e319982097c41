//! The proxy's reconnect against servers that die: a relay in front of
//! each server records what the proxy sends (commands, payloads, fds), so
//! the test sees the second session replay the first one's DMA maps,
//! interrupts and configuration with the same fds, and a device with
//! state memory resume from it.

use super::*;
use crate::vfio_user::proxy::reconnect::Source;
use crate::vfio_user::{ProxyConfig, StateMemoryMode, STATE_MEMORY_BYTES};
use iopath_devices::state::StateMemory;
use iopath_devices::{BarSpec, DeviceContext, DeviceModel, PciIds};
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::Ordering;
use std::time::Duration;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

/// One message the proxy sent: its session, command, payload, fds.
struct Rec {
    session: usize,
    cmd: u16,
    payload: Vec<u8>,
    fds: Vec<File>,
}

/// Servers behind relays on a listening socket: each connection gets a
/// new server of `device()` (a new process of the device); `kill` ends
/// the current one as a death would (both sockets shut down).
struct Servers {
    path: std::path::PathBuf,
    recs: Arc<Mutex<Vec<Rec>>>,
    live: Arc<Mutex<Vec<UnixStream>>>,
}

impl Servers {
    fn start(device: impl Fn() -> iopath_devices::SharedDevice + Send + 'static) -> (Servers, Arc<IrqLines>) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("iopath-reconnect-{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let (recs, live) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
        let (r, lv) = (recs.clone(), live.clone());
        let irq = IrqLines::new();
        let device_side = irq.clone();
        std::thread::spawn(move || {
            for (session, proxy_end) in l.incoming().enumerate() {
                let Ok(proxy_end) = proxy_end else { return };
                let (relay, server_end) = UnixStream::pair().unwrap();
                let (r, irq) = (r.clone(), irq.clone());
                lv.lock().unwrap().extend([proxy_end.try_clone().unwrap(), relay.try_clone().unwrap()]);
                let dev = device();
                std::thread::spawn(move || {
                    let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
                    let _ = VfioUserServer::new(f, irq, IoFds::IoEventFds).session(&server_end, "test");
                });
                let (p2, s2) = (proxy_end.try_clone().unwrap(), relay.try_clone().unwrap());
                std::thread::spawn(move || pump(&proxy_end, &relay, Some((r, session))));
                std::thread::spawn(move || pump(&s2, &p2, None));
            }
        });
        (Servers { path, recs, live }, device_side)
    }

    fn connect(&self) -> VfioUserProxy {
        self.connect_with(ProxyConfig::default())
    }

    fn connect_with(&self, cfg: ProxyConfig) -> VfioUserProxy {
        let s = crate::attach::connect(&self.path).unwrap();
        let source = Source::Socket { path: self.path.clone(), window: Duration::from_secs(10) };
        VfioUserProxy::connect_from(s, None, source, cfg).unwrap()
    }

    /// The server dies: its connection closes both ways.
    fn kill(&self) {
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The commands of `session`, with their payloads and fds.
    fn session(&self, session: usize) -> Vec<(u16, Vec<u8>, Vec<File>)> {
        let recs = self.recs.lock().unwrap();
        let mine = recs.iter().filter(|r| r.session == session);
        mine.map(|r| (r.cmd, r.payload.clone(), r.fds.iter().map(|f| f.try_clone().unwrap()).collect())).collect()
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Forwards messages from `from` to `to` until either closes, recording
/// them if asked.
fn pump(from: &UnixStream, to: &UnixStream, rec: Option<(Arc<Mutex<Vec<Rec>>>, usize)>) {
    while let Ok(Some(m)) = recv(from) {
        let raw: Vec<RawFd> = m.fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut bytes = message(m.hdr.msg_id, Command::Version, m.hdr.flags, &m.payload);
        bytes[2..4].copy_from_slice(&m.hdr.cmd.to_le_bytes());
        bytes[12..16].copy_from_slice(&m.hdr.error_no.to_le_bytes());
        // Recorded before it goes on: the reply the proxy waits for comes after.
        if let Some((recs, session)) = &rec {
            let fds = m.fds.iter().map(|f| f.try_clone().unwrap()).collect();
            recs.lock().unwrap().push(Rec { session: *session, cmd: m.hdr.cmd, payload: m.payload.clone(), fds });
        }
        if send(to, &bytes, &raw).is_err() {
            return;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// An interrupt host with INTx and MSI-X eventfds, each kept to check
/// which one a signal reaches.
#[derive(Default)]
struct Host {
    intx: Mutex<Option<(EventFd, EventFd)>>,
    msix: Mutex<Vec<(u16, EventFd)>>,
}
impl Interrupts for Host {
    fn set_intx(&self, _: bool) {}
    fn signal_msix(&self, _: u16) -> bool {
        false
    }
    fn intx_eventfds(&self) -> Option<(EventFd, EventFd)> {
        let g = self.intx.lock().unwrap();
        let (t, r) = g.as_ref()?;
        Some((t.try_clone().unwrap(), r.try_clone().unwrap()))
    }
    fn msix_eventfd(&self, v: u16) -> Option<EventFd> {
        let fd = EventFd::new(EFD_NONBLOCK).unwrap();
        let copy = fd.try_clone().unwrap();
        self.msix.lock().unwrap().push((v, fd));
        Some(copy)
    }
}

fn ino(f: &impl AsFd) -> u64 {
    use std::os::unix::fs::MetadataExt;
    File::from(f.as_fd().try_clone_to_owned().unwrap()).metadata().unwrap().ino()
}

/// True if `sent` (an fd the proxy sent) is `kept` (the host's): the same
/// open file (kcmp(2) KCMP_FILE; SCM_RIGHTS and dup share it).
fn same_eventfd(sent: &File, kept: &EventFd) -> bool {
    let pid = std::process::id() as libc::c_long;
    let (a, b) = (sent.as_raw_fd() as libc::c_long, kept.as_raw_fd() as libc::c_long);
    // SAFETY: kcmp with integer arguments only; it reads no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, pid, pid, 0 as libc::c_long, a, b) };
    assert!(r >= 0, "kcmp: {}", std::io::Error::last_os_error());
    r == 0
}

/// The INTx SET_IRQS of a session: (action flags, the fd sent).
fn intx_sets(s: &[(u16, Vec<u8>, Vec<File>)]) -> Vec<(u32, File)> {
    s.iter()
        .filter(|x| x.0 == Command::DeviceSetIrqs as u16)
        .filter_map(|x| {
            let q = IrqSet::parse(&x.1).ok()?;
            (q.index == PCI_INTX_IRQ_INDEX).then(|| (q.flags & !IRQ_SET_DATA_EVENTFD, x.2[0].try_clone().unwrap()))
        })
        .collect()
}

fn cmds(s: &[(u16, Vec<u8>, Vec<File>)]) -> Vec<u16> {
    s.iter().map(|(c, _, _)| *c).collect()
}

fn nvme() -> iopath_devices::SharedDevice {
    "nvme,doorbell=mmio,backend=null".parse::<DeviceConfig>().unwrap().build().unwrap()
}

#[test]
fn a_reconnect_replays_dma_maps_interrupts_and_configuration_with_the_same_fds() {
    let (servers, _) = Servers::start(nvme);
    let mut p = servers.connect();
    let (mut ctx, _) = vmm_context();
    let host = Arc::new(Host::default());
    let intx = (EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap());
    *host.intx.lock().unwrap() = Some(intx);
    ctx.irq = host.clone();
    let ram = ino(&ctx.mem.mapped().iter().next().unwrap().file_offset().unwrap().file().as_fd());
    p.attach(ctx);
    place(&mut p);
    // MSI-X vector 1 unmasked and enabled: its eventfd goes to the server.
    let (bar, cap) = p.msix.as_ref().map(|m| (m.table.bar(), m.table.cap_offset())).unwrap();
    let mut t = [0u8; 4];
    assert!(p.config_read(cap + 4, &mut t));
    let table = (u32::from_le_bytes(t) & !7) as u64;
    p.bar_write(bar, table + 16, &0xfee0_0000u64.to_le_bytes());
    p.bar_write(bar, table + 24, &0x45u32.to_le_bytes());
    p.bar_write(bar, table + 28, &0u32.to_le_bytes());
    p.config_write(cap + 2, &0x8000u16.to_le_bytes());
    let first = servers.session(0);
    servers.kill();
    // The next access meets the dead server, reconnects, and is answered.
    let mut cfg = [0u8; 4];
    assert!(p.config_read(0, &mut cfg));
    assert_eq!(u32::from_le_bytes(cfg) & 0xffff, p.ids().vendor as u32, "vendor ID from the new server");
    assert_eq!(p.reconnects(), 1);
    assert!(p.chan.peer.dead.is_none(), "{:?}", p.chan.peer.dead);
    let second = servers.session(1);
    let c = cmds(&second);
    // Discovery as at connect, then the replay in order.
    // (STATE_MEMORY, if the device keeps state, is not part of it.)
    let found = |c: &[u16]| -> Vec<u16> {
        let end = c.iter().position(|&x| x == Command::DmaMap as u16).unwrap();
        c[..end].iter().copied().filter(|&x| x != STATE_MEMORY_COMMAND).collect()
    };
    assert_eq!(found(&c), found(&cmds(&first)), "the same discovery");
    let at = |cmd: Command, from: usize| c[from..].iter().position(|&x| x == cmd as u16).map(|i| i + from);
    let dma = at(Command::DmaMap, 0).expect("DMA_MAP replayed");
    // (The controller has no INTx pin: no INTx SET_IRQS, in either session;
    // the stateful device's test checks INTx.)
    assert_eq!(intx_sets(&second).len(), 0);
    let config = at(Command::RegionWrite, dma).expect("configuration replayed");
    let vec1 = at(Command::DeviceSetIrqs, config).expect("MSI-X vector replayed");
    // The same guest RAM memfd.
    assert_eq!(ino(&second[dma].2[0]), ram);
    let dmas = |s: &[(u16, Vec<u8>, Vec<File>)]| {
        s.iter().filter(|x| x.0 == Command::DmaMap as u16).map(|x| x.1.clone()).collect::<Vec<_>>()
    };
    assert_eq!(dmas(&second), dmas(&first), "the same DMA maps");
    // The configuration writes, in the order the guest made them (BARs, command, MSI-X control).
    let writes: Vec<(u64, Vec<u8>)> = second[config..vec1]
        .iter()
        .filter(|x| x.0 == Command::RegionWrite as u16)
        .map(|x| {
            let (a, d) = RegionAccess::parse_with_data(&x.1).unwrap();
            assert_eq!(a.region, PCI_CONFIG_REGION_INDEX);
            (a.offset, d.to_vec())
        })
        .collect();
    let want = vec![
        (0x10, 0xfe00_0000u32.to_le_bytes().to_vec()),
        (0x14, 0xc000u32.to_le_bytes().to_vec()),
        (0x04, 3u16.to_le_bytes().to_vec()),
        (cap as u64 + 2, 0x8000u16.to_le_bytes().to_vec()),
    ];
    assert_eq!(writes, want);
    // MSI-X vector 1 with the eventfd the host gave for it.
    let q = IrqSet::parse(&second[vec1].1).unwrap();
    assert_eq!((q.index, q.start, q.count), (PCI_MSIX_IRQ_INDEX, 1, 1));
    let given = host.msix.lock().unwrap();
    assert_eq!(given.len(), 1, "no new eventfd was asked of the host");
    assert!(same_eventfd(&second[vec1].2[0], &given[0].1));
    drop(given);
    assert!(p.counters().iter().any(|c| c.name == crate::vfio_user::RECONNECTS && c.value == 1));
}

/// A device that keeps one register in state memory: BAR0 offset 0.
#[derive(Default)]
struct Stateful {
    mem: Mutex<Option<StateMemory>>,
    /// Each adopt: (resume, the memfd's inode, word 0 when adopted).
    adopted: Mutex<Vec<(bool, u64, u64)>>,
}
impl DeviceModel for Stateful {
    fn name(&self) -> String {
        "stateful".into()
    }
    fn ids(&self) -> PciIds {
        let (vendor, device, class) = (0x1b36, 0x00ee, 0xff0000);
        PciIds { vendor, device, class, revision: 0, subsystem_vendor: vendor, subsystem: device, interrupt_pin: 1 }
    }
    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem32, size: 4096 }]
    }
    fn attach(&self, _: DeviceContext) {}
    fn bar_read(&self, _: u8, _: u64, data: &mut [u8]) {
        let v = self.mem.lock().unwrap().as_ref().map_or(0, |m| m.words()[0].load(Ordering::Acquire));
        iopath_devices::le_fill(data, v);
    }
    fn bar_write(&self, _: u8, _: u64, data: &[u8]) {
        if let Some(m) = self.mem.lock().unwrap().as_ref() {
            m.words()[0].store(iopath_devices::le_value(data), Ordering::Release);
        }
    }
    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }
    fn state_len(&self) -> Option<usize> {
        Some(64)
    }
    fn adopt_state(&self, mem: StateMemory, resume: bool) -> iopath_devices::Result<()> {
        if !resume {
            mem.words().iter().for_each(|w| w.store(0, Ordering::Release));
        }
        let w0 = mem.words()[0].load(Ordering::Acquire);
        self.adopted.lock().unwrap().push((resume, ino(&mem.fd()), w0));
        *self.mem.lock().unwrap() = Some(mem);
        Ok(())
    }
}

type Made = Arc<Mutex<Vec<Arc<Stateful>>>>;

/// New `Stateful` devices, each also kept in the list returned.
fn stateful_devices() -> (impl Fn() -> iopath_devices::SharedDevice + Send + 'static, Made) {
    let made: Made = Arc::default();
    let m = made.clone();
    let f = move || -> iopath_devices::SharedDevice {
        let d = Arc::new(Stateful::default());
        m.lock().unwrap().push(d.clone());
        d
    };
    (f, made)
}

fn stateful() -> iopath_devices::SharedDevice {
    Arc::new(Stateful::default())
}

#[test]
fn a_device_with_state_memory_resumes_from_it_in_its_next_process() {
    let (make, made) = stateful_devices();
    let (servers, _) = Servers::start(make);
    let mut p = servers.connect();
    let (mut ctx, _) = vmm_context();
    let host = Arc::new(Host::default());
    *host.intx.lock().unwrap() = Some((EventFd::new(EFD_NONBLOCK).unwrap(), EventFd::new(EFD_NONBLOCK).unwrap()));
    ctx.irq = host.clone();
    p.attach(ctx);
    p.bar_write(0, 0, &0x1234_5678u32.to_le_bytes());
    servers.kill();
    let mut v = [0u8; 4];
    p.bar_read(0, 0, &mut v);
    assert_eq!(u32::from_le_bytes(v), 0x1234_5678, "the new process resumed the register");
    assert_eq!(p.reconnects(), 1);
    let devs = made.lock().unwrap();
    let mine: Vec<_> = devs.iter().map(|d| d.adopted.lock().unwrap().clone()).collect();
    assert_eq!(mine.len(), 2, "two processes of the device");
    let (a, b) = (&mine[0], &mine[1]);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(b.len(), 1, "{b:?}");
    assert!(!a[0].0 && b[0].0, "fresh, then resume: {a:?} {b:?}");
    assert_eq!(a[0].1, b[0].1, "the same memfd");
    assert_eq!(b[0].2, 0x1234_5678, "what the first process recorded");
    // STATE_MEMORY came last in the replay, with RESUME.
    let second = servers.session(1);
    let i = second.iter().position(|x| x.0 == STATE_MEMORY_COMMAND).expect("STATE_MEMORY replayed");
    let (_, payload, fds) = &second[i];
    assert!(StateMemoryMsg::parse(payload).unwrap().resume() && fds.len() == 1);
    assert!(second[..i].iter().any(|x| x.0 == Command::DmaMap as u16), "after the DMA maps");
    // INTx: trigger then unmask, with the host's own eventfds, in both sessions.
    let (t, r) = host.intx_eventfds().unwrap();
    let sets = intx_sets(&second[..i]);
    let actions: Vec<u32> = sets.iter().map(|(a, _)| *a).collect();
    assert_eq!(actions, [IRQ_SET_ACTION_TRIGGER, IRQ_SET_ACTION_UNMASK]);
    assert!(same_eventfd(&sets[0].1, &t) && same_eventfd(&sets[1].1, &r), "the same INTx eventfds");
    assert!(!same_eventfd(&sets[0].1, &r), "(the check tells eventfds apart)");
    assert_eq!(intx_sets(&servers.session(0)).len(), 2);
    let after: Vec<u16> = second[i + 1..].iter().map(|x| x.0).collect();
    assert_eq!(after, [Command::RegionRead as u16], "then the read that met the dead server, again");
}

#[test]
fn a_server_that_does_not_come_back_ends_the_peer_after_the_window() {
    let (servers, _) = Servers::start(stateful);
    let s = crate::attach::connect(&servers.path).unwrap();
    let source = Source::Socket { path: servers.path.clone(), window: Duration::from_millis(200) };
    let mut p = VfioUserProxy::connect_from(s, None, source, ProxyConfig::default()).unwrap();
    let failed = Arc::new(Mutex::new(Vec::new()));
    let (mut ctx, _) = vmm_context();
    let f = failed.clone();
    ctx.fail = Arc::new(move |m| f.lock().unwrap().push(m));
    p.attach(ctx);
    let _ = std::fs::remove_file(&servers.path);
    servers.kill();
    let mut v = [0u8; 4];
    p.bar_read(0, 0, &mut v);
    assert_eq!(v, [0xff; 4]);
    assert_eq!(p.reconnects(), 0);
    let f = failed.lock().unwrap();
    assert_eq!(f.len(), 1, "{f:?}");
    assert!(f[0].contains("no reconnect after"), "{f:?}");
}

#[test]
fn servers_that_do_not_know_state_memory_see_no_state_command_and_iopath_offers_it_only_when_asked() {
    // The server answers the capability only to a client that proposed it.
    let (a, b) = UnixStream::pair().unwrap();
    let h = std::thread::spawn(move || {
        let f = Arc::new(Mutex::new(PciFunction::new(stateful()).unwrap()));
        VfioUserServer::new(f, IrqLines::new(), IoFds::IoEventFds).session(&b, "test")
    });
    let mut raw = Raw(a, 0);
    let v = Version { major: 0, minor: 2, capabilities: Some(Capabilities::default()) };
    send(&raw.0, &message(1, Command::Version, 0, &v.to_bytes()), &[]).unwrap();
    let r = recv(&raw.0).unwrap().unwrap();
    let answer = Version::parse(&r.payload).unwrap();
    assert_eq!(answer.caps().state_memory, None);
    assert!(!String::from_utf8_lossy(&r.payload).contains(STATE_MEMORY_CAP));
    // STATE_MEMORY without the capability agreed: ENOTSUP, and the session goes on.
    let mem = StateMemory::create(64).unwrap();
    raw.1 = 1;
    let q = StateMemoryMsg { flags: 0, size: 64 }.to_bytes();
    let hdr = raw.call(STATE_MEMORY_COMMAND, &q, &[mem.fd().as_raw_fd()]);
    assert!(hdr.is_error() && hdr.error_no == libc::ENOTSUP as u32, "{hdr:?}");
    drop(raw);
    h.join().unwrap().unwrap();
}

#[test]
fn state_memory_that_is_wrong_is_refused_with_an_error_reply() {
    let (a, b) = UnixStream::pair().unwrap();
    let h = std::thread::spawn(move || {
        let f = Arc::new(Mutex::new(PciFunction::new(stateful()).unwrap()));
        VfioUserServer::new(f, IrqLines::new(), IoFds::IoEventFds).session(&b, "test")
    });
    let mut raw = Raw(a, 0);
    let caps = Capabilities { state_memory: Some(1 << 20), ..Capabilities::default() };
    let v = Version { major: 0, minor: 2, capabilities: Some(caps) };
    send(&raw.0, &message(1, Command::Version, 0, &v.to_bytes()), &[]).unwrap();
    let r = recv(&raw.0).unwrap().unwrap();
    assert_eq!(Version::parse(&r.payload).unwrap().caps().state_memory, Some(64));
    raw.1 = 1;
    let good = StateMemory::create(64).unwrap();
    let small = StateMemory::create(32).unwrap();
    let plain = crate::testing::memfd("plain");
    plain.set_len(64).unwrap();
    let msg = |size| StateMemoryMsg { flags: 0, size }.to_bytes();
    for (what, payload, fds) in [
        ("no fd", msg(64), vec![]),
        ("two fds", msg(64), vec![good.fd().as_raw_fd(), good.fd().as_raw_fd()]),
        ("another size than agreed", msg(128), vec![good.fd().as_raw_fd()]),
        ("too small", msg(64), vec![small.fd().as_raw_fd()]),
        ("not sealed", msg(64), vec![plain.as_raw_fd()]),
        ("unknown flag", [&16u32.to_le_bytes()[..], &2u32.to_le_bytes(), &64u64.to_le_bytes()].concat(), vec![]),
    ] {
        let hdr = raw.call(STATE_MEMORY_COMMAND, &payload, &fds);
        assert!(hdr.is_error() && hdr.error_no == libc::EINVAL as u32, "{what}: {hdr:?}");
    }
    let hdr = raw.call(STATE_MEMORY_COMMAND, &msg(64), &[good.fd().as_raw_fd()]);
    assert!(!hdr.is_error(), "{hdr:?}");
    drop(raw);
    h.join().unwrap().unwrap();
}

#[test]
fn a_device_that_dies_at_every_use_stops_the_run_after_a_burst_of_reconnects() {
    use crate::vfio_user::proxy::reconnect::MAX_BURST;
    let (servers, _) = Servers::start(stateful);
    let mut p = servers.connect();
    let failed = Arc::new(Mutex::new(Vec::new()));
    let (mut ctx, _) = vmm_context();
    let f = failed.clone();
    ctx.fail = Arc::new(move |m| f.lock().unwrap().push(m));
    p.attach(ctx);
    let mut v = [0u8; 4];
    for n in 1..=MAX_BURST as u64 {
        servers.kill();
        p.bar_read(0, 0, &mut v);
        assert_eq!((p.reconnects(), v), (n, [0; 4]), "reconnect {n} (the register is in state memory: 0)");
    }
    servers.kill();
    p.bar_read(0, 0, &mut v);
    assert_eq!((p.reconnects(), v), (MAX_BURST as u64, [0xff; 4]));
    let f = failed.lock().unwrap();
    assert!(f.len() == 1 && f[0].contains("reconnects within"), "{f:?}");
}

/// The counters of the proxy that name state memory: (name, value).
fn state_counters(p: &VfioUserProxy) -> Vec<(String, u64)> {
    p.counters().into_iter().filter(|c| c.name == STATE_MEMORY_BYTES).map(|c| (c.name, c.value)).collect()
}

#[test]
fn with_state_memory_off_none_is_offered_or_agreed_and_a_death_stops_the_run_saying_why() {
    for mode in [StateMemoryMode::On, StateMemoryMode::Off] {
        let (make, made) = stateful_devices();
        let (servers, _) = Servers::start(make);
        let mut p = servers.connect_with(ProxyConfig { state_memory: mode });
        assert_eq!(p.config().state_memory, mode);
        let failed = Arc::new(Mutex::new(Vec::new()));
        let (mut ctx, _) = vmm_context();
        let f = failed.clone();
        ctx.fail = Arc::new(move |m| f.lock().unwrap().push(m));
        p.attach(ctx);
        p.bar_write(0, 0, &0x55u32.to_le_bytes());
        let first = servers.session(0);
        // The proposal: the capability offered only with state memory on.
        let version = &first.iter().find(|x| x.0 == Command::Version as u16).expect("VERSION").1;
        let offered = Version::parse(version).unwrap().caps().state_memory;
        let handed: Vec<_> = first.iter().filter(|x| x.0 == STATE_MEMORY_COMMAND).collect();
        let adopted = made.lock().unwrap()[0].adopted.lock().unwrap().clone();
        if mode.on() {
            assert_eq!(offered, Some(MAX_STATE_MEMORY), "{mode}");
            assert_eq!(handed.len(), 1, "{mode}: STATE_MEMORY once");
            assert_eq!(adopted.len(), 1, "{mode}: the device keeps its state");
            assert_eq!(state_counters(&p), [(STATE_MEMORY_BYTES.to_string(), 64)]);
        } else {
            assert_eq!(offered, None, "{mode}: no offer");
            assert!(!String::from_utf8_lossy(version).contains(STATE_MEMORY_CAP), "{mode}");
            assert!(handed.is_empty(), "{mode}: no STATE_MEMORY");
            assert!(adopted.is_empty(), "{mode}: the device keeps no state");
            assert!(state_counters(&p).is_empty(), "{mode}: {:?}", state_counters(&p));
        }
        // A death: resumed with state memory, the run stopped without it.
        servers.kill();
        let mut v = [0u8; 4];
        p.bar_read(0, 0, &mut v);
        let f = failed.lock().unwrap().clone();
        if mode.on() {
            assert_eq!((p.reconnects(), u32::from_le_bytes(v)), (1, 0x55), "{f:?}");
            assert!(f.is_empty(), "{f:?}");
        } else {
            assert_eq!((p.reconnects(), v), (0, [0xff; 4]));
            // The socket's watcher and the read may both tell it: each says why.
            assert!(!f.is_empty(), "the run stops");
            assert!(f.iter().all(|m| m.contains("--state-memory off") && m.contains("the run stops")), "{f:?}");
            assert_eq!(servers.recs.lock().unwrap().iter().filter(|r| r.session > 0).count(), 0, "no new session");
        }
    }
}

#[test]
fn nvme_keeps_state_only_with_state_memory_on_as_version_and_its_counters_show() {
    let counter = |d: &iopath_devices::SharedDevice, n: &str| d.counters().into_iter().find(|c| c.name == n);
    for mode in [StateMemoryMode::On, StateMemoryMode::Off] {
        let dev = "nvme,backend=null,size_mb=8,doorbell=mmio".parse::<DeviceConfig>().unwrap().build().unwrap();
        let d = dev.clone();
        let (a, b) = UnixStream::pair().unwrap();
        let h = std::thread::spawn(move || {
            let f = Arc::new(Mutex::new(PciFunction::new(d).unwrap()));
            VfioUserServer::new(f, IrqLines::new(), IoFds::IoEventFds).session(&b, "test")
        });
        let p = VfioUserProxy::connect_with(a, None, ProxyConfig { state_memory: mode }).unwrap();
        let len = dev.state_len().expect("nvme,doorbell=mmio keeps state") as u64;
        let (proxy, device) = (state_counters(&p), counter(&dev, "state.memory-bytes").map(|c| c.value));
        if mode.on() {
            assert_eq!(proxy, [(STATE_MEMORY_BYTES.to_string(), len)], "{mode}: the agreed state memory");
            assert_eq!(device, Some(len), "{mode}: the controller keeps its state");
            assert!(counter(&dev, "state.commands").is_some(), "{mode}");
        } else {
            assert!(proxy.is_empty(), "{mode}: none agreed: {proxy:?}");
            let names: Vec<String> =
                dev.counters().into_iter().map(|c| c.name).filter(|n| n.starts_with("state.")).collect();
            assert!(names.is_empty(), "{mode}: the controller keeps no state: {names:?}");
        }
        drop(p);
        h.join().unwrap().unwrap();
    }
    // The server's VERSION reply to a proposal without the capability names none.
    let dev = "nvme,backend=null,size_mb=8,doorbell=mmio".parse::<DeviceConfig>().unwrap().build().unwrap();
    let len = dev.state_len().map(|n| n as u64);
    let (a, b) = UnixStream::pair().unwrap();
    let h = std::thread::spawn(move || {
        let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
        VfioUserServer::new(f, IrqLines::new(), IoFds::IoEventFds).session(&b, "test")
    });
    for (offer, agreed) in [(None, None), (Some(MAX_STATE_MEMORY), len)] {
        let caps = Capabilities { state_memory: offer, ..Capabilities::default() };
        let v = Version { major: 0, minor: 2, capabilities: Some(caps) };
        send(&a, &message(1, Command::Version, 0, &v.to_bytes()), &[]).unwrap();
        let r = recv(&a).unwrap().unwrap();
        assert_eq!(Version::parse(&r.payload).unwrap().caps().state_memory, agreed, "offered {offer:?}");
    }
    drop(a);
    let _ = h.join().unwrap();
}

/// A device whose BAR0 page at 0x1000 is memory it shares (a memfd of its
/// own, BAR0 at offset 0 of it, as NVMe's doorbell page): a store that
/// comes as a message lands there too; when it resumes it notes what the
/// page holds.
struct Paged {
    page: File,
    at_resume: Mutex<Option<[u32; 4]>>,
}
impl Paged {
    fn word(&self, i: u64) -> u32 {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 4];
        self.page.read_exact_at(&mut b, 0x1000 + 4 * i).unwrap();
        u32::from_le_bytes(b)
    }
}
impl DeviceModel for Paged {
    fn name(&self) -> String {
        "paged".into()
    }
    fn ids(&self) -> PciIds {
        let (vendor, device, class) = (0x1b36, 0x00ef, 0xff0000);
        PciIds { vendor, device, class, revision: 0, subsystem_vendor: vendor, subsystem: device, interrupt_pin: 0 }
    }
    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem32, size: 0x2000 }]
    }
    fn attach(&self, _: DeviceContext) {}
    fn bar_read(&self, _: u8, _: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&self, _: u8, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        if offset >= 0x1000 && offset + data.len() as u64 <= 0x2000 {
            self.page.write_all_at(data, offset).unwrap();
        }
    }
    fn mapped_areas(&self) -> Vec<iopath_devices::MappedArea> {
        let fd = self.page.try_clone().unwrap();
        vec![iopath_devices::MappedArea { bar: 0, offset: 0x1000, size: 0x1000, fd, fd_offset: 0x1000 }]
    }
    fn counters(&self) -> Vec<Counter> {
        Vec::new()
    }
    fn state_len(&self) -> Option<usize> {
        Some(64)
    }
    fn adopt_state(&self, _: StateMemory, resume: bool) -> iopath_devices::Result<()> {
        if resume {
            *self.at_resume.lock().unwrap() = Some([0, 1, 2, 3].map(|i| self.word(i)));
        }
        Ok(())
    }
}

/// A VMM's BAR areas, as far as the proxy asks: each trap and replacement
/// noted, the page it maps now (the guest's stores land there unless trapped).
struct PageHost {
    can_trap: bool,
    events: Mutex<Vec<String>>,
    mapped: Mutex<Option<File>>,
    trapped: std::sync::atomic::AtomicBool,
}
impl IoEvents for PageHost {
    fn register(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
    fn unregister(&self, _: IoEventSpec, _: &EventFd) -> iopath_devices::Result<()> {
        Ok(())
    }
    fn trap_area(&self, bar: u8, offset: u64, trap: bool) -> bool {
        self.events.lock().unwrap().push(format!("trap BAR{bar}+{offset:#x} {trap}"));
        self.trapped.store(trap && self.can_trap, Ordering::SeqCst);
        self.can_trap
    }
    fn replace_area(&self, a: iopath_devices::MappedArea) -> bool {
        self.events.lock().unwrap().push(format!("replace BAR{}+{:#x}", a.bar, a.offset));
        assert_eq!((a.size, a.fd_offset), (0x1000, 0x1000));
        *self.mapped.lock().unwrap() = Some(a.fd);
        true
    }
}

/// The guest stores `v` at word `i` of the page: into the page the host
/// maps, or, trapped, as an exit to the proxy's `bar_write`.
fn guest_store(host: &PageHost, p: &mut VfioUserProxy, i: u64, v: u32) {
    use std::os::unix::fs::FileExt;
    if host.trapped.load(Ordering::SeqCst) {
        p.bar_write(0, 0x1000 + 4 * i, &v.to_le_bytes());
    } else {
        host.mapped.lock().unwrap().as_ref().unwrap().write_all_at(&v.to_le_bytes(), 0x1000 + 4 * i).unwrap();
    }
}

type MadePaged = Arc<Mutex<Vec<Arc<Paged>>>>;

fn paged_devices() -> (impl Fn() -> iopath_devices::SharedDevice + Send + 'static, MadePaged) {
    let made: MadePaged = Arc::default();
    let m = made.clone();
    let f = move || -> iopath_devices::SharedDevice {
        let page = crate::testing::memfd("page");
        page.set_len(0x2000).unwrap();
        let d = Arc::new(Paged { page, at_resume: Mutex::new(None) });
        m.lock().unwrap().push(d.clone());
        d
    };
    (f, made)
}

/// A proxy on `servers`, attached to `host` as a VMM would: the page mapped.
fn attached_to(servers: &Servers, host: &Arc<PageHost>) -> (VfioUserProxy, Arc<Mutex<Vec<String>>>) {
    let mut p = servers.connect();
    let failed = Arc::new(Mutex::new(Vec::new()));
    let (mut ctx, _) = vmm_context();
    let f = failed.clone();
    ctx.fail = Arc::new(move |m| f.lock().unwrap().push(m));
    ctx.ioevents = host.clone();
    *host.mapped.lock().unwrap() = Some(p.mapped_areas().remove(0).fd);
    p.attach(ctx);
    (p, failed)
}

#[test]
fn a_bar_page_is_trapped_at_the_death_carried_before_the_resume_and_the_new_one_mapped() {
    let (make, made) = paged_devices();
    let (servers, _) = Servers::start(make);
    let host = Arc::new(PageHost {
        can_trap: true,
        events: Mutex::default(),
        mapped: Mutex::default(),
        trapped: false.into(),
    });
    let (mut p, failed) = attached_to(&servers, &host);
    guest_store(&host, &mut p, 0, 0x11);
    servers.kill();
    // Before the proxy knows: into the dead process's page.
    guest_store(&host, &mut p, 1, 0x22);
    // A store that exits (the page trapped) meets the dead server: the proxy
    // reconnects, and the store reaches the new process.
    p.bar_write(0, 0x1008, &0x33u32.to_le_bytes());
    assert_eq!(p.reconnects(), 1, "{:?}", failed.lock().unwrap());
    let events = host.events.lock().unwrap().clone();
    assert_eq!(events, ["trap BAR0+0x1000 true", "replace BAR0+0x1000", "trap BAR0+0x1000 false"]);
    let devs = made.lock().unwrap().clone();
    assert_eq!(devs.len(), 2, "two processes of the device");
    // What the old page held, in the new one before it resumed; then the forwarded store.
    assert_eq!(*devs[1].at_resume.lock().unwrap(), Some([0x11, 0x22, 0, 0]));
    assert_eq!([0, 1, 2, 3].map(|i| devs[1].word(i)), [0x11, 0x22, 0x33, 0]);
    // The host maps the new page, and the proxy calls it its own.
    let new = ino(&devs[1].page);
    assert_ne!(new, ino(&devs[0].page));
    assert_eq!(ino(host.mapped.lock().unwrap().as_ref().unwrap()), new);
    assert_eq!(ino(&p.mapped_areas()[0].fd), new);
    guest_store(&host, &mut p, 3, 0x44);
    assert_eq!(devs[1].word(3), 0x44, "the guest's stores land in the new page");
    // A second death: the page carried again, from the second process's.
    servers.kill();
    p.bar_write(0, 0x1000, &0x55u32.to_le_bytes());
    assert_eq!(p.reconnects(), 2);
    let devs = made.lock().unwrap().clone();
    assert_eq!(*devs[2].at_resume.lock().unwrap(), Some([0x11, 0x22, 0x33, 0x44]));
    assert_eq!(devs[2].word(0), 0x55);
    assert!(failed.lock().unwrap().is_empty(), "{:?}", failed.lock().unwrap());
}

#[test]
fn a_bar_page_the_vmm_cannot_trap_stops_the_run_saying_why() {
    let (make, _) = paged_devices();
    let (servers, _) = Servers::start(make);
    let host = Arc::new(PageHost {
        can_trap: false,
        events: Mutex::default(),
        mapped: Mutex::default(),
        trapped: false.into(),
    });
    let (mut p, failed) = attached_to(&servers, &host);
    servers.kill();
    let mut v = [0u8; 4];
    p.bar_read(0, 0, &mut v);
    assert_eq!((p.reconnects(), v), (0, [0xff; 4]));
    let f = failed.lock().unwrap();
    assert!(f.len() == 1 && f[0].contains("could not take the BAR0 page at 0x1000 out of the guest"), "{f:?}");
    assert_eq!(servers.recs.lock().unwrap().iter().filter(|r| r.session > 0).count(), 0, "no new session");
}

#[test]
fn carrying_bar_pages_refuses_a_new_page_past_its_fd_and_more_than_the_bound() {
    use super::super::proxy::reconnect::{carry_pages, MAX_CARRIED};
    let area = |size: u64, len: u64| {
        let fd = crate::testing::memfd("page");
        fd.set_len(len).unwrap();
        iopath_devices::MappedArea { bar: 0, offset: 0x1000, size, fd, fd_offset: 0 }
    };
    assert!(carry_pages(&[area(0x1000, 0x1000)], &[area(0x1000, 0x1000)]).is_ok());
    let e = carry_pages(&[area(0x1000, 0x1000)], &[area(0x1000, 0x800)]).unwrap_err().to_string();
    assert!(e.contains("past its fd"), "{e}");
    let big = MAX_CARRIED + 0x1000;
    let e = carry_pages(&[area(big, 0)], &[area(big, 0)]).unwrap_err().to_string();
    assert!(e.contains("a reconnect carries"), "{e}");
}
