//! The ioregionfd command decoder (`protocols::vfio_user::ioregionfd::wire::Cmd::decode`) on
//! hostile bytes: the input is a stream of 32-byte `ioregionfd_cmd`s as a region fd delivers
//! them. Nothing may panic; a decoded command has a valid size, encodes without panicking, and
//! the encoding decodes back to the same command.

#![no_main]

use iopath_protocols::vfio_user::ioregionfd::wire::{exponent, resp, Cmd, CMD_READ, CMD_WRITE, MSG_SIZE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for b in data.chunks_exact(MSG_SIZE) {
        let Ok(c) = Cmd::decode(b.try_into().unwrap()) else { continue };
        assert!(c.cmd == CMD_READ || c.cmd == CMD_WRITE);
        assert!(c.cmd == CMD_WRITE || c.resp, "a read without resp was taken");
        assert!(matches!(c.len(), 1 | 2 | 4 | 8) && !c.is_empty());
        assert_eq!(exponent(c.len()), Some(c.size_exponent));
        let enc = c.encode();
        // Only the padding (bytes 2..8, the top bits of byte 1) may differ from the input.
        assert_eq!((enc[0], enc[1] & 0x1f, &enc[8..]), (b[0], b[1] & 0x1f, &b[8..]));
        assert_eq!(Cmd::decode(&enc).ok(), Some(c));
        let _ = resp(c.data);
    }
});
