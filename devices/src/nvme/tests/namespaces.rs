//! Several namespaces: Identify (NN, the active and allocated lists, each
//! namespace's structure and descriptors), I/O routed by NSID with each
//! namespace's own data (an NSID that names none: 0x0b, nothing touched),
//! Format NVM between the two LBA formats, and file namespaces whose rings
//! share one completion eventfd.

use super::*;
use crate::nvme::namespaces::NsConfig;

impl Drv {
    /// One I/O to namespace `nsid` through the MMIO doorbell; its status.
    fn io_ns(&mut self, op: u8, nsid: u32, slba: u64, nlb0: u32, prp1: u64, size: u16) -> u16 {
        let e = self.sqe(op, nsid, prp1, 0, [slba as u32, (slba >> 32) as u32, nlb0, 0]);
        self.mem.write_slice(&e, GuestAddress(IOSQ + self.iotail as u64 * 64)).unwrap();
        self.iotail = (self.iotail + 1) % size;
        self.w32(DOORBELLS + 8, self.iotail as u32);
        let t0 = std::time::Instant::now();
        let (_, st) = loop {
            if let Some(r) = self.reap(IOCQ, size, false) {
                break r;
            }
            assert!(t0.elapsed() < std::time::Duration::from_secs(5), "io completion");
            std::thread::yield_now();
        };
        self.w32(DOORBELLS + 12, self.iohead as u32);
        st
    }
}

fn ns(backend: StorageKind, size: u64, lba_size: u32) -> NsConfig {
    NsConfig { backend, size, lba_size, create: false, timing: None }
}

/// Namespaces 1-2 ram (512, cloned), 3 null (4096), 4 ram (4096).
fn four() -> NvmeConfig {
    NvmeConfig {
        namespaces: 2,
        ns: vec![ns(StorageKind::Null, 4 << 20, 4096), ns(StorageKind::Ram, 2 << 20, 4096)],
        ..mmio(StorageKind::Ram)
    }
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().unwrap())
}

