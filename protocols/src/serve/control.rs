//! The control socket of a device process (`iopath serve ... --control
//! PATH`): a test harness changes the device's error injection while the
//! device runs, and reads its counters. `iopath ctl PATH ...` is its client.
//!
//! # Protocol: JSON lines
//! Each request is one line (at most [`MAX_REQUEST`] bytes) holding an
//! object with `"cmd"`; each gets one line back, `{"ok":true,...}` or
//! `{"ok":false,"error":TEXT}` (with `"field"` when the error names a piece
//! of a rule). Requests on a connection are answered in order.
//!
//! | request | reply |
//! |---|---|
//! | `{"cmd":"list"}` | `{"ok":true,"rules":[RULE...]}` in the order they are tried, each with its `"id"` |
//! | `{"cmd":"stats"}` | `{"ok":true,"stats":{"commands":N,"injected":N,"rules":[{"id":N,"matched":N,"fired":N}...]}}` |
//! | `{"cmd":"inject","rule":RULE}` | `{"ok":true,"id":N}` (the rule is tried after those already there) |
//! | `{"cmd":"remove","id":N}` | `{"ok":true,"rule":RULE}` |
//! | `{"cmd":"clear"}` | `{"ok":true,"removed":N}` |
//! | `{"cmd":"attach","nsid":N}` | `{"ok":true,"nsid":N,"changed":BOOL}` (false: it was attached) |
//! | `{"cmd":"detach","nsid":N}` | `{"ok":true,"nsid":N,"changed":BOOL}` (false: it was detached) |
//!
//! RULE is the JSON form of `iopath_devices::block::inject` (its module
//! doc has the grammar). Unknown commands and fields are errors. `attach`
//! and `detach` change an NVMe namespace as a namespace management tool
//! would: the host is told with a Namespace Attribute Changed event where
//! it enabled them, and rescans; a device without namespaces refuses them.
//!
//! # Bounds (a client is a peer like any other)
//! One thread (`serve-control`) serves every connection with `poll`: at
//! most [`MAX_CLIENTS`] at once (one more is told so and closed), a
//! request line of at most [`MAX_REQUEST`] bytes (a longer one is answered
//! with an error and its connection closed), a connection idle for
//! [`IDLE_TIMEOUT`] closed, a reply a client does not take within
//! [`SEND_TIMEOUT`] closes it. The rules a client may add are bounded by
//! the rule set ([`MAX_RULES`](iopath_devices::block::inject::set::MAX_RULES)).
//! Nothing is logged per request (a client cannot flood the log); a
//! connection closed for breaking a bound gets one debug line.
//!
//! The socket file is bound as `--socket`'s is (`listen.rs`: nothing there
//! or a stale socket; never another file) and removed when the process
//! ends, however it ends (`janitor.rs`).

