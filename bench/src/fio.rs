//! fio on the host, on the file a file-backed NVMe run uses: the same job
//! (rw, block size, queue depth, run time, byte range) through io_uring with
//! O_DIRECT, so that a row says what the host itself gets from that file.
//! `bench nvme` runs it in each round beside iopath's runs and gives each of
//! them its `fio_ratio`.
//!
//! Several queues: nvmeperf keeps `iodepth` commands outstanding on each of
//! `queues` queue pairs, so fio runs `numjobs = queues` jobs (each its own
//! io_uring, as each queue pair is its own ring) of `iodepth` each, reported
//! as one group. One job at the total depth would be one ring, which is not
//! what the guest drives.
//!
//! fio's buffers are put in transparent huge pages (glibc's
//! `glibc.malloc.hugetlb=1` tunable: malloc advises them), as iopath's
//! bounce buffers and QEMU's guest RAM are. A transfer from 4 KiB pages goes
//! to the disk as one segment per page; a virtual disk that costs per
//! segment serves it much slower (64 KiB random writes on a disk here:
//! 9-11 k IOPS against 15-18 k from huge pages), and the row would then
//! measure fio's allocator, not the file.

use crate::nvme::IoFigures;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub const BINARY: &str = "fio";

/// The glibc tunable that gives fio's buffers transparent huge pages.
pub const HUGE_BUFFERS: &str = "glibc.malloc.hugetlb=1";

/// GLIBC_TUNABLES for fio: `current` (the caller's, if any) with
/// [`HUGE_BUFFERS`] added.
pub fn tunables(current: Option<&str>) -> String {
    match current.filter(|c| !c.is_empty()) {
        Some(c) => format!("{c}:{HUGE_BUFFERS}"),
        None => HUGE_BUFFERS.to_string(),
    }
}

/// The job fio runs: nvmeperf's, on the host.
#[derive(Clone, Debug)]
pub struct FioJob {
    pub path: PathBuf,
    /// fio's and nvmeperf's names: read, write, randread, randwrite, randrw.
    pub rw: String,
    pub bs: u64,
    /// Per job (per queue pair).
    pub iodepth: u32,
    /// Jobs: one per queue pair of the iopath run.
    pub numjobs: u32,
    pub runtime_ms: u64,
    /// The bytes of the file the offsets fall in (the namespace size).
    pub size: u64,
    /// Reads in percent, for randrw.
    pub rwmixread: u32,
    /// iodepth_batch_submit when the guest's job sets one (0: fio's default).
    pub batch_submit: u32,
    /// The CPU fio's jobs run on (`cpus_allowed`), where iopath's device
    /// threads would; None leaves them to the scheduler.
    pub cpu: Option<usize>,
}

/// One fio run's figures (all jobs together).
#[derive(Clone, Debug, PartialEq)]
pub struct FioResult {
    /// Both directions together: the mean latency over both, percentiles
    /// from the direction with more I/Os (`hist` empty, `lat` None).
    pub io: IoFigures,
    /// Jobs that ended with an error.
    pub errors: u64,
    /// fio's CPU time (user and system, its jobs' threads) per I/O, from
    /// `usr_cpu`/`sys_cpu` (percent of each job's run time); None if absent.
    pub cpu_ns_per_io: Option<f64>,
    /// fio's latency histogram of every I/O (all jobs, both directions):
    /// (bin value in ns, count), from `--output-format=json+`'s `lat_ns.bins`;
    /// empty when fio gave none or they do not add up to `ios`.
    pub lat_bins: Vec<(u64, u64)>,
    /// Reads and writes apart (fio's `read` and `write`, all jobs).
    pub read: FioDir,
    pub write: FioDir,
}

/// One direction's figures, its `read` or `write` objects of every job
/// added (latency mean and percentiles from the job with the most I/Os).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FioDir {
    /// `hist` empty, `lat` None: see `IoFigures::from_fio`.
    pub io: IoFigures,
    /// json+ `lat_ns.bins` (ns, count); empty unless they add up to `ios`.
    pub lat_bins: Vec<(u64, u64)>,
}

