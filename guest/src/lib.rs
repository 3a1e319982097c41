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
    let dir = std::env::temp_dir().join(format!("iopath-{}", user_id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("guest-{:016x}.elf", fnv1a(IMAGE)));
    if std::fs::read(&path).map(|b| b != IMAGE).unwrap_or(true) {
        let tmp = dir.join(format!("guest.{}.tmp", std::process::id()));
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
}
