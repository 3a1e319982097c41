//! The controller's options (`nvme,KEY=VALUE,...`) as one table: what
//! each key takes, its help line, how it sets [`NvmeConfig`] and how it is
//! written back (`crate::options`). Checks across options are
//! [`NvmeConfig::validate`]'s.

use super::namespaces::{NsConfig, MAX_NAMESPACES};
use super::{InPlace, NvmeConfig, MAX_POLLERS, MAX_SUBMIT_BATCH};
use crate::options::{self, num, on_off, Opt, Options};

/// `nvme`'s options, in the order its `Display` writes them.
pub const OPTIONS: Options<NvmeConfig> = Options {
    device: "nvme",
    opts: &[
        Opt {
            key: "doorbell",
            values: "auto|adaptive|bar-adaptive|shm|bar|ioeventfd|mmio",
            help: "how the guest's doorbell writes reach the controller (default auto; README.md lists the modes)",
            parse: |c, v| {
                c.doorbell = v.parse()?;
                Ok(())
            },
            show: |c| Some(c.doorbell.to_string()),
        },
        options::backend(),
        Opt {
            key: "size_mb",
            values: "N",
            help: "the namespace's size in MiB, 1 ..= 1048576 (default 64)",
            parse: |c, v| match num(v)? {
                mb if mb == 0 || mb > 1 << 20 => Err(format!("{mb} MiB (1 .. 1048576)").into()),
                mb => {
                    c.size = mb << 20;
                    Ok(())
                }
            },
            show: |c| Some((c.size >> 20).to_string()),
        },
        Opt {
            key: "lba",
            values: "512|4096",
            help: "the LBA size in bytes (default 512)",
            parse: |c, v| {
                c.lba_size = match num(v)? {
                    512 => 512,
                    4096 => 4096,
                    n => return Err(format!("{n} (512 or 4096)").into()),
                };
                Ok(())
            },
            show: |c| Some(c.lba_size.to_string()),
        },
        options::create(),
        Opt {
            key: "ms",
            values: "0|8|16|64",
            help: "metadata bytes per block (default 0); file:PATH then holds an eighth more after the data",
            parse: |c, v| {
                c.meta.set("ms", v)?;
                Ok(())
            },
            show: |c| (c.meta.ms != 0).then(|| c.meta.ms.to_string()),
        },
        Opt {
            key: "ext",
            values: "on|off",
            help: "with ms=: extended LBAs, the metadata inline after each block (default off: a separate buffer)",
            parse: |c, v| {
                c.meta.set("ext", v)?;
                Ok(())
            },
            show: |c| c.meta.ext.then(|| "on".to_string()),
        },
        Opt {
            key: "pi",
            values: "0|1",
            help: "protection information type 1 in the metadata (needs ms=8, 16 or 64; default 0)",
            parse: |c, v| {
                c.meta.set("pi", v)?;
                Ok(())
            },
            show: |c| (c.meta.pi != 0).then(|| c.meta.pi.to_string()),
        },
        Opt {
            key: "pil",
            values: "first|last",
            help: "with pi=1: the protection information in the metadata's first or last 8 bytes (default last; \
                   Format NVM's PIL)",
            parse: |c, v| {
                c.meta.set("pil", v)?;
                Ok(())
            },
            show: |c| c.meta.pi_first.then(|| "first".to_string()),
        },
        Opt {
            key: "pollers",
            values: "N",
            help: "poller threads, 1 ..= 16 (default 1); more than one: doorbell=shm, bar or adaptive, \
                   backend=null or ram, the I/O queues spread over them",
            parse: |c, v| match num(v)? {
                n if (1..=MAX_POLLERS as u64).contains(&n) => {
                    c.pollers = n as u8;
                    Ok(())
                }
                n => Err(format!("{n} (1 ..= {MAX_POLLERS})").into()),
            },
            show: |c| (c.pollers != 1).then(|| c.pollers.to_string()),
        },
        Opt {
            key: "forecast",
            values: "on|off",
            help: "doorbell=adaptive: poll for the command that ends a steady gap instead of waiting \
                   for its doorbell (default on)",
            parse: |c, v| {
                c.forecast = on_off(v)?;
                Ok(())
            },
            show: |c| (!c.forecast).then(|| "off".to_string()),
        },
        Opt {
            key: "in_place",
            values: "auto|on|off",
            help: "file:PATH only: reads and writes work on the guest's pages in place instead of \
                   through bounce buffers (default auto)",
            parse: |c, v| {
                c.in_place = v.parse()?;
                Ok(())
            },
            show: |c| (c.in_place != InPlace::Auto).then(|| c.in_place.to_string()),
        },
        Opt {
            key: "submit_batch",
            values: "N",
            help: "file:PATH only: operations go to the kernel every N, 0 ..= 256 (default 0: all a \
                   queue pass fetched at once; fio's iodepth_batch_submit)",
            parse: |c, v| match num(v)? {
                n if n <= MAX_SUBMIT_BATCH as u64 => {
                    c.submit_batch = n as u16;
                    Ok(())
                }
                n => Err(format!("{n} (0 ..= {MAX_SUBMIT_BATCH})").into()),
            },
            show: |c| (c.submit_batch != 0).then(|| c.submit_batch.to_string()),
        },
        Opt {
            key: "serial",
            values: "S",
            help: "the serial number, 1-20 printable ASCII (default: drawn per controller, IOPATH...)",
            parse: |c, v| {
                c.id.serial = Some(v.to_string());
                Ok(())
            },
            show: |c| c.id.serial.clone(),
        },
        Opt {
            key: "nqn",
            values: "S",
            help: "the subsystem NQN, nqn.YYYY-MM.domain[:name], at most 223 bytes (default: \
                   nqn.2026-11.io.iopath:nvme:SERIAL)",
            parse: |c, v| {
                c.id.nqn = Some(v.to_string());
                Ok(())
            },
            show: |c| c.id.nqn.clone(),
        },
        Opt {
            key: "cntlid",
            values: "N",
            help: "the controller id, 1 ..= 65519 (default: drawn per controller)",
            parse: |c, v| {
                // Out of u16: 0, which validate() refuses with the range.
                c.id.cntlid = Some(num(v)?.try_into().unwrap_or(0));
                Ok(())
            },
            show: |c| c.id.cntlid.map(|n| n.to_string()),
        },
        Opt {
            key: "namespaces",
            values: "N",
            help: "namespaces 1..=N, each as backend=, size_mb=, lba= give namespace 1 (its own data; not \
                   with a file), 1 ..= 32 with the ns= ones (default 1)",
            parse: |c, v| match num(v)? {
                n if (1..=MAX_NAMESPACES as u64).contains(&n) => {
                    c.namespaces = n as u32;
                    Ok(())
                }
                n => Err(format!("{n} (1 ..= {MAX_NAMESPACES})").into()),
            },
            show: |c| (c.namespaces != 1).then(|| c.namespaces.to_string()),
        },
        Opt {
            key: "ns",
            values: "SPEC",
            help: "one more namespace (repeatable, NSIDs in order after namespaces=): SPEC is \
                   backend=...;size_mb=...;lba=...;create=...;timing=... with ; between its keys (defaults as \
                   namespace 1's; timing= as the device option's, ++ for its +), several joined by +",
            parse: |c, v| {
                c.ns.extend(NsConfig::parse_list(v)?);
                Ok(())
            },
            show: |c| NsConfig::write_list(&c.ns),
        },
        Opt {
            key: "timing",
            values: "SPEC",
            help: "the namespaces' device timing model (the default of each without a timing= of its own), items joined by + (e.g. read:80us+write:ln:20us:90us+\
                   channels:8+iops:500k+bw:3g; default off); not with doorbell=mmio",
            parse: |c, v| {
                c.timing = Some(Box::new(v.parse().map_err(|e: crate::block::timing::TimingError| e.to_string())?));
                Ok(())
            },
            show: |c| c.timing.as_ref().map(|t| t.to_string()),
        },
        Opt {
            key: "inject",
            values: "RULES",
            help: "error injection rules from the start, items joined by /, rules by + (e.g. \
                   op=read/lba=0-7/status=2:0x81/once+op=write/delay=2ms/every=10; README.md lists them)",
            parse: |c, v| {
                c.inject = crate::block::inject::parse_rules(v).map_err(|e| e.to_string())?;
                Ok(())
            },
            show: |c| (!c.inject.is_empty()).then(|| crate::block::inject::write_rules(&c.inject)),
        },
    ],
};

