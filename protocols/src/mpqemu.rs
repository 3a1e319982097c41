//! QEMU's multi-process protocol ("mpqemu", QEMU 6.0..): the VMM side as
//! [`MpqemuProxy`] (what QEMU's `x-pci-proxy-dev` does) and the device side
//! as [`serve`] (what QEMU's `-machine x-remote` does), byte-compatible with
//! QEMU 7.2 on x86-64.
//!
//! Wire format (native layout, host endian, no version): a 16-byte header
//! `{i32 cmd; u32 pad; u64 size}` then `size` bytes of the data union, fds as
//! SCM_RIGHTS with the header. Commands: SYNC_SYSMEM 0 (guest RAM as up to 8
//! fds with gpas/sizes/offsets; no reply), RET 1 (the reply, u64), PCI_CFGWRITE
//! 2 / PCI_CFGREAD 3 `{u32 addr; u32 val; i32 len}`, BAR_WRITE 4 / BAR_READ 5
//! `{u64 addr; u64 val; u32 size; u8 memory; pad}` where addr is the absolute
//! guest address or port, SET_IRQFD 6 (two fds: INTx trigger and resample;
//! no reply) and DEVICE_RESET 7. Every request but SYNC_SYSMEM and SET_IRQFD
//! is answered by RET; an error answers u64::MAX. Every access is
//! synchronous: the vCPU waits for RET.

use crate::function::{map_guest_memory, no_memory, PciFunction, SharedRegion};
use iopath_devices::irq::IrqLines;
use crate::peer::Peer;
use crate::process::DeviceProcess;
use crate::socket;
use iopath_devices::pci::ConfigSpace;
use iopath_devices::{
    le_fill, le_value, BarKind, BarSpec, Counter, DeviceContext, DeviceModelMut, NoIoEvents, PciIds,
};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

pub const HEADER_SIZE: usize = 16;
/// sizeof the data union (SyncSysmemMsg: 3 x 8 x u64).
pub const MAX_DATA: usize = 192;
pub const MAX_FDS: usize = 8;

pub const SYNC_SYSMEM: i32 = 0;
pub const RET: i32 = 1;
pub const PCI_CFGWRITE: i32 = 2;
pub const PCI_CFGREAD: i32 = 3;
pub const BAR_WRITE: i32 = 4;
pub const BAR_READ: i32 = 5;
pub const SET_IRQFD: i32 = 6;
pub const DEVICE_RESET: i32 = 7;

const CONF_SIZE: usize = 12;
const BAR_SIZE: usize = 24;

/// One memory region of SYNC_SYSMEM (its fd travels beside it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SysmemRegion {
    pub gpa: u64,
    pub size: u64,
    pub offset: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    SyncSysmem(Vec<SysmemRegion>),
    Ret(u64),
    CfgWrite { addr: u32, val: u32, len: i32 },
    CfgRead { addr: u32, len: i32 },
    BarWrite { addr: u64, val: u64, size: u32, memory: bool },
    BarRead { addr: u64, size: u32, memory: bool },
    SetIrqfd,
    DeviceReset,
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

impl Msg {
    pub fn cmd(&self) -> i32 {
        match self {
            Msg::SyncSysmem(_) => SYNC_SYSMEM,
            Msg::Ret(_) => RET,
            Msg::CfgWrite { .. } => PCI_CFGWRITE,
            Msg::CfgRead { .. } => PCI_CFGREAD,
            Msg::BarWrite { .. } => BAR_WRITE,
            Msg::BarRead { .. } => BAR_READ,
            Msg::SetIrqfd => SET_IRQFD,
            Msg::DeviceReset => DEVICE_RESET,
        }
    }

