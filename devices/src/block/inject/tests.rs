//! The rules engine against oracles: both forms round-trip over random
//! rules, every bad input names its field, mutated JSON never panics,
//! matchers agree with a brute-force reference, triggers and counters with
//! a reference model of the set.

use super::rule::splitmix64;
use super::text::MAX_TEXT;
use super::*;

/// The tests' own generator (seeded, so a failure repeats).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        splitmix64(&mut self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    /// Small values most of the time, the edges of the type sometimes.
    fn edgy(&mut self, max: u64) -> u64 {
        match self.below(4) {
            0 => max - self.below(3).min(max),
            1 => self.below(3).min(max),
            _ => self.next() % max.saturating_add(1).max(1),
        }
    }
}

/// A random valid rule, over every variant.
fn random_rule(r: &mut Rng) -> Rule {
    let op = match r.below(9) {
        0 => None,
        1 => Some(Op::Read),
        2 => Some(Op::Write),
        3 => Some(Op::Flush),
        4 => Some(Op::Discard),
        5 => Some(Op::WriteZeroes),
        6 => Some(Op::Admin(None)),
        7 => Some(Op::Admin(Some(r.below(256) as u8))),
        _ => Some(Op::Io(r.below(256) as u8)),
    };
    let lba = r.chance(50).then(|| {
        let a = r.edgy(u64::MAX);
        let b = r.edgy(u64::MAX);
        LbaRange { first: a.min(b), last: a.max(b) }
    });
    let matcher = Matcher {
        op,
        nsid: r.chance(50).then(|| r.edgy(u32::MAX.into()) as u32),
        lba,
        qid: r.chance(50).then(|| r.edgy(u16::MAX.into()) as u16),
    };
    let mut matcher = matcher;
    let action = match r.below(7) {
        0 => Action::Status(Status {
            sct: r.below(8) as u8,
            sc: r.below(256) as u8,
            dnr: r.chance(50),
            more: r.chance(50),
        }),
        1 => Action::Delay { ns: r.edgy(rule::MAX_DELAY_NS) },
        2 => Action::Drop,
        3 => {
            matcher.op = Some(Op::Read);
            Action::Corrupt(Corrupt { bytes: 1 + r.below(4096) as u16, seed: r.edgy(u64::MAX) })
        }
        4 => Action::Fatal,
        5 => Action::Event(Event::SmartWarning(1 + r.below(0x3f) as u8)),
        _ => Action::Event(Event::NsChanged),
    };
    let trigger = match r.below(5) {
        0 => Trigger::Always,
        1 => Trigger::Once,
        2 => Trigger::Every(1 + r.edgy(rule::MAX_TRIGGER_N - 1)),
        3 => Trigger::Count(1 + r.edgy(rule::MAX_TRIGGER_N - 1)),
        _ => Trigger::Probability { ppb: r.edgy(rule::PPB.into()) as u32, seed: r.edgy(u64::MAX) },
    };
    Rule { id: 0, matcher, action, trigger }
}

#[test]
fn the_briefs_example_parses_to_what_it_says() {
    let j = r#"{"match":{"op":"read","nsid":1,"lba":[0,1023],"qid":1},"action":{"status":{"sct":2,"sc":129,"dnr":false}},"trigger":{"every":10}}"#;
    let want = Rule {
        id: 0,
        matcher: Matcher {
            op: Some(Op::Read),
            nsid: Some(1),
            lba: Some(LbaRange { first: 0, last: 1023 }),
            qid: Some(1),
        },
        action: Action::Status(Status { sct: 2, sc: 0x81, dnr: false, more: false }),
        trigger: Trigger::Every(10),
    };
    assert_eq!(Rule::from_json(j).unwrap(), want);
    assert_eq!(want.to_string(), "op=read/nsid=1/lba=0-1023/qid=1/status=2:0x81/every=10");
    assert_eq!("op=read/nsid=1/lba=0-1023/qid=1/status=2:0x81/every=10".parse::<Rule>().unwrap(), want);
    assert_eq!(
        want.to_json(),
        r#"{"action":{"status":{"dnr":false,"more":false,"sc":129,"sct":2}},"match":{"lba":[0,1023],"nsid":1,"op":"read","qid":1},"trigger":{"every":10}}"#
    );
}

