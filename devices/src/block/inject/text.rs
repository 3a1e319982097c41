//! A rule's text form, for the `inject=` device option: `/`-separated
//! items (`op=read/lba=0-1023/status=2:0x81:dnr/every=10`), rules of a
//! list joined by `+`; never a `,` or `@` (the device option syntax's
//! separators), so a value needs no escaping. The grammar with examples is
//! in the module's `//!` (`inject/mod.rs`); [`Rule`]'s `Display` writes
//! what `FromStr` reads back (without the id).

use super::rule::*;
use std::fmt;

/// The longest text an `inject=` value may be.
pub const MAX_TEXT: usize = 4096;

type R<T> = Result<T, RuleError>;

/// A decimal or `0x` hexadecimal number.
pub fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()) => u64::from_str_radix(h, 16).ok(),
        Some(_) => None,
        None if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) => s.parse().ok(),
        None => None,
    }
}

/// An op kind by name (`dsm` is `discard`).
pub fn op_name(s: &str) -> Option<Op> {
    Some(match s {
        "read" => Op::Read,
        "write" => Op::Write,
        "flush" => Op::Flush,
        "discard" | "dsm" => Op::Discard,
        "write-zeroes" => Op::WriteZeroes,
        "admin" => Op::Admin(None),
        _ => return None,
    })
}

/// The name of an op kind without a number.
pub fn op_str(op: Op) -> &'static str {
    match op {
        Op::Read => "read",
        Op::Write => "write",
        Op::Flush => "flush",
        Op::Discard => "discard",
        Op::WriteZeroes => "write-zeroes",
        Op::Admin(_) => "admin",
        Op::Io(_) => "io",
    }
}

fn num(field: &'static str, s: &str, max: u64) -> R<u64> {
    let n =
        parse_u64(s).ok_or_else(|| RuleError::Type { field, value: shown(s), expected: "a decimal or 0x number" })?;
    if n > max {
        return Err(RuleError::TooLarge { field, value: shown(s), max });
    }
    Ok(n)
}

fn need<'a>(field: &'static str, v: Option<&'a str>) -> R<&'a str> {
    v.ok_or(RuleError::Missing { field })
}

fn set<T>(slot: &mut Option<T>, field: &'static str, piece: &str, v: T) -> R<()> {
    if slot.is_some() {
        return Err(RuleError::Duplicate { field, piece: shown(piece) });
    }
    *slot = Some(v);
    Ok(())
}

fn parse_op(v: &str) -> R<Op> {
    let bad = || RuleError::UnknownField {
        field: "match.op",
        name: shown(v),
        allowed: "read, write, flush, discard, dsm, write-zeroes, admin, admin:N, io:N",
    };
    if let Some(op) = op_name(v) {
        return Ok(op);
    }
    match v.split_once(':') {
        Some(("admin", n)) => Ok(Op::Admin(Some(num("match.op.admin", n, 255)? as u8))),
        Some(("io", n)) => Ok(Op::Io(num("match.op.io", n, 255)? as u8)),
        _ => Err(bad()),
    }
}

fn parse_status(v: &str) -> R<Status> {
    let mut it = v.split(':');
    let sct = num("action.status.sct", need("action.status.sct", it.next())?, 255)? as u8;
    let sc = num("action.status.sc", need("action.status.sc", it.next())?, 255)? as u8;
    let (mut dnr, mut more) = (false, false);
    for flag in it {
        let slot = match flag {
            "dnr" => &mut dnr,
            "more" => &mut more,
            _ => {
                let allowed = "dnr, more";
                return Err(RuleError::UnknownField { field: "action.status", name: shown(flag), allowed });
            }
        };
        if *slot {
            return Err(RuleError::Duplicate { field: "action.status", piece: shown(flag) });
        }
        *slot = true;
    }
    Ok(Status { sct, sc, dnr, more })
}

const UNITS: [(&str, u64); 4] = [("ns", 1), ("us", 1_000), ("ms", 1_000_000), ("s", 1_000_000_000)];

