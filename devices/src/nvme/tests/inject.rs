//! Error injection as a driver sees it: statuses with their Error
//! Information log entries, dropped commands that complete only when
//! aborted (and whose CQ room a reset or an SQ deletion gives back), Controller
//! Fatal Status, asynchronous events with their log pages, corrupted reads.

use super::*;
use crate::block::inject::parse_rules;

fn with(rules: &str, cfg: NvmeConfig) -> Drv {
    Drv::new(NvmeConfig { inject: parse_rules(rules).unwrap(), ..cfg })
}

impl Drv {
    /// Get Log Page `lid`, `len` bytes (a multiple of 4), RAE or not.
    fn get_log(&mut self, lid: u8, len: usize, rae: bool) -> Vec<u8> {
        let numd = (len / 4 - 1) as u32;
        let (st, b) = self.admin_data(0x02, 0, [lid as u32 | u32::from(rae) << 15 | numd << 16, 0, 0, 0], len);
        assert_eq!(st, 0, "log page {lid:#x}");
        b
    }
    /// After CC.EN = 0: the admin and I/O queues from scratch (their CQ
    /// rings zeroed, or the driver would take old entries for new ones).
    fn restart(&mut self) {
        self.mem.write_slice(&[0u8; 32 * 16], GuestAddress(ACQ)).unwrap();
        self.mem.write_slice(&[0u8; 64 * 16], GuestAddress(IOCQ)).unwrap();
        (self.atail, self.ahead, self.aphase, self.iotail, self.iohead, self.iophase) = (0, 0, 1, 0, 0, 1);
        self.w32(REG_CC, 0x0046_0001);
    }
    /// Writes a read or write of LBAs `slba..=slba+nlb0` at the SQ tail and
    /// rings; does not wait (its cid).
    fn post(&mut self, op: u8, slba: u64, nlb0: u32, size: u16) -> u16 {
        self.submit_batch(&[(op, slba, nlb0, DATA)], IOSQ, size)[0]
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}

#[test]
fn an_injected_status_completes_at_once_unexecuted_and_fills_the_error_log() {
    let mut d = with("op=read/lba=4-7/status=2:0x81:dnr", mmio(StorageKind::Ram));
    d.io_queues(8);
    let (st, id) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
    assert_eq!((st, id[262] as usize), (0, super::super::inject::ERROR_LOG_ENTRIES - 1), "ELPE");
    assert_eq!(d.io(0x02, 0, 3, DATA, 0, 8), 0, "LBAs 0-3 do not match");
    assert_eq!(d.io(0x01, 4, 0, DATA, 0, 8), 0, "a write does not match");
    // SCT 2, SC 81h, DNR (bit 14 of the status field).
    assert_eq!(d.io(0x02, 2, 3, DATA, 0, 8), 0x4281, "overlaps LBA 4");
    let first = d.cid;
    d.mem.write_slice(&[0x5au8; 512], GuestAddress(DATA)).unwrap();
    assert_eq!(d.io(0x02, 7, 0, DATA, 0, 8), 0x4281);
    let mut b = [0u8; 512];
    d.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
    assert_eq!(b, [0x5a; 512], "not executed: the buffer is left alone");
    let log = d.get_log(0x01, 64 * 16, false);
    // Newest first: error counts 2 and 1, then invalid (count 0) entries.
    assert_eq!((u64_at(&log, 0), u64_at(&log, 64), u64_at(&log, 128)), (2, 1, 0));
    let e = &log[64..128];
    assert_eq!((u16_at(e, 8), u16_at(e, 10), u16_at(e, 12) >> 1), (1, first, 0x4281), "SQID, CID, status");
    assert_eq!((u64_at(e, 16), u32::from_le_bytes(e[24..28].try_into().unwrap())), (2, 1), "LBA, NSID");
    assert_eq!(u64_at(&log, 16), 7);
    let smart = d.get_log(0x02, 512, false);
    assert_eq!(u64_at(&smart, 176), 2, "error log entries, lifetime");
    // The ring keeps the newest ERROR_LOG_ENTRIES.
    for _ in 0..20 {
        assert_eq!(d.io(0x02, 4, 0, DATA, 0, 8), 0x4281);
    }
    let log = d.get_log(0x01, 64 * 16, false);
    assert_eq!((u64_at(&log, 0), u64_at(&log, 64 * 15)), (22, 7));
    assert_eq!(d.n.injector().stats().injected, 22);
}

#[test]
fn a_dropped_command_completes_only_when_aborted_and_gives_its_cq_room_back_on_reset_and_deletion() {
    let mut d = with("op=read/lba=100-100/drop", mmio(StorageKind::Ram));
    // A 2-entry CQ: room for one completion, which the dropped read owes.
    d.io_queues(2);
    let dropped = d.post(0x02, 100, 0, 2);
    assert!(d.reap(IOCQ, 2, false).is_none(), "never completed");
    d.post(0x01, 0, 0, 2);
    assert!(d.reap(IOCQ, 2, false).is_none(), "the CQ's one entry is owed to the dropped read");
    assert_eq!(d.admin(0x08, 0, 0, 0, [1 | 999 << 16, 0, 0, 0]), (1, 0), "no such command: not aborted");
    assert_eq!(d.admin(0x08, 0, 0, 0, [1 | (dropped as u32) << 16, 0, 0, 0]), (0, 0), "aborted");
    assert_eq!(d.reap_batch(1, IOCQ, 2), [(dropped, 0x007)], "Command Abort Requested");
    // The CQ room is back: the write is fetched on the next doorbell.
    d.w32(DOORBELLS + 8, d.iotail as u32);
    assert_eq!(d.reap_batch(1, IOCQ, 2)[0].1, 0);
    // Dropped again, then the SQ deleted and created on the same CQ: its room is back.
    d.post(0x02, 100, 0, 2);
    assert_eq!(d.admin(0x00, 0, 0, 0, [1, 0, 0, 0]).1, 0);
    assert_eq!(d.admin(0x01, 0, IOSQ, 0, [1 | 1 << 16, 1 | 1 << 16, 0, 0]).1, 0);
    d.iotail = 0;
    assert_eq!(d.io(0x01, 0, 0, DATA, 0, 2), 0);
    // Dropped again, then a reset: the new queues have all their room.
    d.post(0x02, 100, 0, 2);
    d.w32(REG_CC, 0);
    assert_eq!(d.r32(0x1c) & 3, 0, "not ready, no CFS");
    d.restart();
    d.io_queues(2);
    assert_eq!(d.io(0x01, 0, 0, DATA, 0, 2), 0);
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 2), 0);
}

