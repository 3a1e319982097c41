//! The controller's namespaces as configured: namespace 1 from the
//! top-level options (`backend=`, `size_mb=`, `lba=`, `create=`, as before
//! there were several), `namespaces=N` clones it into namespaces 1..=N, and
//! each `ns=SPEC` adds one after those, in order of appearance.
//!
//! A SPEC is the namespace's own options in the device-option syntax with
//! `;` between them (`ns=backend=ram;size_mb=16;lba=4096`); several
//! namespaces may share one `ns=` value, separated by `+` (that is how
//! `Display` writes them all back). A `;` or `+` inside a value is written
//! twice. At most [`MAX_NAMESPACES`] in all.
//!
//! `iopath serve nvme --namespace SPEC` (repeatable) takes each namespace
//! in the device-option syntax instead (`,` between its keys):
//! [`NvmeConfig::with_namespaces`](super::NvmeConfig::with_namespaces).

use crate::block::StorageKind;
use crate::options::num;
use crate::{Error, Result};

/// Namespaces a controller may have (Identify Controller NN).
pub const MAX_NAMESPACES: u32 = 32;

/// One namespace's options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsConfig {
    pub backend: StorageKind,
    /// Size in bytes.
    pub size: u64,
    /// 512 or 4096.
    pub lba_size: u32,
    /// `file:PATH`: make a missing file (`crate::backing`).
    pub create: bool,
    /// `ms=`, `ext=`, `pi=`: metadata and protection information (`meta.rs`).
    pub meta: NsMeta,
    /// `timing=`: this namespace's own device timing model (None: the
    /// controller's `timing=`, if any).
    pub timing: Option<Box<crate::block::timing::TimingSpec>>,
}

/// A namespace's metadata format: `ms=0|8|16|64` bytes per block,
/// `ext=on` (extended LBAs: inline after each block's data) or off (a
/// separate buffer, MPTR), `pi=0|1` (protection information type 1 in the
/// metadata's last 8 bytes; Format NVM may put it in the first, PIL).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NsMeta {
    pub ms: u16,
    pub ext: bool,
    pub pi: u8,
    /// PI in the first 8 bytes of the metadata (Format NVM's PIL; DPS bit 3).
    pub pi_first: bool,
}

impl NsMeta {
    /// Bytes a namespace of `size` data bytes keeps after them for
    /// metadata: an eighth (64 bytes per 512-byte block, the most any
    /// format takes) where it has metadata, or may be formatted to (`null`
    /// and `ram` always: the memory is taken only when written); none for
    /// a file without `ms=` (its file holds the data only, as before).
    pub fn area(&self, backend: &StorageKind, size: u64) -> u64 {
        if self.ms == 0 && matches!(backend, StorageKind::File(_)) {
            0
        } else {
            size / 8
        }
    }

    /// Checks ms 0/8/16/64, pi 0/1 (with ms >= 8), pil=first with pi, ext with ms.
    pub fn validate(&self, what: &str) -> Result<()> {
        if !matches!(self.ms, 0 | 8 | 16 | 64) {
            return Err(bad(format!("{what}: ms={} (0, 8, 16 or 64)", self.ms)));
        }
        if self.pi > 1 {
            return Err(bad(format!("{what}: pi={} (0 or 1: protection information type 1)", self.pi)));
        }
        if self.pi == 1 && self.ms < 8 {
            return Err(bad(format!("{what}: pi=1 needs ms=8, 16 or 64")));
        }
        if self.pi_first && self.pi == 0 {
            return Err(bad(format!("{what}: pil=first needs pi=1")));
        }
        if self.ext && self.ms == 0 {
            return Err(bad(format!("{what}: ext=on needs ms=8, 16 or 64")));
        }
        Ok(())
    }

