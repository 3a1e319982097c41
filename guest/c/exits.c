/*
 * iopath guest: the exit-cost table.
 *
 * Each row times a tight loop of one kind of access with RDTSC, in the style
 * of kvm-unit-tests x86/vmexit: a calibration pass picks an iteration count
 * that takes about batch_us, then `batches` timed batches follow. The guest
 * prints one "@row" record per row (all batch totals, the access count, and
 * the device's own counter where there is one); the host computes medians.
 *
 * Command line: batches=N batch_us=N only=prefix,prefix
 *               floor rows: td_mmio=ADDR td_pio=PORT (see workload_floor)
 */
#include "guest.h"

#define MAX_BATCHES 64
#define UNCLAIMED_PORT 0x1234
#define UNCLAIMED_MMIO 0xd0000000ull
#define ELCR_PORT 0x4d0

/* pci-testdev (docs/specs/pci-testdev.txt) */
#define TESTDEV_VENDOR 0x1b36
#define TESTDEV_DEVICE 0x0005
#define TD_TEST 0
#define TD_WIDTH 1
#define TD_OFFSET 4
#define TD_DATA 8
#define TD_COUNT 12
#define TD_NAME 16

/* iopath-doorbell test device (devices/src/doorbell.rs) */
#define DB_VENDOR 0x1234
#define DB_DEVICE 0x10db
#define DB_MAGIC 0x42444f49u
#define DB_REG_MAGIC 0x00
#define DB_REG_MODE 0x04
#define DB_REG_COMPLETION 0x08
#define DB_REG_SHM 0x10
#define DB_REG_ERROR 0x18
#define DB_REG_EXITS 0x20
#define DB_REG_KICKS 0x28
#define DB_REG_POLLS 0x30
#define DB_REG_DOORBELL 0x100
#define DB_MODE_EXIT 0
#define DB_MODE_IOEVENTFD 1
#define DB_MODE_SHM 2

typedef void (*body_fn)(const void *ctx, u64 n);

struct meas {
    u64 iters;
    u64 accesses;
    u32 nb;
    u64 cycles[MAX_BATCHES];
};

static u64 target_cycles;
static u32 nbatches;
static int failures;

static void params_init(void)
{
    u64 us = cmdline_u64("batch_us", 20000);
    u64 khz = tsc_khz ? tsc_khz : 2000000;
    target_cycles = us * khz / 1000;
    if (target_cycles < 1000)
        target_cycles = 1000;
    nbatches = (u32)cmdline_u64("batches", 9);
    if (nbatches < 1)
        nbatches = 1;
    if (nbatches > MAX_BATCHES)
        nbatches = MAX_BATCHES;
}

static u64 run_once(body_fn fn, const void *ctx, u64 n)
{
    u64 t0 = rdtsc();
    fn(ctx, n);
    return rdtsc() - t0;
}

static void measure(struct meas *m, body_fn fn, const void *ctx)
{
    u64 n = 8, t;
    m->accesses = 0;
    for (;;) {
        t = run_once(fn, ctx, n);
        m->accesses += n;
        if (t >= target_cycles / 8 || n >= (1ull << 30))
            break;
        n *= 2;
    }
    if (t && t < target_cycles)
        n = n * target_cycles / t;
    if (n < 1)
        n = 1;
    m->iters = n;
    m->nb = nbatches;
    for (u32 b = 0; b < nbatches; b++) {
        m->cycles[b] = run_once(fn, ctx, n);
        m->accesses += n;
    }
}

static u64 median_per_iter(const struct meas *m)
{
    u64 v[MAX_BATCHES];
    for (u32 i = 0; i < m->nb; i++) {
        u64 x = m->cycles[i];
        u32 j = i;
        while (j && v[j - 1] > x) {
            v[j] = v[j - 1];
            j--;
        }
        v[j] = x;
    }
    return m->iters ? v[m->nb / 2] / m->iters : 0;
}

/* "@row" record for the host, then a kvm-unit-tests style "name cycles" line. */
static void report(const char *name, const char *group, const struct meas *m, const char *fmt_extra, u64 a,
                   u64 b, u64 c)
{
    printf("@row name=%s group=%s iters=%lu accesses=%lu cycles=", name, group, m->iters, m->accesses);
    for (u32 i = 0; i < m->nb; i++)
        printf(i ? ",%lu" : "%lu", m->cycles[i]);
    if (fmt_extra) {
        putc_serial(' ');
        printf(fmt_extra, a, b, c);
    }
    printf("\n%s %lu\n", name, median_per_iter(m));
}