#[test]
fn an_injected_fatal_sets_cfs_until_the_host_resets() {
    for mode in [DoorbellMode::Mmio, DoorbellMode::Bar] {
        let mut d = with("op=flush/fatal/once", NvmeConfig { doorbell: mode, ..mmio(StorageKind::Null) });
        d.io_queues(4);
        d.post(0x00, 0, 0, 4);
        let t0 = std::time::Instant::now();
        while d.r32(0x1c) & 2 == 0 {
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{mode}: CSTS.CFS");
            std::thread::yield_now();
        }
        assert!(d.reap(IOCQ, 4, false).is_none(), "{mode}: the command is not completed");
        d.w32(REG_CC, 0);
        assert_eq!(d.r32(0x1c) & 3, 0, "{mode}: a reset clears CFS");
        d.restart();
        d.io_queues(4);
        assert_eq!(d.io(0x00, 0, 0, 0, 0, 4), 0, "{mode}: once");
        d.n.quiesce();
    }
}

#[test]
fn injected_events_complete_aers_and_fill_their_log_pages() {
    let mut d = with("op=flush/event=smart:0x04+op=write/event=ns-changed", mmio(StorageKind::Null));
    d.io_queues(8);
    d.submit_aer();
    d.submit_aer();
    assert_eq!(d.io(0x00, 0, 0, 0, 0, 8), 0, "executed as usual");
    // SMART / Health status (type 1), reliability (info 0), log page 02h.
    assert_eq!(d.reap(ACQ, 32, true), Some((1 | 2 << 16, 0)));
    assert_eq!(d.io(0x01, 9, 0, DATA, 0, 8), 0);
    // Notice (type 2), Namespace Attribute Changed (info 0), log page 04h.
    assert_eq!(d.reap(ACQ, 32, true), Some((2 | 4 << 16, 0)));
    d.w32(DOORBELLS + 4, d.ahead as u32);
    assert_eq!(d.get_log(0x02, 512, false)[0] & 0x04, 0x04, "the warning shows in the SMART log");
    let l = d.get_log(0x04, 4096, true);
    assert_eq!((&l[0..4], &l[4..8]), (&1u32.to_le_bytes()[..], &[0u8; 4][..]), "namespace 1 changed");
    assert_eq!(d.get_log(0x04, 4096, false)[0..4], 1u32.to_le_bytes(), "kept with RAE");
    assert_eq!(d.get_log(0x04, 4096, false)[0..4], [0; 4], "read without RAE: cleared");
    // Another SMART event: its type was reported and its log page read, so it goes out.
    d.submit_aer();
    assert_eq!(d.io(0x00, 0, 0, 0, 0, 8), 0);
    assert_eq!(d.reap(ACQ, 32, true), Some((1 | 2 << 16, 0)));
}

