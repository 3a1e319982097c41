//! Completion interrupts: MSI-X through the shared
//! [`MsixTable`](crate::pci::MsixTable) (the host gets each vector's route
//! when its message or mask changes; a masked vector keeps its pending bit
//! and fires when unmasked), and Interrupt Coalescing (Set Features 0x08).
//!
//! One message per pass: a queue pass or a reap of file completions posts
//! its completions first and then signals each vector they raised once
//! ([`Core::batched`]), as a controller that writes a batch of CQ entries
//! and then interrupts. A driver reaps every new entry of a CQ on one
//! interrupt, so nothing waits longer than the pass; a completion whose
//! signal merged into its pass's is counted (`msix.merged`). A message costs
//! a KVM irqfd write, and an injection into the vCPU (an IPI and an exit
//! when it runs); at 4 KiB randread QD32 on a file, with a guest that waits
//! on interrupts, one message per completion cost the vCPU about 6 us of CPU
//! per I/O on this project's nested hosts, one per pass about 3 us.
//!
//! Whose table: a host that keeps the MSI-X table itself (QEMU's
//! vfio-user-pci and iopath's own vfio-user proxy, like kernel VFIO, emulate
//! table and PBA and forward no table write;
//! [`Interrupts::msix_host_owned`](crate::Interrupts::msix_host_owned)) gets
//! every raised vector on its eventfd, and the controller's own table, which
//! stays masked, is not consulted. A client that does write the table (and
//! relies on the controller to mask) keeps the controller's table in charge
//! until it leaves or the controller is reset. In the VMM the controller's
//! table is the only one.

use super::controller::Core;
use super::{DoorbellMode, MSIX_CAP, MSIX_PBA, MSIX_TABLE, MSIX_VECTORS};
use crate::pci::MsixTable;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) struct IrqState {
    /// The host's interrupt lines.
    pub irq: Arc<dyn crate::Interrupts>,
    pub msix: MsixTable,
    /// The client has written the table since it attached: the table is ours
    /// to enforce even if the host says it keeps one.
    pub client_table: bool,
    /// Interrupt Coalescing: THR in bits 7:0 (0-based completions), TIME in
    /// bits 15:8 (100 us units). Applied to I/O CQs where a device thread
    /// can keep time (shm, bar, ioeventfd, adaptive).
    pub coalescing: u32,
    /// Per vector: completions not yet signalled, and since when.
    pub agg: Vec<(u32, Option<Instant>)>,
    /// Vectors in `agg` that hold completions: the pollers look at the
    /// timers on every pass, so with none held they do not walk the 65.
    pub held: usize,
    /// A pass is posting completions ([`Core::batched`]): the vectors they
    /// raise wait in `due` (bit = vector) until it ends.
    pub batching: bool,
    pub due: u128,
}

impl IrqState {
    pub fn new() -> Self {
        IrqState {
            irq: Arc::new(crate::NoInterrupts),
            msix: MsixTable::new(MSIX_VECTORS as u16, 0, MSIX_TABLE, MSIX_PBA, MSIX_CAP),
            client_table: false,
            coalescing: 0,
            agg: vec![(0, None); MSIX_VECTORS],
            held: 0,
            batching: false,
            due: 0,
        }
    }

    /// Drops what every vector holds (a controller reset).
    pub fn clear_held(&mut self) {
        self.agg.iter_mut().for_each(|a| *a = (0, None));
        self.held = 0;
        self.due = 0;
    }
}

// The vectors fit `IrqState::due`.
const _: () = assert!(MSIX_VECTORS <= 128);

