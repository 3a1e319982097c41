//! The NVMe controller end to end on the real /dev/kvm, driven by the
//! guest's nvmeperf: every backend and doorbell mode, in the VMM and from a
//! device process, and the same driver against QEMU's nvme.

mod common;
use common::nvmeperf::{num, nvme_record, nvmeperf, nvmeperf_in, nvmeperf_run};
use common::{kvm, programs};
use iopath_vmm::RamKind;

use std::time::Duration;

#[test]
fn verify_passes_on_every_backend_and_doorbell_mode_in_the_vmm() {
    kvm();
    let file = std::env::temp_dir().join(format!("iopath-nvme-test-{}.img", std::process::id()));
    for backend in ["ram".to_string(), format!("file:{},create=on", file.display())] {
        for db in ["mmio", "ioeventfd", "shm", "bar", "adaptive", "bar-adaptive"] {
            for (bs, lba) in [(4096, 512), (65536, 4096)] {
                let spec = format!("nvme,doorbell={db},backend={backend},size_mb=8,lba={lba}");
                let (rec, c, _) = nvmeperf(&spec, &format!("verify=1 bs={bs} iodepth=8 size_mb=4"));
                assert_eq!(num(&rec, "errors"), 0, "{spec}");
                assert_eq!(num(&rec, "mismatches"), 0, "{spec}");
                assert_eq!(num(&rec, "verified_blocks"), (4 << 20) / bs, "{spec}");
                assert_eq!(c["io.commands"], num(&rec, "ios"), "{spec}: every guest I/O is a controller command");
                assert_eq!(c["io.writes"], c["io.reads"], "{spec}");
            }
        }
    }
    let _ = std::fs::remove_file(file);
}

#[test]
fn shm_doorbells_take_no_exit_per_io_ioeventfd_ones_kick_and_mmio_ones_exit() {
    kvm();
    for backend in ["null", "ram"] {
        let (rec, c, r) =
            nvmeperf(&format!("nvme,doorbell=shm,backend={backend}"), "rw=randread bs=512 iodepth=16 time_ms=300");
        let ios = num(&rec, "ios");
        assert!(ios > 0, "{rec:?}");
        assert_eq!(num(&rec, "dbbuf"), 1);
        assert_eq!(num(&rec, "io_doorbell_writes"), 0, "the EventIdx rule never asked for a doorbell");
        // Only the admin queue's doorbells exited (submission + completion per command).
        assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "{c:?}");
        assert!(r.exits.mmio_write < 40, "{:?}", r.exits);
        assert_eq!(c["io.commands"], ios);
    }
    // bar: plain MMIO doorbell stores land in the page mapped over BAR0 (a KVM memslot):
    // not even the admin queue's exit, and the guest needs no Doorbell Buffer Config.
    let (rec, c, r) = nvmeperf("nvme,doorbell=bar,backend=null", "rw=randread bs=4096 iodepth=1 time_ms=300");
    assert_eq!(num(&rec, "dbbuf"), 0);
    assert!(num(&rec, "io_doorbell_writes") >= num(&rec, "ios"));
    assert_eq!(c["doorbell.writes"], 0, "{c:?}");
    assert!(r.exits.mmio_write < 10, "{:?}", r.exits);
    // ioeventfd: every doorbell the guest writes is a KVM ioeventfd kick, none exits.
    let (rec, c, r) = nvmeperf("nvme,doorbell=ioeventfd,backend=null", "rw=randread bs=4096 iodepth=1 time_ms=300");
    assert!(num(&rec, "io_doorbell_writes") > 0);
    assert_eq!(c["ioeventfd.kicks"], num(&rec, "io_doorbell_writes"));
    assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "{c:?}");
    assert!(r.exits.mmio_write < 40, "{:?}", r.exits);
    let (rec, c, r) = nvmeperf("nvme,doorbell=mmio,backend=null", "rw=randread bs=4096 iodepth=1 time_ms=300");
    let ios = num(&rec, "ios");
    assert_eq!(num(&rec, "dbbuf"), 0, "mmio mode offers no Doorbell Buffer Config");
    assert_eq!(c["doorbell.writes"] - 2 * c["admin.commands"], 2 * ios, "SQ tail + CQ head per I/O");
    assert!(r.exits.mmio_write >= 2 * ios);
}

#[test]
fn doorbells_rung_within_a_reaping_pass_take_no_exit() {
    kvm();
    // batch_submit=4: the driver rings its CQ head and SQ tail after every 4
    // commands it issues while reaping. With shadow doorbells the EventIdx rule
    // must still never ask for an MMIO write (a driver ringing only its SQ lets
    // its CQ fill, and the head doorbell it then writes exits).
    for db in ["shm", "adaptive"] {
        let spec = format!("nvme,doorbell={db},backend=null");
        let args = "rw=randread bs=512 iodepth=16 time_ms=300";
        let (rec, c, _) = nvmeperf(&spec, &format!("{args} batch_submit=4"));
        assert!(num(&rec, "ios") > 0, "{rec:?}");
        assert_eq!(num(&rec, "errors"), 0);
        // shm never asks for a write; adaptive only to wake its sleeping poller (a kick, not an exit).
        let asked = if db == "shm" { 0 } else { c["ioeventfd.kicks"] };
        assert_eq!(num(&rec, "io_doorbell_writes"), asked, "{db}: {c:?}");
        assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "{db}: only admin doorbells exit: {c:?}");
        assert_eq!(c["cq.full-waits"], 0, "{db}: {c:?}");
        assert_eq!(c["io.commands"], num(&rec, "ios"));
    }
    // bar: every ring is a store to the polled page; with batches of 4 the
    // driver writes its SQ tail at least once per 4 commands.
    let (rec, _, _) =
        nvmeperf("nvme,doorbell=bar,backend=null", "rw=randread bs=512 iodepth=16 time_ms=300 batch_submit=4");
    assert!(num(&rec, "io_doorbell_writes") >= num(&rec, "ios") / 4, "{rec:?}");
}

