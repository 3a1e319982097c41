//! iopath's vfio-user server under QEMU 11's `vfio-user-pci` + KVM where
//! the other real-client tests do not go: guest RAM that QEMU cannot share
//! (plain `-m`, no memfd), so that every DMA_MAP comes without an fd and the
//! server reaches guest RAM with DMA_READ/DMA_WRITE (pci-testdev makes no
//! DMA; `real_clients.rs` runs Linux's nvme driver that way).
//!
//! The harness (QEMU 11 in a Debian trixie root) comes from `harness/linux/`
//! and is built on first use, as for `real_clients.rs`.

mod common;
use common::kvm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `iopath serve DEVICE --transport vfio-user --socket PATH`; killed on drop.
struct Serve {
    child: Child,
    socket: PathBuf,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Serve {
    fn start(device: &str) -> Serve {
        let dir = std::env::temp_dir().join(format!("iopath-vus-{}-{}", std::process::id(), device.len()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("dev.sock");
        let mut child = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["serve", device, "--transport", "vfio-user", "--socket"])
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start iopath serve");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (err, keep) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                keep.lock().unwrap().push(l);
            }
        });
        let t0 = Instant::now();
        while !socket.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "iopath serve made no socket at {}", socket.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        Serve { child, socket, stderr }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(self.socket.parent().unwrap());
    }
}

#[test]
fn qemu11_attaches_iopath_pci_testdev_with_guest_ram_it_cannot_share() {
    kvm();
    let serve = Serve::start("pci-testdev");
    let img = serve.socket.parent().unwrap().join("guest.elf");
    iopath_guest::write_image(&img).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../harness/linux/run-image.sh");
    let out = Command::new("bash")
        .arg(script)
        .args([img.to_str().unwrap(), serve.socket.to_str().unwrap(), "batches=2 only=mmio-no,portio-no", "180"])
        .env("IOPATH_RUN_IMAGE_SHARE", "0")
        .output()
        .expect("run-image.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let log = serve.stderr.lock().unwrap().join("\n");
    assert_eq!(out.status.code(), Some(0), "QEMU 11 with unshared RAM:\n{text}\n--- iopath serve ---\n{log}");
    assert!(text.contains("@row"), "the guest measured pci-testdev:\n{text}");
    assert!(
        log.contains("without an fd") && log.contains("DMA_READ/DMA_WRITE"),
        "the server said it reaches that memory by message:\n{log}"
    );
}
