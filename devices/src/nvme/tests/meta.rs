//! Namespaces with metadata (`meta.rs`): random reads and writes in both
//! modes (extended LBAs, a separate buffer at MPTR) against a reference
//! model of every block's data and metadata; protection information type
//! 1 checked and generated per PRINFO (a wrong tuple fails with its SCT 2
//! status and changes nothing); Identify Namespace's formats and Format
//! NVM switching between them; bad metadata pointers.

use super::*;
use crate::nvme::meta::{crc16_t10dif, APP_TAG_CHECK, GUARD_CHECK, REF_TAG_CHECK};
use crate::nvme::namespaces::{NsConfig, NsMeta};
use crate::nvme::oracle::Rng;

/// Page-aligned data buffer (up to 128 KiB + a block's metadata per page),
/// its PRP list, and the separate metadata buffer.
const BUF: u64 = 0x40000;
const LIST: u64 = 0x70000;
const MBUF: u64 = 0x80000;

/// PRACT and PRCHK (guard, app tag, ref tag) in CDW12.
const PRACT: u32 = 1 << 29;
const PRCHK_ALL: u32 = 7 << 26;

/// One command's fields beyond the LBA range.
#[derive(Clone, Copy, Default)]
struct Cmd {
    nsid: u32,
    /// CDW12 bits 31:16 (PRINFO, FUA ...).
    flags: u32,
    mptr: u64,
    cdw14: u32,
    cdw15: u32,
}

impl Drv {
    /// An I/O on queue 1 with `len` bytes of data at BUF (PRPs built for
    /// it) and `x`'s MPTR, CDW14 and CDW15; its status.
    fn io_meta(&mut self, op: u8, slba: u64, nlb: u32, len: usize, x: Cmd) -> u16 {
        let pages = len.div_ceil(4096) as u64;
        let prp2 = match pages {
            0 | 1 => 0,
            2 => BUF + 4096,
            _ => {
                for k in 1..pages {
                    self.mem.write_obj(BUF + k * 4096, GuestAddress(LIST + (k - 1) * 8)).unwrap();
                }
                LIST
            }
        };
        let mut e = self.sqe(op, x.nsid, BUF, prp2, [slba as u32, (slba >> 32) as u32, (nlb - 1) | x.flags, 0]);
        e[16..24].copy_from_slice(&x.mptr.to_le_bytes());
        e[56..60].copy_from_slice(&x.cdw14.to_le_bytes());
        e[60..64].copy_from_slice(&x.cdw15.to_le_bytes());
        self.mem.write_slice(&e, GuestAddress(IOSQ + self.iotail as u64 * 64)).unwrap();
        self.iotail = (self.iotail + 1) % 16;
        self.w32(DOORBELLS + 8, self.iotail as u32);
        let (_, st) = self.reap(IOCQ, 16, false).expect("mmio: completed at once");
        self.w32(DOORBELLS + 12, self.iohead as u32);
        st
    }
}

/// A namespace's blocks as the host should see them.
struct Model {
    lbs: usize,
    data: Vec<Vec<u8>>,
    meta: Vec<Vec<u8>>,
}

impl Model {
    fn new(lbs: usize, ms: usize, blocks: usize) -> Model {
        // Never written: zeros, and metadata as deallocated (all FFh).
        Model { lbs, data: vec![vec![0; lbs]; blocks], meta: vec![vec![0xff; ms]; blocks] }
    }
}

/// The PI tuple of `data` (big endian): guard, app tag, ref tag.
fn tuple(data: &[u8], app: u16, reft: u32) -> [u8; 8] {
    let mut t = [0u8; 8];
    t[0..2].copy_from_slice(&crc16_t10dif(data).to_be_bytes());
    t[2..4].copy_from_slice(&app.to_be_bytes());
    t[4..8].copy_from_slice(&reft.to_be_bytes());
    t
}

fn cfg(lba: u32, meta: NsMeta, backend: StorageKind) -> NvmeConfig {
    NvmeConfig { lba_size: lba, meta, ..mmio(backend) }
}