static int selected(const char *name) { return cmdline_has_word("only", name); }

/* ---- bodies ---- */

static void body_empty(const void *c, u64 n)
{
    (void)c;
    for (u64 i = 0; i < n; i++)
        barrier();
}

static volatile u64 store_sink;
static void body_ram_store(const void *c, u64 n)
{
    (void)c;
    for (u64 i = 0; i < n; i++)
        store_sink = i;
}

static void body_cpuid(const void *c, u64 n)
{
    (void)c;
    u32 a, b, cx, d;
    for (u64 i = 0; i < n; i++)
        cpuid(0, 0, &a, &b, &cx, &d);
}

static int is_amd;
static void hypercall(void)
{
    u64 rax = ~0ull; /* no such hypercall: KVM answers -KVM_ENOSYS/-KVM_EPERM */
    if (is_amd)
        asm volatile("vmmcall" : "+a"(rax) : : "rbx", "rcx", "rdx", "rsi", "memory");
    else
        asm volatile("vmcall" : "+a"(rax) : : "rbx", "rcx", "rdx", "rsi", "memory");
}
static void body_vmcall(const void *c, u64 n)
{
    (void)c;
    for (u64 i = 0; i < n; i++)
        hypercall();
}

static void body_inl_kernel(const void *c, u64 n)
{
    (void)c;
    for (u64 i = 0; i < n; i++)
        (void)inb(ELCR_PORT);
}

static void body_outl_kernel(const void *c, u64 n)
{
    (void)c;
    u8 v = inb(ELCR_PORT);
    for (u64 i = 0; i < n; i++)
        outb(ELCR_PORT, v);
}

struct access {
    u64 addr;
    u32 data;
    u32 width;
};

static void body_in_port(const void *c, u64 n)
{
    const struct access *a = c;
    for (u64 i = 0; i < n; i++)
        (void)inl((u16)a->addr);
}

static void body_out_port(const void *c, u64 n)
{
    const struct access *a = c;
    u16 p = (u16)a->addr;
    switch (a->width) {
    case 1:
        for (u64 i = 0; i < n; i++)
            outb(p, (u8)a->data);
        break;
    case 2:
        for (u64 i = 0; i < n; i++)
            outw(p, (u16)a->data);
        break;
    default:
        for (u64 i = 0; i < n; i++)
            outl(p, a->data);
        break;
    }
}

static void body_mmio_write(const void *c, u64 n)
{
    const struct access *a = c;
    switch (a->width) {
    case 1:
        for (u64 i = 0; i < n; i++)
            mmio_write8(a->addr, (u8)a->data);
        break;
    case 2:
        for (u64 i = 0; i < n; i++)
            mmio_write16(a->addr, (u16)a->data);
        break;
    default:
        for (u64 i = 0; i < n; i++)
            mmio_write32(a->addr, a->data);
        break;
    }
}

static void body_mmio_read(const void *c, u64 n)
{
    const struct access *a = c;
    for (u64 i = 0; i < n; i++)
        (void)mmio_read32(a->addr);
}

static void run_simple(const char *name, const char *group, body_fn fn, const void *ctx)
{
    struct meas m;
    if (!selected(name))
        return;
    measure(&m, fn, ctx);
    report(name, group, &m, NULL, 0, 0, 0);
}

/* Runs an instruction once with the CPL0 stub ready to skip it if it faults. */
static u64 probe(void (*fn)(void), u64 len)
{
    probe_fault = 0;
    probe_skip = len;
    fn();
    probe_skip = 0;
    return probe_fault;
}

static void rows_cpu(void)
{
    u32 a, b, c, d;
    cpuid(0, 0, &a, &b, &c, &d);
    is_amd = (b == 0x68747541); /* "Auth" */
    run_simple("empty-loop", "cpu", body_empty, NULL);
    run_simple("ram-store", "cpu", body_ram_store, NULL);
    run_simple("cpuid", "cpu", body_cpuid, NULL);
    if (selected("vmcall")) {
        u64 f = probe(hypercall, 3);
        if (f)
            printf("@row name=vmcall group=cpu status=unsupported vector=%lu\n", f & 0xff);
        else
            run_simple("vmcall", "cpu", body_vmcall, NULL);
    }
}

static void rows_ports(void)
{
    struct access unclaimed_port = {UNCLAIMED_PORT, 0, 4};
    struct access unclaimed_mmio = {UNCLAIMED_MMIO, 0, 4};
    run_simple("inl_from_kernel", "kernel", body_inl_kernel, NULL);
    run_simple("outl_to_kernel", "kernel", body_outl_kernel, NULL);
    run_simple("inl_from_vmm", "vmm", body_in_port, &unclaimed_port);
    run_simple("outl_to_vmm", "vmm", body_out_port, &unclaimed_port);
    run_simple("mmio_to_vmm", "vmm", body_mmio_write, &unclaimed_mmio);
}

