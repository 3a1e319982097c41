//! The ELF loader (`vmm::loader::load_elf`) and the multiboot header scan
//! (`has_multiboot_header`) on hostile images, into a 2 MiB guest RAM (images load at 1 MiB and
//! above). Nothing may panic; a loaded image lies inside RAM above the 1 MiB floor and its entry
//! point is inside it.

#![no_main]

use iopath_vmm::loader::{has_multiboot_header, load_elf, LOAD_MIN};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use vm_memory::{GuestAddress, GuestMemoryMmap};

const RAM: u64 = 2 << 20;

fn mem() -> &'static GuestMemoryMmap {
    static MEM: OnceLock<GuestMemoryMmap> = OnceLock::new();
    MEM.get_or_init(|| GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap())
}

fuzz_target!(|img: &[u8]| {
    let _ = has_multiboot_header(img);
    if let Ok(l) = load_elf(mem(), RAM, img) {
        assert!(l.end <= RAM && l.end > LOAD_MIN, "loaded image ends at {:#x}", l.end);
        assert!((LOAD_MIN..l.end).contains(&l.entry), "entry {:#x} outside [{LOAD_MIN:#x}, {:#x})", l.entry, l.end);
    }
});
