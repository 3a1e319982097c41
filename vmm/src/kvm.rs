//! What this host's KVM offers beyond the capabilities kvm-ioctls names.

/// Why the kernel half of ioregionfd is not there (the VMM then plays it).
#[derive(Debug, thiserror::Error)]
pub enum NoIoRegionFd {
    #[error("KVM_SET_IOREGION is not in upstream Linux (RFC v3 was never merged); served in userspace")]
    NotUpstream,
    #[error("KVM capability {0} (IOPATH_KVM_CAP_IOREGIONFD) is absent; served in userspace")]
    Absent(u32),
}

/// A kernel that implements KVM_SET_IOREGION, if this one does. Upstream
/// kernels do not; the RFC's numbers were taken by other ioctls, so only an
/// explicitly named capability (`IOPATH_KVM_CAP_IOREGIONFD=N`, as a patched
/// kernel defines it) is probed.
pub fn ioregionfd_support(kvm: &kvm_ioctls::Kvm) -> Result<u32, NoIoRegionFd> {
    let Some(cap) = std::env::var("IOPATH_KVM_CAP_IOREGIONFD").ok().and_then(|v| v.parse::<u32>().ok()) else {
        return Err(NoIoRegionFd::NotUpstream);
    };
    // SAFETY: KVM_CHECK_EXTENSION with an integer argument only reads it.
    let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(kvm), 0xae03, cap as libc::c_ulong) };
    if r > 0 {
        Ok(cap)
    } else {
        Err(NoIoRegionFd::Absent(cap))
    }
}