/// `f` of both where both are known, else the one that is.
fn combine(a: Option<f64>, b: Option<f64>, f: fn(f64, f64) -> f64) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(f(a, b)),
        (a, b) => a.or(b),
    }
}

/// Adds `d` (one job's `read` or `write` object) into `acc`; `most`: the
/// I/Os of the job whose latencies `acc` holds so far.
fn add_dir(
    acc: &mut FioDir,
    most: &mut u64,
    bins: &mut BTreeMap<u64, u64>,
    d: &serde_json::Value,
) -> anyhow::Result<()> {
    let num = |x: &serde_json::Value| x.as_f64().ok_or_else(|| anyhow::anyhow!("fio's JSON: not a number: {x}"));
    let ios = d["total_ios"].as_u64().unwrap_or(0);
    if ios == 0 {
        return Ok(());
    }
    acc.io.ios += ios;
    acc.io.iops += num(&d["iops"])?;
    acc.io.mb_s += num(&d["bw_bytes"])? / 1e6;
    for (k, c) in d["lat_ns"]["bins"].as_object().into_iter().flatten() {
        let (Ok(v), Some(c)) = (k.parse::<u64>(), c.as_u64()) else {
            anyhow::bail!("fio's JSON: a latency bin {k:?}: {c}");
        };
        anyhow::ensure!(bins.len() < MAX_BINS || bins.contains_key(&v), "fio's JSON: over {MAX_BINS} bins");
        let e = bins.entry(v).or_insert(0);
        *e = e.saturating_add(c);
    }
    if let (Some(lo), Some(hi)) = (d["lat_ns"]["min"].as_f64(), d["lat_ns"]["max"].as_f64()) {
        acc.io.lat_min_ns = combine(acc.io.lat_min_ns, Some(lo), f64::min);
        acc.io.lat_max_ns = combine(acc.io.lat_max_ns, Some(hi), f64::max);
    }
    if ios > *most {
        *most = ios;
        let lat = &d["lat_ns"];
        let p = |k: &str| num(&lat["percentile"][k]);
        (acc.io.lat_avg_ns, acc.io.p50_ns, acc.io.p90_ns, acc.io.p99_ns, acc.io.p999_ns) =
            (num(&lat["mean"])?, p("50.000000")?, p("90.000000")?, p("99.000000")?, p("99.900000")?);
    }
    Ok(())
}

/// Most latency bins taken from fio's JSON (fio has about 1900 per direction and job).
pub const MAX_BINS: usize = 1 << 16;

/// fio from $IOPATH_FIO, else from PATH; None if there is none.
pub fn find() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("IOPATH_FIO") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    find_on(&std::env::var("PATH").unwrap_or_default())
}

/// fio in one of the directories of `path_var` (a PATH value).
pub fn find_on(path_var: &str) -> Option<PathBuf> {
    path_var.split(':').filter(|d| !d.is_empty()).map(|d| Path::new(d).join(BINARY)).find(|p| p.is_file())
}

/// The reason given when fio is not there.
pub fn missing_reason() -> String {
    format!("{BINARY} not found (PATH, or $IOPATH_FIO): install it (Debian/Ubuntu: `apt-get install -y fio`)")
}

/// fio's command line for `j`, JSON on stdout.
pub fn args(j: &FioJob) -> Vec<String> {
    let mut a = vec![
        "--name=iopath-peer".into(),
        format!("--filename={}", j.path.display()),
        "--ioengine=io_uring".into(),
        "--direct=1".into(),
        format!("--rw={}", j.rw),
        format!("--bs={}", j.bs),
        format!("--iodepth={}", j.iodepth),
        format!("--numjobs={}", j.numjobs),
        "--group_reporting=1".into(),
        format!("--size={}", j.size),
        // nvmeperf draws each offset afresh (no map of blocks already done).
        "--norandommap=1".into(),
        "--time_based=1".into(),
        format!("--runtime={}ms", j.runtime_ms.max(1)),
        // Percentiles of the total latency, which is what nvmeperf measures;
        // json+ adds their histogram (`bins`), which rounds merge.
        "--lat_percentiles=1".into(),
        "--output-format=json+".into(),
        format!("--rwmixread={}", j.rwmixread.min(100)),
    ];
    if j.batch_submit > 0 {
        a.push(format!("--iodepth_batch_submit={}", j.batch_submit));
    }
    if let Some(c) = j.cpu {
        a.push(format!("--cpus_allowed={c}"));
    }
    a
}

