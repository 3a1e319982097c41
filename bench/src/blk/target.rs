//! `bench blk`'s targets: each path to the guest's disk it measures, as a
//! type, with the names users type (`--targets`, `--reference`) as its
//! `Display` and `FromStr`. The remote ones come from the transport
//! registry: virtio-blk over vfio-user, and its queues over each queue
//! transport that carries virtio-blk (vhost-user), named as the transport.

use iopath_devices::nvme::DoorbellMode;
use iopath_devices::virtio::pci::NotifyMode;
use iopath_protocols::Transport;
use std::fmt;
use std::str::FromStr;

/// QEMU's own device on the same guest image and backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QemuBlk {
    /// QEMU's virtio-blk-pci on its own block layer.
    VirtioBlkPci,
    /// QEMU's vhost-user-blk-pci, with iopath's backend
    /// (`iopath serve virtio-blk --transport vhost-user`).
    VhostUserBlkPci,
}

/// One path to the guest's disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// iopath's NVMe controller in the VMM, its I/O doorbells in this mode
    /// (`nvme-mmio`, `nvme-shm`, `nvme-bar`), run by `bench nvme`'s runner.
    Nvme(DoorbellMode),
    /// iopath's virtio-blk in the VMM, notified so (`virtio-exit`,
    /// `virtio-ioeventfd`, `virtio-poll`).
    Virtio(NotifyMode),
    /// iopath's virtio-blk over a transport, notified through an eventfd:
    /// the function in a device process over a function transport
    /// (`virtio@vfio-user`), or its queues served by iopath's backend over
    /// a queue transport (named as the transport: `vhost-user`).
    Remote(Transport),
    /// QEMU's device (`qemu-virtio-blk-pci`, `qemu-vhost-user-blk-pci`).
    Qemu(QemuBlk),
}

/// The function transports virtio-blk runs over as a target (queue
/// transports are all taken).
const FUNCTION_TRANSPORTS: &[&str] = &["vfio-user"];

impl Target {
    /// Every target, in the order a round runs them: NVMe, virtio-blk in
    /// the VMM, over transports, QEMU's.
    pub fn all() -> Vec<Target> {
        let mut v: Vec<Target> = [DoorbellMode::Mmio, DoorbellMode::Shm, DoorbellMode::Bar].map(Target::Nvme).into();
        v.extend([NotifyMode::Exit, NotifyMode::Ioeventfd, NotifyMode::Poll].map(Target::Virtio));
        let blk = iopath_devices::DeviceConfig::VirtioBlk(Default::default());
        v.extend(
            iopath_protocols::TRANSPORTS
                .iter()
                .filter(|t| match t {
                    Transport::Function(f) => FUNCTION_TRANSPORTS.contains(&f.name()),
                    Transport::Queues(_) => t.carries(&blk).is_ok(),
                })
                .map(|&t| Target::Remote(t)),
        );
        v.extend([QemuBlk::VirtioBlkPci, QemuBlk::VhostUserBlkPci].map(Target::Qemu));
        v
    }

    /// True for QEMU's devices (they need QEMU).
    pub fn is_qemu(self) -> bool {
        matches!(self, Target::Qemu(_))
    }
}

/// The name, padded as asked (`{:<25}` in the tables).
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Target::Nvme(db) => format!("nvme-{db}"),
            Target::Virtio(n) => format!("virtio-{n}"),
            Target::Remote(t @ Transport::Function(_)) => format!("virtio@{t}"),
            Target::Remote(t @ Transport::Queues(_)) => t.to_string(),
            Target::Qemu(QemuBlk::VirtioBlkPci) => "qemu-virtio-blk-pci".into(),
            Target::Qemu(QemuBlk::VhostUserBlkPci) => "qemu-vhost-user-blk-pci".into(),
        };
        f.pad(&name)
    }
}

impl serde::Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A name that is no target.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a target; the targets: {}", Target::all().iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "))]
pub struct UnknownTarget {
    pub name: String,
}

impl FromStr for Target {
    type Err = UnknownTarget;
    fn from_str(s: &str) -> Result<Self, UnknownTarget> {
        Target::all().into_iter().find(|t| t.to_string() == s).ok_or_else(|| UnknownTarget { name: s.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_is_parsed_back_from_its_name() {
        let names: Vec<String> = Target::all().iter().map(|t| t.to_string()).collect();
        assert_eq!(
            names,
            [
                "nvme-mmio",
                "nvme-shm",
                "nvme-bar",
                "virtio-exit",
                "virtio-ioeventfd",
                "virtio-poll",
                "virtio@vfio-user",
                "vhost-user",
                "qemu-virtio-blk-pci",
                "qemu-vhost-user-blk-pci",
            ]
        );
        for t in Target::all() {
            assert_eq!(t.to_string().parse::<Target>(), Ok(t));
        }
        let vu = iopath_protocols::transport("vhost-user").unwrap();
        assert_eq!("vhost-user".parse::<Target>(), Ok(Target::Remote(vu)));
        assert_eq!("nvme-shm".parse::<Target>(), Ok(Target::Nvme(DoorbellMode::Shm)));
        for bad in ["nvme-foo", "nvme-adaptive", "virtio@mpqemu", "virtio@vhost-user", "vfio-user", "qemu", ""] {
            let e = bad.parse::<Target>().unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")) && e.to_string().contains("vhost-user"), "{e}");
        }
        assert_eq!(serde_json::to_value(Target::Virtio(NotifyMode::Poll)).unwrap(), "virtio-poll");
        assert_eq!(format!("{:<12}|", Target::Remote(vu)), "vhost-user  |", "padded as a table asks");
    }
}
