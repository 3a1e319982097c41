//! Guest RAM offered without an fd (QEMU's RAM without `share=on`): the
//! server reaches it with DMA_READ / DMA_WRITE messages to the client, from
//! the session's handler (doorbell=mmio serves a queue inside the doorbell's
//! REGION_WRITE) and from device threads (doorbell=bar's poller), while the
//! client goes on sending commands.
//!
//! The client here is written for the test, as the rust-vmm `vfio_user`
//! client does not answer DMA_READ/DMA_WRITE (and always sends an fd with
//! DMA_MAP): a reader thread answers the server's requests from the
//! client's own buffer, as QEMU's vfio-user proxy does from guest RAM, and
//! hands replies to the thread that waits for them.

use super::super::wire::*;
use super::super::{recv, send, IoFds, Received, VfioUserServer};
use crate::function::PciFunction;
use crate::testing::sealed_memfd;
use crate::transport::Server;
use crate::Result;
use iopath_devices::irq::IrqLines;
use iopath_devices::{Counter, DeviceConfig};
use serde_json::json;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Guest RAM the client offers without an fd: `BASE..BASE + LEN`.
const BASE: u64 = 0x4000_0000;
const LEN: usize = 0x40000;
const ASQ: u64 = BASE;
const ACQ: u64 = BASE + 0x1000;
const IOSQ: u64 = BASE + 0x2000;
const IOCQ: u64 = BASE + 0x3000;
const IDENT: u64 = BASE + 0x4000;
const LIST: u64 = BASE + 0x5000;
/// 16 KiB written from here...
const SRC: u64 = BASE + 0x10000;
/// ...and read back to here.
const DST: u64 = BASE + 0x20000;
const QSIZE: u64 = 16;
/// The largest DMA payload the client takes (VERSION max_data_xfer_size):
/// a 16 KiB transfer is split.
const MAX_XFER: usize = 8192;
/// Where an fd-backed map of queues sits in the mixed tests.
const FD_BASE: u64 = 0x10_0000;

/// What the client's reader thread does with the server's DMA requests.
#[derive(Default)]
struct DmaSide {
    /// Answer them (off: keep them unanswered in `held`).
    answer: AtomicBool,
    held: Mutex<Vec<Received>>,
    reads: AtomicU64,
    writes: AtomicU64,
    /// The largest `count` the server asked for.
    largest: AtomicU64,
}

/// A vfio-user client whose guest RAM has no fd.
struct Client {
    sock: Arc<Mutex<UnixStream>>,
    ram: Arc<Mutex<Vec<u8>>>,
    dma: Arc<DmaSide>,
    replies: Receiver<Received>,
    id: u16,
}

impl Client {
    fn new(sock: UnixStream) -> Client {
        let ram = Arc::new(Mutex::new(vec![0u8; LEN]));
        let dma = Arc::new(DmaSide { answer: AtomicBool::new(true), ..Default::default() });
        let writer = Arc::new(Mutex::new(sock.try_clone().unwrap()));
        let (tx, replies) = channel();
        let (ram2, dma2, w2) = (ram.clone(), dma.clone(), writer.clone());
        std::thread::spawn(move || {
            while let Ok(Some(m)) = recv(&sock) {
                if m.hdr.is_reply() {
                    let _ = tx.send(m);
                } else if dma2.answer.load(Ordering::Relaxed) {
                    let r = serve_dma(&ram2, &dma2, &m);
                    let _ = send(&w2.lock().unwrap(), &r, &[]);
                } else {
                    dma2.held.lock().unwrap().push(m);
                }
            }
        });
        Client { sock: writer, ram, dma, replies, id: 0 }
    }

    fn call(&mut self, cmd: Command, payload: &[u8], fds: &[i32]) -> Received {
        self.id = self.id.wrapping_add(1);
        send(&self.sock.lock().unwrap(), &message(self.id, cmd, FLAGS_TYPE_COMMAND, payload), fds).unwrap();
        let r = self.replies.recv_timeout(Duration::from_secs(20)).expect("a reply");
        assert!(r.hdr.msg_id == self.id && r.hdr.cmd == cmd as u16, "{:?}", r.hdr);
        r
    }

    fn ok(&mut self, cmd: Command, payload: &[u8], fds: &[i32]) -> Received {
        let r = self.call(cmd, payload, fds);
        assert!(!r.hdr.is_error(), "{cmd:?} failed with errno {}", r.hdr.error_no);
        r
    }

