//! One injection rule ([`Rule`]): which commands it matches ([`Matcher`]
//! over a [`CommandView`]), what it does to them ([`Action`]) and when it
//! fires ([`Trigger`]); the bounds every rule is held to
//! ([`Rule::validate`]) and the typed errors of both forms ([`RuleError`]).
//! The JSON form is `json.rs`'s, the text form `text.rs`'s; the trigger's
//! state (counters, a probability's generator) lives in the set
//! (`set.rs`), so a `Rule` is plain data.

/// The longest delay a rule may ask for: 600 s (past every host timeout
/// worth testing; a longer one is a [`Action::Drop`]).
pub const MAX_DELAY_NS: u64 = 600_000_000_000;
/// The largest N of `every` and `count`.
pub const MAX_TRIGGER_N: u64 = u32::MAX as u64;
/// The most bytes one corruption flips.
pub const MAX_CORRUPT_BYTES: u16 = 4096;
/// The SMART / Health critical warning bits NVMe defines (bits 0 to 5).
pub const SMART_WARNING_BITS: u8 = 0x3f;
/// A probability's unit: parts per billion.
pub const PPB: u32 = 1_000_000_000;

/// What a command is, as the front end classifies it (NVMe's NVM command
/// set, virtio-blk's request types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Read,
    Write,
    Flush,
    /// NVMe Dataset Management with Deallocate, virtio-blk DISCARD.
    Discard,
    WriteZeroes,
    /// A command on the admin queue.
    Admin,
    /// Any other I/O command.
    Other,
}

/// The LBAs a command touches: `nlb + 1` blocks from `slba` (`nlb` is
/// 0-based, as NVMe's NLB field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lbas {
    pub slba: u64,
    pub nlb: u32,
}

/// What a rule looks at in a command; the front end fills it before it
/// executes the command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommandView {
    /// The front end's opcode (NVMe's; virtio-blk gives the NVMe opcode
    /// of the same operation).
    pub opcode: u8,
    pub kind: Kind,
    pub nsid: u32,
    /// None for commands without an LBA range (flush, admin commands). A
    /// Dataset Management command gives the span of its ranges.
    pub lba: Option<Lbas>,
    /// The submission queue (0: admin).
    pub qid: u16,
}

/// Which commands an [`Op`] matcher takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Read,
    Write,
    Flush,
    /// Dataset Management (deallocate) / discard.
    Discard,
    WriteZeroes,
    /// Admin commands: any (None) or this opcode.
    Admin(Option<u8>),
    /// I/O commands with this opcode (any command set).
    Io(u8),
}

impl Op {
    pub fn matches(self, cmd: &CommandView) -> bool {
        match self {
            Op::Read => cmd.kind == Kind::Read,
            Op::Write => cmd.kind == Kind::Write,
            Op::Flush => cmd.kind == Kind::Flush,
            Op::Discard => cmd.kind == Kind::Discard,
            Op::WriteZeroes => cmd.kind == Kind::WriteZeroes,
            Op::Admin(None) => cmd.kind == Kind::Admin,
            Op::Admin(Some(o)) => cmd.kind == Kind::Admin && cmd.opcode == o,
            Op::Io(o) => cmd.kind != Kind::Admin && cmd.opcode == o,
        }
    }
}

/// LBAs `first..=last` (validated: `first <= last`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaRange {
    pub first: u64,
    pub last: u64,
}

impl LbaRange {
    /// Whether a command's LBAs overlap the range. A range running past
    /// the last LBA a u64 can name ends there (the front end answers LBA
    /// Out of Range for it anyway; matching never overflows).
    pub fn overlaps(&self, l: Lbas) -> bool {
        let end = l.slba.saturating_add(u64::from(l.nlb));
        l.slba <= self.last && end >= self.first
    }
}

/// The commands a rule applies to: every field given must match (none
/// given: every command).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Matcher {
    pub op: Option<Op>,
    pub nsid: Option<u32>,
    /// A command matches if its LBAs overlap; a command without LBAs does not.
    pub lba: Option<LbaRange>,
    pub qid: Option<u16>,
}

