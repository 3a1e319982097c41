//! A device model and its options as one typed value: `NAME[,KEY=VALUE...]`.
//!
//! [`DeviceConfig`] is parsed and validated once, where the user typed it
//! (the CLI, a bench), before any process starts; its [`Display`](fmt::Display)
//! form round-trips, so the same value becomes a device process's argv. A
//! value that holds `,` writes it `,,` (QEMU's option escaping), and `@`
//! (which separates a device from its transport in a device spec) `@@`:
//! `nvme,backend=file:/data/a,,b@@c.img` names the file `/data/a,b@c.img`.
//!
//! [`DEVICES`] is the table of devices: each name with its summary and its
//! options table (`crate::options`); parsing, `Display`, [`DEVICE_NAMES`]
//! and the CLI's [`help`] come from it.

use crate::nvme::{self, NvmeConfig};
use crate::options::Docs;
use crate::virtio::options::BLK_OPTIONS;
use crate::virtio::pci::{VirtioBlk, VirtioBlkConfig};
use crate::{doorbell, testdev, Error, Result, SharedDevice};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

/// A device model as `iopath serve` and `--device` name it.
pub struct Device {
    pub name: &'static str,
    /// What it is, for the help.
    pub summary: &'static str,
    /// Its options, or None: it takes none.
    pub options: Option<&'static dyn Docs>,
    /// The config from its `KEY=VALUE` pairs: its table's parse, then the
    /// checks across options.
    parse: fn(&[(String, String)]) -> Result<DeviceConfig>,
}

const PCI_TESTDEV: Device = Device {
    name: "pci-testdev",
    summary: "QEMU's pci-testdev (1b36:0005)",
    options: None,
    parse: |_| Ok(DeviceConfig::PciTestDev),
};

const DOORBELL: Device = Device {
    name: "iopath-doorbell",
    summary: "iopath's doorbell round-trip device",
    options: None,
    parse: |_| Ok(DeviceConfig::Doorbell),
};

const NVME: Device = Device {
    name: "nvme",
    summary: "the NVMe controller",
    options: Some(&nvme::options::OPTIONS),
    parse: |kvs| {
        let c = nvme::options::OPTIONS.parse(kvs)?;
        c.validate()?;
        Ok(DeviceConfig::Nvme(c))
    },
};

const VIRTIO_BLK: Device = Device {
    name: "virtio-blk",
    summary: "virtio-blk on the modern PCI transport",
    options: Some(&BLK_OPTIONS),
    parse: |kvs| {
        let c = BLK_OPTIONS.parse(kvs)?;
        c.validate()?;
        Ok(DeviceConfig::VirtioBlk(c))
    },
};

/// Device models, in the order the help lists them.
pub const DEVICES: &[Device] = &[PCI_TESTDEV, DOORBELL, NVME, VIRTIO_BLK];

