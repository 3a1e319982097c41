//! Block backends of the NVMe namespace: `null` (no data: dispatch cost
//! only), `ram` (keeps data in an anonymous mapping), `file:PATH`
//! (pread/pwrite at LBA offsets). Callers pass LBA ranges already checked
//! against the namespace.

use std::fs::File;
use std::os::unix::fs::FileExt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Null,
    Ram,
    File(std::path::PathBuf),
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "null" => Ok(BackendKind::Null),
            "ram" => Ok(BackendKind::Ram),
            f if f.starts_with("file:") && f.len() > 5 => Ok(BackendKind::File(f[5..].into())),
            _ => Err(format!("unknown backend {s:?} (null, ram, file:PATH)")),
        }
    }
}

pub enum Backend {
    Null,
    Ram(Vec<u8>),
    File(File),
}

impl Backend {
    pub fn open(kind: &BackendKind, bytes: u64) -> Result<Self, String> {
        Ok(match kind {
            BackendKind::Null => Backend::Null,
            BackendKind::Ram => {
                let n = usize::try_from(bytes).map_err(|_| "namespace too large")?;
                // vec! of zeros is calloc: pages are mapped on first touch.
                Backend::Ram(vec![0u8; n])
            }
            BackendKind::File(p) => {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(p)
                    .map_err(|e| format!("{}: {e}", p.display()))?;
                if f.metadata().map_err(|e| e.to_string())?.len() < bytes {
                    f.set_len(bytes).map_err(|e| format!("{}: {e}", p.display()))?;
                }
                Backend::File(f)
            }
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
    pub fn read(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self {
            Backend::Null => Ok(()),
            Backend::Ram(v) => {
                let o = off as usize;
                buf.copy_from_slice(&v[o..o + buf.len()]);
                Ok(())
            }
            Backend::File(f) => f.read_exact_at(buf, off),
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
            Backend::File(f) => f.write_all_at(buf, off),
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
                    f.write_all_at(&z[..n], off + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Backend::File(f) => f.sync_data(),
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
            b.zero(4096, 4096).unwrap();
            b.read(4096, &mut r).unwrap();
            assert_eq!(r, [0; 4]);
        }
        let _ = std::fs::remove_file(path);
        assert!("floppy".parse::<BackendKind>().is_err());
        assert_eq!("file:/x".parse::<BackendKind>().unwrap(), BackendKind::File("/x".into()));
    }
}
