//! Error injection's rules engine, pure code: rules ([`rule`]), their
//! JSON form (the control socket's, `json.rs`) and text form (the
//! `inject=` device option's, [`text`]), and the set a device asks once per
//! command ([`set`]), and the handle a device and its control socket share
//! ([`injector`]). Nothing here touches a controller, a queue, a clock
//! or a socket: front ends build a [`CommandView`], call
//! [`RuleSet::decide`] and carry out the [`Action`].
//!
//! A rule is a matcher (every field given must match; none: every
//! command), one action, and a trigger (absent: always). Rules are tried
//! in the order they were added; the first that matches *and* whose
//! trigger fires wins, and later rules do not see that command.
//!
//! # JSON (one line, at most 4096 bytes)
//!
//! ```json
//! {"match":{"op":"read","nsid":1,"lba":[0,1023],"qid":1},
//!  "action":{"status":{"sct":2,"sc":129,"dnr":false}},"trigger":{"every":10}}
//! ```
//! Integers are numbers or strings of decimal or `0x` numbers (`"sc":"0x81"`).
//! Unknown fields are errors. Written back canonically (`to_json`), with
//! `"id"` once a set holds the rule.
//!
//! | piece | JSON | text |
//! |---|---|---|
//! | op kind | `"op":"read"` (`write`, `flush`, `discard`/`dsm`, `write-zeroes`) | `op=read` |
//! | any admin command | `"op":"admin"` | `op=admin` |
//! | admin opcode | `"op":{"admin":6}` | `op=admin:0x06` |
//! | I/O opcode | `"op":{"io":5}` | `op=io:0x05` |
//! | namespace | `"nsid":1` | `nsid=1` |
//! | LBAs overlapping `first..=last` | `"lba":[0,1023]` | `lba=0-1023` |
//! | submission queue (0: admin) | `"qid":1` | `qid=1` |
//! | status (SCT 0-7, SC 0-255) | `"status":{"sct":2,"sc":129,"dnr":true,"more":false}` | `status=2:0x81:dnr` (`:more`) |
//! | delay (at most 600 s) | `"delay":{"us":100}` (`ns`, `us`, `ms`) | `delay=100us` (`ns`, `us`, `ms`, `s`) |
//! | no completion | `"action":"drop"` | `drop` |
//! | corrupt a read's data | `"corrupt":{"bytes":4,"seed":7}` (`"action":"corrupt"`: 1 byte, seed 0) | `corrupt=4:7` (`corrupt`) |
//! | controller fatal (CSTS.CFS) | `"action":"fatal"` | `fatal` |
//! | SMART critical warning event | `"event":{"smart":1}` (bits 0x3f) | `event=smart:0x01` |
//! | namespace attribute changed | `"event":"ns-changed"` | `event=ns-changed` |
//! | every match | `"trigger":"always"` (or none) | `always` (or none) |
//! | the first match | `"trigger":"once"` | `once` |
//! | matches N, 2N, ... | `"trigger":{"every":10}` | `every=10` |
//! | the first N matches | `"trigger":{"count":5}` | `count=5` |
//! | probability p, seeded | `"trigger":{"probability":{"p":0.01,"seed":42}}` | `p=0.01:42` |
//!
//! An action other than `drop`, `fatal` or the bare `corrupt` is an object
//! of exactly one key (`"action":{"delay":{"ns":5000}}`). `corrupt` needs
//! `op` read. N of `every`/`count` is 1 to 2^32-1; p is 0 to 1, rounded to
//! 10^-9; the seed any u64 (the same seed gives the same sequence).
//!
//! # Text (`inject=`)
//!
//! Items joined by `/`, rules of a list by `+`, no `,` or `@`, so the
//! device option needs no escaping:
//! `inject=op=read/lba=0-7/status=2:0x81/once+op=write/nsid=1/delay=2ms/p=0.5:9`.
//!
//! Errors ([`RuleError`]) name the piece: `action.status.sct: 9 is out of
//! range (0 to 7)`.

pub mod injector;
pub mod json;
pub mod rule;
pub mod set;
pub mod text;

pub use injector::Injector;
pub use json::MAX_JSON_LINE;
pub use rule::{
    Action, CommandView, Corrupt, Event, Kind, LbaRange, Lbas, Matcher, Op, Rule, RuleError, Status, Trigger,
};
pub use set::{RuleSet, RuleStats, Stats, MAX_RULES};
pub use text::{parse_rules, write_rules};

#[cfg(test)]
mod tests;
