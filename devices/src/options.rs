//! A device's options as one table ([`Options`]): each key with the values
//! it takes, its help line, how a value sets it in the device's config and
//! how the config writes it back. Parsing a `KEY=VALUE` list, the options
//! part of `DeviceConfig`'s `Display`, the "unknown option (...)" error and
//! the CLI's help all read the table; checks across options (a device's
//! `validate`) run after it. `crate::spec` holds the table of devices.

use crate::block::StorageKind;
use crate::spec::escape;
use crate::{Error, Result};
use std::fmt;

/// Why a value does not fit its key; the table names the device and the
/// key ([`Error::Option`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reason(pub String);

impl From<String> for Reason {
    fn from(s: String) -> Self {
        Reason(s)
    }
}

impl From<&str> for Reason {
    fn from(s: &str) -> Self {
        Reason(s.to_string())
    }
}

/// A value type's own parse error: its reason (the table names device and key).
impl From<Error> for Reason {
    fn from(e: Error) -> Self {
        match e {
            Error::Option { reason, .. } => Reason(reason),
            e => Reason(e.to_string()),
        }
    }
}

/// One option of a device whose config is `C`.
pub struct Opt<C> {
    pub key: &'static str,
    /// The values it takes, as the help writes them (`on|off`, `N`, `file:PATH`).
    pub values: &'static str,
    /// One line: what it does, its range and its default.
    pub help: &'static str,
    /// Sets the option in the config from its value.
    pub parse: fn(&mut C, &str) -> Result<(), Reason>,
    /// The value as `parse` takes it back, or None: the default, not written.
    pub show: fn(&C) -> Option<String>,
}

/// A device's options, in the order `Display` writes them.
pub struct Options<C: 'static> {
    pub device: &'static str,
    pub opts: &'static [Opt<C>],
}

impl<C> Options<C> {
    /// The config from `KEY=VALUE` pairs, each set over `C::default()` in
    /// turn (a key given twice: the last one counts). No checks across options.
    pub fn parse(&self, kvs: &[(String, String)]) -> Result<C>
    where
        C: Default,
    {
        let mut c = C::default();
        for (k, v) in kvs {
            let opt = self.opts.iter().find(|o| o.key == k).ok_or_else(|| self.unknown(k))?;
            (opt.parse)(&mut c, v).map_err(|r| self.error(k, r))?;
        }
        Ok(c)
    }

    /// `,KEY=VALUE` for each option that is not at its default, in table
    /// order, with `,` and `@` in values doubled.
    pub fn write(&self, c: &C, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for o in self.opts {
            if let Some(v) = (o.show)(c) {
                write!(f, ",{}={}", o.key, escape(&v))?;
            }
        }
        Ok(())
    }

    /// An [`Error::Option`] of this device.
    pub fn error(&self, key: &str, reason: impl Into<Reason>) -> Error {
        Error::Option { device: self.device, option: key.to_string(), reason: reason.into().0 }
    }

    fn unknown(&self, key: &str) -> Error {
        let keys: Vec<&str> = self.opts.iter().map(|o| o.key).collect();
        self.error(key, format!("unknown option ({})", keys.join(", ")))
    }
}

/// One option as the help shows it.
#[derive(Clone, Copy, Debug)]
pub struct Doc {
    pub key: &'static str,
    pub values: &'static str,
    pub help: &'static str,
}

/// What the help needs of an options table, whatever config it fills.
pub trait Docs: Sync {
    fn docs(&self) -> Vec<Doc>;
}

impl<C> Docs for Options<C> {
    fn docs(&self) -> Vec<Doc> {
        self.opts.iter().map(|o| Doc { key: o.key, values: o.values, help: o.help }).collect()
    }
}

/// A switch's value: `on` or `off`.
pub fn on_off(v: &str) -> Result<bool, Reason> {
    match v {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{v:?} (on or off)").into()),
    }
}

/// A decimal number.
pub fn num(v: &str) -> Result<u64, Reason> {
    v.parse().map_err(|_| format!("{v:?} is not a number").into())
}

/// `on` for a switch that is on; None (not written) when off, its default.
pub fn on_if(on: bool) -> Option<String> {
    on.then(|| "on".to_string())
}

