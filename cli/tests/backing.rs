//! `--backend file:PATH` as a fio user expects it (the real binary): a
//! missing PATH is refused with a message that names it and `--create`;
//! with `--create` the file is laid out (written, no holes) before it is
//! measured; an existing file is not changed by a read-only bench. The
//! same for a device spec's `backend=file:PATH` (`iopath serve`, `iopath
//! run --device`), whose `create=on` makes a missing file.

mod common;
use common::TempDir;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};

fn iopath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iopath")).args(args).output().unwrap()
}

/// A short read-only `bench nvme` on `file` (`more` added).
fn bench_nvme(file: &Path, more: &[&str]) -> Output {
    assert!(Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let backend = format!("file:{}", file.display());
    let mut a = vec!["bench", "nvme", "--backend", &backend, "--doorbell", "shm", "--rw", "randread"];
    a.extend(["--bs", "4k", "--iodepth", "4", "--rounds", "1", "--runtime", "300ms", "--quiet", "--json", "-"]);
    a.extend(more);
    a.extend(["--pin", "off"]);
    iopath(&a)
}

#[test]
fn a_missing_backend_file_is_refused_naming_it_and_the_option_that_makes_it() {
    let d = TempDir::new("backing-cli-missing");
    let p = d.join("none.img");
    let backend = format!("file:{}", p.display());
    for args in [vec!["bench", "nvme", "--backend", &backend], vec!["bench", "blk", "--backend", &backend]] {
        let out = iopath(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&p.display().to_string()) && stderr.contains("--create"), "{stderr}");
        assert!(!p.exists(), "{args:?} made {}", p.display());
    }
}

#[test]
fn with_create_the_file_is_written_through_before_it_is_measured() {
    let d = TempDir::new("backing-cli-create");
    let p = d.join("new.img");
    let out = bench_nvme(&p, &["--create"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let m = std::fs::metadata(&p).unwrap();
    assert_eq!(m.len(), 64 << 20, "the default namespace size");
    assert!(m.blocks() * 512 >= m.len(), "{} bytes allocated of {}: the bench read holes", m.blocks() * 512, m.len());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["runs"][0]["iops"].as_f64().is_some_and(|x| x > 0.0), "{}", v["runs"]);
}

#[test]
fn a_read_only_bench_leaves_an_existing_file_as_it_was() {
    let d = TempDir::new("backing-cli-existing");
    let p = d.join("user.img");
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&p, &data).unwrap();
    let before = std::fs::metadata(&p).unwrap();
    // --create too: a file that is there is used as it is.
    let out = bench_nvme(&p, &["--create"]);
    assert!(out.status.success(), "{}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let after = std::fs::metadata(&p).unwrap();
    assert_eq!((after.len(), after.ino()), (before.len(), before.ino()), "the file was replaced or resized");
    assert!(std::fs::read(&p).unwrap() == data, "a read-only bench changed the user's file");
    // A file under 1 MiB would have to be extended: refused, and left alone.
    let short = d.join("short.img");
    std::fs::write(&short, b"the user's").unwrap();
    let out = bench_nvme(&short, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&short).unwrap(), b"the user's");
}

const MISSING: &str = "does not exist; add create=on to lay it out";