#[test]
fn identify_lists_every_namespace_with_its_geometry_and_ids_of_its_own() {
    let mut d = Drv::new(four());
    let (st, c) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
    assert_eq!(st, 0);
    assert_eq!(u32::from_le_bytes(c[516..520].try_into().unwrap()), 4, "NN");
    // The active (02h) and allocated (10h) lists: NSIDs above CDW1's.
    for cns in [2u32, 0x10] {
        for (from, want) in [(0u32, vec![1u32, 2, 3, 4]), (2, vec![3, 4]), (4, vec![]), (100, vec![])] {
            let (st, l) = d.admin_data(0x06, from, [cns, 0, 0, 0], 4096);
            let got: Vec<u32> =
                l.chunks(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).take_while(|&n| n != 0).collect();
            assert_eq!((st, got), (0, want), "CNS {cns:#x} from {from}");
        }
        assert_eq!(d.admin(0x06, 0xffff_fffe, DATA, 0, [cns, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    }
    let mut ids = Vec::new();
    for (nsid, bytes, shift) in [(1u32, 1u64 << 20, 9u32), (2, 1 << 20, 9), (3, 4 << 20, 12), (4, 2 << 20, 12)] {
        for cns in [0u32, 0x11] {
            let (st, n) = d.admin_data(0x06, nsid, [cns, 0, 0, 0], 4096);
            assert_eq!(st, 0, "namespace {nsid}");
            let nlbas = bytes >> shift;
            assert_eq!((le64(&n[0..]), le64(&n[8..]), le64(&n[16..])), (nlbas, nlbas, nlbas), "{nsid}: NSZE NCAP NUSE");
            assert_eq!(n[25], 1, "NLBAF: two formats");
            assert_eq!(n[26], (shift == 12) as u8, "{nsid}: FLBAS");
            assert_eq!((n[128 + 2], n[132 + 2]), (9, 12), "LBAF0 512, LBAF1 4096");
            assert_eq!((&n[128..130], &n[132..134]), (&[0u8, 0][..], &[0u8, 0][..]), "no metadata");
        }
        let (_, n) = d.admin_data(0x06, nsid, [0, 0, 0, 0], 4096);
        let (st, l) = d.admin_data(0x06, nsid, [3, 0, 0, 0], 4096);
        assert_eq!(st, 0);
        assert_eq!((l[0], l[1], l[20], l[21]), (2, 16, 3, 16), "{nsid}: an NGUID and a UUID");
        assert_eq!(&l[4..20], &n[104..120], "{nsid}: the NGUID as Identify Namespace has it");
        ids.extend([l[4..20].to_vec(), l[24..40].to_vec()]);
    }
    let k = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), k, "every namespace's NGUID and UUID its own");
    for bad in [0u32, 5, 32, 0xffff_ffff] {
        for cns in [0u32, 3, 0x11] {
            assert_eq!(d.admin(0x06, bad, DATA, 0, [cns, 0, 0, 0]).1, status::INVALID_NAMESPACE, "{bad} cns {cns}");
        }
    }
    // SMART is controller-wide only (LPA bit 0 clear).
    assert_eq!(c[261] & 1, 0);
    assert_eq!(d.admin(0x02, 1, DATA, 0, [2 | 1 << 15 | 127 << 16, 0, 0, 0]).1, status::INVALID_FIELD);
    assert_eq!(d.admin(0x02, 0, DATA, 0, [2 | 1 << 15 | 127 << 16, 0, 0, 0]).1, 0);
}

#[test]
fn io_goes_to_the_namespace_its_nsid_names_and_a_bad_nsid_touches_nothing() {
    const BUF: u64 = 0x40000;
    let mut d = Drv::new(four());
    d.io_queues(16);
    // Namespaces 1, 2 and 4 keep data of their own at LBA 0.
    for (nsid, fill) in [(1u32, 0x11u8), (2, 0x22), (4, 0x44)] {
        let lba = if nsid == 4 { 4096 } else { 512 };
        d.mem.write_slice(&vec![fill; lba], GuestAddress(BUF)).unwrap();
        assert_eq!(d.io_ns(0x01, nsid, 0, 0, BUF, 16), 0, "write to {nsid}");
    }
    for (nsid, fill, lba) in [(1u32, 0x11u8, 512usize), (2, 0x22, 512), (4, 0x44, 4096), (3, 0, 4096)] {
        d.mem.write_slice(&vec![0xee; 4096], GuestAddress(BUF)).unwrap();
        assert_eq!(d.io_ns(0x02, nsid, 0, 0, BUF, 16), 0, "read from {nsid}");
        let mut got = vec![0u8; lba];
        d.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
        if nsid == 3 {
            assert!(got.iter().all(|&b| b == 0xee), "null: no data moved");
        } else {
            assert!(got.iter().all(|&b| b == fill), "namespace {nsid} has its own data");
        }
    }
    // Each namespace's own size bounds its LBAs.
    assert_eq!(d.io_ns(0x02, 2, (1 << 20) / 512, 0, BUF, 16), status::LBA_OUT_OF_RANGE);
    assert_eq!(d.io_ns(0x02, 4, (2 << 20) / 4096 - 1, 0, BUF, 16), 0);
    assert_eq!(d.io_ns(0x02, 4, (2 << 20) / 4096, 0, BUF, 16), status::LBA_OUT_OF_RANGE);
    // No such namespace: Invalid Namespace or Format, the buffer untouched.
    d.mem.write_slice(&[0x5a; 4096], GuestAddress(BUF)).unwrap();
    for bad in [0u32, 5, 33, 0xffff_fffe, 0xffff_ffff] {
        for op in [0x01u8, 0x02, 0x08, 0x09] {
            assert_eq!(d.io_ns(op, bad, 0, 0, BUF, 16), status::INVALID_NAMESPACE, "op {op:#x} nsid {bad:#x}");
        }
    }
    let mut got = [0u8; 4096];
    d.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert!(got.iter().all(|&b| b == 0x5a));
    // Flush: a namespace, or FFFFFFFFh for all of them.
    assert_eq!(d.io_ns(0x00, 2, 0, 0, 0, 16), 0);
    assert_eq!(d.io_ns(0x00, 0xffff_ffff, 0, 0, 0, 16), 0);
    assert_eq!(d.io_ns(0x00, 5, 0, 0, 0, 16), status::INVALID_NAMESPACE);
    // Nothing else changed namespace 1.
    assert_eq!(d.io_ns(0x02, 1, 0, 0, BUF, 16), 0);
    d.mem.read_slice(&mut got[..512], GuestAddress(BUF)).unwrap();
    assert!(got[..512].iter().all(|&b| b == 0x11));
}

#[test]
fn format_nvm_switches_a_namespace_between_512_and_4096_and_erases_it_alone() {
    const BUF: u64 = 0x40000;
    let mut d = Drv::new(four());
    d.io_queues(16);
    for nsid in [1u32, 2] {
        d.mem.write_slice(&[nsid as u8; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(d.io_ns(0x01, nsid, 7, 0, BUF, 16), 0);
    }
    let flbas = |d: &mut Drv, nsid| {
        let (_, n) = d.admin_data(0x06, nsid, [0, 0, 0, 0], 4096);
        (n[26], le64(&n[0..]))
    };
    // Refused: a format not listed, protection information, cryptographic erase, no such namespace.
    assert_eq!(d.admin(0x80, 2, 0, 0, [2, 0, 0, 0]).1, status::INVALID_FORMAT);
    assert_eq!(d.admin(0x80, 2, 0, 0, [1 | 1 << 5, 0, 0, 0]).1, status::INVALID_FORMAT);
    assert_eq!(d.admin(0x80, 2, 0, 0, [1 | 2 << 9, 0, 0, 0]).1, status::INVALID_FIELD);
    assert_eq!(d.admin(0x80, 9, 0, 0, [1, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    assert_eq!(d.admin(0x80, 0, 0, 0, [1, 0, 0, 0]).1, status::INVALID_NAMESPACE);
    assert_eq!(flbas(&mut d, 2), (0, 2048), "nothing changed");
    // Namespace 2 to 4096 (with user data erase): its LBAs are 4 KiB, its data zeros.
    assert_eq!(d.admin(0x80, 2, 0, 0, [1 | 1 << 9, 0, 0, 0]).1, 0);
    assert_eq!(flbas(&mut d, 2), (1, 256));
    d.mem.write_slice(&[0xee; 4096], GuestAddress(BUF)).unwrap();
    assert_eq!(d.io_ns(0x02, 2, 0, 0, BUF, 16), 0);
    let mut got = [0u8; 4096];
    d.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert!(got.iter().all(|&b| b == 0), "erased, 4096 bytes moved");
    assert_eq!(d.io_ns(0x02, 2, 256, 0, BUF, 16), status::LBA_OUT_OF_RANGE);
    // Namespace 1 kept its format and data.
    assert_eq!(flbas(&mut d, 1), (0, 2048));
    assert_eq!(d.io_ns(0x02, 1, 7, 0, BUF, 16), 0);
    d.mem.read_slice(&mut got[..512], GuestAddress(BUF)).unwrap();
    assert!(got[..512].iter().all(|&b| b == 1));
    // And back to 512; FFFFFFFFh formats every namespace.
    assert_eq!(d.admin(0x80, 2, 0, 0, [0, 0, 0, 0]).1, 0);
    assert_eq!(flbas(&mut d, 2), (0, 2048));
    assert_eq!(d.admin(0x80, 0xffff_ffff, 0, 0, [1, 0, 0, 0]).1, 0);
    for (nsid, nlbas) in [(1, 256), (2, 256), (3, 1024), (4, 512)] {
        assert_eq!(flbas(&mut d, nsid), (1, nlbas), "namespace {nsid}");
    }
    assert_eq!(d.io_ns(0x02, 1, 1, 0, BUF, 16), 0);
    d.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
    assert!(got.iter().all(|&b| b == 0), "namespace 1 erased too");
}

#[test]
fn file_namespaces_each_keep_their_own_file_and_share_one_completion_eventfd() {
    const W: u64 = 0x40000;
    const R: u64 = 0x80000;
    for mode in MODES {
        let (a, b) = (TempImage::new("nsa"), TempImage::new("nsb"));
        let cfg = NvmeConfig {
            ns: vec![
                NsConfig {
                    backend: StorageKind::File(b.0.clone()),
                    size: 1 << 20,
                    lba_size: 4096,
                    create: true,
                    timing: None,
                },
                ns(StorageKind::Ram, 1 << 20, 512),
            ],
            ..a.cfg(mode)
        };
        let mut d = Drv::new(cfg);
        d.io_queues(64);
        // 16 writes to each file namespace in one pass, then their read-backs.
        let mut cmds = Vec::new();
        for i in 0..16u64 {
            d.mem.write_slice(&[i as u8 + 1; 4096], GuestAddress(W + i * 4096)).unwrap();
            d.mem.write_slice(&[i as u8 + 0x81; 4096], GuestAddress(W + (16 + i) * 4096)).unwrap();
            cmds.push((0x01, 1, i * 8, 7, W + i * 4096)); // 8 LBAs of 512
            cmds.push((0x01, 2, i, 0, W + (16 + i) * 4096)); // 1 LBA of 4096
        }
        cmds.push((0x01, 7, 0, 0, W)); // no such namespace
        let got = d.submit_ns(&cmds, 64);
        assert_eq!(got.len(), 33);
        assert_eq!(got.iter().filter(|&&(_, st)| st == status::INVALID_NAMESPACE).count(), 1, "{mode}");
        assert!(got.iter().all(|&(_, st)| st == 0 || st == status::INVALID_NAMESPACE), "{mode}: {got:?}");
        let reads: Vec<_> = (0..16u64)
            .flat_map(|i| [(0x02, 1, i * 8, 7, R + i * 4096), (0x02, 2, i, 0, R + (16 + i) * 4096)])
            .collect();
        assert!(d.submit_ns(&reads, 64).iter().all(|&(_, st)| st == 0), "{mode}");
        for i in 0..32u64 {
            let mut g = [0u8; 4096];
            d.mem.read_slice(&mut g, GuestAddress(R + i * 4096)).unwrap();
            let want = if i < 16 { i as u8 + 1 } else { (i - 16) as u8 + 0x81 };
            assert!(g.iter().all(|&x| x == want), "{mode}: read {i}");
        }
        // Flush to every namespace, then each file holds its own writes.
        assert_eq!(d.submit_ns(&[(0x00, 0xffff_ffff, 0, 0, 0)], 64)[0].1, 0);
        let (fa, fb) = (std::fs::read(&a.0).unwrap(), std::fs::read(&b.0).unwrap());
        for i in 0..16usize {
            assert!(fa[i * 4096..(i + 1) * 4096].iter().all(|&x| x == i as u8 + 1), "{mode}: file a block {i}");
            assert!(fb[i * 4096..(i + 1) * 4096].iter().all(|&x| x == i as u8 + 0x81), "{mode}: file b block {i}");
        }
        assert_eq!(counter(&d.n, "namespaces"), 3);
        assert_eq!(counter(&d.n, "io.writes"), 32, "{mode}");
        d.n.quiesce();
    }
}

impl Drv {
    /// Submits (opcode, nsid, slba, nlb - 1, prp1) at the SQ tail of pair 1
    /// (`size` entries, at IOSQ/IOCQ), one doorbell; waits for them all.
    fn submit_ns(&mut self, cmds: &[(u8, u32, u64, u32, u64)], size: u16) -> Vec<(u16, u16)> {
        for &(op, nsid, slba, nlb0, prp1) in cmds {
            let e = self.sqe(op, nsid, prp1, 0, [slba as u32, (slba >> 32) as u32, nlb0, 0]);
            self.mem.write_slice(&e, GuestAddress(IOSQ + self.iotail as u64 * 64)).unwrap();
            self.iotail = (self.iotail + 1) % size;
        }
        self.w32(DOORBELLS + 8, self.iotail as u32);
        self.reap_batch(cmds.len(), IOCQ, size)
    }
}

#[test]
fn namespace_options_are_checked_across_each_other() {
    let e = |c: NvmeConfig| Nvme::new(c).err().map(|e| e.to_string()).unwrap_or_default();
    let file = |p: &str| StorageKind::File(p.into());
    assert!(e(NvmeConfig { namespaces: 33, ..mmio(StorageKind::Null) }).contains("namespaces"));
    let many = vec![ns(StorageKind::Null, 1 << 20, 512); 31];
    assert!(e(NvmeConfig { namespaces: 2, ns: many.clone(), ..mmio(StorageKind::Null) }).contains("33 namespaces"));
    Nvme::new(NvmeConfig { ns: many, ..mmio(StorageKind::Null) }).unwrap();
    assert!(e(NvmeConfig { namespaces: 2, ..mmio(file("/tmp/x")) }).contains("namespaces=N clones"));
    let twice =
        NvmeConfig { ns: vec![ns(file("/tmp/iopath-same.img"), 1 << 20, 512)], ..mmio(file("/tmp/iopath-same.img")) };
    assert!(e(twice).contains("backs two namespaces"));
    let odd = NvmeConfig { ns: vec![ns(StorageKind::Ram, 4096 + 512, 4096)], ..mmio(StorageKind::Null) };
    assert!(e(odd).contains("namespace 2: size"));
    let pollers = NvmeConfig {
        doorbell: DoorbellMode::Shm,
        pollers: 2,
        ns: vec![ns(file("/tmp/x.img"), 1 << 20, 512)],
        ..mmio(StorageKind::Null)
    };
    assert!(e(pollers).contains("pollers"));
}

/// Detach and attach at run time: the namespace leaves and rejoins the
/// active list (the allocated list keeps it), I/O to it gets 0x0b while
/// detached and finds its data again after, the Changed Namespace List log
/// names it (once, cleared as read), and an AER completes with the notice
/// once the host enabled Namespace Attribute Notices.
#[test]
fn a_namespace_detached_at_run_time_leaves_the_active_list_and_the_host_is_told() {
    const BUF: u64 = 0x40000;
    for pollers in [1u8, 2] {
        let cfg = NvmeConfig {
            doorbell: if pollers > 1 { DoorbellMode::Shm } else { DoorbellMode::Mmio },
            pollers,
            ..four()
        };
        let mut d = Drv::new(cfg);
        d.io_queues(16);
        let (_, c) = d.admin_data(0x06, 0, [1, 0, 0, 0], 4096);
        assert_eq!(u32::from_le_bytes(c[92..96].try_into().unwrap()) & 1 << 8, 1 << 8, "OAES: namespace notices");
        d.mem.write_slice(&[0x22; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(d.io_ns(0x01, 2, 3, 0, BUF, 16), 0);
        let active = |d: &mut Drv, cns: u32| {
            let (_, l) = d.admin_data(0x06, 0, [cns, 0, 0, 0], 4096);
            l.chunks(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).take_while(|&n| n != 0).collect::<Vec<_>>()
        };
        let changed = |d: &mut Drv| {
            let (st, l) = d.admin_data(0x02, 0xffff_ffff, [4 | 1023 << 16, 0, 0, 0], 4096); // RAE clear: read and cleared
            assert_eq!(st, 0);
            l.chunks(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).take_while(|&n| n != 0).collect::<Vec<_>>()
        };
        // Notices off (the default): logged, no event.
        assert!(d.n.set_attached(2, false).unwrap());
        assert!(!d.n.set_attached(2, false).unwrap(), "detached already");
        assert!(d.n.set_attached(9, false).is_err());
        assert_eq!(active(&mut d, 2), [1, 3, 4]);
        assert_eq!(active(&mut d, 0x10), [1, 2, 3, 4], "still allocated");
        let (st, n) = d.admin_data(0x06, 2, [0, 0, 0, 0], 4096);
        assert!(st == 0 && n.iter().all(|&b| b == 0), "inactive: Identify Namespace is zeros");
        assert_eq!(le64(&d.admin_data(0x06, 2, [0x11, 0, 0, 0], 4096).1), 2048, "11h: allocated, its size");
        assert_eq!(d.io_ns(0x02, 2, 3, 0, BUF, 16), status::INVALID_NAMESPACE);
        assert_eq!(changed(&mut d), [2]);
        assert_eq!(changed(&mut d), Vec::<u32>::new(), "cleared as read");
        // Notices on: the attach raises one.
        assert_eq!(d.admin(0x09, 0, 0, 0, [0x0b, 1 << 8, 0, 0]).1, 0);
        let aer = d.submit_aer();
        assert!(d.reap(ACQ, 32, true).is_none(), "no event yet");
        assert!(d.n.set_attached(2, true).unwrap());
        let (dw0, st) = d.reap(ACQ, 32, true).expect("the notice completes the AER");
        d.w32(DOORBELLS + 4, d.ahead as u32);
        assert_eq!((dw0, st), (2 | 4 << 16, 0), "notice, namespace attribute changed, log 04h (AER cid {aer})");
        assert_eq!(changed(&mut d), [2]);
        assert_eq!(active(&mut d, 2), [1, 2, 3, 4]);
        d.mem.write_slice(&[0; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(d.io_ns(0x02, 2, 3, 0, BUF, 16), 0);
        let mut got = [0u8; 512];
        d.mem.read_slice(&mut got, GuestAddress(BUF)).unwrap();
        assert!(got.iter().all(|&b| b == 0x22), "pollers={pollers}: its data kept");
        d.n.quiesce();
    }
}