#[test]
fn a_file_namespace_sees_the_guests_queue_depth() {
    kvm();
    let file = std::env::temp_dir().join(format!("iopath-nvme-qd-{}.img", std::process::id()));
    // submit_batch=1: each operation goes to the kernel as it is fetched (in a device process too).
    let each = "adaptive,submit_batch=1";
    for (db, remote) in
        [("shm", ""), ("ioeventfd", ""), ("mmio", ""), ("shm", "@vfio-user"), (each, ""), (each, "@vfio-user")]
    {
        let spec = format!("nvme,doorbell={db},backend=file:{},create=on,size_mb=8{remote}", file.display());
        let (rec, _, _) = nvmeperf(&spec, "verify=1 bs=4096 iodepth=32 size_mb=4");
        assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0), "{spec}");
        let (rec, c, _) = nvmeperf(&spec, "rw=randrw bs=4096 iodepth=32 time_ms=300");
        assert_eq!(num(&rec, "errors"), 0, "{spec}");
        assert_eq!(c["io.commands"], num(&rec, "ios"), "{spec}");
        if c["backend.direct-ops"] == 0 {
            eprintln!("{spec}: no O_DIRECT io_uring on {} here; queue depth not checked", file.display());
            continue;
        }
        // More than one command at the file at once, and never more than the guest has out.
        let depth = c["backend.inflight-max"];
        eprintln!("{db}{remote}: {} guest I/Os, at most {depth} file operations in flight", num(&rec, "ios"));
        assert!((2..=32).contains(&depth), "{spec}: {depth} in flight at most: {c:?}");
    }
    let _ = std::fs::remove_file(file);
}

#[test]
fn every_rw_mode_and_several_queues_run_clean() {
    kvm();
    for rw in ["read", "write", "randread", "randwrite", "randrw", "randrw rwmixread=0", "randrw rwmixread=100"] {
        let (rec, c, r) =
            nvmeperf("nvme,doorbell=shm,backend=ram", &format!("rw={rw} bs=8192 iodepth=4 queues=3 time_ms=200"));
        assert_eq!(num(&rec, "errors"), 0, "{rw}");
        assert_eq!(num(&rec, "queues"), 3);
        assert_eq!(c["io.commands"], num(&rec, "ios"));
        match rw {
            "read" | "randread" => assert_eq!(c["io.writes"], 0),
            "write" | "randwrite" => assert_eq!(c["io.reads"], 0),
            _ => {
                // randrw: the guest's reads and writes apart are the controller's.
                let dir = |d: &str| iopath_bench::record::find_record(&r.lines, &format!("nvme-{d}")).unwrap();
                let (rd, wr) = (dir("read"), dir("write"));
                assert_eq!((num(&rd, "ios"), num(&wr, "ios")), (c["io.reads"], c["io.writes"]), "{rw}");
                assert_eq!(num(&rd, "lat_sum") + num(&wr, "lat_sum"), num(&rec, "lat_sum"), "{rw}");
                let mix = rec.get("rwmixread").map(String::as_str);
                match mix {
                    Some("0") => assert!(c["io.reads"] == 0 && c["io.writes"] > 0),
                    Some("100") => assert!(c["io.reads"] > 0 && c["io.writes"] == 0),
                    _ => assert!(mix == Some("50") && c["io.reads"] > 0 && c["io.writes"] > 0, "{rec:?}"),
                }
            }
        }
    }
    // A share of reads past 100 % is refused by the guest, not run.
    let r = nvmeperf_run("nvme,doorbell=shm,backend=ram", "rw=randrw rwmixread=101 time_ms=50", 128, RamKind::Auto);
    assert_eq!(r.status, 3, "the guest's rc 1");
    assert!(r.lines.iter().any(|l| l.starts_with("@nvme-error rwmixread=101")), "{:?}", r.lines);
    // 128 KiB transfers need PRP lists.
    let (rec, _, _) = nvmeperf("nvme,doorbell=shm,backend=ram", "verify=1 bs=131072 iodepth=4 size_mb=8");
    assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0));
}

#[test]
fn msix_completions_signal_their_vectors_through_kvm_irqfds() {
    kvm();
    // The guest enables MSI-X, points vectors 1 and 2 at its LAPIC, and creates its CQs with
    // IEN=1; it runs with IF=0 and still reaps by polling.
    let (rec, c, _) =
        nvmeperf("nvme,doorbell=shm,backend=null", "rw=randread bs=4096 iodepth=4 queues=2 irq=1 time_ms=200");
    assert_eq!(num(&rec, "irq"), 1);
    assert_eq!(num(&rec, "errors"), 0);
    // One message per queue pass: every completion signalled or merged into its pass's message.
    assert!(c["msix.interrupts"] > 0, "{c:?}");
    assert_eq!(c["msix.interrupts"] + c["msix.merged"], num(&rec, "ios"), "a message per completion or pass");
    let (rec, c, _) = nvmeperf("nvme,doorbell=shm,backend=null", "rw=randread bs=4096 iodepth=4 time_ms=100");
    assert_eq!((num(&rec, "irq"), c["msix.interrupts"]), (0, 0), "polled mode: none");
    // From a device process: the VMM routes the vectors the guest programs and hands their
    // eventfds over with SET_IRQS; the device process signals them.
    let spec = "nvme,doorbell=shm,backend=null@vfio-user";
    let (rec, c, _) = nvmeperf(spec, "rw=randread bs=4096 iodepth=4 queues=2 irq=1 time_ms=200");
    assert_eq!(num(&rec, "errors"), 0);
    assert!(c["msix.interrupts"] > 0, "vfio-user: {c:?}");
    assert_eq!(c["msix.interrupts"] + c["msix.merged"], num(&rec, "ios"), "vfio-user: {c:?}");
}

#[test]
fn an_interrupt_driven_guest_halts_until_its_completions_msix_message_wakes_it() {
    kvm();
    // irq=wait: a pass with nothing to reap halts the vCPU (sti; hlt) until an MSI-X message
    // comes through the irqfd; the guest's interrupt handler counts what it takes (`irqs`).
    for spec in ["nvme,doorbell=ioeventfd,backend=null", "nvme,doorbell=adaptive,backend=null@vfio-user"] {
        let (rec, c, _) = nvmeperf(spec, "rw=randread bs=4096 iodepth=2 queues=2 irq=wait time_ms=200");
        let (ios, sleeps, irqs) = (num(&rec, "ios"), num(&rec, "sleeps"), num(&rec, "irqs"));
        assert_eq!((num(&rec, "irq"), num(&rec, "errors")), (2, 0), "{spec}");
        assert_eq!(c["io.commands"], ios, "{spec}");
        assert!(sleeps > 0, "{spec}: it never slept: {rec:?}");
        // A halt ends only on an interrupt taken; a message can merge with one still pending.
        assert!(irqs >= sleeps, "{spec}: {sleeps} sleeps, {irqs} interrupts taken");
        assert!(irqs <= c["msix.interrupts"], "{spec}: {irqs} taken, {c:?}");
        assert_eq!(c["msix.interrupts"] + c["msix.merged"], ios, "{spec}: {c:?}");
    }
    // Polling, the same messages stay pending: none is taken.
    let (rec, _, _) =
        nvmeperf("nvme,doorbell=shm,backend=null", "rw=randread bs=4096 iodepth=4 queues=2 irq=1 time_ms=100");
    assert_eq!((num(&rec, "sleeps"), num(&rec, "irqs")), (0, 0));
}

