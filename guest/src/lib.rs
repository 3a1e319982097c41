//! The iopath guest image.
//!
//! One freestanding x86-64 image (C and assembly in `c/`), built by this
//! crate's build script with the host's gcc. It boots as a Multiboot v1 kernel
//! both from the iopath VMM and from `qemu-system-x86_64 -kernel`, switches to
//! long mode in a tiny CPL0 stub and runs its workloads at CPL3. Results are
//! printed on the 16550 serial port as `@key k=v ...` records; the run ends
//! through isa-debug-exit (port 0xf4).
//!
//! Command-line words (multiboot cmdline, or QEMU `-append`):
//! `workload=exits|floor tsc_khz=N batches=N batch_us=N only=a,b td_mmio=A td_pio=P`.
//! `workload=nvme` and `workload=vblk` (a polled virtio-blk driver) take the job words
//! listed at the top of `c/nvme.c` and `c/virtio.c`.

use std::io;
use std::path::{Path, PathBuf};

/// The image: an ELF32 (x86-64 code inside) with a multiboot header.
pub static IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/guest.elf"));

/// Writes the image to `path` (QEMU needs it as a file).
pub fn write_image(path: &Path) -> io::Result<()> {
    std::fs::write(path, IMAGE)
}

/// Writes the image into a per-user cache file and returns its path. The file
/// is rewritten only when its contents differ, so concurrent runs share it.
pub fn image_file() -> io::Result<PathBuf> {
    image_file_in(&std::env::temp_dir().join(format!("iopath-{}", user_id())))
}

/// [`image_file`] in `dir`. Each writer renames a temporary file of its own
/// (process id and a per-process counter), so threads of one process that
/// find the cache stale at the same time do not rename each other's file.
fn image_file_in(dir: &Path) -> io::Result<PathBuf> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("guest-{:016x}.elf", fnv1a(IMAGE)));
    if std::fs::read(&path).map(|b| b != IMAGE).unwrap_or(true) {
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!("guest.{}.{n}.tmp", std::process::id()));
        std::fs::write(&tmp, IMAGE)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path)
}

fn user_id() -> u32 {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap_or(0)
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100000001b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_is_elf32_with_multiboot_header() {
        assert_eq!(&IMAGE[..4], b"\x7fELF");
        assert_eq!(IMAGE[4], 1, "ELF class must be 32-bit for QEMU's multiboot loader");
        let found = IMAGE[..8192.min(IMAGE.len())]
            .chunks_exact(4)
            .any(|w| u32::from_le_bytes(w.try_into().unwrap()) == 0x1BADB002);
        assert!(found, "multiboot header missing from the first 8 KiB");
    }

    #[test]
    fn threads_writing_a_stale_cache_at_once_all_get_the_image() {
        let root = std::env::temp_dir().join(format!("iopath-image-race-{}", std::process::id()));
        for round in 0..20 {
            let dir = root.join(round.to_string());
            let go = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                let all: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            go.wait();
                            image_file_in(&dir)
                        })
                    })
                    .collect();
                for t in all {
                    let p = t.join().unwrap().expect("every thread gets the cached image");
                    assert_eq!(std::fs::read(p).unwrap(), IMAGE);
                }
            });
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