/// Runs fio (`fio`, found by [`find`]) for `j`, killed after `timeout` or on Ctrl-C (`crate::interrupt`).
pub fn run(fio: &Path, j: &FioJob, timeout: Duration) -> anyhow::Result<FioResult> {
    let mut child = Command::new(fio)
        .args(args(j))
        .env("GLIBC_TUNABLES", tunables(std::env::var("GLIBC_TUNABLES").ok().as_deref()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", fio.display()))?;
    // Read both pipes beside the wait, so that a large output cannot block fio.
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if crate::interrupt::interrupted() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(crate::interrupt::Interrupted.into());
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("fio did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out_t.join().unwrap_or_default(), err_t.join().unwrap_or_default());
    if !status.success() {
        anyhow::bail!("fio failed ({status}): {}", err.trim());
    }
    parse(&out)
}

/// Reads fio's `--output-format=json` (anything fio prints before the JSON
/// object, such as warnings, is skipped): each direction's figures, and
/// the two added: the mean latency over both, percentiles from the
/// direction with more I/Os.
pub fn parse(out: &str) -> anyhow::Result<FioResult> {
    use serde_json::Value;
    let start = out.find('{').ok_or_else(|| anyhow::anyhow!("no JSON in fio's output: {:?}", trunc(out)))?;
    let v: Value = serde_json::from_str(&out[start..]).map_err(|e| anyhow::anyhow!("fio's JSON: {e}"))?;
    let jobs =
        v["jobs"].as_array().filter(|j| !j.is_empty()).ok_or_else(|| anyhow::anyhow!("fio's JSON has no jobs"))?;
    let (mut dirs, mut most) = ([FioDir::default(), FioDir::default()], [0u64; 2]);
    let mut bins = [BTreeMap::new(), BTreeMap::new()];
    let (mut errors, mut cpu_ns) = (0, Some(0.0));
    for job in jobs {
        errors += (job["error"].as_u64().unwrap_or(1) != 0) as u64;
        let pct = job["usr_cpu"].as_f64().zip(job["sys_cpu"].as_f64()).map(|(u, s)| u + s);
        cpu_ns = cpu_ns.zip(pct.zip(job["job_runtime"].as_f64())).map(|(n, (p, ms))| n + p / 100.0 * ms * 1e6);
        for (k, dir) in ["read", "write"].into_iter().enumerate() {
            add_dir(&mut dirs[k], &mut most[k], &mut bins[k], &job[dir])?;
        }
    }
    let [mut read, mut write] = dirs;
    let ios = read.io.ios + write.io.ios;
    if ios == 0 {
        anyhow::bail!("fio did no I/O");
    }
    // Both directions' bins together, and each direction's, where they hold its I/Os.
    let mut all: BTreeMap<u64, u64> = BTreeMap::new();
    for (&v, &c) in bins.iter().flatten() {
        let e = all.entry(v).or_insert(0);
        *e = e.saturating_add(c);
    }
    let holds = |b: &BTreeMap<u64, u64>, n: u64| b.values().fold(0u64, |a, &c| a.saturating_add(c)) == n;
    for (d, b) in [(&mut read, &bins[0]), (&mut write, &bins[1])] {
        if holds(b, d.io.ios) {
            d.lat_bins = b.iter().map(|(&v, &c)| (v, c)).collect();
        }
    }
    let busier = if write.io.ios > read.io.ios { &write } else { &read };
    Ok(FioResult {
        io: IoFigures {
            ios,
            iops: read.io.iops + write.io.iops,
            mb_s: read.io.mb_s + write.io.mb_s,
            lat_avg_ns: (read.io.lat_avg_ns * read.io.ios as f64 + write.io.lat_avg_ns * write.io.ios as f64)
                / ios as f64,
            lat_min_ns: combine(read.io.lat_min_ns, write.io.lat_min_ns, f64::min),
            lat_max_ns: combine(read.io.lat_max_ns, write.io.lat_max_ns, f64::max),
            p50_ns: busier.io.p50_ns,
            p90_ns: busier.io.p90_ns,
            p99_ns: busier.io.p99_ns,
            p999_ns: busier.io.p999_ns,
            ..IoFigures::default()
        },
        errors,
        cpu_ns_per_io: cpu_ns.map(|n| n / ios as f64),
        lat_bins: if holds(&all, ios) { all.into_iter().collect() } else { Vec::new() },
        read,
        write,
    })
}

fn trunc(s: &str) -> &str {
    &s[..s.char_indices().nth(200).map_or(s.len(), |(i, _)| i)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fio 3.33's JSON of a 4 KiB randread at QD 32 on this host (trimmed to
    /// the fields read, one warning line before it as fio sometimes prints).
    const SAMPLE: &str = include_str!("testdata/fio-randread.json");

    #[test]
    fn fio_json_gives_the_groups_figures() {
        let r = parse(SAMPLE).unwrap();
        assert_eq!(r.io.ios, 191129);
        assert!((r.io.iops - 63688.437188).abs() < 1e-6, "{r:?}");
        assert!((r.io.mb_s - 260.867838).abs() < 1e-6, "{r:?}");
        assert_eq!((r.io.p50_ns, r.io.p99_ns, r.io.p999_ns), (432128.0, 3489792.0, 7307264.0));
        assert_eq!(r.errors, 0);
        assert_eq!((r.io.lat_min_ns, r.io.lat_max_ns), (Some(64556.0), Some(8629109.0)));
        // (3.266667 + 35.3) % of 3000 ms over the I/Os.
        let cpu = r.cpu_ns_per_io.unwrap();
        assert!((cpu - 0.38566667 * 3e9 / 191129.0).abs() < 1.0, "{cpu}");
        // Two jobs: reads and writes add up; latency from the busier direction.
        let two = r#"{"jobs":[
            {"error":0,"read":{"total_ios":10,"iops":5.0,"bw_bytes":2000000,
              "lat_ns":{"mean":7.0,"percentile":{"50.000000":1,"90.000000":2,"99.000000":3,"99.900000":4}}},
             "write":{"total_ios":30,"iops":15.0,"bw_bytes":6000000,
              "lat_ns":{"mean":9.0,"percentile":{"50.000000":5,"90.000000":6,"99.000000":7,"99.900000":8}}}},
            {"error":5,"read":{"total_ios":0},"write":{"total_ios":0}}]}"#;
        let r = parse(two).unwrap();
        assert_eq!(
            (r.io.ios, r.io.iops, r.io.mb_s, r.io.p99_ns, r.io.lat_avg_ns, r.errors),
            (40, 20.0, 8.0, 7.0, 8.5, 1)
        );
        // Each direction on its own: a randrw row's reads and writes.
        assert_eq!(
            (r.read.io.ios, r.read.io.iops, r.read.io.mb_s, r.read.io.p99_ns, r.read.io.lat_avg_ns),
            (10, 5.0, 2.0, 3.0, 7.0)
        );
        assert_eq!((r.write.io.ios, r.write.io.iops, r.write.io.mb_s, r.write.io.p50_ns), (30, 15.0, 6.0, 5.0));
        assert_eq!(r.cpu_ns_per_io, None, "no CPU figures in that output");
        assert!(r.lat_bins.is_empty(), "no bins in that output");
    }

    #[test]
    fn json_plus_bins_of_every_job_and_direction_add_up() {
        let j = r#"{"jobs":[
            {"error":0,"read":{"total_ios":3,"iops":5.0,"bw_bytes":2000000,
              "lat_ns":{"mean":7.0,"percentile":{"50.000000":1,"90.000000":2,"99.000000":3,"99.900000":4},
                        "bins":{"1000":2,"2000":1}}},
             "write":{"total_ios":1,"iops":1.0,"bw_bytes":1,
              "lat_ns":{"mean":9.0,"percentile":{"50.000000":5,"90.000000":6,"99.000000":7,"99.900000":8},
                        "bins":{"1000":1}}}}]}"#;
        let r = parse(j).unwrap();
        assert_eq!(r.lat_bins, vec![(1000, 3), (2000, 1)]);
        assert_eq!((r.read.lat_bins, r.write.lat_bins), (vec![(1000, 2), (2000, 1)], vec![(1000, 1)]));
        // Bins that do not add up to the I/Os are not a histogram of them.
        assert!(parse(&j.replace(r#""2000":1"#, r#""2000":7"#)).unwrap().lat_bins.is_empty());
        // A malformed bin is an error.
        assert!(parse(&j.replace(r#""2000":1"#, r#""x":1"#)).is_err());
        assert!(parse(&j.replace(r#""2000":1"#, r#""2000":-1"#)).is_err());
    }

    #[test]
    fn bad_fio_output_is_an_error() {
        for bad in
            ["", "fio: engine io_uring not loadable", "{\"jobs\":[]}", "{\"jobs\":[{\"read\":{\"total_ios\":0}}]}"]
        {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let no_pct = r#"{"jobs":[{"error":0,"read":{"total_ios":1,"iops":1.0,"bw_bytes":1,"lat_ns":{"mean":1.0}}}]}"#;
        assert!(parse(no_pct).is_err());
    }

    #[test]
    fn the_command_line_is_the_guests_job_through_io_uring_o_direct() {
        let j = FioJob {
            path: "/var/tmp/x.img".into(),
            rw: "randwrite".into(),
            bs: 65536,
            iodepth: 32,
            numjobs: 4,
            runtime_ms: 2500,
            size: 1 << 30,
            rwmixread: 70,
            batch_submit: 4,
            cpu: Some(1),
        };
        let a = args(&j);
        for want in [
            "--filename=/var/tmp/x.img",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randwrite",
            "--bs=65536",
            "--iodepth=32",
            "--numjobs=4",
            "--group_reporting=1",
            "--size=1073741824",
            "--runtime=2500ms",
            "--output-format=json+",
            "--rwmixread=70",
            "--iodepth_batch_submit=4",
            "--cpus_allowed=1",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
        let unpinned = args(&FioJob { cpu: None, ..j });
        assert!(!unpinned.iter().any(|x| x.starts_with("--cpus_allowed")), "{unpinned:?}");
        // Its buffers in huge pages, keeping the caller's other tunables.
        assert_eq!(tunables(None), "glibc.malloc.hugetlb=1");
        assert_eq!(tunables(Some("")), "glibc.malloc.hugetlb=1");
        assert_eq!(tunables(Some("glibc.malloc.check=3")), "glibc.malloc.check=3:glibc.malloc.hugetlb=1");
    }

    #[test]
    fn missing_fio_is_reported_not_a_panic() {
        assert_eq!(find_on(""), None);
        assert_eq!(find_on("/nonexistent-iopath-dir:/also/not/there"), None);
        let dir = std::env::temp_dir().join(format!("iopath-fio-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(BINARY), "").unwrap();
        assert_eq!(find_on(&format!("/nonexistent:{}", dir.display())), Some(dir.join(BINARY)));
        let _ = std::fs::remove_dir_all(&dir);
        let j = FioJob {
            path: "/nonexistent".into(),
            rw: "randread".into(),
            bs: 4096,
            iodepth: 1,
            numjobs: 1,
            runtime_ms: 10,
            size: 4096,
            rwmixread: 50,
            batch_submit: 0,
            cpu: None,
        };
        let e = run(Path::new("/nonexistent/fio"), &j, Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("cannot start"), "{e}");
        assert!(missing_reason().contains("fio not found"));
    }
}
