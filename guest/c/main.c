/* iopath guest: entry at CPL3, multiboot information, workload dispatch. */
#include "guest.h"

#define MULTIBOOT_BOOTLOADER_MAGIC 0x2BADB002
#define MBI_FLAG_CMDLINE (1u << 2)

struct multiboot_info {
    u32 flags;
    u32 mem_lower;
    u32 mem_upper;
    u32 boot_device;
    u32 cmdline;
};

static const char *cpu_vendor(void)
{
    static char v[13];
    u32 a, b, c, d;
    cpuid(0, 0, &a, &b, &c, &d);
    memcpy(v, &b, 4);
    memcpy(v + 4, &d, 4);
    memcpy(v + 8, &c, 4);
    v[12] = 0;
    return v;
}

int guest_main(u64 mbi_addr, u32 magic)
{
    const struct multiboot_info *mbi = (const struct multiboot_info *)mbi_addr;
    const char *cmd = NULL;
    u32 mem_kb = 0;
    if (magic == MULTIBOOT_BOOTLOADER_MAGIC && mbi) {
        if (mbi->flags & MBI_FLAG_CMDLINE)
            cmd = (const char *)(u64)mbi->cmdline;
        if (mbi->flags & 1)
            mem_kb = mbi->mem_upper + 1024;
    }
    cmdline_init(cmd);
    tsc_init();
    const char *workload = cmdline_get("workload");
    printf("@guest version=1 cpl=3 magic=%x mem_kb=%u tsc_khz=%lu tsc_source=%s vendor=%s\n", magic, mem_kb,
           tsc_khz, tsc_source, cpu_vendor());
    int rc;
    if (workload && !strncmp(workload, "floor", 5) && (workload[5] == ' ' || !workload[5])) {
        rc = workload_floor();
    } else if (!workload || (!strncmp(workload, "exits", 5) && (workload[5] == ' ' || !workload[5]))) {
        pci_scan();
        rc = workload_exits();
    } else if (!strncmp(workload, "nvme", 4) && (workload[4] == ' ' || !workload[4])) {
        pci_scan();
        rc = workload_nvme((u64)mem_kb * 1024);
    } else if (!strncmp(workload, "vblk", 4) && (workload[4] == ' ' || !workload[4])) {
        pci_scan();
        rc = workload_vblk((u64)mem_kb * 1024);
    } else if (!strncmp(workload, "pci", 3) && (workload[3] == ' ' || !workload[3])) {
        pci_scan();
        rc = workload_pci();
    } else {
        printf("@error unknown workload\n");
        rc = EXIT_FAIL;
    }
    printf("@done rc=%d\n", rc);
    return rc;
}

/* Called at CPL0 by the boot stub for a fault that was not a probe. */
void fault_handler(u64 *f)
{
    u64 cr2;
    asm volatile("mov %%cr2, %0" : "=r"(cr2));
    printf("@fault vector=%lu error=0x%lx rip=0x%lx cs=0x%lx rsp=0x%lx cr2=0x%lx\n", f[9], f[10], f[11], f[12],
           f[14], cr2);
    guest_exit(EXIT_FAULT);
}