/// A block device's config, as the options every block device shares
/// ([`backend`], [`create`]) set and show it.
pub trait BlockConfig {
    fn backend(&self) -> &StorageKind;
    fn backend_mut(&mut self) -> &mut StorageKind;
    fn create(&self) -> bool;
    fn create_mut(&mut self) -> &mut bool;
}

/// `impl BlockConfig` for a config struct with `backend: StorageKind` and `create: bool` fields.
#[macro_export]
macro_rules! block_config {
    ($t:ty) => {
        impl $crate::options::BlockConfig for $t {
            fn backend(&self) -> &$crate::block::StorageKind {
                &self.backend
            }
            fn backend_mut(&mut self) -> &mut $crate::block::StorageKind {
                &mut self.backend
            }
            fn create(&self) -> bool {
                self.create
            }
            fn create_mut(&mut self) -> &mut bool {
                &mut self.create
            }
        }
    };
}

/// `backend=null|ram|file:PATH`, the same entry in every block device's table.
pub const fn backend<C: BlockConfig>() -> Opt<C> {
    Opt {
        key: "backend",
        values: "null|ram|file:PATH",
        help: "where the data is kept (default ram); file:PATH: an existing file or block device \
               that holds size_mb, used as it is (never truncated or extended); a missing PATH is an \
               error unless create=on",
        parse: parse_backend::<C>,
        show: show_backend::<C>,
    }
}

/// `create=on|off`, the same entry in every block device's table.
pub const fn create<C: BlockConfig>() -> Opt<C> {
    Opt {
        key: "create",
        values: "on|off",
        help: "file:PATH only: make a missing PATH and write all its bytes (synced) before it is served \
               (default off)",
        parse: parse_create::<C>,
        show: show_create::<C>,
    }
}

fn parse_backend<C: BlockConfig>(c: &mut C, v: &str) -> Result<(), Reason> {
    *c.backend_mut() = v.parse()?;
    Ok(())
}

fn show_backend<C: BlockConfig>(c: &C) -> Option<String> {
    Some(c.backend().to_string())
}

fn parse_create<C: BlockConfig>(c: &mut C, v: &str) -> Result<(), Reason> {
    *c.create_mut() = on_off(v)?;
    Ok(())
}

fn show_create<C: BlockConfig>(c: &C) -> Option<String> {
    on_if(c.create())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every key of `t` takes back what its `show` printed for `c` (each
    /// key alone over the default config), and prints it again the same.
    pub(crate) fn keys_round_trip<C: Default>(t: &Options<C>, c: &C) {
        for o in t.opts {
            let v = (o.show)(c).unwrap_or_else(|| panic!("{}: {} is at its default in the sample", t.device, o.key));
            let mut d = C::default();
            (o.parse)(&mut d, &v).unwrap_or_else(|r| panic!("{}: {}={v}: {r:?}", t.device, o.key));
            assert_eq!((o.show)(&d).as_deref(), Some(v.as_str()), "{}: {}", t.device, o.key);
        }
    }

    #[test]
    fn switches_and_numbers() {
        assert_eq!(on_off("on"), Ok(true));
        assert_eq!(on_off("off"), Ok(false));
        assert_eq!(on_off("1"), Err(Reason("\"1\" (on or off)".into())));
        assert_eq!(num("12"), Ok(12));
        assert_eq!(num("-1"), Err(Reason("\"-1\" is not a number".into())));
        assert_eq!(on_if(true).as_deref(), Some("on"));
        assert_eq!(on_if(false), None);
    }

    #[test]
    fn the_block_entries_are_the_same_in_both_tables() {
        let v = crate::virtio::options::BLK_OPTIONS.docs();
        let n = crate::nvme::options::OPTIONS.docs();
        for key in ["backend", "create"] {
            let (a, b) = (v.iter().find(|d| d.key == key).unwrap(), n.iter().find(|d| d.key == key).unwrap());
            assert_eq!((a.values, a.help), (b.values, b.help), "{key}");
        }
        let backend = v.iter().find(|d| d.key == "backend").unwrap().help;
        assert_eq!(
            backend,
            "where the data is kept (default ram); file:PATH: an existing file or block device that holds size_mb, \
             used as it is (never truncated or extended); a missing PATH is an error unless create=on"
        );
        let create = v.iter().find(|d| d.key == "create").unwrap().help;
        assert_eq!(
            create,
            "file:PATH only: make a missing PATH and write all its bytes (synced) before it is served (default off)"
        );
    }
}
