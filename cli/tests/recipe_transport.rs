//! The "How to add a transport" recipe (docs/ARCHITECTURE.md), checked: a function transport
//! that lives in this file only, "tiny" (fixed-size requests for configuration and BAR
//! accesses, each answered by a fixed-size reply, over a Unix stream; INTx's eventfds passed
//! with SCM_RIGHTS), implements `FunctionTransport` with a proxy and a server and carries the
//! scratch device (`common/scratch.rs`) from this process to iopath's VMM, with iopath's
//! guest image making real accesses to its BAR. No file of the library names it: if this test
//! needs a library edit to build or pass, the recipe is wrong. On the real /dev/kvm.

#[path = "common/scratch.rs"]
mod scratch;

use iopath_devices::irq::{eventfd_from, IrqLines};
use iopath_devices::{le_fill, le_value, BarSpec, Counter, DeviceContext, DeviceModelMut, PciIds, SharedDevice};
use iopath_protocols::function::{no_memory, probe, PciFunction};
use iopath_protocols::peer::Peer;
use iopath_protocols::process::DeviceProcess;
use iopath_protocols::{socket, Error, FunctionTransport, Result, Server};
use scratch::{check_device, counter, guest_accesses, Scratch};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The codec: a request is [`REQUEST`] bytes, little-endian: op (u16), BAR (u8), width (u8),
/// 4 reserved zero bytes, offset (u64), value (u64, what a write writes). A reply is
/// [`REPLY`] bytes: status (u32: 0 done, 1 refused), 4 reserved zero bytes, value (u64, what
/// a read read). Both are validated before use.
mod wire {
    pub const REQUEST: usize = 24;
    pub const REPLY: usize = 16;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Op {
        CfgRead = 1,
        CfgWrite = 2,
        BarRead = 3,
        BarWrite = 4,
        /// Two fds attached: INTx's trigger and resample eventfds.
        Intx = 5,
        Reset = 6,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Request {
        pub op: Op,
        pub bar: u8,
        pub width: u8,
        pub offset: u64,
        pub value: u64,
    }

    impl Request {
        pub fn new(op: Op, bar: u8, offset: u64, width: usize, value: u64) -> Self {
            Request { op, bar, width: width as u8, offset, value }
        }

        pub fn encode(&self) -> [u8; REQUEST] {
            let mut b = [0u8; REQUEST];
            b[0..2].copy_from_slice(&(self.op as u16).to_le_bytes());
            (b[2], b[3]) = (self.bar, self.width);
            b[8..16].copy_from_slice(&self.offset.to_le_bytes());
            b[16..24].copy_from_slice(&self.value.to_le_bytes());
            b
        }

        /// A known op, with a width it allows (1, 2, 4 for configuration, also 8 for a BAR,
        /// 0 for the others), a BAR index only on BAR ops (0..=5), zero reserved bytes.
        pub fn decode(b: &[u8; REQUEST]) -> Result<Request, String> {
            let op = match u16::from_le_bytes([b[0], b[1]]) {
                1 => Op::CfgRead,
                2 => Op::CfgWrite,
                3 => Op::BarRead,
                4 => Op::BarWrite,
                5 => Op::Intx,
                6 => Op::Reset,
                n => return Err(format!("unknown op {n}")),
            };
            let (bar, width) = (b[2], b[3]);
            let bar_op = matches!(op, Op::BarRead | Op::BarWrite);
            let widths: &[u8] = match op {
                Op::CfgRead | Op::CfgWrite => &[1, 2, 4],
                Op::BarRead | Op::BarWrite => &[1, 2, 4, 8],
                Op::Intx | Op::Reset => &[0],
            };
            if !widths.contains(&width) {
                return Err(format!("{op:?} of width {width}"));
            }
            if bar > 5 || (bar != 0 && !bar_op) {
                return Err(format!("{op:?} of BAR {bar}"));
            }
            if b[4..8] != [0; 4] {
                return Err(format!("{op:?} with reserved bytes {:02x?}", &b[4..8]));
            }
            let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
            Ok(Request { op, bar, width, offset: u64_at(8), value: u64_at(16) })
        }
    }

    pub fn encode_reply(done: bool, value: u64) -> [u8; REPLY] {
        let mut b = [0u8; REPLY];
        b[0..4].copy_from_slice(&u32::from(!done).to_le_bytes());
        b[8..16].copy_from_slice(&value.to_le_bytes());
        b
    }

    /// `Ok(Some(value))` done, `Ok(None)` refused.
    pub fn decode_reply(b: &[u8; REPLY]) -> Result<Option<u64>, String> {
        let value = u64::from_le_bytes(b[8..16].try_into().unwrap());
        match (u32::from_le_bytes(b[0..4].try_into().unwrap()), b[4..8] == [0; 4]) {
            (_, false) => Err(format!("a reply with reserved bytes {:02x?}", &b[4..8])),
            (0, true) => Ok(Some(value)),
            (1, true) => Ok(None),
            (s, true) => Err(format!("a reply of unknown status {s}")),
        }
    }
}

use wire::{Op, Request, REPLY, REQUEST};

/// The proxy counter of requests sent: the transport's crossings.
const MESSAGES: &str = "tiny.messages";
/// Of them, BAR accesses.
const BAR_MESSAGES: &str = "tiny.bar-messages";
/// The server's counter of requests received.
const RECEIVED: &str = "tiny.received";

/// The transport: a unit struct, as the registry's are.
struct Tiny;

impl FunctionTransport for Tiny {
    fn name(&self) -> &'static str {
        "tiny"
    }

