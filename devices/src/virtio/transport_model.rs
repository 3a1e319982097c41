//! [`VirtioPci`] as a PCI function: BAR accesses to the transport's
//! registers, the capabilities, MSI-X and the PCI_CFG window.

use super::*;
use crate::{read_regs, BarKind, BarSpec, PciIds};

impl<E: QueueEngine> DeviceModel for VirtioPci<E> {
    fn name(&self) -> String {
        self.state().t.name.clone()
    }

    fn ids(&self) -> PciIds {
        let s = self.state();
        PciIds {
            vendor: crate::virtio::pci::VENDOR,
            device: s.e.device_id(),
            class: s.e.class(),
            revision: 1,
            subsystem_vendor: crate::virtio::pci::VENDOR,
            subsystem: s.e.subsystem(),
            interrupt_pin: 1, // INTx while MSI-X is off (`transport.rs`)
        }
    }

    fn bars(&self) -> Vec<BarSpec> {
        vec![BarSpec { index: 0, kind: BarKind::Mem64, size: BAR_SIZE }]
    }

    fn injector(&self) -> Option<std::sync::Arc<crate::block::inject::Injector>> {
        self.state().e.injector()
    }

    fn shares_guest_ram(&self) -> bool {
        self.state().e.shares_guest_ram()
    }

    fn attach(&self, ctx: DeviceContext) {
        E::attach(&self.state, &ctx);
        self.state().t.ctx = Some(ctx);
    }

    fn bar_read(&self, bar: u8, offset: u64, data: &mut [u8]) {
        let mut s = self.state();
        if bar == 0 && s.t.msix.read(bar, offset, data) {
            return;
        }
        match (bar, offset) {
            (0, o) if o < COMMON_LEN => read_regs(&s.t.common_regs(), o, data),
            (0, ISR) => {
                // Reading the ISR clears it and deasserts INTx (4.1.4.5).
                let isr = std::mem::take(&mut s.t.isr);
                read_regs(&[isr], 0, data);
                if let Some(c) = &s.t.ctx {
                    c.irq.set_intx(false);
                }
            }
            (0, o) if (DEVCFG..DEVCFG + DEVCFG_LEN).contains(&o) => read_regs(&s.e.device_config(), o - DEVCFG, data),
            _ => data.fill(0xff),
        }
    }

    fn bar_write(&self, bar: u8, offset: u64, data: &[u8]) {
        let mut s = self.state();
        if bar != 0 {
            return;
        }
        if s.t.msix.claims(bar, offset) {
            if let Some(v) = s.t.msix.write(bar, offset, data) {
                s.t.msix_update(v);
                s.t.record_msix(v);
                let State { t, e } = &mut *s;
                e.interrupt_changed(t);
            }
            return;
        }
        let notify_end = notify_offset(s.t.num_queues());
        match offset {
            o if o < COMMON_LEN => s.common_write(o, data),
            // Queue q's notify address (4.1.4.4): the queue is the
            // address's, whatever the value (as a KVM ioeventfd there).
            o if (NOTIFY..notify_end).contains(&o) && (o - NOTIFY).is_multiple_of(NOTIFY_MULT as u64) => {
                s.t.notifies += 1;
                let State { t, e } = &mut *s;
                e.notify(t, ((o - NOTIFY) / NOTIFY_MULT as u64) as u16);
            }
            _ => {}
        }
    }

    fn reset(&self) {
        let mut s = self.state();
        s.reset();
        s.t.msix = new_msix(s.t.num_queues());
        for v in 0..s.t.msix_vectors() as usize {
            s.t.record_msix(v);
        }
        s.t.record_msix_control();
    }

    fn state_len(&self) -> Option<usize> {
        self.state_bytes()
    }

    fn adopt_state(&self, mem: crate::state::StateMemory, resume: bool) -> Result<()> {
        self.adopt(mem, resume)
    }

    fn new_client(&self) {
        let ctx = self.state().t.ctx.clone();
        if let Some(ctx) = ctx {
            E::new_client(&self.state, &ctx);
        }
    }

    fn quiesce(&self) {
        E::quiesce(&self.state);
    }

    fn counters(&self) -> Vec<Counter> {
        let mut s = self.state();
        let c = |n: &str, value| Counter { name: n.into(), value };
        let mut v = vec![c("notifies", s.t.notifies)];
        v.extend(s.e.counters());
        v.extend([c("interrupts", s.t.interrupts), c("ring_errors", s.t.ring_errors), c("resets", s.t.resets)]);
        v.extend(Self::state_counters(&mut s));
        v
    }

    fn config_read(&self, offset: usize, data: &mut [u8]) -> bool {
        // pci_cfg_data reads the BAR through the window (4.1.4.9).
        let at = PCI_CFG_CAP + 2 + PCI_CFG_DATA;
        if offset != at || data.len() != 4 {
            return false;
        }
        data.fill(0);
        if let Some((bar, off, len)) = self.pci_cfg_window() {
            self.bar_read(bar, off, &mut data[..len]);
        }
        true
    }

    fn config_write(&self, offset: usize, data: &[u8]) {
        self.pci_cfg_write(offset, data);
        let mut s = self.state();
        if s.t.msix.config_write(offset, data) {
            for v in 0..s.t.msix_vectors() as usize {
                s.t.msix_update(v);
            }
            s.t.record_msix_control();
            let State { t, e } = &mut *s;
            e.interrupt_changed(t);
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        // A virtio vendor capability (4.1.4): cap_len, cfg_type, bar, id, 2
        // bytes padding, offset, length[, notify_off_multiplier].
        let vcap = |at: usize, kind: u8, off: u64, len: u64, extra: Option<u32>| {
            let mut body = vec![if extra.is_some() { 20 } else { 16 }, kind, 0, 0, 0, 0];
            body.extend_from_slice(&(off as u32).to_le_bytes());
            body.extend_from_slice(&(len as u32).to_le_bytes());
            if let Some(m) = extra {
                body.extend_from_slice(&m.to_le_bytes());
            }
            Capability { offset: at, id: 0x09, body, wmask: Vec::new() }
        };
        let (msix, queues) = {
            let s = self.state();
            (s.t.msix.capability(), s.t.num_queues())
        };
        vec![
            msix,
            vcap(0x50, 1, COMMON, COMMON_LEN, None),
            // Each queue's notify address, queue_notify_off * multiplier, inside it.
            vcap(0x60, 2, NOTIFY, notify_offset(queues) - NOTIFY, Some(NOTIFY_MULT)),
            vcap(0x78, 3, ISR, 1, None),
            vcap(0x88, 4, DEVCFG, DEVCFG_LEN, None),
            {
                // VIRTIO_PCI_CAP_PCI_CFG: bar, offset, length and data are the guest's.
                let mut c = vcap(PCI_CFG_CAP, 5, 0, 0, Some(0));
                c.body[0] = 20;
                let mut w = vec![0u8; PCI_CFG_BODY];
                w[PCI_CFG_BAR] = 0xff;
                w[6..].fill(0xff);
                c.wmask = w;
                c
            },
        ]
    }
}