    /// VERSION with a small max_data_xfer_size, then RAM without an fd.
    fn attach(&mut self) {
        let caps = json!({"capabilities": {"max_msg_fds": 16, "max_data_xfer_size": MAX_XFER}}).to_string();
        self.ok(Command::Version, &[&[0, 0, 2, 0][..], caps.as_bytes(), &[0]].concat(), &[]);
        let map = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: BASE, size: LEN as u64 };
        self.ok(Command::DmaMap, &map.to_bytes(), &[]);
    }

    fn write_mem(&self, gpa: u64, data: &[u8]) {
        let o = (gpa - BASE) as usize;
        self.ram.lock().unwrap()[o..o + data.len()].copy_from_slice(data);
    }

    fn read_mem(&self, gpa: u64, len: usize) -> Vec<u8> {
        let o = (gpa - BASE) as usize;
        self.ram.lock().unwrap()[o..o + len].to_vec()
    }
}

impl Drop for Client {
    /// Leaves: the reader thread holds a copy of the socket, so close it for both.
    fn drop(&mut self) {
        let _ = self.sock.lock().unwrap().shutdown(std::net::Shutdown::Both);
    }
}

/// The client's answer to a DMA_READ or DMA_WRITE, from its RAM.
fn serve_dma(ram: &Mutex<Vec<u8>>, dma: &DmaSide, m: &Received) -> Vec<u8> {
    let span = |a: &DmaAccess| {
        let o = a.address.checked_sub(BASE)? as usize;
        let e = o.checked_add(a.count as usize).filter(|&e| e <= LEN)?;
        Some(o..e)
    };
    match m.hdr.command() {
        Some(Command::DmaRead) => {
            let a = DmaAccess::parse(&m.payload).unwrap();
            dma.reads.fetch_add(1, Ordering::Relaxed);
            dma.largest.fetch_max(a.count, Ordering::Relaxed);
            match span(&a) {
                Some(r) => reply(&m.hdr, &DmaAccess::to_bytes_with_data(a.address, &ram.lock().unwrap()[r])),
                None => error_reply(&m.hdr, libc::EFAULT),
            }
        }
        Some(Command::DmaWrite) => {
            let (a, data) = DmaAccess::parse_with_data(&m.payload).unwrap();
            dma.writes.fetch_add(1, Ordering::Relaxed);
            dma.largest.fetch_max(a.count, Ordering::Relaxed);
            match span(&a) {
                Some(r) => {
                    ram.lock().unwrap()[r].copy_from_slice(data);
                    // QEMU's reply: the header alone.
                    reply(&m.hdr, &[])
                }
                None => error_reply(&m.hdr, libc::EFAULT),
            }
        }
        _ => error_reply(&m.hdr, libc::ENOSYS),
    }
}

/// An NVMe driver over the client: registers as REGION_WRITE/READ,
/// doorbells too (in bar mode the server stores them in the page its poller
/// reads), queues in the client's RAM unless `queues` says where.
struct Driver {
    c: Client,
    tails: [u64; 2],
    heads: [u64; 2],
    phase: [bool; 2],
    cid: u16,
    /// Queue base addresses (admin SQ, admin CQ, I/O SQ, I/O CQ) and the
    /// memfd behind them if they are in an fd-backed map.
    queues: [u64; 4],
    queue_fd: Option<std::fs::File>,
}

impl Driver {
    fn new(c: Client) -> Driver {
        Driver {
            c,
            tails: [0; 2],
            heads: [0; 2],
            phase: [true; 2],
            cid: 0,
            queues: [ASQ, ACQ, IOSQ, IOCQ],
            queue_fd: None,
        }
    }

    /// Queues in an fd-backed map at FD_BASE instead (data stays without an fd).
    fn queues_in_an_fd_map(&mut self) {
        let f = sealed_memfd("queues", 0x4000);
        let map = DmaMap { flags: 3, offset: 0, address: FD_BASE, size: 0x4000 };
        self.c.ok(Command::DmaMap, &map.to_bytes(), &[f.as_raw_fd()]);
        self.queues = [FD_BASE, FD_BASE + 0x1000, FD_BASE + 0x2000, FD_BASE + 0x3000];
        self.queue_fd = Some(f);
    }

    fn qwrite(&self, gpa: u64, data: &[u8]) {
        match &self.queue_fd {
            Some(f) => f.write_all_at(data, gpa - FD_BASE).unwrap(),
            None => self.c.write_mem(gpa, data),
        }
    }

