//! The one progress display of every bench: how many runs are done, of how
//! many, the time so far and the estimated time left (ETA) for the whole bench.
//!
//! At a terminal it is an indicatif bar on stderr. Without one (CI, a pipe,
//! `2> log`) the bar stays hidden and a thread prints plain lines on stderr:
//! one when a run ends (at most one per [`Plain::min_gap`]) and one at least
//! every [`Plain::every`] while a run goes on, so a long run never looks
//! stuck. The thread ends with the bar (it holds only a weak reference).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, WeakProgressBar};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// When plain progress lines are printed.
#[derive(Clone, Copy, Debug)]
pub struct Plain {
    /// A line at least this often while the bench runs.
    pub every: Duration,
    /// At most one line per this when runs end quickly one after another.
    pub min_gap: Duration,
}

impl Default for Plain {
    fn default() -> Self {
        Plain { every: Duration::from_secs(10), min_gap: Duration::from_secs(2) }
    }
}

/// The progress of a bench of `len` runs: hidden without `show`; a bar with
/// an ETA at a terminal; plain lines on stderr otherwise.
pub fn bar(show: bool, len: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    if std::io::stderr().is_terminal() {
        let pb = ProgressBar::new(len);
        if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} ETA {eta} {msg}") {
            pb.set_style(style.progress_chars("=> "));
        }
        return pb;
    }
    plain(len, Plain::default(), Box::new(std::io::stderr()))
}

/// A hidden bar whose state a thread prints to `out` as plain lines.
pub fn plain(len: u64, when: Plain, out: Box<dyn Write + Send>) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden());
    let weak = pb.downgrade();
    let spawned = std::thread::Builder::new().name("progress".into()).spawn(move || lines(&weak, when, out));
    if let Err(e) = spawned {
        log::warn!("no progress lines: {e}");
    }
    pb
}

fn lines(weak: &WeakProgressBar, when: Plain, mut out: Box<dyn Write + Send>) {
    let tick = when.min_gap.min(when.every).clamp(Duration::from_millis(1), Duration::from_millis(200));
    let (mut last_line, mut last_pos) = (Instant::now(), 0);
    loop {
        std::thread::sleep(tick);
        let Some(pb) = weak.upgrade() else { return };
        if pb.is_finished() {
            return;
        }
        let pos = pb.position();
        let since = last_line.elapsed();
        if (pos != last_pos && since >= when.min_gap) || since >= when.every {
            let eta = (pos > 0).then(|| pb.eta());
            let _ = writeln!(out, "{}", line(pos, pb.length().unwrap_or(0), pb.elapsed(), eta, &pb.message()));
            let _ = out.flush();
            (last_line, last_pos) = (Instant::now(), pos);
        }
    }
}

/// One plain progress line: `progress: 3/12 runs, 0:42 elapsed, ETA 2:06: <what runs>`.
pub fn line(pos: u64, len: u64, elapsed: Duration, eta: Option<Duration>, msg: &str) -> String {
    let eta = match eta {
        // Re-runs a guard asked for, or a bench's last steps, come after the planned runs.
        _ if len > 0 && pos >= len => "none: the planned runs are done; re-runs and the last steps go on".to_string(),
        Some(d) => clock(d),
        None => "not known yet".to_string(),
    };
    let msg = if msg.is_empty() { String::new() } else { format!(": {msg}") };
    format!("progress: {pos}/{len} runs, {} elapsed, ETA {eta}{msg}", clock(elapsed))
}

/// m:ss, or h:mm:ss from an hour.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_says_runs_done_of_all_elapsed_and_eta() {
        let l = line(3, 12, Duration::from_secs(42), Some(Duration::from_secs(126)), "nvme shm qd16");
        assert_eq!(l, "progress: 3/12 runs, 0:42 elapsed, ETA 2:06: nvme shm qd16");
        let l = line(0, 2, Duration::from_secs(3725), None, "");
        assert_eq!(l, "progress: 0/2 runs, 1:02:05 elapsed, ETA not known yet");
        let l = line(18, 18, Duration::from_secs(341), Some(Duration::ZERO), "re-run 49");
        assert!(l.contains("ETA none: the planned runs are done"), "{l}");
    }

    /// Without a terminal: a line when a run ends, one while a run goes on
    /// (every `every`), and none once the bar is gone.
    #[test]
    fn without_a_terminal_runs_and_waits_print_plain_lines_until_the_bar_goes() {
        let sink = Sink::default();
        let when = Plain { every: Duration::from_millis(300), min_gap: Duration::from_millis(20) };
        let pb = plain(4, when, Box::new(sink.clone()));
        pb.set_message("round 1");
        pb.inc(1);
        let text = || String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        // (A bound, not a speed: a loaded host may be slow to run the thread.)
        let end = Instant::now() + Duration::from_secs(20);
        while text().lines().count() < 2 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = text();
        let seen: Vec<&str> = text.lines().collect();
        assert!(
            seen.first().is_some_and(|l| l.starts_with("progress: 1/4 runs, ") && l.ends_with(": round 1")),
            "{seen:?}"
        );
        assert!(seen.len() >= 2, "a line while the run goes on: {seen:?}");
        drop(pb);
        std::thread::sleep(Duration::from_millis(500));
        let after = sink.0.lock().unwrap().len();
        std::thread::sleep(Duration::from_millis(700));
        assert_eq!(sink.0.lock().unwrap().len(), after, "lines after the bar was dropped");
    }
}
