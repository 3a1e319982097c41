//! The frontend with several queues (`queues=N`): what the connect asks
//! of the backend, which rings DRIVER_OK starts (each with its own kick
//! and call), their calls' vectors, and reset.

use super::*;

/// (request, queue index) of the messages from the `from`th on.
fn by_queue(rig: &Rig, from: usize) -> Vec<(u32, u64)> {
    iopath_devices::lock(&rig.log)[from..].iter().map(|m| (m.0, m.1 & 0xff)).collect()
}

/// The driver: reset, features (VERSION_1, EVENT_IDX, MQ), MSI-X on with
/// vectors 0..=2 unmasked, queue q set up on its own rings with vector
/// `vectors[q]` (None: left disabled), DRIVER_OK.
fn up(rig: &Rig, vectors: &[Option<u16>]) {
    let d = &rig.d;
    w(d, 0x14, 0, 1);
    w(d, 0x14, 3, 1);
    let f = VERSION_1 | EVENT_IDX | (1 << 12);
    for sel in 0..2u64 {
        w(d, 0x08, sel, 4);
        w(d, 0x0c, (f >> (32 * sel)) & 0xffff_ffff, 4);
    }
    w(d, 0x14, 3 | 8, 1);
    for v in 0..3u64 {
        w(d, 0x4000 + 16 * v, 0xfee0_0000, 4);
        w(d, 0x4000 + 16 * v + 8, 0x30 + v, 4);
        w(d, 0x4000 + 16 * v + 12, 0, 4);
    }
    rig.msix(true);
    for (q, v) in vectors.iter().enumerate() {
        let Some(v) = v else { continue };
        let base = 0x10000 * q as u64;
        w(d, 0x16, q as u64, 2);
        w(d, 0x18, 8, 2);
        w(d, 0x1a, *v as u64, 2);
        start_queue(d, base);
    }
    w(d, 0x14, 3 | 8 | 4, 1);
}

/// A ring's set-up messages at DRIVER_OK, in order.
const RING: [u32; 6] = [8, 9, 10, 13, 12, 18];

#[test]
fn each_enabled_queue_gets_its_ring_kick_and_call_and_each_is_stopped_at_reset() {
    let irq = Irq::new(); // vector 1 is an irqfd; 2 is not: its calls are relayed
    let rig = Rig::new(Opts { queue_num: Some(4), queues: 2, ..Opts::default() }, irq.clone(), None);
    assert_eq!(rig.reqs(0), [3, 1, 15, 16, 17, 24], "GET_QUEUE_NUM, then the configuration");
    let d = &rig.d;
    assert_eq!((r(d, 0x12, 2), r(d, 0x2000 + 34, 2)), (2, 2), "the function's 2 queues, not the backend's 4");
    w(d, 0x00, 0, 4);
    assert_ne!(r(d, 0x04, 4) & (1 << 12), 0, "MQ");

    let sent = rig.sent();
    up(&rig, &[Some(1), Some(2)]);
    let want: Vec<(u32, u64)> =
        [(2, 0), (5, 0)].into_iter().chain(RING.iter().map(|&m| (m, 0))).chain(RING.iter().map(|&m| (m, 1))).collect();
    let got = by_queue(&rig, sent);
    assert_eq!((got[0].0, got[1].0), (2, 5));
    assert_eq!(got[2..], want[2..], "queue 0's ring, then queue 1's");
    assert_eq!(call_msgs(&rig, sent), 2, "a call fd each");
    let kicks = iopath_devices::lock(&rig.log)[sent..].iter().filter(|m| m.0 == 12 && m.2 == 1).count();
    assert_eq!(kicks, 2, "a kick fd each");
    assert_eq!(r(d, 0x14, 1), 3 | 8 | 4, "no NEEDS_RESET");
    assert_eq!((counter(d, "activations"), counter(d, "call_irqfd"), counter(d, "kick_ioeventfd")), (1, 1, 1));

    // Queue 1's backend calls on its own fd: the VMM relays them to its vector 2.
    let call1 = iopath_devices::lock(&rig.calls)[1].try_clone().unwrap();
    iopath_devices::lock(&irq.msix).clear();
    (&call1).write_all(&1u64.to_ne_bytes()).unwrap();
    eventually("vector 2 raised", || iopath_devices::lock(&irq.msix).contains(&2));
    assert!(!iopath_devices::lock(&irq.msix).contains(&1), "{:?}", irq.msix);
    // Queue 0's is vector 1's irqfd: KVM injects, no VMM thread.
    let call0 = iopath_devices::lock(&rig.calls)[0].try_clone().unwrap();
    (&call0).write_all(&1u64.to_ne_bytes()).unwrap();
    assert_eq!(irq.irqfd.read().unwrap(), 1);

    // Reset stops both rings.
    let sent = rig.sent();
    w(d, 0x14, 0, 1);
    assert_eq!(by_queue(&rig, sent), [(18, 0), (11, 0), (18, 1), (11, 1)]);
    assert_eq!(counter(d, "backend_errors"), 0);
    rig.d.quiesce();
}