    fn qread(&self, gpa: u64, len: usize) -> Vec<u8> {
        match &self.queue_fd {
            Some(f) => {
                let mut b = vec![0u8; len];
                f.read_exact_at(&mut b, gpa - FD_BASE).unwrap();
                b
            }
            None => self.c.read_mem(gpa, len),
        }
    }

    fn reg_write(&mut self, offset: u64, data: &[u8]) {
        self.c.ok(Command::RegionWrite, &RegionAccess::to_bytes_with_data(offset, 0, data), &[]);
    }

    fn reg_read32(&mut self, offset: u64) -> u32 {
        let r = self.c.ok(Command::RegionRead, &RegionAccess { offset, region: 0, count: 4 }.to_bytes(), &[]);
        u32::from_le_bytes(r.payload[16..20].try_into().unwrap())
    }

    fn enable(&mut self) {
        self.reg_write(0x24, &(((QSIZE - 1) << 16 | (QSIZE - 1)) as u32).to_le_bytes());
        self.reg_write(0x28, &self.queues[0].to_le_bytes());
        self.reg_write(0x30, &self.queues[1].to_le_bytes());
        self.reg_write(0x14, &0x0046_0001u32.to_le_bytes());
        assert_eq!(self.reg_read32(0x1c) & 3, 1, "CSTS.RDY, no CFS");
    }

