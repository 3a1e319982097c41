//! `--backend file:PATH` as a fio user expects it (the real binary): a
//! missing PATH is refused with a message that names it and `--create`;
//! with `--create` the file is laid out (written, no holes) before it is
//! measured; an existing file is not changed by a read-only bench.

mod common;
use common::TempDir;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};

fn iopath(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iopath")).args(args).output().unwrap()
}

/// A short read-only `bench nvme` on `file` (`more` added).
fn bench_nvme(file: &Path, more: &[&str]) -> Output {
    assert!(Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
    let backend = format!("file:{}", file.display());
    let mut a = vec!["bench", "nvme", "--backend", &backend, "--doorbell", "shm", "--rw", "randread"];
    a.extend(["--bs", "4k", "--iodepth", "4", "--rounds", "1", "--runtime", "300ms", "--quiet", "--json", "-"]);
    a.extend(more);
    a.extend(["--pin", "off"]);
    iopath(&a)
}

#[test]
fn a_missing_backend_file_is_refused_naming_it_and_the_option_that_makes_it() {
    let d = TempDir::new("backing-cli-missing");
    let p = d.join("none.img");
    let backend = format!("file:{}", p.display());
    for args in [vec!["bench", "nvme", "--backend", &backend], vec!["bench", "blk", "--backend", &backend]] {
        let out = iopath(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&p.display().to_string()) && stderr.contains("--create"), "{stderr}");
        assert!(!p.exists(), "{args:?} made {}", p.display());
    }
}

#[test]
fn with_create_the_file_is_written_through_before_it_is_measured() {
    let d = TempDir::new("backing-cli-create");
    let p = d.join("new.img");
    let out = bench_nvme(&p, &["--create"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", out.status);
    let m = std::fs::metadata(&p).unwrap();
    assert_eq!(m.len(), 64 << 20, "the default namespace size");
    assert!(m.blocks() * 512 >= m.len(), "{} bytes allocated of {}: the bench read holes", m.blocks() * 512, m.len());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["runs"][0]["iops"].as_f64().is_some_and(|x| x > 0.0), "{}", v["runs"]);
}

#[test]
fn a_read_only_bench_leaves_an_existing_file_as_it_was() {
    let d = TempDir::new("backing-cli-existing");
    let p = d.join("user.img");
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&p, &data).unwrap();
    let before = std::fs::metadata(&p).unwrap();
    // --create too: a file that is there is used as it is.
    let out = bench_nvme(&p, &["--create"]);
    assert!(out.status.success(), "{}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    let after = std::fs::metadata(&p).unwrap();
    assert_eq!((after.len(), after.ino()), (before.len(), before.ino()), "the file was replaced or resized");
    assert!(std::fs::read(&p).unwrap() == data, "a read-only bench changed the user's file");
    // A file under 1 MiB would have to be extended: refused, and left alone.
    let short = d.join("short.img");
    std::fs::write(&short, b"the user's").unwrap();
    let out = bench_nvme(&short, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(std::fs::read(&short).unwrap(), b"the user's");
}