use super::listen::Bound;
use crate::{Error, Result};
use iopath_devices::block::inject::{Injector, Rule, RuleError};
use iopath_devices::{DeviceModel, SharedDevice};
use serde_json::{json, Map, Value};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// The most connections served at once.
pub const MAX_CLIENTS: usize = 8;
/// The longest request line, newline included.
pub const MAX_REQUEST: usize = 8192;
/// A connection with no request for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a client may leave a reply untaken.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// A request's answer: the reply's fields besides `"ok":true`, or the
/// error.
type Answer = std::result::Result<Map<String, Value>, (String, Option<&'static str>)>;

/// Answers one request line on the device's rules `target` (the same
/// [`Injector`] its threads ask per command) and, for `attach` and
/// `detach`, on `device` (None: refused).
pub fn answer(target: &Injector, device: Option<&dyn DeviceModel>, line: &str) -> Value {
    match request(target, device, line) {
        Ok(mut m) => {
            let mut r = Map::new();
            r.insert("ok".into(), true.into());
            r.append(&mut m);
            Value::Object(r)
        }
        Err((error, field)) => {
            let mut r = json!({"ok": false, "error": error});
            if let Some(f) = field {
                r["field"] = f.into();
            }
            r
        }
    }
}

fn rule_error(e: RuleError) -> (String, Option<&'static str>) {
    let f = e.field();
    (e.to_string(), f)
}

fn request(target: &Injector, device: Option<&dyn DeviceModel>, line: &str) -> Answer {
    let plain = |s: &str| (s.to_string(), None);
    let v: Value = serde_json::from_str(line).map_err(|e| (format!("not JSON: {e}"), None))?;
    let Value::Object(m) = v else { return Err(plain("a request is a JSON object with \"cmd\"")) };
    let cmd = match m.get("cmd") {
        Some(Value::String(c)) => c.as_str(),
        Some(_) => return Err(("cmd: not a string".into(), Some("cmd"))),
        None => return Err(("cmd: missing".into(), Some("cmd"))),
    };
    let allowed: &[&str] = match cmd {
        "list" | "stats" | "clear" => &["cmd"],
        "inject" => &["cmd", "rule"],
        "remove" => &["cmd", "id"],
        "attach" | "detach" => &["cmd", "nsid"],
        _ => {
            let shown: String = cmd.chars().take(40).collect();
            return Err((
                format!("cmd: unknown command {shown:?} (one of list, stats, inject, remove, clear, attach, detach)"),
                Some("cmd"),
            ));
        }
    };
    if let Some(k) = m.keys().find(|k| !allowed.contains(&k.as_str())) {
        let shown: String = k.chars().take(40).collect();
        return Err((format!("{cmd}: unknown field {shown:?} (one of {})", allowed.join(", ")), None));
    }
    let mut r = Map::new();
    match cmd {
        "list" => {
            r.insert("rules".into(), target.list().iter().map(Rule::to_value).collect());
        }
        "stats" => {
            let s = serde_json::to_value(target.stats()).map_err(|e| plain(&e.to_string()))?;
            r.insert("stats".into(), s);
        }
        "clear" => {
            r.insert("removed".into(), target.clear().into());
        }
        "inject" => {
            let v = m.get("rule").ok_or(("rule: missing".to_string(), Some("rule")))?;
            let rule = Rule::from_value(v).map_err(rule_error)?;
            r.insert("id".into(), target.add(rule).map_err(rule_error)?.into());
        }
        "remove" => {
            let id =
                m.get("id").and_then(Value::as_u64).ok_or(("id: missing or not a rule id".to_string(), Some("id")))?;
            r.insert("rule".into(), target.remove(id).map_err(rule_error)?.to_value());
        }
        "attach" | "detach" => {
            let nsid = m
                .get("nsid")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(("nsid: missing or not a namespace id".to_string(), Some("nsid")))?;
            let device = device.ok_or(("nsid: this device has no namespaces".to_string(), Some("nsid")))?;
            let changed =
                device.set_namespace_attached(nsid, cmd == "attach").map_err(|e| (e.to_string(), Some("nsid")))?;
            r.insert("nsid".into(), nsid.into());
            r.insert("changed".into(), changed.into());
        }
        _ => unreachable!("commands are listed above"),
    }
    Ok(r)
}

/// A control socket being served; dropping it stops its thread and
/// removes the socket file.
pub struct Control {
    stop: Arc<AtomicBool>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
}

impl Control {
    /// Binds `path` (nothing there, or a stale socket) and serves it on a
    /// thread of its own, on `target`'s rules and `device`'s namespaces.
    pub fn start(path: &Path, target: Arc<Injector>, device: Option<SharedDevice>) -> Result<Control> {
        let bound = Bound::new(path)?;
        let what = || format!("the control socket {}", path.display());
        bound.listener.set_nonblocking(true).map_err(|e| Error::io(what(), e))?;
        let wake = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("the control socket's eventfd", e))?);
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s, where_) = (wake.clone(), stop.clone(), path.display().to_string());
        let thread = std::thread::Builder::new()
            .name("serve-control".into())
            .spawn(move || Server { bound, wake: w, stop: s, target, device, where_, clients: Vec::new() }.run())
            .map_err(|e| Error::io("the control socket's thread", e))?;
        Ok(Control { stop, wake, thread: Some(thread) })
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Client {
    sock: UnixStream,
    buf: Vec<u8>,
    last: Instant,
}

struct Server {
    /// Dropped with the server: the socket closed, then its file removed.
    bound: Bound,
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    target: Arc<Injector>,
    device: Option<SharedDevice>,
    where_: String,
    clients: Vec<Client>,
}

/// What became of a client after its turn.
enum Turn {
    Keep,
    Close(Option<String>),
}