/* ---- pci-testdev ---- */

static void hdr_w8(const struct pci_bar *b, u32 off, u8 v)
{
    if (b->io)
        outb((u16)(b->addr + off), v);
    else
        mmio_write8(b->addr + off, v);
}
static u8 hdr_r8(const struct pci_bar *b, u32 off)
{
    return b->io ? inb((u16)(b->addr + off)) : mmio_read8(b->addr + off);
}
static u32 hdr_r32(const struct pci_bar *b, u32 off)
{
    return b->io ? inl((u16)(b->addr + off)) : mmio_read32(b->addr + off);
}

static void rows_testdev(void)
{
    struct pci_dev *td = pci_find(TESTDEV_VENDOR, TESTDEV_DEVICE);
    if (!td) {
        printf("@note pci-testdev not found\n");
        return;
    }
    for (int bi = 0; bi < 2; bi++) {
        const struct pci_bar *b = &td->bar[bi];
        if (!b->size || !b->addr)
            continue;
        for (u32 t = 0; t < 16; t++) {
            hdr_w8(b, TD_TEST, (u8)t);
            u32 width = hdr_r8(b, TD_WIDTH);
            if (width != 1 && width != 2 && width != 4)
                break;
            u32 off = hdr_r32(b, TD_OFFSET);
            u32 data = hdr_r32(b, TD_DATA);
            char tname[48];
            u32 k = 0;
            for (; k < sizeof(tname) - 1; k++) {
                tname[k] = (char)hdr_r8(b, TD_NAME + k);
                if (!tname[k])
                    break;
            }
            tname[k] = 0;
            char name[64];
            const char *suffix = b->io ? ":pci-io" : ":pci-mem";
            size_t nl = strlen(tname);
            memcpy(name, tname, nl);
            memcpy(name + nl, suffix, strlen(suffix) + 1);
            if (!selected(name))
                continue;
            if (off + width > b->size) {
                printf("@row name=%s group=pci-testdev status=error reason=offset-outside-bar\n", name);
                failures++;
                continue;
            }
            u32 before = hdr_r32(b, TD_COUNT);
            struct access acc = {b->addr + off, data, width};
            struct meas m;
            measure(&m, b->io ? body_out_port : body_mmio_write, &acc);
            u32 count = hdr_r32(b, TD_COUNT);
            report(name, "pci-testdev", &m, "count=%lu count_at_start=%lu addr=0x%lx", count, before, acc.addr);
        }
        /* A read row: 4-byte reads of the `data` register (the device counts them). */
        const char *rname = b->io ? "portio-read:pci-io" : "mmio-read:pci-mem";
        if (selected(rname)) {
            struct access acc = {b->addr + TD_DATA, 0, 4};
            struct meas m;
            measure(&m, b->io ? body_in_port : body_mmio_read, &acc);
            report(rname, "pci-testdev", &m, "addr=0x%lx", acc.addr, 0, 0);
        }
    }
}

/* ---- doorbell round trip (iopath-doorbell device) ---- */

static volatile u64 db_completion __attribute__((aligned(64)));
static volatile u64 db_shm __attribute__((aligned(64)));
static u64 db_pad __attribute__((aligned(64))) __attribute__((used));
static u64 db_seq;
static int db_timeout;

struct doorbell {
    u64 bar0;
    u16 bar2; /* BAR0 is a 64-bit memory BAR, so the I/O BAR is BAR2 */
    int kind; /* 0 mmio register, 1 pio register, 2 shared-memory word */
};

static void body_doorbell(const void *c, u64 n)
{
    const struct doorbell *d = c;
    u64 limit = (tsc_khz ? tsc_khz : 2000000) * 1000; /* one second */
    for (u64 i = 0; i < n && !db_timeout; i++) {
        u64 want = ++db_seq;
        if (d->kind == 2)
            db_shm = want;
        else if (d->kind == 1)
            outl(d->bar2, 1);
        else
            mmio_write32(d->bar0 + DB_REG_DOORBELL, 1);
        u64 t0 = rdtsc();
        while (db_completion != want) {
            if (rdtsc() - t0 > limit) {
                db_timeout = 1;
                return;
            }
        }
    }
}

