//! iopath's state memory extension of vfio-user: a memfd the client holds
//! and hands to each process of the device, which keeps in it what it must
//! not lose (`iopath_devices::state::StateMemory`), so that a process that
//! replaces a killed one resumes where it stopped.
//!
//! Negotiated in VERSION's capabilities JSON: the client proposes
//! `"iopath_state_memory": MAX` (the most bytes it will hold); a server
//! whose device keeps state answers `"iopath_state_memory": N` (1..=MAX).
//! Peers that do not know the key ignore it (libvfio-user reads only the
//! keys it knows; rust-vmm's serde struct ignores unknown fields), and a
//! server answers it only to a client that proposed it. Then the client
//! sends STATE_MEMORY, a command number outside the spec's range, with the
//! memfd as its one fd and this 16-byte payload; the reply is empty, or an
//! error reply whose errno says why (the server logs the reason).

use super::*;

/// STATE_MEMORY's command number: far above the spec's (1..=18 in use).
pub const STATE_MEMORY_COMMAND: u16 = 0x7f01;
/// The key of the capability in VERSION's JSON.
pub const STATE_MEMORY_CAP: &str = "iopath_state_memory";
/// The largest state memory either side names.
pub const MAX_STATE_MEMORY: u64 = iopath_devices::state::MAX_STATE_LEN as u64;
/// STATE_MEMORY flag: the memory holds an earlier process's state, to
/// resume from; without it the device starts recording afresh.
pub const STATE_MEMORY_RESUME: u32 = 1;
const STATE_MEMORY_SIZE: usize = 16;

/// STATE_MEMORY's payload: `argsz`, flags, the memory's size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateMemoryMsg {
    pub flags: u32,
    pub size: u64,
}

impl StateMemoryMsg {
    pub fn resume(&self) -> bool {
        self.flags & STATE_MEMORY_RESUME != 0
    }

    /// Exactly 16 bytes, `argsz` 16, no unknown flag, a size of
    /// 1..=[`MAX_STATE_MEMORY`] bytes, a multiple of 8.
    pub fn parse(b: &[u8]) -> Result<Self, WireError> {
        let mut r = Rd::new("state_memory", b, STATE_MEMORY_SIZE, true)?;
        let (argsz, flags, size) = (r.u32()?, r.u32()?, r.u64()?);
        if argsz as usize != STATE_MEMORY_SIZE {
            return Err(invalid(format!("state_memory: argsz {argsz}, not {STATE_MEMORY_SIZE}")));
        }
        if flags & !STATE_MEMORY_RESUME != 0 {
            return Err(invalid(format!("state_memory: unknown flags {flags:#x}")));
        }
        if size == 0 || size > MAX_STATE_MEMORY || size % 8 != 0 {
            return Err(invalid(format!("state_memory: {size} bytes (a multiple of 8, 8..={MAX_STATE_MEMORY})")));
        }
        Ok(StateMemoryMsg { flags, size })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        Wr::new(STATE_MEMORY_SIZE).u32(STATE_MEMORY_SIZE as u32).u32(self.flags).u64(self.size).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn state_memory_messages_round_trip_and_bad_ones_are_refused() {
        for m in [StateMemoryMsg { flags: 0, size: 4096 }, StateMemoryMsg { flags: STATE_MEMORY_RESUME, size: 8 }] {
            assert_eq!(StateMemoryMsg::parse(&m.to_bytes()).unwrap(), m);
        }
        let good = StateMemoryMsg { flags: 1, size: 64 }.to_bytes();
        let with = |at: usize, v: &[u8]| {
            let mut b = good.clone();
            b[at..at + v.len()].copy_from_slice(v);
            b
        };
        for bad in [
            good[..15].to_vec(),
            [good.clone(), vec![0]].concat(),
            with(0, &24u32.to_le_bytes()),
            with(4, &2u32.to_le_bytes()),
            with(8, &0u64.to_le_bytes()),
            with(8, &12u64.to_le_bytes()),
            with(8, &(MAX_STATE_MEMORY + 8).to_le_bytes()),
        ] {
            assert!(StateMemoryMsg::parse(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_capability_is_read_written_and_never_part_of_a_plain_answer() {
        let c = Capabilities::from_json(&json!({"capabilities": {STATE_MEMORY_CAP: 4096}})).unwrap();
        assert_eq!(c.state_memory, Some(4096));
        assert_eq!(Capabilities::from_json(&c.to_json()).unwrap(), c);
        assert_eq!(Capabilities::from_json(&json!({"capabilities": {}})).unwrap().state_memory, None);
        for bad in [json!(0), json!(-1), json!("4096"), json!(MAX_STATE_MEMORY + 1)] {
            assert!(Capabilities::from_json(&json!({"capabilities": {STATE_MEMORY_CAP: bad}})).is_err(), "{bad}");
        }
        // A JSON without the key (every deployed peer's) says nothing of it.
        let d = Capabilities::default();
        assert!(!d.to_json().to_string().contains(STATE_MEMORY_CAP));
        assert_eq!(d.answer(&c).unwrap().state_memory, None, "the server adds it itself");
        assert_eq!(Command::from_u16(STATE_MEMORY_COMMAND), Some(Command::StateMemory));
    }
}
