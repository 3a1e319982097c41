//! A schedule's shape: the choices fixed before it runs (queues, doorbell
//! habits, resets, crashes, the namespace's kind, injection rules).

use super::super::rng::Rng;
use crate::block::inject::Rule;

/// A schedule's fixed choices; the rest is drawn step by step.
#[derive(Clone, Debug)]
pub struct Shape {
    pub steps: u32,
    /// I/O SQs (1..=MAX_QUEUES) and the CQs they share (1..=sqs).
    pub sqs: u16,
    pub cqs: u16,
    /// Admin queue entries (2..=64).
    pub admin: u16,
    /// Commands in flight at most, over all SQs.
    pub inflight: u16,
    /// Commands per submission batch at most.
    pub batch: u16,
    /// Use Doorbell Buffer Config where the controller offers it.
    pub shadow: bool,
    /// With shadow doorbells: ring the register only when EventIdx asks
    /// (Linux); otherwise after every shadow update.
    pub event_idx: bool,
    /// Ring the SQ tail every this many entries within a batch (0: only
    /// after the batch).
    pub sq_every: u16,
    /// Percent of batches whose tail is not rung at their end (late).
    pub sq_late: u64,
    /// Ring the CQ head every this many completions reaped (0: after a reap).
    pub cq_every: u16,
    /// Percent of reaps whose head is not rung at their end (late).
    pub cq_late: u64,
    /// Delete and create queues again, reset and shut down the controller.
    pub deletes: bool,
    pub resets: bool,
    /// Kill the device with commands in flight and start a new one on the
    /// same storage (`Port::restart`).
    pub crashes: bool,
    /// The namespace keeps data (false: a null namespace, whose reads
    /// leave the buffer as it was; their data is not checked).
    pub data: bool,
    /// The error injection rules the controller was given (`inject=`),
    /// each triggered always: the driver expects each command's fate from
    /// the first that matches it ([`injection_rules`]).
    pub rules: Vec<Rule>,
}

/// Rules for the oracle over a namespace of `nlbas` LBAs (the model's
/// first 4096 at most): reads of one range fail with Unrecovered Read
/// Error, reads of another are dropped (the driver aborts them), reads of
/// a third come back with `seed`'s bytes flipped, writes of a fourth are
/// delayed 200 us, flushes raise a SMART event (no AER is outstanding: it
/// waits), all triggered always.
pub fn injection_rules(nlbas: u64, seed: u64) -> Vec<Rule> {
    let n = nlbas.min(4096);
    let r = |a: u64, len: u64| format!("{}-{}", a, (a + len - 1).min(n - 1));
    let text = format!(
        "op=read/lba={}/status=2:0x81+op=read/lba={}/drop+op=read/lba={}/corrupt=5:{seed}+op=write/lba={}/delay=200us+op=flush/event=smart:0x04",
        r(n / 8, 8),
        r(n / 2, 2),
        r(n / 4, n / 16),
        r(3 * n / 4, n / 8)
    );
    crate::block::inject::parse_rules(&text).expect("the oracle's rules")
}

impl Shape {
    /// A schedule drawn from `rng`.
    pub fn random(rng: &mut Rng, steps: u32) -> Shape {
        let sqs = rng.range(1, 4) as u16;
        Shape {
            steps,
            sqs,
            cqs: rng.range(1, sqs as u64) as u16,
            admin: rng.pick(&[2, 3, 8, 32, 64]),
            inflight: rng.pick(&[1, 2, 4, 16, 64, 255]),
            batch: rng.pick(&[1, 2, 4, 16, 64]),
            shadow: rng.chance(70),
            event_idx: rng.chance(80),
            sq_every: rng.pick(&[0, 0, 1, 3, 16]),
            sq_late: rng.pick(&[0, 0, 20, 60]),
            cq_every: rng.pick(&[0, 1, 1, 4, 16]),
            cq_late: rng.pick(&[0, 0, 20, 60]),
            deletes: rng.chance(50),
            resets: rng.chance(50),
            crashes: false,
            data: true,
            rules: Vec::new(),
        }
    }

    /// The driver that met replayed commands: one 256-entry I/O queue, 4
    /// writes in flight, its SQ tail rung every 16 entries and after each
    /// batch, its CQ head rung after each completion it reaps.
    pub fn replay_case(steps: u32) -> Shape {
        Shape {
            steps,
            sqs: 1,
            cqs: 1,
            admin: 32,
            inflight: 4,
            batch: 4,
            shadow: false,
            event_idx: true,
            sq_every: 16,
            sq_late: 0,
            cq_every: 1,
            cq_late: 0,
            deletes: false,
            resets: false,
            crashes: false,
            data: true,
            rules: Vec::new(),
        }
    }

    /// The durability case: many writes in flight (up to 255), the device
    /// killed now and then and a new one started on the same storage.
    pub fn durability(rng: &mut Rng, steps: u32) -> Shape {
        Shape {
            sqs: rng.range(1, 2) as u16,
            inflight: 255,
            batch: 64,
            sq_every: rng.pick(&[0, 16]),
            cq_every: rng.pick(&[0, 1]),
            crashes: true,
            resets: false,
            deletes: false,
            ..Shape::random(rng, steps)
        }
    }
}

impl Shape {
    /// Several SQs on one small CQ, its head rung late: completions wait
    /// for room, and the controller must ask for the head (EventIdx) and
    /// keep asking while any SQ of that CQ holds commands back.
    pub fn shared_small_cq(steps: u32) -> Shape {
        Shape {
            sqs: 3,
            cqs: 1,
            inflight: 64,
            batch: 16,
            shadow: true,
            cq_every: 0,
            cq_late: 60,
            ..Shape::replay_case(steps)
        }
    }
}
