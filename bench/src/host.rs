//! What host a result came from: CPU, kernel, KVM flavour, nested or not.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct HostInfo {
    pub cpu: String,
    pub cpus: usize,
    pub kernel: String,
    /// kvm_intel, kvm_amd, kvm_pvm, ...
    pub kvm_module: String,
    /// The host itself runs under a hypervisor (CPUID hypervisor bit).
    pub nested: bool,
    pub tsc_khz: u64,
}

fn read(p: &str) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

pub fn host_info(tsc_khz: u64) -> HostInfo {
    let cpuinfo = read("/proc/cpuinfo");
    let field = |k: &str| {
        cpuinfo
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let nested = field("flags").split_whitespace().any(|f| f == "hypervisor");
    let kvm_module = ["kvm_intel", "kvm_amd", "kvm_pvm"]
        .iter()
        .find(|m| std::path::Path::new(&format!("/sys/module/{m}")).exists())
        .map(|m| m.to_string())
        .unwrap_or_else(|| "unknown".into());
    HostInfo {
        cpu: field("model name"),
        cpus: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        kvm_module,
        nested,
        tsc_khz,
    }
}

impl std::fmt::Display for HostInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "host: {} ({} cpus), Linux {}, KVM {}{}, TSC {:.3} GHz",
            self.cpu,
            self.cpus,
            self.kernel,
            self.kvm_module,
            if self.nested { " (nested: this host is itself a VM)" } else { "" },
            self.tsc_khz as f64 / 1e6
        )
    }
}
