//! The process's logger: env_logger's format and `RUST_LOG` filter, with a
//! rate limit, because what a guest or a peer does can be logged.
//!
//! A guest that keeps writing a bad doorbell, or a client that sends a
//! million malformed requests, must not turn into megabytes of stderr (a
//! disk filled, a terminal unusable, a slow device thread). Each call site
//! (module and line) has a token bucket: [`SITE_BURST`] lines at once, then
//! [`SITE_PER_SEC`] a second; the whole process has another ([`ALL_BURST`],
//! [`ALL_PER_SEC`]), so the log volume is bounded whatever the number of
//! sites. A line that gets through after others from its site were dropped
//! says how many were.
//!
//! Whether lines are coloured is decided once, when the logger is made
//! (`RUST_LOG_STYLE`, else whether stderr is a terminal that takes colour,
//! as env_logger decides it), and each line is then one plain write to
//! stderr: env_logger's own stderr writer asks the terminal again at every
//! line (an ioctl), which a confined device process (`iopath serve`'s
//! seccomp filters) may not make.

use log::{Log, Metadata, Record};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// Lines a call site may log at once.
pub const SITE_BURST: f64 = 10.0;
/// Lines a second a call site may log after its burst.
pub const SITE_PER_SEC: f64 = 1.0;
/// Lines the process may log at once.
pub const ALL_BURST: f64 = 50.0;
/// Lines a second the process may log after its burst.
pub const ALL_PER_SEC: f64 = 10.0;

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new(burst: f64, now: Instant) -> Self {
        Bucket { tokens: burst, at: now }
    }

    /// Refills for the time since the last call, then takes a token if there is one.
    fn take(&mut self, burst: f64, per_sec: f64, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * per_sec).min(burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A call site's bucket and the lines it dropped since its last one out.
struct Site {
    bucket: Bucket,
    dropped: u64,
}

/// The budgets; call sites are the binary's `log!` invocations, so the map
/// holds at most one entry per line of source that logs.
pub struct Limiter {
    all: Bucket,
    sites: HashMap<(&'static str, u32), Site>,
}

impl Limiter {
    pub fn new(now: Instant) -> Self {
        Limiter { all: Bucket::new(ALL_BURST, now), sites: HashMap::new() }
    }

    /// Whether a line from `site` goes out at `now`; if it does, how many
    /// from that site were dropped before it.
    pub fn admit(&mut self, site: (&'static str, u32), now: Instant) -> Option<u64> {
        let s = self.sites.entry(site).or_insert_with(|| Site { bucket: Bucket::new(SITE_BURST, now), dropped: 0 });
        // Both budgets must have a token; the process's is only spent on a
        // line its site lets through.
        if s.bucket.take(SITE_BURST, SITE_PER_SEC, now) && self.all.take(ALL_BURST, ALL_PER_SEC, now) {
            Some(std::mem::take(&mut s.dropped))
        } else {
            s.dropped += 1;
            None
        }
    }
}

/// env_logger behind a [`Limiter`].
struct RateLimited {
    inner: env_logger::Logger,
    limiter: Mutex<Limiter>,
}

impl Log for RateLimited {
    fn enabled(&self, m: &Metadata) -> bool {
        self.inner.enabled(m)
    }

    fn log(&self, r: &Record) {
        if !self.inner.enabled(r.metadata()) {
            return;
        }
        let site = (r.module_path_static().or(r.file_static()).unwrap_or("?"), r.line().unwrap_or(0));
        let admitted = iopath_devices::lock(&self.limiter).admit(site, Instant::now());
        match admitted {
            None => {}
            Some(0) => self.inner.log(r),
            Some(n) => self.inner.log(
                &Record::builder()
                    .args(format_args!("{} ({n} more like this dropped by the log rate limit)", r.args()))
                    .metadata(r.metadata().clone())
                    .module_path(r.module_path())
                    .file(r.file())
                    .line(r.line())
                    .build(),
            ),
        }
    }

    fn flush(&self) {
        self.inner.flush()
    }
}

/// Where the lines go: stderr, one write each (a line is formatted whole
/// first), with no terminal check.
struct Stderr;

impl std::io::Write for Stderr {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(()) // stderr is not buffered
    }
}

/// Colours or not, decided now: `RUST_LOG_STYLE` (`always`, `never`; else
/// `auto`), and for `auto` what anstream makes of stderr (NO_COLOR,
/// CLICOLOR_FORCE, a terminal whose TERM takes colour), as env_logger does.
fn style(var: Option<&str>) -> env_logger::WriteStyle {
    match var {
        Some("always") => env_logger::WriteStyle::Always,
        Some("never") => env_logger::WriteStyle::Never,
        _ => anstream::AutoStream::choice(&std::io::stderr()).into(),
    }
}

/// Installs the logger: `RUST_LOG` (default `warn`), rate-limited.
pub fn init() {
    let style = style(std::env::var("RUST_LOG_STYLE").ok().as_deref());
    let inner = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .write_style(style)
        .target(env_logger::Target::Pipe(Box::new(Stderr)))
        .build();
    let level = inner.filter();
    let logger = RateLimited { inner, limiter: Mutex::new(Limiter::new(Instant::now())) };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_site_gets_its_burst_then_one_line_a_second_with_the_count_it_dropped() {
        let t0 = Instant::now();
        let mut l = Limiter::new(t0);
        let site = ("nvme", 213);
        let out = (0..1000).filter(|_| l.admit(site, t0).is_some()).count();
        assert_eq!(out, SITE_BURST as usize);
        assert_eq!(l.admit(site, t0 + Duration::from_millis(500)), None);
        assert_eq!(l.admit(site, t0 + Duration::from_millis(1100)), Some(991), "990 + the one at 500 ms");
        assert_eq!(l.admit(site, t0 + Duration::from_millis(1200)), None);
    }

    #[test]
    fn the_style_is_the_one_rust_log_style_names_else_what_stderr_takes() {
        use env_logger::WriteStyle;
        assert_eq!(style(Some("always")), WriteStyle::Always);
        assert_eq!(style(Some("never")), WriteStyle::Never);
        // auto (or anything else): decided now, once, never left to each line.
        for v in [None, Some("auto"), Some("bogus")] {
            assert_ne!(style(v), WriteStyle::Auto, "{v:?}");
        }
    }

    #[test]
    fn the_process_budget_bounds_many_sites_and_sites_do_not_starve_each_other() {
        let t0 = Instant::now();
        let mut l = Limiter::new(t0);
        let out = (0..100u32)
            .flat_map(|line| (0..20).map(move |_| ("vfio_user", line)))
            .filter(|&s| l.admit(s, t0).is_some())
            .count();
        assert_eq!(out, ALL_BURST as usize);
        // Ten seconds on, every second the process lets ALL_PER_SEC lines out in all.
        let t = t0 + Duration::from_secs(10);
        let out = (0..1000u32).filter(|&line| l.admit(("other", line), t).is_some()).count();
        assert_eq!(out, ALL_BURST as usize, "refilled to its burst, not beyond");
        // A quiet site still gets a line out once the process has tokens again.
        let t = t + Duration::from_secs(1);
        assert_eq!(l.admit(("quiet", 1), t), Some(0));
    }
}
