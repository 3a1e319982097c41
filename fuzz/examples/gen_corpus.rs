//! Writes the seed corpora under fuzz/corpus/<target>/: valid messages built with the
//! project's own encoders, a real guest image, real `@row` lines, and NVMe driver sessions.
//! Run it (plain stable cargo, no fuzzing flags) after a wire format changes:
//!
//! ```text
//! cd fuzz && cargo run --example gen_corpus
//! ```
//! Files are named by content, so a re-run only adds what changed; remove a stale seed by hand.

use iopath_fuzz::nvme::{self as nv, Op};
use iopath_protocols::mpqemu::wire::{Msg, SysmemRegion};
use iopath_protocols::vfio_user::ioregionfd::wire::{Cmd, CMD_READ, CMD_WRITE};
use iopath_protocols::vfio_user::wire::*;
use std::path::{Path, PathBuf};

struct Out {
    dir: PathBuf,
    n: usize,
}

impl Out {
    fn new(root: &Path, target: &str) -> Out {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        Out { dir, n: 0 }
    }

    fn put(&mut self, name: &str, bytes: &[u8]) {
        let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        std::fs::write(self.dir.join(format!("{name}-{h:016x}")), bytes).unwrap();
        self.n += 1;
    }
}

fn vfio_user(o: &mut Out) {
    let caps = Capabilities {
        max_msg_fds: 16,
        max_data_xfer_size: 1 << 20,
        max_dma_maps: 64,
        pgsizes: 4096,
        write_multiple: true,
        state_memory: None,
    };
    let v = Version { major: VERSION_MAJOR, minor: VERSION_MINOR, capabilities: Some(caps) };
    o.put("version", &message(1, Command::Version, 0, &v.to_bytes()));
    let bare = Version { major: 0, minor: 2, capabilities: None };
    o.put("version-bare", &message(1, Command::Version, FLAGS_TYPE_REPLY, &bare.to_bytes()));
    let raw =
        [&[0, 0, 2, 0][..], b"{\"capabilities\":{\"max_msg_fds\":4,\"migration\":{},\"twin_socket\":{}}}\0"].concat();
    o.put("version-json", &message(2, Command::Version, 0, &raw));

    let map = DmaMap { flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE, offset: 0, address: 0, size: 1 << 30 };
    o.put("dma-map", &message(3, Command::DmaMap, 0, &map.to_bytes()));
    let unmap = DmaUnmap::new(0, 0x10_0000, 0x1000);
    o.put("dma-unmap", &message(4, Command::DmaUnmap, 0, &unmap.to_bytes()));
    o.put("dma-unmap-all", &message(4, Command::DmaUnmap, 0, &DmaUnmap::new(DMA_UNMAP_FLAG_ALL, 0, 0).to_bytes()));
    let h = Header { msg_id: 4, cmd: Command::DmaUnmap as u16, msg_size: 0, flags: 0, error_no: 0 };
    o.put("dma-unmap-reply", &reply(&h, &unmap.to_bytes()));
    o.put("error-reply", &error_reply(&h, 22));

    o.put("device-info", &message(5, Command::DeviceGetInfo, 0, &DeviceInfo::request().to_bytes()));
    let info = DeviceInfo { argsz: 16, flags: DEVICE_FLAGS_RESET | DEVICE_FLAGS_PCI, num_regions: 9, num_irqs: 5 };
    o.put("device-info-reply", &message(5, Command::DeviceGetInfo, FLAGS_TYPE_REPLY, &info.to_bytes()));

    o.put("region-info", &message(6, Command::DeviceGetRegionInfo, 0, &RegionInfo::request(0, 4096).to_bytes()));
    let areas = vec![SparseMmapArea { offset: 0x1000, size: 0x1000 }, SparseMmapArea { offset: 0x3000, size: 0x1000 }];
    let flags = REGION_INFO_FLAG_READ | REGION_INFO_FLAG_WRITE | REGION_INFO_FLAG_MMAP;
    let r = RegionInfoReply::new(0, flags, 0x4000, 0, Some(areas));
    o.put("region-info-sparse", &message(6, Command::DeviceGetRegionInfo, FLAGS_TYPE_REPLY, &r.to_bytes()));
    let t = r.clone().fit(32);
    o.put("region-info-truncated", &message(6, Command::DeviceGetRegionInfo, FLAGS_TYPE_REPLY, &t.to_bytes()));
    // A chain: a TYPE capability (skipped) at 32, then the sparse mmap capability.
    let mut chain = RegionInfo {
        argsz: 32 + 16 + 32,
        flags: flags | REGION_INFO_FLAG_CAPS,
        index: 1,
        cap_offset: 32,
        size: 0x2000,
        offset: 0,
    }
    .to_bytes();
    chain.extend_from_slice(&[2, 0, 1, 0, 48, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    chain.extend_from_slice(&[1, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    chain.extend_from_slice(&[0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0]);
    o.put("region-info-chain", &message(6, Command::DeviceGetRegionInfo, FLAGS_TYPE_REPLY, &chain));

    let q = IoFdsRequest { argsz: 1024, index: 0 };
    o.put("io-fds", &message(7, Command::DeviceGetRegionIoFds, 0, &q.to_bytes()));
    let entries = vec![
        IoFdEntry::IoEventFd {
            offset: 0x1000,
            size: 4,
            fd_index: 0,
            flags: KVM_IOEVENTFD_FLAG_DATAMATCH,
            datamatch: 1,
        },
        IoFdEntry::IoRegionFd { offset: 0, size: 0x1000, fd_index: 1, flags: KVM_IOREGION_POSTED_WRITES, user_data: 7 },
    ];
    let rep = IoFdsReply::new(0, entries.clone());
    o.put("io-fds-reply", &message(7, Command::DeviceGetRegionIoFds, FLAGS_TYPE_REPLY, &rep.to_bytes()));
    let mut wide = entries;
    wide.push(IoFdEntry::ShadowIoEventFd {
        offset: 0x1008,
        size: 4,
        fd_index: 2,
        flags: 0,
        shadow_fd_index: 3,
        shadow_offset: 0x8,
        datamatch: 0,
    });
    let rep = IoFdsReply::new(0, wide);
    o.put("io-fds-reply-shadow", &message(7, Command::DeviceGetRegionIoFds, FLAGS_TYPE_REPLY, &rep.to_bytes()));
    o.put("io-fds-reply-head", &message(7, Command::DeviceGetRegionIoFds, FLAGS_TYPE_REPLY, &rep.fit(16).to_bytes()));

    o.put("irq-info", &message(8, Command::DeviceGetIrqInfo, 0, &IrqInfo::request(PCI_MSIX_IRQ_INDEX).to_bytes()));
    let ii = IrqInfo { argsz: 16, flags: IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE, index: 2, count: 65 };
    o.put("irq-info-reply", &message(8, Command::DeviceGetIrqInfo, FLAGS_TYPE_REPLY, &ii.to_bytes()));
    let set =
        IrqSet { flags: IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER, index: 2, start: 0, count: 2, data: vec![] };
    o.put("set-irqs-eventfd", &message(9, Command::DeviceSetIrqs, 0, &set.to_bytes()));
    let set =
        IrqSet { flags: IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_MASK, index: 0, start: 0, count: 3, data: vec![1, 0, 1] };
    o.put("set-irqs-bool", &message(9, Command::DeviceSetIrqs, 0, &set.to_bytes()));

    let rd = RegionAccess { offset: 0x1c, region: 0, count: 4 };
    o.put("region-read", &message(10, Command::RegionRead, 0, &rd.to_bytes()));
    let data = RegionAccess::to_bytes_with_data(0x1c, 0, &[1, 0, 0, 0]);
    o.put("region-read-reply", &message(10, Command::RegionRead, FLAGS_TYPE_REPLY, &data));
    o.put("region-write", &message(11, Command::RegionWrite, 0, &data));
    o.put("region-write-reply", &message(11, Command::RegionWrite, FLAGS_TYPE_REPLY, &rd.to_bytes()));
    o.put("dma-read", &message(12, Command::DmaRead, 0, &DmaAccess { address: 0x2000, count: 8 }.to_bytes()));
    let dw = DmaAccess::to_bytes_with_data(0x2000, &[0xaa; 8]);
    o.put("dma-write", &message(13, Command::DmaWrite, 0, &dw));
    o.put("device-reset", &message(14, Command::DeviceReset, FLAGS_NO_REPLY, &[]));

    let multi = RegionWriteMulti {
        writes: vec![WriteOne::new(0x1000, 0, &[1, 0, 0, 0]).unwrap(), WriteOne::new(0x1008, 0, &[2, 0]).unwrap()],
    };
    o.put("write-multi", &message(15, Command::RegionWriteMulti, 0, &multi.to_bytes()));
    let mr = RegionWriteMultiReply { wr_cnt: 2 };
    o.put("write-multi-reply", &message(15, Command::RegionWriteMulti, FLAGS_TYPE_REPLY, &mr.to_bytes()));
    let feat = DeviceFeature { argsz: 16, flags: DEVICE_FEATURE_PROBE | DEVICE_FEATURE_GET | 3, data: vec![0; 8] };
    o.put("device-feature", &message(16, Command::DeviceFeature, 0, &feat.to_bytes()));
}

fn mpqemu(o: &mut Out) {
    let regions = vec![
        SysmemRegion { gpa: 0, size: 0xa0000, offset: 0 },
        SysmemRegion { gpa: 0x10_0000, size: 0x3ff0_0000, offset: 0x10_0000 },
    ];
    let msgs = [
        ("sync-sysmem", Msg::SyncSysmem(regions)),
        ("ret", Msg::Ret(0x1234)),
        ("cfg-write", Msg::CfgWrite { addr: 4, val: 6, len: 2 }),
        ("cfg-read", Msg::CfgRead { addr: 0, len: 4 }),
        ("bar-write", Msg::BarWrite { addr: 0xfebf_1000, val: 1, size: 4, memory: true }),
        ("bar-read", Msg::BarRead { addr: 0xc000, size: 2, memory: false }),
        ("set-irqfd", Msg::SetIrqfd),
        ("device-reset", Msg::DeviceReset),
    ];
    for (name, m) in msgs {
        let nfds = match &m {
            Msg::SyncSysmem(r) => r.len() as u8,
            Msg::SetIrqfd => 2,
            _ => 0,
        };
        o.put(name, &iopath_fuzz::mpqemu::encode(nfds, &m.encode()));
    }
    // QEMU's remote answers DEVICE_RESET with an empty RET.
    o.put("ret-empty", &iopath_fuzz::mpqemu::encode(0, &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]));
}

fn ioregionfd(o: &mut Out) {
    let r = Cmd { cmd: CMD_READ, size_exponent: 2, resp: true, user_data: 7, offset: 0x1c, data: 0 };
    let w = Cmd { cmd: CMD_WRITE, size_exponent: 3, resp: false, user_data: 7, offset: 0x1000, data: 5 };
    let wr = Cmd { resp: true, size_exponent: 0, ..w };
    o.put("read", &r.encode());
    o.put("stream", &[r.encode(), w.encode(), wr.encode()].concat());
}

fn elf(o: &mut Out) {
    // The real guest image, cut after the last byte its segments load.
    let img = iopath_guest::IMAGE;
    let phoff = u32::from_le_bytes(img[28..32].try_into().unwrap()) as usize;
    let phnum = u16::from_le_bytes(img[44..46].try_into().unwrap()) as usize;
    let end = (0..phnum)
        .map(|i| {
            let ph = &img[phoff + 32 * i..];
            let (off, filesz) =
                (u32::from_le_bytes(ph[4..8].try_into().unwrap()), u32::from_le_bytes(ph[16..20].try_into().unwrap()));
            (off + filesz) as usize
        })
        .max()
        .unwrap();
    o.put("guest", &img[..end.max(4096).min(img.len())]);
    o.put("guest-head", &img[..4096]);
    // Hand-built: ELF32 and ELF64, one PT_LOAD of 16 bytes at 1 MiB, memsz 4 KiB, and a
    // multiboot header in the data.
    let mb = [0x1bad_b002u32, 0, 0u32.wrapping_sub(0x1bad_b002)];
    let data: Vec<u8> = mb.iter().flat_map(|w| w.to_le_bytes()).chain([0xf4; 4]).collect();
    let mut e32 = vec![0u8; 0x54];
    e32[..6].copy_from_slice(b"\x7fELF\x01\x01");
    e32[24..28].copy_from_slice(&0x10_000cu32.to_le_bytes());
    e32[28..32].copy_from_slice(&52u32.to_le_bytes());
    e32[42..44].copy_from_slice(&32u16.to_le_bytes());
    e32[44..46].copy_from_slice(&1u16.to_le_bytes());
    let ph = 52;
    e32[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
    e32[ph + 4..ph + 8].copy_from_slice(&0x54u32.to_le_bytes());
    e32[ph + 12..ph + 16].copy_from_slice(&0x10_0000u32.to_le_bytes());
    e32[ph + 16..ph + 20].copy_from_slice(&(data.len() as u32).to_le_bytes());
    e32[ph + 20..ph + 24].copy_from_slice(&0x1000u32.to_le_bytes());
    e32.extend_from_slice(&data);
    o.put("elf32", &e32);
    let mut e64 = vec![0u8; 0x78];
    e64[..6].copy_from_slice(b"\x7fELF\x02\x01");
    e64[24..32].copy_from_slice(&0x10_000cu64.to_le_bytes());
    e64[32..40].copy_from_slice(&64u64.to_le_bytes());
    e64[54..56].copy_from_slice(&56u16.to_le_bytes());
    e64[56..58].copy_from_slice(&1u16.to_le_bytes());
    let ph = 64;
    e64[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
    e64[ph + 8..ph + 16].copy_from_slice(&0x78u64.to_le_bytes());
    e64[ph + 24..ph + 32].copy_from_slice(&0x10_0000u64.to_le_bytes());
    e64[ph + 32..ph + 40].copy_from_slice(&(data.len() as u64).to_le_bytes());
    e64[ph + 40..ph + 48].copy_from_slice(&0x1000u64.to_le_bytes());
    e64.extend_from_slice(&data);
    o.put("elf64", &e64);
}

fn records(o: &mut Out) {
    let run = "\
@guest version=1 tsc_khz=2000000 workload=exits
@pci bdf=00:01.0 vendor=0x1b36 device=0x0005 bar0=0xfebf0000
@row name=mmio-read group=mmio iters=1000 accesses=1000 cycles=1200000,1180000,1210000 count=3000
@row name=pio-write group=pio iters=1000 accesses=2000 cycles=900000 exits=2000
@row name=doorbell group=nvme status=unsupported reason=no-device
@nvme ios=4096 cycles=123456 depth=8
@done rc=0
";
    o.put("run", run.as_bytes());
    o.put(
        "malformed",
        b"@row name=x iters=ten accesses=5 cycles=1,,2\n@row group=y\n@fault rip=0x100000 vector=13\n@done rc=zz\n",
    );
}

fn nvme(o: &mut Out) {
    use nv::{sqe, DATA};
    let up = nv::SETUP_BRING_UP | nv::SETUP_IRQ_ACCEPT | nv::SETUP_MSIX_ON;
    let cid = std::cell::Cell::new(0u16);
    let next = || {
        cid.set(cid.get() + 1);
        cid.get()
    };
    let admin = |op: u8, nsid: u32, prp1: u64, prp2: u64, cdw: [u32; 6]| {
        [Op::Submit { q: 0, sqe: sqe(op, next(), nsid, prp1, prp2, cdw) }, Op::Reap { q: 0 }]
    };
    let (iocq, iosq) = (nv::iocq(1), nv::iosq(1));
    let qsize = (nv::IO_ENTRIES as u32 - 1) << 16;
    let mut ops: Vec<Op> = Vec::new();
    ops.extend(admin(0x06, 0, DATA, 0, [1, 0, 0, 0, 0, 0])); // Identify controller
    ops.extend(admin(0x06, 1, DATA, 0, [0, 0, 0, 0, 0, 0])); // Identify namespace
    ops.extend(admin(0x06, 1, DATA, 0, [3, 0, 0, 0, 0, 0])); // NS descriptors
    ops.extend(admin(0x09, 0, 0, 0, [7, 3 | 3 << 16, 0, 0, 0, 0])); // Number of queues
    ops.extend(admin(0x05, 0, iocq, 0, [1 | qsize, 1 | 2, 0, 0, 0, 0])); // Create I/O CQ 1, IEN, vector 0
    ops.extend(admin(0x01, 0, iosq, 0, [1 | qsize, 1 | 1 << 16, 0, 0, 0, 0])); // Create I/O SQ 1 on CQ 1
    let session = ops.clone();
    // I/O: write 8 KiB (PRP1 + PRP2), read it back, a 16 KiB read through a PRP list, flush,
    // write zeroes, DSM deallocate of two ranges.
    let io = |op: u8, prp1: u64, prp2: u64, cdw: [u32; 6]| {
        [Op::Submit { q: 1, sqe: sqe(op, next(), 1, prp1, prp2, cdw) }, Op::Reap { q: 1 }]
    };
    let list = DATA + 0x8000;
    let prps: Vec<u8> = [DATA + 0x1000, DATA + 0x2000, DATA + 0x3000].iter().flat_map(|p| p.to_le_bytes()).collect();
    let ranges = DATA + 0x9000;
    let mut dsm = vec![0u8; 32];
    dsm[4..8].copy_from_slice(&8u32.to_le_bytes());
    dsm[8..16].copy_from_slice(&0u64.to_le_bytes());
    dsm[20..24].copy_from_slice(&4u32.to_le_bytes());
    dsm[24..32].copy_from_slice(&16u64.to_le_bytes());
    let pattern: Vec<u8> = (0..255u32).map(|i| (i * 7 + 3) as u8).collect();
    let mut rw = session.clone();
    rw.push(Op::Mem { gpa: DATA as u32, data: pattern });
    rw.push(Op::Mem { gpa: list as u32, data: prps });
    rw.push(Op::Mem { gpa: ranges as u32, data: dsm });
    rw.extend(io(0x01, DATA, DATA + 0x1000, [8, 0, 15, 0, 0, 0]));
    rw.extend(io(0x02, DATA, DATA + 0x1000, [8, 0, 15, 0, 0, 0]));
    rw.extend(io(0x02, DATA, list, [0, 0, 31, 0, 0, 0]));
    rw.extend(io(0x00, 0, 0, [0; 6]));
    rw.extend(io(0x08, 0, 0, [4, 0, 3, 0, 0, 0]));
    rw.extend(io(0x09, ranges, 0, [1, 4, 0, 0, 0, 0]));
    rw.extend(io(0x02, DATA, 0, [200, 0, 0, 0, 0, 0])); // LBA out of range
    o.put("io", &nv::encode(up, &[], &rw));
    o.put("io-null-4k", &nv::encode(up | nv::SETUP_NULL | nv::SETUP_LBA4K, &[], &rw));

    // The guest's own bytes: an Identify in the admin SQ's first slot of the memory image, rung
    // by a plain doorbell write.
    let image = sqe(0x06, 0x77, 0, DATA, 0, [1, 0, 0, 0, 0, 0]);
    o.put(
        "image",
        &nv::encode(nv::SETUP_BRING_UP, &image, &[Op::Doorbell { idx: 0, v: 1 }, Op::Doorbell { idx: 1, v: 1 }]),
    );

    // Part of RAM reached by message (a vfio-user client without a memory fd): the same I/O,
    // a write straddling remote and mapped pages, the third pair with its CQ remote, and a
    // client that stops answering.
    let mut remote = rw.clone();
    let (cq3, sq3) = (nv::iocq(3), nv::iosq(3));
    remote.extend(admin(0x05, 0, cq3, 0, [3 | qsize, 1 | 2, 0, 0, 0, 0]));
    remote.extend(admin(0x01, 0, sq3, 0, [3 | qsize, 1 | 3 << 16, 0, 0, 0, 0]));
    remote.extend(io(0x01, 0x27000, 0x28000, [0, 0, 15, 0, 0, 0]));
    let cid3 = next();
    remote.push(Op::Submit { q: 3, sqe: sqe(0x02, cid3, 1, 0x27800, 0x28000, [0, 0, 7, 0, 0, 0]) });
    remote.push(Op::Reap { q: 3 });
    remote.push(Op::PortFail { on: true });
    remote.extend(io(0x02, DATA, 0, [0, 0, 0, 0, 0, 0]));
    remote.push(Op::PortFail { on: false });
    o.put("io-remote", &nv::encode(up | nv::SETUP_REMOTE, &[], &remote));

    // Admin odds and ends: features, log pages (with offsets), AERs, abort, bad doorbells that
    // raise an event, queue deletion.
    let mut adm = session.clone();
    adm.extend(admin(0x0c, 0, 0, 0, [0; 6])); // AER
    adm.extend(admin(0x0c, 0, 0, 0, [0; 6]));
    adm.push(Op::Doorbell { idx: 2, v: 99 }); // SQ 1 tail beyond the queue: an event
    adm.push(Op::Doorbell { idx: 20, v: 0 }); // a queue that does not exist
    adm.push(Op::Reap { q: 0 });
    adm.extend(admin(0x02, 0, DATA, 0, [0x01 | 15 << 16, 0, 0, 0, 0, 0])); // error log
    adm.extend(admin(0x02, 0, DATA, 0, [0x02 | 127 << 16, 0, 0, 0, 0, 0])); // SMART
    adm.extend(admin(0x02, 0, DATA, 0, [0x05 | 1023 << 16, 0, 16, 0, 0, 0])); // effects, offset 16
    adm.extend(admin(0x02, 0, DATA, DATA + 0x1000, [0x03 | 2047 << 16, 0, 0, 0, 0, 0])); // 8 KiB of firmware log
    for (fid, v) in
        [(1, 3), (2, 0x20), (4, 350), (5, 10), (6, 0), (8, 0x0a04), (9, 1 | 1 << 16), (0x0a, 1), (0x0b, 0xff)]
    {
        adm.extend(admin(0x09, 0, 0, 0, [fid, v, 0, 0, 0, 0]));
        adm.extend(admin(0x0a, 0, 0, 0, [fid, v & 0xffff, 0, 0, 0, 0]));
    }
    adm.extend(admin(0x08, 0, 0, 0, [1, 0, 0, 0, 0, 0])); // abort
    adm.extend(admin(0x7c, 0, DATA, DATA + 0x1000, [0; 6])); // doorbell buffer config: not in mmio
    adm.extend(admin(0x04, 0, 0, 0, [1, 0, 0, 0, 0, 0])); // delete CQ 1 while SQ 1 uses it
    adm.extend(admin(0x00, 0, 0, 0, [1, 0, 0, 0, 0, 0])); // delete SQ 1
    adm.extend(admin(0x04, 0, 0, 0, [1, 0, 0, 0, 0, 0])); // delete CQ 1
    adm.extend(admin(0xff, 0, 0, 0, [0; 6])); // unknown opcode
    o.put("admin", &nv::encode(up, &[], &adm));

    // Registers only: reads, a refused enable (bad AQA), an enable, shutdown, disable, MSI-X
    // table writes, a function-level reset, a client leaving.
    let regs = vec![
        Op::Read { bar: 0, off: 0, len: 8 },
        Op::Read { bar: 0, off: 0x1c, len: 4 },
        Op::Enable { aqa: 0, cc: nv::CC_ENABLE },
        Op::W32 { off: 0x14, v: 0 },
        Op::Enable { aqa: 31 << 16 | 31, cc: nv::CC_ENABLE },
        Op::W32 { off: 0x0c, v: 1 },
        Op::W32 { off: 0x10, v: 1 },
        Op::W64 { off: 0x2000, v: 0xfee0_0000 },
        Op::W32 { off: 0x2008, v: 0x41 },
        Op::W32 { off: 0x200c, v: 0 },
        Op::Config { off: 0x42, data: vec![0, 0xc0] },
        Op::Read { bar: 0, off: 0x3000, len: 8 },
        Op::Write { bar: 0, off: 0x2004, data: vec![1, 2] },
        Op::W32 { off: 0x14, v: nv::CC_ENABLE | 1 << 14 },
        Op::W32 { off: 0x14, v: 0 },
        Op::Reset,
        Op::Attach { gone: true },
        Op::Enable { aqa: 31 << 16 | 31, cc: nv::CC_ENABLE },
        Op::Attach { gone: false },
    ];
    o.put("registers", &nv::encode(nv::SETUP_HOST_TABLE, &[], &regs));
}

/// Schedules for the queue oracle: choice bytes from the oracle's own generator (any bytes are a
/// schedule), in mmio and each polled mode, with and without a device process's host.
fn nvme_queues(o: &mut Out) {
    use iopath_fuzz::nvme_queues::{encode, LBA_4K, STATIC_HOST, STEPS_SHIFT, TWO_POLLERS};
    let choices = |seed: u64, n: usize| -> Vec<u8> {
        let mut r = iopath_devices::nvme::oracle::Rng::new(seed);
        (0..n).flat_map(|_| r.next_u64().to_le_bytes()[..2].to_vec()).collect()
    };
    let long = 3 << STEPS_SHIFT;
    for seed in 0..4u64 {
        let flags = long | if seed % 2 == 1 { LBA_4K } else { 0 };
        o.put(&format!("mmio-{seed}"), &encode(0, flags, &choices(seed, 800)));
    }
    for (i, mode) in ["ioeventfd", "shm", "bar", "adaptive", "bar-adaptive", "auto"].iter().enumerate() {
        o.put(mode, &encode(10 + i as u8, 2 << STEPS_SHIFT, &choices(100 + i as u64, 400)));
        o.put(
            &format!("{mode}-static"),
            &encode(10 + i as u8, 2 << STEPS_SHIFT | STATIC_HOST | TWO_POLLERS, &choices(200 + i as u64, 400)),
        );
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    type Gen = fn(&mut Out);
    let gens: [(&str, Gen); 7] = [
        ("vfio_user_wire", vfio_user),
        ("mpqemu_wire", mpqemu),
        ("ioregionfd_wire", ioregionfd),
        ("nvme", nvme),
        ("nvme_queues", nvme_queues),
        ("elf_loader", elf),
        ("guest_records", records),
    ];
    for (target, gen) in gens {
        let mut o = Out::new(&root, target);
        gen(&mut o);
        println!("{target}: {} seeds in {}", o.n, o.dir.display());
    }
}