fn parse_delay(v: &str) -> R<u64> {
    let (n, unit) = v.split_at(v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len()));
    let mul = UNITS.iter().find(|(name, _)| *name == unit).map(|&(_, m)| m);
    let mul = match (unit, mul) {
        ("", _) => 1,
        (_, Some(m)) => m,
        _ => {
            return Err(RuleError::UnknownField { field: "action.delay", name: shown(unit), allowed: "ns, us, ms, s" })
        }
    };
    num("action.delay", n, u64::MAX)?.checked_mul(mul).ok_or_else(|| RuleError::Range {
        field: "action.delay",
        value: shown(v),
        allowed: "at most 600 s",
    })
}

fn parse_event(v: &str) -> R<Event> {
    match v.split_once(':') {
        None if v == "ns-changed" => Ok(Event::NsChanged),
        Some(("smart", b)) => Ok(Event::SmartWarning(num("action.event.smart", b, 255)? as u8)),
        _ => Err(RuleError::UnknownField { field: "action.event", name: shown(v), allowed: "ns-changed, smart:BITS" }),
    }
}

fn parse_p(v: &str) -> R<Trigger> {
    let (p, seed) = match v.split_once(':') {
        Some((p, s)) => (p, num("trigger.probability.seed", s, u64::MAX)?),
        None => (v, 0),
    };
    let pf = match p.parse::<f64>() {
        Ok(f) if p.bytes().all(|b| b.is_ascii_digit() || b == b'.') => f,
        _ => {
            return Err(RuleError::Type {
                field: "trigger.probability.p",
                value: shown(p),
                expected: "a number 0 to 1",
            })
        }
    };
    Trigger::probability(pf, seed)
}

impl std::str::FromStr for Rule {
    type Err = RuleError;

    /// One rule in the text form, validated (id 0).
    fn from_str(s: &str) -> R<Rule> {
        if s.len() > MAX_TEXT {
            return Err(RuleError::TooLong { what: "inject text", len: s.len(), max: MAX_TEXT });
        }
        let (mut op, mut nsid, mut lba, mut qid) = (None, None, None, None);
        let (mut action, mut trigger) = (None, None);
        for item in s.split('/') {
            let (k, v) = match item.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (item, None),
            };
            match k {
                "op" => set(&mut op, "match.op", item, parse_op(need("match.op", v)?)?)?,
                "nsid" => set(
                    &mut nsid,
                    "match.nsid",
                    item,
                    num("match.nsid", need("match.nsid", v)?, u32::MAX.into())? as u32,
                )?,
                "qid" => {
                    set(&mut qid, "match.qid", item, num("match.qid", need("match.qid", v)?, u16::MAX.into())? as u16)?
                }
                "lba" => {
                    let v = need("match.lba", v)?;
                    let (a, b) = v.split_once('-').ok_or_else(|| RuleError::Type {
                        field: "match.lba",
                        value: shown(v),
                        expected: "FIRST-LAST",
                    })?;
                    let r = LbaRange { first: num("match.lba", a, u64::MAX)?, last: num("match.lba", b, u64::MAX)? };
                    set(&mut lba, "match.lba", item, r)?
                }
                "status" => set(&mut action, "action", item, Action::Status(parse_status(need("action.status", v)?)?))?,
                "delay" => {
                    set(&mut action, "action", item, Action::Delay { ns: parse_delay(need("action.delay", v)?)? })?
                }
                "drop" if v.is_none() => set(&mut action, "action", item, Action::Drop)?,
                "fatal" if v.is_none() => set(&mut action, "action", item, Action::Fatal)?,
                "corrupt" => {
                    let c = match v {
                        None => Corrupt { bytes: 1, seed: 0 },
                        Some(v) => {
                            let (b, seed) = v.split_once(':').unwrap_or((v, "0"));
                            let bytes = num("action.corrupt.bytes", b, u16::MAX.into())? as u16;
                            Corrupt { bytes, seed: num("action.corrupt.seed", seed, u64::MAX)? }
                        }
                    };
                    set(&mut action, "action", item, Action::Corrupt(c))?
                }
                "event" => set(&mut action, "action", item, Action::Event(parse_event(need("action.event", v)?)?))?,
                "always" if v.is_none() => set(&mut trigger, "trigger", item, Trigger::Always)?,
                "once" if v.is_none() => set(&mut trigger, "trigger", item, Trigger::Once)?,
                "every" => set(
                    &mut trigger,
                    "trigger",
                    item,
                    Trigger::Every(num("trigger.every", need("trigger.every", v)?, u64::MAX)?),
                )?,
                "count" => set(
                    &mut trigger,
                    "trigger",
                    item,
                    Trigger::Count(num("trigger.count", need("trigger.count", v)?, u64::MAX)?),
                )?,
                "p" => set(&mut trigger, "trigger", item, parse_p(need("trigger.probability", v)?)?)?,
                _ => {
                    let allowed =
                        "op, nsid, lba, qid, status, delay, drop, corrupt, fatal, event, always, once, every, count, p";
                    return Err(RuleError::UnknownField { field: "rule", name: shown(item), allowed });
                }
            }
        }
        let matcher = Matcher { op, nsid, lba, qid };
        let action = action.ok_or(RuleError::Missing { field: "action" })?;
        let rule = Rule { id: 0, matcher, action, trigger: trigger.unwrap_or_default() };
        rule.validate()?;
        Ok(rule)
    }
}

