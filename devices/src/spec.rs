//! A device model and its options as one typed value: `NAME[,KEY=VALUE...]`.
//!
//! [`DeviceConfig`] is parsed and validated once, where the user typed it
//! (the CLI, a bench), before any process starts; its [`Display`](fmt::Display)
//! form round-trips, so the same value becomes a device process's argv. A
//! value that holds `,` writes it `,,` (QEMU's option escaping), and `@`
//! (which separates a device from its transport in a device spec) `@@`:
//! `nvme,backend=file:/data/a,,b@@c.img` names the file `/data/a,b@c.img`.

use crate::block::StorageKind;
use crate::nvme::{DoorbellMode, NvmeConfig};
use crate::virtio::pci::{VirtioBlk, VirtioBlkConfig};
use crate::{doorbell, nvme, testdev, Error, Result, SharedDevice};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

/// Device models by name, as `iopath serve` and `--device` name them.
pub const DEVICE_NAMES: &[&str] = &["pci-testdev", "iopath-doorbell", "nvme", "virtio-blk"];

/// One device model with its options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceConfig {
    /// QEMU's pci-testdev (1b36:0005).
    PciTestDev,
    /// iopath's doorbell round-trip device.
    Doorbell,
    /// The NVMe controller.
    Nvme(NvmeConfig),
    /// virtio-blk on the modern PCI transport.
    VirtioBlk(VirtioBlkConfig),
}

impl DeviceConfig {
    pub fn name(&self) -> &'static str {
        match self {
            DeviceConfig::PciTestDev => "pci-testdev",
            DeviceConfig::Doorbell => "iopath-doorbell",
            DeviceConfig::Nvme(_) => "nvme",
            DeviceConfig::VirtioBlk(_) => "virtio-blk",
        }
    }

    /// Checks the `file:PATH` backend this device stands on, and with
    /// `create=on` makes a missing one (`crate::backing`), before the
    /// device is built here or in a device process.
    pub fn prepare_backing(&self) -> Result<crate::backing::Prepared> {
        let (backend, bytes, create) = match self {
            DeviceConfig::Nvme(c) => (&c.backend, c.size, c.create),
            DeviceConfig::VirtioBlk(c) => (&c.backend, c.size, c.create),
            _ => return Ok(crate::backing::Prepared::AsIs),
        };
        Ok(crate::backing::prepare(backend, bytes, create)?)
    }

    /// A new device model with these options.
    pub fn build(&self) -> Result<SharedDevice> {
        Ok(match self {
            DeviceConfig::PciTestDev => Arc::new(Mutex::new(testdev::PciTestDev::new())),
            DeviceConfig::Doorbell => Arc::new(Mutex::new(doorbell::Doorbell::new())),
            DeviceConfig::Nvme(c) => Arc::new(nvme::Nvme::new(c.clone())?),
            DeviceConfig::VirtioBlk(c) => Arc::new(VirtioBlk::new(c.clone())?),
        })
    }
}

/// Splits `s` at every `sep` that is not doubled; doubled separators (and
/// doubled `@`) become single characters in the pieces.
pub fn split_escaped(s: &str, sep: char) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if (c == sep || c == '@' || c == ',') && it.peek() == Some(&c) {
            it.next();
            out.last_mut().unwrap().push(c);
        } else if c == sep {
            out.push(String::new());
        } else {
            out.last_mut().unwrap().push(c);
        }
    }
    out
}

/// The position of the first `@` that is not doubled, if any.
pub fn find_unescaped_at(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'@' || b[i] == b',' {
            if b.get(i + 1) == Some(&b[i]) {
                i += 2;
                continue;
            }
            if b[i] == b'@' {
                return Some(i);
            }
        }
        i += 1;
    }
    None
}

/// Writes a value with `,` and `@` doubled.
pub fn escape(v: &str) -> String {
    v.replace(',', ",,").replace('@', "@@")
}

fn option(device: &'static str, key: &str, reason: impl Into<String>) -> Error {
    Error::Option { device, option: key.to_string(), reason: reason.into() }
}

