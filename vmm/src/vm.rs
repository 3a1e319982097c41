//! A VM built from a [`VmConfig`], run to completion by [`run`].

use crate::bus::Bus;
use crate::debug_exit::{DebugExit, ExitStatus};
pub use crate::error::VmmError;
use crate::ioeventfd::KvmIoEvents;
use crate::memory::{self, GuestRam, RamKind};
use crate::pci::PciHost;
use crate::serial::{LineCallback, LineSink, Uart};
use crate::vcpu::{self, ExitStats};
use iopath_devices::irq::IrqLines;
use iopath_devices::lock;
use iopath_devices::pci::BarPlacement;
use iopath_devices::SharedDevice;
use iopath_devices::{Counter, DeviceContext, FailFn};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};
use vm_memory::GuestMemoryBackend;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

pub struct VmConfig {
    pub image: Vec<u8>,
    pub cmdline: String,
    pub mem_size: u64,
    pub devices: Vec<SharedDevice>,
    /// Assign BARs in the VMM (as firmware would); false leaves it to the guest.
    pub place_bars: bool,
    pub timeout: Duration,
    pub on_line: Option<LineCallback>,
    /// Guest lines (by prefix) at which the exit counts are recorded
    /// (`RunReport::marks`), e.g. the edges of a timed window.
    pub exit_marks: Vec<String>,
    /// How guest RAM is backed. `Auto` is anonymous memory unless a device
    /// shares guest RAM (then a memfd); `Memfd` even when none does (a run
    /// compared with one whose device does: same memory on both sides).
    pub ram: RamKind,
    /// A flag that stops the run as its timeout does when it becomes true
    /// (e.g. a bench's Ctrl-C flag): the run ends with [`VmmError::Cancelled`].
    pub cancel: Option<&'static AtomicBool>,
}

impl VmConfig {
    pub fn new(image: &[u8], cmdline: &str) -> Self {
        VmConfig {
            image: image.to_vec(),
            cmdline: cmdline.to_string(),
            mem_size: 64 << 20,
            devices: Vec::new(),
            place_bars: true,
            timeout: Duration::from_secs(600),
            on_line: None,
            exit_marks: Vec::new(),
            ram: RamKind::Auto,
            cancel: None,
        }
    }
}

pub struct DeviceReport {
    pub name: String,
    pub slot: u8,
    pub bars: Vec<BarPlacement>,
    pub counters: Vec<Counter>,
}

pub struct RunReport {
    /// isa-debug-exit status, (value << 1) | 1.
    pub status: i32,
    pub lines: Vec<String>,
    pub exits: ExitStats,
    /// The exit counts at the lines `VmConfig::exit_marks` asked for.
    pub marks: Vec<crate::vcpu::ExitMark>,
    pub devices: Vec<DeviceReport>,
    pub pci_absent_accesses: u64,
    pub tsc_khz: u32,
    pub wall: Duration,
}

/// A booted-but-not-running machine: KVM VM, RAM with the image, vCPU 0.
pub(crate) struct Machine {
    pub vm: Arc<VmFd>,
    pub ram: GuestRam,
    pub vcpu: VcpuFd,
    pub tsc_khz: u32,
}

