//! Block backends of the NVMe namespace: `null` (no data: dispatch cost
//! only), `ram` (keeps data in an anonymous mapping), `file:PATH` (O_DIRECT
//! reads and writes through io_uring, one whole transfer per command from an
//! aligned buffer; where O_DIRECT or io_uring is refused, pread/pwrite).
//! Callers pass LBA ranges already checked against the namespace.

use crate::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Null,
    Ram,
    File(std::path::PathBuf),
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "null" => Ok(BackendKind::Null),
            "ram" => Ok(BackendKind::Ram),
            f if f.starts_with("file:") && f.len() > 5 => Ok(BackendKind::File(f[5..].into())),
            _ => Err(Error::Option {
                device: "nvme",
                option: "backend".into(),
                reason: format!("unknown backend {s:?} (null, ram, file:PATH)"),
            }),
        }
    }
}

/// `null`, `ram` or `file:PATH`, as [`FromStr`](std::str::FromStr) takes
/// them (a path that is not UTF-8 is written lossily).
impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendKind::Null => f.write_str("null"),
            BackendKind::Ram => f.write_str("ram"),
            BackendKind::File(p) => write!(f, "file:{}", p.display()),
        }
    }
}

pub enum Backend {
    Null,
    Ram(Vec<u8>),
    File(Box<FileBackend>),
}

/// A file namespace: a buffered fd always, and when the filesystem and
/// kernel allow, an O_DIRECT fd driven through io_uring.
pub struct FileBackend {
    file: File,
    direct: Option<(File, io_uring::IoUring)>,
    /// Operations that went through io_uring with O_DIRECT.
    pub direct_ops: u64,
    seq: u64,
}

impl FileBackend {
    fn open(p: &std::path::Path, bytes: u64) -> Result<Self> {
        let io_err = |e| Error::io(p.display().to_string(), e);
        let f =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p).map_err(io_err)?;
        if f.metadata().map_err(io_err)?.len() < bytes {
            f.set_len(bytes).map_err(io_err)?;
        }
        use std::os::unix::fs::OpenOptionsExt;
        let direct = std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(p).ok();
        let direct = match (direct, io_uring::IoUring::new(4)) {
            (Some(d), Ok(r)) => Some((d, r)),
            (None, _) => {
                log::info!("{}: no O_DIRECT here; using pread/pwrite", p.display());
                None
            }
            (_, Err(e)) => {
                log::info!("io_uring unavailable ({e}); using pread/pwrite");
                None
            }
        };
        Ok(FileBackend { file: f, direct, direct_ops: 0, seq: 0 })
    }

    /// One O_DIRECT read or write through io_uring; None if it cannot be
    /// done that way (alignment, a refused opcode): the caller falls back.
    fn uring(&mut self, write: bool, off: u64, ptr: *mut u8, len: usize) -> Option<std::io::Result<()>> {
        use std::os::fd::AsRawFd;
        let (f, ring) = self.direct.as_mut()?;
        if !off.is_multiple_of(512) || !len.is_multiple_of(512) || !(ptr as usize).is_multiple_of(4096) {
            return None;
        }
        let fd = io_uring::types::Fd(f.as_raw_fd());
        self.seq = self.seq.wrapping_add(1);
        let tag = self.seq;
        let e = if write {
            io_uring::opcode::Write::new(fd, ptr, len as u32).offset(off).build()
        } else {
            io_uring::opcode::Read::new(fd, ptr, len as u32).offset(off).build()
        }
        .user_data(tag);
        // SAFETY: the buffer outlives the operation: this function does not
        // return before the operation's own completion has been reaped.
        if unsafe { ring.submission().push(&e) }.is_err() {
            return None;
        }
        let r = loop {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // Not submitted at all: nothing is in flight, the caller may fall back.
                Err(e) if !ring.submission().is_empty() => return Some(Err(e)),
                Err(_) => {}
            }
            if let Some(c) = ring.completion().find(|c| c.user_data() == tag) {
                break c.result();
            }
        };
        match r {
            n if n as usize == len => {
                self.direct_ops += 1;
                Some(Ok(()))
            }
            n if n == -libc::EINVAL => None, // this filesystem's block size: use the buffered fd
            n if n < 0 => Some(Err(std::io::Error::from_raw_os_error(-n))),
            _ => Some(Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short O_DIRECT transfer"))),
        }
    }
}