/// A switch's value: `on` or `off`.
pub fn on_off(device: &'static str, key: &str, v: &str) -> Result<bool> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(option(device, key, format!("{v:?} (on or off)"))),
    }
}

impl FromStr for DeviceConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let parts = split_escaped(s, ',');
        let name = parts[0].as_str();
        let opts: Vec<(String, String)> = parts[1..]
            .iter()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => Ok((k.to_string(), v.to_string())),
                None => Err(Error::Option { device: "device", option: kv.clone(), reason: "is not KEY=VALUE".into() }),
            })
            .collect::<Result<_>>()?;
        let no_opts = |c: DeviceConfig| match opts.first() {
            None => Ok(c),
            Some((k, _)) => Err(option(c.name(), k, "this device takes no options")),
        };
        match name {
            "pci-testdev" => no_opts(DeviceConfig::PciTestDev),
            "iopath-doorbell" => no_opts(DeviceConfig::Doorbell),
            "nvme" => {
                let mut c = NvmeConfig::default();
                for (k, v) in &opts {
                    let num = || v.parse::<u64>().map_err(|_| option("nvme", k, format!("{v:?} is not a number")));
                    match k.as_str() {
                        "doorbell" => c.doorbell = v.parse::<DoorbellMode>()?,
                        "backend" => c.backend = v.parse::<StorageKind>()?,
                        "size_mb" => {
                            let mb = num()?;
                            if mb == 0 || mb > 1 << 20 {
                                return Err(option("nvme", k, format!("{mb} MiB (1 .. 1048576)")));
                            }
                            c.size = mb << 20;
                        }
                        "lba" => {
                            c.lba_size = match num()? {
                                512 => 512,
                                4096 => 4096,
                                n => return Err(option("nvme", k, format!("{n} (512 or 4096)"))),
                            }
                        }
                        "pollers" => {
                            c.pollers = match num()? {
                                n if (1..=nvme::MAX_POLLERS as u64).contains(&n) => n as u8,
                                n => return Err(option("nvme", k, format!("{n} (1 ..= {})", nvme::MAX_POLLERS))),
                            }
                        }
                        "forecast" => c.forecast = on_off("nvme", k, v)?,
                        "in_place" => c.in_place = v.parse().map_err(|e| option("nvme", k, e))?,
                        "create" => c.create = on_off("nvme", k, v)?,
                        "submit_batch" => {
                            c.submit_batch = match num()? {
                                n if n <= nvme::MAX_SUBMIT_BATCH as u64 => n as u16,
                                n => return Err(option("nvme", k, format!("{n} (0 ..= {})", nvme::MAX_SUBMIT_BATCH))),
                            }
                        }
                        "serial" => c.id.serial = Some(v.clone()),
                        "nqn" => c.id.nqn = Some(v.clone()),
                        "cntlid" => c.id.cntlid = Some(num()?.try_into().unwrap_or(0)),
                        _ => {
                            return Err(option(
                                "nvme",
                                k,
                                "unknown option (doorbell, backend, create, size_mb, lba, pollers, forecast, \
                                 in_place, submit_batch, serial, nqn, cntlid)",
                            ))
                        }
                    }
                }
                c.validate()?;
                Ok(DeviceConfig::Nvme(c))
            }
            "virtio-blk" => crate::virtio::parse_blk(&opts).map(DeviceConfig::VirtioBlk),
            _ => Err(Error::UnknownDevice(name.to_string())),
        }
    }
}