impl Core {
    /// Runs `f` (a pass that posts completions) with the vectors it raises
    /// signalled once each when it ends, not once per completion. Nested
    /// passes signal at the end of the outermost. A file namespace without
    /// io_uring blocks on each operation inside the pass, so it signals each
    /// completion at once.
    pub(super) fn batched<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let batch = self.ns.iter().all(|ns| match &ns.storage {
            crate::block::Storage::File(b) => b.is_async(),
            _ => true,
        });
        let outer = self.intr.batching;
        self.intr.batching = outer || batch;
        let r = f(self);
        if !outer {
            self.intr.batching = false;
            self.signal_due();
        }
        r
    }

    /// Signals the vectors a pass raised so far (before it blocks, and at its end).
    pub(super) fn signal_due(&mut self) {
        while self.intr.due != 0 {
            let v = self.intr.due.trailing_zeros() as u16;
            self.intr.due &= self.intr.due - 1;
            self.interrupt(v);
        }
    }

    /// Signals vector `v` now, or at the end of the pass posting completions.
    fn raise(&mut self, v: u16) {
        if !self.intr.batching || v as usize >= MSIX_VECTORS {
            return self.interrupt(v);
        }
        let bit = 1u128 << v;
        if self.intr.due & bit != 0 {
            self.st.merged_interrupts += 1;
        }
        self.intr.due |= bit;
    }

    /// A completion on CQ `cqid` for vector `v`: signals at once, or counts
    /// it toward the aggregation threshold (I/O queues, modes with a device
    /// thread to keep the aggregation time, vectors whose Interrupt Vector
    /// Configuration does not disable coalescing).
    pub(super) fn completion_interrupt(&mut self, cqid: usize, v: u16) {
        let thr = (self.intr.coalescing & 0xff) + 1;
        if cqid == 0
            || self.intr.coalescing == 0
            || self.mode() == DoorbellMode::Mmio
            || self.feat.coalescing_off.get(v as usize).is_none_or(|&off| off)
        {
            return self.raise(v);
        }
        let a = &mut self.intr.agg[v as usize];
        a.0 += 1;
        if a.1.is_none() {
            a.1 = Some(Instant::now());
            self.intr.held += 1;
        }
        if a.0 >= thr {
            *a = (0, None);
            self.intr.held -= 1;
            self.raise(v);
        }
    }

    /// Signals the vectors whose aggregation time has run out (device threads call this).
    pub(super) fn flush_coalesced(&mut self) {
        if self.intr.held == 0 {
            return; // the usual case, on every poller pass
        }
        // Decided from the counters: turning coalescing off releases what it held.
        let time = Duration::from_micros(100 * ((self.intr.coalescing >> 8) & 0xff) as u64);
        for v in 0..MSIX_VECTORS {
            if self.intr.agg[v].1.is_some_and(|t| t.elapsed() >= time) {
                self.intr.agg[v] = (0, None);
                self.intr.held -= 1;
                self.interrupt(v as u16);
            }
        }
    }

    /// What the aggregation threshold holds goes out now (a device thread
    /// with no timer: the ioeventfd one).
    pub(super) fn flush_coalesced_untimed(&mut self) {
        let time = self.intr.coalescing & 0xff00;
        self.intr.coalescing &= !0xff00;
        self.flush_coalesced();
        self.intr.coalescing |= time;
    }

    /// Signals every vector that holds coalesced completions.
    pub(super) fn flush_coalesced_now(&mut self) {
        for v in 0..MSIX_VECTORS {
            if self.intr.agg[v].0 > 0 {
                self.intr.agg[v] = (0, None);
                self.intr.held -= 1;
                self.interrupt(v as u16);
            }
        }
    }

    /// True when the host keeps the MSI-X table (see the module documentation).
    pub(super) fn host_owns_table(&self) -> bool {
        !self.intr.client_table && self.intr.irq.msix_host_owned()
    }

    /// Signals vector `v`, or leaves it pending while it is masked. With the
    /// host's table, signals it whatever ours says (the host masks and holds).
    pub(super) fn interrupt(&mut self, v: u16) {
        let v = v as usize;
        if v >= MSIX_VECTORS {
            return;
        }
        if self.group != 0 {
            return self.shard_interrupt(v); // group 0 keeps the table
        }
        if self.host_owns_table() {
            if self.intr.irq.signal_msix(v as u16) {
                self.st.interrupts += 1;
            }
            return;
        }
        if self.intr.msix.masked(v) || !self.intr.irq.signal_msix(v as u16) {
            self.intr.msix.set_pending(v, true);
        } else {
            self.st.interrupts += 1;
        }
    }

    /// Tells the host where vector `v` goes now, and fires it if it was pending.
    pub(super) fn msix_update(&mut self, v: usize) {
        let route = self.intr.msix.route(v);
        self.intr.irq.msix_route(v as u16, route);
        if route.is_some() && self.intr.msix.pending(v) && self.intr.irq.signal_msix(v as u16) {
            self.intr.msix.set_pending(v, false);
            self.st.interrupts += 1;
        }
    }
}
