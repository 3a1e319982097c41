//! Multiboot (v1) loading of an ELF image into guest RAM.
//!
//! The image is untrusted input: every header field is bounds-checked against
//! the file and against guest RAM before anything is copied.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

pub const MULTIBOOT_HEADER_MAGIC: u32 = 0x1BAD_B002;
pub const MULTIBOOT_BOOTLOADER_MAGIC: u32 = 0x2BAD_B002;
/// Where the multiboot information structure and the command line go.
pub const MBI_ADDR: u64 = 0x9000;
pub const CMDLINE_ADDR: u64 = 0x9100;
pub const CMDLINE_MAX: usize = 0x0f00;
/// Images may not load below 1 MiB (the MBI and boot data live there).
pub const LOAD_MIN: u64 = 0x10_0000;

/// Why an image cannot be loaded (which header field, which segment).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LoadError(pub String);

impl From<&str> for LoadError {
    fn from(s: &str) -> Self {
        LoadError(s.to_string())
    }
}

impl From<String> for LoadError {
    fn from(s: String) -> Self {
        LoadError(s)
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Loaded {
    pub entry: u64,
    pub end: u64,
}

fn rd<const N: usize>(img: &[u8], off: u64) -> Result<[u8; N], LoadError> {
    let off = usize::try_from(off).map_err(|_| "offset overflow")?;
    img.get(off..off.checked_add(N).ok_or("offset overflow")?)
        .map(|s| s.try_into().unwrap())
        .ok_or_else(|| LoadError(format!("ELF image truncated at {off:#x}")))
}
fn u16_at(img: &[u8], off: u64) -> Result<u64, LoadError> {
    Ok(u16::from_le_bytes(rd(img, off)?) as u64)
}
fn u32_at(img: &[u8], off: u64) -> Result<u64, LoadError> {
    Ok(u32::from_le_bytes(rd(img, off)?) as u64)
}
fn u64_at(img: &[u8], off: u64) -> Result<u64, LoadError> {
    Ok(u64::from_le_bytes(rd(img, off)?))
}

/// Checks for a multiboot header in the first 8 KiB.
pub fn has_multiboot_header(img: &[u8]) -> bool {
    img[..img.len().min(8192)].chunks_exact(4).enumerate().any(|(i, w)| {
        u32::from_le_bytes(w.try_into().unwrap()) == MULTIBOOT_HEADER_MAGIC
            && img
                .get(i * 4 + 4..i * 4 + 12)
                .map(|r| {
                    let flags = u32::from_le_bytes(r[..4].try_into().unwrap());
                    let sum = u32::from_le_bytes(r[4..].try_into().unwrap());
                    MULTIBOOT_HEADER_MAGIC.wrapping_add(flags).wrapping_add(sum) == 0
                })
                .unwrap_or(false)
    })
}

/// Loads the PT_LOAD segments of an ELF32 or ELF64 little-endian x86 image.
pub fn load_elf(mem: &GuestMemoryMmap, ram_size: u64, img: &[u8]) -> Result<Loaded, LoadError> {
    if rd::<4>(img, 0)? != *b"\x7fELF" {
        return Err("not an ELF image".into());
    }
    let class = rd::<1>(img, 4)?[0];
    if rd::<1>(img, 5)?[0] != 1 {
        return Err("ELF image is not little-endian".into());
    }
    let (entry, phoff, phentsize, phnum) = match class {
        1 => (u32_at(img, 24)?, u32_at(img, 28)?, u16_at(img, 42)?, u16_at(img, 44)?),
        2 => (u64_at(img, 24)?, u64_at(img, 32)?, u16_at(img, 54)?, u16_at(img, 56)?),
        _ => return Err(LoadError(format!("unknown ELF class {class}"))),
    };
    let min_ph = if class == 1 { 32 } else { 56 };
    if phentsize < min_ph || phnum == 0 || phnum > 64 {
        return Err(LoadError(format!("bad program header table ({phnum} entries of {phentsize} bytes)")));
    }
    let mut end = 0u64;
    let mut entry_ok = false;
    for i in 0..phnum {
        let ph = phoff.checked_add(i * phentsize).ok_or("program header offset overflow")?;
        let (ptype, offset, paddr, filesz, memsz) = if class == 1 {
            (
                u32_at(img, ph)?,
                u32_at(img, ph + 4)?,
                u32_at(img, ph + 12)?,
                u32_at(img, ph + 16)?,
                u32_at(img, ph + 20)?,
            )
        } else {
            (
                u32_at(img, ph)?,
                u64_at(img, ph + 8)?,
                u64_at(img, ph + 24)?,
                u64_at(img, ph + 32)?,
                u64_at(img, ph + 40)?,
            )
        };
        if ptype != 1 {
            continue;
        }
        let seg_end = paddr.checked_add(memsz).ok_or("segment address overflow")?;
        if filesz > memsz || paddr < LOAD_MIN || seg_end > ram_size {
            return Err(LoadError(format!(
                "segment {i} ({paddr:#x}+{memsz:#x}) does not fit guest RAM [{LOAD_MIN:#x}, {ram_size:#x})"
            )));
        }
        let data = usize::try_from(offset)
            .ok()
            .and_then(|o| img.get(o..o.checked_add(filesz as usize)?))
            .ok_or_else(|| format!("segment {i} data lies outside the image"))?;
        mem.write_slice(data, GuestAddress(paddr)).map_err(|e| LoadError(e.to_string()))?;
        let zeros = vec![0u8; (memsz - filesz) as usize];
        mem.write_slice(&zeros, GuestAddress(paddr + filesz)).map_err(|e| LoadError(e.to_string()))?;
        entry_ok |= (paddr..seg_end).contains(&entry);
        end = end.max(seg_end);
    }
    if !entry_ok {
        return Err(LoadError(format!("entry point {entry:#x} is not inside a loaded segment")));
    }
    Ok(Loaded { entry, end })
}

/// Writes the multiboot information structure (memory sizes, command line).
pub fn write_mbi(mem: &GuestMemoryMmap, ram_size: u64, cmdline: &str) -> Result<u64, LoadError> {
    if cmdline.len() >= CMDLINE_MAX {
        return Err(LoadError(format!("command line longer than {} bytes", CMDLINE_MAX - 1)));
    }
    let mut mbi = [0u32; 5];
    mbi[0] = 1 | 4; // mem_* and cmdline valid
    mbi[1] = 640;
    mbi[2] = ((ram_size - 0x10_0000) / 1024) as u32;
    mbi[4] = CMDLINE_ADDR as u32;
    let bytes: Vec<u8> = mbi.iter().flat_map(|v| v.to_le_bytes()).collect();
    mem.write_slice(&bytes, GuestAddress(MBI_ADDR)).map_err(|e| LoadError(e.to_string()))?;
    let mut c = cmdline.as_bytes().to_vec();
    c.push(0);
    mem.write_slice(&c, GuestAddress(CMDLINE_ADDR)).map_err(|e| LoadError(e.to_string()))?;
    Ok(MBI_ADDR)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).unwrap()
    }