    /// Submits a command on queue `q` (0 admin, 1 I/O), waits for its
    /// completion (answering DMA meanwhile: the reader thread does) and
    /// returns its status.
    fn submit(&mut self, q: usize, opcode: u8, nsid: u32, prp: [u64; 2], cdw: [u32; 3]) -> u16 {
        self.cid += 1;
        let mut sqe = [0u8; 64];
        sqe[0] = opcode;
        sqe[2..4].copy_from_slice(&self.cid.to_le_bytes());
        sqe[4..8].copy_from_slice(&nsid.to_le_bytes());
        sqe[24..32].copy_from_slice(&prp[0].to_le_bytes());
        sqe[32..40].copy_from_slice(&prp[1].to_le_bytes());
        for (i, d) in cdw.iter().enumerate() {
            sqe[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        let (sq, cq) = (self.queues[2 * q], self.queues[2 * q + 1]);
        self.qwrite(sq + self.tails[q] * 64, &sqe);
        self.tails[q] = (self.tails[q] + 1) % QSIZE;
        self.reg_write(0x1000 + 8 * q as u64, &(self.tails[q] as u32).to_le_bytes());
        let t0 = Instant::now();
        let cqe = loop {
            let cqe = self.qread(cq + self.heads[q] * 16, 16);
            if (cqe[14] & 1 == 1) == self.phase[q] {
                break cqe;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "no completion for cid {}", self.cid);
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), self.cid);
        self.heads[q] = (self.heads[q] + 1) % QSIZE;
        if self.heads[q] == 0 {
            self.phase[q] = !self.phase[q];
        }
        self.reg_write(0x1004 + 8 * q as u64, &(self.heads[q] as u32).to_le_bytes());
        u16::from_le_bytes([cqe[14], cqe[15]]) >> 1
    }

    fn identify(&mut self) -> u16 {
        self.submit(0, 0x06, 0, [IDENT, 0], [1, 0, 0])
    }

    fn create_io_queues(&mut self) {
        let size = ((QSIZE - 1) as u32) << 16;
        assert_eq!(self.submit(0, 0x05, 0, [self.queues[3], 0], [size | 1, 1, 0]), 0, "Create I/O CQ 1");
        assert_eq!(self.submit(0, 0x01, 0, [self.queues[2], 0], [size | 1, 1 << 16 | 1, 0]), 0, "Create I/O SQ 1");
    }

    /// 16 KiB (32 LBAs from LBA 8) from or to `buf`: PRP1 and a PRP list.
    fn rw16k(&mut self, write: bool, buf: u64) -> u16 {
        let list: Vec<u8> = (1..4u64).flat_map(|i| (buf + i * 0x1000).to_le_bytes()).collect();
        self.c.write_mem(LIST, &list);
        self.submit(1, if write { 0x01 } else { 0x02 }, 1, [buf, LIST], [8, 0, 31])
    }
}

/// The server's thread: the session's end and the function's counters then.
type ServerThread = JoinHandle<(Result<()>, Vec<Counter>)>;

/// Serves `device` on a socketpair with a DMA timeout; returns the client's
/// end, the server thread (with the function's counters at the end).
fn serve(device: &str, timeout: Duration) -> (UnixStream, ServerThread) {
    let dev = device.parse::<DeviceConfig>().unwrap().build().unwrap();
    let f = Arc::new(Mutex::new(PciFunction::new(dev).unwrap()));
    let (a, b) = UnixStream::pair().unwrap();
    let h = std::thread::spawn(move || {
        let mut srv = VfioUserServer::new(f.clone(), IrqLines::new(), IoFds::IoEventFds);
        srv.set_dma_timeout(timeout);
        let r = srv.session(&b, "test");
        let c = f.lock().unwrap().counters();
        (r, c)
    });
    (a, h)
}

fn counter(c: &[Counter], name: &str) -> u64 {
    c.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no counter {name} in {c:?}")).value
}

#[test]
fn nvme_reaches_guest_ram_without_an_fd_through_dma_read_and_write_in_mmio_and_bar_modes() {
    for mode in ["mmio", "bar"] {
        let (sock, h) = serve(&format!("nvme,doorbell={mode},backend=ram,size_mb=1"), Duration::from_secs(5));
        let mut d = Driver::new(Client::new(sock));
        d.c.attach();
        d.enable();
        assert_eq!(d.identify(), 0, "{mode}: Identify Controller into RAM without an fd");
        assert_eq!(d.c.read_mem(IDENT, 2), 0x1234u16.to_le_bytes(), "{mode}: the VID arrived by DMA_WRITE");
        assert_eq!(&d.c.read_mem(IDENT + 24, 6), b"iopath", "{mode}: the model number");
        d.create_io_queues();
        let pat: Vec<u8> = (0..16384u32).map(|i| (i * 31 + 7) as u8).collect();
        d.c.write_mem(SRC, &pat);
        assert_eq!(d.rw16k(true, SRC), 0, "{mode}: write");
        assert_eq!(d.rw16k(false, DST), 0, "{mode}: read");
        assert_eq!(d.c.read_mem(DST, pat.len()), pat, "{mode}: the data came back");
        let (reads, writes) = (d.c.dma.reads.load(Ordering::Relaxed), d.c.dma.writes.load(Ordering::Relaxed));
        assert!(reads >= 4 && writes >= 4, "{mode}: {reads} DMA_READs, {writes} DMA_WRITEs");
        assert_eq!(d.c.dma.largest.load(Ordering::Relaxed), MAX_XFER as u64, "{mode}: 16 KiB split at the limit");
        drop(d);
        let (r, c) = h.join().unwrap();
        r.unwrap();
        assert_eq!(counter(&c, "errors"), 0, "{mode}: {c:?}");
        assert!(counter(&c, "dma.reads") >= reads && counter(&c, "dma.writes") >= writes, "{mode}: {c:?}");
        assert_eq!(counter(&c, "dma.timeouts"), 0);
    }
}

/// A client that stops answering DMA: the first request past its deadline makes the session
/// dead for DMA, so 8 queued writes (data in RAM without an fd) cost one deadline, not one each:
/// the later requests fail at once, every command completes with Data Transfer Error, and the
/// session ends saying why. Doorbells by REGION_WRITE (mmio: the handler serves the queue inside
/// it, and its reply never comes) and in the polled page (bar).
#[test]
fn a_client_that_does_not_answer_dma_ends_the_session_within_one_deadline_whatever_the_queue_depth() {
    let timeout = Duration::from_millis(1000);
    for mode in ["mmio", "bar"] {
        let (sock, h) = serve(&format!("nvme,doorbell={mode},backend=ram,size_mb=1"), timeout);
        let mut d = Driver::new(Client::new(sock));
        d.c.attach();
        d.queues_in_an_fd_map();
        d.enable();
        assert_eq!(d.identify(), 0);
        d.create_io_queues();
        d.c.dma.answer.store(false, Ordering::Relaxed);
        // 8 writes of 4 KiB from RAM without an fd, queued behind one doorbell.
        for i in 0..8u64 {
            let mut sqe = [0u8; 64];
            sqe[0] = 0x01;
            sqe[2..4].copy_from_slice(&(100 + i as u16).to_le_bytes());
            sqe[4..8].copy_from_slice(&1u32.to_le_bytes());
            sqe[24..32].copy_from_slice(&(SRC + i * 0x1000).to_le_bytes());
            sqe[40..44].copy_from_slice(&(8 * i as u32).to_le_bytes());
            sqe[48..52].copy_from_slice(&7u32.to_le_bytes());
            d.qwrite(d.queues[2] + i * 64, &sqe);
        }
        d.c.id = d.c.id.wrapping_add(1);
        let ring = message(
            d.c.id,
            Command::RegionWrite,
            FLAGS_TYPE_COMMAND,
            &RegionAccess::to_bytes_with_data(0x1008, 0, &8u32.to_le_bytes()),
        );
        let t0 = Instant::now();
        send(&d.c.sock.lock().unwrap(), &ring, &[]).unwrap();
        // Bounded even where the session would not end by itself: then the client leaves.
        while !h.is_finished() && t0.elapsed() < 12 * timeout {
            std::thread::sleep(Duration::from_millis(10));
        }
        let took = t0.elapsed();
        if !h.is_finished() {
            let _ = d.c.sock.lock().unwrap().shutdown(std::net::Shutdown::Both);
        }
        let (r, c) = h.join().unwrap();
        assert!(took < 2 * timeout, "{mode}: 8 unanswered commands took {took:?}, deadline {timeout:?}");
        let e = r.expect_err("the session ends with an error").to_string();
        assert!(e.contains("did not answer DmaRead"), "{mode}: {e}");
        assert_eq!(counter(&c, "dma.timeouts"), 1, "{mode}: one request timed out, the rest failed at once: {c:?}");
        // Every command completed with an NVMe error: Data Transfer Error (SCT 0, SC 4).
        let cqes = d.qread(d.queues[3], 8 * 16);
        let mut done: Vec<(u16, u16)> =
            cqes.chunks(16).map(|e| (u16::from_le_bytes([e[12], e[13]]), u16::from_le_bytes([e[14], e[15]]))).collect();
        done.sort();
        for (i, (cid, st)) in done.iter().enumerate() {
            assert_eq!((*cid, st & 1, st >> 1), (100 + i as u16, 1, 0x004), "{mode}: CQE {i}: {done:?}");
        }
        assert!(d.c.dma.held.lock().unwrap().len() <= 2, "{mode}: DMA requests sent after the first went unanswered");
    }
}

#[test]
fn a_client_that_leaves_fails_the_waiting_dma_at_once() {
    let (sock, h) = serve("nvme,doorbell=bar,backend=ram,size_mb=1", Duration::from_secs(60));
    let mut d = Driver::new(Client::new(sock));
    d.c.attach();
    d.queues_in_an_fd_map();
    d.enable();
    assert_eq!(d.identify(), 0);
    d.create_io_queues();
    // The poller's DMA_READ of the data is never answered; the client leaves.
    d.c.dma.answer.store(false, Ordering::Relaxed);
    let sqe_tail = d.tails[1];
    let mut sqe = [0u8; 64];
    sqe[0] = 0x01;
    sqe[4..8].copy_from_slice(&1u32.to_le_bytes());
    sqe[24..32].copy_from_slice(&SRC.to_le_bytes());
    d.qwrite(d.queues[2] + sqe_tail * 64, &sqe);
    d.reg_write(0x1008, &((sqe_tail as u32 + 1) % QSIZE as u32).to_le_bytes());
    let t0 = Instant::now();
    while d.c.dma.held.lock().unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "the poller sent no DMA_READ");
        std::thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    drop(d);
    let (r, c) = h.join().unwrap();
    r.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "the session waited {:?} for a client that left", t0.elapsed());
    assert_eq!(counter(&c, "dma.timeouts"), 0, "{c:?}");
}

#[test]
fn a_reply_to_nothing_the_server_sent_closes_the_channel_with_and_without_a_reader_thread() {
    for fdless in [false, true] {
        let (sock, h) = serve("nvme,doorbell=mmio,backend=null", Duration::from_secs(5));
        let mut c = Client::new(sock);
        let caps = json!({"capabilities": {"max_msg_fds": 16}}).to_string();
        c.ok(Command::Version, &[&[0, 0, 2, 0][..], caps.as_bytes(), &[0]].concat(), &[]);
        if fdless {
            // From here a reader thread takes the messages.
            let map = DmaMap { flags: 3, offset: 0, address: BASE, size: LEN as u64 };
            c.ok(Command::DmaMap, &map.to_bytes(), &[]);
        }
        let hdr = Header { msg_id: 77, cmd: Command::DmaRead as u16, msg_size: 0, flags: 0, error_no: 0 };
        send(&c.sock.lock().unwrap(), &reply(&hdr, &[]), &[]).unwrap();
        let (r, _) = h.join().unwrap();
        let e = r.unwrap_err().to_string();
        assert!(e.contains("message 77") && e.contains("reply"), "fdless={fdless}: {e}");
    }
}
