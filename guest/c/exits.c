/*
 * iopath guest: the exit-cost table.
 *
 * Each row times a tight loop of one kind of access with RDTSC, in the style
 * of kvm-unit-tests x86/vmexit. Per row: untimed warm-up passes until the
 * per-access cost settles (a device thread that starts cold makes the first
 * accesses slow) or a bounded time passes; then the pass grows until one pass
 * takes at least batch_us (bounded in passes, accesses and time, so a slow
 * path cannot hang the guest); then `batches` timed batches of that many
 * accesses, grown again (up to MAX_REDO times) if their median came out
 * under half of batch_us. The guest prints one "@row" record per row (each timed batch's
 * cycles, the accesses per batch, every access it made, warm-up included, and
 * the device's own counter where there is one); the host computes medians.
 *
 * Command line: batches=N batch_us=N only=prefix,prefix
 *               cpl=0|3: the privilege level the access loops run at
 *               (default 3; 0 runs them through ring0_call)
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

/* Calibration bounds: accesses per pass, and passes while the batch grows. */
#define MAX_ITERS (1ull << 30)
#define MAX_GROW_PASSES 40
/* Times the timed batches may be grown again when they came out short. */
#define MAX_REDO 3
/* batch_us is capped so that MAX_ITERS * target_cycles fits in a u64. */
#define MAX_TARGET_CYCLES (1ull << 33)

struct meas {
    u64 iters;    /* accesses per timed batch */
    u64 accesses; /* every access of the row: warm-up, calibration and batches */
    u64 warm;     /* the untimed ones among them */
    u32 nb;
    u64 cycles[MAX_BATCHES];
};

static u64 target_cycles;
static u64 warm_cap_cycles;
static u32 nbatches;
static int failures;
static int run_cpl = 3;
static int db_timeout;

static void params_init(void)
{
    u64 us = cmdline_u64("batch_us", 20000);
    u64 khz = tsc_khz ? tsc_khz : 2000000;
    if (us > 100000000)
        us = 100000000;
    target_cycles = us * khz / 1000;
    if (target_cycles < 1000)
        target_cycles = 1000;
    if (target_cycles > MAX_TARGET_CYCLES)
        target_cycles = MAX_TARGET_CYCLES;
    /* Warm-up: up to 4 batches' time, and at least 20 ms for a thread to start. */
    warm_cap_cycles = 4 * target_cycles;
    if (warm_cap_cycles < 20 * khz)
        warm_cap_cycles = 20 * khz;
    run_cpl = cmdline_u64("cpl", 3) == 0 ? 0 : 3;
    nbatches = (u32)cmdline_u64("batches", 9);
    if (nbatches < 1)
        nbatches = 1;
    if (nbatches > MAX_BATCHES)
        nbatches = MAX_BATCHES;
}

struct r0_pass {
    body_fn fn;
    const void *ctx;
    u64 n;
};

/* At CPL0: the timed pass itself, so the gate's int/iretq stay outside it. */
static u64 r0_timed(void *p)
{
    const struct r0_pass *c = p;
    u64 t0 = rdtsc();
    c->fn(c->ctx, c->n);
    return rdtsc() - t0;
}

static u64 run_once(body_fn fn, const void *ctx, u64 n)
{
    if (run_cpl == 0) {
        struct r0_pass c = {fn, ctx, n};
        return ring0_call(r0_timed, &c);
    }
    u64 t0 = rdtsc();
    fn(ctx, n);
    return rdtsc() - t0;
}

/* The median of a row's batch cycles (0 when it has none). */
static u64 median_cycles(const struct meas *m)
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
    return m->nb ? v[m->nb / 2] : 0;
}

/* Per-access cost of a pass in 1/64 cycles (t < 2^40, so no overflow). */
static u64 per_access64(u64 t, u64 n) { return n ? (t << 6) / n : 0; }

static void measure(struct meas *m, body_fn fn, const void *ctx)
{
    u64 n = 8, t, prev = 0, best = ~0ull;
    m->accesses = 0;
    m->iters = 0;
    m->nb = 0;
    /* Warm-up: until two passes in a row agree within 1/8 on the cost per
     * access, each long enough to mean something, or the warm-up cap. */
    u64 start = rdtsc();
    for (;;) {
        t = run_once(fn, ctx, n);
        m->accesses += n;
        if (db_timeout)
            goto out;
        u64 per = per_access64(t, n);
        if (per < best)
            best = per;
        int settled = prev && t >= target_cycles / 16 && per <= prev + prev / 8 && per + prev / 8 >= prev;
        if (settled || rdtsc() - start > warm_cap_cycles)
            break;
        prev = per;
        if (t < target_cycles / 8 && n < MAX_ITERS / 2)
            n *= 2;
    }
    /* Grow the pass until one takes target_cycles (aiming 1/16 above it).
     * A pass that took that long only because the vCPU was descheduled
     * (its accesses at the best cost seen would take under half of it)
     * does not count. n * best <= t << 6 < 2^40: no overflow. Then the
     * timed batches. If the path got much faster since (a device thread
     * that was descheduled now runs), their median falls under half the
     * target: they become untimed and the pass grows again from them, up
     * to MAX_REDO times. */
    for (u32 redo = 0;; redo++) {
        start = rdtsc();
        for (u32 i = 0; n < MAX_ITERS && i < MAX_GROW_PASSES; i++) {
            if (t >= target_cycles && ((n * best) >> 6) >= target_cycles / 2)
                break;
            if (rdtsc() - start > 16 * target_cycles)
                break;
            if (!t || t < target_cycles / 2 || t >= target_cycles)
                n *= 2;
            else
                n += n * (target_cycles - t) / t + n / 16 + 1;
            if (n > MAX_ITERS)
                n = MAX_ITERS;
            t = run_once(fn, ctx, n);
            m->accesses += n;
            if (db_timeout)
                goto out;
            u64 per = per_access64(t, n);
            if (per < best)
                best = per;
        }
        m->warm = m->accesses;
        m->iters = n;
        m->nb = nbatches;
        for (u32 b = 0; b < nbatches; b++) {
            m->cycles[b] = run_once(fn, ctx, n);
            m->accesses += n;
        }
        t = median_cycles(m);
        if (db_timeout || t >= target_cycles / 2 || redo >= MAX_REDO || n >= MAX_ITERS)
            return;
        u64 per = per_access64(t, n);
        if (per < best)
            best = per;
    }
out:
    m->warm = m->accesses;
}