#[test]
fn file_transfers_go_in_place_or_through_bounce_buffers_as_in_place_says() {
    kvm();
    let file = std::env::temp_dir().join(format!("iopath-nvme-in-place-{}.img", std::process::id()));
    // The VMM's own guest RAM is anonymous, advised for huge pages, where the kernel allows them.
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let anon_huge = thp.contains("[always]") || thp.contains("[madvise]");
    // A device process maps a memfd: huge where the host's shmem settings grant it.
    let memfd_huge = {
        let m = iopath_vmm::memory::create(2 << 20, RamKind::Memfd).unwrap();
        m.huge
    };
    // hugetlb RAM: 32 MiB, 16 pages of this machine's pool of 2 MiB pages (vm.nr_hugepages).
    let runs = [
        ("on", "", RamKind::Auto),
        ("off", "", RamKind::Auto),
        ("auto", "", RamKind::Auto),
        ("auto", "@vfio-user", RamKind::Auto),
        ("on", "@vfio-user", RamKind::Auto),
        ("auto", "@vfio-user", RamKind::Hugetlb),
    ];
    for (in_place, remote, ram) in runs {
        // 4 KiB: one page each; 64 KiB: a PRP list of 16 pages.
        for bs in [4096u64, 65536] {
            let spec = format!(
                "nvme,doorbell=adaptive,backend=file:{},create=on,size_mb=8,in_place={in_place}{remote}",
                file.display()
            );
            let (mem, args) = match ram {
                RamKind::Hugetlb => (32, format!("verify=1 bs={bs} iodepth=8 size_mb=4")),
                _ => (128, format!("verify=1 bs={bs} iodepth=16 size_mb=4")),
            };
            let (rec, c, _) = nvmeperf_in(&spec, &args, mem, ram);
            let what = format!("{spec} bs={bs} ram={ram}");
            assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0), "{what}");
            assert_eq!(num(&rec, "verified_blocks"), (4 << 20) / bs, "{what}");
            let (direct, placed) = (c["backend.direct-ops"], c["backend.in-place-ops"]);
            assert!(
                direct >= 2 * num(&rec, "verified_blocks"),
                "{what}: O_DIRECT io_uring on {}: {c:?}",
                file.display()
            );
            // auto: a transfer within one page goes in place, a larger one
            // only from huge pages.
            let huge = match (remote, ram) {
                (_, RamKind::Hugetlb) => true,
                ("", _) => anon_huge,
                _ => memfd_huge,
            };
            let want = match (in_place, bs) {
                ("off", _) => 0,
                ("auto", 65536) if !huge => 0,
                _ => direct,
            };
            eprintln!("{in_place}{remote} ram={ram} bs={bs}: {placed} of {direct} O_DIRECT operations in place");
            assert_eq!(placed, want, "{what}: {c:?}");
        }
    }
    let _ = std::fs::remove_file(file);
}

#[test]
fn the_controller_serves_from_a_device_process_over_vfio_user_and_mpqemu() {
    kvm();
    // vfio-user offers the doorbell page as a sparse mmap of BAR0: no exit out of process either.
    let (rec, c, r) =
        nvmeperf("nvme,doorbell=bar,backend=ram,size_mb=8@vfio-user", "verify=1 bs=4096 iodepth=8 size_mb=4");
    assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0));
    assert_eq!(c["doorbell.writes"], 0, "{c:?}");
    assert!(r.exits.mmio_write < 10, "{:?}", r.exits);
    for t in ["vfio-user", "mpqemu"] {
        let spec = format!("nvme,doorbell=shm,backend=ram,size_mb=8@{t}");
        let (rec, c, r) = nvmeperf(&spec, "verify=1 bs=4096 iodepth=8 size_mb=4");
        assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0), "{t}");
        assert_eq!(c["io.commands"], num(&rec, "ios"), "{t}: counters from the device process");
        let (rec, _, _) = nvmeperf(&spec, "rw=randread bs=4096 iodepth=1 time_ms=300");
        assert_eq!(num(&rec, "io_doorbell_writes"), 0, "{t}: shadow doorbells in shared guest RAM");
        assert!(r.exits.mmio_write < 40, "{t}: {:?}", r.exits);
    }
}

#[test]
fn ioeventfd_doorbells_kick_from_a_device_process_over_vfio_user() {
    kvm();
    // The device process announces every I/O doorbell as an ioeventfd when the client attaches
    // (before any queue exists): the client installs them in KVM, so doorbell writes kick the
    // device thread and none reaches the device process as a REGION_WRITE.
    let spec = "nvme,doorbell=ioeventfd,backend=null@vfio-user";
    let (rec, c, r) = nvmeperf(spec, "rw=randread bs=4096 iodepth=1 time_ms=300");
    let ios = num(&rec, "ios");
    assert!(ios > 0 && num(&rec, "io_doorbell_writes") > 0, "{rec:?}");
    assert_eq!(num(&rec, "dbbuf"), 1);
    assert!(c["ioeventfd.kicks"] > 0, "no kick: {c:?}");
    assert_eq!(c["ioeventfd.kicks"], num(&rec, "io_doorbell_writes"), "every I/O doorbell write is a kick: {c:?}");
    assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "only admin doorbells came as messages: {c:?}");
    assert!(r.exits.mmio_write < 40, "{:?} for {ios} I/Os", r.exits);
    assert_eq!(c["io.commands"], ios);
    // Several queues, and data checked: the kicks serve every queue's shadow tail.
    let (rec, c, _) = nvmeperf(
        "nvme,doorbell=ioeventfd,backend=ram,size_mb=8@vfio-user",
        "verify=1 bs=4096 iodepth=8 queues=3 size_mb=4",
    );
    assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0));
    assert!(c["ioeventfd.kicks"] > 0, "{c:?}");
    assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "{c:?}");
}

