#!/bin/sh
# Builds the guest image by hand (guest/build.rs does the same in cargo builds).
set -e
out=${1:-/tmp/iopath-guest}
mkdir -p "$out"
CFLAGS="-m64 -O2 -g -ffreestanding -fno-pic -fno-pie -mno-red-zone -mgeneral-regs-only -mno-sse -mno-mmx -mno-80387 -fno-stack-protector -fno-asynchronous-unwind-tables -fno-builtin -fno-tree-loop-distribute-patterns -Wall -Wextra"
cd "$(dirname "$0")"
for f in boot.S lib.c pci.c exits.c main.c; do gcc $CFLAGS -c $f -o "$out/${f%.*}.o"; done
gcc -m64 -nostdlib -static -no-pie -Wl,-T,linker.ld -Wl,-z,max-page-size=0x1000 -Wl,--build-id=none \
  -o "$out/guest.elf64" "$out"/boot.o "$out"/lib.o "$out"/pci.o "$out"/exits.o "$out"/main.o
objcopy -O elf32-i386 "$out/guest.elf64" "$out/guest.elf"