static void doorbell_row(const struct pci_dev *dev, const char *name, u32 mode, int kind)
{
    if (!selected(name))
        return;
    u64 bar0 = dev->bar[0].addr;
    struct doorbell d = {bar0, (u16)dev->bar[2].addr, kind};
    if (kind == 1 && !dev->bar[2].size)
        return;
    db_seq = 0;
    db_completion = 0;
    db_shm = 0;
    db_timeout = 0;
    mmio_write64(bar0 + DB_REG_COMPLETION, (u64)&db_completion);
    mmio_write64(bar0 + DB_REG_SHM, (u64)&db_shm);
    mmio_write32(bar0 + DB_REG_MODE, mode); /* resets the device's sequence */
    u64 e0 = mmio_read64(bar0 + DB_REG_EXITS), k0 = mmio_read64(bar0 + DB_REG_KICKS),
        p0 = mmio_read64(bar0 + DB_REG_POLLS);
    struct meas m;
    measure(&m, body_doorbell, &d);
    mmio_write32(bar0 + DB_REG_MODE, DB_MODE_EXIT); /* stops the device thread */
    u64 e1 = mmio_read64(bar0 + DB_REG_EXITS), k1 = mmio_read64(bar0 + DB_REG_KICKS),
        p1 = mmio_read64(bar0 + DB_REG_POLLS);
    u32 err = mmio_read32(bar0 + DB_REG_ERROR);
    if (db_timeout || err) {
        printf("@row name=%s group=doorbell status=error reason=%s device_error=%u completed=%lu\n", name,
               db_timeout ? "timeout" : "device-error", err, db_seq);
        failures++;
        return;
    }
    printf("@row name=%s group=doorbell iters=%lu accesses=%lu cycles=", name, m.iters, m.accesses);
    for (u32 i = 0; i < m.nb; i++)
        printf(i ? ",%lu" : "%lu", m.cycles[i]);
    printf(" exits=%lu kicks=%lu polls=%lu\n%s %lu\n", e1 - e0, k1 - k0, p1 - p0, name, median_per_iter(&m));
}

static void rows_doorbell(void)
{
    struct pci_dev *dev = pci_find(DB_VENDOR, DB_DEVICE);
    if (!dev || !dev->bar[0].size)
        return;
    if (mmio_read32(dev->bar[0].addr + DB_REG_MAGIC) != DB_MAGIC) {
        printf("@note doorbell device has a wrong magic\n");
        return;
    }
    doorbell_row(dev, "doorbell-rtt:exit-mmio", DB_MODE_EXIT, 0);
    doorbell_row(dev, "doorbell-rtt:exit-pio", DB_MODE_EXIT, 1);
    doorbell_row(dev, "doorbell-rtt:ioeventfd-mmio", DB_MODE_IOEVENTFD, 0);
    doorbell_row(dev, "doorbell-rtt:ioeventfd-pio", DB_MODE_IOEVENTFD, 1);
    doorbell_row(dev, "doorbell-rtt:shm", DB_MODE_SHM, 2);
}

int workload_exits(void)
{
    params_init();
    rows_cpu();
    rows_ports();
    rows_testdev();
    rows_doorbell();
    return failures ? EXIT_FAIL : EXIT_OK;
}

/*
 * The floor: the same accesses as the exits workload, run under a bare
 * KVM_RUN loop that answers nothing (vmm/src/bare.rs). There is no PCI here;
 * the addresses of the pci-testdev rows come from the command line so the
 * access is the very same one the exits workload made.
 */
int workload_floor(void)
{
    params_init();
    struct access unclaimed_port = {UNCLAIMED_PORT, 0, 4};
    struct access unclaimed_mmio = {UNCLAIMED_MMIO, 0, 4};
    run_simple("inl_from_vmm", "vmm", body_in_port, &unclaimed_port);
    run_simple("outl_to_vmm", "vmm", body_out_port, &unclaimed_port);
    run_simple("mmio_to_vmm", "vmm", body_mmio_write, &unclaimed_mmio);
    u64 td_mmio = cmdline_u64("td_mmio", 0), td_pio = cmdline_u64("td_pio", 0);
    u64 td_data = cmdline_u64("td_data", 0xfa);
    if (td_mmio) {
        struct access a = {td_mmio, (u32)td_data, 1};
        run_simple("mmio-no-eventfd:pci-mem", "pci-testdev", body_mmio_write, &a);
    }
    if (td_pio) {
        struct access a = {td_pio, (u32)td_data, 1};
        run_simple("portio-no-eventfd:pci-io", "pci-testdev", body_out_port, &a);
    }
    return EXIT_OK;
}
