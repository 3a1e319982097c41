//! The VMM side of vfio-user: a device in another process as a
//! [`DeviceModel`](iopath_devices::DeviceModel) the VMM hosts.
//!
//! [`VfioUserProxy`] composes one part per concern, each in its file:
//! - `channel`: the request/reply exchange and its failure policy;
//! - `discovery` (and `io_fds`): what `connect` learns — version, identity,
//!   BARs, sparse mmap areas, MSI-X placement, the io fds offered;
//! - `msix`: the MSI-X table and PBA, emulated here, never forwarded;
//! - `dma`: guest RAM for the device process (DMA_MAP at attach, and
//!   DMA_READ/WRITE answered while a reply is awaited);
//! - `reconnect`: a new process of the device when one dies, the session
//!   replayed on it, its state memory handed back and its BAR pages (the
//!   guest's stores in the dead process's, carried over) mapped in place of
//!   the old ones;
//! - `config`: what the VMM asks of the proxy (state memory on or off).
//!
//! This file owns the attach and the forwarding of accesses. At attach the
//! proxy maps guest RAM into the device process, installs the ioeventfds the
//! server announced, and hands over the INTx eventfds if the device has
//! INTx. BAR accesses go on a region fd if one covers them, else as
//! REGION_READ/WRITE; configuration writes are forwarded without the bytes
//! of a capability's ID and next pointer (libvfio-user refuses a write that
//! touches them: MSI-X Enable goes as Message Control alone, 16 bits at
//! cap + 2).
//!
//! An error reply is the answer to one request (a BAR read gives all-ones,
//! a write is dropped; both are counted) or, to an optional step of the
//! attach, a log line; any other error reconnects (a device process the
//! VMM started, or an external socket with a reconnect window: see
//! `reconnect`) or ends the peer (the run stops, accesses read all-ones).
//!
//! Deployed servers differ from the spec and from each other; each part
//! says what it does about it (GET_REGION_IO_FDS only at minor >= 1 in
//! `discovery`, both io fd entry layouts in `io_fds`, the capability
//! headers here).

mod channel;
mod config;
mod discovery;
mod dma;
mod io_fds;
mod msix;
pub(in crate::vfio_user) mod reconnect;

pub use config::{ProxyConfig, StateMemoryMode};
pub use reconnect::{BURST_WINDOW, MAX_BURST, RECONNECTS, RESPAWN_WINDOW};

use super::ioregionfd::{RegionClient, COMMANDS};
use super::wire::*;
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::{Error, Result};
use channel::Channel;
use discovery::Device;
use iopath_devices::{
    le_fill, le_value, BarSpec, Counter, DeviceContext, DeviceModelMut, IoEventSpec, MappedArea, PciIds, SharedDevice,
};
use msix::MsixEmulation;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use vmm_sys_util::eventfd::EventFd;

/// The proxy counter of requests sent (one per access that crossed as a message).
pub const REQUESTS: &str = "vfio-user.requests";
/// The proxy counter of the bytes of state memory the device keeps its
/// state in (absent: none, e.g. `--state-memory off`).
pub const STATE_MEMORY_BYTES: &str = "vfio-user.state-memory-bytes";

/// A device in another process over vfio-user (or its ioregionfd extension).
pub struct VfioUserProxy {
    /// The socket to the server, with the DMA service run while it waits.
    pub(super) chan: Channel,
    /// The device as `connect` found it.
    dev: Device,
    /// Ioeventfds the server announced: installed as KVM ioeventfds at attach.
    pub(super) ioevents: Vec<(IoEventSpec, EventFd)>,
    /// ioregionfd regions the server announced, by BAR.
    pub(super) regions: Vec<(u8, RegionClient)>,
    /// The device's MSI-X, if it has one, emulated here.
    pub(super) msix: Option<MsixEmulation>,
    /// ioregionfd commands of regions already closed.
    region_commands: u64,
    /// Error replies to BAR accesses (each read as all-ones, or a dropped write).
    error_replies: u64,
    /// Where a new process of the device comes from, if one dies.
    source: reconnect::Source,
    /// What a reconnect replays, and its state memory.
    session: reconnect::Session,
    /// What the VMM asked of the proxy.
    cfg: ProxyConfig,
    /// State memory is off where a death would have been reconnected:
    /// the run's end says why it was not.
    stops_for_state_off: bool,
}