impl Matcher {
    pub fn matches(&self, cmd: &CommandView) -> bool {
        self.op.is_none_or(|o| o.matches(cmd))
            && self.nsid.is_none_or(|n| n == cmd.nsid)
            && self.qid.is_none_or(|q| q == cmd.qid)
            && self.lba.is_none_or(|r| cmd.lba.is_some_and(|l| r.overlaps(l)))
    }
}

/// A completion status: Status Code Type (0..=7), Status Code, Do Not
/// Retry, More.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
    pub more: bool,
}

impl Status {
    /// The completion's 15-bit Status Field as `nvme::queue::post_cqe`
    /// takes it (DW3 bits 31:17): SC in bits 7:0, SCT 10:8, CRD 12:11 (0),
    /// More 13, DNR 14.
    pub fn field(&self) -> u16 {
        u16::from(self.sc) | u16::from(self.sct & 7) << 8 | u16::from(self.more) << 13 | u16::from(self.dnr) << 14
    }
}

/// Which bytes of a read's data to flip: `bytes` distinct offsets, each
/// XORed with a non-zero value, all drawn from `seed` (the same seed and
/// length flip the same bytes every time).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Corrupt {
    pub bytes: u16,
    pub seed: u64,
}

impl Corrupt {
    /// The flips for `len` bytes of data, by offset: `min(bytes, len)`
    /// distinct offsets below `len`, each with a non-zero XOR value.
    pub fn flips(&self, len: usize) -> Vec<(usize, u8)> {
        let n = usize::from(self.bytes).min(len);
        let mut state = self.seed;
        let mut out: Vec<(usize, u8)> = Vec::with_capacity(n);
        while out.len() < n {
            let r = splitmix64(&mut state);
            let off = (r % len as u64) as usize;
            if let Err(at) = out.binary_search_by_key(&off, |f| f.0) {
                out.insert(at, (off, 1 + ((r >> 32) % 255) as u8));
            }
        }
        out
    }

    /// Flips the bytes of [`flips`](Self::flips) in `data`.
    pub fn apply(&self, data: &mut [u8]) {
        for (off, x) in self.flips(data.len()) {
            data[off] ^= x;
        }
    }
}

/// An asynchronous event the controller posts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// SMART / Health critical warning bits (non-zero, within
    /// [`SMART_WARNING_BITS`]).
    SmartWarning(u8),
    /// Namespace Attribute Changed (for the command's namespace).
    NsChanged,
}

/// What happens to a command whose rule fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Completed with this status, not executed.
    Status(Status),
    /// Executed, its completion posted this many ns later.
    Delay { ns: u64 },
    /// Not executed, never completed (the host times out).
    Drop,
    /// A read, executed, with its data corrupted before it reaches the host.
    Corrupt(Corrupt),
    /// Controller Fatal Status (CSTS.CFS) set; the command is not completed.
    Fatal,
    /// Executed as usual, and this event posted.
    Event(Event),
}

/// When a matching rule fires (counted over the commands that reach the
/// rule and match it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Trigger {
    /// Every match.
    #[default]
    Always,
    /// The first match only.
    Once,
    /// Matches N, 2N, 3N, ...
    Every(u64),
    /// The first N matches.
    Count(u64),
    /// Each match with probability `ppb` / 10^9, drawn from a generator
    /// seeded with `seed`.
    Probability { ppb: u32, seed: u64 },
}

impl Trigger {
    /// A probability trigger from `p` in [0, 1] (rounded to 10^-9).
    pub fn probability(p: f64, seed: u64) -> Result<Trigger, RuleError> {
        if !(0.0..=1.0).contains(&p) {
            return Err(RuleError::Range { field: "trigger.probability.p", value: p.to_string(), allowed: "0 to 1" });
        }
        Ok(Trigger::Probability { ppb: (p * f64::from(PPB)).round() as u32, seed })
    }
}

/// One rule. `id` is the set's (0 until a set takes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    pub id: u64,
    pub matcher: Matcher,
    pub action: Action,
    pub trigger: Trigger,
}