static u64 median_per_iter(const struct meas *m) { return m->iters ? median_cycles(m) / m->iters : 0; }

/* "@row" record for the host, then a kvm-unit-tests style "name cycles" line. */
static void report(const char *name, const char *group, const struct meas *m, const char *fmt_extra, u64 a,
                   u64 b, u64 c)
{
    printf("@row name=%s group=%s cpl=%u iters=%lu accesses=%lu warm=%lu cycles=", name, group, run_cpl, m->iters,
           m->accesses, m->warm);
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

/* A path that is cold once: its first access takes a whole batch's time
 * (a device thread starting), then each costs a RAM store. Calibration
 * must not let the first pass set the batch length. */
static int cold_done;
static void body_cold_start(const void *c, u64 n)
{
    (void)c;
    if (!cold_done) {
        cold_done = 1;
        u64 t0 = rdtsc();
        while (rdtsc() - t0 < target_cycles)
            cpu_relax();
    }
    for (u64 i = 0; i < n; i++)
        store_sink = i;
}

/* A path that is slow (1 ms per access) for the row's first 4 passes, the
 * warm-up and growth that size its batch (8, 8, 16 and ~22 accesses at a
 * 20 ms batch), then costs a RAM store: the timed batches must not keep
 * the slow phase's length. */
static u32 slow_passes;
static void body_slow_then_fast(const void *c, u64 n)
{
    (void)c;
    u64 ms = tsc_khz ? tsc_khz : 2000000;
    int slow = slow_passes++ < 4;
    for (u64 i = 0; i < n; i++) {
        if (slow) {
            u64 t0 = rdtsc();
            while (rdtsc() - t0 < ms)
                cpu_relax();
        }
        store_sink = i;
    }
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
    /* Tests of the calibration, each run only when only= starts with its name. */
    const char *only = cmdline_get("only");
    if (only && !strncmp(only, "calibration-cold-start", 22))
        run_simple("calibration-cold-start", "cpu", body_cold_start, NULL);
    if (only && !strncmp(only, "calibration-slow-then-fast", 26))
        run_simple("calibration-slow-then-fast", "cpu", body_slow_then_fast, NULL);
    if (selected("vmcall") && run_cpl == 0) {
        /* On this host a CPL0 hypercall of an unknown number never returns. */
        printf("@note vmcall is not run at cpl=0\n");
    } else if (selected("vmcall")) {
        u64 f = probe(hypercall, 3);
        if (f)
            printf("@row name=vmcall group=cpu cpl=%u status=unsupported vector=%lu\n", run_cpl, f & 0xff);
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
                printf("@row name=%s group=pci-testdev cpl=%u status=error reason=offset-outside-bar\n", name, run_cpl);
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
            /* Test 0's `data` field, read before and after the timed reads:
               the same value, and not all-ones (an unclaimed hole), shows the
               reads reached the device's register on any host (QEMU counts
               no reads, so this is its check). */
            hdr_w8(b, TD_TEST, 0);
            u32 want = hdr_r32(b, TD_DATA);
            struct access acc = {b->addr + TD_DATA, 0, 4};
            struct meas m;
            measure(&m, b->io ? body_in_port : body_mmio_read, &acc);
            u32 got = hdr_r32(b, TD_DATA);
            report(rname, "pci-testdev", &m, "addr=0x%lx value=0x%lx value_ok=%lu", acc.addr, (u64)got,
                   (u64)(got == want && want != 0xffffffffu));
        }
    }
}

/* ---- doorbell round trip (iopath-doorbell device) ---- */

static volatile u64 db_completion __attribute__((aligned(64)));
static volatile u64 db_shm __attribute__((aligned(64)));
static u64 db_pad __attribute__((aligned(64))) __attribute__((used));
static u64 db_seq;

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
        printf("@row name=%s group=doorbell cpl=%u status=error reason=%s device_error=%u completed=%lu\n", name,
               run_cpl, db_timeout ? "timeout" : "device-error", err, db_seq);
        failures++;
        return;
    }
    report(name, "doorbell", &m, "exits=%lu kicks=%lu polls=%lu", e1 - e0, k1 - k0, p1 - p0);
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