    /// Sets key `k` (ms, ext, pi, pil); false if `k` is none of them.
    pub fn set(&mut self, k: &str, v: &str) -> std::result::Result<bool, crate::options::Reason> {
        match k {
            "ms" => self.ms = num(v)?.try_into().unwrap_or(u16::MAX),
            "ext" => self.ext = crate::options::on_off(v)?,
            "pi" => self.pi = num(v)?.try_into().unwrap_or(u8::MAX),
            "pil" => {
                self.pi_first = match v {
                    "first" => true,
                    "last" => false,
                    _ => return Err(format!("{v:?} (first or last)").into()),
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// `;ms=..` (`;ext=on`, `;pi=1`, `;pil=first`) as a SPEC writes them; empty for none.
    pub fn spec(&self) -> String {
        let mut s = String::new();
        if self.ms != 0 {
            s.push_str(&format!(";ms={}", self.ms));
        }
        if self.ext {
            s.push_str(";ext=on");
        }
        if self.pi != 0 {
            s.push_str(&format!(";pi={}", self.pi));
        }
        if self.pi_first {
            s.push_str(";pil=first");
        }
        s
    }
}

impl Default for NsConfig {
    fn default() -> Self {
        NsConfig {
            backend: StorageKind::Ram,
            size: 64 << 20,
            lba_size: 512,
            create: false,
            meta: NsMeta::default(),
            timing: None,
        }
    }
}

fn bad(reason: String) -> Error {
    Error::Option { device: "nvme", option: "ns".into(), reason }
}

/// Splits at every `sep` that is not doubled; a doubled one is kept single.
fn split(s: &str, sep: char) -> Vec<String> {
    crate::spec::split_doubled(s, sep, &[sep])
}

impl NsConfig {
    /// One SPEC: `KEY=VALUE` pairs separated by `;` (keys `backend`,
    /// `size_mb`, `lba`, `create`), each over the defaults.
    pub fn parse_spec(spec: &str) -> Result<NsConfig> {
        NsConfig::parse_pairs(split(spec, ';'))
    }

    /// One namespace in the device-option syntax (`iopath serve nvme
    /// --namespace backend=ram,size_mb=16,lba=4096`): `,` between its keys,
    /// a `,` inside a value written twice. A spec with no `,` but a `;`
    /// is taken as a SPEC ([`parse_spec`](Self::parse_spec): `--namespace
    /// backend=ram;size_mb=64;lba=512;ms=8;pi=1` works too).
    pub fn parse_options(spec: &str) -> Result<NsConfig> {
        let pairs = split(spec, ',');
        if pairs.len() == 1 && spec.contains(';') {
            return NsConfig::parse_spec(spec);
        }
        NsConfig::parse_pairs(pairs)
    }

    fn parse_pairs(pairs: Vec<String>) -> Result<NsConfig> {
        let mut c = NsConfig::default();
        for kv in pairs {
            let Some((k, v)) = kv.split_once('=') else {
                return Err(bad(format!(
                    "{kv:?} is not KEY=VALUE (backend, size_mb, lba, create, ms, ext, pi, timing)"
                )));
            };
            let r = |e: crate::options::Reason| bad(format!("{k}: {}", e.0));
            if c.meta.set(k, v).map_err(r)? {
                continue;
            }
            match k {
                "backend" => c.backend = v.parse().map_err(|e: Error| r(e.into()))?,
                "size_mb" => match num(v).map_err(r)? {
                    mb if mb == 0 || mb > 1 << 20 => return Err(bad(format!("size_mb: {mb} MiB (1 .. 1048576)"))),
                    mb => c.size = mb << 20,
                },
                "lba" => {
                    c.lba_size = match num(v).map_err(r)? {
                        512 => 512,
                        4096 => 4096,
                        n => return Err(bad(format!("lba: {n} (512 or 4096)"))),
                    }
                }
                "create" => c.create = crate::options::on_off(v).map_err(r)?,
                "timing" => {
                    c.timing = Some(Box::new(
                        v.parse().map_err(|e: crate::block::timing::TimingError| bad(format!("timing: {e}")))?,
                    ))
                }
                _ => return Err(bad(format!("unknown key {k:?} (backend, size_mb, lba, create, timing)"))),
            }
        }
        Ok(c)
    }

    /// The SPEC [`parse_spec`](Self::parse_spec) takes back (`;` and `+`
    /// in values doubled).
    pub fn spec(&self) -> String {
        let esc = |v: String| v.replace(';', ";;").replace('+', "++");
        let mut s =
            format!("backend={};size_mb={};lba={}", esc(self.backend.to_string()), self.size >> 20, self.lba_size);
        if self.create {
            s.push_str(";create=on");
        }
        s.push_str(&self.meta.spec());
        if let Some(t) = &self.timing {
            s.push_str(&format!(";timing={}", esc(t.to_string())));
        }
        s
    }

    /// Every SPEC of an `ns=` value (`+` between namespaces).
    pub fn parse_list(v: &str) -> Result<Vec<NsConfig>> {
        split(v, '+').iter().map(|s| NsConfig::parse_spec(s)).collect()
    }

    /// An `ns=` value for `list` (None: empty).
    pub fn write_list(list: &[NsConfig]) -> Option<String> {
        if list.is_empty() {
            return None;
        }
        // `+` inside a spec is doubled already; the separator is single.
        Some(list.iter().map(|n| n.spec()).collect::<Vec<_>>().join("+"))
    }

    /// Its geometry: LBA size 512 or 4096, the size a non-zero multiple of
    /// it; create=on only with a file.
    pub fn validate(&self, what: &str) -> Result<()> {
        if self.lba_size != 512 && self.lba_size != 4096 {
            return Err(bad(format!("{what}: LBA size {} (512 or 4096)", self.lba_size)));
        }
        if self.size < self.lba_size as u64 || !self.size.is_multiple_of(self.lba_size as u64) {
            return Err(bad(format!("{what}: size {} is not a multiple of the LBA size", self.size)));
        }
        if self.create && !matches!(self.backend, StorageKind::File(_)) {
            return Err(bad(format!("{what}: create=on needs backend=file:PATH")));
        }
        self.meta.validate(what)
    }
}

impl super::NvmeConfig {
    /// The controller with exactly `specs` as its namespaces, in order
    /// (`--namespace`, [`NsConfig::parse_options`]): the first is namespace
    /// 1 (its backend=, size_mb=, lba=, create= replace the device
    /// options'), the others follow; checked as a whole. No specs: as it is.
    pub fn with_namespaces(mut self, specs: &[String]) -> Result<super::NvmeConfig> {
        let Some((first, rest)) = specs.split_first() else { return Ok(self) };
        if self.namespaces != 1 || !self.ns.is_empty() {
            return Err(bad("--namespace gives every namespace: not with namespaces= or ns=".into()));
        }
        let n1 = NsConfig::parse_options(first)?;
        if n1.timing.is_some() {
            // Namespace 1 is the device options' own: its model is the controller's.
            return Err(bad("--namespace: namespace 1's timing model is the device option timing= \
                 (the default of every namespace without a timing= of its own)"
                .into()));
        }
        (self.backend, self.size, self.lba_size, self.create) = (n1.backend, n1.size, n1.lba_size, n1.create);
        self.meta = n1.meta;
        self.ns = rest.iter().map(|s| NsConfig::parse_options(s)).collect::<Result<_>>()?;
        self.validate()?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_and_bad_ones_are_named() {
        let a = NsConfig {
            backend: StorageKind::File("/tmp/a;b+c.img".into()),
            size: 8 << 20,
            lba_size: 4096,
            create: true,
            meta: NsMeta::default(),
            timing: None,
        };
        let b = NsConfig {
            backend: StorageKind::Null,
            size: 1 << 30,
            lba_size: 512,
            create: false,
            meta: NsMeta::default(),
            timing: Some(Box::new("read:20us+write:ln:20us:90us".parse().unwrap())),
        };
        let v = NsConfig::write_list(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(
            v,
            "backend=file:/tmp/a;;b++c.img;size_mb=8;lba=4096;create=on+\
             backend=null;size_mb=1024;lba=512;timing=read:20us++write:lognormal:20us:90us"
        );
        assert_eq!(NsConfig::parse_list(&v).unwrap(), [a.clone(), b]);
        // The same namespace in the device-option syntax (`--namespace`).
        assert_eq!(NsConfig::parse_options("backend=file:/tmp/a;b+c.img,size_mb=8,lba=4096,create=on").unwrap(), a);
        let c = NsConfig::parse_options("backend=file:/tmp/x,,y.img").unwrap();
        assert_eq!(c.backend, StorageKind::File("/tmp/x,y.img".into()));
        assert_eq!(NsConfig::write_list(&[]), None);
        // Keys left out take the defaults.
        assert_eq!(NsConfig::parse_spec("lba=4096").unwrap(), NsConfig { lba_size: 4096, ..Default::default() });
        for bad in ["lba=1024", "size_mb=0", "backend=disk", "colour=blue", "ram", "create=yes", "timing=read:fast"] {
            let e = NsConfig::parse_spec(bad).unwrap_err().to_string();
            assert!(e.starts_with("nvme: ns: "), "{bad}: {e}");
        }
        let e = NsConfig::parse_spec("backend=ram;create=on").unwrap().validate("namespace 2").unwrap_err();
        assert!(e.to_string().contains("namespace 2: create=on needs"), "{e}");
    }

    #[test]
    fn metadata_keys_round_trip_and_are_checked() {
        let m = NsConfig::parse_options("backend=ram,size_mb=64,lba=512,ms=8,pi=1").unwrap();
        assert_eq!(m.meta, NsMeta { ms: 8, ext: false, pi: 1, pi_first: false });
        m.validate("namespace 1").unwrap();
        let e = NsConfig::parse_spec("lba=4096;ms=16;ext=on").unwrap();
        assert_eq!(e.meta, NsMeta { ms: 16, ext: true, pi: 0, pi_first: false });
        assert_eq!(e.spec(), "backend=ram;size_mb=64;lba=4096;ms=16;ext=on");
        assert_eq!(NsConfig::parse_spec(&m.spec()).unwrap(), m);
        // `--namespace` takes the `;` form as well.
        assert_eq!(NsConfig::parse_options("backend=ram;size_mb=64;lba=512;ms=8;pi=1").unwrap(), m);
        let first = NsConfig::parse_options("ms=16,pi=1,pil=first").unwrap();
        assert_eq!(first.meta, NsMeta { ms: 16, ext: false, pi: 1, pi_first: true });
        assert!(first.spec().ends_with(";ms=16;pi=1;pil=first"), "{}", first.spec());
        assert_eq!(NsConfig::parse_spec(&first.spec()).unwrap(), first);
        assert!(NsConfig::parse_spec("ms=8;pi=1;pil=middle").is_err());
        for bad in ["ms=4", "ms=9", "pi=1", "pi=2;ms=8", "ext=on", "ms=100000", "ms=8;pil=first"] {
            let c = NsConfig::parse_spec(bad).unwrap();
            let e = c.validate("namespace 3").unwrap_err().to_string();
            assert!(e.contains("namespace 3: "), "{bad}: {e}");
        }
        assert!(NsConfig::parse_spec("ms=x").is_err());
        let file = StorageKind::File("/tmp/x".into());
        assert_eq!(NsMeta::default().area(&file, 8 << 20), 0);
        assert_eq!(m.meta.area(&file, 8 << 20), 1 << 20);
        assert_eq!(NsMeta::default().area(&StorageKind::Ram, 8 << 20), 1 << 20);
    }
}