/// Writes `n` blocks at `slba` with the host's view of data and metadata
/// (laid out for the mode); returns the status.
fn write(d: &mut Drv, m: &Model, ext: bool, slba: u64, data: &[Vec<u8>], meta: &[Vec<u8>], x: Cmd) -> u16 {
    let host_ms = meta.first().map_or(0, |v| v.len());
    let mut host = Vec::new();
    for (k, b) in data.iter().enumerate() {
        host.extend_from_slice(b);
        if ext {
            host.extend_from_slice(&meta[k]);
        }
    }
    d.mem.write_slice(&host, GuestAddress(BUF)).unwrap();
    if !ext && host_ms > 0 {
        d.mem.write_slice(&meta.concat(), GuestAddress(MBUF)).unwrap();
    }
    let _ = m;
    d.io_meta(0x01, slba, data.len() as u32, host.len(), x)
}

/// Reads `n` blocks; (status, data, metadata) as the host got them
/// (`host_ms` metadata bytes per block reach it).
fn read(
    d: &mut Drv,
    m: &Model,
    ext: bool,
    slba: u64,
    n: usize,
    host_ms: usize,
    x: Cmd,
) -> (u16, Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let per = if ext { m.lbs + host_ms } else { m.lbs };
    d.mem.write_slice(&vec![0xa5; per * n], GuestAddress(BUF)).unwrap();
    d.mem.write_slice(&vec![0xa5; host_ms * n], GuestAddress(MBUF)).unwrap();
    let st = d.io_meta(0x02, slba, n as u32, per * n, x);
    let mut host = vec![0u8; per * n];
    d.mem.read_slice(&mut host, GuestAddress(BUF)).unwrap();
    let mut sep = vec![0u8; host_ms * n];
    d.mem.read_slice(&mut sep, GuestAddress(MBUF)).unwrap();
    let mut data = Vec::new();
    let mut meta = Vec::new();
    for k in 0..n {
        let b = &host[k * per..(k + 1) * per];
        data.push(b[..m.lbs].to_vec());
        meta.push(if ext { b[m.lbs..].to_vec() } else { sep[k * host_ms..(k + 1) * host_ms].to_vec() });
    }
    (st, data, meta)
}

/// Random writes and reads of 1-8 blocks against the model, in one mode;
/// with PI, each write carries correct tuples (checked with every PRCHK
/// bit) or asks the controller for them (PRACT), and every read checks.
fn random_io(lba: u32, ms: u16, ext: bool, pi: u8, backend: StorageKind, seed: u64) {
    let meta = NsMeta { ms, ext, pi, pi_first: false };
    let mut d = Drv::new(cfg(lba, meta, backend.clone()));
    d.io_queues(16);
    let (lbs, msz) = (lba as usize, ms as usize);
    let blocks = (1usize << 20) / lbs;
    let mut m = Model::new(lbs, msz, blocks);
    let null = backend == StorageKind::Null;
    let po = msz - 8;
    let mut r = Rng::new(seed);
    for step in 0..200u32 {
        let n = r.range(1, 8) as usize;
        let slba = r.below((blocks - n) as u64) as usize;
        let x = Cmd { nsid: 1, mptr: MBUF, cdw14: slba as u32, cdw15: 0xffff << 16 | 0x00c3, ..Default::default() };
        if r.chance(50) {
            let pract = pi != 0 && r.chance(30);
            let data: Vec<Vec<u8>> = (0..n).map(|_| (0..lbs).map(|_| r.next_u64() as u8).collect()).collect();
            let mut md: Vec<Vec<u8>> = (0..n).map(|_| (0..msz).map(|_| r.next_u64() as u8).collect()).collect();
            if pi != 0 && !pract {
                for k in 0..n {
                    md[k][po..].copy_from_slice(&tuple(&data[k], 0x00c3, (slba + k) as u32));
                }
            }
            let host_md: Vec<Vec<u8>> = if pract && msz == 8 { vec![vec![]; n] } else { md.clone() };
            let flags = if pract { PRACT } else { PRCHK_ALL };
            assert_eq!(write(&mut d, &m, ext, slba as u64, &data, &host_md, Cmd { flags, ..x }), 0, "step {step}");
            if null {
                continue;
            }
            for k in 0..n {
                m.data[slba + k] = data[k].clone();
                m.meta[slba + k] = md[k].clone();
                if pract {
                    m.meta[slba + k][po..].copy_from_slice(&tuple(&data[k], 0x00c3, (slba + k) as u32));
                }
            }
        } else {
            let strip = pi != 0 && msz == 8 && r.chance(30);
            let flags = if pi != 0 { PRCHK_ALL | if strip { PRACT } else { 0 } } else { 0 };
            let host_ms = if strip { 0 } else { msz };
            let (st, data, md) = read(&mut d, &m, ext, slba as u64, n, host_ms, Cmd { flags, ..x });
            assert_eq!(st, 0, "step {step}: read {n} at {slba}");
            for k in 0..n {
                let want_d = if null { vec![0u8; lbs] } else { m.data[slba + k].clone() };
                let want_m = if null { vec![0xffu8; msz] } else { m.meta[slba + k].clone() };
                assert!(data[k] == want_d, "step {step}: block {} data", slba + k);
                assert_eq!(md[k], want_m[..host_ms], "step {step}: block {} metadata", slba + k);
            }
        }
    }
}

