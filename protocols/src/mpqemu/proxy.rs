//! The VMM side of mpqemu (what QEMU's `x-pci-proxy-dev` does): a device in
//! another process as a [`DeviceModel`](iopath_devices::DeviceModel) the VMM
//! hosts. Every access is synchronous: the vCPU waits for RET.

use super::wire::{recv_reply, send, Msg, SysmemRegion, MAX_FDS};
use crate::function::probe;
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::{Error, Result};
use iopath_devices::pci::ConfigSpace;
use iopath_devices::{le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, PciIds};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

/// The proxy counter of requests sent (one per access that crossed).
pub const REQUESTS: &str = "mpqemu.requests";

/// A device in another process, reached over mpqemu. It is a device model
/// to the VMM: configuration and BAR accesses are forwarded
/// and waited for; guest RAM and the INTx eventfds are handed over at attach.
pub struct MpqemuProxy {
    pub(super) peer: Peer,
    ids: PciIds,
    bars: Vec<BarSpec>,
    /// The configuration the guest programmed, to turn (BAR, offset) into
    /// the absolute addresses mpqemu carries.
    shadow: ConfigSpace,
    requests: u64,
}

const NO_IDS: PciIds =
    PciIds { vendor: 0, device: 0, class: 0, revision: 0, subsystem_vendor: 0, subsystem: 0, interrupt_pin: 0 };

impl MpqemuProxy {
    /// Probes the remote device's identity and BARs over `sock`, the way
    /// QEMU's proxy does (configuration reads, BAR sizing: [`probe`]).
    pub fn connect(sock: UnixStream, child: Option<DeviceProcess>) -> Result<Self> {
        let mut p = MpqemuProxy {
            peer: Peer::new(sock, "mpqemu", child),
            ids: PciIds { vendor: 0xffff, device: 0xffff, ..NO_IDS },
            bars: Vec::new(),
            shadow: ConfigSpace::new(NO_IDS, &[])?,
            requests: 0,
        };
        (p.ids, p.bars) = probe(|reg, write| match write {
            None => p.cfg_read(reg, 4),
            Some(v) => p.cfg_write(reg, v, 4).map(|()| 0),
        })?;
        p.shadow = ConfigSpace::new(p.ids, &p.bars).map_err(|e| Error::from(e).context("the remote's BARs"))?;
        p.peer.name = format!("mpqemu:{:04x}:{:04x}", p.ids.vendor, p.ids.device);
        Ok(p)
    }

    /// Names the device in reports (e.g. "pci-testdev@mpqemu").
    pub fn set_name(&mut self, name: &str) {
        self.peer.name = name.to_string();
    }

    /// Sends a request and waits for its RET. mpqemu has no error reply
    /// (a refusal is RET u64::MAX, a value): any error ends the peer.
    fn call(&mut self, msg: Msg) -> Result<u64> {
        self.peer.alive()?;
        self.requests += 1;
        let r = self.exchange(&msg);
        if let Err(e) = &r {
            self.peer.die(e);
        }
        r
    }

    fn exchange(&self, msg: &Msg) -> Result<u64> {
        let sock = &self.peer.sock;
        send(sock, msg, &[], "sending to the device process")?;
        match recv_reply(sock)? {
            Some((Msg::Ret(v), _)) => Ok(v),
            Some((m, _)) => Err(Error::protocol(format!("device process answered command {} instead of RET", m.cmd()))),
            None => Err(Error::PeerGone("the device process closed the mpqemu socket".into())),
        }
    }

    fn cfg_read(&mut self, addr: u32, len: i32) -> Result<u32> {
        self.call(Msg::CfgRead { addr, len }).map(|v| v as u32)
    }

    fn cfg_write(&mut self, addr: u32, val: u32, len: i32) -> Result<()> {
        self.call(Msg::CfgWrite { addr, val, len }).map(|_| ())
    }

    fn bar_addr(&self, bar: u8, offset: u64) -> Option<(u64, bool)> {
        let p = self.shadow.bar_placement(bar)?;
        Some((p.addr + offset, p.spec.kind != BarKind::Io))
    }

    fn share_memory(&mut self, ctx: &DeviceContext) -> Result<()> {
        let mut regions = Vec::new();
        let mut fds = Vec::new();
        for r in ctx.mem.mapped().iter() {
            let Some(fo) = r.file_offset() else {
                return Err(Error::Config("guest RAM is not fd-backed; mpqemu needs a memfd".into()));
            };
            regions.push(SysmemRegion { gpa: r.start_addr().0, size: r.len(), offset: fo.start() });
            fds.push(fo.file().as_raw_fd());
        }
        // QEMU's remote refuses 8 regions although the message has room for them.
        if regions.is_empty() || regions.len() > MAX_FDS - 1 {
            return Err(Error::Config(format!("{} guest RAM regions; mpqemu carries 1..=7", regions.len())));
        }
        send(&self.peer.sock, &Msg::SyncSysmem(regions), &fds, "SYNC_SYSMEM")
    }
}

impl DeviceModelMut for MpqemuProxy {
    fn name(&self) -> String {
        self.peer.name.clone()
    }
    /// SYNC_SYSMEM passes guest RAM's fds.
    fn shares_guest_ram(&self) -> bool {
        true
    }
    fn ids(&self) -> PciIds {
        self.ids
    }
    fn bars(&self) -> Vec<BarSpec> {
        self.bars.clone()
    }

    fn attach(&mut self, ctx: DeviceContext) {
        self.peer.fail = Some(ctx.fail.clone());
        if let Err(e) = self.share_memory(&ctx) {
            self.peer.die(&e);
            return;
        }
        if let Some((t, r)) = ctx.irq.intx_eventfds() {
            if let Err(e) = send(&self.peer.sock, &Msg::SetIrqfd, &[t.as_raw_fd(), r.as_raw_fd()], "SET_IRQFD") {
                self.peer.die(&e);
                return;
            }
        }
        self.peer.watch();
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        let v = match self.bar_addr(bar, offset) {
            Some((addr, memory)) => self.call(Msg::BarRead { addr, size: data.len() as u32, memory }).ok(),
            None => None, // the BAR is not decoded
        };
        le_fill(data, v.unwrap_or(u64::MAX));
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if let Some((addr, memory)) = self.bar_addr(bar, offset) {
            let _ = self.call(Msg::BarWrite { addr, val: le_value(data), size: data.len() as u32, memory });
        }
    }

    fn config_read(&mut self, offset: usize, data: &mut [u8]) -> bool {
        let v = self.cfg_read(offset as u32, data.len() as i32).unwrap_or(u32::MAX);
        le_fill(data, v as u64);
        true
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        if offset + data.len() <= iopath_devices::pci::CONFIG_SIZE {
            self.shadow.write(offset, data);
        }
        let _ = self.cfg_write(offset as u32, le_value(data) as u32, data.len() as i32);
    }

    fn reset(&mut self) {
        let _ = self.call(Msg::DeviceReset);
    }

    /// Ends the session: the device process reports its counters.
    fn quiesce(&mut self) {
        self.peer.end();
    }

    fn counters(&self) -> Vec<Counter> {
        let mut c = self.peer.remote.clone();
        c.push(Counter { name: REQUESTS.into(), value: self.requests });
        c
    }
}
