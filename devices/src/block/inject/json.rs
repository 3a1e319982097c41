//! A rule's JSON form (the control socket's; the grammar with examples is
//! in the module's `//!`, `inject/mod.rs`): parsed from a bounded line
//! into a `serde_json::Value`, then read field by field so every error
//! names its field; written back canonically (numbers, the short forms
//! for `drop`, `fatal`, `always`, `once`).

use super::rule::*;
use serde_json::{json, Map, Value};

/// The longest JSON line a rule (or a control request) may be.
pub const MAX_JSON_LINE: usize = 4096;

type R<T> = Result<T, RuleError>;

impl Rule {
    /// A rule from one JSON line (at most [`MAX_JSON_LINE`] bytes),
    /// validated. An `id` in it is read and kept (a set replaces it).
    pub fn from_json(line: &str) -> R<Rule> {
        if line.len() > MAX_JSON_LINE {
            return Err(RuleError::TooLong { what: "JSON line", len: line.len(), max: MAX_JSON_LINE });
        }
        let v: Value = serde_json::from_str(line).map_err(|e| RuleError::Json(e.to_string()))?;
        Rule::from_value(&v)
    }

    /// A rule from a parsed JSON value, validated.
    pub fn from_value(v: &Value) -> R<Rule> {
        let m = object(v, "rule", &["id", "match", "action", "trigger"], "id, match, action, trigger")?;
        let id = m.get("id").map(|v| uint(v, "id", u64::MAX)).transpose()?.unwrap_or(0);
        let matcher = m.get("match").map(matcher).transpose()?.unwrap_or_default();
        let action = action(m.get("action").ok_or(RuleError::Missing { field: "action" })?)?;
        let trigger = m.get("trigger").map(trigger).transpose()?.unwrap_or_default();
        let rule = Rule { id, matcher, action, trigger };
        rule.validate()?;
        Ok(rule)
    }

    /// The canonical JSON value (`id` left out while 0).
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        if self.id != 0 {
            m.insert("id".into(), self.id.into());
        }
        let mt = matcher_value(&self.matcher);
        if !mt.is_empty() {
            m.insert("match".into(), Value::Object(mt));
        }
        m.insert("action".into(), action_value(&self.action));
        if self.trigger != Trigger::Always {
            m.insert("trigger".into(), trigger_value(&self.trigger));
        }
        Value::Object(m)
    }

    /// The canonical JSON line.
    pub fn to_json(&self) -> String {
        self.to_value().to_string()
    }
}

impl serde::Serialize for Rule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_value().serialize(s)
    }
}

/// Validated as [`Rule::from_value`]; no length bound (a peer's line goes
/// through [`Rule::from_json`]).
impl<'de> serde::Deserialize<'de> for Rule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        Rule::from_value(&v).map_err(serde::de::Error::custom)
    }
}

fn type_err(field: &'static str, v: &Value, expected: &'static str) -> RuleError {
    RuleError::Type { field, value: shown(&v.to_string()), expected }
}

/// `v` as an object whose keys are all in `keys`.
fn object<'a>(v: &'a Value, field: &'static str, keys: &[&str], allowed: &'static str) -> R<&'a Map<String, Value>> {
    let m = v.as_object().ok_or_else(|| type_err(field, v, "an object"))?;
    match m.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(RuleError::UnknownField { field, name: shown(k), allowed }),
        None => Ok(m),
    }
}

/// `v` as an object of exactly one key, one of `keys`; a string of a key
/// in `bare` stands for that key alone.
fn one_of<'a>(
    v: &'a Value,
    field: &'static str,
    bare: &[&str],
    allowed: &'static str,
) -> R<(&'a str, Option<&'a Value>)> {
    match v {
        Value::String(s) if bare.contains(&s.as_str()) => Ok((s, None)),
        Value::String(s) => Err(RuleError::UnknownField { field, name: shown(s), allowed }),
        Value::Object(m) if m.len() == 1 => {
            let (k, v) = m.iter().next().expect("one key");
            Ok((k, Some(v)))
        }
        Value::Object(_) => Err(RuleError::Invalid { field, reason: "needs exactly one kind" }),
        _ => Err(type_err(field, v, "a string or an object of one key")),
    }
}