#[test]
fn a_corrupted_read_differs_in_exactly_the_bytes_its_seed_names() {
    let img = TempImage::new("inject-corrupt");
    for cfg in [mmio(StorageKind::Ram), img.cfg(DoorbellMode::Mmio), img.cfg(DoorbellMode::Bar)] {
        let what = format!("{} {}", cfg.backend, cfg.doorbell);
        let mut d = with("op=read/lba=8-15/corrupt=9:11", cfg);
        d.io_queues(8);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        d.mem.write_slice(&data, GuestAddress(DATA)).unwrap();
        assert_eq!(d.io(0x01, 8, 7, DATA, 0, 8), 0, "{what}");
        d.mem.write_slice(&[0u8; 4096], GuestAddress(DATA)).unwrap();
        // 4 KiB at DATA (one page): PRP1 only.
        assert_eq!(d.io(0x02, 8, 7, DATA, 0, 8), 0, "{what}");
        let mut got = vec![0u8; 4096];
        d.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        let k = crate::block::inject::Corrupt { bytes: 9, seed: 11 };
        let flips = k.flips(4096);
        assert_eq!(flips.len(), 9);
        let diff: Vec<(usize, u8)> = (0..4096).filter(|&i| got[i] != data[i]).map(|i| (i, got[i] ^ data[i])).collect();
        assert_eq!(diff, flips, "{what}");
        d.n.quiesce();
    }
}

#[test]
fn rules_added_and_cleared_at_run_time_apply_from_the_next_command() {
    let dev =
        crate::DeviceConfig::build(&"nvme,doorbell=mmio,backend=null,inject=op=write/drop".parse().unwrap()).unwrap();
    let inj = dev.injector().expect("an nvme controller has an injector");
    assert_eq!(inj.list().len(), 1, "inject= rules are there from the start");
    let mut d = Drv::new(mmio(StorageKind::Null));
    let inj = d.n.injector();
    d.io_queues(8);
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 8), 0);
    let id = inj.add(parse_rules("op=read/status=0:0x06").unwrap()[0]).unwrap();
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 8), 0x006, "Internal Error");
    inj.remove(id).unwrap();
    assert_eq!(d.io(0x02, 0, 0, DATA, 0, 8), 0);
    inj.add(parse_rules("qid=1/status=0:0x06/every=2").unwrap()[0]).unwrap();
    let st: Vec<u16> = (0..4).map(|_| d.io(0x00, 0, 0, 0, 0, 8)).collect();
    assert_eq!(st, [0, 6, 0, 6]);
    assert_eq!(inj.clear(), 1);
    assert_eq!(d.io(0x00, 0, 0, 0, 0, 8), 0);
    let s = inj.stats();
    assert_eq!((s.commands, s.injected), (5, 3), "only commands while armed are counted");
}
