//! What a bench's `--backend file:PATH` stands on, checked before anything
//! runs, by the devices' own rules (`iopath_devices::backing`): an existing
//! file or block device is used as it is (never created over, truncated or
//! extended); a missing one is an error unless the user asked for it with
//! `--create`, and then it is made and laid out (every byte written, as fio
//! lays out its files) so that the bench measures reads of data, not of
//! holes.

use iopath_devices::backing::BackingError;
pub use iopath_devices::backing::Prepared;
use iopath_devices::block::StorageKind;

/// The option that asks for a missing file to be made.
pub const CREATE_OPTION: &str = "--create";

/// Checks `backend` for a disk of `bytes` before a bench runs on it; with
/// `create`, makes a missing file of `bytes`, written through (zeros, then
/// fsync). A file that exists but is shorter than `bytes` is refused (the
/// device would have to extend it: the user's file changed).
pub fn prepare(backend: &StorageKind, bytes: u64, create: bool) -> anyhow::Result<Prepared> {
    match iopath_devices::backing::prepare(backend, bytes, create) {
        Ok(p) => Ok(p),
        Err(BackingError::Missing { path, bytes }) => anyhow::bail!(
            "--backend file:{}: no such file; give an existing file or block device, or add {CREATE_OPTION} \
             to make one of {} MiB, written through before it is measured",
            path.display(),
            bytes >> 20
        ),
        // "backend file:PATH: ...": the option as the user typed it.
        Err(e) => anyhow::bail!("--{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_file_names_the_bench_option_and_the_rest_is_the_devices_rule() {
        let d = std::env::temp_dir().join(format!("iopath-bench-backing-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("ns.img");
        let kind = StorageKind::File(p.clone());
        let e = prepare(&kind, 4 << 20, false).unwrap_err().to_string();
        assert!(e.starts_with(&format!("--backend file:{}: no such file", p.display())), "{e}");
        assert!(e.contains(CREATE_OPTION) && e.contains("4 MiB"), "{e}");
        assert!(!p.exists(), "a refused file was made");
        assert_eq!(prepare(&kind, 4 << 20, true).unwrap(), Prepared::Created { bytes: 4 << 20 });
        assert_eq!(prepare(&kind, 4 << 20, true).unwrap(), Prepared::AsIs);
        let e = prepare(&kind, 8 << 20, false).unwrap_err().to_string();
        assert!(e.starts_with("--backend file:") && e.contains("never extends"), "{e}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 20);
        let _ = std::fs::remove_dir_all(&d);
    }
}