/// A non-negative integer at most `max`: a number, or a string of a
/// decimal or 0x number (`"0x81"`).
fn uint(v: &Value, field: &'static str, max: u64) -> R<u64> {
    let n = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => super::text::parse_u64(s),
        _ => None,
    }
    .ok_or_else(|| type_err(field, v, "a non-negative integer"))?;
    if n > max {
        return Err(RuleError::TooLarge { field, value: n.to_string(), max });
    }
    Ok(n)
}

fn boolean(v: &Value, field: &'static str) -> R<bool> {
    v.as_bool().ok_or_else(|| type_err(field, v, "true or false"))
}

fn matcher(v: &Value) -> R<Matcher> {
    let m = object(v, "match", &["op", "nsid", "lba", "qid"], "op, nsid, lba, qid")?;
    let op = m.get("op").map(op).transpose()?;
    let nsid = m.get("nsid").map(|v| uint(v, "match.nsid", u32::MAX.into()).map(|n| n as u32)).transpose()?;
    let qid = m.get("qid").map(|v| uint(v, "match.qid", u16::MAX.into()).map(|n| n as u16)).transpose()?;
    let lba = m.get("lba").map(lba).transpose()?;
    Ok(Matcher { op, nsid, lba, qid })
}

const OPS: &str = "read, write, flush, discard, dsm, write-zeroes, admin, {\"admin\":N}, {\"io\":N}";

fn op(v: &Value) -> R<Op> {
    let bare = ["read", "write", "flush", "discard", "dsm", "write-zeroes", "admin"];
    match one_of(v, "match.op", &bare, OPS)? {
        (s, None) => Ok(super::text::op_name(s).expect("a bare name")),
        ("admin", Some(n)) => Ok(Op::Admin(Some(uint(n, "match.op.admin", 255)? as u8))),
        ("io", Some(n)) => Ok(Op::Io(uint(n, "match.op.io", 255)? as u8)),
        (k, Some(_)) => Err(RuleError::UnknownField { field: "match.op", name: shown(k), allowed: OPS }),
    }
}

fn lba(v: &Value) -> R<LbaRange> {
    match v.as_array().map(Vec::as_slice) {
        Some([a, b]) => Ok(LbaRange { first: uint(a, "match.lba", u64::MAX)?, last: uint(b, "match.lba", u64::MAX)? }),
        _ => Err(type_err("match.lba", v, "[first, last]")),
    }
}

const ACTIONS: &str = "status, delay, drop, corrupt, fatal, event";

fn action(v: &Value) -> R<Action> {
    Ok(match one_of(v, "action", &["drop", "fatal", "corrupt"], ACTIONS)? {
        ("drop", None) => Action::Drop,
        ("fatal", None) => Action::Fatal,
        ("corrupt", None) => Action::Corrupt(Corrupt { bytes: 1, seed: 0 }),
        ("status", Some(v)) => {
            let m = object(v, "action.status", &["sct", "sc", "dnr", "more"], "sct, sc, dnr, more")?;
            let sct =
                uint(m.get("sct").ok_or(RuleError::Missing { field: "action.status.sct" })?, "action.status.sct", 255)?;
            let sc =
                uint(m.get("sc").ok_or(RuleError::Missing { field: "action.status.sc" })?, "action.status.sc", 255)?;
            let dnr = m.get("dnr").map(|v| boolean(v, "action.status.dnr")).transpose()?.unwrap_or(false);
            let more = m.get("more").map(|v| boolean(v, "action.status.more")).transpose()?.unwrap_or(false);
            Action::Status(Status { sct: sct as u8, sc: sc as u8, dnr, more })
        }
        ("delay", Some(v)) => {
            let m = object(v, "action.delay", &["ns", "us", "ms"], "one of ns, us, ms")?;
            let (unit, n) = match (m.len(), m.iter().next()) {
                (1, Some((k, n))) => (k.as_str(), uint(n, "action.delay", u64::MAX)?),
                _ => {
                    return Err(RuleError::Invalid { field: "action.delay", reason: "needs exactly one of ns, us, ms" })
                }
            };
            let mul = match unit {
                "us" => 1_000,
                "ms" => 1_000_000,
                _ => 1,
            };
            let ns = n.checked_mul(mul).ok_or_else(|| RuleError::Range {
                field: "action.delay",
                value: format!("{n} {unit}"),
                allowed: "at most 600 s",
            })?;
            Action::Delay { ns }
        }
        ("corrupt", Some(v)) => {
            let m = object(v, "action.corrupt", &["bytes", "seed"], "bytes, seed")?;
            let bytes = m.get("bytes").map(|v| uint(v, "action.corrupt.bytes", u16::MAX.into())).transpose()?;
            let seed = m.get("seed").map(|v| uint(v, "action.corrupt.seed", u64::MAX)).transpose()?;
            Action::Corrupt(Corrupt { bytes: bytes.unwrap_or(1) as u16, seed: seed.unwrap_or(0) })
        }
        ("event", Some(v)) => {
            Action::Event(match one_of(v, "action.event", &["ns-changed"], "ns-changed, {\"smart\":BITS}")? {
                (_, None) => Event::NsChanged,
                ("smart", Some(b)) => Event::SmartWarning(uint(b, "action.event.smart", 255)? as u8),
                (k, Some(_)) => {
                    let allowed = "ns-changed, {\"smart\":BITS}";
                    return Err(RuleError::UnknownField { field: "action.event", name: shown(k), allowed });
                }
            })
        }
        ("drop" | "fatal", Some(_)) => {
            return Err(RuleError::Invalid {
                field: "action",
                reason: "drop and fatal are strings (\"action\":\"drop\")",
            });
        }
        (k, _) => return Err(RuleError::UnknownField { field: "action", name: shown(k), allowed: ACTIONS }),
    })
}

