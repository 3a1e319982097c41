//! virtio-blk in the VMM, end to end on the real /dev/kvm: the guest's PCI
//! scan finds the function and its BAR (the guest driver comes separately).

use std::process::Command;

#[test]
fn the_guest_finds_virtio_blk_with_its_bar_placed() {
    for spec in ["virtio-blk,backend=ram", "virtio-blk,backend=null,notify=ioeventfd", "virtio-blk,notify=poll"] {
        let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["run", "--device", spec, "--append", "batches=1 batch_us=200 only=cpuid"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{spec}: {}", String::from_utf8_lossy(&out.stderr));
        let line = stdout.lines().find(|l| l.starts_with("@pci") && l.contains("id=1af4:1042"));
        let line = line.unwrap_or_else(|| panic!("{spec}: no virtio-blk in the guest's scan:\n{stdout}"));
        assert!(line.contains("class=010000") && line.contains("bar0=mem64:0x") && line.ends_with(":32768"), "{line}");
        assert!(stdout.contains("@done rc=0"), "{stdout}");
    }
}

/// A guest run of `workload=vblk` against iopath's virtio-blk: its `@vblk`
/// record and the device's counters (printed by `iopath run` on stderr).
fn vblk(spec: &str, args: &str) -> (std::collections::BTreeMap<String, u64>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["run", "--workload", "vblk", "--device", spec, "--append", args, "--timeout", "60"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{spec} {args}: {stderr}\n{stdout}");
    let rec = stdout.lines().find(|l| l.starts_with("@vblk ")).unwrap_or_else(|| panic!("no @vblk record:\n{stdout}"));
    let nums = rec
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect();
    (nums, stderr.to_string())
}

/// A device counter from `iopath run`'s report line (`name=value` words).
fn counter(stderr: &str, name: &str) -> u64 {
    stderr
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")).and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[test]
fn the_guests_virtio_blk_driver_runs_against_iopaths_device_in_every_notify_mode() {
    for notify in ["exit", "ioeventfd", "poll"] {
        // Data: a pattern written over 4 MiB and read back.
        let (r, _) = vblk(&format!("virtio-blk,backend=ram,notify={notify}"), "verify=1 bs=4096 iodepth=4 size_mb=4");
        assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{notify}: {r:?}");
        // Load: every guest request is a device request; EVENT_IDX negotiated.
        let (r, err) =
            vblk(&format!("virtio-blk,backend=null,notify={notify}"), "rw=randread bs=512 iodepth=16 time_ms=200");
        assert!(r["ios"] > 0 && r["errors"] == 0 && r["event_idx"] == 1, "{notify}: {r:?}");
        assert_eq!(counter(&err, "requests"), r["ios"], "{notify}: {err}");
        match notify {
            // Each notify the guest wrote exited to the device.
            "exit" => assert_eq!(counter(&err, "notifies"), r["notifies"], "{err}"),
            // Each one was an ioeventfd kick instead; none exited.
            "ioeventfd" => assert_eq!((counter(&err, "kicks"), counter(&err, "notifies")), (r["notifies"], 0), "{err}"),
            // The polling device asks for notifications only once it has gone
            // to sleep: the ones the driver wrote woke it (kicks), none exited.
            // (How few they are is a bench figure, not a test.)
            _ => {
                assert_eq!((counter(&err, "kicks"), counter(&err, "notifies")), (r["notifies"], 0), "{err}");
                assert!(counter(&err, "sleeps") >= 1, "{err}");
            }
        }
    }
}

#[test]
fn a_device_with_four_queues_serves_a_one_queue_driver_in_the_vmm_and_over_vfio_user() {
    // The guest's driver sets up queue 0 only (4 are offered, with MQ): it is served in
    // every notify mode; in a device process queue 0's notify address is one of the four
    // ioeventfds the server announced (GET_REGION_IO_FDS), which the VMM installed.
    for spec in [
        "virtio-blk,backend=ram,notify=exit,queues=4",
        "virtio-blk,backend=ram,notify=ioeventfd,queues=4",
        "virtio-blk,backend=ram,notify=poll,queues=4",
        "virtio-blk,backend=ram,notify=ioeventfd,queues=4@vfio-user",
    ] {
        let (r, err) = vblk(spec, "verify=1 bs=4096 iodepth=4 size_mb=4");
        assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{spec}: {r:?}");
        assert_eq!(counter(&err, "q0.requests"), r["ios"], "{spec}: {err}");
        assert_eq!(counter(&err, "requests"), r["ios"], "{spec}: {err}");
        if !spec.contains("notify=exit") {
            assert_eq!((counter(&err, "kicks"), counter(&err, "notifies")), (r["notifies"], 0), "{spec}: {err}");
        }
    }
}

#[test]
fn without_queues_the_vmm_gives_virtio_blk_one_queue_per_vcpu_in_the_vmm_and_in_a_device_process_it_starts() {
    // iopath's VMM has one vCPU: one queue, in the VMM and in the device process the VMM
    // starts (told queues=1 on its command line), whatever `iopath serve` offers by itself.
    for spec in ["virtio-blk,backend=ram,notify=ioeventfd", "virtio-blk,backend=ram,notify=ioeventfd@vfio-user"] {
        let (r, err) = vblk(spec, "verify=1 bs=4096 iodepth=4 size_mb=4");
        assert_eq!((r["errors"], r["mismatches"], r["verified_blocks"]), (0, 0, 1024), "{spec}: {r:?}");
        assert_eq!(counter(&err, "q0.requests"), r["ios"], "{spec}: {err}");
        assert!(!err.contains("q1.requests="), "{spec}: more than one queue: {err}");
    }
}

#[test]
fn a_device_process_serves_a_second_client_through_the_notify_eventfd_it_announced() {
    // One `iopath serve` (vfio-user, notify=ioeventfd), two clients in turn:
    // the second one's notifications must still reach the device thread.
    // Without queues=N it offers 16 (it cannot know its client's vCPUs); the
    // guest's driver enables queue 0 only, and the others cost nothing.
    let dir = std::env::temp_dir().join(format!("iopath-vblk-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("vfio-user.sock");
    let mut server = Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["serve", "virtio-blk,notify=ioeventfd,backend=ram", "--transport", "vfio-user", "--socket"])
        .arg(&sock)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reports = server.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(reports).lines().map_while(Result::ok) {
            if l.contains("\"disconnected\"") && tx.send(l).is_err() {
                return;
            }
        }
    });
    let t0 = std::time::Instant::now();
    while !sock.exists() && t0.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let spec = format!("vfio-user:{}", sock.display());
    let result = std::panic::catch_unwind(|| {
        let mut ios = 0; // the counters add up across clients
        for client in 1..=2 {
            // A lost notification leaves the guest waiting: its run times out (vblk's --timeout 120).
            let (r, _) = vblk(&spec, "rw=randread bs=4096 iodepth=4 time_ms=100");
            assert!(r["ios"] > 0 && r["errors"] == 0, "client {client}: {r:?}");
            // The device's counters when the client left: 16 queues, queue 0 took every request.
            let report = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("a counters line");
            let v: serde_json::Value = serde_json::from_str(&report).unwrap();
            let c = |n: &str| v["counters"][n].as_u64().unwrap_or_else(|| panic!("no {n}: {report}"));
            ios += r["ios"];
            assert_eq!(c("q0.requests"), ios, "client {client}: {report}");
            assert_eq!((c("q15.requests"), c("errors"), c("ring_errors")), (0, 0, 0), "client {client}: {report}");
            assert!(v["counters"].get("q16.requests").is_none(), "client {client}: {report}");
        }
    });
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