    /// Header and body, as QEMU lays them out.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Msg::SyncSysmem(r) => {
                let mut d = [0u64; 24];
                for (i, x) in r.iter().take(MAX_FDS).enumerate() {
                    (d[i], d[8 + i], d[16 + i]) = (x.gpa, x.size, x.offset);
                }
                d.iter().for_each(|v| body.extend_from_slice(&v.to_le_bytes()));
            }
            Msg::Ret(v) => body.extend_from_slice(&v.to_le_bytes()),
            Msg::CfgWrite { addr, val, len } => {
                body.extend_from_slice(&addr.to_le_bytes());
                body.extend_from_slice(&val.to_le_bytes());
                body.extend_from_slice(&len.to_le_bytes());
            }
            Msg::CfgRead { addr, len } => {
                body.extend_from_slice(&addr.to_le_bytes());
                body.extend_from_slice(&0u32.to_le_bytes());
                body.extend_from_slice(&len.to_le_bytes());
            }
            Msg::BarWrite { addr, val, size, memory } => bar_body(&mut body, *addr, *val, *size, *memory),
            Msg::BarRead { addr, size, memory } => bar_body(&mut body, *addr, 0, *size, *memory),
            Msg::SetIrqfd | Msg::DeviceReset => {}
        }
        let mut m = Vec::with_capacity(HEADER_SIZE + body.len());
        m.extend_from_slice(&self.cmd().to_le_bytes());
        m.extend_from_slice(&[0; 4]);
        m.extend_from_slice(&(body.len() as u64).to_le_bytes());
        m.extend_from_slice(&body);
        m
    }

    /// Decodes and validates a message as QEMU's `mpqemu_msg_valid` does:
    /// the size must be exactly the command's, and the fd count right.
    pub fn decode(cmd: i32, body: &[u8], nfds: usize) -> Result<Msg, String> {
        let need = |n: usize| {
            if body.len() == n {
                Ok(())
            } else {
                Err(format!("command {cmd}: {} bytes of data, expected {n}", body.len()))
            }
        };
        let fds = |n: std::ops::RangeInclusive<usize>| {
            if n.contains(&nfds) {
                Ok(())
            } else {
                Err(format!("command {cmd}: {nfds} fds, expected {n:?}"))
            }
        };
        Ok(match cmd {
            SYNC_SYSMEM => {
                need(MAX_DATA)?;
                fds(1..=MAX_FDS)?;
                let r = (0..nfds)
                    .map(|i| SysmemRegion {
                        gpa: u64_at(body, 8 * i),
                        size: u64_at(body, 64 + 8 * i),
                        offset: u64_at(body, 128 + 8 * i),
                    })
                    .collect();
                Msg::SyncSysmem(r)
            }
            RET => {
                // QEMU's remote answers DEVICE_RESET with an empty RET.
                fds(0..=0)?;
                match body.len() {
                    0 => Msg::Ret(0),
                    _ => {
                        need(8)?;
                        Msg::Ret(u64_at(body, 0))
                    }
                }
            }
            PCI_CFGWRITE | PCI_CFGREAD => {
                need(CONF_SIZE)?;
                fds(0..=0)?;
                let (addr, val, len) = (u32_at(body, 0), u32_at(body, 4), u32_at(body, 8) as i32);
                if cmd == PCI_CFGWRITE {
                    Msg::CfgWrite { addr, val, len }
                } else {
                    Msg::CfgRead { addr, len }
                }
            }
            BAR_WRITE | BAR_READ => {
                need(BAR_SIZE)?;
                fds(0..=0)?;
                let (addr, val, size, memory) = (u64_at(body, 0), u64_at(body, 8), u32_at(body, 16), body[20] != 0);
                if cmd == BAR_WRITE {
                    Msg::BarWrite { addr, val, size, memory }
                } else {
                    Msg::BarRead { addr, size, memory }
                }
            }
            SET_IRQFD => {
                need(0)?;
                fds(2..=2)?;
                Msg::SetIrqfd
            }
            DEVICE_RESET => {
                need(0)?;
                fds(0..=0)?;
                Msg::DeviceReset
            }
            _ => return Err(format!("unknown command {cmd}")),
        })
    }
}

fn bar_body(body: &mut Vec<u8>, addr: u64, val: u64, size: u32, memory: bool) {
    body.extend_from_slice(&addr.to_le_bytes());
    body.extend_from_slice(&val.to_le_bytes());
    body.extend_from_slice(&size.to_le_bytes());
    body.extend_from_slice(&[memory as u8, 0, 0, 0]);
}

/// Sends a message with `fds`.
pub fn send(sock: &UnixStream, msg: &Msg, fds: &[RawFd]) -> std::io::Result<()> {
    socket::send(sock, &[&msg.encode()], fds)
}