    /// A minimal ELF32 with one PT_LOAD of `data` at `paddr`.
    fn elf32(paddr: u32, data: &[u8], memsz: u32, entry: u32) -> Vec<u8> {
        let mut v = vec![0u8; 0x54];
        v[..4].copy_from_slice(b"\x7fELF");
        v[4] = 1;
        v[5] = 1;
        v[24..28].copy_from_slice(&entry.to_le_bytes());
        v[28..32].copy_from_slice(&52u32.to_le_bytes());
        v[42..44].copy_from_slice(&32u16.to_le_bytes());
        v[44..46].copy_from_slice(&1u16.to_le_bytes());
        let ph = 52;
        v[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
        v[ph + 4..ph + 8].copy_from_slice(&0x54u32.to_le_bytes());
        v[ph + 12..ph + 16].copy_from_slice(&paddr.to_le_bytes());
        v[ph + 16..ph + 20].copy_from_slice(&(data.len() as u32).to_le_bytes());
        v[ph + 20..ph + 24].copy_from_slice(&memsz.to_le_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn loads_segments_and_zeroes_bss() {
        let m = mem();
        m.write_slice(&[0xaa; 16], GuestAddress(0x100004)).unwrap();
        let img = elf32(0x100000, &[1, 2, 3, 4], 16, 0x100000);
        let l = load_elf(&m, 4 << 20, &img).unwrap();
        assert_eq!(l, Loaded { entry: 0x100000, end: 0x100010 });
        let mut b = [0u8; 8];
        m.read_slice(&mut b, GuestAddress(0x100000)).unwrap();
        assert_eq!(b, [1, 2, 3, 4, 0, 0, 0, 0]);
    }

    #[test]
    fn hostile_images_are_refused() {
        let m = mem();
        let ram = 4 << 20;
        assert!(load_elf(&m, ram, b"\x7fEL").is_err());
        assert!(load_elf(&m, ram, &elf32(0x1000, &[0], 1, 0x1000)).is_err(), "below 1 MiB");
        assert!(load_elf(&m, ram, &elf32(0x3ffffe, &[0; 4], 4, 0x3ffffe)).is_err(), "past RAM");
        assert!(load_elf(&m, ram, &elf32(0xffff_fff0, &[0], 0x20, 0xffff_fff0)).is_err(), "wraps");
        assert!(load_elf(&m, ram, &elf32(0x100000, &[0; 4], 2, 0x100000)).is_err(), "filesz > memsz");
        assert!(load_elf(&m, ram, &elf32(0x100000, &[0; 4], 4, 0x200000)).is_err(), "entry outside");
        let mut img = elf32(0x100000, &[0; 4], 4, 0x100000);
        img.truncate(0x56);
        assert!(load_elf(&m, ram, &img).is_err(), "segment data truncated");
        let mut img = elf32(0x100000, &[0; 4], 4, 0x100000);
        img[44] = 0xff;
        assert!(load_elf(&m, ram, &img).is_err(), "too many program headers");
    }

    #[test]
    fn mbi_has_cmdline_and_memory() {
        let m = mem();
        write_mbi(&m, 4 << 20, "tsc_khz=1 workload=exits").unwrap();
        let flags: u32 = m.read_obj(GuestAddress(MBI_ADDR)).unwrap();
        assert_eq!(flags, 5);
        let upper: u32 = m.read_obj(GuestAddress(MBI_ADDR + 8)).unwrap();
        assert_eq!(upper, 3072);
        let mut c = [0u8; 25];
        m.read_slice(&mut c, GuestAddress(CMDLINE_ADDR)).unwrap();
        assert_eq!(&c, b"tsc_khz=1 workload=exits\0");
        assert!(write_mbi(&m, 4 << 20, &"x".repeat(CMDLINE_MAX)).is_err());
    }

    #[test]
    fn multiboot_header_detection() {
        let mut img = vec![0u8; 64];
        img[16..20].copy_from_slice(&MULTIBOOT_HEADER_MAGIC.to_le_bytes());
        img[20..24].copy_from_slice(&2u32.to_le_bytes());
        img[24..28].copy_from_slice(&(0u32.wrapping_sub(MULTIBOOT_HEADER_MAGIC + 2)).to_le_bytes());
        assert!(has_multiboot_header(&img));
        img[24] ^= 1;
        assert!(!has_multiboot_header(&img));
    }
}