#[test]
fn adaptive_doorbells_poll_then_sleep_and_every_doorbell_write_is_a_kick() {
    kvm();
    // The guest pauses between runs of I/O only at setup; whether the poller sleeps during
    // the run depends on the host's timing, so only the routing is asserted: a doorbell
    // register write the EventIdx rule asks for is a KVM ioeventfd kick, never an exit.
    for remote in ["", "@vfio-user"] {
        let spec = format!("nvme,doorbell=adaptive,backend=null{remote}");
        let (rec, c, _) = nvmeperf(&spec, "rw=randread bs=4096 iodepth=1 time_ms=300");
        assert_eq!(num(&rec, "errors"), 0, "{spec}");
        assert_eq!(num(&rec, "dbbuf"), 1, "{spec}");
        assert_eq!(c["io.commands"], num(&rec, "ios"), "{spec}");
        assert_eq!(c["ioeventfd.kicks"], num(&rec, "io_doorbell_writes"), "{spec}: {c:?}");
        assert_eq!(c["doorbell.writes"], 2 * c["admin.commands"], "{spec}: {c:?}");
        assert!(c["shadow.polls"] > 0 && c["adaptive.sleeps"] > 0, "{spec}: idle before the first I/O: {c:?}");
    }
}

#[test]
fn adaptive_doorbells_wake_the_poller_where_the_doorbell_comes_as_a_message() {
    kvm();
    // mpqemu and ioregionfd have no ioeventfd for the doorbells: the write EventIdx asks for
    // exits and reaches the device process as a message. It must wake the poller, which then
    // polls the next submissions; if it did not, the poller would sleep on and every I/O
    // after the first sleep would exit (doorbell writes = I/Os, no wake-up). How many I/Os
    // are polled between two sleeps depends on the host's load (a debug build on shared
    // cores may idle 200 us between I/Os): the figures are `iopath bench nvme`'s.
    for t in ["mpqemu", "ioregionfd"] {
        let spec = format!("nvme,doorbell=adaptive,backend=null@{t}");
        let (rec, c, _) = nvmeperf(&spec, "rw=randread bs=4096 iodepth=1 time_ms=300");
        let (ios, rings) = (num(&rec, "ios"), num(&rec, "io_doorbell_writes"));
        assert_eq!(num(&rec, "errors"), 0, "{spec}");
        assert_eq!(c["io.commands"], ios, "{spec}");
        assert!(c["adaptive.sleeps"] > 0 && c["adaptive.wakeups"] > 0, "{spec}: {c:?}");
        assert!(rings > 0, "{spec}: the poller slept before the first I/O: {c:?}");
        assert_eq!(c["ioeventfd.kicks"], 0, "{spec}: no ioeventfd here, the wake-ups are the server's: {c:?}");
        assert_eq!(c["doorbell.writes"], rings + 2 * c["admin.commands"], "{spec}: the rings exited: {c:?}");
    }
}

#[test]
fn adaptive_doorbells_sleep_while_file_reads_are_in_flight_and_wake_on_their_completion() {
    kvm();
    // A file with data (reads of unwritten extents never reach the disk), on the disk, not tmpfs.
    let img = std::path::PathBuf::from(format!("/var/tmp/iopath-adaptive-file-{}.img", std::process::id()));
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    std::fs::write(&img, data).unwrap();
    let spec = format!("nvme,doorbell=adaptive,backend=file:{},size_mb=8", img.display());
    let (rec, c, _) = nvmeperf(&spec, "rw=randread bs=4096 iodepth=1 time_ms=300");
    let _ = std::fs::remove_file(&img);
    let ios = num(&rec, "ios");
    assert_eq!((num(&rec, "errors"), c["io.commands"]), (0, ios), "{c:?}");
    // Each read waits for the disk: the poller sleeps through it and its completion wakes it.
    // Spinning through in-flight operations instead, it slept only when the guest was idle.
    assert!(c["adaptive.sleeps"] >= (ios / 2).min(100), "{ios} reads, {c:?}");
    assert!(c["adaptive.wakeups"] <= c["adaptive.sleeps"], "{c:?}");
}

#[test]
fn bar_adaptive_sleeps_in_timed_steps_then_with_its_doorbell_page_trapped() {
    kvm();
    // 2 ms between a completion and the next command: the poller sleeps in timed steps and
    // finds each command in the page at its next look; no doorbell exits for that.
    let dev = "nvme,doorbell=bar-adaptive,backend=null";
    let (rec, c, _) = nvmeperf(dev, "rw=randread bs=4096 iodepth=1 thinktime_us=2000 time_ms=200");
    let ios = num(&rec, "ios");
    assert!(ios > 0 && ios <= 101 && num(&rec, "errors") == 0, "{rec:?}");
    assert_eq!(c["io.commands"], ios);
    assert!(c["adaptive.sleeps"] + 2 >= ios, "it slept in each pause: {ios} I/Os, {c:?}");
    // Exits only where the page was trapped (an idle of 20 ms or more: at setup), each
    // accounted for by a wake-up: at most one kick (CQ head, SQ tail) per wake-up.
    assert!(c["doorbell.writes"] <= 2 * (c["adaptive.wakeups"] + c["admin.commands"]), "{c:?}");
    // 60 ms between commands: the page is trapped in each pause (after 20 ms of it, with room
    // for a loaded host that wakes the steps late), and each command's doorbell store exits
    // and wakes the poller, which maps the page back.
    let (rec, c, r) = nvmeperf(dev, "rw=randread bs=4096 iodepth=1 thinktime_us=60000 time_ms=400");
    let ios = num(&rec, "ios");
    // (The guest issues a slot's next command after its think time even past time_ms.)
    assert!(ios > 0 && ios <= 9 && num(&rec, "errors") == 0, "{rec:?}");
    assert_eq!(c["io.commands"], ios);
    assert!(c["adaptive.wakeups"] + 1 >= ios, "each command woke the trapped poller: {ios} I/Os, {c:?}");
    assert!(c["doorbell.writes"] >= c["adaptive.wakeups"], "a wake-up is an exit: {c:?}");
    assert!(c["doorbell.writes"] <= 2 * (c["adaptive.wakeups"] + c["admin.commands"]), "{c:?}");
    assert_eq!(c["ioeventfd.kicks"], 0, "{c:?}");
    assert!(r.exits.mmio_write >= c["doorbell.writes"]);
    // Busy, the page is memory: doorbells take no exit.
    let (rec, c, _) = nvmeperf(dev, "rw=randread bs=4096 iodepth=1 time_ms=300");
    let ios = num(&rec, "ios");
    assert_eq!(c["io.commands"], ios);
    assert!(c["doorbell.writes"] < ios / 100 + 2 * (c["adaptive.wakeups"] + c["admin.commands"]), "{ios} I/Os, {c:?}");
    // From a device process the client maps the page (vfio-user sparse mmap) and it cannot
    // be trapped: the steps go on, and nothing exits.
    let (rec, c, _) =
        nvmeperf(&format!("{dev}@vfio-user"), "rw=randread bs=4096 iodepth=1 thinktime_us=30000 time_ms=200");
    let ios = num(&rec, "ios");
    assert!(ios > 0 && num(&rec, "errors") == 0, "{rec:?}");
    assert_eq!(c["io.commands"], ios);
    assert!(c["adaptive.sleeps"] > 0, "{c:?}");
    assert_eq!(c["doorbell.writes"], 0, "the page stays mapped in the client: {c:?}");
}