/// A rule that does not parse or is out of bounds; `field` names the
/// piece (`action.status.sct`, `match.lba`, ...).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RuleError {
    #[error("{what} of {len} bytes is longer than the {max} allowed")]
    TooLong { what: &'static str, len: usize, max: usize },
    #[error("not JSON: {0}")]
    Json(String),
    #[error("{field}: {value} is not {expected}")]
    Type { field: &'static str, value: String, expected: &'static str },
    #[error("{field}: unknown field {name:?} (one of {allowed})")]
    UnknownField { field: &'static str, name: String, allowed: &'static str },
    #[error("{field}: missing")]
    Missing { field: &'static str },
    #[error("{field}: {value} is out of range ({allowed})")]
    Range { field: &'static str, value: String, allowed: &'static str },
    #[error("{field}: {value} is larger than {max}")]
    TooLarge { field: &'static str, value: String, max: u64 },
    #[error("{field}: given twice ({piece:?})")]
    Duplicate { field: &'static str, piece: String },
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: &'static str },
    #[error("a set holds at most {max} rules")]
    TooManyRules { max: usize },
    #[error("no rule {id}")]
    NoSuchRule { id: u64 },
    /// A valid rule this device cannot carry out (virtio-blk: an event).
    #[error("{0}")]
    Refused(String),
}

impl RuleError {
    /// The piece it names, if it names one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            RuleError::Type { field, .. }
            | RuleError::UnknownField { field, .. }
            | RuleError::Missing { field }
            | RuleError::Range { field, .. }
            | RuleError::TooLarge { field, .. }
            | RuleError::Duplicate { field, .. }
            | RuleError::Invalid { field, .. } => Some(field),
            RuleError::Refused(_) => Some("action"),
            _ => None,
        }
    }
}

/// `value` shown in an error, cut to 40 characters (a peer's input).
pub(super) fn shown(value: &str) -> String {
    match value.char_indices().nth(40) {
        Some((at, _)) => format!("{}...", &value[..at]),
        None => value.to_string(),
    }
}

fn range(field: &'static str, value: u64, allowed: &'static str) -> RuleError {
    RuleError::Range { field, value: value.to_string(), allowed }
}

impl Rule {
    /// Checks every bound; a set takes only rules that pass.
    pub fn validate(&self) -> Result<(), RuleError> {
        if let Some(r) = self.matcher.lba {
            if r.first > r.last {
                return Err(RuleError::Invalid { field: "match.lba", reason: "first LBA after last" });
            }
        }
        match self.action {
            Action::Status(s) if s.sct > 7 => return Err(range("action.status.sct", s.sct.into(), "0 to 7")),
            Action::Delay { ns } if ns > MAX_DELAY_NS => {
                return Err(range("action.delay", ns, "at most 600 s"));
            }
            Action::Corrupt(c) => {
                if c.bytes == 0 || c.bytes > MAX_CORRUPT_BYTES {
                    return Err(range("action.corrupt.bytes", c.bytes.into(), "1 to 4096"));
                }
                if self.matcher.op != Some(Op::Read) {
                    return Err(RuleError::Invalid {
                        field: "action.corrupt",
                        reason: "corrupts reads only (op read)",
                    });
                }
            }
            Action::Event(Event::SmartWarning(b)) if b == 0 || b & !SMART_WARNING_BITS != 0 => {
                return Err(range("action.event.smart", b.into(), "non-zero, bits 0x3f"));
            }
            _ => {}
        }
        match self.trigger {
            Trigger::Every(n) if n == 0 || n > MAX_TRIGGER_N => Err(range("trigger.every", n, "1 to 2^32-1")),
            Trigger::Count(n) if n == 0 || n > MAX_TRIGGER_N => Err(range("trigger.count", n, "1 to 2^32-1")),
            Trigger::Probability { ppb, .. } if ppb > PPB => {
                Err(range("trigger.probability.p", ppb.into(), "0 to 10^9 ppb"))
            }
            _ => Ok(()),
        }
    }
}

/// The deterministic generator of probabilities and corruptions.
pub use crate::rng::next as splitmix64;
