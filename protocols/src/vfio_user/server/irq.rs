//! Interrupts: GET_IRQ_INFO and SET_IRQS. INTx is one vector where the
//! function's Interrupt Pin is set (none otherwise, as kernel VFIO): a
//! trigger eventfd, with or without an unmask (resample) eventfd, mask and
//! unmask by value, and trigger by value; automasked as kernel VFIO's (an
//! assertion masks it until the client unmasks, a device reset included;
//! `iopath_devices::irq`). MSI-X has the vectors the device's
//! capability declares, as eventfds the client gives (it keeps the table and
//! masks vectors itself, as QEMU does) or triggered by value; MSI, ERR and
//! REQ have none.

use super::{ok, Reply, Session};
use crate::function::PciFunction;
use crate::vfio_user::wire::*;
use crate::vfio_user::Received;
use crate::{Error, Result};
use std::sync::atomic::Ordering;
use vmm_sys_util::eventfd::EventFd;

/// The Interrupt Pin register in configuration space.
const PCI_INTERRUPT_PIN: usize = 0x3d;

/// SET_IRQS's fixed part; `count` bools follow it with DATA_BOOL, nothing
/// otherwise.
const IRQ_SET_HEAD: usize = 20;
const ACTIONS: u32 = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER;

impl Session<'_> {
    pub(super) fn irq_info(&mut self, m: &Received) -> Result<Reply> {
        super::no_fds(m)?;
        let q = IrqInfo::parse(fixed_part(&m.payload, INFO16_SIZE))?;
        let (flags, count) = match q.index {
            // Mask and unmask by value, an unmask eventfd (no mask eventfd,
            // as in kernel VFIO); the client unmasks after each assertion.
            PCI_INTX_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED, self.intx_count()),
            // Not MASKABLE: the client masks vectors in its own copy of the
            // table (QEMU does). Not NORESIZE: a vector's eventfd may come
            // alone at any time, so QEMU adds vectors without first tearing
            // down every one (which loses what is raised meanwhile).
            PCI_MSIX_IRQ_INDEX => (IRQ_INFO_EVENTFD, msix_vectors(&self.srv.function())),
            PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => (IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, 0),
            i => return Err(Error::protocol(format!("no IRQ index {i}"))),
        };
        ok(IrqInfo { argsz: INFO16_SIZE as u32, flags, index: q.index, count }.to_bytes())
    }

    pub(super) fn set_irqs(&mut self, m: &Received) -> Result<Reply> {
        let q = parse_set_irqs(&m.payload)?;
        let data_eventfd = q.flags & IRQ_SET_DATA_EVENTFD != 0;
        let nfds = m.fds.len();
        if (!data_eventfd && nfds > 0) || (data_eventfd && nfds != 0 && nfds != q.count as usize) {
            return Err(Error::protocol(format!("SET_IRQS count {} with {nfds} fds", q.count)));
        }
        match q.index {
            PCI_INTX_IRQ_INDEX => self.set_intx(&q, m)?,
            PCI_MSIX_IRQ_INDEX => self.set_msix(&q, m)?,
            // No vectors (GET_IRQ_INFO count 0): nothing to set, or disable.
            PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX if q.count == 0 => {}
            PCI_MSI_IRQ_INDEX | PCI_ERR_IRQ_INDEX | PCI_REQ_IRQ_INDEX => {
                let (i, s, e) = (q.index, q.start, q.start + q.count);
                return Err(Error::protocol(format!("IRQ index {i} has no vectors {s}..{e}")));
            }
            i => return Err(Error::protocol(format!("no IRQ index {i}"))),
        }
        ok(Vec::new())
    }

    fn set_intx(&mut self, q: &IrqSet, m: &Received) -> Result<()> {
        let irq = self.srv.irq.clone();
        if q.flags & IRQ_SET_DATA_NONE != 0 && q.count == 0 {
            self.intx = (None, None);
            irq.clear_intx();
            return Ok(());
        }
        let n = self.intx_count();
        if q.start + q.count > n {
            return Err(Error::protocol(format!("INTx has {n} vectors, not {}..{}", q.start, q.start + q.count)));
        }
        if q.count == 0 {
            return Ok(());
        }
        let action = q.flags & ACTIONS;
        if q.flags & IRQ_SET_DATA_EVENTFD != 0 {
            let fd = eventfds(m)?.pop(); // none de-assigns
            match action {
                IRQ_SET_ACTION_TRIGGER => self.intx.0 = fd,
                IRQ_SET_ACTION_UNMASK => self.intx.1 = fd,
                _ => return Err(Error::protocol("INTx: no eventfd for masking events")),
            }
            return self.connect_intx();
        }
        if q.flags & IRQ_SET_DATA_BOOL != 0 && q.data.first() == Some(&0) {
            return Ok(());
        }
        match action {
            IRQ_SET_ACTION_MASK => irq.mask_intx(),
            // INTx is automasked: the client unmasks after each assertion
            // (after the guest's EOI), and a line still high asserts again.
            IRQ_SET_ACTION_UNMASK => irq.unmask_intx(),
            _ => {
                if let Some(t) = &self.intx.0 {
                    if t.write(1).is_ok() {
                        irq.signalled.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        Ok(())
    }

    /// INTx vectors: 1 if the function's Interrupt Pin is set, else 0.
    fn intx_count(&self) -> u32 {
        let mut pin = [0u8];
        self.srv.function().config_read(PCI_INTERRUPT_PIN, &mut pin);
        (pin[0] != 0) as u32
    }

    /// Connects INTx to the eventfds the client gave. With a trigger alone
    /// (a client without a resampling irqfd: it unmasks by value after the
    /// guest's EOI) there is no resample fd to wait on.
    fn connect_intx(&mut self) -> Result<()> {
        let irq = &self.srv.irq;
        match (&self.intx.0, &self.intx.1) {
            (Some(t), u) => irq.connect_intx(dup(t)?, u.as_ref().map(dup).transpose()?),
            (None, _) => irq.clear_intx(),
        }
        Ok(())
    }

    /// MSI-X: eventfds for vectors (none de-assigns them), a trigger by
    /// value, or count 0 with DATA_NONE to disable them all. Once the client
    /// gave an eventfd the device signals every vector it raises there (the
    /// table is the client's: `Interrupts::msix_host_owned`).
    fn set_msix(&mut self, q: &IrqSet, m: &Received) -> Result<()> {
        let irq = &self.srv.irq;
        if q.flags & IRQ_SET_DATA_NONE != 0 && q.count == 0 {
            irq.clear_msix();
            return Ok(());
        }
        let n = msix_vectors(&self.srv.function());
        if q.start + q.count > n {
            return Err(Error::protocol(format!("MSI-X vectors {}..{} of {n}", q.start, q.start + q.count)));
        }
        if q.flags & ACTIONS != IRQ_SET_ACTION_TRIGGER {
            return Err(Error::protocol("MSI-X: no mask or unmask (not MASKABLE; the client masks in its table)"));
        }
        if q.flags & IRQ_SET_DATA_EVENTFD != 0 {
            let fds: Vec<Option<EventFd>> = if m.fds.is_empty() {
                (0..q.count).map(|_| None).collect()
            } else {
                eventfds(m)?.into_iter().map(Some).collect()
            };
            irq.set_msix(q.start as usize, fds);
            return Ok(());
        }
        for (i, v) in (q.start..q.start + q.count).enumerate() {
            if q.flags & IRQ_SET_DATA_BOOL == 0 || q.data.get(i).is_some_and(|&b| b != 0) {
                iopath_devices::Interrupts::signal_msix(&**irq, v as u16);
            }
        }
        Ok(())
    }
}

/// SET_IRQS, from a request that may be longer than its fixed part and data
/// (a client may send a kernel-style fd array after the head; `argsz` is
/// not relied on): parsed as the head and the data its flags and count
/// define.
fn parse_set_irqs(b: &[u8]) -> Result<IrqSet> {
    let word = |at: usize| b.get(at..at + 4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
    let (Some(flags), Some(count)) = (word(4), word(16)) else {
        return Ok(IrqSet::parse(b)?); // too short: the parse says so
    };
    let data = if flags & IRQ_SET_DATA_BOOL != 0 { count as usize } else { 0 };
    let need = IRQ_SET_HEAD + data;
    let mut req =
        b.get(..need).ok_or_else(|| Error::protocol(format!("SET_IRQS of {} bytes: {need} needed", b.len())))?.to_vec();
    req[..4].copy_from_slice(&(need as u32).to_le_bytes());
    Ok(IrqSet::parse(&req)?)
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