    fn connect(&self, sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<SharedDevice> {
        Ok(Arc::new(Mutex::new(TinyProxy::connect(sock, child, name)?)))
    }

    /// The server's count of requests joins the function's counters.
    fn server(&self, f: Arc<Mutex<PciFunction>>, irq: Arc<IrqLines>) -> Result<Box<dyn Server>> {
        let received = Arc::new(AtomicU64::new(0));
        let r = received.clone();
        let count = move || vec![Counter { name: RECEIVED.into(), value: r.load(Ordering::Relaxed) }];
        iopath_devices::lock(&f).add_counters(Box::new(count));
        Ok(Box::new(TinyServer { f, irq, received }))
    }

    /// No message shares BAR memory: every access is a request.
    fn shares_bar_pages(&self) -> bool {
        false
    }

    fn crossings(&self) -> (&'static str, &'static str) {
        (MESSAGES, "tiny msgs")
    }
}

/// The VMM side: a model that forwards every configuration and BAR access and waits for its
/// reply. What it describes to the VMM (IDs, BARs) it learns at connect with configuration
/// requests (`function::probe`, as firmware sizes BARs).
struct TinyProxy {
    peer: Peer,
    ids: PciIds,
    bars: Vec<BarSpec>,
    messages: u64,
    bar_messages: u64,
}

impl TinyProxy {
    fn connect(sock: UnixStream, child: Option<DeviceProcess>, name: &str) -> Result<Self> {
        let ids =
            PciIds { vendor: 0, device: 0, class: 0, revision: 0, subsystem_vendor: 0, subsystem: 0, interrupt_pin: 0 };
        let mut p =
            TinyProxy { peer: Peer::new(sock, name, child), ids, bars: Vec::new(), messages: 0, bar_messages: 0 };
        (p.ids, p.bars) = probe(|offset, write| {
            let (op, value) = write.map_or((Op::CfgRead, 0), |v| (Op::CfgWrite, v));
            p.call(Request::new(op, 0, offset.into(), 4, value.into()), &[]).map(|v| v as u32)
        })?;
        Ok(p)
    }