#[test]
fn bench_nvme_runs_the_vmm_and_a_device_process_in_one_run_and_relates_them() {
    kvm();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--json", "-", "--backend", "null", "--doorbell", "shm"])
        .args(["--rw", "randread", "--bs", "4096", "--iodepth", "4", "--transport", "vmm,vfio-user"])
        // No run the noise guard takes again: a rerun has no twin of its attempt to relate to.
        .args(["--reruns", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["options"]["transports"], serde_json::json!(["vmm", "vfio-user"]));
    let runs = v["runs"].as_array().unwrap();
    let vmm = runs.iter().find(|r| r["target"] == "iopath-shm").expect("the in-VMM row");
    let remote = runs.iter().find(|r| r["target"] == "iopath-shm@vfio-user").expect("the device-process row");
    let want = remote["iops"].as_f64().unwrap() / vmm["iops"].as_f64().unwrap();
    let ratio = remote["vmm_ratio"].as_f64().unwrap_or_else(|| panic!("no vmm_ratio: {remote}\n{vmm}\n{stderr}"));
    assert!((ratio - want).abs() < 1e-9, "{remote}");
    assert!(vmm["vmm_ratio"].is_null());
    // The VMM's run keeps guest RAM in a memfd too: the ratio compares transports, not memories.
    for r in [vmm, remote] {
        assert_eq!(r["setup"], "iopath null ram=memfd", "{r}");
    }
    assert!(stderr.contains("out of process over in the VMM"), "{stderr}");
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--transport", "vmm,carrier-pigeon"])
        .output()
        .unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("carrier-pigeon"));
}

#[test]
fn the_same_driver_runs_against_qemus_nvme() {
    kvm();
    let qemu = programs().qemu.expect("qemu-system-x86_64 is needed (apt-get install -y qemu-system-x86)");
    let image = iopath_guest::image_file().unwrap();
    let disk = std::env::temp_dir().join(format!("iopath-qemu-nvme-{}.img", std::process::id()));
    std::fs::File::create(&disk).unwrap().set_len(16 << 20).unwrap();
    for (drive, args) in [
        ("driver=null-co,size=64M,if=none,id=nvm0".to_string(), "rw=randread bs=4096 iodepth=4 time_ms=300"),
        ("driver=null-co,size=64M,if=none,id=nvm0".to_string(), "rw=randread bs=4096 iodepth=4 time_ms=300 irq=1"),
        // Interrupt-driven: the guest halts until QEMU's MSI-X message (under QEMU the firmware
        // leaves the PIT's IRQ 0 unmasked at vector 8: the guest masks the PICs first).
        ("driver=null-co,size=64M,if=none,id=nvm0".to_string(), "rw=randread bs=4096 iodepth=2 time_ms=300 irq=wait"),
        (format!("file={},format=raw,if=none,id=nvm0", disk.display()), "verify=1 bs=4096 iodepth=8 size_mb=4"),
    ] {
        let a = iopath_bench::qemu::nvme_args(&image, &format!("workload=nvme {args}"), 128, &drive, 512);
        let q = iopath_bench::qemu::run_args(&qemu, a, None, Duration::from_secs(120), |_| {}).unwrap();
        assert_eq!(q.status, Some(1), "{args}: {}\n{:?}", q.stderr, q.lines);
        let rec = nvme_record(&q.lines);
        assert_eq!(num(&rec, "errors"), 0);
        assert!(num(&rec, "ios") > 0);
        if args.contains("verify") {
            assert_eq!(num(&rec, "mismatches"), 0);
        }
        if args.contains("irq=wait") {
            let (sleeps, irqs) = (num(&rec, "sleeps"), num(&rec, "irqs"));
            assert!(sleeps > 0 && irqs >= sleeps, "{sleeps} halts, {irqs} interrupts taken");
        }
    }
    let _ = std::fs::remove_file(disk);
}

