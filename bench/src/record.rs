//! The guest's result records, one parser for all of them: a line
//! `@KIND k=v k=v...` (`@row name=... cpl=N iters=N accesses=N warm=N cycles=a,b,c`,
//! `@nvme ios=N cycles=N ...`, `@guest`, `@pci`). Bench and the tests read
//! guest output only through this file.

use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub name: String,
    pub group: String,
    /// Accesses per timed batch.
    pub iters: u64,
    /// Every access of the row, warm-up and calibration included (what
    /// the device and VMM counters see).
    pub accesses: u64,
    /// Cycles of each timed batch of `iters` accesses.
    pub cycles: Vec<u64>,
    /// Other fields (cpl=, warm=, count=, exits=, status=, reason=...).
    pub extra: BTreeMap<String, String>,
}

/// One timed batch as the guest recorded it: `iters` loop iterations of
/// one access each, in `cycles` TSC cycles.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Batch {
    pub cycles: u64,
    pub iters: u64,
    pub accesses: u64,
}

impl Row {
    /// The timed batches (every row's loop makes one access per iteration).
    pub fn batches(&self) -> Vec<Batch> {
        self.cycles.iter().map(|&cycles| Batch { cycles, iters: self.iters, accesses: self.iters }).collect()
    }

    /// Accesses inside the timed batches.
    pub fn timed_accesses(&self) -> u64 {
        self.iters.saturating_mul(self.cycles.len() as u64)
    }

    /// The privilege level the row's loop ran at, when the guest said (3 before it did).
    pub fn cpl(&self) -> Option<u8> {
        self.extra.get("cpl").and_then(|v| v.parse().ok())
    }

    /// Cycles per access of each batch.
    pub fn per_access(&self) -> Vec<f64> {
        if self.iters == 0 {
            return Vec::new();
        }
        self.cycles.iter().map(|&c| c as f64 / self.iters as f64).collect()
    }

    pub fn get_u64(&self, k: &str) -> Option<u64> {
        self.extra.get(k).and_then(|v| v.parse().ok())
    }

    /// The guest's own verdict, when it gave one (e.g. "unsupported", "error").
    pub fn status(&self) -> Option<&str> {
        self.extra.get("status").map(|s| s.as_str())
    }
}

/// The `k=v` fields of a record line (its first word, `@KIND`, skipped).
pub fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .skip(1)
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The fields of the first `@KIND` record in a guest's output.
pub fn find_record<S: AsRef<str>>(lines: &[S], kind: &str) -> Option<BTreeMap<String, String>> {
    let prefix = format!("@{kind} ");
    lines.iter().map(|l| l.as_ref()).find(|l| l.starts_with(&prefix)).map(fields)
}

/// Parses one `@row` line; malformed numbers make the line an error row,
/// never a panic (the guest's output is input like any other).
pub fn parse_row(line: &str) -> Option<Row> {
    let rest = line.strip_prefix("@row ")?;
    let mut f = fields(&format!("@row {rest}"));
    let name = f.remove("name")?;
    let group = f.remove("group").unwrap_or_default();
    let mut row = Row { name, group, ..Default::default() };
    let num = |f: &mut BTreeMap<String, String>, k: &str| f.remove(k).map(|v| v.parse::<u64>().ok());
    match (num(&mut f, "iters"), num(&mut f, "accesses")) {
        (Some(Some(i)), Some(Some(a))) => {
            row.iters = i;
            row.accesses = a;
        }
        (None, None) => {}
        _ => {
            f.insert("status".into(), "error".into());
            f.insert("reason".into(), "malformed-record".into());
        }
    }
    if let Some(c) = f.remove("cycles") {
        match c.split(',').map(|x| x.parse::<u64>()).collect::<Result<Vec<_>, _>>() {
            Ok(v) => row.cycles = v,
            Err(_) => {
                f.insert("status".into(), "error".into());
                f.insert("reason".into(), "malformed-record".into());
            }
        }
    }
    // warm= (untimed accesses) + the timed batches must be every access.
    if let Some(w) = f.get("warm") {
        let timed = row.iters.checked_mul(row.cycles.len() as u64);
        let whole = w.parse::<u64>().ok().zip(timed).and_then(|(w, t)| w.checked_add(t));
        if whole != Some(row.accesses) && !f.contains_key("status") {
            f.insert("status".into(), "error".into());
            f.insert("reason".into(), "inconsistent-counts".into());
        }
    }
    row.extra = f;
    Some(row)
}

/// Everything a guest run printed that the host uses.
#[derive(Clone, Debug, Default)]
pub struct GuestOutput {
    pub rows: Vec<Row>,
    pub guest: BTreeMap<String, String>,
    pub pci: Vec<BTreeMap<String, String>>,
    pub fault: Option<String>,
    pub done_rc: Option<i64>,
}

impl GuestOutput {
    pub fn parse<S: AsRef<str>>(lines: &[S]) -> Self {
        let mut g = GuestOutput::default();
        for l in lines {
            let l = l.as_ref();
            if let Some(r) = parse_row(l) {
                g.rows.push(r);
            } else if l.starts_with("@guest ") {
                g.guest = fields(l);
            } else if l.starts_with("@pci ") {
                g.pci.push(fields(l));
            } else if l.starts_with("@fault ") {
                g.fault = Some(l.to_string());
            } else if let Some(rc) = l.strip_prefix("@done rc=") {
                g.done_rc = rc.trim().parse().ok();
            }
        }
        g
    }

