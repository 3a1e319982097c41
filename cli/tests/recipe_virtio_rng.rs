//! The "a virtio device" step of the "How to add a device" recipe (docs/ARCHITECTURE.md),
//! checked: a virtio entropy device (virtio 1.2, 5.4: type 4, one request queue, the device
//! fills each buffer the driver makes available with random bytes) written in this file as a
//! `QueueEngine` and nothing else, on the library's modern PCI transport (`VirtioPci`). The
//! driver here is written from the spec, not from the library's test driver: it finds the
//! common, notify and device configuration structures by walking the function's configuration
//! space capabilities, negotiates VERSION_1, sets up a split ring in guest memory and checks
//! each used-ring entry and every byte against the device's generator. Then a driver iopath
//! did not write: the same device served over vfio-user from this process to QEMU 11's
//! `vfio-user-pci` with a stock Linux guest (harness/linux, TCG), whose virtio_rng driver
//! backs /dev/hwrng; the bytes the guest reads are checked against the device's stream.
//!
//! If this file needs a library edit to build or pass, the recipe is wrong.

use iopath_devices::irq::IrqLines;
use iopath_devices::mem::GuestMem;
use iopath_devices::pci::ConfigSpace;
use iopath_devices::virtio::queue::DESC_F_WRITE;
use iopath_devices::virtio::transport::{DeviceConfigBytes, QueueEngine, Transport, VirtioPci, F_VERSION_1};
use iopath_devices::{Counter, DeviceContext, DeviceModel, GuestMemoryMmap};
use iopath_protocols::function::PciFunction;
use iopath_protocols::vfio_user::VfioUser;
use iopath_protocols::FunctionTransport;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vm_memory::{Bytes, GuestAddress};

/// virtio-rng's device type (5.4.1) and so its PCI device id (4.1.2.1).
const VIRTIO_ID_RNG: u16 = 4;
/// PCI class "other" (0xff), as QEMU's virtio-rng-pci shows.
const CLASS_OTHER: u32 = 0xff_00_00;

/// The entropy source: xorshift64*, so that the driver can check every byte it got. A real
/// device reads getrandom(2) instead; the transport neither knows nor cares.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn stream(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed;
    (0..len.div_ceil(8)).flat_map(|_| next(&mut s).to_le_bytes()).take(len).collect()
}

const SEED: u64 = 0x1234_5678_9abc_def1;

/// The recipe's engine: one queue, no features but VERSION_1, no configuration.
struct Rng {
    state: u64,
    /// The generator's current word and how many of its bytes are left.
    word: u64,
    left: u32,
    bytes: u64,
    requests: u64,
}

impl Rng {
    fn new(seed: u64) -> Self {
        Rng { state: seed, word: 0, left: 0, bytes: 0, requests: 0 }
    }

    fn byte(&mut self) -> u8 {
        if self.left == 0 {
            (self.word, self.left) = (next(&mut self.state), 8);
        }
        let b = self.word as u8;
        (self.word, self.left) = (self.word >> 8, self.left - 1);
        b
    }

    /// Fills `len` bytes at `addr` from the generator, a chunk at a time (a chain's length is
    /// the driver's; guest memory, not this, bounds it).
    fn fill(&mut self, mem: &GuestMem, addr: u64, len: u32) -> bool {
        let mut done = 0u64;
        while done < len as u64 {
            let n = (len as u64 - done).min(4096) as usize;
            let chunk: Vec<u8> = (0..n).map(|_| self.byte()).collect();
            if mem.write_slice(&chunk, addr + done).is_err() {
                return false;
            }
            done += n as u64;
        }
        self.bytes += len as u64;
        true
    }
}

