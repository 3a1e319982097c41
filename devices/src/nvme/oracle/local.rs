//! The oracle's port to a controller in this process, with a host that
//! plays KVM's part: ioeventfds (a store to a registered doorbell signals
//! its eventfd; the value is lost), the doorbell page mapped into the guest
//! (a store lands in memory) and trapped on request (a store exits).

use super::{OpRecord, Port};
use crate::nvme::{Nvme, NvmeConfig};
use crate::{Counter, DeviceContext, GuestMem, IoEventSpec, IoEvents, Result, SharedDevice};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// A host as the VMM is one (ioeventfds follow the queues, the doorbell
/// page can be trapped), or as a device process's client is one
/// (`static_only`: ioeventfds announced once, the page mapped for good).
pub struct LocalHost {
    events: Mutex<Vec<(IoEventSpec, EventFd)>>,
    static_only: bool,
    trapped: RwLock<bool>,
}

impl IoEvents for LocalHost {
    fn register(&self, spec: IoEventSpec, fd: &EventFd) -> Result<()> {
        let fd = fd.try_clone().map_err(|e| crate::Error::io("eventfd clone", e))?;
        crate::lock(&self.events).push((spec, fd));
        Ok(())
    }
    fn unregister(&self, spec: IoEventSpec, _: &EventFd) -> Result<()> {
        crate::lock(&self.events).retain(|(s, _)| *s != spec);
        Ok(())
    }
    fn static_only(&self) -> bool {
        self.static_only
    }
    fn trap_area(&self, _bar: u8, _offset: u64, trap: bool) -> bool {
        if self.static_only {
            return false;
        }
        // Waits for a store in progress, as KVM's memslot change does.
        *crate::write(&self.trapped) = trap;
        true
    }
}

/// A device in this process (the controller, or a proxy of one in a
/// device process), its guest RAM and its host.
pub struct LocalPort {
    pub dev: SharedDevice,
    ram: GuestMemoryMmap,
    host: Arc<LocalHost>,
    /// The doorbell page as the guest has it mapped (bar modes).
    page: Option<vm_memory::mmap::MmapRegion>,
    ops: Option<Arc<Mutex<Vec<OpRecord>>>>,
    timed: Option<Arc<Mutex<Vec<crate::nvme::TimedRecord>>>>,
}

impl LocalPort {
    /// A controller of `cfg` with the oracle's RAM, hosted as a VMM hosts it
    /// or (`static_host`) as a device process's client does.
    pub fn new(cfg: NvmeConfig, static_host: bool) -> Result<LocalPort> {
        let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), super::driver::RAM as usize)])
            .map_err(|e| crate::Error::Host(format!("oracle RAM: {e}")))?;
        let nvme = Arc::new(Nvme::new(cfg)?);
        let ops = nvme.oracle_log();
        let timed = nvme.timed_log();
        let mut port = LocalPort::hosting(nvme, ram.clone(), ram.into(), static_host)?;
        port.ops = Some(ops);
        port.timed = Some(timed);
        Ok(port)
    }

    /// Hosts `dev` on `mem` (the device's view of `ram`, the driver's): the
    /// proxy of a controller in a device process, say.
    pub fn hosting(dev: SharedDevice, ram: GuestMemoryMmap, mem: GuestMem, static_host: bool) -> Result<LocalPort> {
        let host =
            Arc::new(LocalHost { events: Mutex::default(), static_only: static_host, trapped: RwLock::new(false) });
        let mut ctx = DeviceContext::detached(mem);
        ctx.ioevents = host.clone();
        dev.attach(ctx);
        // A device process's areas are known once its client attached.
        let page = match dev.mapped_areas().into_iter().find(|a| a.bar == 0 && a.offset == 0x1000) {
            Some(a) => Some(
                vm_memory::mmap::MmapRegion::from_file(vm_memory::FileOffset::new(a.fd, a.fd_offset), a.size as usize)
                    .map_err(|e| crate::Error::Host(format!("oracle: doorbell page: {e}")))?,
            ),
            None => None,
        };
        Ok(LocalPort { dev, ram, host, page, ops: None, timed: None })
    }
}

impl Port for LocalPort {
    fn read32(&self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.dev.bar_read(0, off, &mut b);
        u32::from_le_bytes(b)
    }
    fn write(&self, off: u64, data: &[u8]) {
        self.dev.bar_write(0, off, data)
    }
    fn doorbell(&self, off: u64, value: u32) {
        if let Some(page) = &self.page {
            let trapped = crate::read(&self.host.trapped);
            if !*trapped && (0x1000..0x2000).contains(&off) {
                // SAFETY: the page maps 4 KiB from BAR0 + 0x1000 and `off` is a
                // 4-byte aligned doorbell inside it; the device reads it
                // concurrently, hence atomic.
                let w = unsafe { &*(page.as_ptr().add((off - 0x1000) as usize) as *const AtomicU32) };
                w.store(value.to_le(), Ordering::Release);
                return;
            }
        }
        let kick = crate::lock(&self.host.events).iter().find_map(|(s, fd)| {
            let hit = s.bar == 0 && s.offset == off && s.len == 4 && s.datamatch.is_none_or(|d| d == value as u64);
            hit.then(|| fd.try_clone().ok()).flatten()
        });
        match kick {
            Some(fd) => fd.write(1).expect("an ioeventfd's eventfd"),
            None => self.dev.bar_write(0, off, &value.to_le_bytes()),
        }
    }
    fn ram(&self) -> &GuestMemoryMmap {
        &self.ram
    }
    fn counters(&self) -> Vec<Counter> {
        self.dev.counters()
    }
    fn take_ops(&self) -> Option<Vec<OpRecord>> {
        Some(std::mem::take(&mut *crate::lock(self.ops.as_ref()?)))
    }
    fn take_timed(&self) -> Option<Vec<crate::nvme::TimedRecord>> {
        Some(std::mem::take(&mut *crate::lock(self.timed.as_ref()?)))
    }
}

impl Drop for LocalPort {
    fn drop(&mut self) {
        self.dev.quiesce();
    }
}