#[test]
fn bench_nvme_reports_a_checked_table_and_json() {
    kvm();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--rounds", "1", "--time", "0.3", "--backend", "null", "--json", "-"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 14, "2 jobs x 7 doorbell modes (the CLI's default list)");
    let mut qd1_runs = 0;
    for r in runs {
        assert!(r["iops"].as_f64().unwrap() > 0.0 && r["routing_ok"] == true, "{r}");
        // The QD1 job's runs are given over the guest line floor measured before each, the others are not.
        let qd1 = v["options"]["jobs"][r["job"].as_u64().unwrap() as usize]["iodepth"] == 1;
        assert_eq!(r["guest_line_ratio"].as_f64().is_some_and(|x| x > 0.0), qd1, "{r}");
        qd1_runs += qd1 as usize;
    }
    // One per QD1 run, every round trip through guest memory (the doorbell device's counters).
    let g = v["floor"]["guest_line"].as_array().unwrap();
    assert_eq!((g.len(), qd1_runs), (7, 7), "{g:?}");
    for l in g {
        assert!(
            l["rtt_ns"].as_f64().unwrap() > 0.0 && l["routing"].as_str().unwrap().contains("exits=0 kicks=0"),
            "{l}"
        );
    }
    assert!(stderr.contains("iopath-shm") && stderr.contains("exits/IO") && stderr.contains("guest line floor"));
}

#[test]
fn bench_nvme_contend_records_its_level_device_cpu_and_leaves_no_contender() {
    kvm();
    let bench = |extra: &[&str]| {
        let base = ["bench", "nvme", "--quick", "--json", "-", "--contend", "1", "--rw", "randread", "--bs", "4096"];
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(base.iter().chain(extra))
            .args(["--iodepth", "1", "--backend", "ram"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{extra:?}: {stderr}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
        assert_eq!(v["options"]["contend"], serde_json::json!([1]), "{}", v["options"]);
        assert!(stderr.contains("contend: 1"), "{stderr}");
        v["runs"].as_array().unwrap().clone()
    };
    // In the VMM: shm and bar have a poller, ioeventfd its thread; mmio with
    // the RAM backend has none (the vCPU thread does the work).
    let runs = bench(&["--doorbell", "shm,bar,ioeventfd,mmio"]);
    assert_eq!(runs.len(), 4);
    for r in &runs {
        // The vCPU thread, in every mode (mmio: it does the device's work in its exits).
        assert!(r["vcpu_ns_per_io"].as_f64().unwrap() > 0.0, "{r}");
        if r["target"] == "iopath-mmio" {
            assert!(r["device_threads"] == 0 && r["cpu_ns_per_io"].is_null(), "{r}");
        } else {
            assert_eq!(r["device_threads"], 1, "{r}");
            assert!(r["cpu_ns_per_io"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["idle_cpu_pct"].as_f64().unwrap() >= 0.0, "{r}");
        }
    }
    // In a device process: its poller is found among the child's threads.
    let runs = bench(&["--doorbell", "shm", "--transport", "vfio-user"]);
    assert_eq!(runs.len(), 1);
    assert!(runs[0]["cpu_ns_per_io"].as_f64().unwrap() > 0.0, "{}", runs[0]);
    assert!(runs[0]["idle_cpu_pct"].as_f64().unwrap() >= 0.0, "{}", runs[0]);

    // Two levels: each target quiet, then beside busy threads, and their ratio.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--json", "-", "--contend", "0,1", "--doorbell", "shm"])
        .args(["--rw", "randread", "--bs", "4096", "--iodepth", "1", "--backend", "null"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["options"]["contend"], serde_json::json!([0, 1]), "{}", v["options"]);
    let runs = v["runs"].as_array().unwrap();
    let names: Vec<_> = runs.iter().map(|r| (r["target"].as_str().unwrap(), r["contend"].as_u64().unwrap())).collect();
    assert_eq!(names, [("iopath-shm", 0), ("iopath-shm+contend1", 1)], "{stderr}");
    assert!(runs[0]["quiet_ratio"].is_null(), "{}", runs[0]);
    // The guard runs twins again together: the two are of one attempt.
    assert_eq!(runs[0]["attempt"], runs[1]["attempt"], "{stderr}");
    let q = runs[1]["quiet_ratio"].as_f64().unwrap();
    let want = runs[1]["iops"].as_f64().unwrap() / runs[0]["iops"].as_f64().unwrap();
    assert!((q - want).abs() < 1e-9, "{}", runs[1]);
    assert!(runs[1]["quiet_floor_ratio"].as_f64().unwrap() > 0.0, "{}", runs[1]);
    assert!(stderr.contains("contend: 0,1") && stderr.contains("beside busy threads over quiet"), "{stderr}");
    // The vCPU's share of a CPU, beside busy threads and quiet.
    let row = stderr.lines().find(|l| l.contains("iopath-shm+contend1") && l.contains("vCPU")).unwrap_or_default();
    assert!(row.contains(" % / ") && row.ends_with(" %"), "{stderr}");
    for bad in ["0,0", "65"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["bench", "nvme", "--quick", "--contend", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "--contend {bad} was taken");
    }

    // In this process: the contenders are gone once the bench returns.
    let o = iopath_bench::nvme::NvmeOptions {
        jobs: vec![iopath_bench::nvme::Job::randread(4096, 1)],
        doorbells: vec![iopath_devices::nvme::DoorbellMode::Shm],
        time_ms: 100,
        contend: vec![2],
        progress: false,
        ..Default::default()
    };
    let r = iopath_bench::nvme::run_nvme(&o).unwrap();
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let left = || iopath_bench::cpu::Snapshot::take(&[std::process::id()], &[iopath_bench::contend::THREAD_NAME]);
    let t0 = std::time::Instant::now();
    while !left().threads.is_empty() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(left().threads.is_empty(), "contenders survived the bench: {:?}", left());

    // bench exits takes the option too and records it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "exits", "--quick", "--only", "cpuid", "--no-floor", "--transports", "none"])
        .args(["--contend", "1", "--json", "-"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["options"]["contend"], 1, "{}", v["options"]);
    assert!(stderr.contains("contend: 1"), "{stderr}");
}

#[test]
fn bench_nvme_on_a_file_runs_host_fio_beside_it_or_says_why_not() {
    kvm();
    let img = std::env::temp_dir().join(format!("iopath-fio-row-{}.img", std::process::id()));
    std::fs::write(&img, vec![0u8; 8 << 20]).unwrap();
    let bench_with = |fio: Option<&str>, more: &[&str]| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"));
        c.args(["bench", "nvme", "--time", "0.3", "--doorbell", "shm", "--rw", "randread"]).args(more);
        c.args(["--bs", "4096", "--iodepth", "4", "--json", "-", "--backend", &format!("file:{}", img.display())]);
        if let Some(f) = fio {
            c.env("IOPATH_FIO", f);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (v, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let bench = |fio: Option<&str>| bench_with(fio, &["--rounds", "1"]);
    // No fio: the row is skipped with the reason; the bench runs and passes.
    let (v, table) = bench(Some("/nonexistent/fio"));
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(runs[0]["fio_ratio"].is_null());
    let skipped = v["skipped"].as_array().unwrap();
    assert!(skipped.iter().any(|s| s.as_str().unwrap().contains("fio (host): fio not found")), "{skipped:?}");
    assert!(table.contains("skipped:") && table.contains("fio not found"), "{table}");
    // With fio (CI installs it): its row on the same file, and the iopath row's ratio to it.
    if iopath_bench::fio::find().is_some() {
        let (v, table) = bench(None);
        let runs = v["runs"].as_array().unwrap();
        let fio = runs.iter().find(|r| r["target"] == "fio (host)").expect("a fio row");
        assert!(fio["iops"].as_f64().unwrap() > 0.0 && fio["p99_ns"].as_f64().unwrap() > 0.0, "{fio}");
        let shm = runs.iter().find(|r| r["target"] == "iopath-shm").unwrap();
        let ratio = shm["fio_ratio"].as_f64().expect("fio_ratio");
        assert!((ratio - shm["iops"].as_f64().unwrap() / fio["iops"].as_f64().unwrap()).abs() < 1e-9);
        assert!(table.contains("fio (host)") && table.contains("/fio"), "{table}");
        // The same fio beside a busy thread on the vCPU's CPU, and the ratio to it.
        let busy = runs.iter().find(|r| r["target"] == "fio (host, busy CPU)").expect("a busy-CPU fio row");
        assert!(busy["iops"].as_f64().unwrap() > 0.0, "{busy}");
        let routing = busy["routing"].as_str().unwrap();
        assert!(routing.contains("one busy thread on CPU") && routing.contains("fio on CPU"), "{routing}");
        let ratio = shm["fio_busy_ratio"].as_f64().expect("fio_busy_ratio");
        assert!((ratio - shm["iops"].as_f64().unwrap() / busy["iops"].as_f64().unwrap()).abs() < 1e-9);
        assert!(busy["fio_ratio"].is_null() && busy["floor_ratio"].is_null(), "{busy}");
        assert!(table.contains("/fio busy CPU"), "{table}");
        // A target the guard runs again (two rounds never agree exactly, and the spread
        // allowed is 1.0) takes fio along: each of its runs keeps a fio row of its own attempt.
        let (v, _) = bench_with(None, &["--rounds", "2", "--max-spread", "1.0", "--reruns", "1"]);
        let runs = v["runs"].as_array().unwrap();
        let shm: Vec<_> = runs.iter().filter(|r| r["target"] == "iopath-shm").collect();
        assert_eq!(shm.len(), 2, "{runs:?}");
        for r in &shm {
            assert_eq!(r["attempt"], 1, "{r}");
            let fio = runs
                .iter()
                .find(|f| f["target"] == "fio (host)" && f["attempt"] == 1 && f["round"] == r["round"])
                .expect("a fio row of the re-run's attempt and round");
            let ratio = r["fio_ratio"].as_f64().expect("fio_ratio after a re-run");
            assert!((ratio - r["iops"].as_f64().unwrap() / fio["iops"].as_f64().unwrap()).abs() < 1e-9);
            assert!(r["fio_busy_ratio"].as_f64().is_some(), "{r}");
        }
    } else {
        eprintln!("fio is not installed: only the skipped row was checked");
    }
    let _ = std::fs::remove_file(img);
}

#[test]
fn two_pollers_share_four_queues_and_both_serve_io() {
    kvm();
    // The e2e run of the brief: shm doorbells, null namespace, 4 queues over 2 pollers.
    let (rec, c, r) =
        nvmeperf("nvme,doorbell=shm,backend=null,pollers=2", "rw=randread bs=512 iodepth=16 queues=4 time_ms=300");
    assert_eq!(num(&rec, "errors"), 0);
    assert_eq!(c["io.commands"], num(&rec, "ios"), "every guest I/O is a controller command");
    assert!(c["poller0.ios"] > 0 && c["poller1.ios"] > 0, "both pollers served I/O: {c:?}");
    assert_eq!(c["poller0.ios"] + c["poller1.ios"], c["io.commands"]);
    assert!(r.exits.mmio_write < num(&rec, "ios") / 10, "shadow doorbells: no exit per I/O");
    // Data through both groups: a ram namespace, written and read back, shm, bar and adaptive, in the VMM
    // and from a device process (the option crosses to `iopath serve`).
    for spec in [
        "nvme,doorbell=shm,backend=ram,size_mb=8,pollers=2",
        "nvme,doorbell=bar,backend=ram,size_mb=8,pollers=2",
        "nvme,doorbell=adaptive,backend=ram,size_mb=8,pollers=2",
        "nvme,doorbell=shm,backend=ram,size_mb=8,pollers=2@vfio-user",
    ] {
        let (rec, c, _) = nvmeperf(spec, "verify=1 bs=4096 iodepth=8 queues=4 size_mb=4");
        assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0), "{spec}");
        assert!(c["poller0.ios"] > 0 && c["poller1.ios"] > 0, "{spec}: both pollers served I/O: {c:?}");
    }
}

#[test]
fn bench_nvme_runs_each_poller_count_and_records_it() {
    kvm();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--json", "-", "--backend", "null", "--doorbell", "shm,mmio"])
        .args(["--pollers", "1,2", "--rw", "randread", "--bs", "512", "--iodepth", "4", "--queues", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
    assert_eq!(v["options"]["pollers"], serde_json::json!([1, 2]));
    let runs = v["runs"].as_array().unwrap();
    let targets: Vec<(&str, u64)> =
        runs.iter().map(|r| (r["target"].as_str().unwrap(), r["pollers"].as_u64().unwrap())).collect();
    // mmio serves no second poller: that combination is skipped, not failed.
    assert_eq!(targets, [("iopath-shm", 1), ("iopath-shm-p2", 2), ("iopath-mmio", 1)]);
    let p2 = &runs[1];
    let per: Vec<u64> = p2["poller_ios"].as_array().unwrap().iter().map(|n| n.as_u64().unwrap()).collect();
    assert!(per.len() == 2 && per.iter().all(|&n| n > 0), "both pollers served the 2 queues: {p2}");
    assert!(p2["routing_ok"] == true && p2["device_threads"] == 2, "{p2}");
    assert!(stderr.contains("iopath-shm-p2") && stderr.contains("pollers"), "{stderr}");
    // A bad count is refused before anything runs.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--pollers", "0"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--pollers"));
}

/// `bench nvme --json -` with `args`: the JSON and the table.
fn bench_nvme(args: &[&str]) -> (serde_json::Value, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_iopath"))
        .args(["bench", "nvme", "--quick", "--json", "-", "--rw", "randread", "--bs", "4096", "--iodepth", "2"])
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    (serde_json::from_slice(&out.stdout).unwrap(), stderr)
}

#[test]
fn bench_nvme_runs_keep_the_guests_histogram_and_count_only_the_windows_exits() {
    kvm();
    let (v, table) = bench_nvme(&["--backend", "null", "--doorbell", "shm,mmio"]);
    assert_eq!(v["schema_version"], iopath_bench::guard::JSON_SCHEMA_VERSION);
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    for r in runs {
        // The raw inputs: I/Os, cycles and the histogram, whose counts are the I/Os.
        let ios = r["ios"].as_u64().unwrap();
        assert!(ios > 0 && r["cycles"].as_u64().unwrap() > 0, "{r}");
        let hist = r["hist"].as_array().unwrap();
        let total: u64 = hist.iter().map(|p| p[1].as_u64().unwrap()).sum();
        assert_eq!(total, ios, "{r}");
        let edges: Vec<f64> = hist.iter().map(|p| p[0].as_f64().unwrap()).collect();
        assert!(edges.windows(2).all(|w| w[0] < w[1]), "upper edges ascend: {edges:?}");
        assert!(r["marks"].is_array(), "{r}");
        // Exits: the window's and the setup's add up to the run's.
        let (w, s, all) = (r["window_exits"].as_u64(), r["setup_exits"].as_u64(), r["vm_exits"].as_u64());
        assert_eq!(w.unwrap() + s.unwrap(), all.unwrap(), "{r}");
        assert!(s.unwrap() > 0, "setup (enumeration, admin, output) exits: {r}");
    }
    let shm = runs.iter().find(|r| r["target"] == "iopath-shm").unwrap();
    // Shadow doorbells: no exit at all in the window, whatever setup took.
    assert_eq!((shm["window_exits"].as_u64(), shm["exits_per_io"].as_f64()), (Some(0), Some(0.0)), "{shm}");
    let mmio = runs.iter().find(|r| r["target"] == "iopath-mmio").unwrap();
    assert_eq!(mmio["window_exits"], mmio["io_doorbell_writes"], "{mmio}");
    assert!(table.contains("merged latency histogram") && table.contains("interpolated linearly"), "{table}");
}

#[test]
fn bench_nvme_vs_qemu_puts_qemu_on_the_same_backend_kind_and_checks_its_guest() {
    kvm();
    for (backend, setup, drive) in [("null", "qemu null-co", "null-co"), ("ram", "qemu ram(/dev/shm)", "/dev/shm/")] {
        let (v, table) = bench_nvme(&["--backend", backend, "--doorbell", "shm", "--vs", "qemu"]);
        assert!(v["errors"].as_array().unwrap().is_empty(), "{}", v["errors"]);
        let runs = v["runs"].as_array().unwrap();
        let q = runs.iter().find(|r| r["target"] == "qemu").expect("a QEMU row");
        let routing = q["routing"].as_str().unwrap();
        assert_eq!(q["setup"], setup, "{q}");
        assert!(routing.contains(drive), "{routing}");
        // Checked by the guest's own counts, not QEMU's exit status alone.
        assert!(routing.contains(&format!("guest: {} I/Os, 0 errors", q["ios"])), "{routing}");
        assert_eq!(q["routing_ok"], true);
        let sum: u64 = q["hist"].as_array().unwrap().iter().map(|p| p[1].as_u64().unwrap()).sum();
        assert_eq!(sum, q["ios"].as_u64().unwrap());
        // QEMU's main loop (its device side) and its vCPU thread are measured in the window too.
        assert!(q["device_threads"].as_u64().unwrap() >= 1, "{q}");
        assert!(q["cpu_ns_per_io"].as_f64().unwrap() > 0.0, "{q}");
        assert!(q["vcpu_ns_per_io"].as_f64().unwrap() > 0.0, "{q}");
        assert!(table.contains("vCPU/IO"), "{table}");
        let l = table.lines().find(|l| l.contains("iopath-shm / qemu IOPS = ")).unwrap_or_else(|| panic!("{table}"));
        assert!(l.ends_with(&format!("(iopath {backend} / {setup})")), "{l}");
        if backend == "ram" {
            // The RAM image is the bench's, and gone with it.
            let path = routing.split_whitespace().find(|w| w.starts_with("/dev/shm/")).unwrap();
            assert!(!std::path::Path::new(path).exists(), "{path} outlived the bench");
        }
    }
}

/// A loop device over a file of `bytes`, detached (and its file removed) when dropped.
struct LoopDevice(String, std::path::PathBuf);

impl LoopDevice {
    /// None where this user may not set one up (not root).
    fn new(bytes: usize) -> Option<LoopDevice> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        if !status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0")) {
            return None;
        }
        let img = std::env::temp_dir().join(format!("iopath-blkdev-{}.img", std::process::id()));
        std::fs::write(&img, vec![0u8; bytes]).unwrap();
        let out = std::process::Command::new("losetup").args(["-f", "--show"]).arg(&img).output().expect("losetup");
        assert!(out.status.success(), "losetup as root: {}", String::from_utf8_lossy(&out.stderr));
        Some(LoopDevice(String::from_utf8(out.stdout).unwrap().trim().to_string(), img))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup").args(["-d", &self.0]).status();
        let _ = std::fs::remove_file(&self.1);
    }
}

#[test]
fn a_block_device_backs_a_namespace_up_to_its_own_size() {
    kvm();
    let Some(dev) = LoopDevice::new(16 << 20) else {
        eprintln!("not root: no loop device to put a namespace on");
        return;
    };
    // Data through the block device, written and read back, from the VMM and a device process.
    for remote in ["", "@vfio-user"] {
        let spec = format!("nvme,doorbell=adaptive,backend=file:{},size_mb=16{remote}", dev.0);
        let (rec, c, _) = nvmeperf(&spec, "verify=1 bs=4096 iodepth=8 size_mb=16");
        assert_eq!((num(&rec, "errors"), num(&rec, "mismatches")), (0, 0), "{spec}");
        assert_eq!(num(&rec, "verified_blocks"), (16 << 20) / 4096, "{spec}");
        assert!(c["backend.direct-ops"] > 0, "{spec}: O_DIRECT through io_uring: {c:?}");
    }
    // A namespace larger than the device is refused with both sizes, not grown.
    let spec: iopath_protocols::attach::DeviceSpec = format!("nvme,backend=file:{},size_mb=32", dev.0).parse().unwrap();
    let e = iopath_protocols::attach::instantiate(&spec, &programs()).err().expect("a 32 MiB namespace on 16 MiB");
    assert!(e.to_string().contains("holds 16777216 bytes, the disk needs 33554432"), "{e}");
    // The bench sizes its runs (guest, fio, QEMU) by the device.
    let kind = iopath_devices::block::StorageKind::File(dev.0.clone().into());
    assert_eq!(iopath_bench::nvme::namespace_size(&kind, None), 16 << 20);
}

/// iopath's guest driver meets injected statuses: every 50th read fails (Unrecovered Read
/// Error), and the driver's record, the device's errors counter and the reads it served agree
/// exactly (the oracle: errors = read commands / 50; a failed read is not carried out, so
/// `io.reads` counts the others), in a polled and a kicked doorbell mode.
#[test]
fn the_guest_driver_counts_each_injected_error_once() {
    kvm();
    for db in ["shm", "ioeventfd"] {
        let spec = format!("nvme,doorbell={db},backend=ram,size_mb=8,inject=op=read/status=2:0x81:dnr/every=50");
        // 2 s: enough reads for several errors even on a loaded host (a failed run had 150 reads in 0.3 s).
        let r = nvmeperf_run(&spec, "rw=randrw bs=4096 iodepth=8 time_ms=2000", 128, RamKind::Auto);
        let rec = nvme_record(&r.lines);
        let c: std::collections::BTreeMap<String, u64> =
            r.devices[0].counters.iter().map(|c| (c.name.clone(), c.value)).collect();
        assert_ne!(r.status, 1, "{spec}: a run with I/O errors does not pass");
        assert!(c["errors"] >= 5, "{spec}: too few reads to tell: {c:?}");
        assert_eq!(c["errors"], (c["io.reads"] + c["errors"]) / 50, "{spec}: {c:?}");
        assert_eq!(num(&rec, "errors"), c["errors"], "{spec}: the driver saw each injected error once: {rec:?}");
        assert_eq!(num(&rec, "ios"), c["io.commands"], "{spec}: every command completed once: {rec:?}");
    }
}