#[test]
fn a_queue_the_driver_leaves_disabled_is_never_started_nor_kicked() {
    let rig = Rig::new(Opts { queue_num: Some(2), queues: 2, ..Opts::default() }, Irq::new(), None);
    let sent = rig.sent();
    up(&rig, &[Some(1), None]);
    let got = by_queue(&rig, sent);
    assert_eq!(got[2..], RING.iter().map(|&m| (m, 0)).collect::<Vec<_>>()[..], "queue 0 only");
    // Notify writes that exit: queue 0's is passed on, queue 1's goes nowhere.
    w(&rig.d, 0x3004, 1, 2);
    assert_eq!(counter(&rig.d, "kicks_forwarded"), 0);
    w(&rig.d, 0x3000, 0, 2);
    assert_eq!((counter(&rig.d, "notifies"), counter(&rig.d, "kicks_forwarded")), (2, 1));
    let sent = rig.sent();
    w(&rig.d, 0x14, 0, 1);
    assert_eq!(by_queue(&rig, sent), [(18, 0), (11, 0)]);
    rig.d.quiesce();
}

#[test]
fn a_vector_change_gives_only_that_queue_a_new_call_fd() {
    let irq = Irq::new();
    let rig = Rig::new(Opts { queue_num: Some(2), queues: 2, ..Opts::default() }, irq, None);
    up(&rig, &[Some(1), Some(2)]);
    let sent = rig.sent();
    w(&rig.d, 0x16, 1, 2);
    w(&rig.d, 0x1a, 1, 2); // queue 1 joins queue 0 on vector 1 (an irqfd)
    assert_eq!(by_queue(&rig, sent), [(13, 1)]);
    assert_eq!((counter(&rig.d, "call_changes"), counter(&rig.d, "call_irqfd")), (1, 2));
    assert_eq!(r(&rig.d, 0x14, 1), 3 | 8 | 4);
    rig.d.quiesce();
}

#[test]
fn more_queues_than_the_backend_serves_fail_the_connect_saying_why() {
    for (o, want) in [
        (Opts { queue_num: None, ..Opts::default() }, "protocol feature MQ"),
        (Opts { queue_num: Some(2), ..Opts::default() }, "the backend has 2 (GET_QUEUE_NUM)"),
    ] {
        let (mine, theirs) = UnixStream::pair().unwrap();
        std::thread::spawn(move || fake_backend(theirs, Log::default(), o, Calls::default()));
        match VhostUserBlk::handshake(mine, None, "vhost-user-blk", 3) {
            Ok(_) => panic!("3 queues from a backend that serves fewer"),
            Err(e) => assert!(e.to_string().contains(want), "{e}"),
        }
    }
    let (mine, _theirs) = UnixStream::pair().unwrap();
    let e = VhostUserBlk::handshake(mine, None, "vhost-user-blk", 17).err().unwrap().to_string();
    assert!(e.contains("17 queues"), "{e}");
}
