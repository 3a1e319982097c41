//! Errors of the devices crate: a device that cannot be built from its
//! options, a host service a device asked for and did not get, a PCI header
//! that cannot hold what a device declares, a backing file that is not there.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A device option that does not parse or is out of range (reported
    /// before anything is started).
    #[error("{device}: {option}: {reason}")]
    Option { device: &'static str, option: String, reason: String },
    /// A `file:PATH` backend that is missing (without `create=on`), too
    /// short, or not a file (`crate::backing`).
    #[error(transparent)]
    Backing(#[from] crate::backing::BackingError),
    /// A device name nobody implements.
    #[error("unknown device {0:?} (one of {names})", names = crate::spec::DEVICE_NAMES.join(", "))]
    UnknownDevice(String),
    /// A host resource the device needs (memfd, eventfd, thread, file).
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    /// The host cannot give a device what it asked for (an ioeventfd, say).
    #[error("{0}")]
    Host(String),
    /// A configuration header that cannot hold the device's BARs or capabilities.
    #[error("PCI header: {0}")]
    Config(String),
}

impl Error {
    /// An [`Error::Io`] naming what failed.
    pub fn io(what: impl Into<String>, source: io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