impl Server {
    fn run(mut self) {
        while !self.stop.load(Ordering::Acquire) {
            let mut fds = vec![
                libc::pollfd { fd: self.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.bound.listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            fds.extend(self.clients.iter().map(|c| libc::pollfd {
                fd: c.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }));
            // SAFETY: `fds` is a live array of fds.len() pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!("control socket {}: poll: {e}; it stops serving", self.where_);
                return;
            }
            let ready: Vec<bool> = fds[2..].iter().map(|p| p.revents != 0).collect();
            let mut i = 0;
            self.clients.retain_mut(|c| {
                let r = ready[i];
                i += 1;
                let turn = if r { serve(c, &self.target, self.device.as_deref()) } else { Turn::Keep };
                match turn {
                    Turn::Keep if c.last.elapsed() < IDLE_TIMEOUT => true,
                    Turn::Keep => {
                        log::debug!("control socket: a connection idle for {IDLE_TIMEOUT:?} closed");
                        false
                    }
                    Turn::Close(why) => {
                        if let Some(w) = why {
                            log::debug!("control socket: a connection closed: {w}");
                        }
                        false
                    }
                }
            });
            if fds[1].revents != 0 {
                self.accept();
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match accept_nonblocking(&self.bound.listener) {
                Ok(sock) => {
                    if self.clients.len() >= MAX_CLIENTS {
                        let r = json!({"ok": false, "error": format!("the control socket serves at most {MAX_CLIENTS} connections at once")});
                        let _ = reply(&sock, &r);
                        continue;
                    }
                    self.clients.push(Client { sock, buf: Vec::new(), last: Instant::now() });
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // ECONNABORTED, EMFILE, ...: this connection is lost, not the socket.
                    log::debug!("control socket {}: accept: {e}", self.where_);
                    return;
                }
            }
        }
    }
}

/// A connection from `l`, non-blocking from the start: accept4 with
/// SOCK_NONBLOCK, since a confined process may not make the ioctl
/// (FIONBIO) that `set_nonblocking` is (`crate::seccomp`).
fn accept_nonblocking(l: &std::os::unix::net::UnixListener) -> io::Result<UnixStream> {
    use std::os::fd::FromRawFd;
    // SAFETY: a listening socket's fd; no address asked for.
    let fd = unsafe {
        libc::accept4(
            l.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: accept4 returned a new fd this process owns.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// Writes `v` as one line on a non-blocking socket: a reply is small, and
/// a client that takes none of it within [`SEND_TIMEOUT`] is closed.
fn reply(sock: &UnixStream, v: &Value) -> io::Result<()> {
    let mut line = v.to_string().into_bytes();
    line.push(b'\n');
    let deadline = Instant::now() + SEND_TIMEOUT;
    let mut at = 0;
    let mut s = sock;
    while at < line.len() {
        match s.write(&line[at..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::ErrorKind::TimedOut.into());
                }
                let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                // SAFETY: one live pollfd.
                unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) };
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads what client `c` sent and answers each whole line.
fn serve(c: &mut Client, target: &Injector, device: Option<&dyn DeviceModel>) -> Turn {
    let mut chunk = [0u8; 4096];
    loop {
        let mut s = &c.sock;
        match s.read(&mut chunk) {
            Ok(0) => return Turn::Close(None),
            Ok(n) => c.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Turn::Close(Some(format!("read: {e}"))),
        }
        if c.buf.len() > MAX_REQUEST && !c.buf[..MAX_REQUEST].contains(&b'\n') {
            break;
        }
    }
    c.last = Instant::now();
    while let Some(nl) = c.buf.iter().position(|&b| b == b'\n') {
        let line: Vec<u8> = c.buf.drain(..=nl).collect();
        let v = if line.len() > MAX_REQUEST {
            json!({"ok": false, "error": format!("a request of {} bytes is longer than the {MAX_REQUEST} allowed", line.len())})
        } else {
            match std::str::from_utf8(&line[..nl]) {
                Ok(l) if l.trim().is_empty() => continue,
                Ok(l) => answer(target, device, l),
                Err(_) => json!({"ok": false, "error": "a request is UTF-8 JSON"}),
            }
        };
        if let Err(e) = reply(&c.sock, &v) {
            return Turn::Close(Some(format!("reply: {e}")));
        }
    }
    if c.buf.len() >= MAX_REQUEST {
        let v = json!({"ok": false, "error": format!("a request line is longer than the {MAX_REQUEST} bytes allowed; connection closed")});
        let _ = reply(&c.sock, &v);
        return Turn::Close(Some("request line too long".into()));
    }
    Turn::Keep
}

/// A client of a control socket (`iopath ctl`): one connection, requests
/// answered in order.
pub struct ControlClient {
    sock: UnixStream,
    reader: std::io::BufReader<UnixStream>,
}

impl ControlClient {
    /// Connects to the control socket at `path`; every reply must come
    /// within `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> Result<ControlClient> {
        let what = || format!("the control socket {}", path.display());
        let sock = UnixStream::connect(path).map_err(|e| Error::io(what(), e))?;
        sock.set_read_timeout(Some(timeout)).map_err(|e| Error::io(what(), e))?;
        sock.set_write_timeout(Some(timeout)).map_err(|e| Error::io(what(), e))?;
        let reader = std::io::BufReader::new(sock.try_clone().map_err(|e| Error::io(what(), e))?);
        Ok(ControlClient { sock, reader })
    }

    /// Sends `req` and gives its reply (`"ok"` false included: that is
    /// the device's answer, not a failure of the socket).
    pub fn ask(&mut self, req: &Value) -> Result<Value> {
        use std::io::BufRead;
        let mut line = req.to_string();
        line.push('\n');
        self.sock.write_all(line.as_bytes()).map_err(|e| Error::io("a control request", e))?;
        let mut back = String::new();
        // Bounded: a reply is at most the rules' list, well under 1 MiB.
        let n = (&mut self.reader).take(1 << 20).read_line(&mut back).map_err(|e| Error::io("a control reply", e))?;
        if n == 0 {
            return Err(Error::PeerGone("the control socket closed without a reply".into()));
        }
        serde_json::from_str(&back)
            .map_err(|e| Error::Protocol(format!("a control reply that is not JSON ({e}): {}", back.trim_end())))
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