/// The runs of a configuration write at `offset` that touch no
/// capability's first two bytes: (offset, bytes) each. An aligned access
/// leaves one run at most (a capability starts a dword).
fn without_cap_headers<'a>(headers: &[usize], offset: usize, data: &'a [u8]) -> Vec<(usize, &'a [u8])> {
    let header = |i: &usize| headers.iter().any(|&h| (h..h + 2).contains(&(offset + i)));
    let mut runs = Vec::new();
    let mut i = 0;
    while i < data.len() {
        if header(&i) {
            i += 1;
            continue;
        }
        let end = (i..data.len()).find(header).unwrap_or(data.len());
        runs.push((offset + i, &data[i..end]));
        i = end;
    }
    runs
}

impl VfioUserProxy {
    /// Negotiates the version, reads the device's regions, identity and
    /// announced io fds, and hands over fresh state memory if the server's
    /// device keeps state. A device process the VMM started (an iopath
    /// one) is started again if it dies; an external socket is waited for
    /// if `respawn::set_socket_wait` set a wait.
    pub fn connect(sock: UnixStream, child: Option<DeviceProcess>) -> Result<Self> {
        Self::connect_with(sock, child, ProxyConfig::default())
    }

    /// [`connect`](Self::connect) as `cfg` asks: with state memory off,
    /// VERSION offers none, and a death stops the run (no reconnect).
    pub fn connect_with(sock: UnixStream, child: Option<DeviceProcess>, cfg: ProxyConfig) -> Result<Self> {
        let source = reconnect::Source::of(&sock, child.as_ref());
        Self::connect_from(sock, child, source, cfg)
    }

    /// [`connect_with`](Self::connect_with) with where a new process comes from.
    pub(in crate::vfio_user) fn connect_from(
        sock: UnixStream,
        child: Option<DeviceProcess>,
        source: reconnect::Source,
        cfg: ProxyConfig,
    ) -> Result<Self> {
        let mut chan = Channel::new(Peer::new(sock, "vfio-user", child));
        let found = discovery::discover_offering(&mut chan, cfg.state_memory.on())?;
        // Without state memory a new process could not resume a device
        // with state: nothing is reconnected (the death's message says so).
        let stops_for_state_off = !cfg.state_memory.on() && source.enabled();
        let source = if stops_for_state_off { reconnect::Source::None } else { source };
        chan.reconnects = source.enabled();
        let mut p = VfioUserProxy {
            chan,
            dev: found.device,
            ioevents: found.io.ioevents,
            regions: found.io.regions,
            msix: found.msix.map(MsixEmulation::new),
            region_commands: 0,
            error_replies: 0,
            source,
            session: Default::default(),
            cfg,
            stops_for_state_off,
        };
        p.adopt_fresh_state(found.state_len)?;
        Ok(p)
    }

    /// [`connect`](Self::connect), named `name` in reports, as the VMM hosts it.
    pub fn shared(sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        Self::shared_with(sock, child, name, ProxyConfig::default())
    }

    /// [`shared`](Self::shared) as `cfg` asks ([`connect_with`](Self::connect_with)).
    pub fn shared_with(
        sock: UnixStream,
        child: Option<DeviceProcess>,
        name: &str,
        cfg: ProxyConfig,
    ) -> Result<SharedDevice> {
        let mut p = Self::connect_with(sock, child, cfg)?;
        p.set_name(name);
        let p = Arc::new(Mutex::new(p));
        iopath_devices::lock(&p).session.me = Some(Arc::downgrade(&p));
        Ok(p)
    }

    /// What the VMM asked of the proxy.
    pub fn config(&self) -> ProxyConfig {
        self.cfg
    }

    /// Reconnects so far.
    pub fn reconnects(&self) -> u64 {
        self.session.reconnects
    }

    pub fn set_name(&mut self, name: &str) {
        self.chan.peer.name = name.to_string();
    }

    /// A BAR access that failed: an error reply is the answer to that access
    /// (logged, counted; a read gives all-ones), anything else ends the peer.
    fn access_failed(&mut self, e: Error) {
        if !matches!(e, Error::Remote { .. }) {
            return self.chan.broke(&e);
        }
        self.error_replies += 1;
        if self.error_replies.is_power_of_two() {
            let (name, n) = (&self.chan.peer.name, self.error_replies);
            log::warn!("{name}: {e} ({n} error replies to BAR accesses so far)");
        }
    }

    fn region_of(&mut self, bar: u8, offset: u64, len: usize) -> Option<&mut RegionClient> {
        self.regions.iter_mut().find(|(b, r)| *b == bar && r.covers(offset, len)).map(|(_, r)| r)
    }