/// Receives one message. `Ok(None)` is a clean end of stream between messages.
pub fn recv(sock: &UnixStream) -> Result<Option<(Msg, Vec<File>)>, String> {
    let mut h = [0u8; HEADER_SIZE];
    let files = match socket::recv_exact(sock, &mut h) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(format!("receiving a header: {e}")),
    };
    let cmd = u32_at(&h, 0) as i32;
    let size = u64_at(&h, 8);
    if size > MAX_DATA as u64 {
        return Err(format!("command {cmd}: {size} bytes of data, more than {MAX_DATA}"));
    }
    if files.len() > MAX_FDS {
        return Err(format!("command {cmd}: {} fds, more than {MAX_FDS}", files.len()));
    }
    let mut body = vec![0u8; size as usize];
    socket::recv_exact(sock, &mut body).map_err(|e| format!("command {cmd}: receiving {size} bytes of data: {e}"))?;
    let msg = Msg::decode(cmd, &body, files.len())?;
    Ok(Some((msg, files)))
}

/// The device side: serves `f` on `sock` until the peer disconnects.
/// `Ok` on a clean disconnect; `Err` names the message that broke the
/// protocol (the caller logs it and closes the channel).
pub fn serve(sock: &UnixStream, f: &mut PciFunction, irq: &Arc<IrqLines>) -> Result<(), String> {
    let ctx = |mem| {
        let mut c = DeviceContext::detached(mem);
        c.ioevents = Arc::new(NoIoEvents);
        c.irq = irq.clone();
        c
    };
    f.attach(ctx(no_memory()));
    let reply = |v: u64| send(sock, &Msg::Ret(v), &[]).map_err(|e| format!("sending RET: {e}"));
    loop {
        let Some((msg, files)) = recv(sock)? else {
            return Ok(());
        };
        match msg {
            Msg::SyncSysmem(regions) => {
                let shared = regions
                    .iter()
                    .zip(files)
                    .map(|(r, file)| SharedRegion { gpa: r.gpa, size: r.size, offset: r.offset, file })
                    .collect();
                let mem = map_guest_memory(shared).map_err(|e| format!("SYNC_SYSMEM: {e}"))?;
                f.attach(ctx(mem));
            }
            Msg::CfgWrite { addr, val, len } => {
                if let Some(n) = conf_len(addr, len) {
                    f.config_write(addr as usize, &val.to_le_bytes()[..n]);
                    reply(0)?;
                } else {
                    log::warn!("mpqemu: PCI_CFGWRITE of {len} bytes at {addr:#x} refused");
                    reply(u64::MAX)?;
                }
            }
            Msg::CfgRead { addr, len } => match conf_len(addr, len) {
                Some(n) => {
                    let mut b = [0u8; 4];
                    f.config_read(addr as usize, &mut b[..n]);
                    reply(u32::from_le_bytes(b) as u64)?;
                }
                None => {
                    log::warn!("mpqemu: PCI_CFGREAD of {len} bytes at {addr:#x} refused");
                    reply(u64::MAX)?;
                }
            },
            Msg::BarWrite { addr, val, size, memory } => {
                match bar_target(f, addr, size, memory) {
                    Some((bar, off, n)) => f.bar_write(bar, off, &val.to_le_bytes()[..n]),
                    None => f.stray_accesses += 1,
                }
                reply(0)?;
            }
            Msg::BarRead { addr, size, memory } => {
                let v = match bar_target(f, addr, size, memory) {
                    Some((bar, off, n)) => {
                        let mut b = [0u8; 8];
                        f.bar_read(bar, off, &mut b[..n]);
                        le_value(&b[..n])
                    }
                    None => {
                        f.stray_accesses += 1;
                        u64::MAX
                    }
                };
                reply(v)?;
            }
            Msg::SetIrqfd => {
                let mut it = files.into_iter().map(iopath_devices::irq::eventfd_from);
                if let (Some(t), Some(r)) = (it.next(), it.next()) {
                    irq.connect_intx(t, r);
                }
            }
            Msg::DeviceReset => {
                f.device.reset();
                reply(0)?;
            }
            Msg::Ret(_) => return Err("RET from the proxy, which sends requests only".into()),
        }
    }
}