    /// Sends `req` with `fds` and waits for its reply. A refusal is `Error::Remote` (the proxy
    /// lives on); any other error gives the peer up and stops the run.
    fn call(&mut self, req: Request, fds: &[RawFd]) -> Result<u64> {
        self.peer.alive()?;
        self.messages += 1;
        self.bar_messages += u64::from(matches!(req.op, Op::BarRead | Op::BarWrite));
        let r = exchange(&self.peer.sock, req, fds);
        match &r {
            Err(Error::Remote { .. }) | Ok(_) => {}
            Err(e) => self.peer.die(e),
        }
        r
    }
}

fn exchange(sock: &UnixStream, req: Request, fds: &[RawFd]) -> Result<u64> {
    socket::send(sock, &[&req.encode()], fds).map_err(|e| Error::io("tiny: sending a request", e))?;
    let mut b = [0u8; REPLY];
    let files = socket::recv_exact(sock, &mut b).map_err(|e| Error::io("tiny: waiting for a reply", e))?;
    if !files.is_empty() {
        return Err(Error::protocol(format!("tiny: a reply to {:?} came with {} fds", req.op, files.len())));
    }
    match wire::decode_reply(&b).map_err(|e| Error::protocol(format!("tiny: {e}")))? {
        Some(v) => Ok(v),
        None => Err(Error::Remote { command: format!("{:?}", req.op), errno: libc::EINVAL as u32 }),
    }
}

impl DeviceModelMut for TinyProxy {
    fn name(&self) -> String {
        self.peer.name.clone()
    }
    fn ids(&self) -> PciIds {
        self.ids
    }
    fn bars(&self) -> Vec<BarSpec> {
        self.bars.clone()
    }
    /// Hands INTx's eventfds to the server, and watches it from now on.
    fn attach(&mut self, ctx: DeviceContext) {
        self.peer.fail = Some(ctx.fail.clone());
        if let Some((trigger, resample)) = ctx.irq.intx_eventfds() {
            let fds = [trigger.as_raw_fd(), resample.as_raw_fd()];
            if self.call(Request::new(Op::Intx, 0, 0, 0, 0), &fds).is_err() {
                return;
            }
        }
        self.peer.watch();
    }
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        let v = self.call(Request::new(Op::BarRead, bar, offset, data.len(), 0), &[]);
        le_fill(data, v.unwrap_or(u64::MAX));
    }
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        let _ = self.call(Request::new(Op::BarWrite, bar, offset, data.len(), le_value(data)), &[]);
    }
    /// The header is the server's: every configuration access crosses.
    fn config_read(&mut self, offset: usize, data: &mut [u8]) -> bool {
        let v = self.call(Request::new(Op::CfgRead, 0, offset as u64, data.len(), 0), &[]);
        le_fill(data, v.unwrap_or(u64::MAX));
        true
    }
    fn config_write(&mut self, offset: usize, data: &[u8]) {
        let _ = self.call(Request::new(Op::CfgWrite, 0, offset as u64, data.len(), le_value(data)), &[]);
    }
    fn reset(&mut self) {
        let _ = self.call(Request::new(Op::Reset, 0, 0, 0, 0), &[]);
    }
    /// Ends the session (a device process the VMM started reports its counters).
    fn quiesce(&mut self) {
        self.peer.end();
    }
    fn counters(&self) -> Vec<Counter> {
        let mut c = self.peer.remote.clone();
        c.push(Counter { name: MESSAGES.into(), value: self.messages });
        c.push(Counter { name: BAR_MESSAGES.into(), value: self.bar_messages });
        c
    }
}

/// The device side: serves one client at a time over the function, whose state outlives it.
struct TinyServer {
    f: Arc<Mutex<PciFunction>>,
    irq: Arc<IrqLines>,
    /// Requests received (the function's counter [`RECEIVED`]).
    received: Arc<AtomicU64>,
}

impl Server for TinyServer {
    /// Holds the function for the whole session, attached with the client's interrupt lines;
    /// a request it cannot serve is refused and counted as a stray access.
    fn session(&mut self, sock: &UnixStream, peer: &str) -> Result<()> {
        let mut f = iopath_devices::lock(&self.f);
        let mut ctx = DeviceContext::detached(no_memory());
        ctx.irq = self.irq.clone();
        f.attach(ctx);
        loop {
            let mut b = [0u8; REQUEST];
            let files = match socket::recv_exact_idle(sock, &mut b) {
                Ok(files) => files,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(Error::io(format!("tiny {peer}: reading a request"), e)),
            };
            self.received.fetch_add(1, Ordering::Relaxed);
            let v = Request::decode(&b).and_then(|r| serve(&mut f, &self.irq, r, files));
            if let Err(why) = &v {
                log::warn!("tiny {peer}: refused: {why}");
                f.stray_accesses += 1;
            }
            let reply = wire::encode_reply(v.is_ok(), v.unwrap_or(u64::MAX));
            socket::send(sock, &[&reply], &[]).map_err(|e| Error::io(format!("tiny {peer}: replying"), e))?;
        }
    }
}