impl QueueEngine for Rng {
    fn name(&self) -> String {
        "virtio-rng".into()
    }
    fn device_id(&self) -> u16 {
        0x1040 + VIRTIO_ID_RNG
    }
    fn class(&self) -> u32 {
        CLASS_OTHER
    }
    fn features(&self) -> u64 {
        F_VERSION_1
    }
    fn device_config(&self) -> DeviceConfigBytes {
        [0; 64] // virtio-rng has no configuration (5.4.4)
    }
    /// Serves every chain made available: each device-writable buffer filled, the chain put in
    /// the used ring with the bytes written, an interrupt if the driver wants one.
    fn notify(&mut self, t: &mut Transport, queue: u16) {
        let (q, Some(ctx)) = (queue as usize, t.ctx.clone()) else { return };
        if !t.queue_live(q) {
            return;
        }
        loop {
            let chain = match t.queues[q].ring.pop(&ctx.mem) {
                Ok(Some(c)) => c,
                Ok(None) => return,
                Err(e) => return t.broken(&format!("queue {q}: {e}")),
            };
            let mut written = 0u32;
            for d in chain.descs.iter().filter(|d| d.write) {
                if !self.fill(&ctx.mem, d.addr, d.len) {
                    return t.broken("a buffer left guest memory");
                }
                written = written.saturating_add(d.len);
            }
            self.requests += 1;
            match t.queues[q].ring.push_used(&ctx.mem, chain.head, written) {
                Ok(true) => t.queue_interrupt(q),
                Ok(false) => {}
                Err(e) => return t.broken(&format!("queue {q}: {e}")),
            }
        }
    }
    fn counters(&self) -> Vec<Counter> {
        vec![
            Counter { name: "bytes".into(), value: self.bytes },
            Counter { name: "requests".into(), value: self.requests },
        ]
    }
}

// ---- the driver, from virtio 1.2 (4.1.4 capabilities, 3.1.1 initialisation, 2.7 split rings) ----

const RAM: u64 = 1 << 20;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const BUFS: u64 = 0x10000;
const QSIZE: u16 = 8;

/// Where a virtio structure is: BAR 0 offset (the transport has one BAR).
#[derive(Default, Debug)]
struct Layout {
    common: u64,
    notify: u64,
    notify_mult: u32,
    device: u64,
}

struct Drv<'a> {
    dev: &'a dyn DeviceModel,
    ram: GuestMemoryMmap,
    at: Layout,
    avail_idx: u16,
}

