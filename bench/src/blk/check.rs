//! `bench blk`'s routing rules for the virtio and QEMU targets, as pure
//! functions of the counters a run reported and the guest's own counts, so
//! that each rule's failing cases are unit-tested. A counter the rule needs
//! that is missing fails it: iopath's devices report every counter, zeros
//! included, and each target here always runs the device whose counters it
//! reads.

/// The path a virtio target's notifications are meant to take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VirtioPath {
    /// `notify=exit`: every notify the guest writes exits to the device.
    Exit,
    /// `notify=ioeventfd` (in the VMM or a device process): every notify is
    /// a KVM ioeventfd the device thread reads; none exits; nothing polls.
    Ioeventfd,
    /// `notify=poll`: as ioeventfd, and the device thread polled: it went to
    /// sleep at least once (only the poller sleeps), and never more often
    /// than it was woken by a kick.
    Poll,
    /// iopath's VMM as vhost-user frontend of iopath's backend: the notify
    /// register is a KVM ioeventfd the backend reads (`kick_ioeventfd` 1),
    /// no notify exits or is forwarded, the backend served every I/O.
    VhostUser,
}

/// What the guest counted in its run.
#[derive(Clone, Copy, Debug)]
pub struct Guest {
    pub ios: u64,
    pub notifies: u64,
}

/// A rule's verdict: the counters it read, and whether they are the path's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub text: String,
    pub ok: bool,
}

/// Looks a counter up by name (None: not reported).
pub type Counters<'a> = &'a dyn Fn(&str) -> Option<u64>;

fn show(v: Option<u64>) -> String {
    v.map_or_else(|| "missing".to_string(), |v| v.to_string())
}

/// Checks a virtio target's device counters (`c` looks one up by name)
/// against what its path must give for the guest's I/Os and notifies.
pub fn virtio(path: VirtioPath, c: Counters, g: Guest) -> Verdict {
    let (requests, notifies, kicks, sleeps) = (c("requests"), c("notifies"), c("kicks"), c("sleeps"));
    let mut text = format!(
        "device requests={} notifies(exits)={} kicks={} sleeps={} for {} guest I/Os, {} guest notifies",
        show(requests),
        show(notifies),
        show(kicks),
        show(sleeps),
        g.ios,
        g.notifies
    );
    let every_io = requests == Some(g.ios);
    let ok = match path {
        VirtioPath::Exit => every_io && notifies == Some(g.notifies) && kicks == Some(0),
        VirtioPath::Ioeventfd => every_io && kicks == Some(g.notifies) && notifies == Some(0) && sleeps == Some(0),
        VirtioPath::Poll => {
            every_io
                && kicks == Some(g.notifies)
                && notifies == Some(0)
                && sleeps.zip(kicks).is_some_and(|(s, k)| s >= 1 && s <= k)
        }
        VirtioPath::VhostUser => {
            // The frontend's own counters (notifies is the transport's) and
            // the backend's, which the device process it started reported.
            let (reg, fwd, breq) = (c("kick_ioeventfd"), c("kicks_forwarded"), c("backend.requests"));
            let (bkicks, bsleeps) = (c("backend.kicks"), c("backend.sleeps"));
            text = format!(
                "frontend notifies(exits)={} kick_ioeventfd={} kicks_forwarded={}; backend requests={} kicks={} \
                 sleeps={} for {} guest I/Os, {} guest notifies",
                show(notifies),
                show(reg),
                show(fwd),
                show(breq),
                show(bkicks),
                show(bsleeps),
                g.ios,
                g.notifies
            );
            notifies == Some(0) && reg == Some(1) && fwd == Some(0) && breq == Some(g.ios)
        }
    };
    Verdict { text, ok }
}

/// QEMU's vhost-user-blk-pci on iopath's backend: the backend's counters
/// (its disconnect line; None if it printed none) must show every guest I/O
/// served there.
pub fn qemu_vhost_user(backend: Option<Counters>, g: Guest) -> Verdict {
    let Some(c) = backend else {
        return Verdict { text: "backend printed no counters after QEMU left".into(), ok: false };
    };
    let (requests, kicks, sleeps) = (c("requests"), c("kicks"), c("sleeps"));
    Verdict {
        text: format!(
            "backend requests={} kicks={} sleeps={} for {} guest I/Os, {} guest notifies",
            show(requests),
            show(kicks),
            show(sleeps),
            g.ios,
            g.notifies
        ),
        ok: requests == Some(g.ios),
    }
}

