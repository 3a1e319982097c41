//! What a `file:PATH` backend stands on, for every device that takes one
//! (the NVMe namespace, virtio-blk in the VMM and over vhost-user) and for
//! the benches' `--backend file:PATH`: an existing regular file or block
//! device that holds the whole disk, used as it is (never created over,
//! truncated or extended). A missing PATH is an error unless the user asked
//! for it (`create=on` in a device spec, `--create` in a bench); then it is
//! made and laid out, every byte written and synced, so that the device
//! reads data, not holes.

use crate::block::{backing_bytes, Storage, StorageKind};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Why a backing file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// PATH is not there, and nobody asked for it to be made.
    #[error("backend file:{}: does not exist; add create=on to lay it out ({} MiB, written through)", path.display(), bytes >> 20)]
    Missing { path: PathBuf, bytes: u64 },
    /// PATH holds less than the disk: iopath would have to extend it.
    #[error("backend file:{}: holds {have} bytes, the disk needs {need} (iopath never extends or truncates an existing file)", path.display())]
    TooShort { path: PathBuf, have: u64, need: u64 },
    /// PATH is a directory, a FIFO, a socket, ...
    #[error("backend file:{}: neither a regular file nor a block device", path.display())]
    NotFile { path: PathBuf },
    /// PATH cannot be looked at, opened or made.
    #[error("backend file:{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What [`prepare`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Prepared {
    /// Not a file backend, or the file was there: nothing touched.
    AsIs,
    /// The file was made and `bytes` written.
    Created { bytes: u64 },
}

/// Checks `backend` for a disk of `bytes` before a device opens it; with
/// `create`, makes a missing file of `bytes`, written through (zeros, then
/// fsync). A file that is there is used as it is, whatever `create` says.
pub fn prepare(backend: &StorageKind, bytes: u64, create: bool) -> Result<Prepared, BackingError> {
    let StorageKind::File(p) = backend else { return Ok(Prepared::AsIs) };
    let mut made = false;
    if create && !exists(p)? {
        // create_new: a file that appeared since is not written over.
        match lay_out(p, bytes) {
            Err(BackingError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AlreadyExists => {}
            r => made = r.map(|()| true)?,
        }
    }
    // Looked at before it is opened: opening a FIFO would block. (With
    // `create`, still missing is a dangling symbolic link: not made through.)
    let m = std::fs::metadata(p).map_err(|e| match create {
        true => BackingError::Io { path: p.clone(), source: e },
        false => open_error(p, bytes, e),
    })?;
    use std::os::unix::fs::FileTypeExt;
    if !(m.file_type().is_file() || m.file_type().is_block_device()) {
        return Err(BackingError::NotFile { path: p.clone() });
    }
    // Read-only: a block device closed after a writable open is probed again by udev.
    let f = File::open(p).map_err(|e| open_error(p, bytes, e))?;
    check(p, &f, bytes)?;
    Ok(if made { Prepared::Created { bytes } } else { Prepared::AsIs })
}

/// Opens `kind` for a disk of `bytes` ([`prepare`] first: a missing file
/// is made only with `create`).
pub fn open(kind: &StorageKind, bytes: u64, create: bool) -> crate::Result<Storage> {
    open_with(kind, bytes, create, true)
}

/// As [`open`]; a file is served O_DIRECT if `direct`, else buffered
/// ([`Storage::open_with`]).
pub fn open_with(kind: &StorageKind, bytes: u64, create: bool, direct: bool) -> crate::Result<Storage> {
    prepare(kind, bytes, create)?;
    Storage::open_with(kind, bytes, direct)
}

/// Opens `p` to read and write a disk of `bytes` on it: it must be there
/// (see [`prepare`]), a regular file or block device that holds `bytes`.
pub fn open_rw(p: &Path, bytes: u64) -> Result<File, BackingError> {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(p).map_err(|e| open_error(p, bytes, e))?;
    check(p, &f, bytes)?;
    Ok(f)
}

fn exists(p: &Path) -> Result<bool, BackingError> {
    match std::fs::symlink_metadata(p) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(BackingError::Io { path: p.into(), source }),
    }
}

fn open_error(p: &Path, bytes: u64, source: std::io::Error) -> BackingError {
    if source.kind() == std::io::ErrorKind::NotFound {
        BackingError::Missing { path: p.into(), bytes }
    } else {
        BackingError::Io { path: p.into(), source }
    }
}

/// `f` (opened from `p`) is a regular file or a block device of `bytes` or more.
fn check(p: &Path, f: &File, bytes: u64) -> Result<(), BackingError> {
    use std::os::unix::fs::FileTypeExt;
    let io = |source| BackingError::Io { path: p.into(), source };
    let t = f.metadata().map_err(io)?.file_type();
    if !(t.is_file() || t.is_block_device()) {
        return Err(BackingError::NotFile { path: p.into() });
    }
    let have = backing_bytes(f).map_err(io)?;
    if have < bytes {
        return Err(BackingError::TooShort { path: p.into(), have, need: bytes });
    }
    Ok(())
}