impl Drv<'_> {
    fn r(&self, off: u64, len: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev.bar_read(0, self.at.common + off, &mut b[..len]);
        u64::from_le_bytes(b)
    }
    fn w(&self, off: u64, len: usize, v: u64) {
        self.dev.bar_write(0, self.at.common + off, &v.to_le_bytes()[..len]);
    }
    fn status(&self) -> u8 {
        self.r(0x14, 1) as u8
    }

    /// Walks the capability list (4.1.4): vendor capabilities (id 9) with cfg_type 1 (common),
    /// 2 (notify, with its multiplier), 4 (device), all in BAR 0.
    fn layout(dev: &dyn DeviceModel) -> Layout {
        let mut cs = ConfigSpace::new(dev.ids(), &dev.bars()).unwrap();
        cs.add_capabilities(&dev.capabilities()).unwrap();
        let rd = |off: usize, len: usize| {
            let mut b = [0u8; 4];
            cs.read(off, &mut b[..len]);
            u32::from_le_bytes(b)
        };
        assert_ne!(rd(0x06, 2) & 0x10, 0, "no capability list");
        let mut at = Layout::default();
        let (mut p, mut seen) = (rd(0x34, 1) as usize, 0);
        while p != 0 && seen < 48 {
            if rd(p, 1) == 0x09 {
                assert_eq!(rd(p + 4, 1), 0, "a structure outside BAR 0");
                let off = rd(p + 8, 4) as u64;
                match rd(p + 3, 1) {
                    1 => at.common = off,
                    2 => (at.notify, at.notify_mult) = (off, rd(p + 16, 4)),
                    4 => at.device = off,
                    _ => {}
                }
            }
            (p, seen) = (rd(p + 1, 1) as usize, seen + 1);
        }
        assert!(at.notify != 0 && at.device != 0, "{at:?}");
        at
    }

    /// 3.1.1: reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK, the queue, DRIVER_OK.
    fn init(dev: &dyn DeviceModel) -> Drv<'_> {
        let ram = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap();
        dev.attach(DeviceContext::detached(ram.clone()));
        let d = Drv { at: Drv::layout(dev), dev, ram, avail_idx: 0 };
        d.w(0x14, 1, 0);
        assert_eq!(d.status(), 0);
        d.w(0x14, 1, 1 | 2);
        let mut offered = 0u64;
        for sel in 0..2 {
            d.w(0x00, 4, sel);
            offered |= d.r(0x04, 4) << (32 * sel);
        }
        assert_ne!(offered & F_VERSION_1, 0, "VERSION_1 must be offered: {offered:#x}");
        for sel in 0..2 {
            d.w(0x08, 4, sel);
            d.w(0x0c, 4, (F_VERSION_1 >> (32 * sel)) & 0xffff_ffff);
        }
        d.w(0x14, 1, 1 | 2 | 8);
        assert_ne!(d.status() & 8, 0, "FEATURES_OK refused");
        assert_eq!(d.r(0x12, 2), 1, "virtio-rng has one queue");
        d.w(0x16, 2, 0);
        assert!(d.r(0x18, 2) >= QSIZE as u64);
        d.w(0x18, 2, QSIZE as u64);
        for (off, addr) in [(0x20, DESC), (0x28, AVAIL), (0x30, USED)] {
            d.w(off, 8, addr);
        }
        d.w(0x1c, 2, 1);
        d.w(0x14, 1, 1 | 2 | 8 | 4);
        assert_eq!(d.status(), 1 | 2 | 8 | 4, "the device refused DRIVER_OK");
        d
    }

    /// Makes a chain of device-writable buffers `(addr, len)` available at descriptor `first`
    /// and notifies queue 0; returns the head.
    fn request(&mut self, first: u16, bufs: &[(u64, u32)]) -> u16 {
        for (k, &(addr, len)) in bufs.iter().enumerate() {
            let i = first + k as u16;
            let more = k + 1 < bufs.len();
            let flags = DESC_F_WRITE | if more { 1 } else { 0 };
            let mut e = [0u8; 16];
            e[0..8].copy_from_slice(&addr.to_le_bytes());
            e[8..12].copy_from_slice(&len.to_le_bytes());
            e[12..14].copy_from_slice(&flags.to_le_bytes());
            e[14..16].copy_from_slice(&(if more { i + 1 } else { 0 }).to_le_bytes());
            self.ram.write_slice(&e, GuestAddress(DESC + 16 * i as u64)).unwrap();
        }
        let slot = (self.avail_idx % QSIZE) as u64;
        self.ram.write_obj(first, GuestAddress(AVAIL + 4 + 2 * slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.ram.write_obj(self.avail_idx, GuestAddress(AVAIL + 2)).unwrap();
        let queue_notify_off = {
            self.w(0x16, 2, 0);
            self.r(0x1e, 2)
        };
        let notify = self.at.notify + queue_notify_off * self.at.notify_mult as u64;
        self.dev.bar_write(0, notify, &0u16.to_le_bytes());
        first
    }

    fn used(&self) -> (u16, Vec<(u32, u32)>) {
        let idx: u16 = self.ram.read_obj(GuestAddress(USED + 2)).unwrap();
        let elems = (0..idx)
            .map(|k| {
                let at = USED + 4 + 8 * (k % QSIZE) as u64;
                (self.ram.read_obj(GuestAddress(at)).unwrap(), self.ram.read_obj(GuestAddress(at + 4)).unwrap())
            })
            .collect();
        (idx, elems)
    }

    fn bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.ram.read_slice(&mut b, GuestAddress(addr)).unwrap();
        b
    }
}