/// Device models by name, as `iopath serve` and `--device` name them.
pub const DEVICE_NAMES: &[&str] = &{
    let mut names = [""; DEVICES.len()];
    let mut i = 0;
    while i < DEVICES.len() {
        names[i] = DEVICES[i].name;
        i += 1;
    }
    names
};

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
    /// Its entry in [`DEVICES`].
    pub fn device(&self) -> &'static Device {
        match self {
            DeviceConfig::PciTestDev => &PCI_TESTDEV,
            DeviceConfig::Doorbell => &DOORBELL,
            DeviceConfig::Nvme(_) => &NVME,
            DeviceConfig::VirtioBlk(_) => &VIRTIO_BLK,
        }
    }

    pub fn name(&self) -> &'static str {
        self.device().name
    }

    /// Checks the `file:PATH` backend this device stands on, and with
    /// `create=on` makes a missing one (`crate::backing`), before the
    /// device is built here or in a device process.
    pub fn prepare_backing(&self) -> Result<crate::backing::Prepared> {
        let (backend, bytes, create) = match self {
            DeviceConfig::Nvme(c) => {
                // Every namespace's file; what was made, added up.
                let mut made = 0;
                for n in c.ns_list() {
                    if let crate::backing::Prepared::Created { bytes } =
                        crate::backing::prepare(&n.backend, n.size, n.create)?
                    {
                        made += bytes;
                    }
                }
                return Ok(if made > 0 {
                    crate::backing::Prepared::Created { bytes: made }
                } else {
                    crate::backing::Prepared::AsIs
                });
            }
            DeviceConfig::VirtioBlk(c) => (&c.backend, c.size, c.create),
            _ => return Ok(crate::backing::Prepared::AsIs),
        };
        Ok(crate::backing::prepare(backend, bytes, create)?)
    }

    /// This device with its queue count settled: virtio-blk's `queues=N`
    /// if given, else `default` (the host's choice: iopath's VMM one per
    /// vCPU, a device process [`MAX_QUEUES`](crate::virtio::transport::MAX_QUEUES));
    /// other devices as they are.
    pub fn with_default_queues(&self, default: u16) -> DeviceConfig {
        match self {
            DeviceConfig::VirtioBlk(c) => {
                DeviceConfig::VirtioBlk(VirtioBlkConfig { queues: Some(c.queues.unwrap_or(default)), ..c.clone() })
            }
            d => d.clone(),
        }
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
    split_doubled(s, sep, &[sep, '@', ','])
}

/// Splits at every `sep` that is not doubled; a doubled character of
/// `doubled` (which holds `sep`) is kept single.
pub fn split_doubled(s: &str, sep: char, doubled: &[char]) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if doubled.contains(&c) && it.peek() == Some(&c) {
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
        let device = DEVICES.iter().find(|d| d.name == name).ok_or_else(|| Error::UnknownDevice(name.to_string()))?;
        if let (None, Some((k, _))) = (device.options, opts.first()) {
            let reason = "this device takes no options".into();
            return Err(Error::Option { device: device.name, option: k.clone(), reason });
        }
        (device.parse)(&opts)
    }
}

impl fmt::Display for DeviceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())?;
        match self {
            DeviceConfig::PciTestDev | DeviceConfig::Doorbell => Ok(()),
            DeviceConfig::Nvme(c) => nvme::options::OPTIONS.write(c, f),
            DeviceConfig::VirtioBlk(c) => BLK_OPTIONS.write(c, f),
        }
    }
}

