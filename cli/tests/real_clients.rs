//! iopath's device processes driven by clients iopath did not write: QEMU 11's `vfio-user-pci`
//! with a stock Linux guest (its nvme driver, fio, nvme-cli, mkfs/fsck; under TCG, since this
//! host's KVM emulates guest ring 0), and iopath's own guest image under QEMU 11 + KVM.
//!
//! The QEMU 11 root, the trixie kernel and the initramfs come from `harness/linux/` (built once
//! and cached by the scripts' hash). These tests build it if it is missing and fail loudly if it
//! cannot be built: they are never skipped. They run one at a time (TCG guests need the cores).

mod common;
use common::kvm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One QEMU guest at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn harness(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/linux").join(script)
}

/// Keeps the first 2000 lines of a child's stderr; `listening` hears once of each line
/// `iopath serve` prints when it listens.
fn keep_stderr(
    child: &mut Child,
    listening: Option<std::sync::mpsc::Sender<()>>,
) -> std::sync::Arc<Mutex<Vec<String>>> {
    let stderr = std::sync::Arc::new(Mutex::new(Vec::new()));
    let (err, keep) = (child.stderr.take().unwrap(), stderr.clone());
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            if let (Some(tx), true) = (&listening, l.starts_with("iopath serve: ")) {
                let _ = tx.send(());
            }
            let mut k = keep.lock().unwrap();
            if k.len() < 2000 {
                k.push(l);
            }
        }
    });
    stderr
}

/// A thread reading all of `r` (a child's stdout or stderr) into a string.
fn read_all(r: Box<dyn std::io::Read + Send>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        use std::io::Read;
        let mut s = String::new();
        let _ = BufReader::new(r).read_to_string(&mut s);
        s
    })
}

/// An `iopath serve DEVICE --transport TRANSPORT` on a fresh socket; killed on drop.
struct Serve {
    child: Child,
    socket: PathBuf,
    stderr: std::sync::Arc<Mutex<Vec<String>>>,
}

impl Serve {
    fn start(device: &str) -> Serve {
        Serve::start_on(device, "vfio-user")
    }

    fn start_on(device: &str, transport: &str) -> Serve {
        Serve::start_with(device, transport, &[])
    }

