//! The guest record parser (`bench::record`: `parse_row`, `fields`, `find_record`,
//! `GuestOutput::parse`) on arbitrary serial output. Nothing may panic; a line parses as a row
//! exactly when it is an `@row` line with a name.

#![no_main]

use iopath_bench::record::{fields, find_record, parse_row, GuestOutput};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let lines: Vec<&str> = text.lines().collect();
    for l in &lines {
        let f = fields(l);
        match parse_row(l) {
            Some(r) => {
                assert!(l.starts_with("@row "));
                let _ = (r.per_access(), r.status(), r.get_u64("count"));
            }
            None => assert!(!l.starts_with("@row ") || !f.contains_key("name"), "row not parsed: {l:?}"),
        }
    }
    let g = GuestOutput::parse(&lines);
    for r in &g.rows {
        assert!(g.row(&r.name).is_some());
    }
    for kind in ["row", "guest", "pci", "nvme"] {
        let _ = find_record(&lines, kind);
    }
});
