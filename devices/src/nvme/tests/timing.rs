//! Timing models per namespace: each namespace's commands are due at its
//! own model's time (its `timing=` in its `ns=` SPEC, else the controller's
//! `timing=`), checked on the controller's clock (the due and fetch times
//! the controller logged), never against the wall clock.

use super::*;
use crate::nvme::namespaces::NsConfig;

/// One read of namespace `nsid` (QD1): through the shadow doorbells, else
/// the doorbell register; its status.
fn read(d: &mut Drv, nsid: u32, slba: u64, shadow: bool) -> u16 {
    let e = d.sqe(0x02, nsid, DATA, 0, [slba as u32, 0, 0, 0]);
    d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
    let old = d.iotail as u32;
    d.iotail = (d.iotail + 1) % 8;
    if shadow {
        d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
        // The shadow doorbell rule (a sleeping adaptive poller armed EventIdx): ring when
        // the new tail passed it (a queue of 8 entries).
        std::sync::atomic::fence(Ordering::SeqCst);
        let ev: u32 = d.mem.load(GuestAddress(EVIDX + 8), Ordering::Acquire).unwrap();
        let nw = d.iotail as u32;
        if (nw + 16 - ev - 1) % 8 < (nw + 8 - old) % 8 {
            d.w32(DOORBELLS + 8, nw);
        }
    } else {
        d.w32(DOORBELLS + 8, d.iotail as u32);
    }
    let t0 = std::time::Instant::now();
    let r = loop {
        if let Some(r) = d.reap(IOCQ, 8, false) {
            break r;
        }
        // A bound on a hang, not a timed assertion.
        assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the poller did not post the completion");
        std::thread::yield_now();
    };
    if shadow {
        d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
    } else {
        d.w32(DOORBELLS + 12, d.iohead as u32);
    }
    r.1
}

#[test]
fn each_namespace_completes_at_its_own_models_due_time() {
    for (mode, shadow) in [
        (DoorbellMode::Shm, true),
        (DoorbellMode::Auto, true),
        (DoorbellMode::Auto, false),
        (DoorbellMode::Adaptive, true),
        (DoorbellMode::Ioeventfd, true),
    ] {
        own_due_times(mode, shadow);
    }
}

fn own_due_times(mode: DoorbellMode, shadow: bool) {
    let ns = |timing: Option<&str>| NsConfig {
        backend: StorageKind::Ram,
        size: 1 << 20,
        lba_size: 512,
        timing: timing.map(|t| Box::new(t.parse().unwrap())),
        ..Default::default()
    };
    // Namespace 1 and 3 take the controller's model, 2 its own.
    let cfg = NvmeConfig {
        backend: StorageKind::Ram,
        size: 1 << 20,
        doorbell: mode,
        timing: Some(Box::new("read:300us".parse().unwrap())),
        ns: vec![ns(Some("read:40us+write:10us")), ns(None)],
        ..NvmeConfig::default()
    };
    let mut d = Drv::new(cfg);
    let log = d.n.timed_log();
    if shadow {
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
    }
    d.io_queues(8);
    let order = [1u32, 2, 3, 2, 1, 2, 2, 3, 1, 2];
    for (i, &nsid) in order.iter().enumerate() {
        assert_eq!(read(&mut d, nsid, i as u64, shadow), 0, "{mode}: read {i} of namespace {nsid}");
    }
    let recs = crate::lock(&log).clone();
    assert_eq!(recs.len(), order.len(), "{mode}: every read timed: {recs:?}");
    for (r, &nsid) in recs.iter().zip(&order) {
        let want = if nsid == 2 { 40_000 } else { 300_000 };
        assert!(r.arrival_ns > 0, "{r:?}");
        // A constant, no channels or ceilings: due = fetched + the constant, exactly.
        assert_eq!(r.due_ns - r.arrival_ns, want, "namespace {nsid}: {r:?}");
        assert!(r.posted_ns >= r.due_ns, "namespace {nsid} posted early: {r:?}");
    }
    // The device's own histogram counted each one: its p50 device time is
    // the 300 us of the six reads of namespaces 1 and 3 (within a bucket's
    // 1.6 % and the lateness), its minimum-side the 40 us ones.
    let c = d.n.counters();
    let get = |n: &str| c.iter().find(|x| x.name == n).map(|x| x.value);
    assert_eq!(get("timing.posted"), Some(order.len() as u64));
    assert!(get("timing.device-p50-ns").unwrap() >= 40_000 * 98 / 100, "{c:?}");
    if mode == DoorbellMode::Adaptive {
        // The six 300 us reads were slept through (an idle window of at most
        // 200 us, then a sleep until 50 us before each was due), not polled:
        // at least half of them on a loaded host (polling through them, as
        // before, sleeps at most once: the next read follows each at once).
        assert!(get("adaptive.sleeps").unwrap_or(0) >= 3, "{mode}: {c:?}");
    }
    d.n.quiesce();
}

