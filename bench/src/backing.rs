//! What a bench's `--backend file:PATH` stands on, checked before anything
//! runs: an existing file or block device is used as it is (never created
//! over, truncated or extended); a missing one is an error unless the user
//! asked for it with `--create`, and then it is made and laid out (every
//! byte written, as fio lays out its files) so that the bench measures
//! reads of data, not of holes.

use iopath_devices::block::StorageKind;
use std::io::Write;
use std::path::Path;

/// The option that asks for a missing file to be made.
pub const CREATE_OPTION: &str = "--create";

/// Smallest file a namespace stands on (the namespace is the file's whole MiB).
const MIN_BYTES: u64 = 1 << 20;

/// What [`prepare`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Prepared {
    /// Not a file backend, or the file was there: nothing touched.
    AsIs,
    /// The file was made and `bytes` written.
    Created { bytes: u64 },
}

/// Checks `backend` before a bench runs on it; with `create`, makes a
/// missing file of `bytes`, written through (zeros, then fsync). A file
/// that exists but is shorter than 1 MiB is refused (the device would
/// extend it: the user's file changed).
pub fn prepare(backend: &StorageKind, bytes: u64, create: bool) -> anyhow::Result<Prepared> {
    let StorageKind::File(p) = backend else { return Ok(Prepared::AsIs) };
    match std::fs::metadata(p) {
        Ok(m) => {
            use std::os::unix::fs::FileTypeExt;
            if m.file_type().is_file() && m.len() < MIN_BYTES {
                anyhow::bail!(
                    "--backend file:{}: the file holds {} bytes, a namespace needs at least 1 MiB \
                     (iopath does not extend an existing file)",
                    p.display(),
                    m.len()
                );
            }
            if !(m.file_type().is_file() || m.file_type().is_block_device()) {
                anyhow::bail!("--backend file:{}: neither a regular file nor a block device", p.display());
            }
            Ok(Prepared::AsIs)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !create {
                anyhow::bail!(
                    "--backend file:{}: no such file; give an existing file or block device, or add {CREATE_OPTION} \
                     to make one of {} MiB, written through before it is measured",
                    p.display(),
                    bytes >> 20
                );
            }
            lay_out(p, bytes)?;
            Ok(Prepared::Created { bytes })
        }
        Err(e) => anyhow::bail!("--backend file:{}: {e}", p.display()),
    }
}

/// Makes `p` (it must not exist) and writes `bytes` of zeros to it, then
/// fsync: every block allocated. A failure removes the file it made.
fn lay_out(p: &Path, bytes: u64) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(p)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", p.display()))?;
    let chunk = vec![0u8; 1 << 20];
    let written = (|| -> std::io::Result<()> {
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n])?;
            left -= n as u64;
        }
        f.sync_all()
    })();
    if let Err(e) = written {
        drop(f);
        let _ = std::fs::remove_file(p);
        anyhow::bail!("cannot lay out {} ({bytes} bytes): {e}", p.display());
    }
    log::info!("{}: created and laid out, {} MiB written", p.display(), bytes >> 20);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("iopath-backing-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_missing_file_is_refused_unless_asked_and_then_written_through() {
        let d = scratch("missing");
        let p = d.join("ns.img");
        let kind = StorageKind::File(p.clone());
        let e = prepare(&kind, 4 << 20, false).unwrap_err().to_string();
        assert!(e.contains(&p.display().to_string()) && e.contains(CREATE_OPTION), "{e}");
        assert!(!p.exists(), "a refused file was made");
        assert_eq!(prepare(&kind, 4 << 20, true).unwrap(), Prepared::Created { bytes: 4 << 20 });
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 4 << 20);
        assert!(m.blocks() * 512 >= m.len(), "{} of {} bytes allocated: holes", m.blocks() * 512, m.len());
        // There now: used as it is, whatever `create` says.
        assert_eq!(prepare(&kind, 8 << 20, true).unwrap(), Prepared::AsIs);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 20);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn an_existing_file_is_never_touched_and_a_short_one_is_refused() {
        let d = scratch("existing");
        let p = d.join("user.img");
        let data: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        assert_eq!(prepare(&StorageKind::File(p.clone()), 64 << 20, true).unwrap(), Prepared::AsIs);
        assert_eq!(std::fs::read(&p).unwrap(), data, "the user's file changed");
        let short = d.join("short.img");
        std::fs::write(&short, b"mine").unwrap();
        let e = prepare(&StorageKind::File(short.clone()), 64 << 20, true).unwrap_err().to_string();
        assert!(e.contains("at least 1 MiB"), "{e}");
        assert_eq!(std::fs::read(&short).unwrap(), b"mine");
        let e = prepare(&StorageKind::File(d.clone()), 1 << 20, true).unwrap_err().to_string();
        assert!(e.contains("neither a regular file"), "{e}");
        for k in [StorageKind::Null, StorageKind::Ram] {
            assert_eq!(prepare(&k, 1 << 20, false).unwrap(), Prepared::AsIs);
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
