//! virtio 1.x devices: split virtqueues ([`queue`]), the block device
//! ([`blk`]), the modern PCI transport ([`transport`]: up to 16 queues, a
//! [`QueueEngine`](transport::QueueEngine) serving them) and virtio-blk
//! served in the VMM ([`pci`]).

pub mod blk;
pub mod pci;
pub mod queue;
pub mod transport;
mod worker;

#[cfg(test)]
mod fake;

use crate::{Error, Result};
use pci::VirtioBlkConfig;

/// Parses virtio-blk's `KEY=VALUE` options: `backend=null|ram|file:PATH`,
/// `create=on|off` (a missing file made: `crate::backing`), `size_mb=N` (1 ..= 1048576), `notify=exit|ioeventfd|poll`, `queues=N`
/// (1 ..= [`MAX_QUEUES`](transport::MAX_QUEUES)).
pub fn parse_blk(opts: &[(String, String)]) -> Result<VirtioBlkConfig> {
    let err = |k: &str, reason: String| Error::Option { device: "virtio-blk", option: k.into(), reason };
    let mut c = VirtioBlkConfig::default();
    for (k, v) in opts {
        match k.as_str() {
            "backend" => c.backend = v.parse::<crate::block::StorageKind>()?,
            "create" => c.create = crate::spec::on_off("virtio-blk", k, v)?,
            "size_mb" => match v.parse::<u64>() {
                Ok(mb) if (1..=1 << 20).contains(&mb) => c.size = mb << 20,
                _ => return Err(err(k, format!("{v:?} MiB (1 ..= 1048576)"))),
            },
            "notify" => c.notify = v.parse()?,
            "queues" => match v.parse::<u16>() {
                Ok(n) if (1..=transport::MAX_QUEUES).contains(&n) => c.queues = Some(n),
                _ => return Err(err(k, format!("{v:?} (1 ..= {})", transport::MAX_QUEUES))),
            },
            _ => return Err(err(k, "unknown option (backend, create, size_mb, notify, queues)".into())),
        }
    }
    if c.create && !matches!(c.backend, crate::block::StorageKind::File(_)) {
        return Err(err("create", "create=on needs backend=file:PATH".into()));
    }
    Ok(c)
}