    /// What the attach does: guest RAM to the device process, the announced
    /// ioeventfds into KVM, the INTx eventfds to a device that has INTx. An
    /// error reply to any of these steps is logged and the attach goes on
    /// (a server may have no use for DMA, or take no resample fd); a broken
    /// channel ends it.
    fn setup(&mut self, ctx: &DeviceContext) -> Result<()> {
        dma::map_guest_ram(&mut self.chan, &ctx.mem)?;
        for (spec, fd) in &self.ioevents {
            ctx.ioevents.register(*spec, fd).map_err(|e| Error::from(e).context(format!("installing {spec:?}")))?;
        }
        self.hand_over_intx(ctx)
    }

    /// INTx's trigger and resample eventfds to the device process, only if
    /// the device has INTx (GET_IRQ_INFO), as QEMU asks first.
    fn hand_over_intx(&mut self, ctx: &DeviceContext) -> Result<()> {
        let Some((t, r)) = ctx.irq.intx_eventfds() else { return Ok(()) };
        if discovery::irq_count(&mut self.chan, PCI_INTX_IRQ_INDEX)? < 1 {
            return Ok(());
        }
        for (action, fd, what) in [
            (IRQ_SET_ACTION_TRIGGER, &t, "SET_IRQS INTx trigger"),
            (IRQ_SET_ACTION_UNMASK, &r, "SET_IRQS INTx resample (unmask)"),
        ] {
            let flags = IRQ_SET_DATA_EVENTFD | action;
            let q = IrqSet { flags, index: PCI_INTX_IRQ_INDEX, start: 0, count: 1, data: vec![] };
            if !self.chan.optional(what, Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()])? {
                break;
            }
        }
        Ok(())
    }
}

impl DeviceModelMut for VfioUserProxy {
    fn name(&self) -> String {
        self.chan.peer.name.clone()
    }
    /// DMA_MAP passes guest RAM's fds.
    fn shares_guest_ram(&self) -> bool {
        true
    }
    fn ids(&self) -> PciIds {
        self.dev.ids
    }
    fn bars(&self) -> Vec<BarSpec> {
        self.dev.bars.clone()
    }

