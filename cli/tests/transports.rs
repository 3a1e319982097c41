//! Device processes end to end on the real /dev/kvm: pci-testdev served by
//! `iopath serve` over each transport, QEMU interop in both directions for
//! mpqemu, a device process that outlives its VMM, and one that dies.

mod common;
use common::{kvm, programs};

use iopath_bench::exits::{verify_iopath, verify_qemu};
use iopath_bench::record::GuestOutput;
use iopath_protocols::attach::{instantiate, DeviceSpec};
use iopath_protocols::function_transports;
use iopath_vmm::{run, VmConfig};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SYNC_ROWS: &str = "mmio-no-eventfd,portio-no-eventfd,mmio-read,portio-read";

fn vm(spec: &str, only: &str) -> VmConfig {
    let spec: DeviceSpec = spec.parse().unwrap();
    let cmd = format!("workload=exits batches=3 batch_us=2000 only={only}");
    let mut cfg = VmConfig::new(iopath_guest::IMAGE, &cmd);
    cfg.devices = vec![instantiate(&spec, &programs()).unwrap()];
    cfg.timeout = Duration::from_secs(120);
    cfg
}

fn counter(r: &iopath_vmm::vm::RunReport, name: &str) -> u64 {
    r.devices[0].counters.iter().find(|c| c.name == name).map(|c| c.value).unwrap_or(0)
}

#[test]
fn every_transport_serves_pci_testdev_from_a_device_process() {
    kvm();
    // Every one of the registry: a transport named on the command line is checked here as it is.
    assert!(function_transports().count() >= 4);
    for transport in function_transports() {
        let (t, (msgs, _)) = (transport.name(), transport.crossings());
        // The eventfd rows, over a transport that announces the ioeventfds the device registers.
        let extra = if transport.announces_ioeventfds() {
            ",mmio-wildcard,mmio-datamatch,portio-wildcard,portio-datamatch"
        } else {
            ""
        };
        let r = run(vm(&format!("pci-testdev@{t}"), &format!("{SYNC_ROWS}{extra}"))).unwrap();
        assert_eq!(r.status, 1, "{t}: {:?}", r.lines);
        let out = GuestOutput::parse(&r.lines);
        let want = if extra.is_empty() { 4 } else { 8 };
        assert_eq!(out.rows.len(), want, "{t}: {:?}", out.rows.iter().map(|r| &r.name).collect::<Vec<_>>());
        for (row, v) in verify_iopath(&out, &r) {
            assert!(v.ok, "{t}: {row}: {}", v.detail);
        }
        // The counters came from the device process, and the accesses crossed the transport.
        let writes = out.row("mmio-no-eventfd:pci-mem").unwrap().accesses;
        assert_eq!(counter(&r, "mmio-no-eventfd.exits"), writes, "{t}");
        let crossing: u64 = out
            .rows
            .iter()
            .filter(|x| !x.name.contains("-eventfd:") || x.name.contains("no-"))
            .map(|x| x.accesses)
            .sum();
        assert!(counter(&r, msgs) >= crossing, "{t}: {msgs}={} < {crossing}", counter(&r, msgs));
        assert_eq!(r.exits.unclaimed_mmio_write, 0, "{t}");
    }
}

fn serve_on(path: &std::path::Path, transport: &str) -> std::process::Child {
    let _ = std::fs::remove_file(path);
    let child = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "pci-testdev", "--transport", transport, "--socket"])
        .arg(path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "iopath serve did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_device_process_outlives_its_vmm_and_serves_the_next() {
    kvm();
    let dir = common::TempDir::new("transports");
    let sock = dir.join("td.sock");
    let mut serve = serve_on(&sock, "vfio-user");
    let spec = format!("pci-testdev@vfio-user:{}", sock.display());
    for _ in 0..2 {
        let r = run(vm(&spec, "mmio-no-eventfd")).unwrap();
        assert_eq!(r.status, 1);
        let out = GuestOutput::parse(&r.lines);
        assert_eq!(out.rows.len(), 1);
        assert_eq!(out.rows[0].get_u64("count"), Some(out.rows[0].accesses));
    }
    // One counter report per client, the exits adding up across them.
    let mut lines = BufReader::new(serve.stdout.take().unwrap()).lines();
    let a = lines.next().unwrap().unwrap();
    let b = lines.next().unwrap().unwrap();
    assert!(a.contains("\"event\":\"disconnected\"") && b.contains("mmio-no-eventfd.exits"), "{a}\n{b}");
    assert!(serve.try_wait().unwrap().is_none(), "still serving");
    serve.kill().unwrap();
    serve.wait().unwrap();
}

#[test]
fn a_device_process_that_dies_stops_the_run_within_a_second() {
    kvm();
    let dir = common::TempDir::new("transports");
    let sock = dir.join("td.sock");
    let mut serve = serve_on(&sock, "mpqemu");
    // A long run of writes through the device process.
    let spec = format!("pci-testdev@mpqemu:{}", sock.display());
    let cfg = {
        let mut c = vm(&spec, "mmio-no-eventfd");
        c.cmdline = "workload=exits batches=50 batch_us=200000 only=mmio-no-eventfd".into();
        c
    };
    let h = std::thread::spawn(move || run(cfg));
    std::thread::sleep(Duration::from_millis(1500));
    serve.kill().unwrap();
    let killed = Instant::now();
    serve.wait().unwrap();
    let r = h.join().unwrap();
    let took = killed.elapsed();
    let e = r.err().expect("the run must fail").to_string();
    assert!(e.contains("pci-testdev"), "{e}");
    assert!(took < Duration::from_secs(1), "stopped {took:?} after the device process died");
}

