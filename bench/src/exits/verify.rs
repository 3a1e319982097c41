//! Routing checks: each row of a run is held against counters the guest
//! cannot write (the devices' own, the VMM's, the bare loop's) before its
//! figures are used. A guest that says what it did is input, not proof.

use crate::record::{GuestOutput, Row};
use iopath_vmm::vcpu::ExitStats;
use iopath_vmm::vm::RunReport;
use serde::Serialize;
use std::collections::BTreeMap;

/// A routing verdict for one row of one run.
#[derive(Clone, Debug, Serialize)]
pub struct Routing {
    pub ok: bool,
    pub detail: String,
}

pub(crate) fn ok(detail: String) -> Routing {
    Routing { ok: true, detail }
}
pub(crate) fn bad(detail: String) -> Routing {
    Routing { ok: false, detail }
}

pub(crate) fn fmt_opt(v: Option<u64>) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| "?".into())
}

fn status_verdict(r: &Row) -> Option<Routing> {
    match r.status() {
        Some(s) if s != "ok" => {
            Some(bad(format!("guest reported status={s} {}", r.extra.get("reason").cloned().unwrap_or_default())))
        }
        _ => None,
    }
}

/// The sum of the accesses of the rows `pick` selects.
fn sum_of(out: &GuestOutput, pick: impl Fn(&Row) -> bool) -> u64 {
    out.rows.iter().filter(|r| pick(r)).map(|r| r.accesses).fold(0, u64::saturating_add)
}

/// Checks each row of an iopath run against the device and VMM counters.
///
/// Rows that exit on purpose (`vmm`, `kernel`) are held to the VMM's
/// unclaimed-access counters exactly: every access of a `vmm` row reached
/// the VMM and no access of a `kernel` row did. Doorbell rows are held to
/// the doorbell device's own totals (the guest's per-row deltas must add up
/// to them), not only to what the guest read from its registers.
pub fn verify_iopath(out: &GuestOutput, run: &RunReport) -> BTreeMap<String, Routing> {
    let counter = |dev: &str, name: &str| -> Option<u64> {
        run.devices.iter().find(|d| d.name == dev)?.counters.iter().find(|c| c.name == name).map(|c| c.value)
    };
    let acc = |name: &str| out.row(name).map(|r| r.accesses).unwrap_or(0);
    let e = &run.exits;
    let doorbell_kind = |r: &Row| r.name.rsplit(':').next().unwrap_or("").to_string();
    let db_sum = |prefix: &str| sum_of(out, |r| r.group == "doorbell" && doorbell_kind(r).starts_with(prefix));
    let mut v = BTreeMap::new();
    for r in &out.rows {
        let verdict = match r.group.as_str() {
            _ if status_verdict(r).is_some() => status_verdict(r).unwrap(),
            "pci-testdev" if r.name.contains("-read:") => {
                // Reads of `data`: the row's, plus a few from the guest's test scan.
                let ty = r.name.split('-').next().unwrap_or("");
                let reads = counter("pci-testdev", &format!("{ty}.data-reads"));
                let d = format!("data-reads={} of {} reads", fmt_opt(reads), r.accesses);
                match reads {
                    Some(n) if n >= r.accesses && n <= r.accesses + 64 && r.get_u64("value_ok") != Some(0) => ok(d),
                    _ => bad(d),
                }
            }
            "pci-testdev" => {
                let test = r.name.split(':').next().unwrap_or("");
                let (exits, kicks) = (
                    counter("pci-testdev", &format!("{test}.exits")),
                    counter("pci-testdev", &format!("{test}.kicks")),
                );
                let count = r.get_u64("count");
                let want_exit = test.contains("no-eventfd");
                let (we, wk) = if want_exit { (r.accesses, 0) } else { (0, r.accesses) };
                let detail = format!(
                    "count={} exits={} kicks={} of {} writes",
                    fmt_opt(count),
                    fmt_opt(exits),
                    fmt_opt(kicks),
                    r.accesses
                );
                if count == Some(we) && exits == Some(we) && kicks == Some(wk) {
                    ok(detail)
                } else {
                    bad(detail)
                }
            }
            "doorbell" => {
                let (x, k, p) = (r.get_u64("exits"), r.get_u64("kicks"), r.get_u64("polls"));
                let a = r.accesses;
                let kind = doorbell_kind(r);
                let want = match kind.as_str() {
                    s if s.starts_with("exit") => (a, 0, 0),
                    s if s.starts_with("ioeventfd") => (0, a, 0),
                    _ => (0, 0, a),
                };
                // The device's totals over the run against the guest's rows of each kind.
                let dev = ["exits", "kicks", "polls"].map(|c| counter("iopath-doorbell", c));
                let sums = [db_sum("exit"), db_sum("ioeventfd"), db_sum("shm")];
                let detail = format!(
                    "exits={} kicks={} polls={} of {a} doorbells; device totals {}/{}/{} for {}/{}/{}",
                    fmt_opt(x),
                    fmt_opt(k),
                    fmt_opt(p),
                    fmt_opt(dev[0]),
                    fmt_opt(dev[1]),
                    fmt_opt(dev[2]),
                    sums[0],
                    sums[1],
                    sums[2]
                );
                let totals_agree = dev.iter().zip(sums).all(|(d, s)| *d == Some(s));
                if (x, k, p) == (Some(want.0), Some(want.1), Some(want.2)) && totals_agree {
                    ok(detail)
                } else {
                    bad(detail)
                }
            }
            "vmm" | "kernel" => {
                // Port 0x1234 and MMIO 0xd0000000 are unclaimed: the VMM counts each
                // access that reaches it. The kernel rows' port (ELCR) must not reach it.
                let (seen, vmm_row, what) = match r.name.as_str() {
                    "outl_to_vmm" | "outl_to_kernel" => (e.unclaimed_pio_write, "outl_to_vmm", "unclaimed PIO writes"),
                    "inl_from_vmm" | "inl_from_kernel" => (e.unclaimed_pio_read, "inl_from_vmm", "unclaimed PIO reads"),
                    _ => (e.unclaimed_mmio_write, "mmio_to_vmm", "unclaimed MMIO writes"),
                };
                let want = acc(vmm_row);
                let d = if r.group == "kernel" {
                    format!("VMM saw {} of its {} accesses", seen.saturating_sub(want), r.accesses)
                } else {
                    format!("{what}={seen} of {} accesses", r.accesses)
                };
                if seen == want {
                    ok(d)
                } else {
                    bad(d)
                }
            }
            _ => ok("-".into()),
        };
        v.insert(r.name.clone(), verdict);
    }
    v
}