#[test]
fn random_io_with_metadata_matches_the_model_in_both_modes() {
    for lba in [512u32, 4096] {
        for ms in [8u16, 16, 64] {
            for ext in [false, true] {
                for pi in [0u8, 1] {
                    random_io(lba, ms, ext, pi, StorageKind::Ram, (lba as u64) << 8 | (ms as u64) << 2 | ext as u64);
                }
            }
        }
    }
    random_io(512, 8, false, 1, StorageKind::Null, 5);
    random_io(4096, 16, true, 1, StorageKind::Null, 6);
}

#[test]
fn a_file_namespace_keeps_metadata_after_its_data_across_a_restart() {
    let p = std::env::temp_dir().join(format!("iopath-meta-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&p);
    let meta = NsMeta { ms: 16, ext: false, pi: 1, pi_first: false };
    let c = NvmeConfig { create: true, ..cfg(512, meta, StorageKind::File(p.clone())) };
    let data: Vec<Vec<u8>> = (0..4).map(|k| vec![k as u8 + 1; 512]).collect();
    let md: Vec<Vec<u8>> =
        (0..4u32).map(|k| [vec![0x70 + k as u8; 8], tuple(&data[k as usize], 7, 100 + k).to_vec()].concat()).collect();
    let x = Cmd { nsid: 1, flags: PRCHK_ALL, mptr: MBUF, cdw14: 100, cdw15: 0xffff << 16 | 7 };
    let m = Model::new(512, 16, 2048);
    {
        let mut d = Drv::new(c.clone());
        d.io_queues(16);
        assert_eq!(write(&mut d, &m, false, 100, &data, &md, x), 0);
    }
    assert_eq!(std::fs::metadata(&p).unwrap().len(), (1 << 20) + (1 << 17), "data, then an eighth for metadata");
    let mut d = Drv::new(NvmeConfig { create: false, ..c });
    d.io_queues(16);
    let (st, got, gm) = read(&mut d, &m, false, 100, 4, 16, x);
    assert_eq!((st, got, gm), (0, data, md));
    // Unwritten blocks: zeros and deallocated metadata.
    let (st, got, gm) = read(&mut d, &m, false, 0, 1, 16, x);
    assert_eq!((st, got[0].clone(), gm[0].clone()), (0, vec![0; 512], vec![0xff; 16]));
    std::fs::remove_file(&p).unwrap();
}

fn with_mptr(x: Cmd) -> Cmd {
    Cmd { mptr: MBUF, ..x }
}

#[test]
fn a_wrong_pi_tuple_fails_with_its_status_and_writes_nothing() {
    let meta = NsMeta { ms: 8, ext: false, pi: 1, pi_first: false };
    let mut d = Drv::new(cfg(512, meta, StorageKind::Ram));
    d.io_queues(16);
    let m = Model::new(512, 8, 2048);
    let old = vec![vec![0x11u8; 512]; 2];
    let good: Vec<Vec<u8>> = (0..2).map(|k| tuple(&old[k], 9, 40 + k as u32).to_vec()).collect();
    let x = with_mptr(Cmd { nsid: 1, flags: PRCHK_ALL, cdw14: 40, cdw15: 0xffff << 16 | 9, ..Default::default() });
    assert_eq!(write(&mut d, &m, false, 40, &old, &good, x), 0);
    let new = vec![vec![0x22u8; 512]; 2];
    let mut md: Vec<Vec<u8>> = (0..2).map(|k| tuple(&new[k], 9, 40 + k as u32).to_vec()).collect();
    // The second block's guard planted wrong: 82h, neither block written.
    md[1][1] ^= 0x40;
    assert_eq!(write(&mut d, &m, false, 40, &new, &md, x), GUARD_CHECK);
    let mut bad_ref: Vec<Vec<u8>> = (0..2).map(|k| tuple(&new[k], 9, 40 + k as u32).to_vec()).collect();
    bad_ref[0][7] ^= 1;
    assert_eq!(write(&mut d, &m, false, 40, &new, &bad_ref, x), REF_TAG_CHECK);
    let bad_app: Vec<Vec<u8>> = (0..2).map(|k| tuple(&new[k], 8, 40 + k as u32).to_vec()).collect();
    assert_eq!(write(&mut d, &m, false, 40, &new, &bad_app, x), APP_TAG_CHECK);
    // Unchecked bits pass: the app tag without PRCHK bit 27, a mask that hides the difference.
    assert_eq!(write(&mut d, &m, false, 40, &new, &bad_app, Cmd { cdw15: 0xfffe << 16 | 9, ..x }), 0);
    let (st, got, gm) = read(&mut d, &m, false, 40, 2, 8, Cmd { cdw15: 0, flags: 5 << 26, ..x });
    assert_eq!((st, got, gm), (0, new.clone(), bad_app.clone()));
    assert_eq!(counter(&d.n, "pi.errors"), 3);
    assert!(counter(&d.n, "pi.checks") >= 10);
    // The guard stored, data changed behind it (planted in the backing): a checking read gets 82h.
    let (st, _, _) = read(&mut d, &m, false, 40, 2, 8, Cmd { cdw15: 0xffff << 16 | 8, ..x });
    assert_eq!(st, 0);
    assert_eq!(write(&mut d, &m, false, 40, &old, &good, x), 0);
    {
        let mut c = d.n.core.lock().unwrap();
        c.ns[0].storage.write(40 * 512 + 3, &[0xee]).unwrap();
    }
    let (st, _, _) = read(&mut d, &m, false, 40, 2, 8, x);
    assert_eq!(st, GUARD_CHECK);
    // Without PRCHK the read passes and returns what is stored.
    let (st, got, gm) = read(&mut d, &m, false, 40, 2, 8, Cmd { flags: 0, ..x });
    assert_eq!((st, gm), (0, good));
    assert_eq!(got[0][3], 0xee);
    // A metadata pointer outside guest memory: a transfer error, nothing written.
    let far = Cmd { mptr: 1 << 40, ..x };
    assert_eq!(write(&mut d, &m, false, 40, &new, &md, far), status::DATA_TRANSFER_ERROR);
    assert_eq!(read(&mut d, &m, false, 40, 2, 8, Cmd { flags: 0, ..far }).0, status::DATA_TRANSFER_ERROR);
    let edge = Cmd { mptr: (1 << 20) - 8, ..x };
    assert_eq!(write(&mut d, &m, false, 40, &new, &md, edge), status::DATA_TRANSFER_ERROR);
    let (_, got, _) = read(&mut d, &m, false, 40, 2, 8, Cmd { flags: 0, ..x });
    assert_eq!(got[1], old[1], "nothing written by the failed commands");
}

#[test]
fn write_zeroes_and_deallocate_leave_metadata_as_the_pi_rules_say() {
    let meta = NsMeta { ms: 8, ext: true, pi: 1, pi_first: false };
    let mut d = Drv::new(cfg(512, meta, StorageKind::Ram));
    d.io_queues(16);
    let m = Model::new(512, 8, 2048);
    let data = vec![vec![0x33u8; 512]; 4];
    let x = Cmd { nsid: 1, flags: PRACT, cdw14: 8, cdw15: 0xffff << 16 | 5, ..Default::default() };
    assert_eq!(write(&mut d, &m, true, 8, &data, &vec![vec![]; 4], x), 0);
    // Write Zeroes with PRACT: PI generated for the zeros (guard 0).
    let e = d.sqe(0x08, 1, 0, 0, [8, 0, 1 | PRACT, 0]);
    let mut e = e;
    e[56..60].copy_from_slice(&8u32.to_le_bytes());
    e[60..64].copy_from_slice(&(0xffffu32 << 16 | 5).to_le_bytes());
    d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
    d.iotail = (d.iotail + 1) % 16;
    d.w32(DOORBELLS + 8, d.iotail as u32);
    assert_eq!(d.reap(IOCQ, 16, false).unwrap().1, 0);
    d.w32(DOORBELLS + 12, d.iohead as u32);
    let (st, got, gm) = read(&mut d, &m, true, 8, 4, 8, Cmd { flags: PRCHK_ALL, ..x });
    assert_eq!(st, 0);
    assert_eq!(got[..2], vec![vec![0u8; 512]; 2][..]);
    assert_eq!(gm[0], tuple(&[0u8; 512], 5, 8));
    assert_eq!(gm[1], tuple(&[0u8; 512], 5, 9));
    assert_eq!(gm[2], tuple(&data[2], 5, 10), "untouched past the range");
    // Deallocate (Dataset Management, AD): deallocated metadata.
    d.mem.write_slice(&[0u8; 16], GuestAddress(DATA)).unwrap();
    d.mem.write_obj(4u32, GuestAddress(DATA + 4)).unwrap();
    d.mem.write_obj(8u64, GuestAddress(DATA + 8)).unwrap();
    let e = d.sqe(0x09, 1, DATA, 0, [0, 4, 0, 0]);
    d.mem.write_slice(&e, GuestAddress(IOSQ + d.iotail as u64 * 64)).unwrap();
    d.iotail = (d.iotail + 1) % 16;
    d.w32(DOORBELLS + 8, d.iotail as u32);
    assert_eq!(d.reap(IOCQ, 16, false).unwrap().1, 0);
    d.w32(DOORBELLS + 12, d.iohead as u32);
    let (st, got, gm) = read(&mut d, &m, true, 8, 4, 8, Cmd { flags: PRCHK_ALL, ..x });
    assert_eq!((st, got, gm), (0, vec![vec![0u8; 512]; 4], vec![vec![0xffu8; 8]; 4]));
}

#[test]
fn identify_lists_the_metadata_formats_and_format_nvm_switches_data_and_metadata() {
    let mut d = Drv::new(NvmeConfig {
        ns: vec![NsConfig { backend: StorageKind::Ram, size: 1 << 20, lba_size: 4096, ..Default::default() }],
        ..cfg(512, NsMeta { ms: 16, ext: true, pi: 1, pi_first: false }, StorageKind::Ram)
    });
    d.io_queues(16);
    let (st, n) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!(st, 0);
    assert_eq!(n[25], 7, "NLBAF: eight formats");
    let lbaf: Vec<(u16, u8)> =
        (0..8).map(|k| (u16::from_le_bytes([n[128 + 4 * k], n[129 + 4 * k]]), n[130 + 4 * k])).collect();
    assert_eq!(lbaf, [(0, 9), (0, 12), (8, 9), (16, 9), (64, 9), (8, 12), (16, 12), (64, 12)]);
    assert_eq!((n[26], n[27], n[28], n[29]), (3 | 1 << 4, 3, 0x19, 1), "FLBAS, MC, DPC, DPS");
    let (_, n2) = d.admin_data(0x06, 2, [0, 0, 0, 0], 4096);
    assert_eq!((n2[26], n2[29]), (1, 0), "namespace 2: LBAF 1, no PI");
    // Write a block with metadata, then format to 4096 + 8 separate, PI in the first bytes.
    let m = Model::new(512, 16, 2048);
    let blk = vec![vec![0x44u8; 512]];
    let md = vec![[vec![1u8; 8], tuple(&blk[0], 1, 3).to_vec()].concat()];
    let x = Cmd { nsid: 1, flags: PRCHK_ALL, cdw14: 3, cdw15: 0xffff << 16 | 1, ..Default::default() };
    assert_eq!(write(&mut d, &m, true, 3, &blk, &md, x), 0);
    // LBAF 5 (4096 + 8), MSET 0, PI 1, PIL 1.
    assert_eq!(d.admin(0x80, 1, 0, 0, [5 | 1 << 5 | 1 << 8, 0, 0, 0]).1, 0);
    let (_, n) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!((le(&n[0..8]), n[26], n[29]), (256, 5, 1 | 1 << 3), "NSZE, FLBAS, DPS");
    let m = Model::new(4096, 8, 256);
    let (st, got, gm) = read(&mut d, &m, false, 0, 1, 8, with_mptr(Cmd { cdw14: 0, ..x }));
    assert_eq!((st, got[0].iter().all(|&b| b == 0), gm[0].clone()), (0, true, vec![0xff; 8]), "erased");
    let blk = vec![vec![0x55u8; 4096]];
    let md = vec![tuple(&blk[0], 1, 0).to_vec()];
    assert_eq!(write(&mut d, &m, false, 0, &blk, &md, with_mptr(Cmd { cdw14: 0, ..x })), 0);
    let (st, got, gm) = read(&mut d, &m, false, 0, 1, 8, with_mptr(Cmd { cdw14: 0, ..x }));
    assert_eq!((st, got, gm), (0, blk, md));
    // Refused: PI types 2 and 3, PI without metadata, an LBAF not listed.
    for cdw10 in [2 | 2 << 5, 2 | 3 << 5, 1 << 5, 8] {
        assert_eq!(d.admin(0x80, 1, 0, 0, [cdw10, 0, 0, 0]).1, status::INVALID_FORMAT, "{cdw10:#x}");
    }
    // Back to LBAF 0: no metadata, the plain path.
    assert_eq!(d.admin(0x80, 1, 0, 0, [0, 0, 0, 0]).1, 0);
    let (_, n) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!((n[26], n[29]), (0, 0));
    d.mem.write_slice(&[0x66u8; 512], GuestAddress(BUF)).unwrap();
    assert_eq!(d.io(0x01, 0, 0, BUF, 0, 16), 0);
}

#[test]
fn a_file_namespace_without_ms_takes_only_the_formats_without_metadata() {
    let p = std::env::temp_dir().join(format!("iopath-meta-plain-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&p);
    let mut d = Drv::new(NvmeConfig { create: true, ..mmio(StorageKind::File(p.clone())) });
    assert_eq!(d.admin(0x80, 1, 0, 0, [2, 0, 0, 0]).1, status::INVALID_FORMAT);
    assert_eq!(d.admin(0x80, 1, 0, 0, [1, 0, 0, 0]).1, 0);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 1 << 20, "the file holds the data only");
    drop(d);
    std::fs::remove_file(&p).unwrap();
}

fn le(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap())
}

/// `pil=first` (the option) is what Format NVM's PIL sets: Identify Namespace's DPS says PI
/// in the first bytes.
#[test]
fn pil_first_is_reported_in_dps() {
    let mut d = Drv::new(cfg(512, NsMeta { ms: 16, ext: false, pi: 1, pi_first: true }, StorageKind::Ram));
    d.io_queues(16);
    let (st, n) = d.admin_data(0x06, 1, [0, 0, 0, 0], 4096);
    assert_eq!((st, n[29]), (0, 1 | 1 << 3), "DPS: type 1, first bytes");
    let parsed: crate::spec::DeviceConfig = "nvme,ms=16,pi=1,pil=first".parse().unwrap();
    assert!(parsed.to_string().ends_with(",ms=16,pi=1,pil=first"), "the option round-trips: {parsed}");
}