#[test]
fn qemu_x_remote_serves_its_pci_testdev_to_iopath_over_mpqemu() {
    kvm();
    programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let r = run(vm("pci-testdev@mpqemu:qemu", SYNC_ROWS)).unwrap();
    assert_eq!(r.status, 1, "{:?}", r.lines);
    let out = GuestOutput::parse(&r.lines);
    let counters: Vec<String> = r.devices[0].counters.iter().map(|c| c.to_string()).collect();
    assert_eq!(out.rows.len(), 4, "guest output {:?}; proxy {counters:?}", r.lines);
    for (row, v) in verify_qemu(&out) {
        assert!(v.ok, "{row}: {}", v.detail);
    }
    let w = out.row("portio-no-eventfd:pci-io").unwrap();
    assert_eq!(w.get_u64("count"), Some(w.accesses), "QEMU's device counted every write");
    assert!(counter(&r, "mpqemu.requests") >= w.accesses);
}

/// QEMU's x-remote serves its socket from machine creation on and resets
/// the machine only after that: configuration written before the reset is
/// lost (a BAR sized 0). `spawn_qemu` returns after QEMU runs; configuration
/// written then must stay, so two messages queued at once and a read made
/// later agree.
#[test]
fn qemu_x_remote_keeps_configuration_written_once_it_is_ready() {
    use iopath_protocols::mpqemu::wire::{recv_reply, send, Msg};
    kvm();
    let qemu = programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let (mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let cmd = iopath_protocols::attach::qemu_remote(&qemu, "pci-testdev");
    let _qemu = iopath_protocols::process::DeviceProcess::spawn_qemu(cmd, theirs.into(), Duration::from_secs(30))
        .expect("QEMU's x-remote runs");
    let ret = |sock: &std::os::unix::net::UnixStream| match recv_reply(sock).unwrap() {
        Some((Msg::Ret(v), _)) => v as u32,
        other => panic!("RET expected, got {other:?}"),
    };
    // BAR1, pci-testdev's I/O BAR: write all ones, read the size mask back.
    send(&mine, &Msg::CfgWrite { addr: 0x14, val: 0xffff_ffff, len: 4 }, &[], "write").unwrap();
    send(&mine, &Msg::CfgRead { addr: 0x14, len: 4 }, &[], "read").unwrap();
    ret(&mine);
    let mask = ret(&mine);
    assert_eq!(mask & 1, 1, "an I/O BAR: {mask:#x}");
    assert_ne!(mask & !3 & 0xffff, 0, "a sized BAR: {mask:#x}");
    std::thread::sleep(Duration::from_millis(300));
    send(&mine, &Msg::CfgRead { addr: 0x14, len: 4 }, &[], "read").unwrap();
    assert_eq!(ret(&mine), mask, "QEMU reset the device after it reported running");
}

#[test]
fn qemu_x_pci_proxy_dev_drives_iopath_serve_over_mpqemu() {
    kvm();
    let qemu = programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let (theirs, ours) = std::os::unix::net::UnixStream::pair().unwrap();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_iopath"));
    serve.args(["serve", "pci-testdev", "--transport", "mpqemu", "--fd", "3"]);
    let ours: std::os::fd::OwnedFd = ours.into();
    iopath_protocols::process::inherit_as_fd3(&mut serve, &ours);
    let mut serve = serve.stdout(Stdio::piped()).spawn().unwrap();
    drop(ours);
    let image = iopath_guest::image_file().unwrap();
    let cmdline = format!("workload=exits batches=3 batch_us=2000 only={SYNC_ROWS}");
    let mut args = iopath_bench::qemu::args(&image, &cmdline, &["x-pci-proxy-dev,id=td0,fd=3"]);
    args.splice(0..0, iopath_bench::qemu::memfd_ram_args());
    let q = iopath_bench::qemu::run_args(&qemu, args, Some(theirs.into()), Duration::from_secs(120), |_| {}).unwrap();
    assert_eq!(q.status, Some(1), "QEMU: {}\n{:?}", q.stderr, q.lines);
    let out = GuestOutput::parse(&q.lines);
    assert_eq!(out.rows.len(), 4, "{:?}", q.lines);
    for (row, v) in verify_qemu(&out) {
        assert!(v.ok, "{row}: {}", v.detail);
    }
    // iopath serve reports its own counters when QEMU goes away.
    let mut line = String::new();
    BufReader::new(serve.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let c = iopath_protocols::process::parse_report(&line).expect("a counter report");
    let get = |n: &str| c.iter().find(|c| c.name == n).map(|c| c.value);
    let w = out.row("mmio-no-eventfd:pci-mem").unwrap().accesses;
    assert_eq!(get("mmio-no-eventfd.exits"), Some(w), "{line}");
    let reads = get("portio.data-reads").unwrap();
    assert!(reads >= out.row("portio-read:pci-io").unwrap().accesses);
    assert!(serve.wait().unwrap().success());
}