fn counter(dev: &dyn DeviceModel, name: &str) -> u64 {
    dev.counters().iter().find(|c| c.name == name).unwrap().value
}

#[test]
fn a_virtio_rng_written_in_a_test_runs_on_the_generic_transport() {
    let dev = VirtioPci::with_engine(Rng::new(SEED));
    // Its identity is the engine's (4.1.2.1): 0x1040 + type 4, class and subsystem.
    let ids = dev.ids();
    assert_eq!((ids.vendor, ids.device, ids.class, ids.subsystem_vendor), (0x1af4, 0x1044, CLASS_OTHER, 0x1af4));
    assert!(ids.subsystem >= 0x40, "4.1.2.1: subsystem id {:#x}", ids.subsystem);
    assert_eq!(dev.name(), "virtio-rng");

    let mut d = Drv::init(&dev);
    // Poison the buffers, so that a byte the device did not write shows.
    d.ram.write_slice(&[0xa5; 0x4000], GuestAddress(BUFS)).unwrap();
    // Three requests: one buffer of 13 bytes, a chain of two (64 + 203), one of 4096.
    let reqs: [&[(u64, u32)]; 3] =
        [&[(BUFS, 13)], &[(BUFS + 0x100, 64), (BUFS + 0x200, 203)], &[(BUFS + 0x1000, 4096)]];
    let mut first = 0;
    let mut heads = Vec::new();
    for bufs in reqs {
        heads.push(d.request(first, bufs));
        first += bufs.len() as u16;
    }
    let (idx, used) = d.used();
    assert_eq!(idx, 3, "one used entry per request");
    let lens: Vec<(u32, u32)> = heads.iter().zip(reqs).map(|(&h, b)| (h as u32, b.iter().map(|b| b.1).sum())).collect();
    assert_eq!(used, lens, "(head, bytes written) for each request, in order");

    // Every byte, in the order the device was given the buffers, is the generator's.
    let mut got = Vec::new();
    for (addr, len) in reqs.iter().flat_map(|b| b.iter()) {
        got.extend(d.bytes(*addr, *len as usize));
    }
    assert_eq!(got.len(), 13 + 64 + 203 + 4096);
    assert_eq!(got, stream(SEED, got.len()), "the bytes are the device's stream, none left poisoned");
    // Nothing outside the buffers was written.
    assert_eq!(d.bytes(BUFS + 13, 0x100 - 13), vec![0xa5; 0x100 - 13]);
    assert_eq!(d.bytes(BUFS + 0x200 + 203, 0x100), vec![0xa5; 0x100]);

    // The device's counters: the transport's and the engine's.
    assert_eq!(counter(&dev, "bytes"), got.len() as u64);
    assert_eq!(counter(&dev, "requests"), 3);
    assert_eq!(counter(&dev, "notifies"), 3);
    assert_eq!(counter(&dev, "ring_errors"), 0);
    eprintln!("virtio-rng on the generic transport: {:?}", dev.counters());
}

/// What the Linux guest runs instead of the harness's checks (`run-linux.sh --script`): waits
/// for virtio_rng to become the current hwrng, shows the function as lspci sees it, reads 4 KiB
/// of /dev/hwrng and prints them in hex (`@rng`).
const GUEST_SCRIPT: &str = r#"#!/bin/sh
. /lib.sh
i=0
lim=$(cap "$PROBE_WAIT")
cur() { cat /sys/class/misc/hw_random/rng_current 2>/dev/null; }
while case "$(cur)" in virtio_rng.*) false ;; *) [ $i -lt $((lim * 2)) ] ;; esac; do usleep 500000; i=$((i + 1)); done
echo "@rng lspci $(lspci -n -d 1af4:1044 | head -n 1)"
case "$(cur)" in
    virtio_rng.*) check hwrng-current ok "$(cur)" ;;
    *) check hwrng-current fail "rng_current=$(cur) available=$(cat /sys/class/misc/hw_random/rng_available 2>/dev/null)" ;;
