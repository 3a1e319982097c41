//! The proxy and the server over a socketpair, hostile peers, a dead peer.

use super::wire::{recv, Msg, BAR_WRITE};
use super::{MpqemuProxy, MpqemuServer};
use crate::socket;
use crate::testing::{device_intx_reaches, testdev, vmm_context};
use crate::transport::Server;
use crate::Result;
use iopath_devices::irq::IrqLines;
use iopath_devices::{BarKind, Counter, DeviceContext, DeviceModelMut};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

fn pair() -> (UnixStream, UnixStream) {
    UnixStream::pair().unwrap()
}

fn server(sock: UnixStream) -> std::thread::JoinHandle<(Result<()>, Vec<Counter>)> {
    std::thread::spawn(move || {
        let f = testdev();
        let r = MpqemuServer::new(f.clone(), IrqLines::new()).session(&sock, "test");
        let c = f.lock().unwrap().counters();
        (r, c)
    })
}

#[test]
fn proxy_and_server_run_pci_testdev_over_a_socketpair() {
    let (a, b) = pair();
    let h = server(b);
    let mut p = MpqemuProxy::connect(a, None).unwrap();
    assert_eq!((p.ids().vendor, p.ids().device), (0x1b36, 0x0005));
    let bars = p.bars();
    assert_eq!(bars.len(), 2);
    assert_eq!((bars[0].kind, bars[0].size, bars[1].kind, bars[1].size), (BarKind::Mem32, 4096, BarKind::Io, 256));
    // Program the BARs as a guest would, through the proxy.
    p.config_write(0x10, &0xfe00_0000u32.to_le_bytes());
    p.config_write(0x14, &0xc000u32.to_le_bytes());
    p.config_write(0x04, &3u16.to_le_bytes());
    p.bar_write(0, 0, &[0]);
    for _ in 0..10 {
        p.bar_write(0, 2048, &[0xfa]);
    }
    let mut c = [0u8; 4];
    p.bar_read(0, 12, &mut c);
    assert_eq!(u32::from_le_bytes(c), 10);
    let mut id = [0u8; 2];
    assert!(p.config_read(2, &mut id));
    assert_eq!(u16::from_le_bytes(id), 0x0005);
    drop(p);
    let (r, counters) = h.join().unwrap();
    r.unwrap();
    assert!(counters.contains(&Counter { name: "mmio-no-eventfd.exits".into(), value: 10 }));
}

#[test]
fn a_hostile_peer_gets_the_channel_closed_not_a_panic() {
    for bad in [
        Msg::BarWrite { addr: 0, val: 0, size: 3, memory: true }.encode(),
        {
            let mut m = Msg::Ret(0).encode();
            m[8] = 200; // size larger than the data union
            m
        },
        vec![42, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ] {
        let (a, b) = pair();
        let h = server(b);
        let _ = socket::send(&a, &[&bad], &[]);
        // An odd-sized BAR access is answered and refused; the stream
        // then ends cleanly. The others break the protocol.
        if bad[0] == BAR_WRITE as u8 {
            assert_eq!(recv(&a).unwrap().unwrap().0, Msg::Ret(0));
        }
        drop(a);
        let (r, c) = h.join().unwrap();
        if bad[0] == BAR_WRITE as u8 {
            assert!(r.is_ok());
            assert!(c.contains(&Counter { name: "stray-accesses".into(), value: 1 }));
        } else {
            assert!(r.is_err(), "{bad:?}");
        }
    }
}

#[test]
fn a_dead_device_process_fails_the_proxy() {
    let (a, b) = pair();
    let h = server(b);
    let mut p = MpqemuProxy::connect(a, None).unwrap();
    let failed = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let f2 = failed.clone();
    let mut ctx = DeviceContext::detached(iopath_devices::GuestMemoryMmap::default());
    ctx.fail = Arc::new(move |m| f2.lock().unwrap().push(m));
    p.peer.fail = Some(ctx.fail.clone());
    p.peer.watch();
    // Kill the server side by shutting the socket from its end.
    p.peer.sock.try_clone().unwrap().shutdown(std::net::Shutdown::Write).unwrap();
    let _ = h.join();
    let t0 = std::time::Instant::now();
    while failed.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!failed.lock().unwrap().is_empty(), "no failure reported");
    let mut b = [0u8; 4];
    p.bar_read(0, 0, &mut b);
    assert_eq!(b, [0xff; 4]);
}

#[test]
fn set_irqfd_hands_intx_and_guest_ram_to_the_device_process() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let irq = IrqLines::new();
    let irq2 = irq.clone();
    let h = std::thread::spawn(move || MpqemuServer::new(testdev(), irq2).session(&b, "test"));
    let mut p = MpqemuProxy::connect(a, None).unwrap();
    let (ctx, trigger) = vmm_context();
    p.attach(ctx);
    device_intx_reaches(&irq, &trigger);
    drop(p);
    h.join().unwrap().unwrap();
}
