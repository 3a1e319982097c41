//! A small QMP client (QEMU's JSON monitor, `-qmp unix:PATH,server=on,wait=off`)
//! for the one query the benches make: `query-blockstats`, the operations
//! QEMU's block layer completed on a drive. QEMU is a peer like any other:
//! every reply is bounded in size, in lines and in time.

use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// Longest reply line kept (a query-blockstats reply for one drive is ~2 KiB).
pub const MAX_LINE: u64 = 1 << 20;
/// Most lines (events) read while waiting for one reply.
const MAX_LINES: usize = 1000;

#[derive(Debug)]
pub struct Qmp {
    rd: BufReader<UnixStream>,
    wr: UnixStream,
    /// Each greeting or reply must come within this.
    timeout: Duration,
}

impl Qmp {
    /// Connects to QEMU's QMP socket `path`, reads its greeting and leaves
    /// capabilities negotiation, each step within `timeout`.
    pub fn connect(path: &Path, timeout: Duration) -> anyhow::Result<Qmp> {
        let wr = UnixStream::connect(path).map_err(|e| anyhow::anyhow!("QMP {}: {e}", path.display()))?;
        let mut q = Qmp { rd: BufReader::new(wr.try_clone()?), wr, timeout };
        let hello = q.line(Instant::now() + timeout)?;
        anyhow::ensure!(hello.get("QMP").is_some(), "QMP greeting expected, got {hello}");
        q.execute("qmp_capabilities")?;
        Ok(q)
    }

