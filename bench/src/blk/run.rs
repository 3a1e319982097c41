//! One run of one `bench blk` target for one job and round, and the checks
//! of its routing against the device's counters:
//! - `nvme-*`: as `bench nvme` checks them (every guest I/O a controller
//!   command; MMIO doorbells exited, shm/bar ones did not).
//! - virtio targets, in the VMM or over a transport (`virtio@vfio-user`,
//!   `vhost-user`), and the `qemu-*` ones (`qemu.rs`): the rules of
//!   `check.rs`, one per path.
//!
//! Every run also needs the guest's own verdict (I/O done, 0 errors).

use super::check::{self, Guest, VirtioPath};
use super::{BlkJob, BlkOptions, BlkRun, QemuBlk, Target};
use crate::host::{host_info, HostInfo};
use crate::nvme::{LatHist, NvmeOptions, NvmeRun, Runner};
use crate::pin::Pinner;
use crate::qemu::QemuBacking;
use indicatif::ProgressBar;
use iopath_devices::nvme::DoorbellMode;
use iopath_devices::virtio::pci::{NotifyMode, VirtioBlkConfig};
use iopath_devices::DeviceConfig;
use iopath_protocols::attach::{instantiate, Device, DeviceSpec, Endpoint, Programs};
use iopath_protocols::Transport;
use iopath_vmm::{run, VmConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Device threads `--pin` places beside the vCPU's: iopath's virtio-blk
/// worker (in the VMM or a device process), the vhost-user backend's queue
/// thread, and QEMU's (`pin::QEMU_DEVICE_THREADS`: its main loop serves its
/// virtio-blk's ioeventfds, no iothread is configured). QEMU's vCPU thread
/// (`CPU 0/KVM`) goes where iopath's does.
pub const DEVICE_THREADS: &[&str] = &["virtio-blk", "vhost-blk-q0", "qemu-system-x86", "worker"];

/// vblk's lines around its timed window (`VmConfig::exit_marks`).
pub const WINDOW_START: &str = "@vblk-window start";
pub const WINDOW_END: &str = "@vblk-window end";

/// The progress bar of a run of `len` steps (hidden without `show`).
pub fn progress(show: bool, len: u64) -> ProgressBar {
    crate::progress::bar(show, len)
}

/// The options `bench nvme`'s runner takes for the same jobs and backend.
pub fn nvme_options(o: &BlkOptions, jobs: &[BlkJob]) -> NvmeOptions {
    NvmeOptions {
        jobs: jobs.iter().map(|j| j.job.clone()).collect(),
        backend: o.backend.clone(),
        size_mb: Some(o.size_mb),
        time_ms: o.time_ms,
        rounds: o.rounds,
        mem_mb: o.mem_mb,
        timeout_s: o.timeout_s,
        progress: false,
        pin: o.pin,
        iopath_exe: o.iopath_exe.clone(),
        ..NvmeOptions::default()
    }
}

/// The disk size in bytes, by `bench nvme`'s rule (`nvme::namespace_size`):
/// a file backend's (whole MiB, at most 1 TiB), else `size_mb`.
pub(super) fn disk_size(o: &BlkOptions) -> u64 {
    crate::nvme::namespace_size(&o.backend, Some(o.size_mb))
}

pub struct Ctx<'a> {
    pub(super) o: &'a BlkOptions,
    pub(super) jobs: &'a [BlkJob],
    pub host: HostInfo,
    pub tsc_khz: u64,
    nvme: Runner<'a>,
    pub(super) progs: Programs,
    pub(super) image: PathBuf,
    /// The disk's size in bytes.
    pub(super) size: u64,
    /// QEMU and the drive it stands on, found once (None: the reason).
    pub(super) qemu: anyhow::Result<(PathBuf, QemuBacking)>,
}