/// `iopath run` with nvmeperf reading (never writing) the namespace of `device`:
/// its `@nvme` record, after checking that the run passed.
fn read_only_run(device: &str) -> std::collections::BTreeMap<String, String> {
    assert!(Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let append = "rw=randread bs=4096 iodepth=4 time_ms=200";
    let out = iopath(&["run", "--workload", "nvme", "--timeout", "60", "--append", append, "--device", device]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{device}: {}\n{stdout}\n{stderr}", out.status);
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    let rec = iopath_bench::record::find_record(&lines, "nvme").unwrap_or_else(|| panic!("no @nvme record: {stdout}"));
    assert_eq!(rec.get("errors").map(String::as_str), Some("0"), "{device}: {rec:?}");
    assert!(rec.get("ios").and_then(|v| v.parse::<u64>().ok()).is_some_and(|n| n > 0), "{device}: {rec:?}");
    rec
}

/// A file of `len` bytes that the guest's reads left as `create=on` made it: every byte
/// allocated (no holes) and zero.
fn laid_out(p: &Path, len: u64) {
    let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    assert_eq!(m.len(), len, "{}", p.display());
    assert!(m.blocks() * 512 >= len, "{}: {} of {len} bytes allocated: holes", p.display(), m.blocks() * 512);
    assert!(std::fs::read(p).unwrap().iter().all(|&b| b == 0), "{}: not zeros", p.display());
}

#[test]
fn a_device_specs_missing_file_is_refused_and_nothing_is_made() {
    let d = TempDir::new("backing-cli-spec-missing");
    let p = d.join("none.img");
    let sock = d.join("s.sock");
    let (file, sock_s) = (format!("file:{}", p.display()), sock.to_str().unwrap().to_string());
    let cases: [Vec<String>; 5] = [
        ["serve", &format!("nvme,backend={file}"), "--socket", &sock_s].map(String::from).into(),
        ["serve", &format!("virtio-blk,backend={file}"), "--transport", "vhost-user", "--socket", &sock_s]
            .map(String::from)
            .into(),
        ["serve", &format!("virtio-blk,backend={file},notify=ioeventfd"), "--socket", &sock_s].map(String::from).into(),
        ["run", "--device", &format!("nvme,backend={file}")].map(String::from).into(),
        ["run", "--device", &format!("nvme,backend={file},size_mb=8@vfio-user")].map(String::from).into(),
    ];
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = iopath(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&format!("backend file:{}: {MISSING}", p.display())), "{args:?}: {stderr}");
        assert_eq!(stderr.matches(MISSING).count(), 1, "{args:?}: said once: {stderr}");
        let left: Vec<_> = std::fs::read_dir(&*d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
}

#[test]
fn create_on_lays_the_file_out_in_the_vmm_and_in_a_served_device() {
    let d = TempDir::new("backing-cli-spec-create");
    // In the VMM, and in a device process the VMM starts (the option goes through its argv).
    for (name, remote) in [("vmm.img", ""), ("spawned.img", "@vfio-user")] {
        let p = d.join(name);
        read_only_run(&format!("nvme,doorbell=shm,backend=file:{},create=on,size_mb=8{remote}", p.display()));
        laid_out(&p, 8 << 20);
    }
    // `iopath serve` on a socket, one client: the file is there before the client is.
    let p = d.join("served.img");
    let sock = d.join("s.sock");
    let spec = format!("nvme,doorbell=shm,backend=file:{},create=on,size_mb=4", p.display());
    let mut serve = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", &spec, "--once", "--no-seccomp", "--socket"])
        .arg(&sock)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !(sock.exists() && p.exists()) {
        if let Some(st) = serve.try_wait().unwrap() {
            panic!("iopath serve ended ({st}) before it served: {:?}", serve.wait_with_output().unwrap());
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "no socket and file from iopath serve");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    read_only_run(&format!("nvme@vfio-user:{}", sock.display()));
    let out = serve.wait_with_output().unwrap();
    assert!(out.status.success(), "{}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    laid_out(&p, 4 << 20);
}

#[test]
fn create_on_leaves_an_existing_file_as_it_was_and_refuses_a_short_one() {
    let d = TempDir::new("backing-cli-spec-existing");
    let p = d.join("user.img");
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
    std::fs::write(&p, &data).unwrap();
    let before = std::fs::metadata(&p).unwrap();
    for remote in ["", "@vfio-user"] {
        // A namespace smaller than the file: served from its start, the rest untouched too.
        for mb in [8, 4] {
            read_only_run(&format!("nvme,doorbell=shm,backend=file:{},create=on,size_mb={mb}{remote}", p.display()));
            let after = std::fs::metadata(&p).unwrap();
            assert_eq!((after.len(), after.ino()), (before.len(), before.ino()), "replaced or resized");
            assert!(std::fs::read(&p).unwrap() == data, "the user's file changed");
        }
        // Longer than the file: never extended.
        let spec = format!("nvme,backend=file:{},create=on,size_mb=16{remote}", p.display());
        let out = iopath(&["run", "--device", &spec]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{spec}: {stderr}");
        assert!(stderr.contains("holds 8388608 bytes, the disk needs 16777216"), "{spec}: {stderr}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 8 << 20, "extended");
        assert!(std::fs::read(&p).unwrap() == data, "the user's file changed");
    }
}

/// `iopath serve nvme --namespace SPEC ...`: each SPEC a namespace in the device-option syntax,
/// its file checked (or, with create=on, laid out) before the socket is served; a bad SPEC, or
/// `--namespace` beside `namespaces=`/`ns=` or for another device, is refused by name.
#[test]
fn serve_takes_each_namespace_from_a_namespace_flag_and_lays_out_their_files() {
    let d = TempDir::new("backing-cli-namespaces");
    let sock = d.join("s.sock");
    let sock_s = sock.to_str().unwrap().to_string();
    let missing = d.join("none.img");
    let bad: [(Vec<String>, String); 5] = [
        (
            [
                "serve",
                "nvme",
                "--namespace",
                "backend=ram",
                "--namespace",
                &format!("backend=file:{}", missing.display()),
            ]
            .map(String::from)
            .into(),
            format!("backend file:{}: {MISSING}", missing.display()),
        ),
        (["serve", "nvme", "--namespace", "colour=blue"].map(String::from).into(), "ns: unknown key".into()),
        (["serve", "nvme", "--namespace", "lba=1024"].map(String::from).into(), "ns: lba: 1024".into()),
        (
            ["serve", "nvme,namespaces=2", "--namespace", "backend=ram"].map(String::from).into(),
            "not with namespaces= or ns=".into(),
        ),
        (
            ["serve", "virtio-blk", "--namespace", "backend=ram"].map(String::from).into(),
            "--namespace is an nvme option".into(),
        ),
    ];
    for (mut args, want) in bad {
        args.extend(["--socket".to_string(), sock_s.clone()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = iopath(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&want), "{args:?}: {stderr}");
        let left: Vec<_> = std::fs::read_dir(&*d).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
    }
    // Two file namespaces made and laid out, then the socket served.
    let (a, b) = (d.join("a,1.img"), d.join("b.img"));
    let spec = |p: &Path, mb: u32, lba: u32| {
        format!("backend=file:{},create=on,size_mb={mb},lba={lba}", p.display().to_string().replace(',', ",,"))
    };
    let mut serve = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "nvme", "--once", "--no-seccomp", "--namespace", &spec(&a, 4, 512)])
        .args(["--namespace", &spec(&b, 2, 4096), "--socket", &sock_s])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The socket is bound before the device is built (a live server there is found before
    // any file is made): the banner, once it serves, says the files are laid out.
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = serve.stderr.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut said = Vec::new();
    while !said.iter().any(|l: &String| l.starts_with("iopath serve: ") && l.ends_with(&sock_s)) {
        match rx.recv_timeout(std::time::Duration::from_secs(20)) {
            Ok(l) => said.push(l),
            Err(e) => panic!("no banner from iopath serve ({e}; {:?}): {said:?}", serve.try_wait()),
        }
    }
    laid_out(&a, 4 << 20);
    laid_out(&b, 2 << 20);
    let _ = serve.kill();
    let _ = serve.wait();
}
