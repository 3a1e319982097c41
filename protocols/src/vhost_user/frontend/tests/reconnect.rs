//! A backend that hangs up after DRIVER_OK: the frontend connects to its
//! socket again and replays the session, the in-flight region kept, each
//! ring from the used index the guest sees.

use super::*;
use crate::respawn::Reconnect;
use std::os::unix::net::UnixListener;

/// Each connection's log and a copy of its socket (to hang it up).
type Conns = Arc<Mutex<Vec<(Log, UnixStream)>>>;

/// Fake backends on `path`, one per connection, as `o` says.
fn listen(path: &std::path::Path, o: Opts) -> Conns {
    let l = UnixListener::bind(path).unwrap();
    let conns: Conns = Arc::default();
    let c = conns.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            let log: Log = Arc::default();
            iopath_devices::lock(&c).push((log.clone(), s.try_clone().unwrap()));
            std::thread::spawn(move || fake_backend(s, log, o, Arc::default()));
        }
    });
    conns
}

#[test]
fn a_backend_that_hangs_up_is_connected_to_again_and_its_session_replayed_with_the_kept_inflight_region() {
    let dir = std::env::temp_dir().join(format!("iopath-vu-fe-reconnect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vu.sock");
    let _ = std::fs::remove_file(&path);
    let conns = listen(&path, Opts { inflight: true, ..Default::default() });
    let again = Reconnect::Socket { path: path.clone(), wait: Duration::from_secs(10) };
    let d = connect_again(UnixStream::connect(&path).unwrap(), None, "vhost-user-blk", 1, Some(again)).unwrap();
    let mem = ram();
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = failed.clone();
    let mut ctx = DeviceContext::detached(mem.clone());
    ctx.ioevents = Arc::new(IoEvents);
    ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
    d.attach(ctx);

    // The driver: queue 0 on rings at 0x1000.. (used ring at 0x3000), DRIVER_OK.
    w(&d, 0x14, 0, 1);
    features_ok(&d);
    w(&d, 0x16, 0, 2);
    w(&d, 0x18, 8, 2);
    start_queue(&d, 0);
    w(&d, 0x14, 3 | 8 | 4, 1);
    let first = iopath_devices::lock(&conns)[0].0.clone();
    let reqs = |l: &Log| iopath_devices::lock(l).iter().map(|m| m.0).collect::<Vec<_>>();
    let r = reqs(&first);
    assert!(r.contains(&31) && r.contains(&32), "GET and SET_INFLIGHT_FD at DRIVER_OK: {r:?}");
    assert_eq!(counter(&d, "inflight_shmfd"), 1);

    // The backend completed 5 requests (the guest sees used index 5), then dies.
    use vm_memory::Bytes;
    mem.write_obj(5u16, GuestAddress(0x3002)).unwrap();
    iopath_devices::lock(&conns)[0].1.shutdown(std::net::Shutdown::Both).unwrap();
    eventually("a reconnect", || counter(&d, "reconnects") == 1);
    let second = iopath_devices::lock(&conns)[1].0.clone();
    eventually("the replay's SET_VRING_ENABLE", || reqs(&second).contains(&18));
    let log = iopath_devices::lock(&second).clone();
    let r: Vec<u32> = log.iter().map(|m| m.0).collect();
    // Handshake, then features, memory, the kept region (SET only, with its fd), the ring.
    assert_eq!(&r[..5], &[3, 1, 15, 16, 24], "{r:?}");
    assert_eq!(&r[5..], &[2, 5, 32, 8, 9, 10, 13, 12, 18], "{r:?}");
    let set_inflight = log.iter().find(|m| m.0 == 32).unwrap();
    assert_eq!((set_inflight.1, set_inflight.2), (8192, 1), "the region GET_INFLIGHT_FD gave, its fd");
    let base = log.iter().find(|m| m.0 == 10).unwrap().1;
    assert_eq!(base, 5 << 32, "SET_VRING_BASE {{queue 0, the used index the guest sees}}");
    assert!(failed.lock().unwrap().is_empty(), "{:?}", failed.lock().unwrap());
    assert_eq!(r.iter().filter(|&&q| q == 31).count(), 0, "no second GET_INFLIGHT_FD");

    // A reset reaches the new backend; the next DRIVER_OK asks for a new region.
    w(&d, 0x14, 0, 1);
    eventually("GET_VRING_BASE at reset", || reqs(&second).contains(&11));
    features_ok(&d);
    w(&d, 0x16, 0, 2);
    w(&d, 0x18, 8, 2);
    start_queue(&d, 0);
    w(&d, 0x14, 3 | 8 | 4, 1);
    assert!(reqs(&second).contains(&31), "a new region after reset: {:?}", reqs(&second));
    assert!(failed.lock().unwrap().is_empty(), "{:?}", failed.lock().unwrap());
    d.quiesce();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_backend_that_comes_not_back_within_the_wait_makes_the_device_need_reset_and_stops_the_run() {
    let dir = std::env::temp_dir().join(format!("iopath-vu-fe-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vu.sock");
    let _ = std::fs::remove_file(&path);
    let conns = listen(&path, Opts { inflight: true, ..Default::default() });
    let again = Reconnect::Socket { path: dir.join("elsewhere.sock"), wait: Duration::from_millis(100) };
    let d = connect_again(UnixStream::connect(&path).unwrap(), None, "vhost-user-blk", 1, Some(again)).unwrap();
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let f = failed.clone();
    let mut ctx = DeviceContext::detached(ram());
    ctx.ioevents = Arc::new(IoEvents);
    ctx.fail = Arc::new(move |m| iopath_devices::lock(&f).push(m));
    d.attach(ctx);
    iopath_devices::lock(&conns)[0].1.shutdown(std::net::Shutdown::Both).unwrap();
    eventually("the run stopped", || !failed.lock().unwrap().is_empty());
    let why = failed.lock().unwrap()[0].clone();
    assert!(why.contains("an external server closed its socket") && why.contains("did not accept again"), "{why}");
    assert_eq!(r(&d, 0x14, 1) & 0x40, 0x40, "DEVICE_NEEDS_RESET");
    assert_eq!(counter(&d, "reconnects"), 0);
    d.quiesce();
    let _ = std::fs::remove_dir_all(&dir);
}