    pub fn row(&self, name: &str) -> Option<&Row> {
        self.rows.iter().find(|r| r.name == name)
    }
}

/// Why a guest run failed, for an error message: its isa-debug-exit status
/// decoded (`(rc << 1) | 1`: 1 is the guest's rc 0, success) and the lines
/// in which the guest said why (`@fault`, `@error`, `@...-error`, a `@row`
/// with `status=error`; at most 4), else its last 3 lines.
pub fn exit_failure<S: AsRef<str>>(status: i32, lines: &[S]) -> String {
    let rc = match status {
        s if s & 1 == 1 && (s >> 1) == 0x3f => "the guest's rc 0x3f: a CPU fault".to_string(),
        s if s & 1 == 1 => format!("the guest's rc {}", s >> 1),
        _ => "not an isa-debug-exit value: the VM ended another way".to_string(),
    };
    let said = |l: &str| {
        let head = l.split_whitespace().next().unwrap_or("");
        head == "@fault"
            || head == "@error"
            || (head.starts_with('@') && head.ends_with("-error"))
            || (head == "@row" && l.split_whitespace().any(|f| f == "status=error"))
    };
    let mut why: Vec<&str> = lines.iter().map(|l| l.as_ref().trim_end()).filter(|l| said(l)).take(4).collect();
    if why.is_empty() {
        let n = lines.len();
        why = lines[n.saturating_sub(3)..].iter().map(|l| l.as_ref().trim_end()).collect();
        if why.is_empty() {
            return format!("guest exit status {status} ({rc}); the guest printed nothing");
        }
        return format!("guest exit status {status} ({rc}); its last lines: {}", why.join(" | "));
    }
    format!("guest exit status {status} ({rc}): {}", why.join(" | "))
}

#[cfg(test)]
mod exit_failure_tests {
    use super::exit_failure;

    #[test]
    fn a_failed_run_names_the_guests_own_reason() {
        let lines = [
            "@guest version=1",
            "@row name=shm group=doorbell cpl=3 status=error reason=timeout device_error=0 completed=7",
            "@done rc=1",
        ];
        let m = exit_failure(3, &lines);
        assert!(m.starts_with("guest exit status 3 (the guest's rc 1)"), "{m}");
        assert!(m.contains("reason=timeout"), "{m}");
        let m = exit_failure(3, &["@nvme-error cid=4 completed twice", "@done rc=1"]);
        assert!(m.contains("cid=4 completed twice"), "{m}");
        let m = exit_failure(0x7f, &["@fault vector=14 error=0x4 rip=0x1000"]);
        assert!(m.contains("a CPU fault") && m.contains("vector=14"), "{m}");
        let m = exit_failure(3, &["a", "b", "c", "d"]);
        assert!(m.ends_with("its last lines: b | c | d"), "{m}");
        assert!(exit_failure(0, &[] as &[&str]).contains("printed nothing"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rows_and_extras() {
        let r = parse_row("@row name=cpuid group=cpu iters=10 accesses=50 cycles=100,200 count=3").unwrap();
        assert_eq!(r.name, "cpuid");
        assert_eq!(r.cycles, vec![100, 200]);
        assert_eq!(r.per_access(), vec![10.0, 20.0]);
        assert_eq!(r.get_u64("count"), Some(3));
        assert_eq!(r.status(), None);
    }

    #[test]
    fn malformed_records_become_errors() {
        let r = parse_row("@row name=x iters=1 accesses=zz cycles=1").unwrap();
        assert_eq!(r.status(), Some("error"));
        let r = parse_row("@row name=x iters=1 accesses=1 cycles=1,,2").unwrap();
        assert_eq!(r.status(), Some("error"));
        assert!(parse_row("@row group=x").is_none());
        let r = parse_row("@row name=vmcall group=cpu status=unsupported vector=6").unwrap();
        assert_eq!(r.status(), Some("unsupported"));
        assert!(r.per_access().is_empty());
    }

    #[test]
    fn batches_and_counts_come_from_the_record() {
        let r = parse_row("@row name=x group=g cpl=0 iters=100 accesses=350 warm=50 cycles=7,8,9").unwrap();
        assert_eq!(r.status(), None);
        assert_eq!(r.cpl(), Some(0));
        assert_eq!(r.timed_accesses(), 300);
        assert_eq!(r.batches()[1], Batch { cycles: 8, iters: 100, accesses: 100 });
        // Counts that do not add up are an error row, as is an overflow.
        let r = parse_row("@row name=x group=g iters=100 accesses=351 warm=50 cycles=7,8,9").unwrap();
        assert_eq!((r.status(), r.extra["reason"].as_str()), (Some("error"), "inconsistent-counts"));
        let r = parse_row("@row name=x iters=18446744073709551615 accesses=1 warm=1 cycles=1,1").unwrap();
        assert_eq!(r.status(), Some("error"));
    }

    #[test]
    fn parses_a_whole_run() {
        let g = GuestOutput::parse(&[
            "@guest version=1 tsc_khz=2000000",
            "@pci bdf=00:01.0 id=1b36:0005",
            "@row name=a group=g iters=1 accesses=2 cycles=5",
            "a 5",
            "@done rc=0",
        ]);
        assert_eq!(g.guest["tsc_khz"], "2000000");
        assert_eq!(g.pci.len(), 1);
        assert_eq!(g.rows.len(), 1);
        assert_eq!(g.done_rc, Some(0));
    }
}