/// Every device with its options, for the CLI's help: a line for each
/// device (`NAME[,KEY=VALUES]...: summary`), one for each of its options
/// (`  KEY: help`).
pub fn help() -> String {
    let mut out = String::new();
    for d in DEVICES {
        let docs = d.options.map(|o| o.docs()).unwrap_or_default();
        out.push_str(d.name);
        for o in &docs {
            out.push_str(&format!("[,{}={}]", o.key, o.values));
        }
        out.push_str(&format!(": {}", d.summary));
        if docs.is_empty() {
            out.push_str(", no options");
        }
        out.push('\n');
        for o in &docs {
            out.push_str(&format!("  {}: {}\n", o.key, o.help));
        }
    }
    out.push_str("A `,` or `@` inside a value is written twice.");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::StorageKind;

    #[test]
    fn a_default_queue_count_fills_only_a_virtio_blk_without_queues() {
        let q = |s: &str, n| match s.parse::<DeviceConfig>().unwrap().with_default_queues(n) {
            DeviceConfig::VirtioBlk(c) => c.queues,
            d => panic!("{d}"),
        };
        assert_eq!(q("virtio-blk", 16), Some(16));
        assert_eq!(q("virtio-blk,queues=2", 16), Some(2));
        assert_eq!(q("virtio-blk,queues=16", 1), Some(16));
        // Written back, the count a device process is started with is explicit.
        let d = "virtio-blk,backend=null".parse::<DeviceConfig>().unwrap().with_default_queues(1);
        assert_eq!(d.to_string(), "virtio-blk,backend=null,size_mb=64,notify=exit,queues=1");
        for s in ["pci-testdev", "nvme,backend=null"] {
            let d = s.parse::<DeviceConfig>().unwrap();
            assert_eq!(d.with_default_queues(16), d, "{s}");
        }
    }

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
            "nvme,doorbell=auto,backend=ram,size_mb=64,lba=512,namespaces=4",
            "nvme,doorbell=auto,backend=file:/tmp/a.img,size_mb=8,lba=512,ns=backend=ram;size_mb=16;lba=4096+backend=file:/tmp/b,,;;c.img;size_mb=8;lba=512;create=on",
            "nvme,doorbell=auto,backend=null,size_mb=8,lba=4096,namespaces=2,ns=backend=null;size_mb=1024;lba=512",
            "virtio-blk,backend=null,size_mb=64,notify=ioeventfd",
            "virtio-blk,backend=ram,size_mb=1,notify=poll",
            "virtio-blk,backend=file:/tmp/v,,b@@c.img,size_mb=8,notify=exit",
            "virtio-blk,backend=ram,size_mb=8,notify=exit",
            "virtio-blk,backend=ram,size_mb=8,notify=poll,queues=2",
            "virtio-blk,backend=null,size_mb=8,notify=ioeventfd,queues=1",
            "virtio-blk,backend=null,size_mb=8,notify=exit,queues=16",
            "virtio-blk,backend=file:/tmp/v@@.img,size_mb=8,notify=poll,queues=2,create=on",
            "virtio-blk,backend=file:/tmp/v.img,size_mb=8,notify=exit,direct=off",
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
            "direct=off",
            "backend=ram,direct=off",
            "direct=0,backend=file:/x",
        ] {
            assert!(e(&format!("virtio-blk,{bad}")).contains(bad.split('=').next().unwrap()), "{bad}");
        }
    }

    #[test]
    fn the_tables_name_every_device_and_key() {
        assert_eq!(DEVICE_NAMES, ["pci-testdev", "iopath-doorbell", "nvme", "virtio-blk"]);
        let h = help();
        for d in DEVICES {
            // Each device parses by its name alone, to a config of that name...
            let c: DeviceConfig = d.name.parse().unwrap();
            assert_eq!(c.name(), d.name);
            assert!(h.contains(&format!("{}: {}", d.name, d.summary)) || h.contains(&format!("]: {}", d.summary)));
            // ...the help lists each of its keys with its values and its help line,
            // and the parser names them all when it meets one it does not know.
            let unknown = format!("{},zz=1", d.name).parse::<DeviceConfig>().unwrap_err().to_string();
            let docs = d.options.map(|o| o.docs()).unwrap_or_default();
            for o in &docs {
                assert!(h.contains(&format!("[,{}={}]", o.key, o.values)), "{}: {}", d.name, o.key);
                assert!(h.contains(&format!("\n  {}: {}\n", o.key, o.help)), "{}: {}", d.name, o.key);
            }
            let keys: Vec<&str> = docs.iter().map(|o| o.key).collect();
            match keys.is_empty() {
                true => assert!(unknown.ends_with("zz: this device takes no options"), "{unknown}"),
                false => assert!(unknown.ends_with(&format!("zz: unknown option ({})", keys.join(", "))), "{unknown}"),
            }
        }
        assert!(e_unknown().ends_with("(one of pci-testdev, iopath-doorbell, nvme, virtio-blk)"), "{}", e_unknown());
    }

    fn e_unknown() -> String {
        "nvme9".parse::<DeviceConfig>().unwrap_err().to_string()
    }

    #[test]
    fn escaped_separators() {
        assert_eq!(split_escaped("a,b,,c@@d,e", ','), ["a", "b,c@d", "e"]);
        assert_eq!(find_unescaped_at("nvme,backend=file:/x@@y@vfio-user"), Some(23));
        assert_eq!(find_unescaped_at("a,,@b"), Some(3));
        assert_eq!(find_unescaped_at("a@@b"), None);
    }
}
