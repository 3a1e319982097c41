//! Hostile peers: what a malicious or broken client/server may send must be
//! refused without leaking resources or crashing the other side.

use iopath_protocols::socket::{self, MAX_FDS};
use std::fs::File;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

/// Tests in this file that count the process's fds run one at a time.
static FD_COUNTING: Mutex<()> = Mutex::new(());

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn memfd() -> File {
    // SAFETY: a NUL-terminated name; the new fd is owned at once.
    let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd nothing else owns.
    unsafe { File::from_raw_fd(fd) }
}

/// D4: a message with n fds is received; more than MAX_FDS is an error, and
/// in every case no fd stays open once the received `File`s are dropped.
#[test]
fn scm_rights_over_the_limit_is_refused_and_leaks_no_fd() {
    let _g = FD_COUNTING.lock().unwrap_or_else(|e| e.into_inner());
    let f = memfd();
    for n in [1usize, 16, 17, 18, 30] {
        let (a, b) = UnixStream::pair().unwrap();
        let before = open_fds();
        let fds: Vec<RawFd> = vec![f.as_raw_fd(); n];
        socket::send(&a, &[b"hdr!", b"body"], &fds).unwrap();
        let mut h = [0u8; 4];
        let r = socket::recv_exact(&b, &mut h);
        if n <= MAX_FDS {
            let files = r.unwrap_or_else(|e| panic!("{n} fds: {e}"));
            assert_eq!(files.len(), n);
            assert_eq!(&h, b"hdr!");
        } else {
            let e = r.expect_err(&format!("{n} fds must be refused"));
            assert_eq!(e.kind(), ErrorKind::InvalidData, "{n} fds: {e}");
        }
        // Everything received is dropped by now (Ok's files, or the error).
        let after = open_fds();
        assert_eq!(after, before, "{n} fds: {} fd(s) leaked", after as isize - before as isize);
    }
}