/// One request on the function: the value read (0 for the others), or why it is refused.
fn serve(f: &mut PciFunction, irq: &Arc<IrqLines>, r: Request, files: Vec<File>) -> Result<u64, String> {
    if r.op != Op::Intx && !files.is_empty() {
        return Err(format!("{:?} with {} fds", r.op, files.len()));
    }
    let (n, offset) = (r.width as usize, usize::try_from(r.offset).unwrap_or(usize::MAX));
    let (mut b, value) = ([0u8; 8], r.value.to_le_bytes());
    match r.op {
        Op::CfgRead => f.config_read(offset, &mut b[..n]),
        Op::CfgWrite => f.config_write(offset, &value[..n]),
        Op::BarRead => f.bar_read(r.bar, r.offset, &mut b[..n]),
        Op::BarWrite => f.bar_write(r.bar, r.offset, &value[..n]),
        Op::Intx => {
            let [trigger, resample] = <[File; 2]>::try_from(files).map_err(|f| format!("Intx with {} fds", f.len()))?;
            irq.connect_intx(eventfd_from(trigger), Some(eventfd_from(resample)));
        }
        Op::Reset => f.device.reset(),
    }
    Ok(u64::from_le_bytes(b))
}

#[test]
fn a_transport_defined_in_a_test_carries_a_device_to_the_vmm() {
    let dev = Arc::new(Mutex::new(Scratch::default()));
    // The device side, in this process: the tiny server of the function, one session on a
    // socketpair. The VMM side: the tiny proxy on the other end.
    let f = Arc::new(Mutex::new(PciFunction::new(dev.clone()).unwrap()));
    let irq = IrqLines::new();
    let mut server = Tiny.server(f.clone(), irq.clone()).unwrap();
    let (vmm_end, device_end) = UnixStream::pair().unwrap();
    let session = std::thread::spawn(move || server.session(&device_end, "the test's VMM").map_err(|e| e.to_string()));
    let proxy = Tiny.connect(vmm_end, None, "scratch@tiny").unwrap();
    let r = guest_accesses(proxy);
    // The VM is gone, and with it the proxy's socket: the session ends cleanly.
    session.join().unwrap().unwrap();
    check_device(&dev);
    let c = &r.devices[0].counters;
    let (crossings, _) = Tiny.crossings();
    let (messages, bar_messages) = (counter(c, crossings), counter(c, BAR_MESSAGES));
    // Every BAR access crossed once; every message the proxy sent was received.
    assert_eq!(bar_messages, 8, "{c:?}");
    let served = iopath_devices::lock(&f).counters();
    assert_eq!(counter(&served, RECEIVED), messages, "{served:?} {c:?}");
    assert!(messages > bar_messages, "no configuration access crossed: {c:?}");
    // INTx's eventfds arrived with SCM_RIGHTS; nothing was refused.
    assert!(irq.intx_fds().is_some(), "the server holds no INTx eventfds");
    assert_eq!(counter(&served, "stray-accesses"), 0, "{served:?}");
    assert_eq!(r.devices[0].name, "scratch@tiny");
    eprintln!("over tiny: proxy {c:?}, server {served:?}");
}

#[test]
fn the_tiny_codec_round_trips_and_refuses_what_it_cannot_serve() {
    let r = Request::new(Op::BarWrite, 2, 0x1234, 8, 0xdead_beef_0bad_cafe);
    assert_eq!(Request::decode(&r.encode()), Ok(r));
    let bad = |r: Request| Request::decode(&r.encode()).unwrap_err();
    assert!(bad(Request::new(Op::CfgRead, 0, 0, 8, 0)).contains("width 8"));
    assert!(bad(Request::new(Op::BarRead, 6, 0, 4, 0)).contains("BAR 6"));
    assert!(bad(Request::new(Op::CfgWrite, 1, 0, 4, 0)).contains("BAR 1"));
    assert!(bad(Request::new(Op::Reset, 0, 0, 4, 0)).contains("width 4"));
    let mut b = r.encode();
    b[5] = 1;
    assert!(Request::decode(&b).unwrap_err().contains("reserved"));
    b = r.encode();
    b[0] = 9;
    assert_eq!(Request::decode(&b).unwrap_err(), "unknown op 9");
    assert_eq!(wire::decode_reply(&wire::encode_reply(true, 7)), Ok(Some(7)));
    assert_eq!(wire::decode_reply(&wire::encode_reply(false, 7)), Ok(None));
    let mut b = wire::encode_reply(true, 7);
    b[0] = 2;
    assert!(wire::decode_reply(&b).unwrap_err().contains("status 2"));
}
