//! virtio-blk with several queues (`queues=N`) served over vfio-user: what a
//! client learns from the server. GET_REGION_IO_FDS announces each queue's
//! notify address (NOTIFY + 4 q) as an ioeventfd, all on the one eventfd the
//! device thread waits on (one fd in the reply); GET_IRQ_INFO gives N + 1
//! MSI-X vectors. The server runs in this process, on a socketpair.

use iopath_devices::irq::IrqLines;
use iopath_devices::virtio::pci::{notify_offset, NOTIFY};
use iopath_devices::DeviceConfig;
use iopath_protocols::function::PciFunction;
use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use iopath_protocols::vfio_user::{IoFds, VfioUserServer};
use iopath_protocols::Server;
use std::fs::File;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One vfio-user request and its reply: (error flag, errno, payload, fds).
fn request(sock: &UnixStream, id: u16, cmd: Command, payload: &[u8]) -> (bool, u32, Vec<u8>, Vec<File>) {
    socket::send(sock, &[&message(id, cmd, FLAGS_TYPE_COMMAND, payload)], &[]).unwrap();
    let mut h = [0u8; HEADER_SIZE];
    let mut files = socket::recv_exact(sock, &mut h).unwrap();
    let r = Header::parse(&h);
    let mut p = vec![0u8; r.payload_len().unwrap()];
    files.extend(socket::recv_exact(sock, &mut p).unwrap());
    assert_eq!((r.msg_id, r.cmd), (id, cmd as u16), "a reply to another request");
    (r.is_error(), r.error_no, p, files)
}

/// The device's counter `name`, read without stopping its thread.
fn counter(f: &Mutex<PciFunction>, name: &str) -> u64 {
    let c = f.lock().unwrap().device.counters();
    c.iter().find(|c| c.name == name).map_or(0, |c| c.value)
}

#[test]
fn each_queue_notify_address_is_announced_on_the_device_eventfd_and_each_queue_has_a_vector() {
    for queues in [1u16, 3, 16] {
        let device = format!("virtio-blk,backend=null,notify=ioeventfd,queues={queues}");
        let dev = device.parse::<DeviceConfig>().unwrap().build().unwrap();
        let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
        let mut srv = VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoEventFds);
        let (mine, theirs) = UnixStream::pair().unwrap();
        mine.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let t = std::thread::spawn(move || srv.session(&theirs, "test client").map_err(|e| e.to_string()));

        let caps = Capabilities { max_msg_fds: 16, ..Default::default() };
        let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
        let (err, errno, _, _) = request(&mine, 1, Command::Version, &v.to_bytes());
        assert!(!err, "VERSION refused: errno {errno}");

        // BAR 0: one entry per queue, at its notify address, any size and value; one fd.
        let q = IoFdsRequest { argsz: 4096, index: 0 };
        let (err, errno, p, mut fds) = request(&mine, 2, Command::DeviceGetRegionIoFds, &q.to_bytes());
        assert!(!err, "GET_REGION_IO_FDS refused: errno {errno}");
        let r = IoFdsReply::parse(&p).unwrap();
        let want: Vec<IoFdEntry> = (0..queues)
            .map(|q| IoFdEntry::IoEventFd { offset: notify_offset(q), size: 0, fd_index: 0, flags: 0, datamatch: 0 })
            .collect();
        assert_eq!(r.entries, want, "{queues} queues");
        assert_eq!(notify_offset(queues - 1), NOTIFY + 4 * (queues as u64 - 1));
        assert_eq!(fds.len(), 1, "{queues} queues: one eventfd for all");

        // That fd is the device thread's: a store KVM would signal wakes it (a kick).
        let mut kick = fds.pop().unwrap();
        kick.write_all(&1u64.to_ne_bytes()).unwrap();
        let t0 = Instant::now();
        while counter(&f, "kicks") != 1 {
            assert!(t0.elapsed() < Duration::from_secs(10), "the announced fd never woke the device thread");
            std::thread::sleep(Duration::from_millis(2));
        }

        // MSI-X: the configuration's vector and one per queue.
        let (err, errno, p, _) =
            request(&mine, 3, Command::DeviceGetIrqInfo, &IrqInfo::request(PCI_MSIX_IRQ_INDEX).to_bytes());
        assert!(!err, "GET_IRQ_INFO refused: errno {errno}");
        assert_eq!(IrqInfo::parse(&p).unwrap().count, queues as u32 + 1, "{queues} queues");

        drop(mine);
        t.join().unwrap().unwrap();
    }
}
