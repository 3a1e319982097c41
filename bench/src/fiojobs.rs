//! Each I/O bench's results as fio's jobs (`crate::fioout`): `bench nvme`
//! and `bench blk` one job per target and job, their rounds together;
//! `bench spdk` one per perf run.

use crate::fioout::{self, bs_text, Figures, LatFigures, Measured, Output};
use crate::nvme::{IoFigures, LatHist};
use std::collections::BTreeMap;

/// Runs grouped by (job index, target): jobs in index order, targets in
/// the order their first run came.
fn groups<R>(runs: &[R], key: impl Fn(&R) -> (usize, &str)) -> Vec<(usize, String, Vec<&R>)> {
    let mut g: Vec<(usize, String, Vec<&R>)> = Vec::new();
    for r in runs {
        let (j, t) = key(r);
        match g.iter_mut().find(|x| x.0 == j && x.1 == t) {
            Some(x) => x.2.push(r),
            None => g.push((j, t.to_string(), vec![r])),
        }
    }
    g.sort_by_key(|x| x.0);
    g
}

/// A run's part of a group's figures.
struct Part<'a> {
    ios: u64,
    secs: f64,
    lat: Option<&'a LatHist>,
    mean: f64,
    min: Option<f64>,
    max: Option<f64>,
}

/// A group's figures: I/Os and windows added, histograms merged, the
/// mean weighted by I/Os; latencies only where every run has a histogram.
fn measured(parts: &[Part], bs: u64, tsc_khz: u64, is_clat: bool) -> Measured {
    let ios: u64 = parts.iter().map(|p| p.ios).sum();
    let secs: f64 = parts.iter().map(|p| p.secs).sum();
    let hists: Option<Vec<&LatHist>> = parts.iter().map(|p| p.lat).collect();
    let lat = hists.filter(|h| !h.is_empty() && ios > 0).map(|h| {
        let merged = LatHist::merged(h);
        let mean = parts.iter().map(|p| p.mean * p.ios as f64).sum::<f64>() / ios as f64;
        let min = parts.iter().filter_map(|p| p.min).fold(f64::INFINITY, f64::min);
        let max = parts.iter().filter_map(|p| p.max).fold(0.0, f64::max);
        let mut f = fioout::lat_from_hist(&merged, tsc_khz, if min.is_finite() { min } else { 0.0 }, max, mean);
        f.is_clat = is_clat;
        f
    });
    Measured { ios, bytes: ios.saturating_mul(bs), secs, lat }
}

/// A direction's part of a run (its window is the run's: `secs`).
fn dir_part(d: &IoFigures, secs: f64) -> Part<'_> {
    // A direction without I/O has no mean (NaN), and weighs nothing.
    let mean = if d.ios > 0 { d.lat_avg_ns } else { 0.0 };
    Part { ios: d.ios, secs, lat: d.lat.as_ref(), mean, min: d.lat_min_ns, max: d.lat_max_ns }
}

/// A group's reads and writes apart, where every run has both.
fn split_measured(
    runs: &[&crate::nvme::NvmeRun],
    parts: &[Part],
    bs: u64,
    tsc_khz: u64,
    is_clat: bool,
) -> Option<(Measured, Measured)> {
    let dirs: Option<Vec<(&IoFigures, &IoFigures)>> =
        runs.iter().map(|r| r.read.as_ref().zip(r.write.as_ref())).collect();
    let dirs = dirs.filter(|d| !d.is_empty())?;
    let of = |read: bool| {
        let p: Vec<Part> =
            dirs.iter().zip(parts).map(|(d, p)| dir_part(if read { d.0 } else { d.1 }, p.secs)).collect();
        measured(&p, bs, tsc_khz, is_clat)
    };
    Some((of(true), of(false)))
}