/// Rules joined by `+` (an `inject=` value), each validated.
pub fn parse_rules(s: &str) -> R<Vec<Rule>> {
    if s.len() > MAX_TEXT {
        return Err(RuleError::TooLong { what: "inject text", len: s.len(), max: MAX_TEXT });
    }
    s.split('+').map(str::parse).collect()
}

/// Rules in the form [`parse_rules`] reads.
pub fn write_rules(rules: &[Rule]) -> String {
    rules.iter().map(Rule::to_string).collect::<Vec<_>>().join("+")
}

/// A ppb as the shortest decimal (`0.01`, `1`, `0`).
fn write_ppb(ppb: u32, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    match ppb {
        0 => f.write_str("0"),
        PPB => f.write_str("1"),
        _ => write!(f, "0.{}", format!("{ppb:09}").trim_end_matches('0')),
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.matcher;
        let mut items = Vec::new();
        match m.op {
            Some(Op::Admin(Some(n))) => items.push(format!("op=admin:{n:#04x}")),
            Some(Op::Io(n)) => items.push(format!("op=io:{n:#04x}")),
            Some(op) => items.push(format!("op={}", op_str(op))),
            None => {}
        }
        if let Some(n) = m.nsid {
            items.push(format!("nsid={n}"));
        }
        if let Some(r) = m.lba {
            items.push(format!("lba={}-{}", r.first, r.last));
        }
        if let Some(q) = m.qid {
            items.push(format!("qid={q}"));
        }
        items.push(match self.action {
            Action::Status(s) => {
                format!(
                    "status={}:{:#04x}{}{}",
                    s.sct,
                    s.sc,
                    if s.dnr { ":dnr" } else { "" },
                    if s.more { ":more" } else { "" }
                )
            }
            Action::Delay { ns } => {
                let (name, mul) = UNITS.iter().rev().find(|(_, m)| ns % m == 0).copied().unwrap_or(("ns", 1));
                format!("delay={}{name}", ns / mul)
            }
            Action::Drop => "drop".into(),
            Action::Corrupt(c) => format!("corrupt={}:{}", c.bytes, c.seed),
            Action::Fatal => "fatal".into(),
            Action::Event(Event::SmartWarning(b)) => format!("event=smart:{b:#04x}"),
            Action::Event(Event::NsChanged) => "event=ns-changed".into(),
        });
        f.write_str(&items.join("/"))?;
        match self.trigger {
            Trigger::Always => Ok(()),
            Trigger::Once => f.write_str("/once"),
            Trigger::Every(n) => write!(f, "/every={n}"),
            Trigger::Count(n) => write!(f, "/count={n}"),
            Trigger::Probability { ppb, seed } => {
                f.write_str("/p=")?;
                write_ppb(ppb, f)?;
                write!(f, ":{seed}")
            }
        }
    }
}
