/*
 * iopath guest: shared declarations. Everything here runs at CPL3 except
 * fault_handler(), which the boot stub calls at CPL0 on an unexpected fault,
 * and what a workload runs through ring0_call() (the exit rows at cpl=0).
 */
#ifndef IOPATH_GUEST_H
#define IOPATH_GUEST_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long s64;
typedef unsigned long size_t;

#define NULL ((void *)0)
#define barrier() asm volatile("" ::: "memory")

/* Ports of the platform both VMMs provide. */
#define SERIAL_PORT 0x3f8
#define DEBUG_EXIT_PORT 0xf4

/* Exit codes written to isa-debug-exit (the VMM sees (code << 1) | 1). */
#define EXIT_OK 0
#define EXIT_FAIL 1
#define EXIT_FAULT 0x3f

static inline void outb(u16 port, u8 v) { asm volatile("outb %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outw(u16 port, u16 v) { asm volatile("outw %0, %1" :: "a"(v), "Nd"(port)); }
static inline void outl(u16 port, u32 v) { asm volatile("outl %0, %1" :: "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; asm volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u16 inw(u16 port) { u16 v; asm volatile("inw %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u32 inl(u16 port) { u32 v; asm volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }

static inline void mmio_write8(u64 a, u8 v) { *(volatile u8 *)a = v; }
static inline void mmio_write16(u64 a, u16 v) { *(volatile u16 *)a = v; }
static inline void mmio_write32(u64 a, u32 v) { *(volatile u32 *)a = v; }
static inline void mmio_write64(u64 a, u64 v) { *(volatile u64 *)a = v; }
static inline u8 mmio_read8(u64 a) { return *(volatile u8 *)a; }
static inline u16 mmio_read16(u64 a) { return *(volatile u16 *)a; }
static inline u32 mmio_read32(u64 a) { return *(volatile u32 *)a; }
static inline u64 mmio_read64(u64 a) { return *(volatile u64 *)a; }

static inline u64 rdtsc(void)
{
    u32 lo, hi;
    asm volatile("rdtsc" : "=a"(lo), "=d"(hi) :: "memory");
    return ((u64)hi << 32) | lo;
}

static inline void cpuid(u32 leaf, u32 sub, u32 *a, u32 *b, u32 *c, u32 *d)
{
    asm volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(sub));
}

static inline void cpu_relax(void) { asm volatile("pause" ::: "memory"); }

/*
 * Runs fn(arg) at CPL0 and returns its result: a ud2 with RAX = RING0_MAGIC,
 * which the #UD stub in boot.S turns into the call. CPL0 code is emulated on
 * some hosts (docs/ARCHITECTURE.md).
 */
#define RING0_MAGIC 0x52304741ull
static inline u64 ring0_call(u64 (*fn)(void *), void *arg)
{
    u64 ret = RING0_MAGIC;
    asm volatile("ud2"
                 : "+a"(ret), "+D"(fn), "+S"(arg)
                 :
                 : "rcx", "rdx", "r8", "r9", "r10", "r11", "memory", "cc");
    return ret;
}

/* lib.c */
void *memset(void *d, int c, size_t n);
void *memcpy(void *d, const void *s, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
int strncmp(const char *a, const char *b, size_t n);
void putc_serial(char c);
void puts_serial(const char *s);
void printf(const char *fmt, ...);
void guest_exit(int code) __attribute__((noreturn));

/* Command line: "key=value" words, from the multiboot information structure. */
void cmdline_init(const char *s);
const char *cmdline_get(const char *key);           /* NULL if absent */
u64 cmdline_u64(const char *key, u64 dflt);
int cmdline_has_word(const char *list_key, const char *word);   /* "only=a,b,c" */

/* TSC frequency in kHz and where it came from. */
extern u64 tsc_khz;
extern const char *tsc_source;
void tsc_init(void);
u64 cycles_to_ns(u64 cycles);

/* Probing an instruction that may fault (#UD, #GP): the CPL0 stub skips it. */
extern volatile u64 probe_skip;
extern volatile u64 probe_fault;
extern volatile u64 irq_count; /* external interrupts taken (boot.S isr_irq) */

/* pci.c */
#define PCI_MAX_DEVS 32
struct pci_bar {
    u64 addr;
    u64 size;
    int io;          /* 1: I/O space, 0: memory */
    int is64;
};
struct pci_dev {
    u8 bus, dev, fn;
    u16 vendor, device;
    u32 class_rev;
    struct pci_bar bar[6];
};
extern struct pci_dev pci_devs[PCI_MAX_DEVS];
extern int pci_ndevs;
void pci_scan(void);
struct pci_dev *pci_find(u16 vendor, u16 device);
u32 pci_cfg_read32(const struct pci_dev *d, u8 off);
void pci_cfg_write32(const struct pci_dev *d, u8 off, u32 v);
void pci_cfg_write16(const struct pci_dev *d, u8 off, u16 v);

/* Workloads. Each returns an exit code. */
int workload_exits(void);
int workload_floor(void);
int workload_nvme(u64 mem_bytes);
int workload_vblk(u64 mem_bytes);
int workload_pci(void);  /* pciio.c: BAR reads and writes of one function */

#endif
