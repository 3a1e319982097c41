//! What the VMM asks of a proxy beyond connecting ([`ProxyConfig`]):
//! whether it offers the device state memory (`iopath run --state-memory`,
//! `iopath bench nvme --state-memory`). Given at `connect` and fixed for
//! the session.

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// State keeping, on or off (`--state-memory on|off`).
///
/// On (the default): VERSION offers the `iopath_state_memory` capability,
/// a device that keeps state gets a memfd to keep it in, and a new process
/// of the device resumes from it after a death. Off: no offer, so the
/// device keeps none (its fast path stores nothing), and nothing is
/// reconnected: a death stops the run, and the message says why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StateMemoryMode {
    #[default]
    On,
    Off,
}

impl StateMemoryMode {
    pub fn on(self) -> bool {
        self == StateMemoryMode::On
    }
}

impl fmt::Display for StateMemoryMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.on() { "on" } else { "off" })
    }
}

impl FromStr for StateMemoryMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "on" => Ok(StateMemoryMode::On),
            "off" => Ok(StateMemoryMode::Off),
            _ => Err(Error::Config(format!("--state-memory: {s:?} is not on or off"))),
        }
    }
}

/// The proxy's configuration (transports without a use for a field ignore it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Offer the device state memory (vfio-user and ioregionfd).
    pub state_memory: StateMemoryMode,
}

/// What a death's message adds when state keeping is off and the proxy
/// would otherwise have reconnected.
pub(super) const NO_RECONNECT_STATE_OFF: &str =
    "state memory is off (--state-memory off): the device kept no state a new process could resume, so none is started and the run stops";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_reads_and_prints_on_and_off_only() {
        for m in [StateMemoryMode::On, StateMemoryMode::Off] {
            assert_eq!(m.to_string().parse::<StateMemoryMode>().unwrap(), m);
        }
        assert_eq!(ProxyConfig::default().state_memory, StateMemoryMode::On, "on by default");
        let e = "yes".parse::<StateMemoryMode>().unwrap_err().to_string();
        assert!(e.contains("--state-memory") && e.contains("\"yes\""), "{e}");
    }
}