/// A buffer aligned for O_DIRECT (4 KiB), for whole transfers.
pub struct Bounce(Vec<u8>, usize);

impl Bounce {
    pub fn new(len: usize) -> Self {
        let v = vec![0u8; len + 4096];
        let start = v.as_ptr().align_offset(4096);
        Bounce(v, start)
    }
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if self.0.len() < self.1 + len {
            *self = Bounce::new(len);
        }
        &mut self.0[self.1..self.1 + len]
    }
}

impl Backend {
    pub fn open(kind: &BackendKind, bytes: u64) -> Result<Self> {
        Ok(match kind {
            BackendKind::Null => Backend::Null,
            BackendKind::Ram => {
                let n = usize::try_from(bytes).map_err(|_| Error::Option {
                    device: "nvme",
                    option: "size_mb".into(),
                    reason: "namespace too large".into(),
                })?;
                // vec! of zeros is calloc: pages are mapped on first touch.
                Backend::Ram(vec![0u8; n])
            }
            BackendKind::File(p) => Backend::File(Box::new(FileBackend::open(p, bytes)?)),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Null => "null",
            Backend::Ram(_) => "ram",
            Backend::File(_) => "file",
        }
    }

    /// Reads `buf.len()` bytes at byte offset `off` (null: zeros are not
    /// even written, as a null device transfers no data).
    pub fn read(&mut self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                let o = off as usize;
                buf.copy_from_slice(&v[o..o + buf.len()]);
                Ok(())
            }
            Backend::File(f) => match f.uring(false, off, buf.as_mut_ptr(), buf.len()) {
                Some(r) => r,
                None => f.file.read_exact_at(buf, off),
            },
        }
    }

    pub fn write(&mut self, off: u64, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                let o = off as usize;
                v[o..o + buf.len()].copy_from_slice(buf);
                Ok(())
            }
            Backend::File(f) => match f.uring(true, off, buf.as_ptr() as *mut u8, buf.len()) {
                Some(r) => r,
                None => f.file.write_all_at(buf, off),
            },
        }
    }

    pub fn zero(&mut self, off: u64, len: u64) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                v[off as usize..(off + len) as usize].fill(0);
                Ok(())
            }
            Backend::File(f) => {
                let z = vec![0u8; 64 << 10];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(z.len() as u64) as usize;
                    f.file.write_all_at(&z[..n], off + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Backend::File(f) => f.file.sync_data(),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_and_file_keep_data_null_keeps_none() {
        let path = std::env::temp_dir().join(format!("iopath-nvme-{}.img", std::process::id()));
        for kind in [BackendKind::Ram, BackendKind::File(path.clone()), BackendKind::Null] {
            let mut b = Backend::open(&kind, 1 << 20).unwrap();
            b.write(4096, b"abcd").unwrap();
            let mut r = [0u8; 4];
            b.read(4096, &mut r).unwrap();
            assert_eq!(&r, if kind == BackendKind::Null { b"\0\0\0\0" } else { b"abcd" }, "{kind:?}");
            // Whole aligned transfers go O_DIRECT through io_uring where the file system allows.
            let mut bounce = Bounce::new(8192);
            let buf = bounce.get(8192);
            buf.fill(0x5a);
            b.write(8192, buf).unwrap();
            buf.fill(0);
            b.read(8192, buf).unwrap();
            if kind != BackendKind::Null {
                assert!(buf.iter().all(|&x| x == 0x5a), "{kind:?}");
            }
            b.zero(4096, 4096).unwrap();
            b.read(4096, &mut r).unwrap();
            assert_eq!(r, [0; 4]);
        }
        let _ = std::fs::remove_file(path);
        assert!("floppy".parse::<BackendKind>().is_err());
        assert_eq!("file:/x".parse::<BackendKind>().unwrap(), BackendKind::File("/x".into()));
        for s in ["null", "ram", "file:/x/y z.img"] {
            assert_eq!(s.parse::<BackendKind>().unwrap().to_string(), s, "round trip");
        }
        let e = "file:".parse::<BackendKind>().unwrap_err();
        assert!(matches!(&e, Error::Option { option, .. } if option == "backend"), "{e}");
    }
}