/// `ram`: how guest RAM is backed (fd-backed where a device hands it to another process).
pub(crate) fn boot(image: &[u8], cmdline: &str, mem_size: u64, ram: RamKind) -> Result<Machine, VmmError> {
    let k = |what: &'static str, source: kvm_ioctls::Error| VmmError::Kvm { what, source };
    let kvm = Kvm::new().map_err(VmmError::NoKvm)?;
    let vm = kvm.create_vm().map_err(|e| k("KVM_CREATE_VM", e))?;
    vm.set_tss_address(0xfffb_d000).map_err(|e| k("KVM_SET_TSS_ADDR", e))?;
    vm.create_irq_chip().map_err(|e| k("KVM_CREATE_IRQCHIP", e))?;
    if !(2 << 20..=3 << 30).contains(&mem_size) {
        return Err(VmmError::Memory(format!("guest RAM of {mem_size} bytes: use 2 MiB .. 3 GiB")));
    }
    let ram = memory::create(mem_size, ram).map_err(|source| VmmError::Host { what: "guest RAM", source })?;
    let host =
        ram.mem.get_host_address(vm_memory::GuestAddress(0)).map_err(|e| VmmError::Memory(e.to_string()))? as u64;
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: mem_size,
        userspace_addr: host,
    };
    // SAFETY: the mapping is owned by `ram`, which lives as long as the VM (Machine).
    unsafe { vm.set_user_memory_region(region) }.map_err(|e| k("KVM_SET_USER_MEMORY_REGION", e))?;
    let loaded = crate::loader::load_elf(&ram.mem, mem_size, image)?;
    if !crate::loader::has_multiboot_header(image) {
        return Err(VmmError::Load("no multiboot header in the first 8 KiB".into()));
    }
    let vcpu = vm.create_vcpu(0).map_err(|e| k("KVM_CREATE_VCPU", e))?;
    let tsc_khz = vcpu.get_tsc_khz().map_err(|e| k("KVM_GET_TSC_KHZ", e))?;
    let mut cmd = cmdline.to_string();
    if !cmd.split_whitespace().any(|w| w.starts_with("tsc_khz=")) {
        cmd = format!("{cmd} tsc_khz={tsc_khz}").trim().to_string();
    }
    let mbi = crate::loader::write_mbi(&ram.mem, mem_size, &cmd)?;
    vcpu::setup_multiboot(&kvm, &vcpu, loaded.entry, mbi)?;
    Ok(Machine { vm: Arc::new(vm), ram, vcpu, tsc_khz })
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal that interrupts KVM_RUN when a run overstays its timeout.
pub(crate) fn kick_signal() -> i32 {
    static ONCE: Once = Once::new();
    let sig = vmm_sys_util::signal::SIGRTMIN();
    ONCE.call_once(|| {
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(sig, kick_handler) {
            log::warn!("cannot install the vCPU kick handler: {e}");
        }
    });
    sig
}

/// A device's report that the run cannot go on (its device process died).
pub(crate) type Fatal = Arc<Mutex<Option<String>>>;

/// How often [`watched`] looks at a device's fatal report and at `cancel`
/// while the vCPU thread runs. Its end wakes the watcher at once; these
/// looks are all it does besides, and each wakes it on a CPU the run's
/// polling threads spin on (every 5 ms, they cost the device poller 1-2 %
/// of its time in preemptions, which a timing model's p99 showed).
const WATCH_PERIOD: Duration = Duration::from_millis(50);

/// Runs `body` on a vCPU thread; past `timeout`, on a device's fatal
/// report or once `cancel` is set, sets `stop` and kicks the thread out of
/// KVM_RUN until it returns.
pub(crate) fn watched<R: Send + 'static>(
    timeout: Duration,
    fatal: Option<Fatal>,
    cancel: Option<&'static AtomicBool>,
    body: impl FnOnce(&AtomicBool) -> R + Send + 'static,
) -> Result<R, VmmError> {
    let sig = kick_signal();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    // Dropped when the thread ends, returned or panicked: the watcher's wake-up.
    let (ended, end) = std::sync::mpsc::channel::<()>();
    let h = std::thread::Builder::new()
        .name("vcpu0".into())
        .spawn(move || {
            let _ended = ended;
            body(&stop2)
        })
        .map_err(|e| VmmError::Host { what: "the vCPU thread", source: e })?;
    let t0 = Instant::now();
    let mut period = WATCH_PERIOD;
    while !h.is_finished() {
        if let Err(std::sync::mpsc::RecvTimeoutError::Disconnected) = end.recv_timeout(period) {
            break;
        }
        let failed = fatal.as_ref().is_some_and(|f| lock(f).is_some());
        let cancelled = cancel.is_some_and(|c| c.load(Ordering::Relaxed));
        if t0.elapsed() > timeout || failed || cancelled {
            stop.store(true, Ordering::Release);
            // SAFETY: the thread is alive (not finished) and joinable; the
            // handler does nothing but interrupt the ioctl.
            unsafe { libc::pthread_kill(h.as_pthread_t(), sig) };
            // Again until it returns: a kick before it entered KVM_RUN is lost.
            period = Duration::from_millis(20);
        }
    }
    h.join().map_err(|_| VmmError::Panicked("the vCPU thread"))
}