esac
new_dmesg 'virtio|rng'
if head -c 4096 /dev/hwrng >$W/rng 2>$W/err && [ "$(wc -c <$W/rng)" -eq 4096 ]; then
    check hwrng-read ok "4096 bytes"
    echo "@rng hex=$(od -An -v -tx1 $W/rng | tr -d ' \n')"
else check hwrng-read fail "$(wc -c <$W/rng) bytes: $(cat $W/err)"; fi
finish
"#;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap()).collect()
}

#[test]
fn linux_virtio_rng_driver_reads_hwrng_from_a_virtio_rng_written_in_a_test_over_vfio_user() {
    let dir = std::env::temp_dir().join(format!("iopath-recipe-rng-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (socket, script, log) = (dir.join("rng.sock"), dir.join("guest-rng.sh"), dir.join("console.log"));
    std::fs::write(&script, GUEST_SCRIPT).unwrap();

    // The device side, in this process: the vfio-user server of the function, one client.
    iopath_protocols::sigbus::install().unwrap();
    let dev = Arc::new(VirtioPci::with_engine(Rng::new(SEED)));
    let f = Arc::new(Mutex::new(PciFunction::new(dev.clone()).unwrap()));
    let mut server = VfioUser.server(f, IrqLines::new()).unwrap();
    let listener = UnixListener::bind(&socket).unwrap();
    let session = std::thread::spawn(move || {
        let (sock, _) = listener.accept().map_err(|e| e.to_string())?;
        sock.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
        server.session(&sock, "QEMU").map_err(|e| e.to_string())
    });

    let harness = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/linux/run-linux.sh");
    let out = Command::new("bash")
        .arg(harness)
        .args(["--timeout", "300", "--vfio-user", socket.to_str().unwrap(), "--script", script.to_str().unwrap()])
        .args(["--log", log.to_str().unwrap()])
        .output()
        .expect("run harness/linux/run-linux.sh");
    let console = std::fs::read_to_string(&log).unwrap_or_default().replace('\r', "");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let rc = out.status.code();
    let session = session.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let counters = dev.counters();
    assert_eq!(rc, Some(0), "the Linux guest's checks failed ({counters:?}, session {session:?}):\n{text}\n{console}");
    session.unwrap();
    for l in console.lines().filter(|l| l.starts_with("@check") || l.starts_with("@rng lspci")) {
        eprintln!("{l}");
    }

    // Linux saw the engine's identity: 1af4:1044, class ff00.
    let lspci = console.lines().find_map(|l| l.strip_prefix("@rng lspci ")).expect("no @rng lspci line");
    assert!(lspci.contains("ff00: 1af4:1044"), "lspci -n: {lspci}");
    // Every byte the guest read came from the device: its 16-byte pieces are in the device's
    // stream (the kernel's hwrng thread takes bytes too, so the guest's reads are pieces of it,
    // not one run; a random 16 bytes is in a few KiB of stream by chance with p ~ 2^-116).
    let got = unhex(console.lines().find_map(|l| l.strip_prefix("@rng hex=")).expect("no @rng hex= line").trim());
    assert_eq!(got.len(), 4096);
    let bytes = counter(&*dev, "bytes");
    assert!(bytes >= 4096, "{counters:?}");
    let all = stream(SEED, bytes as usize);
    let found = got.chunks(16).filter(|p| all.windows(16).any(|w| w == *p)).count();
    assert!(found * 2 > got.len() / 16, "{found} of {} pieces of the guest's bytes are the device's", got.len() / 16);
    assert!(counter(&*dev, "interrupts") > 0 && counter(&*dev, "requests") > 0, "{counters:?}");
    assert_eq!(counter(&*dev, "ring_errors"), 0, "{counters:?}");
    eprintln!("{found}/256 pieces found; device: {counters:?}");
}