/// Checks a floor run: what the bare `KVM_RUN` loop counted must be exactly
/// the accesses the guest says it made, plus its serial output (one OUT per
/// byte) and the final isa-debug-exit write. `serial_bytes` is the length of
/// the output the loop kept.
pub fn verify_floor(out: &GuestOutput, serial_bytes: u64, e: &ExitStats) -> BTreeMap<String, Routing> {
    let is_in = |r: &Row| r.name.starts_with("inl_");
    let is_mmio = |r: &Row| r.name.starts_with("mmio");
    let ins = sum_of(out, is_in);
    let outs = sum_of(out, |r| !is_in(r) && !is_mmio(r));
    let mmio = sum_of(out, is_mmio);
    let want_out = outs.saturating_add(serial_bytes).saturating_add(1);
    let mut v = BTreeMap::new();
    for r in &out.rows {
        let verdict = if let Some(s) = status_verdict(r) {
            s
        } else {
            let (seen, want, what) = if is_in(r) {
                (e.io_in, ins, "PIO reads")
            } else if is_mmio(r) {
                (e.mmio_write, mmio, "MMIO writes")
            } else {
                (e.io_out, want_out, "PIO writes (serial and exit included)")
            };
            let d = format!("bare loop counted {seen} {what} of {want}");
            if seen == want && e.mmio_read == 0 {
                ok(d)
            } else {
                bad(format!("{d}, mmio reads {}", e.mmio_read))
            }
        };
        v.insert(r.name.clone(), verdict);
    }
    v
}

/// Under QEMU only pci-testdev's `count` register tells the route.
pub fn verify_qemu(out: &GuestOutput) -> BTreeMap<String, Routing> {
    let mut v = BTreeMap::new();
    for r in &out.rows {
        let verdict = match (r.group.as_str(), r.status()) {
            (_, Some(s)) if s != "ok" => bad(format!("guest reported status={s}")),
            // QEMU's pci-testdev counts no reads: the guest checks the value it read.
            ("pci-testdev", _) if r.name.contains("-read:") => match r.get_u64("value_ok") {
                Some(1) => ok(format!(
                    "reads: the data register read back {}",
                    r.extra.get("value").map_or("?", String::as_str)
                )),
                v => bad(format!(
                    "reads: value_ok={} (value {})",
                    fmt_opt(v),
                    r.extra.get("value").map_or("?", String::as_str)
                )),
            },
            ("pci-testdev", _) => {
                let want = if r.name.contains("no-eventfd") { r.accesses } else { 0 };
                let c = r.get_u64("count");
                let d = format!("count={} of {} writes", fmt_opt(c), r.accesses);
                if c == Some(want) {
                    ok(d)
                } else {
                    bad(d)
                }
            }
            _ => ok("-".into()),
        };
        v.insert(r.name.clone(), verdict);
    }
    v
}

