//! The queue-protocol oracle: a reference NVMe driver that drives the
//! controller through random schedules and checks every completion against
//! a model of what it published.
//!
//! A schedule varies what real drivers vary and what a hostile one may do:
//! queue sizes from 2 to 4096, CQs smaller than their SQs and several SQs
//! on one CQ, SQ tails rung every k entries, after a batch or late, CQ
//! heads rung after each completion, in batches or late, shadow doorbells
//! with the EventIdx rule or plain doorbell registers, queues deleted and
//! created again, controller resets and shutdowns with commands in flight.
//! What it checks (`model.rs`):
//! - a completion names a published, outstanding command of an SQ of its
//!   CQ; every published command completes exactly once (or, dropped by a
//!   reset, never), and no completion lands after a reset;
//! - each command is executed at most once, and once if it completed: the
//!   controller's operation log ([`OpRecord`], the tag the driver puts in
//!   CDW2) has each tag at most once;
//! - the SQ head a completion reports moves forward only, never past the
//!   tail the driver published;
//! - data: every write carries a pattern of its own, every read returns
//!   what the last completed write (or write zeroes, or deallocate) left;
//!   on a namespace with metadata the same holds for each block's metadata,
//!   inline (extended LBAs) or in a separate buffer at MPTR (all FFh where
//!   nothing was written);
//! - protection information type 1 (`pi.rs`): commands carry PRINFO
//!   (PRACT, PRCHK, the tags of CDW14/15), writes carry tuples right,
//!   unchecked (application tag FFFFh) or spoiled in one field; each
//!   command gets the check error predicted from the model's contents (or
//!   success), a failed one writes nothing, a generated tuple is what a read
//!   returns, PRACT with 8 bytes of metadata moves none, and the
//!   controller's `pi.errors` counts each failure;
//! - with error injection rules (`Shape::rules`): a matching command gets
//!   the injected status (and is not executed), a dropped one completes
//!   only when the driver aborts it (a reset or a deletion forgets it), a
//!   corrupted read differs from the data in exactly the flipped bytes, and
//!   no timed completion (a delay, a timing model) is posted before its
//!   due time on the controller's clock;
//! - guest memory is written only inside the command's data pointers: free
//!   data pages, write buffers, the bytes past a read's length, SQ rings
//!   and the shadow doorbells keep what the driver put there.
//!
//! The driver reaches the controller through a [`Port`]: in process
//! (`local.rs`, with a host that plays KVM's ioeventfds and memslots), or
//! over vfio-user (the protocols crate's tests). The fuzz target `nvme_queues`
//! takes its schedule from the fuzzer's bytes instead of a seed.
//!
//! A second driver shape is the durability case ([`Shape::durability`]):
//! writes in flight on a file namespace when the device process is killed
//! with SIGKILL and a new one starts on the same file (`Port::restart`). A
//! write whose completion was reaped must read back afterwards (none lost,
//! none overwritten by an older command run again); a write that was in
//! flight may or may not have landed.

mod driver;
mod local;
mod model;
mod pi;
mod rng;

pub use driver::{injection_rules, Driver, Report, Shape, RAM};
// (OpRecord and Port are defined here.)
pub use local::{LocalHost, LocalPort};
pub use model::{Failure, Violation, WrongData};
pub use rng::Rng;

use crate::Counter;
use vm_memory::GuestMemoryMmap;

/// One I/O command the controller fetched from an SQ (its operation log).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpRecord {
    pub sqid: u16,
    pub cid: u16,
    /// CDW2 as the driver wrote it: the oracle's tag of the command.
    pub tag: u32,
    pub opcode: u8,
}

/// Why a [`Port`] could not bring up a new device (the port's own error).
pub type RestartError = Box<dyn std::error::Error + Send + Sync>;

/// How the reference driver reaches a controller.
pub trait Port {
    /// A 32-bit register read of BAR0 at `off`.
    fn read32(&self, off: u64) -> u32;
    /// A register write of 4 or 8 bytes to BAR0 at `off`.
    fn write(&self, off: u64, data: &[u8]);
    /// A doorbell store to BAR0 at `off`, carried as the host carries a
    /// CPU's store there: into a mapped doorbell page, as an ioeventfd
    /// kick, or as an exit (a register write).
    fn doorbell(&self, off: u64, value: u32);
    /// Guest RAM as the driver sees it.
    fn ram(&self) -> &GuestMemoryMmap;
    /// The device's counters (at a quiescent point).
    fn counters(&self) -> Vec<Counter>;
    /// The operations the controller fetched since the last call, if this
    /// port can see them (a controller in this process).
    fn take_ops(&self) -> Option<Vec<OpRecord>>;
    /// The timed completions the controller posted since the last call
    /// (due and posted times on its clock), if this port can see them.
    fn take_timed(&self) -> Option<Vec<crate::nvme::TimedRecord>> {
        None
    }
    /// Kills the device (its process, with SIGKILL) with whatever it has
    /// in flight and brings up a new one on the same storage, reached
    /// through this port; None if this port cannot.
    fn restart(&self) -> Option<Result<(), RestartError>> {
        None
    }
}
