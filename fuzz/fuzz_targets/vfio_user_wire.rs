//! Every vfio-user decoder in `protocols::vfio_user::wire` on hostile bytes. The input is a
//! message as it comes off the socket (16-byte header, payload): the header and message framing
//! are checked, then every payload decoder runs on the payload (the bytes after the header,
//! whatever the header says), as requests are cut by a server (`fixed_part`) and as replies are
//! read by the proxy. Nothing may panic; whatever parses re-encodes without panicking, and where
//! the codec is lossless the re-encoding parses back to the same value.

#![no_main]

use iopath_protocols::vfio_user::wire::*;
use libfuzzer_sys::fuzz_target;
use std::fmt::Debug;

/// `parse(enc(parse(b)))` equals `parse(b)` whenever `parse(b)` succeeds.
fn round_trip<T: PartialEq + Debug>(
    what: &str,
    b: &[u8],
    parse: impl Fn(&[u8]) -> Result<T, WireError>,
    enc: impl Fn(&T) -> Vec<u8>,
) -> Option<T> {
    let v = parse(b).ok()?;
    let e = enc(&v);
    match parse(&e) {
        Ok(w) => assert_eq!(v, w, "{what}: the re-encoding {e:02x?} parses differently"),
        Err(err) => panic!("{what}: the re-encoding {e:02x?} of {v:?} does not parse: {err}"),
    }
    Some(v)
}

fn header_and_message(data: &[u8]) {
    if let Some(h) = data.first_chunk::<HEADER_SIZE>() {
        let hdr = Header::parse(h);
        assert_eq!(&hdr.to_bytes(), h, "the header is not re-encoded bit for bit");
        let _ = (hdr.command(), hdr.is_reply(), hdr.no_reply(), hdr.is_error(), hdr.payload_len());
        let _ = error_reply(&hdr, -22);
    }
    if let Ok((hdr, payload)) = parse_message(data) {
        assert_eq!(hdr.msg_size as usize, data.len());
        let cmd = hdr.command().unwrap_or(Command::DeviceReset);
        let m = message(hdr.msg_id, cmd, hdr.flags, payload);
        let (h2, p2) = parse_message(&m).expect("a rebuilt message does not parse");
        assert_eq!((h2.msg_id, h2.flags, p2), (hdr.msg_id, hdr.flags, payload));
        let r = reply(&hdr, payload);
        assert!(parse_message(&r).is_ok_and(|(h, _)| h.is_reply()));
    }
}

fn version(p: &[u8]) {
    let Some(v) = round_trip("version", p, Version::parse, Version::to_bytes) else { return };
    let theirs = v.caps();
    // A server's answer is a subset of the proposal and of what the server can do.
    let servers = [
        Capabilities::default(),
        Capabilities {
            max_msg_fds: 16,
            max_data_xfer_size: 1 << 20,
            max_dma_maps: 65535,
            pgsizes: !0xfff,
            write_multiple: true,
            state_memory: Some(1 << 20),
        },
    ];
    for s in servers {
        if let Some(a) = s.answer(&theirs) {
            assert!(a.max_msg_fds <= theirs.max_msg_fds.min(s.max_msg_fds));
            assert!(a.max_data_xfer_size <= theirs.max_data_xfer_size.min(s.max_data_xfer_size));
            assert!(a.max_dma_maps <= theirs.max_dma_maps.min(s.max_dma_maps));
            assert!(a.pgsizes != 0 && a.pgsizes & !(theirs.pgsizes & s.pgsizes) == 0);
            assert!(!a.write_multiple || (theirs.write_multiple && s.write_multiple));
            // State memory is the server's device's to answer, never the generic answer's.
            assert_eq!(a.state_memory, None);
            assert_eq!(Capabilities::from_json(&a.to_json()).ok(), Some(a), "an answer's JSON does not read back");
        } else {
            assert_eq!(theirs.pgsizes & s.pgsizes, 0);
        }
    }
}

