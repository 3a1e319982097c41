//! virtio-blk's options (`virtio-blk,KEY=VALUE,...`) as one table: what
//! each key takes, its help line, how it sets [`VirtioBlkConfig`] and how
//! it is written back (`crate::options`); then
//! [`VirtioBlkConfig::validate`], the check across options.

use super::blk_emu::check_rule;
use super::pci::NotifyMode;
use super::pci::VirtioBlkConfig;
use super::transport::MAX_QUEUES;
use crate::block::inject::{parse_rules, write_rules, Action};
use crate::block::timing::TimingSpec;
use crate::block::StorageKind;
use crate::options::Reason;
use crate::options::{self, Opt, Options};
use crate::Result;

/// `virtio-blk`'s options, in the order its `Display` writes them.
pub const BLK_OPTIONS: Options<VirtioBlkConfig> = Options {
    device: "virtio-blk",
    opts: &[
        options::backend(),
        Opt {
            key: "size_mb",
            values: "N",
            help: "the disk's size in MiB, 1 ..= 1048576 (default 64)",
            parse: |c, v| match v.parse::<u64>() {
                Ok(mb) if (1..=1 << 20).contains(&mb) => {
                    c.size = mb << 20;
                    Ok(())
                }
                _ => Err(format!("{v:?} MiB (1 ..= 1048576)").into()),
            },
            show: |c| Some((c.size >> 20).to_string()),
        },
        Opt {
            key: "notify",
            values: "exit|ioeventfd|poll",
            help: "how queue notifications reach the device: a VMM exit served on the vCPU thread, \
                   an ioeventfd a device thread serves, or a thread that polls (default exit)",
            parse: |c, v| {
                c.notify = v.parse()?;
                Ok(())
            },
            show: |c| Some(c.notify.to_string()),
        },
        Opt {
            key: "queues",
            values: "N",
            help: "request queues, 1 ..= 16 (default: one per vCPU of iopath's VMM, which has 1; \
                   16 in `iopath serve`, of which Linux's driver takes one per CPU)",
            parse: |c, v| match v.parse::<u16>() {
                Ok(n) if (1..=MAX_QUEUES).contains(&n) => {
                    c.queues = Some(n);
                    Ok(())
                }
                _ => Err(format!("{v:?} (1 ..= {MAX_QUEUES})").into()),
            },
            show: |c| c.queues.map(|n| n.to_string()),
        },
        options::create(),
        Opt {
            key: "direct",
            values: "on|off",
            help: "file:PATH only: on: reads and writes bypass the host's page cache (O_DIRECT); off: \
                   they go through it, buffered (default on)",
            parse: |c, v| {
                c.direct = options::on_off(v)?;
                Ok(())
            },
            show: |c| (!c.direct).then(|| "off".to_string()),
        },
        Opt {
            key: "timing",
            values: "SPEC",
            help: "a device timing model: each completion is posted at its due time, e.g. \
                   read:80us+write:lognormal:20us:200us+channels:8+iops:100000 \
                   (devices/src/block/timing; notify=ioeventfd or poll; default none)",
            parse: |c, v| {
                c.timing = Some(Box::new(v.parse::<TimingSpec>().map_err(|e| Reason(e.to_string()))?));
                Ok(())
            },
            show: |c| c.timing.as_ref().map(|t| t.to_string()),
        },
        Opt {
            key: "inject",
            values: "RULES",
            help: "error injection rules joined by +, e.g. op=read/lba=0-7/status=2:0x81/once \
                   (devices/src/block/inject; no event; a delay needs notify=ioeventfd or poll; \
                   devices/src/virtio/blk_emu.rs maps them to virtio-blk; default none)",
            parse: |c, v| {
                let rules = parse_rules(v).map_err(|e| Reason(e.to_string()))?;
                for r in &rules {
                    check_rule(r).map_err(|e| Reason(e.to_string()))?;
                }
                c.inject = rules;
                Ok(())
            },
            show: |c| (!c.inject.is_empty()).then(|| write_rules(&c.inject)),
        },
    ],
};

impl VirtioBlkConfig {
    /// Checks across options: `create=on` and `direct=off` only with
    /// `backend=file:PATH`.
    pub fn validate(&self) -> Result<()> {
        let file = matches!(self.backend, StorageKind::File(_));
        if self.create && !file {
            return Err(BLK_OPTIONS.error("create", "create=on needs backend=file:PATH"));
        }
        if !self.direct && !file {
            return Err(BLK_OPTIONS.error("direct", "direct=off needs backend=file:PATH"));
        }
        // Held completions are posted by the device thread, which notify=exit has none of.
        if self.notify == NotifyMode::Exit {
            if self.timing.is_some() {
                return Err(BLK_OPTIONS.error("timing", "timing= needs notify=ioeventfd or poll"));
            }
            if self.inject.iter().any(|r| matches!(r.action, Action::Delay { .. })) {
                return Err(BLK_OPTIONS.error("inject", "a delay rule needs notify=ioeventfd or poll"));
            }
        }
        Ok(())
    }
}

crate::block_config!(VirtioBlkConfig);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_takes_back_what_it_printed() {
        let c = VirtioBlkConfig {
            backend: StorageKind::File("/tmp/v,b@c.img".into()),
            size: 8 << 20,
            notify: NotifyMode::Poll,
            queues: Some(MAX_QUEUES),
            create: true,
            direct: false,
            timing: Some(Box::new("read:80us+write:lognormal:20us:200us+channels:8+iops:100000".parse().unwrap())),
            inject: parse_rules("op=read/lba=0-7/status=2:0x81/once+op=write/nsid=1/delay=2ms/p=0.5:9").unwrap(),
        };
        crate::options::tests::keys_round_trip(&BLK_OPTIONS, &c);
    }

    #[test]
    fn the_help_states_the_limits() {
        let queues = BLK_OPTIONS.opts.iter().find(|o| o.key == "queues").unwrap();
        assert!(queues.help.contains(&format!("1 ..= {MAX_QUEUES}")));
    }
}