impl<'a> Ctx<'a> {
    pub fn new(o: &'a BlkOptions, jobs: &'a [BlkJob], nvme: &'a NvmeOptions) -> anyhow::Result<Ctx<'a>> {
        let nvme = Runner::new(nvme)?;
        let tsc_khz = nvme.tsc_khz();
        let size = disk_size(o);
        let wants_qemu = o.targets.iter().any(|t| t.is_qemu());
        let qemu = match wants_qemu {
            true => crate::qemu::find().and_then(|q| {
                QemuBacking::for_backend(&o.backend, size, Path::new(crate::qemu::SHM_DIR)).map(|b| (q, b))
            }),
            false => Err(anyhow::anyhow!("not asked for")),
        };
        let iopath = match &o.iopath_exe {
            Some(p) => p.clone(),
            None => std::env::current_exe()?,
        };
        Ok(Ctx {
            o,
            jobs,
            host: host_info(tsc_khz),
            tsc_khz,
            nvme,
            progs: Programs { iopath, qemu: None, serve_args: Vec::new() },
            image: iopath_guest::image_file()?,
            size,
            qemu,
        })
    }

    /// One run of target `t` for job `ji` in `round`.
    pub fn run(&self, t: Target, ji: usize, round: u32) -> anyhow::Result<BlkRun> {
        // nvme's runner places its own threads.
        let nvme = matches!(t, Target::Nvme(_));
        let _pinned = self.o.pin.filter(|_| !nvme).map(|p| Pinner::start(p, DEVICE_THREADS));
        let name = t.to_string();
        match t {
            Target::Nvme(db) => self.nvme(&name, db, ji, round),
            Target::Virtio(notify) => self.virtio(&name, notify, None, ji, round),
            // A transport's device thread or backend is kicked through an eventfd.
            Target::Remote(tr) => self.virtio(&name, NotifyMode::Ioeventfd, Some(tr), ji, round),
            Target::Qemu(QemuBlk::VirtioBlkPci) => self.qemu_virtio(&name, ji, round),
            Target::Qemu(QemuBlk::VhostUserBlkPci) => self.qemu_vhost_user(&name, ji, round),
        }
    }

    fn nvme(&self, t: &str, db: DoorbellMode, ji: usize, round: u32) -> anyhow::Result<BlkRun> {
        let n = self.nvme.run(db, ji, round)?;
        Ok(from_nvme(t, &self.jobs[ji], n))
    }

    pub(super) fn cmdline(&self, ji: usize) -> String {
        let j = &self.jobs[ji].job;
        format!(
            "workload=vblk rw={} bs={} iodepth={} time_ms={} size_mb={} tsc_khz={}",
            j.rw,
            j.bs,
            j.iodepth,
            self.o.time_ms,
            self.size >> 20,
            self.tsc_khz
        )
    }

    pub(super) fn blk_config(&self, notify: NotifyMode) -> VirtioBlkConfig {
        VirtioBlkConfig { backend: self.o.backend.clone(), size: self.size, notify, ..VirtioBlkConfig::default() }
    }

    /// iopath's virtio-blk in the VMM, or over the transport `remote`
    /// (started by the VMM, as `--device virtio-blk,...@TRANSPORT`).
    fn virtio(
        &self,
        t: &str,
        notify: NotifyMode,
        remote: Option<Transport>,
        ji: usize,
        round: u32,
    ) -> anyhow::Result<BlkRun> {
        let config = DeviceConfig::VirtioBlk(self.blk_config(notify));
        let spec = match remote {
            None => DeviceSpec { device: Device::Model(config), remote: None },
            // Checked as `--device` checks it: the transport carries virtio-blk.
            Some(tr) => DeviceSpec::remote(config, tr, Endpoint::Spawn)?,
        };
        let mut cfg = VmConfig::new(iopath_guest::IMAGE, &self.cmdline(ji));
        cfg.devices = vec![instantiate(&spec, &self.progs).map_err(|e| anyhow::anyhow!("{spec}: {e}"))?];
        cfg.mem_size = self.o.mem_mb << 20;
        cfg.timeout = Duration::from_secs(self.o.timeout_s);
        cfg.cancel = Some(&crate::interrupt::FLAG);
        cfg.exit_marks = vec![WINDOW_START.into(), WINDOW_END.into()];
        let rep = run(cfg)?;
        let mut r = to_run(t, &self.jobs[ji], ji, round, &rep.lines, self.tsc_khz)?;
        let in_window = crate::nvme::window_exits_between(&rep.marks, WINDOW_START, WINDOW_END)
            .ok_or_else(|| anyhow::anyhow!("the guest printed no {WINDOW_START} / {WINDOW_END} lines"))?;
        r.window_exits = Some(in_window);
        r.exits_per_io = Some(in_window as f64 / r.ios.max(1) as f64);
        let counters = &rep.devices.first().ok_or_else(|| anyhow::anyhow!("no device report"))?.counters;
        let c = |n: &str| counters.iter().find(|c| c.name == n).map(|c| c.value);
        let path = match (remote, notify) {
            (Some(Transport::Queues(_)), _) => VirtioPath::VhostUser,
            (_, NotifyMode::Exit) => VirtioPath::Exit,
            (_, NotifyMode::Ioeventfd) => VirtioPath::Ioeventfd,
            (_, NotifyMode::Poll) => VirtioPath::Poll,
        };
        let v = check::virtio(path, &c, Guest { ios: r.ios, notifies: r.guest_notifies.unwrap_or(0) });
        (r.routing, r.routing_ok) = (v.text, v.ok);
        guest_checks(&mut r);
        anyhow::ensure!(
            rep.status == 1,
            "{}; routing: {}",
            crate::record::exit_failure(rep.status, &rep.lines),
            r.routing
        );
        Ok(r)
    }
}

/// A `bench nvme` run as a blk run.
fn from_nvme(t: &str, j: &BlkJob, n: NvmeRun) -> BlkRun {
    BlkRun {
        target: t.into(),
        job_index: n.job,
        job: j.name.clone(),
        round: n.round,
        ios: n.io.ios,
        cycles: n.cycles,
        iops: n.io.iops,
        mb_s: n.io.mb_s,
        lat_avg_ns: Some(n.io.lat_avg_ns).filter(|v| v.is_finite()),
        lat_min_ns: n.io.lat_min_ns,
        lat_max_ns: n.io.lat_max_ns,
        p50_ns: n.io.p50_ns,
        p99_ns: n.io.p99_ns,
        hist: n.io.hist,
        lat: n.io.lat,
        window_exits: n.window_exits,
        exits_per_io: n.exits_per_io,
        guest_notifies: Some(n.io_doorbell_writes),
        errors: n.errors,
        routing: n.routing,
        routing_ok: n.routing_ok,
    }
}

/// The guest's own verdict: it did I/O and none failed.
pub(super) fn guest_checks(r: &mut BlkRun) {
    if r.ios > 0 && r.errors == 0 {
        r.routing = format!("{}; guest: {} I/Os, 0 errors", r.routing, r.ios);
    } else {
        r.routing_ok = false;
        r.routing = format!("{}; guest: {} I/Os, {} errors", r.routing, r.ios, r.errors);
    }
}

/// A run from vblk's `@vblk` record and `@vblk-hist` lines.
pub fn to_run(
    target: &str,
    j: &BlkJob,
    ji: usize,
    round: u32,
    lines: &[String],
    tsc_khz: u64,
) -> anyhow::Result<BlkRun> {
    let f = crate::record::find_record(lines, "vblk").ok_or_else(|| {
        let errs: Vec<&String> =
            lines.iter().filter(|l| l.contains("error") || l.starts_with("@fault")).take(5).collect();
        anyhow::anyhow!("no @vblk record; {errs:?}")
    })?;
    let g = |k: &str| {
        f.get(k).and_then(|v| v.parse::<u64>().ok()).ok_or_else(|| anyhow::anyhow!("@vblk record without {k}"))
    };
    let (ios, cycles) = (g("ios")?, g("cycles")?);
    anyhow::ensure!(cycles > 0 && tsc_khz > 0, "@vblk record with cycles=0");
    let lat = LatHist::parse_kind(lines, "vblk", ios)?.ok_or_else(|| anyhow::anyhow!("no @vblk-hist lines"))?;
    let secs = cycles as f64 / (tsc_khz as f64 * 1000.0);
    let ns = |c: u64| crate::stats::ns(c as f64, tsc_khz);
    Ok(BlkRun {
        target: target.into(),
        job_index: ji,
        job: j.name.clone(),
        round,
        ios,
        cycles,
        iops: ios as f64 / secs,
        mb_s: ios as f64 * j.job.bs as f64 / secs / 1e6,
        lat_avg_ns: g("lat_sum").ok().filter(|_| ios > 0).map(|s| ns(s) / ios as f64),
        lat_min_ns: g("lat_min").ok().filter(|_| ios > 0).map(ns),
        lat_max_ns: g("lat_max").ok().filter(|_| ios > 0).map(ns),
        p50_ns: lat.quantile_ns(0.5, tsc_khz),
        p99_ns: lat.quantile_ns(0.99, tsc_khz),
        hist: lat.pairs_ns(tsc_khz),
        lat: Some(lat),
        window_exits: None,
        exits_per_io: None,
        guest_notifies: Some(g("notifies")?),
        errors: g("errors")?,
        routing: String::new(),
        routing_ok: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::block::StorageKind;

    #[test]
    fn a_file_disk_is_sized_as_bench_nvme_sizes_it() {
        let dir = std::env::temp_dir();
        let file = |name: &str, len: u64| {
            let p = dir.join(format!("iopath-blk-size-{}-{name}", std::process::id()));
            std::fs::File::create(&p).unwrap().set_len(len).unwrap();
            p
        };
        let o = |p: &Path| BlkOptions { backend: StorageKind::File(p.into()), size_mb: 32, ..Default::default() };
        // Below 1 MiB: size_mb, which the device makes the file (it was 1 MiB).
        let tiny = file("tiny", 4096);
        assert_eq!(disk_size(&o(&tiny)), 32 << 20);
        // Past 1 TiB (sparse): the first TiB (it was the whole file).
        let huge = file("huge", (2 << 40) + 4096);
        assert_eq!(disk_size(&o(&huge)), 1 << 40);
        // Whole MiB of a file that has them.
        let odd = file("odd", (3 << 20) + 5);
        assert_eq!(disk_size(&o(&odd)), 3 << 20);
        for p in [&tiny, &huge, &odd] {
            assert_eq!(disk_size(&o(p)), crate::nvme::namespace_size(&o(p).backend, Some(32)));
            let _ = std::fs::remove_file(p);
        }
        let null = BlkOptions { size_mb: 8, ..Default::default() };
        assert_eq!(disk_size(&null), 8 << 20);
    }

    #[test]
    fn a_vblk_record_with_its_histogram_is_a_run() {
        let o = BlkOptions::default();
        let jobs = o.jobs();
        let l: Vec<String> = [
            "@vblk-dev features=0x1 event_idx=1",
            "@vblk rw=read bs=131072 iodepth=16 event_idx=1 ios=4 cycles=2000000 lat_sum=1 errors=0 kicks=3 notifies=2",
            "@vblk-hist 548:4",
            "@vblk-hist-end buckets=1 lines=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // 1 GHz: 4 I/Os of 128 KiB in 2 ms.
        let r = to_run("virtio-exit", &jobs[0], 0, 0, &l, 1_000_000).unwrap();
        assert_eq!((r.ios, r.iops, r.guest_notifies, r.p50_ns), (4, 2000.0, Some(2), 401.5));
        assert!((r.mb_s - 262.144).abs() < 1e-9, "{}", r.mb_s);
        // A histogram that does not hold the record's I/Os is refused.
        let mut bad = l.clone();
        bad[2] = "@vblk-hist 548:3".into();
        assert!(to_run("t", &jobs[0], 0, 0, &bad, 1_000_000).is_err());
        assert!(to_run("t", &jobs[0], 0, 0, &l[..1], 1_000_000).is_err(), "no record");
    }
}
