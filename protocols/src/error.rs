//! The crate's one error type.
//!
//! Callers decide on the variant, never on the text: a proxy lives on after
//! [`Error::Remote`] (the device process refused one request) and treats
//! every other error as the end of its peer; a server closes the channel on
//! any error it returns (bad requests it can answer never become errors).

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call on a socket, fd, process or mapping failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// A malformed or unexpected message, or a request this side cannot
    /// serve; the text says which message and why.
    #[error("{0}")]
    Protocol(String),
    /// The peer answered a request with an error reply.
    #[error("error reply to {command}: errno {errno}")]
    Remote { command: String, errno: u32 },
    /// The peer did not answer in time, or stalled inside a message, or did
    /// not take what was sent to it in time.
    #[error("{what}: timed out")]
    Timeout { what: String },
    /// The peer went away (closed its socket, ended), or was given up on
    /// after an earlier error.
    #[error("{0}")]
    PeerGone(String),
    /// A device spec or option that cannot be served (unknown transport,
    /// a program that is missing).
    #[error("{0}")]
    Config(String),
    /// A device named over a transport that cannot carry it
    /// (`nvme@vhost-user`, `bench nvme --transport vhost-user`); `why` says
    /// what the transport carries and what would carry the device.
    #[error("{transport} cannot carry {device}: {why}")]
    Carry { transport: &'static str, device: String, why: String },
    /// The device model or its PCI header.
    #[error(transparent)]
    Device(#[from] iopath_devices::Error),
    /// An error with what it happened to in front ("pci-testdev@mpqemu: ...").
    #[error("{context}: {source}")]
    Context {
        context: String,
        #[source]
        source: Box<Error>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error: a read or write that timed out (the socket timeouts a
    /// proxy or `iopath serve` sets: WouldBlock; a stall inside a message:
    /// TimedOut, whose text says how far it got) is [`Error::Timeout`], a
    /// peer that hung up is [`Error::PeerGone`], anything else [`Error::Io`].
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        let context = context.into();
        match source.kind() {
            io::ErrorKind::WouldBlock => Error::Timeout { what: context },
            io::ErrorKind::TimedOut => Error::Timeout { what: format!("{context}: {source}") },
            io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                Error::PeerGone(format!("{context}: {source}"))
            }
            _ => Error::Io { context, source },
        }
    }

    pub fn protocol(msg: impl Into<String>) -> Self {
        Error::Protocol(msg.into())
    }

    /// Puts `context` in front of this error.
    pub fn context(self, context: impl Into<String>) -> Self {
        Error::Context { context: context.into(), source: Box::new(self) }
    }
}

impl From<crate::vfio_user::wire::WireError> for Error {
    fn from(e: crate::vfio_user::wire::WireError) -> Self {
        Error::Protocol(e.to_string())
    }
}