    /// With more `iopath serve` arguments; `{dir}` in them is the socket's directory.
    fn start_with(device: &str, transport: &str, more: &[&str]) -> Serve {
        let dir = std::env::temp_dir().join(format!("iopath-rc-{}-{}", std::process::id(), unique()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("dev.sock");
        let more: Vec<String> = more.iter().map(|a| a.replace("{dir}", dir.to_str().unwrap())).collect();
        let mut child = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["serve", device, "--transport", transport, "--socket"])
            .arg(&socket)
            .args(&more)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start iopath serve");
        let stderr = keep_stderr(&mut child, None);
        let t0 = Instant::now();
        while !socket.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "iopath serve made no socket at {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Serve { child, socket, stderr }
    }

    /// The device's counters from the report `iopath serve` prints when its client leaves.
    fn report(&mut self) -> String {
        disconnect_report(&mut self.child)
    }
}

/// The counters line an `iopath serve` child prints on stdout when its client leaves (within
/// 20 s; empty if none).
fn disconnect_report(child: &mut Child) -> String {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if l.contains("\"disconnected\"") {
                let _ = tx.send(l);
                return;
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(20)).unwrap_or_default()
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(self.socket.parent().unwrap());
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Runs a harness script; returns (exit code, stdout+stderr).
fn script(name: &str, args: &[&str]) -> (i32, String) {
    let out = Command::new("bash").arg(harness(name)).args(args).output().expect("run a harness script");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// The `@check` lines and the `@done` verdict of a Linux guest run.
fn checks(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.starts_with("@check ") || l.starts_with("@done ")).collect()
}

/// Boots Linux under QEMU 11 (TCG) with `device` and runs the guest checks.
fn linux(device_args: &[&str]) -> String {
    linux_with(device_args, &String::new)
}

/// The same; a failure also shows `device_log()` (the device process's stderr).
fn linux_with(device_args: &[&str], device_log: &dyn Fn() -> String) -> String {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut args = vec!["--timeout", "420"];
    args.extend_from_slice(device_args);
    let (rc, text) = script("run-linux.sh", &args);
    let c = checks(&text);
    eprintln!("{}", c.join("\n"));
    assert!(
        c.iter().any(|l| l.starts_with("@done ")),
        "no @done (rc {rc}):\n{text}\n--- device process stderr ---\n{}",
        device_log()
    );
    assert_eq!(
        rc,
        0,
        "Linux guest checks failed:\n{}\n--- device process stderr ---\n{}\n--- full output ---\n{text}",
        c.join("\n"),
        device_log()
    );
    text
}

/// Linux against `iopath serve DEVICE` with guest RAM shared as a memfd (`share=on`); returns the
/// device's report.
fn linux_against_iopath(device: &str) -> String {
    linux_against_iopath_with(device, &[])
}

/// The same with more `run-linux.sh` options (`--no-share`).
fn linux_against_iopath_with(device: &str, more: &[&str]) -> String {
    let mut serve = Serve::start(device);
    let sock = serve.socket.to_str().unwrap().to_string();
    // A short driver timeout: a controller that misses interrupts fails the run in minutes, not hours.
    let args = [&["--vfio-user", sock.as_str(), "--nvme-timeout", "10"][..], more].concat();
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    for want in [
        "probe",
        "pci-caps",
        "irq-msix",
        "nvme-list",
        "id-ctrl",
        "id-ns",
        "ns-descs",
        "fio-randread",
        "fio-randwrite",
        "irq-count-rise",
        "ext4",
        "io-after-reset",
        "io-after-rebind",
        "no-timeout",
    ] {
        assert!(
            checks(&text).iter().any(|l| l.starts_with(&format!("@check {want}")) && l.contains(" ok")),
            "{device}: check {want} did not pass:\n{}",
            checks(&text).join("\n")
        );
    }
    let report = serve.report();
    let stderr = serve.stderr.lock().unwrap().join("\n");
    assert!(report.contains("msix.interrupts"), "{device}: no counters from iopath serve: {report}\n{stderr}");
    assert!(!report.contains("\"msix.interrupts\":0"), "{device}: the Linux driver got no MSI-X: {report}");
    report
}

/// The guest's knobs for a 64 MiB virtio-blk disk with one queue.
const VBLK_DISK: &str = "harness.vblk_sectors=131072 harness.vblk_queues=1";

fn vblk_checks_passed(what: &str, text: &str) {
    for want in common::LINUX_VBLK_CHECKS {
        assert!(
            checks(text).iter().any(|l| l.starts_with(&format!("@check {want} ok"))),
            "{what}: check {want} did not pass:\n{}",
            checks(text).join("\n")
        );
    }
}

/// Linux's virtio_blk driver against `iopath serve DEVICE --transport TRANSPORT` (vfio-user
/// through QEMU 11's vfio-user-pci); returns the device's report, whose counters must show the
/// driver's requests served with no error.
fn linux_vblk_against_iopath(device: &str, transport: &str) -> String {
    linux_vblk_against_iopath_with(device, transport, VBLK_DISK, &[]).1
}

/// The same with the guest's knobs `append` and more `run-linux.sh` options; returns the
/// guest's output and the device's report.
fn linux_vblk_against_iopath_with(device: &str, transport: &str, append: &str, more: &[&str]) -> (String, String) {
    let mut serve = Serve::start_on(device, transport);
    let sock = serve.socket.to_str().unwrap().to_string();
    let flag = format!("--{transport}");
    let args = [&[flag.as_str(), &sock, "--check", "vblk", "--append", append][..], more].concat();
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    vblk_checks_passed(device, &text);
    let report = serve.report();
    let stderr = serve.stderr.lock().unwrap().join("\n");
    assert!(
        counter(&report, "requests") > 1000,
        "{device}: the driver's requests did not reach iopath: {report}\n{stderr}"
    );
    assert!(counter(&report, "interrupts") > 0, "{device}: no interrupt reached the driver: {report}");
    for bad in ["errors", "ring_errors"] {
        assert_eq!(counter(&report, bad), 0, "{device}: {bad}: {report}\n{stderr}");
    }
    (text, report)
}

#[test]
fn linux_virtio_blk_driver_against_qemu_virtio_blk_control() {
    let text = linux(&["--device", "qemu-virtio-blk", "--append", VBLK_DISK]);
    vblk_checks_passed("qemu virtio-blk-pci", &text);
}

#[test]
fn linux_virtio_blk_driver_against_iopath_virtio_blk_over_vfio_user() {
    for notify in ["ioeventfd", "poll"] {
        let report =
            linux_vblk_against_iopath(&format!("virtio-blk,backend=ram,size_mb=64,notify={notify}"), "vfio-user");
        eprintln!("notify={notify}: {report}");
    }
}

/// iopath's virtio-blk on a `file:` disk, served through the block layer's io_uring (queues=2,
/// a 2-vCPU guest): fio verify on both queues, ext4 + fsck, unbind/bind; the device counts the
/// transfers it did through io_uring and saw several operations in flight at once.
#[test]
fn linux_virtio_blk_driver_against_an_iopath_file_disk_on_io_uring_over_vfio_user() {
    let dir = std::env::temp_dir().join(format!("iopath-rc-vblk-file-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0u8; 64 << 20]).unwrap();
    for notify in ["ioeventfd", "poll"] {
        let device = format!("virtio-blk,backend=file:{},size_mb=64,notify={notify},queues=2", img.display());
        let (_, report) = linux_vblk_against_iopath_with(&device, "vfio-user", VBLK_DISK_2Q, &["--smp", "2"]);
        eprintln!("notify={notify}: {report}");
        let direct = counter(&report, "backend.direct-ops");
        assert!(direct > 1000, "notify={notify}: {direct} transfers through io_uring: {report}");
        assert!(counter(&report, "backend.inflight-max") > 1, "notify={notify}: one at a time: {report}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 2-vCPU guest's knobs: the 64 MiB disk must come with 2 request queues, each with its MSI-X
/// vector taking interrupts, and fio runs a job on each vCPU (a region each, verified).
const VBLK_DISK_2Q: &str = "harness.vblk_sectors=131072 harness.vblk_queues=2 harness.fio_jobs=2";

/// iopath's virtio-blk without `queues=N` over vfio-user (its own PCI transport, through QEMU
/// 11's vfio-user-pci), and over vhost-user (QEMU's vhost-user-blk-pci, whose num-queues follows
/// -smp, on iopath's backend): `iopath serve` offers 16, of which a 2-vCPU Linux sets up 2 (its
/// virtio_blk takes one per CPU) and drives both. Before iopath's transport had several queues
/// this failed over vfio-user: Linux found one ("1 hardware queues, want 2"); before a device
/// process offered 16 by default it needed `queues=2` (the `file:` test above still gives it).
#[test]
fn linux_virtio_blk_driver_gets_a_queue_per_vcpu_from_iopath_over_vfio_user_and_vhost_user() {
    for transport in ["vfio-user", "vhost-user"] {
        let device = "virtio-blk,backend=ram,size_mb=64,notify=ioeventfd";
        let (text, report) = linux_vblk_against_iopath_with(device, transport, VBLK_DISK_2Q, &["--smp", "2"]);
        eprintln!("{transport}: {report}");
        for want in ["queues", "queue-irqs", "fio-randwrite", "fio-randread"] {
            assert!(
                checks(&text).iter().any(|l| l.starts_with(&format!("@check {want} ok"))),
                "{transport}: check {want} did not pass:\n{}",
                checks(&text).join("\n")
            );
        }
        assert!(text.contains("@check queues ok 2 hardware queues"), "{transport}: {}", checks(&text).join("\n"));
        // The device's own count: both queues carried requests (fio's jobs ran on both vCPUs),
        // together every request; it has 16 queues, and the driver left the other 14 alone.
        let (q0, q1) = (counter(&report, "q0.requests"), counter(&report, "q1.requests"));
        assert!(q0 > 100 && q1 > 100, "{transport}: requests per queue {q0} and {q1}: {report}");
        assert_eq!(q0 + q1, counter(&report, "requests"), "{transport}: {report}");
        for q in 2..16 {
            assert_eq!(counter(&report, &format!("q{q}.requests")), 0, "{transport}: queue {q}: {report}");
        }
        let v: serde_json::Value = serde_json::from_str(&report).unwrap();
        assert!(v["counters"].get("q16.requests").is_none(), "{transport}: a 17th queue: {report}");
    }
}

#[test]
fn linux_nvme_driver_against_qemu_nvme_control() {
    linux(&["--device", "qemu-nvme"]);
}

/// Behind a PCI Express root port (on q35's root bus QEMU shows an Endpoint as Root Complex
/// Integrated): lspci in the guest shows iopath's controller as an Express (v2) Endpoint with
/// Power Management, and the nvme driver binds, resets and rebinds it.
#[test]
fn linux_nvme_driver_against_iopath_nvme_bar_ram() {
    let mut serve = Serve::start("nvme,doorbell=bar,backend=ram,size_mb=64");
    let sock = serve.socket.to_str().unwrap().to_string();
    let log = serve.stderr.clone();
    let args = ["--vfio-user", sock.as_str(), "--nvme-timeout", "10", "--root-port"];
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    let c = checks(&text);
    let caps = c.iter().find(|l| l.starts_with("@check pci-caps ok")).unwrap_or_else(|| panic!("{}", c.join("\n")));
    assert!(caps.contains("Express (v2) Endpoint"), "{caps}");
    assert!(caps.contains("Power Management version 3") && caps.contains("driver=nvme"), "{caps}");
    for want in ["fio-randread", "io-after-reset", "io-after-rebind", "no-timeout"] {
        assert!(c.iter().any(|l| l.starts_with(&format!("@check {want} ok"))), "{want}:\n{}", c.join("\n"));
    }
    let report = serve.report();
    assert_eq!(counter(&report, "dma.reads"), 0, "shared guest RAM needs no DMA_READ: {report}");
}

/// QEMU with plain `-m` (no `share=on`): guest RAM comes without an fd, and iopath's device process
/// reaches it with DMA_READ/DMA_WRITE messages through QEMU's vfio-user client.
#[test]
fn linux_nvme_driver_against_iopath_nvme_bar_ram_without_shared_guest_ram() {
    let dev = "nvme,doorbell=bar,backend=ram,size_mb=64";
    let report = linux_against_iopath_with(dev, &["--no-share"]);
    assert!(counter(&report, "dma.reads") > 0 && counter(&report, "dma.writes") > 0, "no DMA fallback: {report}");
    assert_eq!(counter(&report, "dma.timeouts"), 0, "{report}");
    assert_eq!(counter(&report, "dma.errors"), 0, "{report}");
}

#[test]
fn linux_nvme_driver_against_iopath_nvme_shm_ram() {
    let _ = linux_against_iopath("nvme,doorbell=shm,backend=ram,size_mb=64");
}

/// The default doorbell mode (auto): Linux configures the shadow doorbells, so its I/O queues
/// are served from them (QEMU maps the doorbell page too), and the poller sleeps when the driver
/// is idle (timed steps: the page is QEMU's mapping, it cannot be trapped from here).
#[test]
fn linux_nvme_driver_against_iopath_nvme_in_its_default_mode() {
    let report = linux_against_iopath("nvme,backend=ram,size_mb=64");
    assert!(counter(&report, "dbbuf.configs") > 0, "Linux set up shadow doorbells: {report}");
    assert!(counter(&report, "adaptive.sleeps") > 0, "{report}");
}

/// adaptive from a device process: the shadow doorbells, and the announced ioeventfd that QEMU's
/// client turns into a doorbell message, which wakes the sleeping poller.
#[test]
fn linux_nvme_driver_against_iopath_nvme_adaptive_ram() {
    let report = linux_against_iopath("nvme,doorbell=adaptive,backend=ram,size_mb=64");
    assert!(counter(&report, "adaptive.sleeps") > 0, "{report}");
    assert!(counter(&report, "adaptive.wakeups") > 0, "{report}");
}

/// bar-adaptive from a device process: QEMU's client maps the doorbell page (or sends its
/// stores as messages), so the idle poller cannot have it trapped; it sleeps in timed steps
/// and looks at the page between them, or is woken by the message.
#[test]
fn linux_nvme_driver_against_iopath_nvme_bar_adaptive_ram() {
    let report = linux_against_iopath("nvme,doorbell=bar-adaptive,backend=ram,size_mb=64");
    assert!(counter(&report, "adaptive.sleeps") > 0, "{report}");
}

/// Two iopath controllers in one Linux guest (two `iopath serve nvme` processes, QEMU 11's
/// vfio-user-pci twice): each has an identity of its own, so Linux keeps them apart (two
/// subsystems, no "Duplicate cntlid ... rejecting") and fio verifies a write and its read-back on
/// both namespaces. One takes the identity options, the other draws its identity.
#[test]
fn linux_nvme_driver_against_two_iopath_controllers_in_one_guest() {
    let mut a = Serve::start("nvme,doorbell=bar,backend=ram,size_mb=64");
    let mut b = Serve::start("nvme,backend=ram,size_mb=64,serial=HARNESS-B,nqn=nqn.2014-08.org.example:two-b,cntlid=1");
    let (sa, sb) = (a.socket.to_str().unwrap().to_string(), b.socket.to_str().unwrap().to_string());
    let script = harness("guest-two-nvme.sh");
    let args = [
        "--vfio-user",
        sa.as_str(),
        "--vfio-user",
        sb.as_str(),
        "--nvme-timeout",
        "10",
        "--script",
        script.to_str().unwrap(),
    ];
    let (la, lb) = (a.stderr.clone(), b.stderr.clone());
    let log = move || format!("{}\n--- second ---\n{}", la.lock().unwrap().join("\n"), lb.lock().unwrap().join("\n"));
    let text = linux_with(&args, &log);
    let c = checks(&text);
    let passed = |name: &str| c.iter().any(|l| l.starts_with(&format!("@check {name} ok")));
    for want in ["two-probe", "two-subsystems", "no-rejected"] {
        assert!(passed(want), "check {want} did not pass:\n{}", c.join("\n"));
    }
    let fio: Vec<_> = c.iter().filter(|l| l.starts_with("@check fio-") && l.contains(" ok")).collect();
    assert_eq!(fio.len(), 4, "a verified write and read-back on each namespace:\n{}", c.join("\n"));
    assert!(c.iter().any(|l| l.contains("HARNESS-B")), "serial= reached the guest:\n{}", c.join("\n"));
    for (name, s) in [("first", &mut a), ("second", &mut b)] {
        let report = s.report();
        assert!(counter(&report, "io.commands") > 1000, "{name}: the driver's I/O did not reach it: {report}");
    }
}

/// One iopath controller with four namespaces in a Linux guest (issue 36's namespaces): a ram one
/// at 512 (namespace 1, the top-level options), a ram one at 4096, and two `file:` ones (512,
/// 4096) whose io_urings share the controller's one completion eventfd. Linux's `nvme list` shows
/// all four, `nvme list-ns` (active and `--all`) gives NSIDs 1-4, each has NGUID and UUID of its own
/// and the LBA size configured, fio verifies a write and its read-back on each, and `nvme format
/// --lbaf=1` turns namespace 1 into a 4096-byte one that fio verifies again. Namespace 2 has a
/// timing model of its own (`timing=read:500us` in its `ns=` SPEC): fio's QD1 reads there take at
/// least 500 us (total latency: submission and completion), the other namespaces' minimum is more
/// than 250 us below that, and the device's own counters say the same.
#[test]
fn linux_nvme_driver_sees_four_iopath_namespaces_with_two_lba_formats_and_formats_one() {
    const NS_TIMED_US: u64 = 500;
    let dir = std::env::temp_dir().join(format!("iopath-ns-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b) = (dir.join("ns3.img"), dir.join("ns4.img"));
    // Namespace 2 has a timing model of its own (500 us a read): fio sees it there only.
    let device = format!(
        "nvme,backend=ram,size_mb=64,ns=backend=ram;size_mb=64;lba=4096;timing=read:{NS_TIMED_US}us,\
         ns=backend=file:{};size_mb=64;lba=512;create=on,ns=backend=file:{};size_mb=64;lba=4096;create=on",
        a.display(),
        b.display()
    );
    let mut serve = Serve::start(&device);
    let sock = serve.socket.to_str().unwrap().to_string();
    let script = harness("guest-ns.sh");
    let append = format!(
        "harness.ns_count=4 harness.ns_lba=512,4096,512,4096 harness.ns_timed=2 harness.ns_timed_us={NS_TIMED_US}"
    );
    let args = [
        "--vfio-user",
        sock.as_str(),
        "--nvme-timeout",
        "10",
        "--script",
        script.to_str().unwrap(),
        "--append",
        append.as_str(),
    ];
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    let c = checks(&text);
    let passed = |name: &str| c.iter().any(|l| l.starts_with(&format!("@check {name} ok")));
    for want in
        ["ns-probe", "nvme-list", "list-ns", "list-ns--all", "ns-ids", "ns-lba", "ns-timing", "format", "no-timeout"]
    {
        assert!(passed(want), "check {want} did not pass:\n{}", c.join("\n"));
    }
    let fio: Vec<_> = c.iter().filter(|l| l.starts_with("@check fio-nvme") && l.contains(" ok")).collect();
    assert_eq!(fio.len(), 8, "a verified write and read-back on each of the four namespaces:\n{}", c.join("\n"));
    assert!(
        passed("fio-formatted-w") && passed("fio-formatted-r"),
        "fio on the formatted namespace:\n{}",
        c.join("\n")
    );
    let report = serve.report();
    assert_eq!(counter(&report, "namespaces"), 4, "{report}");
    assert!(counter(&report, "backend.direct-ops") > 0, "the file namespaces were served: {report}");
    // The device's own view: every timed completion (namespace 2's reads) at least its 500 us.
    assert!(counter(&report, "timing.posted") > 0, "{report}");
    assert!(counter(&report, "timing.device-p50-ns") >= NS_TIMED_US * 1000 * 98 / 100, "{report}");
    // The file namespaces hold fio's data: each file was written (not all zeros).
    for f in [&a, &b] {
        let data = std::fs::read(f).unwrap();
        assert_eq!(data.len(), 64 << 20);
        assert!(data.iter().any(|&x| x != 0), "{} holds the guest's writes", f.display());
    }
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The rules of guest-inject.sh given at start (`inject=`), 512 B LBAs: an unrecovered read
/// error with DNR on LBA 2048, always; the same without DNR on LBA 3072, once.
const INJECT_AT_START: &str = "op=read/lba=2048-2048/status=2:0x81:dnr+op=read/lba=3072-3072/status=2:0x81/once";
/// Its rules added through the control socket once the device runs: LBA 4096's read never
/// completed, once; LBA 8192's write not completed and the controller fatal, once.
const INJECT_AT_RUN_TIME: [&str; 2] = ["op=read/lba=4096-4096/drop/once", "op=write/lba=8192-8192/fatal/once"];

/// `iopath ctl SOCKET ARGS...`: its stdout, and it must succeed.
fn ctl(socket: &Path, args: &[&str]) -> String {
    // `iopath serve` binds its control socket after the device's (which Serve::start waits for).
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "iopath serve made no control socket at {}", socket.display());
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_iopath")).arg("ctl").arg(socket).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "iopath ctl {args:?}: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// Linux's nvme driver against errors iopath injects (guest-inject.sh), two rules given at start
/// and two added at run time through `iopath serve --control` (with the process confined by
/// seccomp, as it always is): an error with DNR reaches the reader on that LBA only (a media error:
/// Linux gives ENODATA, not EIO); one
/// without DNR is retried and the retry reads; a command never completed is timed out, aborted
/// and retried; controller fatal status makes the driver reset it; fio verify passes after all
/// that. The device's own counters (`iopath ctl stats`) say each rule fired once per attempt.
#[test]
fn linux_nvme_driver_reacts_to_injected_errors_timeouts_and_fatal_status() {
    kvm();
    let device = format!("nvme,backend=ram,size_mb=64,inject={INJECT_AT_START}");
    let mut serve = Serve::start_with(&device, "vfio-user", &["--control", "{dir}/ctl.sock"]);
    let control = serve.socket.parent().unwrap().join("ctl.sock");
    for r in INJECT_AT_RUN_TIME {
        assert!(ctl(&control, &["inject", r]).contains("\"ok\":true"));
    }
    let listed: serde_json::Value = serde_json::from_str(ctl(&control, &["list"]).trim()).unwrap();
    assert_eq!(listed["rules"].as_array().unwrap().len(), 4, "{listed}");
    let sock = serve.socket.to_str().unwrap().to_string();
    let script = harness("guest-inject.sh");
    let args = ["--vfio-user", sock.as_str(), "--nvme-timeout", "10", "--script", script.to_str().unwrap()];
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    let c = checks(&text);
    for want in ["probe", "eio", "retried", "aborted", "reset", "fio-after-w", "fio-after-r"] {
        assert!(
            c.iter().any(|l| l.starts_with(&format!("@check {want} ok"))),
            "{want} did not pass:\n{}",
            c.join("\n")
        );
    }
    let stats: serde_json::Value = serde_json::from_str(ctl(&control, &["stats"]).trim()).unwrap();
    let rule = |id: u64| stats["stats"]["rules"].as_array().unwrap().iter().find(|r| r["id"] == id).cloned().unwrap();
    // Rule 1 (DNR): the one read of LBA 2048, not retried.
    assert_eq!((rule(1)["matched"].as_u64(), rule(1)["fired"].as_u64()), (Some(1), Some(1)), "{stats}");
    // Rules 2-4 fire once; the driver's retry (after the error, the abort, the reset) matched again.
    for id in 2..=4 {
        let r = rule(id);
        assert_eq!(r["fired"], 1, "rule {id}: {stats}");
        assert!(r["matched"].as_u64() >= Some(2), "rule {id} saw no retry: {stats}");
    }
    assert!(counter(&serve.report(), "io.commands") > 1000, "fio's I/O reached the device");
}

/// A file backend (O_DIRECT through io_uring where the filesystem allows)
/// in `mode`, with the driver's transfers on guest pages in place as
/// `in_place` says: some of them go so (the report's counter).
/// Returns (O_DIRECT operations, of them in place).
fn linux_against_iopath_file(mode: &str, in_place: &str) -> (u64, u64) {
    linux_against_iopath_file_with(mode, in_place, &[])
}

/// The same with more `run-linux.sh` options (`--hugetlb`). `mode` may carry
/// more device options after the doorbell mode (`bar,submit_batch=1`).
fn linux_against_iopath_file_with(mode: &str, in_place: &str, more: &[&str]) -> (u64, u64) {
    let tag = mode.replace([',', '='], "-");
    let dir = std::env::temp_dir().join(format!("iopath-rc-file-{}-{tag}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("ns.img");
    let device =
        format!("nvme,doorbell={mode},backend=file:{},create=on,size_mb=64,in_place={in_place}", img.display());
    let report = linux_against_iopath_with(&device, more);
    let _ = std::fs::remove_dir_all(&dir);
    let count = |name: &str| -> u64 {
        let at = report.find(&format!("\"{name}\":")).unwrap_or_else(|| panic!("{name} not in {report}"));
        let digits = report[at + name.len() + 3..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>();
        digits.parse().unwrap()
    };
    let (direct, placed) = (count("backend.direct-ops"), count("backend.in-place-ops"));
    eprintln!("{device}: {placed} of {direct} O_DIRECT operations on the guest's pages in place");
    assert!(placed > 0 && placed <= direct, "{device}: {placed} of {direct} in place");
    (direct, placed)
}

#[test]
fn linux_nvme_driver_against_iopath_nvme_shm_file() {
    linux_against_iopath_file("shm", "on");
}

/// The Linux driver with QEMU 11's guest RAM in 2 MiB hugetlbfs pages (256 MiB: 128 pages of
/// this machine's pool, vm.nr_hugepages; CI grows it): QEMU shares that RAM in sections at
/// offsets inside a huge page, and the device process serves every DMA_MAP of them; with
/// `in_place=auto` the driver's aligned transfers of several pages go in place too.
#[test]
fn linux_nvme_driver_against_iopath_nvme_with_hugetlb_guest_ram() {
    let (direct, placed) = linux_against_iopath_file_with("adaptive", "auto", &["--hugetlb", "--mem", "256"]);
    assert_eq!(placed, direct, "in huge pages every aligned transfer goes in place");
}

#[test]
fn linux_nvme_driver_against_iopath_nvme_bar_file() {
    linux_against_iopath_file("bar", "auto");
}

/// Each operation to the kernel as the controller fetches it (`submit_batch=1`): the driver's
/// fio, mkfs and file checks pass as with a submit per queue pass.
#[test]
fn linux_nvme_driver_against_iopath_nvme_file_submitting_each_operation() {
    linux_against_iopath_file("adaptive,submit_batch=1", "auto");
}

/// Linux's discard reaches a `file:` disk as a hole, over vfio-user: the guest
/// (`guest-discard.sh`) runs blkdiscard on 4 MiB at 4 MiB of a 16 MiB image the host filled
/// with 'Z'; afterwards the image has 4 MiB fewer bytes allocated, reads as zeros there and
/// keeps every other byte. `device` names the image `IMG`.
fn linux_discard_on_a_file(device: &str) {
    use std::os::unix::fs::MetadataExt;
    const MIB: usize = 1 << 20;
    let dir = std::env::temp_dir().join(format!("iopath-rc-discard-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![b'Z'; 16 * MIB]).unwrap();
    let allocated = || std::fs::metadata(&img).unwrap().blocks() * 512;
    let before = allocated();
    let device = device.replace("IMG", img.to_str().unwrap());
    let mut serve = Serve::start(&device);
    let sock = serve.socket.to_str().unwrap().to_string();
    let script = harness("guest-discard.sh");
    let args = ["--vfio-user", sock.as_str(), "--nvme-timeout", "10", "--script", script.to_str().unwrap()];
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    for want in ["discard-probe", "discard-limits", "discard-before", "discard", "discard-after"] {
        assert!(
            checks(&text).iter().any(|l| l.starts_with(&format!("@check {want} ok"))),
            "{device}: check {want} did not pass:\n{}",
            checks(&text).join("\n")
        );
    }
    let report = serve.report();
    let after = allocated();
    let data = std::fs::read(&img).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{device}: {before} bytes allocated before, {after} after the guest's discard");
    assert!(after <= before - 4 * MIB as u64, "{device}: no hole: {before} -> {after}; {report}");
    assert_eq!(data.len(), 16 * MIB, "{device}: the image keeps its size");
    let first = |r: std::ops::Range<usize>, want: u8| r.clone().find(|&i| data[i] != want);
    assert_eq!(first(4 * MIB..8 * MIB, 0), None, "{device}: the discarded range reads as zeros");
    assert_eq!(first(0..4 * MIB, b'Z'), None, "{device}: before the range, as written");
    assert_eq!(first(8 * MIB..16 * MIB, b'Z'), None, "{device}: after the range, as written");
}

#[test]
fn linux_blkdiscard_punches_a_hole_in_an_iopath_nvme_file_namespace() {
    linux_discard_on_a_file("nvme,backend=file:IMG,size_mb=16");
}

#[test]
fn linux_blkdiscard_punches_a_hole_in_an_iopath_virtio_blk_file_disk() {
    linux_discard_on_a_file("virtio-blk,backend=file:IMG,size_mb=16,notify=poll");
}

/// iopath's own guest image under QEMU 11 + KVM, with `vfio-user-pci` to `iopath serve`.
fn image_under_qemu11(device: &str, append: &str) -> (String, String) {
    image_under_qemu11_env(device, append, &[])
}

/// The same with `env` for run-image.sh (its guest RAM options).
fn image_under_qemu11_env(device: &str, append: &str, env: &[(&str, &str)]) -> (String, String) {
    kvm();
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut serve = Serve::start(device);
    let img = serve.socket.parent().unwrap().join("guest.elf");
    iopath_guest::write_image(&img).unwrap();
    let out = Command::new("bash")
        .arg(harness("run-image.sh"))
        .args([img.to_str().unwrap(), serve.socket.to_str().unwrap(), append, "180"])
        .envs(env.iter().copied())
        .output()
        .expect("run run-image.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let rc = out.status.code().unwrap_or(-1);
    assert_eq!(rc, 0, "{device}: guest under QEMU 11 failed (rc {rc}):\n{text}");
    let report = serve.report();
    (text, report)
}

fn counter(report: &str, name: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(report).unwrap_or_default();
    v["counters"][name].as_u64().unwrap_or_else(|| panic!("no counter {name} in {report}"))
}

#[test]
fn qemu11_guest_ram_in_hugetlb_pages_lets_multi_page_transfers_go_in_place() {
    // QEMU's memory-backend-memfd,hugetlb=on: the server knows the DMA_MAP fd is hugetlbfs,
    // so in_place=auto puts 64 KiB transfers on the guest's pages; from a tmpfs memfd they
    // bounce unless the host's shmem settings grant huge pages. 32 MiB: 16 pages of this
    // machine's pool (vm.nr_hugepages).
    let memfd_huge = iopath_vmm::memory::create(2 << 20, iopath_vmm::RamKind::Memfd).unwrap().huge;
    for (hugetlb, huge) in [("1", true), ("0", memfd_huge)] {
        let dir = std::env::temp_dir().join(format!("iopath-rc-hugetlb-{}-{hugetlb}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dev = format!(
            "nvme,doorbell=adaptive,backend=file:{},create=on,size_mb=8,in_place=auto",
            dir.join("ns.img").display()
        );
        let env = [("IOPATH_RUN_IMAGE_MEM", "32"), ("IOPATH_RUN_IMAGE_HUGETLB", hugetlb)];
        let (text, report) =
            image_under_qemu11_env(&dev, "workload=nvme verify=1 bs=65536 iodepth=8 size_mb=4 irq=1", &env);
        let _ = std::fs::remove_dir_all(&dir);
        let rec = iopath_bench::record::find_record(&text.lines().collect::<Vec<_>>(), "nvme")
            .unwrap_or_else(|| panic!("hugetlb={hugetlb}: no @nvme record:\n{text}"));
        assert_eq!((rec["errors"].as_str(), rec["mismatches"].as_str()), ("0", "0"), "hugetlb={hugetlb}: {rec:?}");
        let (direct, placed) = (counter(&report, "backend.direct-ops"), counter(&report, "backend.in-place-ops"));
        eprintln!("QEMU hugetlb={hugetlb}: {placed} of {direct} 64 KiB O_DIRECT operations in place");
        assert!(direct >= 128, "hugetlb={hugetlb}: {report}");
        assert_eq!(placed, if huge { direct } else { 0 }, "hugetlb={hugetlb}: {report}");
    }
}

#[test]
fn qemu11_vfio_user_pci_drives_iopath_pci_testdev() {
    let (text, report) = image_under_qemu11("pci-testdev", "batches=3 batch_us=2000 only=mmio-no,portio-no,mmio-read");
    let out = iopath_bench::record::GuestOutput::parse(&text.lines().collect::<Vec<_>>());
    let row = out.row("mmio-no-eventfd:pci-mem").unwrap_or_else(|| panic!("no mmio row:\n{text}"));
    // Every write went through QEMU's vfio-user client to the device process: its counter says so.
    assert_eq!(counter(&report, "mmio-no-eventfd.exits"), row.accesses, "{report}");
    let pio = out.row("portio-no-eventfd:pci-io").unwrap();
    assert_eq!(counter(&report, "portio-no-eventfd.exits"), pio.accesses, "{report}");
}

#[test]
fn qemu11_vfio_user_pci_drives_iopath_nvme_in_every_doorbell_mode() {
    for db in ["auto", "bar", "shm", "ioeventfd", "mmio", "adaptive", "bar-adaptive"] {
        let dev = format!("nvme,doorbell={db},backend=ram,size_mb=16");
        let (text, report) = image_under_qemu11(&dev, "workload=nvme verify=1 bs=4096 iodepth=8 size_mb=8 irq=1");
        let rec = iopath_bench::record::find_record(&text.lines().collect::<Vec<_>>(), "nvme")
            .unwrap_or_else(|| panic!("{db}: no @nvme record:\n{text}"));
        assert_eq!(rec.get("mismatches").map(String::as_str), Some("0"), "{db}: {rec:?}");
        let ios: u64 = rec["ios"].parse().unwrap();
        assert!(ios > 0, "{db}: {rec:?}");
        assert_eq!(counter(&report, "io.commands"), ios, "{db}: every guest I/O is a controller command: {report}");
        assert!(counter(&report, "msix.interrupts") > 0, "{db}: irq=1 but no MSI-X signalled: {report}");
        // And a timed run: randread at queue depth 8 for half a second.
        let (text, report) = image_under_qemu11(&dev, "workload=nvme rw=randread bs=4096 iodepth=8 time_ms=500 irq=1");
        let rec = iopath_bench::record::find_record(&text.lines().collect::<Vec<_>>(), "nvme")
            .unwrap_or_else(|| panic!("{db}: no @nvme record of the timed run:\n{text}"));
        let ios: u64 = rec["ios"].parse().unwrap();
        assert!(ios > 0, "{db}: {rec:?}");
        assert_eq!(counter(&report, "io.commands"), ios, "{db}: timed run: {report}");
        assert!(counter(&report, "msix.interrupts") > 0, "{db}: timed run, irq=1: {report}");
        eprintln!("{db}: QEMU 11 + KVM, nvmeperf randread 4k qd8 0.5 s: {ios} I/Os, {rec:?}");
    }
}

/// `@fio job=... iops=...` records of a run, by job.
fn fio_records(text: &str) -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>> {
    text.lines()
        .filter(|l| l.starts_with("@fio "))
        .map(iopath_bench::record::fields)
        .filter_map(|f| Some((f.get("job")?.clone(), f)))
        .collect()
}

/// The same Linux guest and fio jobs against QEMU's nvme and iopath's, one after the other in one
/// test. Under TCG this is a functional comparison (both sides run on an emulated CPU), not a
/// performance claim; the table is printed for the record.
#[test]
fn linux_fio_figures_iopath_nvme_vs_qemu_nvme_under_tcg() {
    let fio = harness("guest-fio.sh");
    let fio = fio.to_str().unwrap();
    let common = ["--script", fio, "--append", "harness.fio_time=3", "--nvme-timeout", "10"];
    let qemu = fio_records(&linux(&[&["--device", "qemu-nvme"][..], &common[..]].concat()));
    let serve = Serve::start("nvme,doorbell=bar,backend=ram,size_mb=64");
    let sock = serve.socket.to_str().unwrap().to_string();
    let iopath = fio_records(&linux(&[&["--vfio-user", sock.as_str()][..], &common[..]].concat()));
    eprintln!("Linux 6.12 fio under QEMU 11 TCG (functional comparison, emulated CPU):");
    eprintln!("{:<20} {:>12} {:>12} {:>8}", "job", "qemu-nvme", "iopath-bar", "ratio");
    for (job, q) in &qemu {
        let i = iopath.get(job).unwrap_or_else(|| panic!("iopath ran no {job}: {iopath:?}"));
        let iops = |r: &std::collections::BTreeMap<String, String>| r["iops"].parse::<f64>().unwrap();
        assert!(iops(q) > 0.0 && iops(i) > 0.0, "{job}: {q:?} {i:?}");
        eprintln!("{job:<20} {:>12.0} {:>12.0} {:>7.2}x", iops(q), iops(i), iops(i) / iops(q));
    }
    assert_eq!(qemu.len(), 4, "{qemu:?}");
}

/// Waits (bounded) until rule `id` of the control socket's set has matched a command, the
/// guest's cue (`guest-attach.sh`); false if `stop` is set or the bound passed first.
fn cued(control: &Path, id: u64, stop: &std::sync::atomic::AtomicBool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(1200) && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let stats: serde_json::Value = serde_json::from_str(ctl(control, &["stats"]).trim()).unwrap();
        let rules = stats["stats"]["rules"].as_array().cloned().unwrap_or_default();
        if rules.iter().any(|r| r["id"] == id && r["matched"].as_u64() >= Some(1)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// `iopath ctl detach|attach` while Linux runs: the driver gets the Namespace Attribute Changed
/// AER, reads the Changed Namespace List and rescans, so the block device goes and comes back
/// with its data; namespace 1 works on meanwhile.
#[test]
fn linux_nvme_driver_rescans_when_a_namespace_is_detached_and_attached_through_the_control_socket() {
    kvm();
    let serve =
        Serve::start_with("nvme,backend=ram,size_mb=64,namespaces=2", "vfio-user", &["--control", "{dir}/ctl.sock"]);
    let control = serve.socket.parent().unwrap().join("ctl.sock");
    // The guest's cues (a harmless 1 us delay each: only their match counters matter).
    for r in ["nsid=2/op=read/lba=99991-99991/delay=1us", "nsid=1/op=read/lba=99992-99992/delay=1us"] {
        assert!(ctl(&control, &["inject", r]).contains("\"ok\":true"));
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let host = {
        let (control, stop) = (control.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut said = Vec::new();
            for (id, cmd) in [(1, "detach"), (2, "attach")] {
                if !cued(&control, id, &stop) {
                    break;
                }
                said.push(serde_json::from_str::<serde_json::Value>(ctl(&control, &[cmd, "2"]).trim()).unwrap());
            }
            said
        })
    };
    let sock = serve.socket.to_str().unwrap().to_string();
    let script = harness("guest-attach.sh");
    let log = serve.stderr.clone();
    let text = linux_with(&["--vfio-user", sock.as_str(), "--script", script.to_str().unwrap()], &|| {
        log.lock().unwrap().join("\n")
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let said = host.join().unwrap();
    let changed = serde_json::json!({"ok": true, "nsid": 2, "changed": true});
    assert_eq!(said, [changed.clone(), changed], "the host's detach and attach");
    let c = checks(&text);
    for want in ["probe", "detach", "ns1-during", "attach", "kept"] {
        assert!(
            c.iter().any(|l| l.starts_with(&format!("@check {want} ok"))),
            "{want} did not pass:\n{}",
            c.join("\n")
        );
    }
}

/// An `iopath serve` on a given socket, which it may replace (a killed one's is stale); its
/// stderr kept. Started again on the same socket after a `kill -9`.
struct Backend {
    child: Child,
    stderr: std::sync::Arc<Mutex<Vec<String>>>,
}

impl Backend {
    /// Starts `iopath serve DEVICE --transport vhost-user --socket SOCK`; returns once it listens.
    fn start(device: &str, sock: &Path) -> Backend {
        let mut child = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["serve", device, "--transport", "vhost-user", "--socket"])
            .arg(sock)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start iopath serve");
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = keep_stderr(&mut child, Some(tx));
        if rx.recv_timeout(Duration::from_secs(20)).is_err() {
            let _ = child.kill();
            panic!("iopath serve did not listen on {}: {:?}", sock.display(), stderr.lock().unwrap());
        }
        Backend { child, stderr }
    }

    /// The requests it resubmitted from the in-flight region, by its log lines.
    fn resubmitted(&self) -> u64 {
        resubmitted(&self.stderr.lock().unwrap())
    }

    /// True if one of its threads is blocked on the disk: in io_uring_enter (the `file:`
    /// backend's O_DIRECT ring, waited on for a request's operation; a ring thread idles in
    /// poll, never there), or in the buffered fd's pread64, pwrite64, preadv, pwritev,
    /// fdatasync. A SIGKILL now lands with that request taken and not completed (the thread
    /// dies on its way out of the system call). A thread on a CPU reads "running", so a
    /// call that never blocks is not seen.
    fn in_io(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.child.id())) else { return false };
        tasks.filter_map(Result::ok).any(|t| {
            let s = std::fs::read_to_string(t.path().join("syscall")).unwrap_or_default();
            matches!(s.split(' ').next(), Some("17" | "18" | "75" | "295" | "296" | "327" | "328" | "426"))
        })
    }

    /// SIGKILL, and reaped; its stderr (still being drained) for the end of the test. Waits up
    /// to `aim` for a moment when it is inside a disk read or write (true if it found one).
    fn kill9(mut self, aim: Duration) -> (std::sync::Arc<Mutex<Vec<String>>>, bool) {
        let t0 = Instant::now();
        let mut hit = false;
        while t0.elapsed() < aim && !hit {
            hit = self.in_io();
        }
        let _ = self.child.kill(); // std's kill is SIGKILL
        let _ = self.child.wait();
        (self.stderr.clone(), hit)
    }
}

/// The requests a backend's log lines say it resubmitted from the in-flight region.
fn resubmitted(stderr: &[String]) -> u64 {
    stderr.iter().filter_map(|l| l.split("resubmitting ").nth(1)?.split(' ').next()?.parse::<u64>().ok()).sum()
}

impl Drop for Backend {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 37: QEMU 11's `vhost-user-blk-pci` on a chardev with `reconnect-ms=1000`, iopath's
/// vhost-user-blk on a `file:` disk, and a Linux guest running fio write+verify rounds while
/// the test kills the backend with SIGKILL every 2 s and starts it again on the same socket.
/// Every round (each spanning kills: its writes acknowledged before one are read back after)
/// ends err=0 with no verify mismatch, and the guest logs no I/O error. The backend negotiates
/// in-flight tracking: some restarted backend resubmitted requests the killed one had taken
/// (its log line; the last one's count also in its report's `inflight_resubmits`).
#[test]
fn linux_fio_verify_survives_kill_9_of_the_vhost_user_blk_backend() {
    const KILLS: usize = 12;
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("iopath-rc-kill-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("disk.img");
    std::fs::write(&img, vec![0u8; 64 << 20]).unwrap();
    let (sock, log) = (dir.join("vu.sock"), dir.join("console.log"));
    let device = format!("virtio-blk,backend=file:{},size_mb=64,queues=1", img.display());
    let mut backend = Backend::start(&device, &sock);
    let mut run = Command::new("bash")
        .arg(harness("run-linux.sh"))
        .args(["--timeout", "600", "--vhost-user", sock.to_str().unwrap(), "--vhost-reconnect", "1000"])
        .args(["--script", harness("guest-vblk-kill.sh").to_str().unwrap()])
        .args(["--log", log.to_str().unwrap(), "--append", "harness.fio_mb=4 harness.kill_secs=60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run-linux.sh");
    let out = read_all(Box::new(run.stdout.take().unwrap()));
    let err = read_all(Box::new(run.stderr.take().unwrap()));
    let t0 = Instant::now();
    let console = || std::fs::read_to_string(&log).unwrap_or_default();
    while !console().contains("@fio-start") {
        if t0.elapsed() > Duration::from_secs(400) || run.try_wait().unwrap().is_some() {
            let _ = run.kill();
            panic!("the guest never started fio:\n{}\n{:?}", console(), backend.stderr.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Every 2 s a kill, aimed (for at most 1.5 s of them) at a moment the backend is inside
    // a disk read or write: it spends microseconds of each request there, so a kill at a
    // random moment almost never finds a request in flight (CI once saw 0 of 12 resubmit
    // with a 0.5 s aim that did not count io_uring_enter).
    let (mut killed, mut aimed) = (Vec::new(), 0);
    for _ in 0..KILLS {
        std::thread::sleep(Duration::from_millis(500));
        let (stderr, hit) = backend.kill9(Duration::from_millis(1500));
        killed.push(stderr);
        aimed += hit as usize;
        backend = Backend::start(&device, &sock);
    }
    let rc = run.wait().unwrap();
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let report = backend.report_on_exit();
    let last = backend.resubmitted();
    let mut resubmitted: Vec<u64> = killed.iter().map(|e| resubmitted(&e.lock().unwrap())).collect();
    resubmitted.push(last);
    let c = checks(&text);
    eprintln!(
        "{}\n{KILLS} kills, {aimed} inside a disk read or write; resubmitted per backend: {resubmitted:?}\n\
         last report: {report}",
        c.join("\n")
    );
    assert!(c.iter().any(|l| l.starts_with("@done ")), "no @done ({rc}):\n{text}");
    assert!(rc.success(), "guest checks failed ({rc}):\n{}\n{text}", c.join("\n"));
    let rounds = c.iter().filter(|l| l.starts_with("@check fio-round-")).count();
    assert!(rounds >= 2, "{rounds} fio rounds:\n{}", c.join("\n"));
    assert!(c.iter().all(|l| !l.contains(" fail ")), "{}", c.join("\n"));
    assert!(c.iter().any(|l| l.starts_with("@check no-errors ok")), "{}", c.join("\n"));
    assert!(resubmitted.iter().sum::<u64>() > 0, "no backend resubmitted anything: {resubmitted:?}");
    assert_eq!(counter(&report, "inflight_resubmits"), last, "the last backend's count: {report}");
    assert!(counter(&report, "inflight_regions") >= 1, "QEMU set no in-flight region: {report}");
    for bad in ["errors", "ring_errors", "refused"] {
        assert_eq!(counter(&report, bad), 0, "{bad}: {report}");
    }
    drop(backend);
    let _ = std::fs::remove_dir_all(&dir);
}

impl Backend {
    /// The report line the last backend prints when QEMU (gone with its guest) leaves.
    fn report_on_exit(&mut self) -> String {
        disconnect_report(&mut self.child)
    }
}

/// Linux's nvme driver against namespaces with metadata (guest-pi.sh): namespace 1 (512 + 8
/// bytes, separate metadata, PI type 1) gets an integrity profile (T10-DIF-TYPE1-CRC), so Linux's
/// block layer generates the PI of each write and verifies it on each read while the device
/// checks it too (its `pi.checks` counter, no `pi.errors`); namespace 2 (extended LBAs, PI) is
/// served with PRACT (the device inserts and strips the PI); namespace 4 (4096 + 16, PI last) is
/// formatted by `nvme format` to PI first (Linux 6.12 puts the tuple there whatever DPS says);
/// fio verify passes on all three. What Linux makes of namespace 3 (extended, no PI) is printed.
#[test]
fn linux_nvme_driver_generates_and_verifies_protection_information_on_iopath_namespaces() {
    let device = "nvme,backend=ram,size_mb=64,lba=512,ms=8,pi=1,ns=backend=ram;size_mb=64;lba=512;ms=8;ext=on;pi=1,\
                  ns=backend=ram;size_mb=64;lba=4096;ms=16;ext=on,ns=backend=ram;size_mb=64;lba=4096;ms=16;pi=1";
    let mut serve = Serve::start(device);
    let sock = serve.socket.to_str().unwrap().to_string();
    let script = harness("guest-pi.sh");
    let args = ["--vfio-user", sock.as_str(), "--nvme-timeout", "10", "--script", script.to_str().unwrap()];
    let log = serve.stderr.clone();
    let text = linux_with(&args, &|| log.lock().unwrap().join("\n"));
    let c = checks(&text);
    let passed = |name: &str| c.iter().any(|l| l.starts_with(&format!("@check {name} ok")));
    let want = ["pi-probe", "pi-id-ns", "pi-integrity", "fio-pi1-w", "fio-pi1-r", "fio-pi2-w", "fio-pi2-r"];
    for want in want.into_iter().chain(["pi-format", "fio-pi4-w", "fio-pi4-r", "no-timeout"]) {
        assert!(passed(want), "check {want} did not pass:\n{}", c.join("\n"));
    }
    for l in c.iter().filter(|l| l.starts_with("@check pi-ext-nopi")) {
        eprintln!("recorded: {l}");
    }
    let report = serve.report();
    assert!(counter(&report, "pi.checks") > 0, "the device checked PI tuples: {report}");
    assert_eq!(counter(&report, "pi.errors"), 0, "{report}");
}

/// Issue 37, item 4: QEMU 11's vfio-user-pci does not reconnect, so when an `iopath serve`
/// behind it is killed (SIGKILL) the failure must be clean: the guest's I/O on that controller
/// fails with an error within the driver's timeout instead of hanging, Linux gives the controller
/// up, the guest's other controller (another `iopath serve`) keeps its data and its I/O, the guest
/// powers off and QEMU exits on its own. What QEMU and Linux say about the death is printed.
#[test]
fn qemu11_vfio_user_pci_fails_cleanly_when_its_iopath_device_process_is_killed() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut gone = Serve::start("nvme,backend=ram,size_mb=16,serial=HARNESS-GONE,cntlid=1");
    let mut stays = Serve::start("nvme,backend=ram,size_mb=16,serial=HARNESS-STAYS,cntlid=2");
    let dir = std::env::temp_dir().join(format!("iopath-rc-gone-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("console.log");
    let (sg, ss) = (gone.socket.to_str().unwrap().to_string(), stays.socket.to_str().unwrap().to_string());
    let mut run = Command::new("bash")
        .arg(harness("run-linux.sh"))
        .args(["--timeout", "420", "--vfio-user", &sg, "--vfio-user", &ss, "--nvme-timeout", "5"])
        .args(["--script", harness("guest-gone.sh").to_str().unwrap()])
        .args(["--log", log.to_str().unwrap(), "--append", "harness.fio_mb=4"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run-linux.sh");
    let out = read_all(Box::new(run.stdout.take().unwrap()));
    let err = read_all(Box::new(run.stderr.take().unwrap()));
    let console = || std::fs::read_to_string(&log).unwrap_or_default();
    let t0 = Instant::now();
    while !console().contains("@gone-cue") {
        if t0.elapsed() > Duration::from_secs(380) || run.try_wait().unwrap().is_some() {
            let _ = run.kill();
            panic!("the guest never gave the cue:\n{}", console());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(500));
    gone.child.kill().unwrap(); // SIGKILL
    let status = gone.child.wait().unwrap();
    let rc = run.wait().unwrap();
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let c = checks(&text);
    let qemu = text.lines().filter(|l| l.contains("qemu|") && l.contains("vfio")).take(4);
    let said: Vec<&str> = qemu.chain(text.lines().filter(|l| l.contains("[dmesg]")).take(12)).collect();
    eprintln!("{}\nthe killed device process: {status:?}\nQEMU and Linux said:\n{}", c.join("\n"), said.join("\n"));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9), "{status:?}");
    assert!(c.iter().any(|l| l.starts_with("@done ")), "no @done, the guest did not power off ({rc}):\n{text}");
    assert!(rc.success(), "guest checks failed or QEMU did not exit cleanly ({rc}):\n{}\n{text}", c.join("\n"));
    for want in ["two-probe", "gone-eio", "gone-given-up", "stays-fio"] {
        assert!(c.iter().any(|l| l.starts_with(&format!("@check {want} ok"))), "{want}:\n{}", c.join("\n"));
    }
    let report = stays.report();
    assert!(counter(&report, "io.commands") > 1000, "the surviving controller's I/O did not reach it: {report}");
    let _ = std::fs::remove_dir_all(&dir);
}