/// Makes `p` (it must not exist) and writes `bytes` of zeros to it, then
/// fsync: every block allocated and written (an fallocated extent reads
/// as a hole does, without touching the disk). The space is reserved first
/// where the file system can, so that a full disk fails at once. A failure
/// removes the file it made.
fn lay_out(p: &Path, bytes: u64) -> Result<(), BackingError> {
    let io = |source| BackingError::Io { path: p.into(), source };
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(p).map_err(io)?;
    let written = (|| -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(bytes).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
        // SAFETY: fallocate on an fd of ours; it touches no memory of ours.
        if len > 0 && unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(e);
            }
        }
        let chunk = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n])?;
            left -= n as u64;
        }
        f.sync_all()
    })();
    if let Err(source) = written {
        drop(f);
        let _ = std::fs::remove_file(p);
        return Err(BackingError::Io { path: p.into(), source });
    }
    log::info!("{}: created and laid out, {} MiB written", p.display(), bytes >> 20);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A directory of its own, removed on drop.
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(tag: &str) -> Self {
            let d = std::env::temp_dir().join(format!("iopath-backing-{}-{tag}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Scratch(d)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_missing_file_is_refused_unless_asked_and_then_written_through() {
        let d = Scratch::new("missing");
        let p = d.0.join("ns.img");
        let kind = StorageKind::File(p.clone());
        for e in [prepare(&kind, 4 << 20, false).unwrap_err(), open_rw(&p, 4 << 20).unwrap_err()] {
            assert!(matches!(e, BackingError::Missing { bytes: 0x40_0000, .. }), "{e:?}");
            let s = e.to_string();
            assert!(s.contains(&p.display().to_string()) && s.contains("does not exist; add create=on"), "{s}");
        }
        assert!(!p.exists(), "a refused file was made");
        assert_eq!(prepare(&kind, 4 << 20, true).unwrap(), Prepared::Created { bytes: 4 << 20 });
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 4 << 20);
        assert!(m.blocks() * 512 >= m.len(), "{} of {} bytes allocated: holes", m.blocks() * 512, m.len());
        assert!(std::fs::read(&p).unwrap().iter().all(|&b| b == 0));
        // There now: used as it is, whatever `create` says; a bigger disk does not fit.
        assert_eq!(prepare(&kind, 4 << 20, true).unwrap(), Prepared::AsIs);
        assert_eq!(prepare(&kind, 1 << 20, false).unwrap(), Prepared::AsIs);
        let e = prepare(&kind, 8 << 20, true).unwrap_err();
        assert!(matches!(e, BackingError::TooShort { have: 0x40_0000, need: 0x80_0000, .. }), "{e:?}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 20, "extended");
        open_rw(&p, 4 << 20).unwrap();
    }

    #[test]
    fn an_existing_file_is_never_touched_and_a_short_one_is_refused() {
        let d = Scratch::new("existing");
        let p = d.0.join("user.img");
        let data: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        assert_eq!(prepare(&StorageKind::File(p.clone()), 2 << 20, true).unwrap(), Prepared::AsIs);
        drop(open_rw(&p, 1 << 20).unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), data, "the user's file changed");
        for e in
            [prepare(&StorageKind::File(p.clone()), 64 << 20, true).unwrap_err(), open_rw(&p, 64 << 20).unwrap_err()]
        {
            let s = e.to_string();
            assert!(s.contains("holds 2097152 bytes, the disk needs 67108864") && s.contains("never extends"), "{s}");
        }
        assert_eq!(std::fs::read(&p).unwrap(), data, "the user's file changed");
        let e = prepare(&StorageKind::File(d.0.clone()), 1 << 20, true).unwrap_err();
        assert!(e.to_string().contains("neither a regular file"), "{e}");
        for k in [StorageKind::Null, StorageKind::Ram] {
            assert_eq!(prepare(&k, 1 << 20, false).unwrap(), Prepared::AsIs);
        }
    }

    #[test]
    fn what_cannot_be_made_is_not_made() {
        let d = Scratch::new("cannot");
        // No directory to make it in.
        let p = d.0.join("no-dir").join("ns.img");
        let e = prepare(&StorageKind::File(p.clone()), 1 << 20, true).unwrap_err();
        assert!(
            matches!(&e, BackingError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
        assert!(!d.0.join("no-dir").exists());
        // A dangling symbolic link: not followed to make its target.
        let link = d.0.join("link.img");
        std::os::unix::fs::symlink(d.0.join("target.img"), &link).unwrap();
        let e = prepare(&StorageKind::File(link.clone()), 1 << 20, true).unwrap_err();
        assert!(matches!(e, BackingError::Io { .. }), "{e:?}");
        assert!(!d.0.join("target.img").exists(), "made through a link");
    }
}