    /// One reply line as JSON, by `deadline`, within `MAX_LINE`.
    fn line(&mut self, deadline: Instant) -> anyhow::Result<Value> {
        let left = deadline.saturating_duration_since(Instant::now());
        anyhow::ensure!(!left.is_zero(), "QMP: no reply within {:?}", self.timeout);
        self.rd.get_ref().set_read_timeout(Some(left))?;
        let mut buf = Vec::new();
        let n = (&mut self.rd).take(MAX_LINE).read_until(b'\n', &mut buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                anyhow::anyhow!("QMP: no reply within {:?}", self.timeout)
            }
            _ => anyhow::anyhow!("QMP: {e}"),
        })?;
        anyhow::ensure!(n > 0, "QMP: QEMU closed the monitor");
        anyhow::ensure!(buf.ends_with(b"\n"), "QMP: a reply line longer than {MAX_LINE} bytes");
        serde_json::from_slice(&buf).map_err(|e| anyhow::anyhow!("QMP: not JSON ({e})"))
    }

    /// Runs `command` (no arguments); its `return` value. Events that come
    /// first are skipped; an `error` reply is an error.
    pub fn execute(&mut self, command: &str) -> anyhow::Result<Value> {
        let deadline = Instant::now() + self.timeout;
        self.wr.set_write_timeout(Some(self.timeout))?;
        writeln!(self.wr, "{}", serde_json::json!({ "execute": command }))?;
        for _ in 0..MAX_LINES {
            let mut v = self.line(deadline)?;
            if let Some(r) = v.get_mut("return") {
                return Ok(r.take());
            }
            if let Some(e) = v.get("error") {
                anyhow::bail!("QMP {command}: {e}");
            }
        }
        anyhow::bail!("QMP {command}: no reply in {MAX_LINES} lines")
    }

    /// `query-blockstats` of the drive `device` (its `-drive id=`):
    /// (rd_operations, wr_operations).
    pub fn blockstats(&mut self, device: &str) -> anyhow::Result<(u64, u64)> {
        let r = self.execute("query-blockstats")?;
        let d = r
            .as_array()
            .and_then(|a| a.iter().find(|d| d["device"] == device))
            .ok_or_else(|| anyhow::anyhow!("QMP query-blockstats: no drive {device:?}"))?;
        let n = |k: &str| {
            d["stats"][k].as_u64().ok_or_else(|| anyhow::anyhow!("QMP query-blockstats: {device} without {k}"))
        };
        Ok((n("rd_operations")?, n("wr_operations")?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A "QEMU" on a socket that answers each line it reads with the next of `replies`.
    fn fake(replies: Vec<Vec<u8>>) -> (std::path::PathBuf, std::thread::JoinHandle<()>) {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("iopath-qmp-test-{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let l = UnixListener::bind(&p).unwrap();
        let path = p.clone();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            drop(l);
            let _ = std::fs::remove_file(&path);
            let mut rd = BufReader::new(s.try_clone().unwrap());
            let mut replies = replies.into_iter();
            if let Some(hello) = replies.next() {
                let _ = s.write_all(&hello);
            }
            let mut line = String::new();
            while rd.read_line(&mut line).unwrap_or(0) > 0 {
                line.clear();
                match replies.next() {
                    Some(r) => {
                        let _ = s.write_all(&r);
                    }
                    // Nothing more to say: hold the connection, answer nothing.
                    None => std::thread::sleep(Duration::from_secs(3)),
                }
            }
        });
        (p, h)
    }

    const HELLO: &[u8] = b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n";
    const OK: &[u8] = b"{\"return\": {}}\n";

    #[test]
    fn blockstats_are_read_past_events() {
        let reply = concat!(
            "{\"event\": \"RESUME\", \"data\": {}}\n",
            "{\"return\": [{\"device\": \"other\", \"stats\": {\"rd_operations\": 1, \"wr_operations\": 1}}, ",
            "{\"device\": \"nvm0\", \"stats\": {\"rd_operations\": 60, \"wr_operations\": 40, \"flush_operations\": 3}}]}\n"
        )
        .as_bytes()
        .to_vec();
        let (p, h) = fake(vec![HELLO.to_vec(), OK.to_vec(), reply]);
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).unwrap();
        assert_eq!(q.blockstats("nvm0").unwrap(), (60, 40));
        drop(q);
        h.join().unwrap();
    }

    #[test]
    fn a_bad_or_silent_monitor_is_an_error_not_a_hang() {
        let t = Duration::from_millis(500);
        // No greeting.
        let (p, _h) = fake(vec![b"{\"hello\": 1}\n".to_vec()]);
        assert!(Qmp::connect(&p, t).unwrap_err().to_string().contains("greeting"));
        // An error reply, a drive that is not there, a reply without counts.
        let err = b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no\"}}\n".to_vec();
        let (p, _h) = fake(vec![HELLO.to_vec(), OK.to_vec(), err]);
        assert!(Qmp::connect(&p, t).unwrap().blockstats("nvm0").unwrap_err().to_string().contains("GenericError"));
        let (p, _h) = fake(vec![HELLO.to_vec(), OK.to_vec(), b"{\"return\": []}\n".to_vec()]);
        assert!(Qmp::connect(&p, t).unwrap().blockstats("nvm0").unwrap_err().to_string().contains("no drive"));
        let r = b"{\"return\": [{\"device\": \"nvm0\", \"stats\": {\"rd_operations\": -1}}]}\n".to_vec();
        let (p, _h) = fake(vec![HELLO.to_vec(), OK.to_vec(), r]);
        assert!(Qmp::connect(&p, t).unwrap().blockstats("nvm0").is_err());
        // A monitor that never answers the query: an error within the bound (liveness only).
        let (p, _h) = fake(vec![HELLO.to_vec(), OK.to_vec()]);
        let mut q = Qmp::connect(&p, t).unwrap();
        let t0 = Instant::now();
        assert!(q.blockstats("nvm0").unwrap_err().to_string().contains("no reply"));
        assert!(t0.elapsed() < Duration::from_secs(30));
        // A reply line past MAX_LINE.
        let mut long = b"{\"return\": \"".to_vec();
        long.resize(MAX_LINE as usize + 10, b'x');
        let (p, _h) = fake(vec![HELLO.to_vec(), OK.to_vec(), long]);
        assert!(Qmp::connect(&p, t).unwrap().blockstats("nvm0").unwrap_err().to_string().contains("longer"));
    }
}