fn region_info(p: &[u8]) {
    round_trip("region_info", fixed_part(p, REGION_INFO_SIZE), RegionInfo::parse, RegionInfo::to_bytes);
    let Ok(r) = RegionInfoReply::parse(p) else { return };
    // Other capabilities are skipped and the chain is rebuilt at 32: no byte equality, but
    // the reply a server would build from what was read must read back as itself.
    let _ = (r.to_bytes(), r.is_truncated());
    let i = r.info;
    let rebuilt = RegionInfoReply::new(i.index, i.flags, i.size, i.offset, r.sparse_mmap.clone());
    let enc = rebuilt.to_bytes();
    assert_eq!(RegionInfoReply::parse(&enc).ok().as_ref(), Some(&rebuilt), "rebuilt region info {enc:02x?}");
    let cut = rebuilt.clone().fit(i.argsz.min(REGION_INFO_SIZE as u32));
    let enc = cut.to_bytes();
    assert_eq!(RegionInfoReply::parse(&enc).ok().as_ref(), Some(&cut), "truncated region info {enc:02x?}");
    assert_eq!(cut.is_truncated(), rebuilt.sparse_mmap.is_some());
}

fn io_fds(p: &[u8]) {
    round_trip("region_io_fds request", fixed_part(p, INFO16_SIZE), IoFdsRequest::parse, IoFdsRequest::to_bytes);
    if let Some(r) = round_trip("region_io_fds reply", p, IoFdsReply::parse, IoFdsReply::to_bytes) {
        let _ = (r.is_truncated(), r.entries.iter().map(IoFdEntry::fd_index).max());
        // What a server builds from these entries reads back as itself.
        let built = IoFdsReply::new(r.index, r.entries.clone());
        let enc = built.to_bytes();
        assert_eq!(IoFdsReply::parse(&enc).ok().as_ref(), Some(&built), "rebuilt io fds reply {enc:02x?}");
        let cut = built.clone().fit(INFO16_SIZE as u32);
        assert_eq!(IoFdsReply::parse(&cut.to_bytes()).ok().as_ref(), Some(&cut));
    }
}

fn accesses(p: &[u8]) {
    round_trip("region access", p, RegionAccess::parse, RegionAccess::to_bytes);
    round_trip("dma access", p, DmaAccess::parse, DmaAccess::to_bytes);
    if let Ok((a, d)) = RegionAccess::parse_with_data(p) {
        assert_eq!(a.count as usize, d.len());
        assert_eq!(RegionAccess::to_bytes_with_data(a.offset, a.region, d), p);
    }
    if let Ok((a, d)) = DmaAccess::parse_with_data(p) {
        assert_eq!(a.count as usize, d.len());
        assert_eq!(DmaAccess::to_bytes_with_data(a.address, d), p);
    }
    if let Some(m) = round_trip("region_write_multi", p, RegionWriteMulti::parse, RegionWriteMulti::to_bytes) {
        for w in &m.writes {
            assert!(w.bytes().len() <= WRITE_MULTI_DATA);
            assert_eq!(WriteOne::new(w.offset, w.region, w.bytes()).map(|n| n.bytes().len()), Some(w.bytes().len()));
        }
    }
    round_trip("region_write_multi reply", p, RegionWriteMultiReply::parse, RegionWriteMultiReply::to_bytes);
}

fn payload_decoders(p: &[u8]) {
    version(p);
    round_trip("dma_map", fixed_part(p, DMA_MAP_SIZE), DmaMap::parse, DmaMap::to_bytes);
    round_trip("dma_unmap", fixed_part(p, DMA_UNMAP_SIZE), DmaUnmap::parse, DmaUnmap::to_bytes);
    round_trip("dma_unmap reply", p, DmaUnmap::parse, DmaUnmap::to_bytes);
    round_trip("device_info", fixed_part(p, INFO16_SIZE), DeviceInfo::parse, DeviceInfo::to_bytes);
    round_trip("device_info reply", p, DeviceInfo::parse, DeviceInfo::to_bytes);
    round_trip("device_feature", p, DeviceFeature::parse, DeviceFeature::to_bytes).map(|f| f.feature());
    region_info(p);
    io_fds(p);
    round_trip("irq_info", fixed_part(p, INFO16_SIZE), IrqInfo::parse, IrqInfo::to_bytes);
    round_trip("irq_info reply", p, IrqInfo::parse, IrqInfo::to_bytes);
    round_trip("set_irqs", p, IrqSet::parse, IrqSet::to_bytes);
    accesses(p);
    let _ = expect_empty("reply", p);
}

fuzz_target!(|data: &[u8]| {
    header_and_message(data);
    payload_decoders(data.get(HEADER_SIZE..).unwrap_or(data));
});
