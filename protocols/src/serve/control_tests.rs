use super::*;
use iopath_devices::block::inject::{Action, CommandView, Kind, Lbas, Status};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

const READ_ERROR: &str =
    r#"{"match":{"op":"read","lba":[100,199]},"action":{"status":{"sct":2,"sc":129}},"trigger":{"every":2}}"#;

fn ask(t: &Injector, line: &str) -> Value {
    answer(t, None, line)
}

fn read_at(slba: u64) -> CommandView {
    CommandView { opcode: 2, kind: Kind::Read, nsid: 1, lba: Some(Lbas { slba, nlb: 7 }), qid: 1 }
}

#[test]
fn each_command_changes_or_reads_the_rules_the_device_decides_with() {
    let set = Injector::new();
    assert_eq!(ask(&set, r#"{"cmd":"list"}"#), json!({"ok": true, "rules": []}));
    let r = ask(&set, &format!(r#"{{"cmd":"inject","rule":{READ_ERROR}}}"#));
    assert_eq!(r, json!({"ok": true, "id": 1}));
    // The device's side: every second matching read fails, others pass.
    let got: Vec<Option<Action>> = (0..4).map(|_| set.decide(&read_at(96))).collect();
    let st = Action::Status(Status { sct: 2, sc: 0x81, dnr: false, more: false });
    assert_eq!(got, [None, Some(st), None, Some(st)]);
    assert_eq!(set.decide(&read_at(200)), None, "outside the LBA range");
    let listed = ask(&set, r#"{"cmd":"list"}"#);
    assert_eq!(listed["rules"][0]["id"], 1);
    assert_eq!(Rule::from_value(&listed["rules"][0]).unwrap().action, st, "the list gives the rule back");
    assert_eq!(
        ask(&set, r#"{"cmd":"stats"}"#),
        json!({"ok": true, "stats": {"commands": 5, "injected": 2, "rules": [{"id": 1, "matched": 4, "fired": 2}]}})
    );
    assert_eq!(ask(&set, r#"{"cmd":"remove","id":1}"#)["rule"]["id"], 1);
    assert_eq!(set.decide(&read_at(96)), None, "removed");
    assert_eq!(ask(&set, r#"{"cmd":"remove","id":1}"#), json!({"ok": false, "error": "no rule 1"}));
    ask(&set, &format!(r#"{{"cmd":"inject","rule":{READ_ERROR}}}"#));
    ask(&set, &format!(r#"{{"cmd":"inject","rule":{READ_ERROR}}}"#));
    assert_eq!(ask(&set, r#"{"cmd":"clear"}"#), json!({"ok": true, "removed": 2}));
    assert!(set.list().is_empty());
}

#[test]
fn bad_requests_get_an_error_naming_what_is_wrong_and_change_nothing() {
    let set = Injector::new();
    let cases = [
        ("not json", None),
        (r#"[1]"#, None),
        (r#"{}"#, Some("cmd")),
        (r#"{"cmd":7}"#, Some("cmd")),
        (r#"{"cmd":"format"}"#, Some("cmd")),
        (r#"{"cmd":"list","x":1}"#, None),
        (r#"{"cmd":"inject"}"#, Some("rule")),
        (r#"{"cmd":"inject","rule":{"action":{"status":{"sct":9,"sc":1}}}}"#, Some("action.status.sct")),
        (r#"{"cmd":"inject","rule":{"action":"drop","bogus":1}}"#, Some("rule")),
        (r#"{"cmd":"remove","id":"one"}"#, Some("id")),
    ];
    for (line, field) in cases {
        let r = ask(&set, line);
        assert_eq!(r["ok"], false, "{line}: {r}");
        assert!(r["error"].as_str().is_some_and(|e| !e.is_empty()), "{line}: {r}");
        assert_eq!(r.get("field").and_then(Value::as_str), field, "{line}: {r}");
    }
    assert!(set.list().is_empty());
    assert_eq!(set.stats().commands, 0);
}

#[test]
fn the_set_bound_holds_over_the_socket_protocol() {
    let set = Injector::new();
    let add = format!(r#"{{"cmd":"inject","rule":{READ_ERROR}}}"#);
    for _ in 0..iopath_devices::block::inject::MAX_RULES {
        assert_eq!(ask(&set, &add)["ok"], true);
    }
    let r = ask(&set, &add);
    assert_eq!(r["ok"], false);
    assert!(r["error"].as_str().unwrap().contains("at most"), "{r}");
}

/// A scratch directory removed when dropped, a failed assertion included.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("iopath-control-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn line(r: &mut impl BufRead) -> Value {
    let mut s = String::new();
    r.read_line(&mut s).unwrap();
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
}

#[test]
fn the_socket_answers_each_line_in_order_and_is_gone_when_dropped() {
    let d = dir("order");
    let p = d.0.join("ctl.sock");
    let set = Arc::new(Injector::new());
    let c = Control::start(&p, set.clone(), None).unwrap();
    let mut s = UnixStream::connect(&p).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Two requests in one write, the second split over two writes.
    write!(s, "{{\"cmd\":\"inject\",\"rule\":{READ_ERROR}}}\n{{\"cmd\":").unwrap();
    s.write_all(b"\"list\"}\n").unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    assert_eq!(line(&mut r), json!({"ok": true, "id": 1}));
    assert_eq!(line(&mut r)["rules"][0]["id"], 1);
    assert_eq!(set.list().len(), 1, "the device's own set changed");
    drop(c);
    assert!(!p.exists(), "the socket file is removed when the control socket stops");
}

#[test]
fn a_long_line_and_one_connection_too_many_are_refused_and_the_rest_go_on() {
    let d = dir("bounds");
    let p = d.0.join("ctl.sock");
    let set = Arc::new(Injector::new());
    let _c = Control::start(&p, set.clone(), None).unwrap();
    let mut held: Vec<UnixStream> = (0..MAX_CLIENTS).map(|_| UnixStream::connect(&p).unwrap()).collect();
    // Each held connection is served (so all are accepted before the next).
    for s in &mut held {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"{\"cmd\":\"list\"}\n").unwrap();
        assert_eq!(line(&mut BufReader::new(s.try_clone().unwrap()))["ok"], true);
    }
    let extra = UnixStream::connect(&p).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(extra);
    let refused = line(&mut r);
    assert_eq!(refused["ok"], false);
    assert!(refused["error"].as_str().unwrap().contains("at most"), "{refused}");
    let mut rest = String::new();
    assert_eq!(r.read_line(&mut rest).unwrap(), 0, "closed after the refusal");
    // A line past the bound: an error, then the connection is closed.
    let mut long = held.pop().unwrap();
    let _ = long.write_all(&vec![b' '; MAX_REQUEST + 10]);
    let mut r = BufReader::new(long.try_clone().unwrap());
    let e = line(&mut r);
    assert!(e["error"].as_str().unwrap().contains("longer"), "{e}");
    let mut rest = String::new();
    assert_eq!(r.read_line(&mut rest).unwrap(), 0, "closed after a line too long");
    // The others are still served.
    let s = &mut held[0];
    s.write_all(b"{\"cmd\":\"stats\"}\n").unwrap();
    assert_eq!(line(&mut BufReader::new(s.try_clone().unwrap()))["ok"], true);
    assert!(set.list().is_empty());
}

#[test]
fn a_file_at_the_path_is_refused_and_left_alone() {
    let d = dir("file");
    let p = d.0.join("image.raw");
    std::fs::write(&p, b"precious").unwrap();
    let set = Arc::new(Injector::new());
    assert!(Control::start(&p, set, None).is_err());
    assert_eq!(std::fs::read(&p).unwrap(), b"precious");
}

#[test]
fn attach_and_detach_change_an_nvme_namespace_and_a_device_without_namespaces_refuses_them() {
    let cfg: iopath_devices::DeviceConfig = "nvme,backend=null,namespaces=2".parse().unwrap();
    let nvme = cfg.build().unwrap();
    let rules = nvme.injector().unwrap();
    let ask = |line: &str| answer(&rules, Some(&*nvme), line);
    assert_eq!(ask(r#"{"cmd":"detach","nsid":2}"#), json!({"ok": true, "nsid": 2, "changed": true}));
    assert_eq!(ask(r#"{"cmd":"detach","nsid":2}"#), json!({"ok": true, "nsid": 2, "changed": false}));
    assert_eq!(ask(r#"{"cmd":"attach","nsid":2}"#), json!({"ok": true, "nsid": 2, "changed": true}));
    assert_eq!(ask(r#"{"cmd":"attach","nsid":2}"#)["changed"], false);
    for bad in [
        r#"{"cmd":"attach","nsid":3}"#,
        r#"{"cmd":"attach"}"#,
        r#"{"cmd":"detach","nsid":-1}"#,
        r#"{"cmd":"detach","nsid":4294967296}"#,
    ] {
        let r = ask(bad);
        assert_eq!((r["ok"].clone(), r["field"].clone()), (json!(false), json!("nsid")), "{bad}: {r}");
    }
    assert_eq!(ask(r#"{"cmd":"attach","nsid":1,"x":0}"#)["ok"], false, "unknown field");
    // No device given (or one without namespaces): refused, the rules untouched.
    let r = answer(&rules, None, r#"{"cmd":"detach","nsid":1}"#);
    assert_eq!(r["ok"], false);
    let pci: iopath_devices::DeviceConfig = "pci-testdev".parse().unwrap();
    let pci = pci.build().unwrap();
    let r = answer(&rules, Some(&*pci), r#"{"cmd":"detach","nsid":1}"#);
    assert!(r["error"].as_str().unwrap().contains("no namespaces"), "{r}");
}