const TRIGGERS: &str = "always, once, every, count, probability";

fn trigger(v: &Value) -> R<Trigger> {
    Ok(match one_of(v, "trigger", &["always", "once"], TRIGGERS)? {
        ("always", None) => Trigger::Always,
        (_, None) => Trigger::Once,
        ("every", Some(n)) => Trigger::Every(uint(n, "trigger.every", u64::MAX)?),
        ("count", Some(n)) => Trigger::Count(uint(n, "trigger.count", u64::MAX)?),
        ("probability", Some(v)) => {
            let m = object(v, "trigger.probability", &["p", "seed"], "p, seed")?;
            let p = m.get("p").ok_or(RuleError::Missing { field: "trigger.probability.p" })?;
            let pf = p.as_f64().ok_or_else(|| type_err("trigger.probability.p", p, "a number"))?;
            let seed = m.get("seed").map(|v| uint(v, "trigger.probability.seed", u64::MAX)).transpose()?;
            Trigger::probability(pf, seed.unwrap_or(0))?
        }
        ("always" | "once", Some(_)) => {
            return Err(RuleError::Invalid {
                field: "trigger",
                reason: "always and once are strings (\"trigger\":\"once\")",
            });
        }
        (k, _) => return Err(RuleError::UnknownField { field: "trigger", name: shown(k), allowed: TRIGGERS }),
    })
}

fn matcher_value(m: &Matcher) -> Map<String, Value> {
    let mut o = Map::new();
    if let Some(op) = m.op {
        let v = match op {
            Op::Admin(Some(n)) => json!({ "admin": n }),
            Op::Io(n) => json!({ "io": n }),
            op => Value::from(super::text::op_str(op)),
        };
        o.insert("op".into(), v);
    }
    if let Some(n) = m.nsid {
        o.insert("nsid".into(), n.into());
    }
    if let Some(r) = m.lba {
        o.insert("lba".into(), json!([r.first, r.last]));
    }
    if let Some(q) = m.qid {
        o.insert("qid".into(), q.into());
    }
    o
}

fn action_value(a: &Action) -> Value {
    match *a {
        Action::Status(s) => json!({ "status": { "sct": s.sct, "sc": s.sc, "dnr": s.dnr, "more": s.more } }),
        Action::Delay { ns } => json!({ "delay": { "ns": ns } }),
        Action::Drop => "drop".into(),
        Action::Corrupt(c) => json!({ "corrupt": { "bytes": c.bytes, "seed": c.seed } }),
        Action::Fatal => "fatal".into(),
        Action::Event(Event::SmartWarning(b)) => json!({ "event": { "smart": b } }),
        Action::Event(Event::NsChanged) => json!({ "event": "ns-changed" }),
    }
}

fn trigger_value(t: &Trigger) -> Value {
    match *t {
        Trigger::Always => "always".into(),
        Trigger::Once => "once".into(),
        Trigger::Every(n) => json!({ "every": n }),
        Trigger::Count(n) => json!({ "count": n }),
        Trigger::Probability { ppb, seed } => {
            json!({ "probability": { "p": f64::from(ppb) / f64::from(PPB), "seed": seed } })
        }
    }
}
