//! Interrupts: GET_IRQ_INFO and SET_IRQS. INTx is one vector (a trigger and
//! an unmask eventfd, or mask/unmask by value); MSI-X has the vectors the
//! device's capability declares; MSI, ERR and REQ have none.

use super::{ok, Reply, Session};
use crate::function::PciFunction;
use crate::vfio_user::wire::*;
use crate::vfio_user::Received;
use crate::{Error, Result};
use vmm_sys_util::eventfd::EventFd;

impl Session<'_> {
    pub(super) fn irq_info(&mut self, m: &Received) -> Result<Reply> {
        super::no_fds(m)?;
        let q = IrqInfo::parse(&m.payload)?;
        let (flags, count) = match q.index {
            PCI_INTX_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED, 1),
            PCI_MSIX_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, msix_vectors(&self.srv.function())),
            PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, 0),
            i => return Err(Error::protocol(format!("no IRQ index {i}"))),
        };
        ok(IrqInfo { argsz: 16, flags, index: q.index, count }.to_bytes())
    }

    pub(super) fn set_irqs(&mut self, m: &Received) -> Result<Reply> {
        let q = IrqSet::parse(&m.payload)?;
        let data_eventfd = q.flags & IRQ_SET_DATA_EVENTFD != 0;
        let nfds = m.fds.len();
        if (!data_eventfd && nfds > 0) || (data_eventfd && nfds != 0 && nfds != q.count as usize) {
            return Err(Error::protocol(format!("SET_IRQS count {} with {nfds} fds", q.count)));
        }
        match q.index {
            PCI_INTX_IRQ_INDEX => self.set_intx(&q, m)?,
            PCI_MSIX_IRQ_INDEX if q.count > 0 && data_eventfd && q.flags & IRQ_SET_ACTION_TRIGGER != 0 => {
                let msix = msix_vectors(&self.srv.function());
                if q.start + q.count > msix {
                    return Err(Error::protocol(format!("MSI-X vectors {}..{} of {msix}", q.start, q.start + q.count)));
                }
                // No fds de-assigns the range.
                let fds: Vec<Option<EventFd>> = if nfds == 0 {
                    (0..q.count).map(|_| None).collect()
                } else {
                    eventfds(m)?.into_iter().map(Some).collect()
                };
                self.srv.irq.set_msix(q.start as usize, fds);
            }
            PCI_MSIX_IRQ_INDEX | PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => {
                if q.count == 0 && q.flags & IRQ_SET_DATA_NONE != 0 {
                    if q.index == PCI_MSIX_IRQ_INDEX {
                        self.srv.irq.clear_msix();
                    }
                    return ok(Vec::new());
                }
                // This device offers no vectors on these indexes (GET_IRQ_INFO count 0).
                let (i, s, e) = (q.index, q.start, q.start + q.count);
                return Err(Error::protocol(format!("IRQ index {i} has no vectors {s}..{e}")));
            }
            i => return Err(Error::protocol(format!("no IRQ index {i}"))),
        }
        ok(Vec::new())
    }

    fn set_intx(&mut self, q: &IrqSet, m: &Received) -> Result<()> {
        let irq = &self.srv.irq;
        if q.start + q.count > 1 {
            return Err(Error::protocol(format!("INTx has 1 vector, not {}..{}", q.start, q.start + q.count)));
        }
        if q.flags & IRQ_SET_DATA_NONE != 0 && q.count == 0 {
            self.intx = (None, None);
            irq.clear_intx();
            return Ok(());
        }
        if q.flags & IRQ_SET_DATA_EVENTFD == 0 {
            // Mask, unmask (re-asserts a line still high) or trigger, by value.
            if q.flags & IRQ_SET_ACTION_MASK != 0 {
                irq.mask_intx(true);
            } else if q.flags & IRQ_SET_ACTION_UNMASK != 0 {
                irq.mask_intx(false);
            }
            return Ok(());
        }
        let fd = eventfds(m)?.pop();
        if q.flags & IRQ_SET_ACTION_TRIGGER != 0 {
            self.intx.0 = fd;
        } else if q.flags & IRQ_SET_ACTION_UNMASK != 0 {
            self.intx.1 = fd;
        }
        match (&self.intx.0, &self.intx.1) {
            (Some(t), Some(u)) => irq.connect_intx(dup(t)?, dup(u)?),
            _ => irq.clear_intx(),
        }
        Ok(())
    }
}

/// The fds of a SET_IRQS as eventfds (copies; the message keeps its own).
fn eventfds(m: &Received) -> Result<Vec<EventFd>> {
    m.fds
        .iter()
        .map(|f| f.try_clone().map(iopath_devices::irq::eventfd_from).map_err(|e| Error::io("dup of an IRQ fd", e)))
        .collect()
}

fn dup(e: &EventFd) -> Result<EventFd> {
    e.try_clone().map_err(|e| Error::io("dup of an INTx fd", e))
}

/// MSI-X vectors the device's capability declares (0 without one).
fn msix_vectors(f: &PciFunction) -> u32 {
    f.device
        .capabilities()
        .iter()
        .find(|c| c.id == iopath_devices::pci::PCI_CAP_ID_MSIX && c.body.len() >= 2)
        .map_or(0, |c| (u16::from_le_bytes([c.body[0], c.body[1]]) & 0x7ff) as u32 + 1)
}
