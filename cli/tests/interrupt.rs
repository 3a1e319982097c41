//! Ctrl-C in the middle of a bench (the real binary): SIGINT to the bench
//! alone (not its process group, so its children get no signal of their
//! own) stops it with exit status 130, every child it started (QEMU, the
//! `iopath serve` device process) ended and reaped, every file it made
//! (QEMU's /dev/shm image, sockets and logs in /tmp) removed, and the runs
//! measured before the signal printed and in the JSON marked partial.

mod common;
use common::{children, ProcInfo};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One bench at a time: two would share the 2 cores and each other's timing.
static ONE: Mutex<()> = Mutex::new(());

fn qemu_installed() {
    let on_path =
        std::env::var("PATH").unwrap_or_default().split(':').any(|d| Path::new(d).join("qemu-system-x86_64").is_file());
    assert!(
        on_path || std::env::var_os("IOPATH_QEMU").is_some(),
        "qemu-system-x86_64 is needed for this test (harness/test.sh installs it)"
    );
}

/// Every process whose command line names `needle`: (pid, cmdline).
fn naming(needle: &str) -> Vec<(u32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmd = std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ");
        if cmd.contains(needle) && p != std::process::id() {
            v.push((p, cmd));
        }
    }
    v
}

/// Files in /dev/shm and the temp directory whose names carry the bench's
/// pid the way its files do (`iopath-...-PID...`), made or changed since
/// `since` (an older one is another process's that had the same pid).
fn files_of(pid: u32, since: std::time::SystemTime) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for dir in [PathBuf::from("/dev/shm"), std::env::temp_dir()] {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let new = e.metadata().and_then(|m| m.modified()).is_ok_and(|t| t >= since);
            if n.starts_with("iopath") && n.contains(&format!("-{pid}")) && new {
                v.push(e.path());
            }
        }
    }
    v
}

/// Whether `pid` is still a process (a zombie counts: not reaped).
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn spawn_nvme(json: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args([
            "bench",
            "nvme",
            "--vs",
            "qemu",
            "--doorbell",
            "shm",
            "--transport",
            "vmm,vfio-user",
            "--rounds",
            "4",
            "--runtime",
            "1",
            "--iodepth",
            "4",
            "--bs",
            "4k",
            "--pin",
            "off",
            "--quiet",
            "--json",
        ])
        .arg(json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits (bounded) until `want` holds of the bench's children; the
/// children seen so far go to `seen`.
fn wait_for(child: &mut Child, seen: &mut Vec<ProcInfo>, what: &str, want: impl Fn(&[ProcInfo]) -> bool) {
    let t0 = Instant::now();
    loop {
        let k = children(child.id());
        for c in &k {
            if !seen.iter().any(|s| s.pid == c.pid) {
                seen.push(c.clone());
            }
        }
        if want(&k) {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
            panic!("the bench ended ({st}) before {what}: {err}");
        }
        if t0.elapsed() > Duration::from_secs(600) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no {what} within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_qemu(c: &ProcInfo) -> bool {
    c.cmdline.contains("qemu-system")
}

fn is_serve(c: &ProcInfo) -> bool {
    c.cmdline.contains(" serve ")
}

/// SIGINT to the bench while `during` holds of its children (after at
/// least one QEMU run ended); then the checks.
fn interrupt_while(during: &str, pred: fn(&ProcInfo) -> bool) {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    qemu_installed();
    let json = std::env::temp_dir().join(format!("interrupt-test-{}-{during}.json", std::process::id()));
    let _ = std::fs::remove_file(&json);
    // (A second back: file times may be coarser than the clock.)
    let since = std::time::SystemTime::now() - Duration::from_secs(1);
    let mut child = spawn_nvme(&json);
    let pid = child.id();
    let mut seen = Vec::new();
    // Round 0 runs iopath-shm, iopath-shm@vfio-user (a device process), then QEMU: a QEMU
    // that came and went means runs were measured.
    wait_for(&mut child, &mut seen, "a QEMU run", |k| k.iter().any(is_qemu));
    wait_for(&mut child, &mut seen, "the end of a QEMU run", |k| !k.iter().any(is_qemu));
    wait_for(&mut child, &mut seen, during, |k| k.iter().any(pred));
    let image = format!("iopath-qemu-nvme-{pid}-");
    assert!(
        files_of(pid, since).iter().any(|f| f.to_string_lossy().contains(&image)),
        "QEMU's /dev/shm image is there"
    );
    std::thread::sleep(Duration::from_millis(300)); // it is running by now
    let running = children(pid);
    assert!(running.iter().any(pred), "{during} still runs: {running:?}");
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
    let t1 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t1.elapsed() < Duration::from_secs(120), "the bench did not stop within 120 s of SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(130), "{}\n{stdout}\n{stderr}", out.status);
    assert!(stderr.contains("interrupted") && stderr.contains("partial"), "{stderr}");
    // Nothing left: every child seen ended and reaped, nobody holds the image, no file of the run's.
    let left: Vec<&ProcInfo> = seen.iter().filter(|c| alive(c.pid)).collect();
    assert!(left.is_empty(), "children of the bench still there: {left:?} (of {seen:?})");
    assert!(seen.iter().any(is_qemu) && seen.iter().any(is_serve), "QEMU and a device process ran: {seen:?}");
    assert_eq!(naming(&image), vec![], "a process still names the bench's image");
    assert_eq!(files_of(pid, since), Vec::<PathBuf>::new(), "files of the bench left behind");
    // The rounds measured so far: printed, and in the JSON marked partial.
    assert!(stdout.starts_with("PARTIAL: interrupted by a signal"), "{stdout}");
    let text = std::fs::read_to_string(&json).unwrap_or_else(|e| panic!("{}: {e}\n{stdout}\n{stderr}", json.display()));
    let _ = std::fs::remove_file(&json);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["partial"], true, "{text:.300}");
    let targets: Vec<&str> = v["runs"].as_array().unwrap().iter().filter_map(|r| r["target"].as_str()).collect();
    for t in ["iopath-shm", "iopath-shm@vfio-user", "qemu"] {
        assert!(targets.contains(&t), "round 0's {t} is among the runs kept: {targets:?}");
    }
    assert!(targets.len() < 12, "4 rounds of 3 targets did not all run: {targets:?}");
    for r in v["runs"].as_array().unwrap() {
        assert!(r["iops"].as_f64().is_some_and(|x| x > 0.0), "a kept run is a measured one: {r}");
    }
}

#[test]
fn sigint_while_a_device_process_serves_leaves_nothing_and_keeps_the_rounds_measured() {
    interrupt_while("a device process", is_serve);
}

#[test]
fn sigint_while_qemu_runs_leaves_nothing_and_keeps_the_rounds_measured() {
    // Round 1 runs the targets in reverse: QEMU first, right after round 0's.
    interrupt_while("a second QEMU run", is_qemu);
}