fn conf_len(addr: u32, len: i32) -> Option<usize> {
    let n = usize::try_from(len).ok().filter(|n| matches!(n, 1 | 2 | 4))?;
    (addr as usize + n <= 4096).then_some(n)
}

fn bar_target(f: &PciFunction, addr: u64, size: u32, memory: bool) -> Option<(u8, u64, usize)> {
    let n = size as usize;
    if !matches!(n, 1 | 2 | 4 | 8) {
        log::warn!("mpqemu: BAR access of {size} bytes at {addr:#x} refused");
        return None;
    }
    let Some((bar, off)) = f.decode(addr, n, !memory) else {
        log::warn!("mpqemu: BAR access at {} {addr:#x} hits no BAR", if memory { "memory" } else { "port" });
        return None;
    };
    Some((bar, off, n))
}


/// The VMM side: a device in another process, reached over mpqemu. It is a
/// [`DeviceModel`] to the VMM: configuration and BAR accesses are forwarded
/// and waited for; guest RAM and the INTx eventfds are handed over at attach.
pub struct MpqemuProxy {
    peer: Peer,
    ids: PciIds,
    bars: Vec<BarSpec>,
    /// The configuration the guest programmed, to turn (BAR, offset) into
    /// the absolute addresses mpqemu carries.
    shadow: ConfigSpace,
    requests: u64,
}

impl MpqemuProxy {
    /// Probes the remote device's identity and BARs over `sock`, the way
    /// QEMU's proxy does (configuration reads, BAR sizing).
    pub fn connect(sock: UnixStream, child: Option<DeviceProcess>) -> Result<Self, String> {
        let mut p = MpqemuProxy {
            peer: Peer::new(sock, "mpqemu", child),
            ids: PciIds { vendor: 0xffff, device: 0xffff, class: 0, revision: 0, subsystem_vendor: 0, subsystem: 0 },
            bars: Vec::new(),
            shadow: ConfigSpace::new(
                PciIds { vendor: 0, device: 0, class: 0, revision: 0, subsystem_vendor: 0, subsystem: 0 },
                &[],
            )?,
            requests: 0,
        };
        let id = p.cfg_read(0, 4)?;
        if id & 0xffff == 0xffff {
            return Err(format!("the remote device answers vendor id {:#x}: no device", id & 0xffff));
        }
        let class = p.cfg_read(8, 4)?;
        let sub = p.cfg_read(0x2c, 4)?;
        p.ids = PciIds {
            vendor: id as u16,
            device: (id >> 16) as u16,
            class: class >> 8,
            revision: class as u8,
            subsystem_vendor: sub as u16,
            subsystem: (sub >> 16) as u16,
        };
        let mut i = 0u8;
        while i < 6 {
            let reg = 0x10 + 4 * i as u32;
            let orig = p.cfg_read(reg, 4)?;
            p.cfg_write(reg, 0xffff_ffff, 4)?;
            let mask = p.cfg_read(reg, 4)?;
            p.cfg_write(reg, orig, 4)?;
            if mask == 0 {
                i += 1;
                continue;
            }
            let spec = if mask & 1 == 1 {
                BarSpec { index: i, kind: BarKind::Io, size: ((!(mask & !3)).wrapping_add(1) & 0xffff) as u64 }
            } else if (mask >> 1) & 3 == 2 && i < 5 {
                let hi_reg = reg + 4;
                let orig_hi = p.cfg_read(hi_reg, 4)?;
                p.cfg_write(hi_reg, 0xffff_ffff, 4)?;
                let hi = p.cfg_read(hi_reg, 4)?;
                p.cfg_write(hi_reg, orig_hi, 4)?;
                let m = ((hi as u64) << 32) | (mask & !0xf) as u64;
                BarSpec { index: i, kind: BarKind::Mem64, size: (!m).wrapping_add(1) }
            } else {
                BarSpec { index: i, kind: BarKind::Mem32, size: (!(mask & !0xf)).wrapping_add(1) as u64 }
            };
            i += if spec.kind == BarKind::Mem64 { 2 } else { 1 };
            p.bars.push(spec);
        }
        p.shadow = ConfigSpace::new(p.ids, &p.bars).map_err(|e| format!("the remote's BARs: {e}"))?;
        p.peer.name = format!("mpqemu:{:04x}:{:04x}", p.ids.vendor, p.ids.device);
        Ok(p)
    }