/// Marks every row of a run whose `cpl=` is not the one the run asked for.
pub(crate) fn check_cpl(out: &GuestOutput, cpl: u8, routing: &mut BTreeMap<String, Routing>) {
    for r in &out.rows {
        if r.status().is_none() && r.cpl().unwrap_or(3) != cpl {
            let v = routing.entry(r.name.clone()).or_insert_with(|| ok(String::new()));
            v.ok = false;
            v.detail = format!("{} [ran at cpl {} instead of {cpl}]", v.detail, fmt_opt(r.cpl().map(u64::from)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use iopath_devices::Counter;
    use iopath_vmm::vm::DeviceReport;

    #[test]
    fn a_qemu_read_row_is_ok_only_if_the_guest_read_the_register_back() {
        let row = |extra: &str| {
            let line = format!(
                "@row name=mmio-read:pci-mem group=pci-testdev cpl=3 iters=10 accesses=10 warm=0 cycles=100 {extra}"
            );
            verify_qemu(&GuestOutput::parse(&[line]))["mmio-read:pci-mem"].clone()
        };
        assert!(row("addr=0x1000 value=0xfa value_ok=1").ok);
        assert!(!row("addr=0x1000 value=0xffffffff value_ok=0").ok, "an unclaimed hole reads all-ones");
        assert!(!row("addr=0x1000").ok, "no check, no pass");
    }

    fn out(lines: &[&str]) -> GuestOutput {
        GuestOutput::parse(lines)
    }

    fn report(exits: ExitStats, doorbell: Option<[u64; 3]>) -> RunReport {
        let devices = doorbell.map(|db| DeviceReport {
            name: "iopath-doorbell".into(),
            slot: 2,
            bars: Vec::new(),
            counters: ["exits", "kicks", "polls"]
                .iter()
                .zip(db)
                .map(|(n, value)| Counter { name: n.to_string(), value })
                .collect(),
        });
        RunReport {
            status: 1,
            lines: Vec::new(),
            exits,
            devices: devices.into_iter().collect(),
            pci_absent_accesses: 0,
            tsc_khz: 2_000_000,
            wall: std::time::Duration::ZERO,
            marks: Vec::new(),
        }
    }

    #[test]
    fn a_kernel_row_fails_if_any_access_reached_the_vmm() {
        let g = out(&[
            "@row name=outl_to_kernel group=kernel iters=10 accesses=100 cycles=1",
            "@row name=outl_to_vmm group=vmm iters=10 accesses=50 cycles=1",
        ]);
        let exact = ExitStats { unclaimed_pio_write: 50, ..Default::default() };
        let v = verify_iopath(&g, &report(exact, Some([0; 3])));
        assert!(v["outl_to_kernel"].ok && v["outl_to_vmm"].ok, "{v:?}");
        // One access of the kernel row reached the VMM: both rows are wrong.
        let one_more = ExitStats { unclaimed_pio_write: 51, ..Default::default() };
        let v = verify_iopath(&g, &report(one_more, Some([0; 3])));
        assert!(!v["outl_to_kernel"].ok && !v["outl_to_vmm"].ok, "{v:?}");
    }

    #[test]
    fn doorbell_rows_are_held_to_the_device_totals() {
        let g = out(&[
            "@row name=doorbell-rtt:exit-mmio group=doorbell iters=1 accesses=10 cycles=1 exits=10 kicks=0 polls=0",
            "@row name=doorbell-rtt:shm group=doorbell iters=1 accesses=20 cycles=1 exits=0 kicks=0 polls=20",
        ]);
        let v = verify_iopath(&g, &report(ExitStats::default(), Some([10, 0, 20])));
        assert!(v.values().all(|r| r.ok), "{v:?}");
        // The guest's registers said 20 polls; the device counted 19.
        let v = verify_iopath(&g, &report(ExitStats::default(), Some([10, 0, 19])));
        assert!(!v["doorbell-rtt:shm"].ok, "{v:?}");
        // No device report at all: nothing confirms the guest's figures.
        let v = verify_iopath(&g, &report(ExitStats::default(), None));
        assert!(v.values().all(|r| !r.ok), "{v:?}");
    }

    #[test]
    fn a_floor_run_must_count_what_the_guest_says() {
        let g = out(&[
            "@row name=outl_to_vmm group=vmm iters=1 accesses=40 cycles=1",
            "@row name=inl_from_vmm group=vmm iters=1 accesses=30 cycles=1",
            "@row name=mmio_to_vmm group=vmm iters=1 accesses=20 cycles=1",
        ]);
        let good = ExitStats { io_out: 40 + 100 + 1, io_in: 30, mmio_write: 20, ..Default::default() };
        assert!(verify_floor(&g, 100, &good).values().all(|r| r.ok));
        let short = ExitStats { io_in: 29, ..good };
        let v = verify_floor(&g, 100, &short);
        assert!(!v["inl_from_vmm"].ok && v["outl_to_vmm"].ok, "{v:?}");
        let v = verify_floor(&g, 99, &good);
        assert!(!v["outl_to_vmm"].ok, "{v:?}");
    }

    #[test]
    fn a_row_at_the_wrong_cpl_is_wrong() {
        let g = out(&["@row name=cpuid group=cpu cpl=3 iters=1 accesses=1 cycles=1"]);
        let mut v = BTreeMap::new();
        check_cpl(&g, 3, &mut v);
        assert!(v.is_empty());
        check_cpl(&g, 0, &mut v);
        assert!(!v["cpuid"].ok);
    }
}