/// PCI INTx lines go to IOAPIC pins 16..23 (level-triggered GSIs).
const INTX_GSI_BASE: u32 = 16;

/// A device's interrupt lines: INTx as a KVM irqfd with a resample fd on
/// `gsi`, so an assertion (from this process or a device process that was
/// handed the fds) goes straight into KVM.
fn intx_lines(vm: &VmFd, gsi: u32) -> Result<Arc<IrqLines>, VmmError> {
    let e = |source| VmmError::Host { what: "an INTx eventfd", source };
    let trigger = EventFd::new(EFD_NONBLOCK).map_err(e)?;
    let resample = EventFd::new(EFD_NONBLOCK).map_err(e)?;
    vm.register_irqfd_with_resample(&trigger, &resample, gsi)
        .map_err(|source| VmmError::Kvm { what: "KVM_IRQFD with resample for INTx", source })?;
    let lines = IrqLines::new();
    lines.connect_intx(trigger, Some(resample));
    Ok(lines)
}

/// Empties the buses when dropped.
struct ReleaseBuses([Arc<Bus>; 2]);

impl Drop for ReleaseBuses {
    fn drop(&mut self) {
        for b in &self.0 {
            b.clear();
        }
    }
}

/// Boots the guest image with the configured devices and runs it to the end.
pub fn run(mut cfg: VmConfig) -> Result<RunReport, VmmError> {
    let t0 = Instant::now();
    let ram = match cfg.ram {
        RamKind::Auto if cfg.devices.iter().any(|d| d.shares_guest_ram()) => RamKind::Memfd,
        k => k,
    };
    let m = boot(&cfg.image, &cfg.cmdline, cfg.mem_size, ram)?;
    let pio = Arc::new(Bus::new());
    let mmio = Arc::new(Bus::new());
    // The PCI host holds both buses and sits on the port bus: emptied when
    // this run ends (every return path), the cycle goes and the devices, the
    // KVM VM they hold, their threads and device processes go with it.
    let _release = ReleaseBuses([pio.clone(), mmio.clone()]);
    let status = ExitStatus::new();
    let mut sink = LineSink::new(cfg.on_line.take());
    let marks = (!cfg.exit_marks.is_empty()).then(|| Arc::new(vcpu::ExitMarks::new(cfg.exit_marks.clone())));
    sink.marks = marks.clone();
    let lines = sink.lines.clone();
    let uart = Arc::new(Mutex::new(Uart::new(sink)));
    pio.insert(crate::serial::PORT, crate::serial::LEN, uart.clone())?;
    pio.insert(crate::debug_exit::PORT, 1, Arc::new(DebugExit(status.clone())))?;
    let host = Arc::new(Mutex::new(PciHost::new(pio.clone(), mmio.clone())));
    lock(&host).set_vm(m.vm.clone());
    pio.insert(crate::pci::CONFIG_ADDRESS, 8, host.clone())?;
    let fatal: Fatal = Arc::new(Mutex::new(None));
    let fatal2 = fatal.clone();
    // The first failure stops the run and is its error (printed once, by
    // whoever gets it); a later one is only logged.
    let fail: FailFn = Arc::new(move |msg: String| {
        let mut f = lock(&fatal2);
        match f.as_ref() {
            Some(first) if *first != msg => log::error!("{msg} (after: {first})"),
            Some(_) => {}
            None => *f = Some(msg),
        }
    });
    let mut devices: Vec<(u8, SharedDevice)> = Vec::new();
    let router = crate::irq::GsiRouter::new(m.vm.clone());
    for (i, d) in cfg.devices.drain(..).enumerate() {
        let ioevents = Arc::new(KvmIoEvents::new(m.vm.clone()));
        let gsi = INTX_GSI_BASE + (i as u32 % 8);
        let irq = Arc::new(crate::irq::VmIrq::new(m.vm.clone(), router.clone(), intx_lines(&m.vm, gsi)?, i as u32));
        let mem = iopath_devices::GuestMem::from(m.ram.mem.clone()).with_huge_pages(m.ram.huge);
        d.attach(DeviceContext { mem, ioevents: ioevents.clone(), irq, fail: fail.clone() });
        let mut h = lock(&host);
        let slot = h.add(d.clone(), Some(ioevents))?;
        h.set_intx_line(slot as usize, gsi as u8);
        devices.push((slot, d));
    }
    if cfg.place_bars {
        lock(&host).place_bars()?;
    }
    let Machine { vm, ram, mut vcpu, tsc_khz } = m;
    let (pio2, mmio2, status2, marks2) = (pio.clone(), mmio.clone(), status.clone(), marks.clone());
    let result = watched(cfg.timeout, Some(fatal.clone()), cfg.cancel, move |stop| {
        let r = vcpu::run_loop(&mut vcpu, &pio2, &mmio2, &status2, stop, marks2.as_deref());
        (r, vcpu)
    })?;
    let (r, vcpu) = result;
    if cfg.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
        for (_, d) in &devices {
            d.quiesce();
        }
        return Err(VmmError::Cancelled);
    }
    if let Some(msg) = lock(&fatal).take() {
        for (_, d) in &devices {
            d.quiesce();
        }
        return Err(VmmError::Device(msg));
    }
    let mut reports = Vec::new();
    for (slot, d) in &devices {
        d.quiesce();
        reports.push(DeviceReport {
            name: d.name().to_string(),
            slot: *slot,
            bars: lock(&host).placements(*slot as usize),
            counters: d.counters(),
        });
    }
    lock(&uart).0.writer_mut().flush_partial();
    drop(vcpu);
    drop(vm);
    drop(ram);
    let exits = match r {
        Ok(s) => s,
        Err(e) => {
            let tail: Vec<String> = lock(&lines).iter().rev().take(5).rev().cloned().collect();
            return Err(match e {
                VmmError::Guest { reason, rip } => {
                    VmmError::Guest { reason: format!("{reason}; last guest output: {tail:?}"), rip }
                }
                e => e,
            });
        }
    };
    let lines = std::mem::take(&mut *lock(&lines));
    let pci_absent_accesses = lock(&host).absent_accesses;
    Ok(RunReport {
        status: status.get().unwrap_or(-1),
        lines,
        exits,
        marks: marks.map(|m| m.marks()).unwrap_or_default(),
        devices: reports,
        pci_absent_accesses,
        tsc_khz,
        wall: t0.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iopath_devices::Interrupts;

    #[test]
    fn intx_goes_from_the_device_eventfd_into_kvm_not_through_the_vmm() {
        assert!(std::path::Path::new("/dev/kvm").exists(), "/dev/kvm is missing");
        let kvm = Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let lines = intx_lines(&vm, INTX_GSI_BASE).unwrap();
        // What a device process would hold after SET_IRQFD / SET_IRQS.
        let (trigger, _resample) = lines.intx_eventfds().unwrap();
        lines.set_intx(true);
        std::thread::sleep(Duration::from_millis(50));
        // KVM's irqfd consumed the count: nobody in userspace reads it.
        assert!(trigger.read().is_err(), "the trigger eventfd still holds its count: no irqfd took it");
        let mut chip = kvm_bindings::kvm_irqchip { chip_id: kvm_bindings::KVM_IRQCHIP_IOAPIC, ..Default::default() };
        vm.get_irqchip(&mut chip).unwrap();
        // SAFETY: chip_id IOAPIC selects the ioapic member of the union.
        let irr = unsafe { chip.chip.ioapic.irr };
        assert_ne!(irr & (1 << INTX_GSI_BASE), 0, "IOAPIC pin {INTX_GSI_BASE} not asserted (irr {irr:#x})");
    }
}