    /// Names the device in reports (e.g. "pci-testdev@mpqemu").
    pub fn set_name(&mut self, name: &str) {
        self.peer.name = name.to_string();
    }

    fn call(&mut self, msg: Msg) -> Result<u64, String> {
        if let Some(e) = &self.peer.dead {
            return Err(e.clone());
        }
        self.requests += 1;
        let sock = &self.peer.sock;
        let r = send(sock, &msg, &[]).map_err(|e| format!("sending to the device process: {e}")).and_then(|()| {
            match recv(sock)? {
                Some((Msg::Ret(v), _)) => Ok(v),
                Some((m, _)) => Err(format!("device process answered command {} instead of RET", m.cmd())),
                None => Err("the device process closed the mpqemu socket".to_string()),
            }
        });
        if let Err(e) = &r {
            self.peer.die(e.clone());
        }
        r
    }

    fn cfg_read(&mut self, addr: u32, len: i32) -> Result<u32, String> {
        self.call(Msg::CfgRead { addr, len }).map(|v| v as u32)
    }

    fn cfg_write(&mut self, addr: u32, val: u32, len: i32) -> Result<(), String> {
        self.call(Msg::CfgWrite { addr, val, len }).map(|_| ())
    }

    fn bar_addr(&self, bar: u8, offset: u64) -> Option<(u64, bool)> {
        let p = self.shadow.bar_placement(bar)?;
        Some((p.addr + offset, p.spec.kind != BarKind::Io))
    }

    fn share_memory(&mut self, ctx: &DeviceContext) -> Result<(), String> {
        let mut regions = Vec::new();
        let mut fds = Vec::new();
        for r in ctx.mem.iter() {
            let Some(fo) = r.file_offset() else {
                return Err("guest RAM is not fd-backed; mpqemu needs a memfd".into());
            };
            regions.push(SysmemRegion { gpa: r.start_addr().0, size: r.len(), offset: fo.start() });
            fds.push(fo.file().as_raw_fd());
        }
        // QEMU's remote refuses 8 regions although the message has room for them.
        if regions.is_empty() || regions.len() > MAX_FDS - 1 {
            return Err(format!("{} guest RAM regions; mpqemu carries 1..=7", regions.len()));
        }
        send(&self.peer.sock, &Msg::SyncSysmem(regions), &fds).map_err(|e| format!("SYNC_SYSMEM: {e}"))
    }
}

