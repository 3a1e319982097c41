//! Benchmarks: scenarios that run the guest on iopath's VMM, on the bare
//! KVM_RUN floor and on QEMU, collect the guest's `@row` records and the
//! devices' counters, verify routing, and report medians and ratios.
//!
//! # How the benches measure
//! The guest prints one `@row` per row (batch cycles, access counts, the device's `count`); each row
//! first warms its path until the cost per access settles, then grows its batch until one pass takes
//! `batch_us` (bounded), so a cold device thread cannot shrink the batches. `cpl=0` runs the same access
//! loops at CPL0 through a `ud2` gate (`ring0_call`, guest.h; emulated on this host, so exits from there
//! show what a CPL0 guest pays). `bench::record` parses the rows (malformed or inconsistent input becomes
//! an error row), `bench::exits` checks routing against device, VMM and bare-loop counters
//! (`exits/verify.rs`), computes median, min and max over all batches of all rounds, and marks a cost
//! below its floor or rounds that disagree, running those rows again a bounded number of times
//! (`exits/rerun.rs`, on `bench::guard`).
//! The floor is `vmm/src/bare.rs`: the same image under a KVM_RUN loop with no bus. Out-of-process
//! targets are the registry's function transports (`Target::Remote(name)`). `bench nvme` measures the polled
//! SQ/CQ ring between two host threads (`bench/src/floor.rs`, also `iopath bench floor`) first in each
//! round and again just before each run (odd rounds run the targets in reverse order), and gives each run its
//! `floor_ratio` against the latter; nvmeperf reaps
//! every completion there is, reads the clock once for them and the commands replacing them (never
//! shortening a latency), counts the time its passes found nothing (`wait_cycles`, JSON `guest_wait_pct`:
//! who limits the run, guest or device), prints its latency histogram (`@nvme-hist`; a randrw job
//! also its reads' and writes' apart, `@nvme-read`/`@nvme-write`, `bench/src/nvme/split.rs`) and
//! marks its timed window (`@nvme-window`, where `VmConfig::exit_marks` has the VMM record its exit counts), so
//! `bench/src/nvme/` keeps each run's `ios`, `cycles` and `hist`, takes percentiles over rounds from the merged
//! histogram, counts exits in the window only, runs QEMU on the same backend kind (`qemu::QemuBacking`) and
//! marks, then re-runs, a target the floor contradicts (`guard.rs`); `bench/src/cpu.rs` reads the device threads' CPU time
//! (schedstat, in this process, the device process or QEMU's main loop) for `cpu_ns_per_io` and `idle_cpu_pct`,
//! and the vCPU thread's for `vcpu_ns_per_io`;
//! `--contend N[,M..]` runs N bounded busy threads (`bench/src/contend.rs`) during every run, every target at each level back to back (`relate` gives a contended run its quiet twin's ratio);
//! `--pin` (`bench/src/pin.rs`) places the vCPU thread, the device threads and the floor's threads;
//! `bench/src/wake.rs` measures the wake-up floor (an eventfd waking a thread asleep 1 ms), against
//! which think-time jobs (`--thinktime`) are shown; `bench/src/guestline.rs` runs the exits guest's
//! shm round trip before each QD1 run, the guest line floor its p50 is given over; `bench/src/fio.rs` runs fio on a file backend's
//! file in each round, alone and beside a busy thread on the vCPU's CPU (`fio (host, busy CPU)`; what limits
//! that backend on these hosts: `docs/FILE_BACKEND.md`); `--transport vmm,vfio-user` interleaves the VMM and a device process.
//! `bench blk` (`bench/src/blk/`) runs one block job on every path (NVMe doorbell modes, virtio-blk
//! notify modes, virtio over vfio-user, vhost-user, QEMU's virtio-blk-pci and vhost-user-blk-pci on
//! iopath's backend): nvmeperf or vblk, exits counted between `@vblk-window` marks, percentiles from
//! `@vblk-hist`, each path's routing checked by its counters (`blk/check.rs`; QEMU's through QMP
//! `query-blockstats` (`bench/src/qmp.rs`) or iopath's backend's report). Its targets are typed
//! (`blk/target.rs`: `Nvme(mode)`, `Virtio(notify)`, `Remote(transport)`, `Qemu(device)`) and named as
//! users type them; the remote ones come from the registry (virtio@vfio-user, and each queue transport
//! that carries virtio-blk, named as the transport).
//! `bench reconnect` (`bench/src/reconnect/`) kills a device process every `--every` under the guest's
//! verify workload (the kill loop the survival tests share, `reconnect/kills.rs`) and takes the pause
//! each kill caused from the guest's record of its longest gaps between completions (`gaps=`).
//! Ctrl-C is one mechanism for every bench (`bench/src/interrupt.rs`): the CLI catches SIGINT, SIGTERM
//! and SIGHUP into one flag; the VMM takes it as `VmConfig::cancel` (a run ends as at its timeout,
//! `VmmError::Cancelled`), QEMU's, fio's and perf's waits kill their child on it, and each bench's
//! loop over rounds stops there and returns what it measured, `partial`. A `--backend file:PATH` is
//! checked before anything runs (`bench/src/backing.rs` on the devices' own rules,
//! `devices/src/backing.rs`: missing is an error unless `--create`, which writes the file through).
//! `iopath bench all --out DIR` runs the benches' matrix (`cli/src/all.rs`) and hands their JSON
//! documents to `bench::report`, which writes report.md, results.json, results.csv and the SVG plots
//! (plotters); `iopath report --from results.json` renders them again without running anything.
//! The report marks figures with the same `guard.rs` (`GuardConfig::rounds`: a round 100x from its
//! row's others, one round unguarded; `below_floor` against the run's shm round trip and ring floor)
//! on top of the benches' own marks; each `Figure` carries them to the tables, the CSV and the plots.

pub mod args;
pub mod backing;
pub mod blk;
pub mod contend;
pub mod cpu;
pub mod exits;
pub mod fio;
pub mod fiojobs;
pub mod fioout;
pub mod floor;
pub mod guard;
pub mod guestline;
pub mod host;
pub mod interrupt;
pub mod nvme;
pub mod pin;
pub mod progress;
pub mod qemu;
pub mod qmp;
pub mod reconnect;
pub mod record;
pub mod remote;
pub mod report;
pub mod spdk;
pub mod stats;
pub mod wake;