crate::block_config!(NvmeConfig);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::StorageKind;
    use crate::nvme::{identity::IdentityOptions, DoorbellMode};

    #[test]
    fn every_key_takes_back_what_it_printed() {
        let c = NvmeConfig {
            backend: StorageKind::File("/tmp/a,b@c.img".into()),
            size: 8 << 20,
            lba_size: 4096,
            doorbell: DoorbellMode::BarAdaptive,
            pollers: 3,
            forecast: false,
            in_place: InPlace::Off,
            submit_batch: 7,
            create: true,
            id: IdentityOptions {
                serial: Some("SN 1,2@3".into()),
                nqn: Some("nqn.2014-08.com.example:a".into()),
                cntlid: Some(65519),
            },
            namespaces: 4,
            ns: vec![
                NsConfig { backend: StorageKind::Null, size: 1 << 30, lba_size: 4096, ..Default::default() },
                NsConfig {
                    backend: StorageKind::File("/tmp/n;+,@.img".into()),
                    size: 8 << 20,
                    lba_size: 512,
                    create: true,
                    meta: crate::nvme::namespaces::NsMeta { ms: 16, ext: true, pi: 1, pi_first: false },
                    timing: Some(Box::new("read:u:10us:30us+iops:10k".parse().unwrap())),
                },
            ],
            meta: crate::nvme::namespaces::NsMeta { ms: 8, ext: true, pi: 1, pi_first: true },
            timing: Some(Box::new("read:ln:80us:300us+write:20us+channels:8+iops:500k+bw:3g+seed:7".parse().unwrap())),
            inject: crate::block::inject::parse_rules(
                "op=read/lba=0-7/status=2:0x81:dnr/once+op=write/nsid=1/delay=2ms/p=0.5:9+op=read/corrupt=4:7+qid=2/drop/every=3",
            )
            .unwrap(),
        };
        crate::options::tests::keys_round_trip(&OPTIONS, &c);
    }

    #[test]
    fn the_doorbell_values_are_every_mode() {
        let modes: Vec<String> = DoorbellMode::ALL.iter().map(|m| m.to_string()).collect();
        assert_eq!(OPTIONS.opts[0].values, modes.join("|"));
    }

    #[test]
    fn the_help_states_the_limits() {
        let help = |k: &str| OPTIONS.opts.iter().find(|o| o.key == k).unwrap().help;
        assert!(help("pollers").contains(&format!("1 ..= {MAX_POLLERS}")));
        assert!(help("submit_batch").contains(&format!("0 ..= {MAX_SUBMIT_BATCH}")));
        assert!(help("cntlid").contains(&format!("1 ..= {}", crate::nvme::identity::CNTLID_MAX)));
        assert!(help("serial").contains(&format!("1-{}", crate::nvme::identity::SERIAL_LEN)));
        assert!(help("nqn").contains(&format!("at most {}", crate::nvme::identity::NQN_MAX)));
    }
}
