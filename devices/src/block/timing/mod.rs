//! A device timing model for a block namespace, off by default: how long
//! each command takes inside the emulated device. Pure code (no clock, no
//! thread): time is an argument everywhere, so the model and its tests are
//! deterministic.
//! - [`spec`]: [`TimingSpec`], the `timing=` value (grammar, bounds, typed
//!   errors) and its [`Latency`] distributions;
//! - [`model`]: [`TimingModel::admit`] gives a command its due time
//!   (service time drawn from its operation's distribution, N channels, the
//!   IOPS and bandwidth ceilings);
//! - [`wheel`]: [`TimerWheel`], the due times of the commands in flight,
//!   expired in due order by the device's own threads;
//! - [`hist`]: [`DeviceHist`], each timed completion's device time and
//!   lateness as the device saw them (its counters).
//!
//! Wiring (virtio-blk's: `virtio/blk_emu.rs`; NVMe's: `nvme/timing.rs`): a front end (NVMe's queue poller,
//! virtio-blk's) carries a command out on the storage as today, then,
//! instead of posting its completion, calls `admit(now, op, bytes)` on
//! the namespace's model (one per namespace, behind the namespace's lock or
//! one per poller thread with the ceilings divided) and inserts
//! `(due, command slot)` into its thread's wheel (capacity = its queues'
//! entries). Each turn of the poller calls `expire(now)` and posts those
//! completions; when it would sleep it sleeps no longer than `next_due()`
//! (a timerfd for long waits, spinning for the last microseconds).

pub mod hist;
pub mod model;
pub mod spec;
pub mod wheel;

pub use hist::DeviceHist;
pub use model::{Admission, TimingModel};
pub use spec::{Latency, OpKind, TimingError, TimingSpec};
pub use wheel::{TimerWheel, WheelFull};
