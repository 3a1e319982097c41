//! `iopath serve ... --control PATH` and `iopath ctl PATH ...`, the binaries as users run them
//! (the device process confined by seccomp): rules added in both forms, listed, counted,
//! removed and cleared; bad rules refused with the piece named; a device without injection
//! refuses --control; the control socket's file is gone with the process. (What the rules do to
//! a driver's commands: the Linux test in real_clients.rs and the queue oracle.)

mod common;
use common::TempDir;

use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A liveness bound on every wait.
const HUNG: Duration = Duration::from_secs(20);

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &Path, device: &str) -> Server {
    let child = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", device, "--socket"])
        .arg(dir.join("dev.sock"))
        .arg("--control")
        .arg(dir.join("ctl.sock"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("serve.err")).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !dir.join("ctl.sock").exists() {
        assert!(t0.elapsed() < HUNG, "no control socket: {}", std::fs::read_to_string(dir.join("serve.err")).unwrap());
        std::thread::sleep(Duration::from_millis(10));
    }
    Server(child)
}

fn ctl(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iopath")).arg("ctl").arg(dir.join("ctl.sock")).args(args).output().unwrap()
}

/// The reply lines of a `ctl` that must succeed.
fn ok(dir: &Path, args: &[&str]) -> Vec<Value> {
    let o = ctl(dir, args);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "ctl {args:?}: {out}{}", String::from_utf8_lossy(&o.stderr));
    out.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn rules_come_and_go_through_the_control_socket_of_a_confined_device_process() {
    let d = TempDir::new("control-rules");
    let mut s = serve(&d, "nvme,backend=ram,size_mb=16,inject=op=read/lba=8-15/status=2:0x81/once");
    // Two rules in the text form (joined by +), one in JSON.
    let added = ok(&d, &["inject", "op=write/delay=2ms/every=3+qid=2/drop"]);
    assert_eq!(added.iter().map(|r| r["id"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 3]);
    let json = r#"{"match":{"op":"read","nsid":1},"action":{"corrupt":{"bytes":4,"seed":7}},"trigger":{"count":5}}"#;
    assert_eq!(ok(&d, &["inject", json])[0]["id"], 4);
    let list = &ok(&d, &["list"])[0]["rules"];
    let ids: Vec<u64> = list.as_array().unwrap().iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1, 2, 3, 4], "the inject= rule first, then in the order added: {list}");
    assert_eq!(list[3]["action"]["corrupt"]["bytes"], 4, "{list}");
    let stats = &ok(&d, &["stats"])[0]["stats"];
    assert_eq!(stats["rules"].as_array().unwrap().len(), 4, "{stats}");
    assert_eq!(stats["injected"], 0, "no client, no command: {stats}");
    assert_eq!(ok(&d, &["remove", "2"])[0]["rule"]["id"], 2);
    // Refused: a bad rule (before it is sent), a rule id that is not there.
    let bad = ctl(&d, &["inject", "op=read/status=9:1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("sct"), "{}", String::from_utf8_lossy(&bad.stderr));
    let gone = ctl(&d, &["remove", "2"]);
    assert_eq!(gone.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("no rule 2"));
    assert_eq!(ok(&d, &["clear"])[0]["removed"], 3);
    assert_eq!(ok(&d, &["list"])[0]["rules"], serde_json::json!([]));
    // The process is alive and confined all along; SIGTERM takes both socket files with it.
    assert!(s.0.try_wait().unwrap().is_none(), "{}", std::fs::read_to_string(d.join("serve.err")).unwrap());
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(s.0.id() as libc::pid_t, libc::SIGTERM) };
    let t0 = Instant::now();
    while s.0.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < HUNG, "serve did not end on SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!d.join("ctl.sock").exists() && !d.join("dev.sock").exists(), "a socket file outlived the process");
}

#[test]
fn a_device_without_error_injection_refuses_a_control_socket() {
    let d = TempDir::new("control-refused");
    let o = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--socket"])
        .arg(d.join("dev.sock"))
        .arg("--control")
        .arg(d.join("ctl.sock"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--control") && err.contains("no error injection"), "{err}");
    assert!(!d.join("ctl.sock").exists());
}

#[test]
fn a_virtio_blk_device_process_takes_rules_at_run_time_and_refuses_what_it_cannot_do() {
    let d = TempDir::new("control-virtio");
    let _s = serve(&d, "virtio-blk,backend=ram,size_mb=16,inject=op=read/lba=0-7/status=2:0x81/once");
    assert_eq!(ok(&d, &["inject", "op=write/delay=1ms/every=2"])[0]["id"], 2);
    // An NVMe asynchronous event means nothing to virtio-blk: refused, the action named, nothing added.
    let ev = ctl(&d, &["inject", "event=smart:0x01"]);
    assert_eq!(ev.status.code(), Some(1));
    let out = String::from_utf8_lossy(&ev.stdout);
    assert!(out.contains("\"field\":\"action\"") && out.contains("virtio-blk"), "{out}");
    let ids: Vec<u64> =
        ok(&d, &["list"])[0]["rules"].as_array().unwrap().iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1, 2]);
    // No namespaces to attach or detach.
    let det = ctl(&d, &["detach", "1"]);
    assert_eq!(det.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&det.stderr).contains("no namespaces"), "{}", String::from_utf8_lossy(&det.stderr));
    assert_eq!(ok(&d, &["clear"])[0]["removed"], 2);
}

#[test]
fn namespaces_are_detached_and_attached_through_the_control_socket() {
    let d = TempDir::new("control-attach");
    let _s = serve(&d, "nvme,backend=ram,size_mb=16,namespaces=3");
    assert_eq!(ok(&d, &["detach", "2"])[0], serde_json::json!({"ok": true, "nsid": 2, "changed": true}));
    assert_eq!(ok(&d, &["detach", "2"])[0]["changed"], false, "detached already");
    assert_eq!(ok(&d, &["attach", "2"])[0]["changed"], true);
    let none = ctl(&d, &["attach", "4"]);
    assert_eq!(none.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no namespace 4"),
        "{}",
        String::from_utf8_lossy(&none.stderr)
    );
}
