//! The mpqemu message decoder (`protocols::mpqemu::wire::Msg::decode`) on hostile bytes, with the
//! checks `wire::recv` makes before it (data size, fd count). Input: one byte, the number of fds
//! that came with the message (mod 10), then the message as read from the socket: the 16-byte
//! header `{i32 cmd; u32 pad; u64 size}` and its data. Nothing may panic; a decoded message
//! encodes without panicking, and the encoding decodes back to the same message.

#![no_main]

use iopath_protocols::mpqemu::wire::{Msg, HEADER_SIZE, MAX_DATA, MAX_FDS};
use libfuzzer_sys::fuzz_target;

/// The fds a message carries, as its sender passes them.
fn fds_of(m: &Msg) -> usize {
    match m {
        Msg::SyncSysmem(r) => r.len(),
        Msg::SetIrqfd => 2,
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&nfds, msg)) = data.split_first() else { return };
    let nfds = nfds as usize % (MAX_FDS + 2);
    let Some(h) = msg.first_chunk::<HEADER_SIZE>() else { return };
    let cmd = i32::from_le_bytes(h[0..4].try_into().unwrap());
    let size = u64::from_le_bytes(h[8..16].try_into().unwrap());
    // recv: refused before the body is read.
    if size > MAX_DATA as u64 || nfds > MAX_FDS {
        return;
    }
    // recv reads exactly `size` bytes; a shorter stream is an I/O error.
    let Some(body) = msg[HEADER_SIZE..].get(..size as usize) else { return };
    let Ok(m) = Msg::decode(cmd, body, nfds) else { return };
    assert_eq!(m.cmd(), cmd);
    let enc = m.encode();
    assert!(enc.len() <= HEADER_SIZE + MAX_DATA, "an encoding longer than recv accepts: {enc:02x?}");
    let ecmd = i32::from_le_bytes(enc[0..4].try_into().unwrap());
    let esize = u64::from_le_bytes(enc[8..16].try_into().unwrap());
    assert_eq!((ecmd, esize as usize), (cmd, enc.len() - HEADER_SIZE));
    match Msg::decode(ecmd, &enc[HEADER_SIZE..], fds_of(&m)) {
        Ok(back) => assert_eq!(back, m, "the encoding {enc:02x?} decodes differently"),
        Err(e) => panic!("the encoding {enc:02x?} of {m:?} does not decode: {e}"),
    }
});