impl DeviceModelMut for MpqemuProxy {
    fn name(&self) -> String {
        self.peer.name.clone()
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
            self.peer.die(e);
            return;
        }
        if let Some((t, r)) = ctx.irq.intx_eventfds() {
            if let Err(e) = send(&self.peer.sock, &Msg::SetIrqfd, &[t.as_raw_fd(), r.as_raw_fd()]) {
                self.peer.die(format!("SET_IRQFD: {e}"));
                return;
            }
        }
        self.peer.watch();
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        let v = match self.bar_addr(bar, offset) {
            Some((addr, memory)) => self.call(Msg::BarRead { addr, size: data.len() as u32, memory }),
            None => Err("BAR not decoded".into()),
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
        c.push(Counter { name: "mpqemu.requests".into(), value: self.requests });
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use iopath_devices::testdev::PciTestDev;
    use std::sync::{Arc, Mutex};

    #[test]
    fn encodings_match_qemu_layout() {
        let m = Msg::BarWrite { addr: 0xfe00_0800, val: 0xfa, size: 1, memory: true };
        let b = m.encode();
        assert_eq!(b.len(), 16 + 24);
        assert_eq!(&b[..16], &[4, 0, 0, 0, 0, 0, 0, 0, 24, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[16..24], &0xfe00_0800u64.to_le_bytes());
        assert_eq!(&b[24..32], &0xfau64.to_le_bytes());
        assert_eq!(&b[32..40], &[1, 0, 0, 0, 1, 0, 0, 0]);
        let c = Msg::CfgRead { addr: 0x10, len: 4 }.encode();
        assert_eq!(c.len(), 16 + 12);
        assert_eq!(&c[16..], &[0x10, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0]);
        let s = Msg::SyncSysmem(vec![SysmemRegion { gpa: 0, size: 64 << 20, offset: 0 }]).encode();
        assert_eq!(s.len(), 16 + 192);
        assert_eq!(&s[16 + 64..16 + 72], &(64u64 << 20).to_le_bytes());
        assert_eq!(Msg::Ret(7).encode().len(), 24);
        for m in [
            Msg::Ret(u64::MAX),
            Msg::CfgWrite { addr: 4, val: 3, len: 2 },
            Msg::CfgRead { addr: 0x3c, len: 1 },
            Msg::BarRead { addr: 0xc083, size: 4, memory: false },
            m,
        ] {
            let e = m.encode();
            assert_eq!(Msg::decode(m.cmd(), &e[16..], 0).unwrap(), m);
        }
    }

    #[test]
    fn bad_messages_are_refused() {
        assert!(Msg::decode(99, &[], 0).unwrap_err().contains("unknown"));
        assert!(Msg::decode(BAR_WRITE, &[0; 23], 0).is_err());
        assert!(Msg::decode(BAR_WRITE, &[0; 24], 1).unwrap_err().contains("fds"));
        assert!(Msg::decode(SYNC_SYSMEM, &[0; 192], 0).is_err());
        assert!(Msg::decode(SET_IRQFD, &[], 1).is_err());
        assert!(Msg::decode(RET, &[0; 4], 0).is_err());
        assert_eq!(Msg::decode(RET, &[], 0).unwrap(), Msg::Ret(0), "QEMU's reply to DEVICE_RESET");
        // Every truncation of a valid body fails, none panics.
        let e = Msg::BarWrite { addr: 1, val: 2, size: 4, memory: true }.encode();
        for n in 0..24 {
            assert!(Msg::decode(BAR_WRITE, &e[16..16 + n], 0).is_err());
        }
    }

    fn pair() -> (UnixStream, UnixStream) {
        UnixStream::pair().unwrap()
    }

    fn server(sock: UnixStream) -> std::thread::JoinHandle<(Result<(), String>, Vec<Counter>)> {
        std::thread::spawn(move || {
            let mut f = PciFunction::new(Arc::new(Mutex::new(PciTestDev::new()))).unwrap();
            let r = serve(&sock, &mut f, &IrqLines::new());
            (r, f.counters())
        })
    }

    #[test]
    fn proxy_and_server_run_pci_testdev_over_a_socketpair() {
        let (a, b) = pair();
        let h = server(b);
        let mut p = MpqemuProxy::connect(a, None).unwrap();
        assert_eq!((p.ids().vendor, p.ids().device), (0x1b36, 0x0005));
        let bars = p.bars();
        assert_eq!(bars.len(), 2);
        assert_eq!((bars[0].kind, bars[0].size, bars[1].kind, bars[1].size), (BarKind::Mem32, 4096, BarKind::Io, 256));
        // Program the BARs as a guest would, through the proxy.
        p.config_write(0x10, &0xfe00_0000u32.to_le_bytes());
        p.config_write(0x14, &0xc000u32.to_le_bytes());
        p.config_write(0x04, &3u16.to_le_bytes());
        p.bar_write(0, 0, &[0]);
        for _ in 0..10 {
            p.bar_write(0, 2048, &[0xfa]);
        }
        let mut c = [0u8; 4];
        p.bar_read(0, 12, &mut c);
        assert_eq!(u32::from_le_bytes(c), 10);
        let mut id = [0u8; 2];
        assert!(p.config_read(2, &mut id));
        assert_eq!(u16::from_le_bytes(id), 0x0005);
        drop(p);
        let (r, counters) = h.join().unwrap();
        r.unwrap();
        assert!(counters.contains(&Counter { name: "mmio-no-eventfd.exits".into(), value: 10 }));
    }

    #[test]
    fn a_hostile_peer_gets_the_channel_closed_not_a_panic() {
        for bad in [
            Msg::BarWrite { addr: 0, val: 0, size: 3, memory: true }.encode(),
            {
                let mut m = Msg::Ret(0).encode();
                m[8] = 200; // size larger than the data union
                m
            },
            vec![42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ] {
            let (a, b) = pair();
            let h = server(b);
            let _ = socket::send(&a, &[&bad], &[]);
            // An odd-sized BAR access is answered and refused; the stream
            // then ends cleanly. The others break the protocol.
            if bad[0] == BAR_WRITE as u8 {
                assert_eq!(recv(&a).unwrap().unwrap().0, Msg::Ret(0));
            }
            drop(a);
            let (r, c) = h.join().unwrap();
            if bad[0] == BAR_WRITE as u8 {
                assert!(r.is_ok());
                assert!(c.contains(&Counter { name: "stray-accesses".into(), value: 1 }));
            } else {
                assert!(r.is_err(), "{bad:?}");
            }
        }
    }

    #[test]
    fn a_dead_device_process_fails_the_proxy() {
        let (a, b) = pair();
        let h = server(b);
        let mut p = MpqemuProxy::connect(a, None).unwrap();
        let failed = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let f2 = failed.clone();
        let mut ctx = DeviceContext::detached(iopath_devices::GuestMemoryMmap::default());
        ctx.fail = Arc::new(move |m| f2.lock().unwrap().push(m));
        p.peer.fail = Some(ctx.fail.clone());
        p.peer.watch();
        // Kill the server side by shutting the socket from its end.
        p.peer.sock.try_clone().unwrap().shutdown(std::net::Shutdown::Write).unwrap();
        let _ = h.join();
        let t0 = std::time::Instant::now();
        while failed.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!failed.lock().unwrap().is_empty(), "no failure reported");
        let mut b = [0u8; 4];
        p.bar_read(0, 0, &mut b);
        assert_eq!(b, [0xff; 4]);
    }
}

#[cfg(test)]
pub(crate) mod irq_tests {
    use crate::function::{map_guest_memory, SharedRegion};
    use iopath_devices::irq::IrqLines;
    use iopath_devices::{DeviceContext, DeviceModelMut, Interrupts};
    use std::fs::File;
    use std::sync::Arc;
    use std::time::Duration;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    /// A memfd-backed guest memory and an INTx pair, as the VMM gives a proxy.
    pub fn vmm_context() -> (DeviceContext, EventFd) {
        let name = std::ffi::CString::new("ram").unwrap();
        use std::os::fd::FromRawFd;
        // SAFETY: memfd_create with a valid name; the fd is owned by the File.
        let memfd = unsafe { File::from_raw_fd(libc::memfd_create(name.as_ptr(), 0)) };
        memfd.set_len(1 << 20).unwrap();
        let mem = map_guest_memory(vec![SharedRegion { gpa: 0, size: 1 << 20, offset: 0, file: memfd }]).unwrap();
        let lines = IrqLines::new();
        let trigger = EventFd::new(EFD_NONBLOCK).unwrap();
        lines.connect_intx(trigger.try_clone().unwrap(), EventFd::new(EFD_NONBLOCK).unwrap());
        let mut ctx = DeviceContext::detached(mem);
        ctx.irq = lines;
        (ctx, trigger)
    }

    /// Asserts INTx from the device side and sees it on the VMM's trigger fd.
    pub fn device_intx_reaches(device_side: &Arc<IrqLines>, trigger: &EventFd) {
        let t0 = std::time::Instant::now();
        while device_side.intx_eventfds().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(2), "the device process never got the INTx fds");
            std::thread::sleep(Duration::from_millis(5));
        }
        device_side.set_intx(true);
        assert!(iopath_devices::irq::wait_readable(trigger, Duration::from_secs(2)));
        assert_eq!(trigger.read().unwrap(), 1);
    }

    #[test]
    fn set_irqfd_hands_intx_and_guest_ram_to_the_device_process() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let irq = IrqLines::new();
        let irq2 = irq.clone();
        let h = std::thread::spawn(move || {
            let mut f = crate::function::PciFunction::new(std::sync::Arc::new(std::sync::Mutex::new(iopath_devices::testdev::PciTestDev::new()))).unwrap();
            super::serve(&b, &mut f, &irq2)
        });
        let mut p = super::MpqemuProxy::connect(a, None).unwrap();
        let (ctx, trigger) = vmm_context();
        p.attach(ctx);
        device_intx_reaches(&irq, &trigger);
        drop(p);
        h.join().unwrap().unwrap();
    }
}
