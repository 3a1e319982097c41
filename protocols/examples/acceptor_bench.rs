//! How long a good client waits to start its session while idle
//! connections are held open against `iopath serve` (pci-testdev over
//! vfio-user, the default bounds, seccomp on): the acceptor's answer to
//! cheap hostile connections.
//!
//! ```sh
//! cargo run --release -p iopath-protocols --example acceptor_bench            # 0, 5, 20, 1000 idle, 5 rounds
//! cargo run --release -p iopath-protocols --example acceptor_bench -- --idle 1000 --rounds 3 --cap-s 60
//! ```
//!
//! Each round starts a fresh server (this program again, `--serve PATH`, a
//! process of its own), opens N connections that never send a byte, gives
//! the server 200 ms to see them, then times a client from its first
//! connect to the reply to its VERSION. A client that is refused (EBUSY, or
//! its connection closed) connects again at once, and its wait goes on; one
//! still not served after `--cap-s` seconds counts as kept out. The server
//! is then killed (SIGKILL) and the idle connections closed.

use iopath_protocols::serve::{run, Listen, ServeOptions, Timeouts};
use iopath_protocols::socket;
use iopath_protocols::vfio_user::wire::*;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, path] = &args[..] {
        if flag == "--serve" {
            serve(Path::new(path));
        }
    }
    let mut idle = vec![0usize, 5, 20, 1000];
    let (mut rounds, mut cap) = (5usize, 60u64);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| usage(&format!("{a} needs a value"))).clone();
        match a.as_str() {
            "--idle" => {
                idle = value().split(',').map(|n| n.parse().unwrap_or_else(|_| usage("--idle N[,M..]"))).collect()
            }
            "--rounds" => rounds = value().parse().unwrap_or_else(|_| usage("--rounds N")),
            "--cap-s" => cap = value().parse().unwrap_or_else(|_| usage("--cap-s N")),
            _ => usage(&format!("unknown argument {a}")),
        }
    }
    raise_fd_limit(idle.iter().max().copied().unwrap_or(0) + 64);
    let cap = Duration::from_secs(cap);
    println!("a good client's wait for its session (connect to VERSION's reply), {rounds} rounds each, cap {cap:?}");
    println!("{:>6} {:>10} {:>10} {:>10} {:>9}", "idle", "median", "min", "max", "kept out");
    for &n in &idle {
        let mut waits = Vec::new();
        let mut out = 0;
        for r in 0..rounds {
            match round(n, cap, r) {
                Some(w) => waits.push(w),
                None => out += 1,
            }
        }
        waits.sort();
        let ms = |d: Option<&Duration>| d.map_or("-".to_string(), |d| format!("{:.1} ms", d.as_secs_f64() * 1e3));
        let median = waits.get(waits.len() / 2);
        println!("{n:>6} {:>10} {:>10} {:>10} {out:>9}", ms(median), ms(waits.first()), ms(waits.last()));
    }
}

fn usage(why: &str) -> ! {
    eprintln!("acceptor_bench: {why}\nusage: acceptor_bench [--idle N[,M..]] [--rounds N] [--cap-s S]");
    std::process::exit(2)
}

/// The server: `iopath serve pci-testdev --transport vfio-user --socket PATH`.
fn serve(path: &Path) -> ! {
    let o = ServeOptions {
        device: "pci-testdev".parse().unwrap(),
        transport: iopath_protocols::transport("vfio-user").unwrap(),
        listen: Listen::Socket(path.to_path_buf()),
        once: false,
        keep_state: false,
        timeouts: Timeouts::default(),
        seccomp: true,
        control: None,
        controllers: 1,
        pollers: None,
    };
    match run(&o) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("acceptor_bench --serve: {e}");
            std::process::exit(1)
        }
    }
}

/// One round with `n` idle connections: the good client's wait, or None if
/// it was kept out for `cap`.
fn round(n: usize, cap: Duration, r: usize) -> Option<Duration> {
    let dir = std::env::temp_dir().join(format!("iopath-acceptor-bench-{}-{n}-{r}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("s.sock");
    let mut server = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("--serve")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&path);
    let held: Vec<UnixStream> =
        (0..n).map(|i| UnixStream::connect(&path).unwrap_or_else(|e| panic!("idle connection {i}: {e}"))).collect();
    std::thread::sleep(Duration::from_millis(200));
    let w = good_client(&path, cap);
    let _ = server.kill();
    let _ = server.wait();
    drop(held);
    let _ = std::fs::remove_dir_all(&dir);
    w
}

fn wait_for(path: &Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "the server never listened on {}", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Connects and sends VERSION until it is answered (not EBUSY), for at most `cap`.
fn good_client(path: &Path, cap: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: None }.to_bytes();
    loop {
        let left = cap.checked_sub(t0.elapsed()).filter(|d| !d.is_zero())?;
        let Ok(s) = UnixStream::connect(path) else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        let _ = s.set_read_timeout(Some(left));
        let _ = s.set_write_timeout(Some(left));
        if socket::send(&s, &[&message(1, Command::Version, FLAGS_TYPE_COMMAND, &v)], &[]).is_err() {
            continue;
        }
        let mut h = [0u8; HEADER_SIZE];
        if socket::recv_exact(&s, &mut h).is_ok() && !Header::parse(&h).is_error() {
            return Some(t0.elapsed());
        }
    }
}

/// This process holds `n` fds and more: the soft limit up to the hard one.
fn raise_fd_limit(n: usize) {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && (l.rlim_cur as usize) < n {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}