fn opts(pairs: &[(&str, String)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

impl crate::nvme::NvmeResult {
    /// The runs that stand as fio's output (`plus`: with histogram bins).
    pub fn fio_output(&self, plus: bool) -> Output {
        let o = &self.options;
        let size = crate::nvme::namespace_size(&o.backend, o.size_mb);
        let jobs = groups(&self.runs, |r| (r.job, r.target.as_str()))
            .into_iter()
            .map(|(ji, target, runs)| {
                let j = &o.jobs[ji];
                let fio = crate::nvme::is_fio_target(&target);
                let parts: Vec<Part> = runs
                    .iter()
                    .map(|r| Part {
                        ios: r.io.ios,
                        // fio's rows have no guest window: their time is fio's own.
                        secs: if fio {
                            if r.io.iops > 0.0 {
                                r.io.ios as f64 / r.io.iops
                            } else {
                                0.0
                            }
                        } else {
                            r.cycles as f64 / (self.tsc_khz.max(1) as f64 * 1000.0)
                        },
                        lat: r.io.lat.as_ref(),
                        mean: r.io.lat_avg_ns,
                        min: r.io.lat_min_ns,
                        max: r.io.lat_max_ns,
                    })
                    .collect();
                let mut options = opts(&[
                    ("name", target.clone()),
                    ("rw", if j.verify { "verify".into() } else { j.rw.clone() }),
                    ("bs", bs_text(j.bs)),
                    ("iodepth", j.iodepth.to_string()),
                    ("numjobs", j.queues.to_string()),
                    ("runtime", format!("{}ms", o.time_ms)),
                    ("size", size.to_string()),
                ]);
                if j.rw == "randrw" {
                    options.insert("rwmixread".into(), j.rwmixread.to_string());
                }
                if j.batch_submit > 0 {
                    options.insert("iodepth_batch_submit".into(), j.batch_submit.to_string());
                }
                if j.thinktime_us > 0 {
                    options.insert("thinktime".into(), format!("{}us", j.thinktime_us));
                }
                if fio {
                    options.insert("ioengine".into(), "io_uring".into());
                    options.insert("direct".into(), "1".into());
                }
                let m = measured(&parts, j.bs, self.tsc_khz, !fio);
                let split = split_measured(&runs, &parts, j.bs, self.tsc_khz, !fio);
                let figures = Figures::of(&j.rw, j.verify, &m, split.as_ref().map(|(r, w)| (r, w)));
                let errors = runs.iter().map(|r| r.errors).sum();
                let mut job = fioout::job(&target, ji as u32, options, figures, errors, plus);
                job.rounds = Some(runs.len() as u32);
                job
            })
            .collect();
        Output::new(jobs, self.partial)
    }
}

impl crate::blk::BlkResult {
    /// The runs as fio's output (`plus`: with histogram bins).
    pub fn fio_output(&self, plus: bool) -> Output {
        let jobs = groups(&self.runs, |r| (r.job_index, r.target.as_str()))
            .into_iter()
            .map(|(ji, target, runs)| {
                let j = &self.jobs[ji].job;
                let parts: Vec<Part> = runs
                    .iter()
                    .map(|r| Part {
                        ios: r.ios,
                        secs: r.cycles as f64 / (self.tsc_khz.max(1) as f64 * 1000.0),
                        lat: r.lat.as_ref().filter(|_| r.lat_avg_ns.is_some()),
                        mean: r.lat_avg_ns.unwrap_or(f64::NAN),
                        min: r.lat_min_ns,
                        max: r.lat_max_ns,
                    })
                    .collect();
                let options = opts(&[
                    ("name", target.clone()),
                    ("rw", j.rw.clone()),
                    ("bs", bs_text(j.bs)),
                    ("iodepth", j.iodepth.to_string()),
                    ("runtime", format!("{}ms", self.options.time_ms)),
                    ("size", self.disk_bytes.to_string()),
                ]);
                let m = measured(&parts, j.bs, self.tsc_khz, true);
                let errors = runs.iter().map(|r| r.errors).sum();
                let mut job =
                    fioout::job(&target, ji as u32, options, Figures::of(&j.rw, false, &m, None), errors, plus);
                job.rounds = Some(runs.len() as u32);
                job
            })
            .collect();
        Output::new(jobs, self.partial)
    }
}

impl crate::spdk::SpdkResult {
    /// Every perf run as a job of fio's output: perf prints its IOPS, MiB/s,
    /// latency mean, min and max and percentiles (50, 99, 99.9 kept), no
    /// histogram and no stddev; its I/O count is its IOPS over its `-t`.
    pub fn fio_output(&self) -> Output {
        let o = &self.options;
        let mut runs: Vec<&crate::spdk::SpdkRun> = self.runs.iter().collect();
        runs.sort_by_key(|r| (r.job, r.round));
        let jobs = runs
            .into_iter()
            .map(|r| {
                let j = &o.jobs[r.job];
                let p = &r.perf;
                let secs = o.runtime_s as f64;
                let ios = (p.iops * secs).round() as u64;
                let lat = LatFigures {
                    min: p.min_us * 1e3,
                    max: p.max_us * 1e3,
                    mean: p.avg_us * 1e3,
                    stddev: None,
                    percentiles: vec![(50.0, p.p50_us * 1e3), (99.0, p.p99_us * 1e3), (99.9, p.p999_us * 1e3)],
                    bins: Vec::new(),
                    is_clat: true,
                };
                let m = Measured { ios, bytes: ios.saturating_mul(j.bs), secs, lat: Some(lat) };
                let options = opts(&[
                    ("name", r.target.name().to_string()),
                    ("rw", j.rw.clone()),
                    ("bs", bs_text(j.bs)),
                    ("iodepth", j.iodepth.to_string()),
                    ("runtime", o.runtime_s.to_string()),
                    ("size", (o.size_mb << 20).to_string()),
                    ("ioengine", "spdk_nvme_perf".into()),
                ]);
                let figures = Figures::of(&j.rw, false, &m, None);
                let mut job = fioout::job(r.target.name(), r.job as u32, options, figures, 0, false);
                job.round = Some(r.round);
                job
            })
            .collect();
        Output::new(jobs, self.partial)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_randrw_groups_reads_and_writes_add_their_rounds_apart() {
        let tsc = 1_000_000;
        let run = |reads: u64, writes: u64| {
            let mut r = crate::nvme::NvmeRun::new("iopath-shm", "", 0, 0, reads + writes, 1_000_000);
            let d = |n, b| IoFigures::new(n, 4096, 1.0, Some(LatHist { counts: [(b, n)].into() }), tsc);
            (r.read, r.write) = (Some(d(reads, 105)), Some(d(writes, 180)));
            r
        };
        let runs = [run(70, 30), run(68, 32)];
        let rs: Vec<&crate::nvme::NvmeRun> = runs.iter().collect();
        let part =
            |r: &crate::nvme::NvmeRun| Part { ios: r.io.ios, secs: 1.0, lat: None, mean: 0.0, min: None, max: None };
        let parts: Vec<Part> = runs.iter().map(part).collect();
        let (r, w) = split_measured(&rs, &parts, 4096, tsc, true).unwrap();
        assert_eq!((r.ios, r.secs, w.ios, w.bytes), (138, 2.0, 62, 62 * 4096));
        assert_eq!(r.lat.unwrap().bins.iter().map(|b| b.1).sum::<u64>(), 138);
        // A run without its directions: the group is not counted apart.
        let mut plain = run(1, 1);
        plain.write = None;
        assert!(split_measured(&[rs[0], &plain], &parts, 4096, tsc, true).is_none());
    }

    #[test]
    fn groups_keep_job_order_then_first_appearance() {
        let runs = [(1, "b"), (0, "a"), (1, "a"), (0, "a"), (1, "b")];
        let g = groups(&runs, |r| (r.0, r.1));
        let names: Vec<(usize, &str, usize)> = g.iter().map(|x| (x.0, x.1.as_str(), x.2.len())).collect();
        assert_eq!(names, [(0, "a", 2), (1, "b", 2), (1, "a", 1)]);
    }

    #[test]
    fn a_groups_figures_add_its_rounds_and_merge_their_histograms() {
        let tsc = 1_000_000; // 1 cycle = 1 ns
        let h1 = LatHist::from_ns_points(&[(1000, 10)], tsc);
        let h2 = LatHist::from_ns_points(&[(3000, 30)], tsc);
        let parts = [
            Part { ios: 10, secs: 1.0, lat: Some(&h1), mean: 1000.0, min: Some(990.0), max: Some(1010.0) },
            Part { ios: 30, secs: 3.0, lat: Some(&h2), mean: 3000.0, min: Some(2900.0), max: Some(3100.0) },
        ];
        let m = measured(&parts, 4096, tsc, true);
        assert_eq!((m.ios, m.bytes, m.secs), (40, 40 * 4096, 4.0));
        let d = Measured { lat: None, ..m.clone() }.dir(false);
        assert_eq!((d.iops, d.total_ios), (10.0, 40));
        let l = m.lat.unwrap();
        assert_eq!((l.min, l.max, l.mean), (990.0, 3100.0, 2500.0));
        assert_eq!(l.bins.iter().map(|b| b.1).sum::<u64>(), 40);
        // A run without a histogram: no latency figures for the group.
        let no = [Part { lat: None, ..parts[0] }, Part { ..parts[1] }];
        assert!(measured(&no, 4096, tsc, true).lat.is_none());
    }
}
