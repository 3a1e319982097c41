//! The proxy's MSI-X emulation. MSI-X is the VMM's, as in QEMU and kernel
//! VFIO: the proxy keeps the table and the PBA (a [`MsixTable`], the pure
//! state the device models use too) and answers every access to them; none
//! reaches the device process, whose own table, if it has one, stays masked.
//!
//! Each vector the guest unmasks is routed in the VMM, and its eventfd is
//! handed to the device process (SET_IRQS) the first time. A masked vector
//! is taken out of KVM by the host, so what the device signals waits in the
//! eventfd: the PBA shows it, and unmasking delivers it once.
//!
//! It owns the table, the vectors' routes and eventfds; it sends SET_IRQS
//! on the channel it is given and forwards nothing else.

use super::channel::Channel;
use crate::vfio_user::wire::*;
use iopath_devices::irq::wait_readable;
use iopath_devices::pci::MsixTable;
use iopath_devices::Interrupts;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;
use vmm_sys_util::eventfd::EventFd;

/// The device's MSI-X table and PBA, kept here and never forwarded, and
/// what the host holds of each vector.
pub(in crate::vfio_user) struct MsixEmulation {
    pub(in crate::vfio_user) table: MsixTable,
    /// The table as at reset.
    at_reset: MsixTable,
    /// Per vector: a copy of the eventfd handed to the device process.
    fds: Vec<Option<EventFd>>,
    /// Per vector: routed in the host (its irqfd in KVM).
    routed: Vec<bool>,
    /// The VMM's interrupt host, from the attach on.
    irq: Option<Arc<dyn Interrupts>>,
}

/// True if the eventfd held a signal, which is taken (its counter goes back
/// to 0). Never blocks, whatever the fd's flags.
fn take_signal(fd: &Option<EventFd>) -> bool {
    fd.as_ref().is_some_and(|fd| wait_readable(fd, Duration::ZERO) && fd.read().is_ok_and(|n| n > 0))
}

impl MsixEmulation {
    pub(super) fn new(table: MsixTable) -> Self {
        let n = table.vectors();
        let fds = (0..n).map(|_| None).collect();
        MsixEmulation { at_reset: table.clone(), table, fds, routed: vec![false; n], irq: None }
    }

    pub(super) fn attach(&mut self, irq: Arc<dyn Interrupts>) {
        self.irq = Some(irq);
    }

    /// A BAR read of the table or PBA, answered here; false if neither claims it.
    pub(super) fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) -> bool {
        if !self.table.claims(bar, offset) {
            return false;
        }
        self.collect_pending();
        self.table.read(bar, offset, data)
    }

    /// A BAR write of the table (or PBA, read-only), taken here; false if
    /// neither claims it.
    pub(super) fn bar_write(&mut self, chan: &mut Channel, bar: u8, offset: u64, data: &[u8]) -> bool {
        if !self.table.claims(bar, offset) {
            return false;
        }
        if let Some(v) = self.table.write(bar, offset, data) {
            self.sync(chan, v);
        }
        true
    }

    /// Observes a configuration write to Message Control.
    pub(super) fn config_write(&mut self, chan: &mut Channel, offset: usize, data: &[u8]) {
        if !self.table.config_write(offset, data) {
            return;
        }
        for v in 0..self.table.vectors() {
            self.sync(chan, v);
        }
    }

    /// Message Control's Enable and Function Mask as the VMM keeps them,
    /// over what the device process answered for a configuration read.
    pub(super) fn config_read(&self, offset: usize, data: &mut [u8]) {
        let m = &self.table;
        let Some(b) = (m.cap_offset() + 3).checked_sub(offset).and_then(|i| data.get_mut(i)) else { return };
        *b = (*b & 0x3f) | (m.enabled() as u8) << 7 | (m.function_masked() as u8) << 6;
    }

    /// As at reset: every vector out of KVM, nothing pending, and the
    /// eventfds handed over again when routed.
    pub(super) fn reset(&mut self) {
        if let Some(irq) = &self.irq {
            for v in (0..self.routed.len()).filter(|&v| self.routed[v]) {
                irq.msix_route(v as u16, None);
            }
        }
        self.fds.iter().for_each(|fd| _ = take_signal(fd));
        self.table = self.at_reset.clone();
        self.fds.iter_mut().for_each(|fd| *fd = None);
        self.routed.iter_mut().for_each(|r| *r = false);
    }

    /// Brings vector `v` up to date in the host, as QEMU and kernel VFIO
    /// do with the table they emulate: unmasked (MSI-X on, function and
    /// vector unmasked), it is routed to its message and, the first time,
    /// its eventfd goes to the device process (SET_IRQS, MSI-X index,
    /// TRIGGER | DATA_EVENTFD); masked, the host takes it out of KVM, so
    /// what the device signals waits in the eventfd (the PBA shows it), and
    /// unmasking delivers a vector that waited, once.
    fn sync(&mut self, chan: &mut Channel, v: usize) {
        let Some(irq) = self.irq.clone() else { return };
        let routed = self.routed.get(v).copied().unwrap_or(false);
        let Some(route) = self.table.route(v) else {
            if routed {
                irq.msix_route(v as u16, None);
                self.routed[v] = false;
            }
            return;
        };
        // What the device signalled while the vector was out of KVM: in its
        // eventfd, or taken from there into the PBA by a read.
        let waited = !routed && (self.table.pending(v) || self.fds.get(v).is_some_and(take_signal));
        irq.msix_route(v as u16, Some(route));
        self.routed[v] = true;
        if self.fds[v].is_none() {
            self.give(chan, &*irq, v);
        }
        self.table.set_pending(v, waited && !irq.signal_msix(v as u16));
    }

    /// Hands vector `v`'s eventfd to the device process.
    fn give(&mut self, chan: &mut Channel, irq: &dyn Interrupts, v: usize) {
        let Some(fd) = irq.msix_eventfd(v as u16) else { return };
        let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
        let q = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: v as u32, count: 1, data: vec![] };
        match chan.request(Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()]) {
            Ok(_) => self.fds[v] = Some(fd),
            Err(e) => log::warn!("{}: MSI-X vector {v}: {e}", chan.peer.name),
        }
    }

    /// To a new process of the device (a reconnect): the same eventfd of
    /// each vector handed over before (SET_IRQS, in vector order), so that
    /// its signals reach the same KVM irqfd. An error reply is logged; a
    /// broken channel is the reconnect's failure.
    pub(super) fn replay(&mut self, chan: &mut Channel) -> crate::Result<()> {
        for (v, fd) in self.fds.iter().enumerate() {
            let Some(fd) = fd else { continue };
            let flags = IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER;
            let q = IrqSet { flags, index: PCI_MSIX_IRQ_INDEX, start: v as u32, count: 1, data: vec![] };
            chan.optional(&format!("MSI-X vector {v}"), Command::DeviceSetIrqs, &q.to_bytes(), &[fd.as_raw_fd()])?;
        }
        Ok(())
    }

    /// Moves the signals of vectors that are out of KVM into the PBA.
    fn collect_pending(&mut self) {
        for (v, fd) in self.fds.iter().enumerate() {
            if !self.routed[v] && take_signal(fd) {
                self.table.set_pending(v, true);
            }
        }
    }
}
