//! The fence between a killed device process and the next one on the same
//! file: a resumed device re-executes the writes the dead one had in
//! flight, and the guest may then write those blocks again; a write of the
//! dead process still running in the kernel (io_uring's workers carry
//! operations out after their process is gone) must not land after that.
//!
//! Every file storage holds a shared open-file-description lock (OFD,
//! `F_OFD_SETLK`) on the file its io_uring reads and writes through. That
//! description lives as long as anything refers to it: the ring's fixed
//! file table, and so every operation still in flight, after the process
//! that opened it died. A resumed device first takes an exclusive lock on
//! its own description, which it gets only once no other description holds
//! one: the dead process's ring and all it carried out are gone. Then it
//! holds its shared lock as the one before it did.
//!
//! A file that cannot be locked (a file system without OFD locks) is
//! served without the fence, saying so once.

use crate::{Error, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How long a resume waits for the dead process's operations.
pub const FENCE_WAIT: Duration = Duration::from_secs(10);

fn lock(f: &File, kind: i32) -> std::io::Result<()> {
    // SAFETY: a zeroed flock is a valid value; the fields set below.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    (l.l_start, l.l_len) = (0, 0); // the whole file, as it grows too
                                   // SAFETY: fcntl on an fd `f` owns, with a flock that outlives the call.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l as *const libc::flock) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The shared lock on `f`'s description, held from now on.
pub(super) fn hold(f: &File, what: &str) {
    if let Err(e) = lock(f, libc::F_RDLCK) {
        log::warn!("{what}: no lock on the file ({e}): a resumed device here cannot wait for a dead one's writes");
    }
}

#[cfg(test)]
thread_local! {
    /// The crate's in-process death tests leak the dead device (no cleanup
    /// may run), so its descriptions never end: set, a resume on this
    /// thread does not wait for them. A real death ends them (the fence's
    /// own test here, the kill loops of `cli/tests` over real processes).
    pub static PREDECESSOR_LEAKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Waits (at most `wait`) until no other description of `f` holds a lock,
/// then holds the shared one again.
pub(super) fn after_predecessor(f: &File, what: &str, wait: Duration) -> Result<()> {
    #[cfg(test)]
    if PREDECESSOR_LEAKED.get() {
        return Ok(());
    }
    let t = Instant::now();
    loop {
        match lock(f, libc::F_WRLCK) {
            Ok(()) => break,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
                if t.elapsed() >= wait {
                    return Err(Error::Host(format!(
                        "{what}: another open description of the file holds it {wait:?} after a resume \
                         (a dead device process's writes still running, or another process serving it)"
                    )));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => {
                log::warn!("{what}: no lock on the file ({e}): resumed without waiting for a dead process's writes");
                return Ok(());
            }
        }
    }
    if t.elapsed() > Duration::from_millis(1) {
        log::info!("{what}: the dead device process's file operations ended {:?} into the resume", t.elapsed());
    }
    hold(f, what);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    fn open(p: &std::path::Path) -> File {
        std::fs::OpenOptions::new().read(true).write(true).open(p).unwrap()
    }

    #[test]
    fn a_resume_waits_for_every_other_description_of_the_file_to_end() {
        let p = std::env::temp_dir().join(format!("iopath-fence-{}", std::process::id()));
        std::fs::write(&p, [0u8; 4096]).unwrap();
        // The dead process's description, kept alive (as by its ring) by a dup.
        let dead = open(&p);
        hold(&dead, "dead");
        let in_flight = dead.try_clone().unwrap();
        drop(dead);
        let ended = Arc::new(AtomicBool::new(false));
        let e = ended.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            e.store(true, Ordering::SeqCst);
            drop(in_flight); // its last operation done: the description ends
        });
        let next = open(&p);
        hold(&next, "next");
        after_predecessor(&next, "next", FENCE_WAIT).unwrap();
        assert!(ended.load(Ordering::SeqCst), "the resume went on while the dead description lived");
        h.join().unwrap();
        // It holds the shared lock now: the one after it waits for it in turn.
        let after = open(&p);
        let err = after_predecessor(&after, "after", Duration::from_millis(20)).unwrap_err();
        assert!(err.to_string().contains("another open description"), "{err}");
        drop(next);
        after_predecessor(&after, "after", FENCE_WAIT).unwrap();
        let _ = std::fs::remove_file(&p);
    }
}
