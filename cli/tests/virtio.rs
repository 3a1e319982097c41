//! virtio-blk in the VMM, end to end on the real /dev/kvm: the guest's PCI
//! scan finds the function and its BAR (the guest driver comes separately).

use std::process::Command;

#[test]
fn the_guest_finds_virtio_blk_with_its_bar_placed() {
    for spec in ["virtio-blk,backend=ram", "virtio-blk,backend=null,notify=ioeventfd", "virtio-blk,notify=poll"] {
        let out = Command::new(env!("CARGO_BIN_EXE_iopath"))
            .args(["run", "--device", spec, "--append", "batches=1 batch_us=200 only=cpuid"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{spec}: {}", String::from_utf8_lossy(&out.stderr));
        let line = stdout.lines().find(|l| l.starts_with("@pci") && l.contains("id=1af4:1042"));
        let line = line.unwrap_or_else(|| panic!("{spec}: no virtio-blk in the guest's scan:\n{stdout}"));
        assert!(line.contains("class=010000") && line.contains("bar0=mem64:0x") && line.ends_with(":32768"), "{line}");
        assert!(stdout.contains("@done rc=0"), "{stdout}");
    }
}