/// Each row of the module's table: the JSON and the text give the same rule.
#[test]
fn the_documented_examples_agree_in_both_forms() {
    let rows: &[(&str, &str)] = &[
        (r#"{"match":{"op":"write"},"action":"drop"}"#, "op=write/drop"),
        (r#"{"match":{"op":"dsm"},"action":"drop"}"#, "op=discard/drop"),
        (r#"{"match":{"op":"write-zeroes"},"action":"drop"}"#, "op=write-zeroes/drop"),
        (r#"{"match":{"op":"flush"},"action":"drop"}"#, "op=flush/drop"),
        (r#"{"match":{"op":"admin"},"action":"drop"}"#, "op=admin/drop"),
        (r#"{"match":{"op":{"admin":6}},"action":"drop"}"#, "op=admin:0x06/drop"),
        (r#"{"match":{"op":{"io":"0x05"}},"action":"drop"}"#, "op=io:5/drop"),
        (r#"{"match":{"nsid":1,"qid":1,"lba":[0,1023]},"action":"fatal"}"#, "nsid=1/qid=1/lba=0-1023/fatal"),
        (r#"{"action":{"status":{"sct":2,"sc":129,"dnr":true}}}"#, "status=2:0x81:dnr"),
        (r#"{"action":{"status":{"sct":0,"sc":"0x6","more":true}}}"#, "status=0:6:more"),
        (r#"{"action":{"delay":{"us":100}}}"#, "delay=100us"),
        (r#"{"action":{"delay":{"ns":2000000}}}"#, "delay=2ms"),
        (r#"{"match":{"op":"read"},"action":{"corrupt":{"bytes":4,"seed":7}}}"#, "op=read/corrupt=4:7"),
        (r#"{"match":{"op":"read"},"action":"corrupt"}"#, "op=read/corrupt"),
        (r#"{"action":{"event":{"smart":1}}}"#, "event=smart:0x01"),
        (r#"{"action":{"event":"ns-changed"}}"#, "event=ns-changed"),
        (r#"{"action":"drop","trigger":"always"}"#, "drop"),
        (r#"{"action":"drop","trigger":"once"}"#, "drop/once"),
        (r#"{"action":"drop","trigger":{"every":10}}"#, "drop/every=10"),
        (r#"{"action":"drop","trigger":{"count":5}}"#, "drop/count=5"),
        (r#"{"action":"drop","trigger":{"probability":{"p":0.01,"seed":42}}}"#, "drop/p=0.01:42"),
    ];
    for (j, t) in rows {
        let a = Rule::from_json(j).unwrap_or_else(|e| panic!("{j}: {e}"));
        let b: Rule = t.parse().unwrap_or_else(|e| panic!("{t}: {e}"));
        assert_eq!(a, b, "{j} vs {t}");
    }
    let list = "op=read/lba=0-7/status=2:0x81/once+op=write/nsid=1/delay=2ms/p=0.5:9";
    let rules = parse_rules(list).unwrap();
    assert_eq!(rules.len(), 2);
    assert_eq!(write_rules(&rules), list);
}

#[test]
fn random_rules_round_trip_through_json_and_text() {
    let mut r = Rng(1);
    for i in 0..20_000 {
        let mut rule = random_rule(&mut r);
        rule.validate().unwrap_or_else(|e| panic!("{rule:?}: {e}"));
        let text = rule.to_string();
        assert!(!text.contains(',') && !text.contains('@') && text.len() <= MAX_TEXT, "{text}");
        assert_eq!(text.parse::<Rule>().as_ref(), Ok(&rule), "{text}");
        rule.id = i;
        let json = rule.to_json();
        assert!(json.len() <= MAX_JSON_LINE, "{json}");
        assert_eq!(Rule::from_json(&json).as_ref(), Ok(&rule), "{json}");
        // And through serde's own traits.
        let back: Rule = serde_json::from_str(&serde_json::to_string(&rule).unwrap()).unwrap();
        assert_eq!(back, rule);
    }
}

#[test]
fn every_bad_json_names_its_field() {
    let cases: &[(&str, &str)] = &[
        (r#"{"action":{"status":{"sct":8,"sc":1}}}"#, "action.status.sct"),
        (r#"{"action":{"status":{"sct":2}}}"#, "action.status.sc"),
        (r#"{"action":{"status":{"sct":2,"sc":256}}}"#, "action.status.sc"),
        (r#"{"action":{"status":{"sct":2,"sc":1,"dnr":1}}}"#, "action.status.dnr"),
        (r#"{"action":{"status":{"sct":2,"sc":1,"more":"yes"}}}"#, "action.status.more"),
        (r#"{"action":{"status":{"sct":2,"sc":1,"x":1}}}"#, "action.status"),
        (r#"{"action":{"status":[2,1]}}"#, "action.status"),
        (r#"{"match":{"op":"reed"},"action":"drop"}"#, "match.op"),
        (r#"{"match":{"op":{"admin":300}},"action":"drop"}"#, "match.op.admin"),
        (r#"{"match":{"op":{"io":-1}},"action":"drop"}"#, "match.op.io"),
        (r#"{"match":{"op":{"nvm":1}},"action":"drop"}"#, "match.op"),
        (r#"{"match":{"op":7},"action":"drop"}"#, "match.op"),
        (r#"{"match":{"nsid":-1},"action":"drop"}"#, "match.nsid"),
        (r#"{"match":{"nsid":4294967296},"action":"drop"}"#, "match.nsid"),
        (r#"{"match":{"nsid":1.5},"action":"drop"}"#, "match.nsid"),
        (r#"{"match":{"qid":65536},"action":"drop"}"#, "match.qid"),
        (r#"{"match":{"lba":[5,4]},"action":"drop"}"#, "match.lba"),
        (r#"{"match":{"lba":[5]},"action":"drop"}"#, "match.lba"),
        (r#"{"match":{"lba":"0-7"},"action":"drop"}"#, "match.lba"),
        (r#"{"match":{"lba":[0,18446744073709551616]},"action":"drop"}"#, "match.lba"),
        (r#"{"match":{"lab":[0,1]},"action":"drop"}"#, "match"),
        (r#"{"match":[],"action":"drop"}"#, "match"),
        (r#"{"action":"explode"}"#, "action"),
        (r#"{"action":{"drop":1,"fatal":1}}"#, "action"),
        (r#"{"action":{"boom":{}}}"#, "action"),
        (r#"{"action":{"drop":{}}}"#, "action"),
        (r#"{"action":"status"}"#, "action"),
        (r#"{"action":"drop","trigger":{"once":true}}"#, "trigger"),
        (r#"{"action":7}"#, "action"),
        (r#"{}"#, "action"),
        (r#"[]"#, "rule"),
        (r#"{"action":{"delay":{"s":1}}}"#, "action.delay"),
        (r#"{"action":{"delay":{"ms":1,"us":1}}}"#, "action.delay"),
        (r#"{"action":{"delay":{"ms":600001}}}"#, "action.delay"),
        (r#"{"action":{"delay":{"ms":18446744073709551615}}}"#, "action.delay"),
        (r#"{"action":{"corrupt":{"bytes":1}}}"#, "action.corrupt"),
        (r#"{"match":{"op":"write"},"action":"corrupt"}"#, "action.corrupt"),
        (r#"{"match":{"op":"read"},"action":{"corrupt":{"bytes":0}}}"#, "action.corrupt.bytes"),
        (r#"{"match":{"op":"read"},"action":{"corrupt":{"bytes":5000}}}"#, "action.corrupt.bytes"),
        (r#"{"match":{"op":"read"},"action":{"corrupt":{"seed":-5}}}"#, "action.corrupt.seed"),
        (r#"{"action":{"event":{"smart":64}}}"#, "action.event.smart"),
        (r#"{"action":{"event":{"smart":0}}}"#, "action.event.smart"),
        (r#"{"action":{"event":"ns-gone"}}"#, "action.event"),
        (r#"{"action":{"event":{"temp":1}}}"#, "action.event"),
        (r#"{"action":"drop","trigger":{"every":0}}"#, "trigger.every"),
        (r#"{"action":"drop","trigger":{"count":4294967296}}"#, "trigger.count"),
        (r#"{"action":"drop","trigger":{"probability":{"p":1.5}}}"#, "trigger.probability.p"),
        (r#"{"action":"drop","trigger":{"probability":{"p":-0.1}}}"#, "trigger.probability.p"),
        (r#"{"action":"drop","trigger":{"probability":{"p":"x"}}}"#, "trigger.probability.p"),
        (r#"{"action":"drop","trigger":{"probability":{"seed":1}}}"#, "trigger.probability.p"),
        (r#"{"action":"drop","trigger":{"probability":{"p":0.5,"seed":"x"}}}"#, "trigger.probability.seed"),
        (r#"{"action":"drop","trigger":"twice"}"#, "trigger"),
        (r#"{"action":"drop","trigger":{"every":1,"count":1}}"#, "trigger"),
        (r#"{"action":"drop","id":"x"}"#, "id"),
        (r#"{"action":"drop","extra":1}"#, "rule"),
    ];
    for (j, field) in cases {
        let e = Rule::from_json(j).expect_err(j);
        assert_eq!(e.field(), Some(*field), "{j}: {e}");
        assert!(e.to_string().starts_with(field), "{j}: {e}");
    }
    let sct9 = Rule::from_json(r#"{"action":{"status":{"sct":9,"sc":1}}}"#).unwrap_err();
    assert_eq!(sct9.to_string(), "action.status.sct: 9 is out of range (0 to 7)");
    let qid = Rule::from_json(r#"{"match":{"qid":65536},"action":"drop"}"#).unwrap_err();
    assert_eq!(qid.to_string(), "match.qid: 65536 is larger than 65535");
    assert!(matches!(Rule::from_json("{\"action\":"), Err(RuleError::Json(_))));
    assert!(matches!(Rule::from_json("drop"), Err(RuleError::Json(_))));
    // Nesting within the length bound stops at serde_json's depth limit, not the stack.
    let deep = format!("{}{}", "[".repeat(2000), "]".repeat(2000));
    assert!(matches!(Rule::from_json(&deep), Err(RuleError::Json(_))));
    let deep = format!(r#"{{"action":{}}}"#, r#"{"a":"#.repeat(600) + "1" + &"}".repeat(600));
    assert!(deep.len() <= MAX_JSON_LINE && matches!(Rule::from_json(&deep), Err(RuleError::Json(_))));
    let long = format!(r#"{{"action":"drop","match":{{"nsid":1{}}}}}"#, " ".repeat(MAX_JSON_LINE));
    assert_eq!(
        Rule::from_json(&long),
        Err(RuleError::TooLong { what: "JSON line", len: long.len(), max: MAX_JSON_LINE })
    );
}

#[test]
fn every_bad_text_names_its_field() {
    let cases: &[(&str, &str)] = &[
        ("status=8:1", "action.status.sct"),
        ("status=2", "action.status.sc"),
        ("status", "action.status"),
        ("status=2:0x100", "action.status.sc"),
        ("status=2:1:dnx", "action.status"),
        ("status=2:1:dnr:dnr", "action.status"),
        ("status=-1:1", "action.status.sct"),
        ("op=reed/drop", "match.op"),
        ("op=admin:0x1ff/drop", "match.op.admin"),
        ("op=io:x/drop", "match.op.io"),
        ("op/drop", "match.op"),
        ("nsid=x/drop", "match.nsid"),
        ("nsid=4294967296/drop", "match.nsid"),
        ("qid=70000/drop", "match.qid"),
        ("lba=5-4/drop", "match.lba"),
        ("lba=5/drop", "match.lba"),
        ("lba=0-18446744073709551616/drop", "match.lba"),
        ("drop/fatal", "action"),
        ("op=read/op=write/drop", "match.op"),
        ("nsid=1/nsid=1/drop", "match.nsid"),
        ("nsid=1", "action"),
        ("delay=10xs", "action.delay"),
        ("delay=us", "action.delay"),
        ("delay=601s", "action.delay"),
        ("delay=18446744073709551615s", "action.delay"),
        ("corrupt=1:2", "action.corrupt"),
        ("op=read/corrupt=0", "action.corrupt.bytes"),
        ("op=read/corrupt=1:y", "action.corrupt.seed"),
        ("event=smart:0x40", "action.event.smart"),
        ("event=boom", "action.event"),
        ("drop/every=0", "trigger.every"),
        ("drop/count=4294967296", "trigger.count"),
        ("drop/once/every=2", "trigger"),
        ("drop/p=1.5", "trigger.probability.p"),
        ("drop/p=abc", "trigger.probability.p"),
        ("drop/p=-0.5", "trigger.probability.p"),
        ("drop/p=nan", "trigger.probability.p"),
        ("drop/p=0.5:x", "trigger.probability.seed"),
        ("drop/bogus", "rule"),
        ("drop/", "rule"),
        ("drop=1", "rule"),
        ("drop,once", "rule"),
        ("", "rule"),
    ];
    for (t, field) in cases {
        let e = t.parse::<Rule>().expect_err(t);
        assert_eq!(e.field(), Some(*field), "{t}: {e}");
    }
    let long = "drop/".repeat(MAX_TEXT);
    assert!(matches!(long.parse::<Rule>(), Err(RuleError::TooLong { .. })));
    assert!(matches!(parse_rules(&long), Err(RuleError::TooLong { .. })));
    assert_eq!(parse_rules("drop+bogus").unwrap_err().field(), Some("rule"));
}

/// Mutated JSON and text (deletions, insertions, swapped numbers) never
/// panic; whatever parses is valid and round-trips.
#[test]
fn mutated_input_never_panics() {
    let seeds: Vec<String> = {
        let mut r = Rng(7);
        (0..64).map(|_| random_rule(&mut r).to_json()).collect()
    };
    let alphabet: Vec<char> = "{}[]\":, 0123456789-.eE+xabcdefghijklmnopqrstuvwyz_\\u\u{e9}".chars().collect();
    let numbers = ["99999999999999999999999", "-1", "1e400", "0.5", "18446744073709551615", "0x", "null", "\"\""];
    let mut r = Rng(11);
    let (mut ok, mut err) = (0, 0);
    for i in 0..60_000 {
        let mut s: Vec<char> = seeds[i % seeds.len()].chars().collect();
        for _ in 0..1 + r.below(4) {
            let at = r.below(s.len() as u64 + 1) as usize;
            match r.below(4) {
                0 if !s.is_empty() => {
                    let n = (1 + r.below(6) as usize).min(s.len() - at.min(s.len()));
                    s.drain(at.min(s.len())..at.min(s.len()) + n);
                }
                1 => s.insert(at, alphabet[r.below(alphabet.len() as u64) as usize]),
                2 => s.splice(at..at, numbers[r.below(numbers.len() as u64) as usize].chars()).for_each(drop),
                _ => {
                    let from = r.below(s.len() as u64 + 1) as usize;
                    let piece: Vec<char> = s[from..(from + 8).min(s.len())].to_vec();
                    s.splice(at..at, piece).for_each(drop);
                }
            }
        }
        let line: String = s.into_iter().collect();
        match Rule::from_json(&line) {
            Ok(rule) => {
                ok += 1;
                assert_eq!(rule.validate(), Ok(()), "{line}");
                assert_eq!(Rule::from_json(&rule.to_json()), Ok(rule), "{line}");
            }
            Err(_) => err += 1,
        }
        // The same bytes as text, and a rule's text mutated alike.
        let _ = line.parse::<Rule>();
        let mut t: Vec<char> = random_rule(&mut r).to_string().chars().collect();
        let at = r.below(t.len() as u64 + 1) as usize;
        t.insert(at, alphabet[r.below(alphabet.len() as u64) as usize]);
        if r.chance(50) && at < t.len() - 1 {
            t.remove(at + 1);
        }
        let text: String = t.into_iter().collect();
        if let Ok(rule) = text.parse::<Rule>() {
            assert_eq!(rule.validate(), Ok(()), "{text}");
            assert_eq!(rule.to_string().parse::<Rule>(), Ok(rule), "{text}");
        }
    }
    // The mutations reach both sides.
    assert!(ok > 200 && err > 10_000, "ok {ok}, err {err}");
}

/// The LBAs of `[slba, slba + nlb]` one by one, against `[first, last]`.
fn brute_overlap(first: u64, last: u64, l: Lbas) -> bool {
    (0..=u64::from(l.nlb)).any(|i| {
        let lba = u128::from(l.slba) + u128::from(i);
        lba >= u128::from(first) && lba <= u128::from(last)
    })
}

#[test]
fn lba_overlap_agrees_with_brute_force() {
    // Every small case exhaustively.
    for first in 0..20u64 {
        for last in first..20 {
            let r = LbaRange { first, last };
            for slba in 0..24u64 {
                for nlb in 0..10u32 {
                    let l = Lbas { slba, nlb };
                    assert_eq!(r.overlaps(l), brute_overlap(first, last, l), "{r:?} {l:?}");
                }
            }
        }
    }
    // The same shapes at the top of the LBA space, where slba + nlb overflows.
    let top = u64::MAX - 30;
    for first in top..=u64::MAX {
        for last in (first..=u64::MAX).step_by(3) {
            let r = LbaRange { first, last };
            for slba in (top - 10..=u64::MAX).step_by(2) {
                for nlb in [0u32, 1, 5, 17, 40] {
                    let l = Lbas { slba, nlb };
                    assert_eq!(r.overlaps(l), brute_overlap(first, last, l), "{r:?} {l:?}");
                }
            }
        }
    }
    // Full-width NLBs (too many LBAs to list): against u128 interval arithmetic.
    let mut g = Rng(3);
    for _ in 0..100_000 {
        let (a, b) = (g.edgy(u64::MAX), g.edgy(u64::MAX));
        let r = LbaRange { first: a.min(b), last: a.max(b) };
        let l = Lbas { slba: g.edgy(u64::MAX), nlb: g.edgy(u32::MAX.into()) as u32 };
        let end = u128::from(l.slba) + u128::from(l.nlb);
        let want = u128::from(l.slba) <= u128::from(r.last) && end >= u128::from(r.first);
        assert_eq!(r.overlaps(l), want, "{r:?} {l:?}");
    }
}

const KINDS: [Kind; 7] =
    [Kind::Read, Kind::Write, Kind::Flush, Kind::Discard, Kind::WriteZeroes, Kind::Admin, Kind::Other];

/// A random command over a small universe (so rules match often), with
/// LBAs near the top of the space sometimes.
fn random_command(g: &mut Rng) -> CommandView {
    let kind = KINDS[g.below(7) as usize];
    let lba = matches!(kind, Kind::Read | Kind::Write | Kind::WriteZeroes | Kind::Discard | Kind::Other)
        .then(|| Lbas { slba: if g.chance(10) { u64::MAX - g.below(8) } else { g.below(40) }, nlb: g.below(8) as u32 });
    let opcode = [0u8, 1, 2, 5, 6, 8, 9, 0x81][g.below(8) as usize];
    CommandView {
        opcode,
        kind,
        nsid: g.below(3) as u32,
        lba,
        qid: if kind == Kind::Admin { 0 } else { g.below(3) as u16 },
    }
}

/// A random rule over the same small universe.
fn small_rule(g: &mut Rng) -> Rule {
    let op = match g.below(9) {
        0 | 1 => None,
        2 => Some(Op::Read),
        3 => Some(Op::Write),
        4 => Some(Op::Flush),
        5 => Some(Op::Discard),
        6 => Some(Op::Admin(if g.chance(50) { None } else { Some([6u8, 9][g.below(2) as usize]) })),
        7 => Some(Op::Io([1u8, 2, 5, 0x81][g.below(4) as usize])),
        _ => Some(Op::WriteZeroes),
    };
    let lba = g.chance(40).then(|| {
        let first = if g.chance(10) { u64::MAX - g.below(4) } else { g.below(40) };
        LbaRange { first, last: first.saturating_add(g.below(10)) }
    });
    let matcher = Matcher {
        op,
        nsid: g.chance(40).then(|| g.below(3) as u32),
        lba,
        qid: g.chance(30).then(|| g.below(3) as u16),
    };
    let trigger = match g.below(5) {
        0 => Trigger::Always,
        1 => Trigger::Once,
        2 => Trigger::Every(1 + g.below(5)),
        3 => Trigger::Count(1 + g.below(20)),
        _ => Trigger::Probability { ppb: g.below(u64::from(rule::PPB) + 1) as u32, seed: g.next() },
    };
    let action = Action::Status(Status { sct: 0, sc: g.below(256) as u8, dnr: false, more: false });
    Rule { id: 0, matcher, action, trigger }
}

/// The matcher written out field by field, as the module doc states it.
fn reference_matches(m: &Matcher, c: &CommandView) -> bool {
    let op_ok = match m.op {
        None => true,
        Some(Op::Admin(o)) => c.kind == Kind::Admin && o.is_none_or(|o| o == c.opcode),
        Some(Op::Io(o)) => c.kind != Kind::Admin && c.opcode == o,
        Some(op) => {
            let table = [
                (Op::Read, Kind::Read),
                (Op::Write, Kind::Write),
                (Op::Flush, Kind::Flush),
                (Op::Discard, Kind::Discard),
                (Op::WriteZeroes, Kind::WriteZeroes),
            ];
            table.iter().any(|&(o, k)| o == op && k == c.kind)
        }
    };
    let lba_ok = match (m.lba, c.lba) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(r), Some(l)) => {
            u128::from(l.slba) <= u128::from(r.last) && u128::from(l.slba) + u128::from(l.nlb) >= u128::from(r.first)
        }
    };
    op_ok && lba_ok && m.nsid.is_none_or(|n| n == c.nsid) && m.qid.is_none_or(|q| q == c.qid)
}

/// The set as a reference model: per rule a tally of matches, and whether
/// the trigger fires on match number k (1-based), from its definition.
struct Model {
    rules: Vec<(Rule, u64, u64, u64)>, // rule, matched, fired, generator state
}

impl Model {
    fn decide(&mut self, c: &CommandView) -> Option<Action> {
        for (rule, matched, fired, state) in &mut self.rules {
            if !reference_matches(&rule.matcher, c) {
                continue;
            }
            *matched += 1;
            let k = *matched;
            let fires = match rule.trigger {
                Trigger::Always => true,
                Trigger::Once => k == 1,
                Trigger::Every(n) => k.is_multiple_of(n),
                Trigger::Count(n) => k <= n,
                Trigger::Probability { ppb, .. } => (splitmix64(state) % 1_000_000_000) < u64::from(ppb),
            };
            if fires {
                *fired += 1;
                return Some(rule.action);
            }
        }
        None
    }
}

#[test]
fn matchers_agree_with_the_reference() {
    let mut g = Rng(5);
    let mut hits = 0;
    for _ in 0..2_000 {
        let rule = small_rule(&mut g);
        for _ in 0..200 {
            let c = random_command(&mut g);
            let m = rule.matcher.matches(&c);
            assert_eq!(m, reference_matches(&rule.matcher, &c), "{rule} {c:?}");
            hits += u32::from(m);
        }
    }
    assert!(hits > 20_000, "the universe is small enough to match often: {hits}");
}

/// Sets of up to 8 random rules against the model over random command
/// streams: the same decision every command, the same counters at the end.
#[test]
fn sets_agree_with_the_reference_model() {
    let mut g = Rng(9);
    let mut injected = 0;
    for _ in 0..300 {
        let rules: Vec<Rule> = (0..1 + g.below(8)).map(|_| small_rule(&mut g)).collect();
        let mut set = RuleSet::new();
        let mut model = Model { rules: Vec::new() };
        for r in &rules {
            let id = set.add(*r).unwrap();
            let seed = match r.trigger {
                Trigger::Probability { seed, .. } => seed,
                _ => 0,
            };
            model.rules.push((Rule { id, ..*r }, 0, 0, seed));
        }
        assert_eq!(set.list(), model.rules.iter().map(|r| r.0).collect::<Vec<_>>());
        let n = 2_000;
        for _ in 0..n {
            let c = random_command(&mut g);
            let d = set.decide(&c);
            assert_eq!(d, model.decide(&c), "{c:?}");
            injected += u64::from(d.is_some());
        }
        let stats = set.stats();
        assert_eq!(stats.commands, n);
        assert_eq!(stats.injected, model.rules.iter().map(|r| r.2).sum::<u64>());
        let want: Vec<RuleStats> =
            model.rules.iter().map(|&(r, matched, fired, _)| RuleStats { id: r.id, matched, fired }).collect();
        assert_eq!(stats.rules, want);
    }
    assert!(injected > 100_000, "{injected}");
}

fn read(slba: u64) -> CommandView {
    CommandView { opcode: 2, kind: Kind::Read, nsid: 1, lba: Some(Lbas { slba, nlb: 7 }), qid: 1 }
}

/// One rule over a stream where about half the commands match: `every`
/// fires exactly on multiples of N matches, `count` exactly N times then
/// never, `once` on the first match.
#[test]
fn triggers_fire_exactly_where_their_definition_says() {
    let mut g = Rng(13);
    for trigger in [Trigger::Once, Trigger::Every(1), Trigger::Every(7), Trigger::Count(1), Trigger::Count(333)] {
        let matcher = Matcher { lba: Some(LbaRange { first: 0, last: 99 }), ..Matcher::default() };
        let mut set = RuleSet::new();
        set.add(Rule { id: 0, matcher, action: Action::Drop, trigger }).unwrap();
        let (mut matched, mut fired) = (0u64, Vec::new());
        for _ in 0..10_000 {
            let c = read(g.below(200));
            let m = c.lba.unwrap().slba <= 99;
            matched += u64::from(m);
            if set.decide(&c).is_some() {
                assert!(m);
                fired.push(matched);
            }
        }
        let want: Vec<u64> = match trigger {
            Trigger::Once => vec![1],
            Trigger::Every(n) => (1..=matched).filter(|k| k % n == 0).collect(),
            Trigger::Count(n) => (1..=n.min(matched)).collect(),
            _ => unreachable!(),
        };
        assert_eq!(fired, want, "{trigger:?}");
        assert_eq!(set.stats().rules[0], RuleStats { id: 1, matched, fired: want.len() as u64 });
    }
}

#[test]
fn probability_is_near_p_and_repeats_with_its_seed() {
    let n = 100_000u64;
    for (p, seed) in [(0.0, 1), (0.001, 2), (0.01, 3), (0.1, 4), (0.5, 5), (0.9, 6), (1.0, 7)] {
        let run = |seed: u64| {
            let mut set = RuleSet::new();
            set.add(Rule {
                id: 0,
                matcher: Matcher::default(),
                action: Action::Fatal,
                trigger: Trigger::probability(p, seed).unwrap(),
            })
            .unwrap();
            (0..n).map(|i| set.decide(&read(i)).is_some()).collect::<Vec<bool>>()
        };
        let a = run(seed);
        let fired = a.iter().filter(|&&f| f).count() as f64;
        let (mean, sigma) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
        assert!((fired - mean).abs() <= 4.0 * sigma, "p {p}: {fired} fired, {mean} +- 4 * {sigma}");
        assert_eq!(run(seed), a, "the same seed, the same sequence");
        if p > 0.0 && p < 1.0 {
            assert_ne!(run(seed + 100), a, "another seed, another sequence");
        }
    }
}

#[test]
fn the_first_rule_that_fires_wins_and_later_ones_do_not_see_it() {
    let mut set = RuleSet::new();
    let s = |sc| Action::Status(Status { sct: 0, sc, dnr: false, more: false });
    let a = set.add(Rule { id: 0, matcher: Matcher::default(), action: s(1), trigger: Trigger::Every(2) }).unwrap();
    let b = set.add(Rule { id: 99, matcher: Matcher::default(), action: s(2), trigger: Trigger::Always }).unwrap();
    assert_eq!((a, b), (1, 2));
    let got: Vec<_> = (0..6).map(|i| set.decide(&read(i))).collect();
    assert_eq!(got, [Some(s(2)), Some(s(1)), Some(s(2)), Some(s(1)), Some(s(2)), Some(s(1))]);
    let st = set.stats();
    assert_eq!(st.rules, [RuleStats { id: 1, matched: 6, fired: 3 }, RuleStats { id: 2, matched: 3, fired: 3 }]);
    assert_eq!(
        serde_json::to_string(&st).unwrap(),
        r#"{"commands":6,"injected":6,"rules":[{"id":1,"matched":6,"fired":3},{"id":2,"matched":3,"fired":3}]}"#
    );
}

#[test]
fn a_set_is_bounded_and_ids_are_never_reused() {
    let mut set = RuleSet::new();
    let rule: Rule = "drop".parse().unwrap();
    for i in 1..=MAX_RULES as u64 {
        assert_eq!(set.add(rule), Ok(i));
    }
    assert_eq!(set.add(rule), Err(RuleError::TooManyRules { max: MAX_RULES }));
    assert_eq!(set.remove(3).map(|r| r.id), Ok(3));
    assert_eq!(set.remove(3), Err(RuleError::NoSuchRule { id: 3 }));
    assert_eq!(set.add(rule), Ok(MAX_RULES as u64 + 1));
    assert_eq!(set.clear(), MAX_RULES);
    assert!(set.is_empty() && set.stats().rules.is_empty());
    assert_eq!(set.add(rule), Ok(MAX_RULES as u64 + 2));
    assert_eq!(set.list()[0].to_json(), format!(r#"{{"action":"drop","id":{}}}"#, MAX_RULES + 2));
    // A rule built in code passes the same checks as a parsed one.
    let bad = Rule { action: Action::Status(Status { sct: 8, sc: 0, dnr: false, more: false }), ..rule };
    assert_eq!(set.add(bad).unwrap_err().field(), Some("action.status.sct"));
    assert_eq!(set.len(), 1);
}

#[test]
fn corruption_flips_exactly_its_bytes_and_repeats_with_its_seed() {
    let mut g = Rng(17);
    for _ in 0..2_000 {
        let c = Corrupt { bytes: 1 + g.below(64) as u16, seed: g.next() };
        let len = g.below(200) as usize;
        let orig: Vec<u8> = (0..len).map(|_| g.next() as u8).collect();
        let mut data = orig.clone();
        c.apply(&mut data);
        let differ: Vec<usize> = (0..len).filter(|&i| data[i] != orig[i]).collect();
        assert_eq!(differ.len(), usize::from(c.bytes).min(len), "{c:?} over {len} bytes");
        assert_eq!(differ, c.flips(len).iter().map(|f| f.0).collect::<Vec<_>>());
        let mut again = orig.clone();
        c.apply(&mut again);
        assert_eq!(again, data, "the same seed flips the same bytes");
        c.apply(&mut again);
        assert_eq!(again, orig, "flipping twice restores the data");
    }
    let c = Corrupt { bytes: 4096, seed: 1 };
    assert_eq!(c.flips(4096).len(), 4096);
    assert_eq!(c.flips(0), []);
}

#[test]
fn a_status_is_placed_in_the_status_field_as_nvme_lays_it_out() {
    // Unrecovered Read Error (SCT 2h, SC 81h) with DNR: 0x4281 (DW3 bits 31:17).
    let s = |sct, sc, dnr, more| Status { sct, sc, dnr, more }.field();
    assert_eq!(s(2, 0x81, true, false), 0x4281);
    assert_eq!(s(2, 0x81, false, false), 0x0281);
    assert_eq!(s(0, 0x06, false, true), 0x2006);
    assert_eq!(s(7, 0xff, true, true), 0x67ff);
    // Every valid status: its pieces read back from the field, CRD 0.
    for sct in 0..8u8 {
        for sc in 0..=255u8 {
            for (dnr, more) in [(false, false), (true, false), (false, true), (true, true)] {
                let f = s(sct, sc, dnr, more);
                assert_eq!(
                    (f & 0xff, f >> 8 & 7, f >> 11 & 3, f >> 13 & 1, f >> 14 & 1, f >> 15),
                    (sc.into(), sct.into(), 0, more.into(), dnr.into(), 0)
                );
            }
        }
    }
}
