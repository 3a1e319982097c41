//! The device side of mpqemu (what QEMU's `-machine x-remote` does): BAR
//! accesses arrive as absolute addresses and are decoded through the header
//! the client programmed ([`PciFunction::decode`]).
//!
//! A refused access (odd size, no BAR there) is answered and counted; a
//! message that breaks the protocol ends the session with an error naming it.

use super::wire::{recv, send, Msg};
use crate::function::{map_guest_memory, no_memory, shrunk, MappedRegion, PciFunction, SharedRegion};
use crate::sigbus::Owner;
use crate::transport::Server;
use crate::{Error, Result};
use iopath_devices::irq::IrqLines;
use iopath_devices::{le_value, DeviceContext, NoIoEvents};
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

/// Serves one function to one mpqemu client at a time.
pub struct MpqemuServer {
    f: Arc<Mutex<PciFunction>>,
    irq: Arc<IrqLines>,
}

impl MpqemuServer {
    pub fn new(f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Self {
        MpqemuServer { f, irq }
    }
}

impl Server for MpqemuServer {
    /// Holds the function for the whole session (one client, one vCPU's
    /// worth of synchronous requests).
    /// A client that shrinks the memory it shared ends its session with an
    /// error (`function`'s SIGBUS policy): the SIGBUS handler ends the wait
    /// for its next message.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()> {
        let mut f = iopath_devices::lock(&self.f);
        let owner = Owner::new(Some(sock))?;
        let mut s = Session { sock, f: &mut f, irq: &self.irq, peer, owner, mem: Vec::new() };
        s.f.attach(s.context(no_memory()));
        let r = s.serve();
        let shrunk = s.owner.poisoned().then(|| {
            let regions: Vec<&MappedRegion> = s.mem.iter().collect();
            shrunk(&regions).unwrap_or_else(|| Error::protocol("the client shrank memory it had shared"))
        });
        // The device lets go of the client's memory with the session.
        s.f.attach(s.context(no_memory()));
        shrunk.map_or(r, Err)
    }
}

struct Session<'a> {
    sock: &'a UnixStream,
    f: &'a mut PciFunction,
    irq: &'a Arc<IrqLines>,
    peer: &'a str,
    /// What the client's memory is registered under with the SIGBUS handler.
    owner: Arc<Owner>,
    /// The regions of the last SYNC_SYSMEM, to name one that shrank.
    mem: Vec<MappedRegion>,
}

impl Session<'_> {
    fn serve(&mut self) -> Result<()> {
        while let Some((msg, files)) = recv(self.sock)? {
            if self.owner.poisoned() {
                break;
            }
            self.handle(msg, files)?;
        }
        Ok(())
    }

    fn context(&self, mem: impl Into<iopath_devices::GuestMem>) -> DeviceContext {
        let mut c = DeviceContext::detached(mem);
        c.ioevents = Arc::new(NoIoEvents);
        c.irq = self.irq.clone();
        c
    }

    fn reply(&self, v: u64) -> Result<()> {
        send(self.sock, &Msg::Ret(v), &[], "sending RET")
    }

    fn handle(&mut self, msg: Msg, files: Vec<File>) -> Result<()> {
        match msg {
            Msg::SyncSysmem(regions) => self.sync_sysmem(&regions, files),
            Msg::CfgWrite { addr, val, len } => self.cfg_write(addr, val, len),
            Msg::CfgRead { addr, len } => self.cfg_read(addr, len),
            Msg::BarWrite { addr, val, size, memory } => {
                match self.bar_target(addr, size, memory) {
                    Some((bar, off, n)) => self.f.bar_write(bar, off, &val.to_le_bytes()[..n]),
                    None => self.f.stray_accesses += 1,
                }
                self.reply(0)
            }
            Msg::BarRead { addr, size, memory } => {
                let v = match self.bar_target(addr, size, memory) {
                    Some((bar, off, n)) => {
                        let mut b = [0u8; 8];
                        self.f.bar_read(bar, off, &mut b[..n]);
                        le_value(&b[..n])
                    }
                    None => {
                        self.f.stray_accesses += 1;
                        u64::MAX
                    }
                };
                self.reply(v)
            }
            Msg::SetIrqfd => {
                let mut it = files.into_iter().map(iopath_devices::irq::eventfd_from);
                if let (Some(t), Some(r)) = (it.next(), it.next()) {
                    self.irq.connect_intx(t, Some(r));
                }
                Ok(())
            }
            Msg::DeviceReset => {
                self.f.device.reset();
                self.reply(0)
            }
            Msg::Ret(_) => Err(Error::protocol("RET from the proxy, which sends requests only")),
        }
    }

    /// Guest RAM as the client shares it, mapped whatever the fds
    /// (`function`'s SIGBUS policy): the device is attached again with it.
    fn sync_sysmem(&mut self, regions: &[super::wire::SysmemRegion], files: Vec<File>) -> Result<()> {
        let shared = regions
            .iter()
            .zip(files)
            .map(|(r, file)| SharedRegion { gpa: r.gpa, size: r.size, offset: r.offset, file })
            .collect();
        let (mem, mapped) = map_guest_memory(shared, &self.owner).map_err(|e| e.context("SYNC_SYSMEM"))?;
        self.f.attach(self.context(mem));
        self.mem = mapped;
        Ok(())
    }

    fn cfg_write(&mut self, addr: u32, val: u32, len: i32) -> Result<()> {
        match conf_len(addr, len) {
            Some(n) => {
                self.f.config_write(addr as usize, &val.to_le_bytes()[..n]);
                self.reply(0)
            }
            None => {
                log::warn!("mpqemu {}: PCI_CFGWRITE of {len} bytes at {addr:#x} refused", self.peer);
                self.reply(u64::MAX)
            }
        }
    }

    fn cfg_read(&mut self, addr: u32, len: i32) -> Result<()> {
        match conf_len(addr, len) {
            Some(n) => {
                let mut b = [0u8; 4];
                self.f.config_read(addr as usize, &mut b[..n]);
                self.reply(u32::from_le_bytes(b) as u64)
            }
            None => {
                log::warn!("mpqemu {}: PCI_CFGREAD of {len} bytes at {addr:#x} refused", self.peer);
                self.reply(u64::MAX)
            }
        }
    }

    /// The BAR, offset and size an absolute address decodes to, if any.
    fn bar_target(&self, addr: u64, size: u32, memory: bool) -> Option<(u8, u64, usize)> {
        let n = size as usize;
        if !matches!(n, 1 | 2 | 4 | 8) {
            log::warn!("mpqemu {}: BAR access of {size} bytes at {addr:#x} refused", self.peer);
            return None;
        }
        let Some((bar, off)) = self.f.decode(addr, n, !memory) else {
            let space = if memory { "memory" } else { "port" };
            log::warn!("mpqemu {}: BAR access at {space} {addr:#x} hits no BAR", self.peer);
            return None;
        };
        Some((bar, off, n))
    }
}

fn conf_len(addr: u32, len: i32) -> Option<usize> {
    let n = usize::try_from(len).ok().filter(|n| matches!(n, 1 | 2 | 4))?;
    (addr as usize + n <= 4096).then_some(n)
}