    fn attach(&mut self, mut ctx: DeviceContext) {
        if self.stops_for_state_off {
            let fail = ctx.fail.clone();
            ctx.fail = Arc::new(move |m: String| fail(format!("{m}; {}", config::NO_RECONNECT_STATE_OFF)));
        }
        self.chan.peer.fail = Some(ctx.fail.clone());
        self.chan.dma.mem = Some(ctx.mem.clone());
        if let Some(m) = &mut self.msix {
            m.attach(ctx.irq.clone());
        }
        self.session.ctx = Some(ctx.clone());
        match self.setup(&ctx) {
            Ok(()) if self.source.enabled() => self.watch(),
            Ok(()) => self.chan.peer.watch(),
            // A reconnect replays the whole attach on the new process.
            Err(e) if self.source.enabled() && !matches!(e, Error::Remote { .. }) => {
                if self.recover(&e.to_string()) {
                    self.watch();
                }
            }
            Err(e) => self.chan.peer.die(&e),
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if self.msix.as_mut().is_some_and(|m| m.bar_read(bar, offset, data)) {
            return;
        }
        let n = data.len();
        let v = self.retried(|p| match p.region_of(bar, offset, n) {
            Some(r) => r.read(offset, n),
            None => p.chan.region_read(bar as u32, offset, n as u32).map(|d| le_value(&d)),
        });
        match v {
            Ok(v) => le_fill(data, v),
            Err(e) => {
                self.access_failed(e);
                data.fill(0xff);
            }
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if self.msix.as_mut().is_some_and(|m| m.bar_write(&mut self.chan, bar, offset, data)) {
            return;
        }
        let r = self.retried(|p| match p.region_of(bar, offset, data.len()) {
            Some(r) => r.write(offset, data.len(), le_value(data)),
            None => p.chan.region_write(bar as u32, offset, data),
        });
        if let Err(e) = r {
            self.access_failed(e);
        }
    }

    fn mapped_areas(&self) -> Vec<MappedArea> {
        self.dev
            .areas
            .iter()
            .filter_map(|a| {
                let fd = a.fd.try_clone().ok()?;
                Some(MappedArea { bar: a.bar, offset: a.offset, size: a.size, fd, fd_offset: a.fd_offset })
            })
            .collect()
    }

    fn config_read(&mut self, offset: usize, data: &mut [u8]) -> bool {
        // The BARs and the expansion ROM BAR are the VMM's, as QEMU emulates
        // them: its header sizes and places them as it maps them, whatever
        // the server's configuration space does with a sizing write (writes
        // still go to the server). A configuration access stays within one
        // dword, so it is all BAR or none.
        if (0x10..0x28).contains(&offset) || (0x30..0x34).contains(&offset) {
            return false;
        }
        let n = data.len() as u32;
        match self.retried(|p| p.chan.region_read(PCI_CONFIG_REGION_INDEX, offset as u64, n)) {
            Ok(d) => data.copy_from_slice(&d),
            Err(_) => data.fill(0xff),
        }
        if let Some(m) = &self.msix {
            m.config_read(offset, data);
        }
        true
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        if let Some(m) = &mut self.msix {
            m.config_write(&mut self.chan, offset, data);
        }
        // Without the bytes of a capability's ID and next pointer (a guest
        // that enables MSI-X with a dword write at the capability sends its
        // Message Control alone, 16 bits at cap + 2, as libvfio-user takes it).
        // Kept for a reconnect's replay (before it is sent: a reconnect
        // this write meets replays it).
        self.session.config_written(offset, data);
        let headers = self.dev.cap_headers.clone();
        let r = self.retried(|p| {
            for (at, bytes) in without_cap_headers(&headers, offset, data) {
                match p.chan.region_write(PCI_CONFIG_REGION_INDEX, at as u64, bytes) {
                    Ok(()) | Err(Error::Remote { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        });
        if let Err(e) = r {
            self.chan.broke(&e);
        }
    }

    fn reset(&mut self) {
        // The configuration the guest wrote is gone with the reset.
        self.session.config.clear();
        if let Err(e) = self.retried(|p| p.chan.request(Command::DeviceReset, &[], &[])) {
            if !matches!(e, Error::Remote { .. }) {
                self.chan.broke(&e);
            }
        }
        if let Some(m) = &mut self.msix {
            m.reset();
        }
    }

    fn quiesce(&mut self) {
        self.session.ending.store(true, std::sync::atomic::Ordering::Release);
        self.region_commands += self.regions.iter().map(|(_, r)| r.commands).sum::<u64>();
        self.regions.clear();
        self.chan.peer.end();
    }

    fn counters(&self) -> Vec<Counter> {
        let mut c = self.chan.peer.remote.clone();
        c.push(Counter { name: REQUESTS.into(), value: self.chan.requests });
        c.push(Counter { name: "vfio-user.dma-requests".into(), value: self.chan.dma.requests });
        c.push(Counter { name: "vfio-user.error-replies".into(), value: self.error_replies });
        if let Some(m) = &self.session.state {
            c.push(Counter { name: STATE_MEMORY_BYTES.into(), value: m.len() as u64 });
        }
        if self.source.enabled() {
            c.push(Counter { name: RECONNECTS.into(), value: self.session.reconnects });
            c.push(Counter { name: reconnect::RECONNECT_US.into(), value: self.session.reconnect_us });
        }
        let cmds: u64 = self.regions.iter().map(|(_, r)| r.commands).sum();
        c.push(Counter { name: COMMANDS.into(), value: self.region_commands + cmds });
        c
    }
}

#[cfg(test)]
mod tests {
    use super::without_cap_headers;

    #[test]
    fn configuration_writes_lose_exactly_the_bytes_of_capability_headers() {
        let headers = [0x40, 0x50, 0x52];
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        for offset in 0x3c..0x58 {
            for len in 1..=data.len() {
                let runs = without_cap_headers(&headers, offset, &data[..len]);
                // The oracle: each byte on its own, kept unless a header's.
                let kept: Vec<(usize, u8)> = (0..len)
                    .filter(|i| !headers.iter().any(|&h| h == offset + i || h + 1 == offset + i))
                    .map(|i| (offset + i, data[i]))
                    .collect();
                let got: Vec<(usize, u8)> =
                    runs.iter().flat_map(|(at, b)| b.iter().enumerate().map(move |(i, &v)| (at + i, v))).collect();
                assert_eq!(got, kept, "offset {offset:#x} len {len}");
                // Runs are maximal: two in a row never touch.
                assert!(runs.windows(2).all(|w| w[0].0 + w[0].1.len() < w[1].0), "{runs:?}");
            }
        }
        // MSI-X Enable as a dword write at the capability: Message Control alone.
        let enable = 0x8000_0011u32.to_le_bytes();
        assert_eq!(without_cap_headers(&[0x40], 0x40, &enable), [(0x42, &enable[2..])]);
    }
}