impl fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name())?;
        if let DeviceConfig::Nvme(c) = self {
            // Paths may hold the separators: escaped, unlike StorageKind's own Display.
            let backend = escape(&c.backend.to_string());
            write!(f, ",doorbell={},backend={backend},size_mb={},lba={}", c.doorbell, c.size >> 20, c.lba_size)?;
            if c.create {
                write!(f, ",create=on")?;
            }
            if c.pollers != 1 {
                write!(f, ",pollers={}", c.pollers)?;
            }
            if !c.forecast {
                write!(f, ",forecast=off")?;
            }
            if c.in_place != nvme::InPlace::Auto {
                write!(f, ",in_place={}", c.in_place)?;
            }
            if c.submit_batch != 0 {
                write!(f, ",submit_batch={}", c.submit_batch)?;
            }
            if let Some(s) = &c.id.serial {
                write!(f, ",serial={}", escape(s))?;
            }
            if let Some(n) = &c.id.nqn {
                write!(f, ",nqn={}", escape(n))?;
            }
            if let Some(id) = c.id.cntlid {
                write!(f, ",cntlid={id}")?;
            }
        }
        if let DeviceConfig::VirtioBlk(c) = self {
            write!(f, ",backend={},size_mb={},notify={}", escape(&c.backend.to_string()), c.size >> 20, c.notify)?;
            if let Some(n) = c.queues {
                write!(f, ",queues={n}")?;
            }
            if c.create {
                write!(f, ",create=on")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_round_trip_through_their_text() {
        for s in [
            "pci-testdev",
            "iopath-doorbell",
            "nvme,doorbell=bar,backend=null,size_mb=64,lba=4096",
            "nvme,doorbell=shm,backend=file:/tmp/a,,b@@c.img,size_mb=8,lba=512",
            "nvme,doorbell=shm,backend=ram,size_mb=8,lba=512,pollers=2",
            "nvme,doorbell=adaptive,backend=null,size_mb=8,lba=512,forecast=off",
            "nvme,doorbell=adaptive,backend=file:/tmp/x.img,size_mb=8,lba=512,in_place=on",
            "nvme,doorbell=ioeventfd,backend=file:/tmp/x.img,size_mb=8,lba=4096,in_place=off",
            "nvme,doorbell=adaptive,backend=file:/tmp/x.img,size_mb=8,lba=512,submit_batch=1",
            "nvme,doorbell=shm,backend=file:/tmp/a,,b.img,size_mb=8,lba=4096,create=on,in_place=off",
            "nvme,doorbell=adaptive,backend=ram,size_mb=8,lba=512,serial=SN 1,,2@@3",
            "nvme,doorbell=adaptive,backend=ram,size_mb=8,lba=512,nqn=nqn.2014-08.com.example:a@@b,,c,cntlid=65519",
            "virtio-blk,backend=null,size_mb=64,notify=ioeventfd",
            "virtio-blk,backend=ram,size_mb=1,notify=poll",
            "virtio-blk,backend=file:/tmp/v,,b@@c.img,size_mb=8,notify=exit",
            "virtio-blk,backend=ram,size_mb=8,notify=exit",
            "virtio-blk,backend=ram,size_mb=8,notify=poll,queues=2",
            "virtio-blk,backend=null,size_mb=8,notify=ioeventfd,queues=1",
            "virtio-blk,backend=null,size_mb=8,notify=exit,queues=16",
            "virtio-blk,backend=file:/tmp/v@@.img,size_mb=8,notify=poll,queues=2,create=on",
        ] {
            let c: DeviceConfig = s.parse().unwrap();
            assert_eq!(c.to_string(), s);
            assert_eq!(c.to_string().parse::<DeviceConfig>().unwrap(), c);
        }
        // queues= given or not stays so: None is each host's own default.
        let c: DeviceConfig = "virtio-blk,backend=null".parse().unwrap();
        assert!(matches!(c, DeviceConfig::VirtioBlk(VirtioBlkConfig { queues: None, .. })), "{c:?}");
        let c: DeviceConfig = "virtio-blk,queues=1".parse().unwrap();
        assert!(matches!(c, DeviceConfig::VirtioBlk(VirtioBlkConfig { queues: Some(1), .. })), "{c:?}");
        let c: DeviceConfig = "nvme,backend=file:/tmp/a,,b@@c.img".parse().unwrap();
        let DeviceConfig::Nvme(n) = c else { panic!() };
        assert_eq!(n.backend, StorageKind::File("/tmp/a,b@c.img".into()));
        // create: off unless asked (and then off is not written).
        for (s, create) in [("file:/x", false), ("file:/x,create=off", false), ("file:/x,create=on", true)] {
            let n: DeviceConfig = format!("nvme,backend={s}").parse().unwrap();
            let v: DeviceConfig = format!("virtio-blk,backend={s}").parse().unwrap();
            assert!(matches!(&n, DeviceConfig::Nvme(c) if c.create == create), "{n:?}");
            assert!(matches!(&v, DeviceConfig::VirtioBlk(c) if c.create == create), "{v:?}");
            assert_eq!(n.to_string().contains("create"), create, "{n}");
            assert_eq!(v.to_string().contains("create"), create, "{v}");
        }
    }

    #[test]
    fn bad_options_are_named() {
        let e = |s: &str| s.parse::<DeviceConfig>().unwrap_err().to_string();
        assert!(e("nvme,doorbell=shmm").contains("doorbell"), "{}", e("nvme,doorbell=shmm"));
        assert!(e("nvme,lba=4097").contains("lba"));
        assert!(e("nvme,lba=4294967808").contains("lba"), "no silent truncation");
        assert!(e("nvme,size_mb=0").contains("size_mb"));
        for bad in ["pollers=0", "pollers=17", "pollers=x", "doorbell=mmio,pollers=2", "backend=file:/x,pollers=2"] {
            assert!(e(&format!("nvme,doorbell=shm,{bad}")).contains("pollers"), "{bad}: {}", e(&format!("nvme,{bad}")));
        }
        for bad in ["doorbell=shm,forecast=off", "forecast=maybe"] {
            assert!(e(&format!("nvme,{bad}")).contains("forecast"), "{bad}: {}", e(&format!("nvme,{bad}")));
        }
        for bad in ["submit_batch=1", "backend=file:/x,submit_batch=257", "backend=file:/x,submit_batch=x"] {
            assert!(e(&format!("nvme,{bad}")).contains("submit_batch"), "{bad}: {}", e(&format!("nvme,{bad}")));
        }
        for bad in ["create=on", "backend=ram,create=on", "backend=file:/x,create=1", "backend=file:/x,create=yes"] {
            for dev in ["nvme", "virtio-blk"] {
                let msg = e(&format!("{dev},{bad}"));
                assert!(msg.starts_with(&format!("{dev}: create: ")), "{bad}: {msg}");
            }
        }
        for bad in ["in_place=on", "backend=file:/x,in_place=yes"] {
            assert!(e(&format!("nvme,{bad}")).contains("in_place"), "{bad}: {}", e(&format!("nvme,{bad}")));
        }
        for bad in ["serial=", "serial=123456789012345678901", "nqn=iqn.x", "cntlid=0", "cntlid=65520", "cntlid=70000"]
        {
            let key = bad.split('=').next().unwrap();
            assert!(e(&format!("nvme,{bad}")).contains(key), "{bad}: {}", e(&format!("nvme,{bad}")));
        }
        assert!(e("nvme,colour=blue").contains("colour"));
        assert!(e("nvme,doorbell").contains("KEY=VALUE"));
        assert!(e("pci-testdev,x=1").contains("no options"));
        assert!(e("nvme9").contains("unknown device"));
        for bad in [
            "notify=spin",
            "backend=disk",
            "size_mb=0",
            "size_mb=9999999",
            "lba=512",
            "queues=0",
            "queues=17",
            "queues=x",
        ] {
            assert!(e(&format!("virtio-blk,{bad}")).contains(bad.split('=').next().unwrap()), "{bad}");
        }
    }

    #[test]
    fn escaped_separators() {
        assert_eq!(split_escaped("a,b,,c@@d,e", ','), ["a", "b,c@d", "e"]);
        assert_eq!(find_unescaped_at("nvme,backend=file:/x@@y@vfio-user"), Some(23));
        assert_eq!(find_unescaped_at("a,,@b"), Some(3));
        assert_eq!(find_unescaped_at("a@@b"), None);
    }
}
