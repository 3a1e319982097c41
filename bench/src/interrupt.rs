//! Ctrl-C for every bench: SIGINT, SIGTERM and SIGHUP set one flag
//! ([`FLAG`]) while a [`SignalGuard`] lives, instead of killing the process
//! with its children running and its files in place. Every wait of a bench
//! (a QEMU, fio or perf run, a VM run through `VmConfig::cancel`, the loop
//! over rounds) looks at the flag, so the bench unwinds through the drops
//! that stop and reap its children and remove its files, keeps the rounds
//! measured so far, and the CLI prints them marked partial and exits 130.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Set by the handler; `VmConfig::cancel` takes it as is.
pub static FLAG: AtomicBool = AtomicBool::new(false);

/// Guards alive: the flag is cleared by the outermost only, so that a
/// signal that came before an inner bench started is not forgotten.
static DEPTH: AtomicUsize = AtomicUsize::new(0);

/// The error a wait returns once a signal asked the bench to stop.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by a signal: the bench stopped its processes and removed their files")]
pub struct Interrupted;

/// Whether SIGINT, SIGTERM or SIGHUP came since the outermost [`SignalGuard`] was made.
pub fn interrupted() -> bool {
    FLAG.load(Ordering::Relaxed)
}

/// Fails with [`Interrupted`] once a signal came.
pub fn check() -> Result<(), Interrupted> {
    if interrupted() {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

/// `e`, or [`Interrupted`] if a signal came meanwhile (whatever failed
/// because of it, a child the terminal's Ctrl-C also reached, is that).
pub fn or_interrupted(e: anyhow::Error) -> anyhow::Error {
    if interrupted() && !e.is::<Interrupted>() {
        Interrupted.into()
    } else {
        e
    }
}

/// The line a partial result's table starts with (its JSON has `"partial": true`).
pub fn partial_line(runs: usize) -> String {
    format!("PARTIAL: interrupted by a signal after {runs} run(s); the rounds below are those measured before it")
}

extern "C" fn on_signal(_: libc::c_int) {
    FLAG.store(true, Ordering::Relaxed);
}

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Catches SIGINT, SIGTERM and SIGHUP while it lives (the flag above);
/// the previous dispositions come back when it drops.
pub struct SignalGuard {
    old: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalGuard {
    pub fn install() -> std::io::Result<SignalGuard> {
        if DEPTH.fetch_add(1, Ordering::Relaxed) == 0 {
            FLAG.store(false, Ordering::Relaxed);
        }
        let mut g = SignalGuard { old: Vec::new() };
        for sig in SIGNALS {
            // SAFETY: sigaction with a zeroed struct whose handler only stores to an atomic
            // (async-signal-safe); `old` receives the previous action.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                let mut old: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &sa, &mut old) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                g.old.push((sig, old));
            }
        }
        Ok(g)
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        for (sig, old) in &self.old {
            // SAFETY: restores an action sigaction returned.
            unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
        }
        DEPTH.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Unit tests that wait on the flag, or set it, hold this: it is one per process.
#[cfg(test)]
pub(crate) static TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_sets_the_flag_and_the_old_disposition_comes_back() {
        let _one = TEST_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let outer = SignalGuard::install().unwrap();
        assert!(check().is_ok());
        // SAFETY: raise(2) on ourselves; SIGHUP is caught by the guard just installed.
        unsafe { libc::raise(libc::SIGHUP) };
        assert!(interrupted() && check().is_err());
        // An inner bench's guard keeps what came before it.
        let inner = SignalGuard::install().unwrap();
        assert!(interrupted(), "an inner guard forgot a signal");
        let e = or_interrupted(anyhow::anyhow!("qemu: killed by SIGINT"));
        assert!(e.is::<Interrupted>(), "{e}");
        drop(inner);
        drop(outer);
        // SAFETY: sigaction query only.
        let old = unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut old);
            old
        };
        assert_ne!(old.sa_sigaction, on_signal as extern "C" fn(libc::c_int) as usize, "the handler stayed");
        FLAG.store(false, Ordering::Relaxed);
    }
}