/// QEMU's virtio-blk-pci: its block layer's operations on the drive
/// (QMP `query-blockstats` when the guest's window ended, read + write;
/// Err: why there are none) must be the guest's I/Os. The window ends with
/// every I/O completed, and QEMU counts an operation when it completes.
pub fn qemu_virtio(stats: Result<(u64, u64), &str>, g: Guest) -> Verdict {
    match stats {
        Ok((rd, wr)) => Verdict {
            text: format!("QEMU blockstats rd_operations={rd} wr_operations={wr} for {} guest I/Os", g.ios),
            ok: rd.checked_add(wr) == Some(g.ios),
        },
        Err(e) => Verdict { text: format!("no QEMU blockstats: {e}"), ok: false },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters<'a>(kv: &'a [(&'a str, u64)]) -> impl Fn(&str) -> Option<u64> + 'a {
        move |n| kv.iter().find(|(k, _)| *k == n).map(|(_, v)| *v)
    }

    const G: Guest = Guest { ios: 100, notifies: 7 };

    #[test]
    fn each_virtio_path_holds_on_its_own_counters() {
        let exit = [("requests", 100), ("notifies", 7), ("kicks", 0), ("sleeps", 0)];
        assert!(virtio(VirtioPath::Exit, &counters(&exit), G).ok);
        let ioeventfd = [("requests", 100), ("notifies", 0), ("kicks", 7), ("sleeps", 0)];
        assert!(virtio(VirtioPath::Ioeventfd, &counters(&ioeventfd), G).ok);
        let poll = [("requests", 100), ("notifies", 0), ("kicks", 7), ("sleeps", 3)];
        let v = virtio(VirtioPath::Poll, &counters(&poll), G);
        assert!(v.ok && v.text.contains("sleeps=3"), "{v:?}");
        let vhost = [
            ("notifies", 0),
            ("kick_ioeventfd", 1),
            ("kicks_forwarded", 0),
            ("backend.requests", 100),
            ("backend.kicks", 7),
            ("backend.sleeps", 0),
        ];
        let v = virtio(VirtioPath::VhostUser, &counters(&vhost), G);
        assert!(v.ok && v.text.contains("backend requests=100"), "{v:?}");
    }

    #[test]
    fn a_vhost_user_run_without_the_backends_requests_fails() {
        let c = [("notifies", 0), ("kick_ioeventfd", 1), ("kicks_forwarded", 0)];
        let v = virtio(VirtioPath::VhostUser, &counters(&c), G);
        assert!(!v.ok && v.text.contains("backend requests=missing"), "{v:?}");
        // Not even the frontend's own counters: nothing is assumed zero.
        assert!(!virtio(VirtioPath::VhostUser, &counters(&[("backend.requests", 100)]), G).ok);
        // The backend served fewer (or more) requests than the guest did I/Os.
        let c = [("notifies", 0), ("kick_ioeventfd", 1), ("kicks_forwarded", 0), ("backend.requests", 99)];
        assert!(!virtio(VirtioPath::VhostUser, &counters(&c), G).ok);
        // A notify that exited, or that the VMM forwarded, or no ioeventfd.
        for (k, v) in [("notifies", 1), ("kicks_forwarded", 1), ("kick_ioeventfd", 0)] {
            let mut c = vec![("notifies", 0), ("kick_ioeventfd", 1), ("kicks_forwarded", 0), ("backend.requests", 100)];
            c.iter_mut().find(|x| x.0 == k).unwrap().1 = v;
            assert!(!virtio(VirtioPath::VhostUser, &counters(&c), G).ok, "{k}={v}");
        }
    }

    #[test]
    fn ioeventfd_fails_on_an_exit_a_missing_kick_or_a_sleep() {
        let base = [("requests", 100), ("notifies", 0), ("kicks", 7), ("sleeps", 0)];
        for (k, v) in [("notifies", 1), ("kicks", 6), ("requests", 99), ("sleeps", 1)] {
            let mut c = base.to_vec();
            c.iter_mut().find(|x| x.0 == k).unwrap().1 = v;
            assert!(!virtio(VirtioPath::Ioeventfd, &counters(&c), G).ok, "{k}={v}");
        }
        // Missing counters are not zeros.
        assert!(!virtio(VirtioPath::Ioeventfd, &counters(&base[..3]), G).ok);
        assert!(!virtio(VirtioPath::Ioeventfd, &counters(&[("requests", 100), ("kicks", 7), ("sleeps", 0)]), G).ok);
    }

    #[test]
    fn exit_fails_when_a_notify_did_not_exit_or_was_a_kick() {
        assert!(!virtio(VirtioPath::Exit, &counters(&[("requests", 100), ("notifies", 6), ("kicks", 0)]), G).ok);
        assert!(!virtio(VirtioPath::Exit, &counters(&[("requests", 100), ("notifies", 7), ("kicks", 1)]), G).ok);
        assert!(!virtio(VirtioPath::Exit, &counters(&[("requests", 100), ("notifies", 7)]), G).ok);
    }

    #[test]
    fn a_poll_that_never_polled_fails() {
        // The ioeventfd path's counters: the thread never slept, so it never polled.
        let never = [("requests", 100), ("notifies", 0), ("kicks", 7), ("sleeps", 0)];
        let v = virtio(VirtioPath::Poll, &counters(&never), G);
        assert!(!v.ok && v.text.contains("sleeps=0"), "{v:?}");
        // Slept more often than anything woke it: not a poller's counts.
        assert!(
            !virtio(VirtioPath::Poll, &counters(&[("requests", 100), ("notifies", 0), ("kicks", 7), ("sleeps", 8)]), G)
                .ok
        );
        // No sleeps counter at all.
        assert!(!virtio(VirtioPath::Poll, &counters(&never[..3]), G).ok);
    }

    #[test]
    fn qemu_rows_need_their_device_counts() {
        let b = [("requests", 100), ("kicks", 5)];
        assert!(qemu_vhost_user(Some(&counters(&b)), G).ok);
        assert!(!qemu_vhost_user(Some(&counters(&[("requests", 99)])), G).ok);
        assert!(!qemu_vhost_user(Some(&counters(&[("kicks", 5)])), G).ok, "no requests counter");
        assert!(!qemu_vhost_user(None, G).ok);
        assert!(qemu_virtio(Ok((60, 40)), G).ok);
        assert!(!qemu_virtio(Ok((60, 39)), G).ok);
        assert!(!qemu_virtio(Ok((u64::MAX, 1)), G).ok);
        let v = qemu_virtio(Err("QEMU exited first"), G);
        assert!(!v.ok && v.text.contains("QEMU exited first"), "{v:?}");
    }
}
