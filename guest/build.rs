//! Builds the guest image with the machine's own gcc and objcopy: freestanding
//! x86-64 objects, linked at 1 MiB, then wrapped as ELF32 so that QEMU's
//! multiboot loader (`-kernel`) accepts it. No target download is involved.

use std::env;
use std::path::PathBuf;
use std::process::Command;

const SOURCES: &[&str] = &["boot.S", "lib.c", "pci.c", "exits.c", "nvme.c", "load.c", "virtio.c", "pciio.c", "main.c"];
const CFLAGS: &[&str] = &[
    "-m64",
    "-O2",
    "-g",
    "-ffreestanding",
    "-fno-pic",
    "-fno-pie",
    "-mno-red-zone",
    "-mgeneral-regs-only",
    "-mno-sse",
    "-mno-mmx",
    "-mno-80387",
    "-fno-stack-protector",
    "-fno-asynchronous-unwind-tables",
    "-fno-builtin",
    "-fno-tree-loop-distribute-patterns",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wa,--noexecstack",
];

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (install gcc and binutils)"));
    assert!(status.success(), "guest build step failed: {cmd:?}");
}

fn main() {
    let src = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("c");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cc = env::var("IOPATH_GUEST_CC").unwrap_or_else(|_| "gcc".into());
    println!("cargo:rerun-if-env-changed=IOPATH_GUEST_CC");
    println!("cargo:rerun-if-changed=c/guest.h");
    println!("cargo:rerun-if-changed=c/load.h");
    println!("cargo:rerun-if-changed=c/linker.ld");
    let mut objs = Vec::new();
    for s in SOURCES {
        println!("cargo:rerun-if-changed=c/{s}");
        let obj = out.join(format!("{s}.o"));
        run(Command::new(&cc).args(CFLAGS).arg("-c").arg(src.join(s)).arg("-o").arg(&obj));
        objs.push(obj);
    }
    let elf64 = out.join("guest.elf64");
    run(Command::new(&cc)
        .args(["-m64", "-nostdlib", "-static", "-no-pie", "-Wl,-z,max-page-size=0x1000", "-Wl,--build-id=none"])
        .arg(format!("-Wl,-T,{}", src.join("linker.ld").display()))
        .arg("-o")
        .arg(&elf64)
        .args(&objs));
    run(Command::new("objcopy").args(["-O", "elf32-i386"]).arg(&elf64).arg(out.join("guest.elf")));
}