#[test]
fn a_namespace_timing_needs_a_device_thread_and_the_first_takes_the_controllers() {
    let cfg = NvmeConfig {
        doorbell: DoorbellMode::Mmio,
        ns: vec![NsConfig { timing: Some(Box::new("read:1us".parse().unwrap())), ..NsConfig::default() }],
        ..NvmeConfig::default()
    };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("timing= needs a device thread"), "{e}");
    let e = NvmeConfig::default().with_namespaces(&["backend=ram,timing=read:1us".into()]).unwrap_err().to_string();
    assert!(e.contains("namespace 1's timing model is the device option timing="), "{e}");
    // The others' may come with --namespace.
    let c = NvmeConfig::default()
        .with_namespaces(&["backend=ram".into(), "backend=ram,size_mb=8,timing=read:5us".into()])
        .unwrap();
    assert_eq!(c.ns[0].timing.as_ref().unwrap().to_string(), "read:5us");
}

/// The device's own lateness (posted - due) over `n` QD1 reads with a
/// `read:LAT` model, driver and `shm` poller in this process (the poller
/// on CPU 1, the driver spinning on CPU 0): what the device path keeps of
/// its due times without a VM around it, for a set against `bench nvme
/// --timing` on the same host. A figure, not a judgement (a shared host's
/// scheduling decides the tail): `cargo test --release -p iopath-devices
/// --lib timing_lateness_in_process -- --ignored --nocapture`.
#[test]
#[ignore]
fn timing_lateness_in_process() {
    for lat in ["20us", "100us", "1ms"] {
        let n = match lat {
            "1ms" => 2000,
            "100us" => 20_000,
            _ => 50_000,
        };
        // The poller inherits the affinity of the thread that makes it.
        let pinned = pin_to(1);
        let cfg = NvmeConfig {
            backend: StorageKind::Null,
            size: 1 << 20,
            doorbell: DoorbellMode::Shm,
            timing: Some(Box::new(format!("read:{lat}").parse().unwrap())),
            ..NvmeConfig::default()
        };
        let mut d = Drv::new(cfg);
        let log = d.n.timed_log();
        assert_eq!(d.admin(0x7c, 0, DBBUF, EVIDX, [0; 4]).1, 0);
        d.io_queues(8);
        let pinned = pinned && pin_to(0);
        let mut seen = Vec::with_capacity(n);
        for i in 0..n {
            let e = d.sqe(0x02, 1, DATA, 0, [i as u32 % 1024, 0, 0, 0]);
            d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
            d.iotail = (d.iotail + 1) % 8;
            let t0 = std::time::Instant::now();
            d.mem.store(d.iotail as u32, GuestAddress(DBBUF + 8), Ordering::Release).unwrap();
            let r = loop {
                if let Some(r) = d.reap(IOCQ, 8, false) {
                    break r;
                }
                assert!(t0.elapsed() < std::time::Duration::from_secs(10), "the poller did not post the completion");
                std::hint::spin_loop();
            };
            seen.push(t0.elapsed().as_nanos() as u64);
            assert_eq!(r.1, 0);
            d.mem.store(d.iohead as u32, GuestAddress(DBBUF + 12), Ordering::Release).unwrap();
        }
        let recs = crate::lock(&log).clone();
        d.n.quiesce();
        let mut late: Vec<u64> = recs.iter().map(|r| r.posted_ns - r.due_ns).collect();
        late.sort_unstable();
        seen.sort_unstable();
        let q = |v: &[u64], p: f64| v[((v.len() as f64 * p) as usize).min(v.len() - 1)] as f64 / 1000.0;
        println!(
            "read:{lat} QD1 x{n} (pinned {pinned}): device lateness p50 {:.2} p99 {:.2} p99.9 {:.2} max {:.2} us; \
             driver's latency p50 {:.2} p99 {:.2} p99.9 {:.2} us",
            q(&late, 0.5),
            q(&late, 0.99),
            q(&late, 0.999),
            q(&late, 1.0),
            q(&seen, 0.5),
            q(&seen, 0.99),
            q(&seen, 0.999)
        );
    }
}
