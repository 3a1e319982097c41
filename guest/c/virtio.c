/*
 * iopath guest: vblk, a polled virtio-blk driver (virtio 1.x, modern PCI
 * transport) running the shared load generator (load.c).
 *
 * It finds the first 0x1af4:0x1042 function, walks its virtio vendor
 * capabilities (common, notify, ISR, device configuration), resets the
 * device, sets ACKNOWLEDGE|DRIVER, negotiates VIRTIO_F_VERSION_1 and, if
 * offered (and event_idx=1, the default), VIRTIO_RING_F_EVENT_IDX, checks
 * FEATURES_OK, sets up virtqueue 0 as a split ring with no MSI-X vector,
 * and sets DRIVER_OK. A request is three descriptors (header, data,
 * status), fixed per slot. Completions are polled from the used ring;
 * the notify register is written only when the device asks for it: with
 * EVENT_IDX when the new avail index passes avail_event, without it unless
 * the used ring's NO_NOTIFY flag is set.
 *
 * Records: "@vblk-dev ..." (what was found and negotiated), then the load
 * generator's "@vblk-window start|end", "@vblk rw=.. bs=.. iodepth=..
 * event_idx=0|1 ios=.. cycles=.. lat_*=.. p50..p999=.. errors=.. kicks=..
 * notifies=.. [thinktime_us=..] [verified_blocks=.. mismatches=..]" and the
 * "@vblk-hist" lines. Errors: "@vblk-error ...".
 *
 * Command line: rw=read|write|randread|randwrite|randrw bs=N iodepth=N
 *   time_ms=N rwmixread=N size_mb=N seed=N verify=0|1 thinktime_us=N
 *   batch_submit=N event_idx=0|1 qsize=N (at most the device's, a power of 2)
 *   intr=0|1 (with EVENT_IDX: 1 asks the device to signal every completion)
 */
#include "load.h"

#define MEM_BASE (16ull << 20)
#define MAX_QSIZE 1024
#define SECTOR 512ull

/* Status bits, feature bits (virtio 1.x, 2.1 and 6). */
#define ST_ACK 1
#define ST_DRIVER 2
#define ST_DRIVER_OK 4
#define ST_FEATURES_OK 8
#define ST_FAILED 0x80
#define F_EVENT_IDX (1ull << 29)
#define F_VERSION_1 (1ull << 32)

/* Common configuration registers. */
#define CC_DFSELECT 0
#define CC_DF 4
#define CC_GFSELECT 8
#define CC_GF 12
#define CC_MSIX 16
#define CC_NUMQ 18
#define CC_STATUS 20
#define CC_QSELECT 22
#define CC_QSIZE 24
#define CC_QMSIX 26
#define CC_QENABLE 28
#define CC_QNOTIFYOFF 30
#define CC_QDESC 32
#define CC_QDRIVER 40
#define CC_QDEVICE 48

#define DESC_NEXT 1
#define DESC_WRITE 2

struct desc {
    u64 addr;
    u32 len;
    u16 flags, next;
};

static u64 common, notify_reg, devcfg;
static volatile struct desc *descs;
static volatile u16 *avail; /* flags, idx, ring[qs], used_event */
static volatile u16 *used;  /* flags, idx, {u32 id, u32 len}[qs], avail_event */
static u16 qs, avail_idx, kicked_idx, last_used;
static int event_idx, want_intr;
static u64 notifies, kicks, bs, bad_used;
static u32 depth;
static struct load_slot *slots;

/* The device's avail_event, after the used ring's qs elements. */
static u16 avail_event(void) { return used[2 + 4 * (u32)qs]; }

static void issue(u32 q, u32 i, struct load_slot *s, u8 op, u64 lba)
{
    (void)q;
    u16 h = (u16)(3 * i);
    volatile u32 *hdr = (volatile u32 *)s->aux;
    hdr[0] = op == LOAD_OP_WRITE ? 1 : 0; /* VIRTIO_BLK_T_OUT / T_IN */
    hdr[1] = 0;
    *(volatile u64 *)(s->aux + 8) = lba; /* in 512-byte sectors: lba_bytes is 512 */
    *(volatile u8 *)(s->aux + 16) = 0xff; /* the device must overwrite it */
    descs[h] = (struct desc){s->aux, 16, DESC_NEXT, (u16)(h + 1)};
    descs[h + 1] = (struct desc){s->buf, (u32)bs, (u16)(DESC_NEXT | (op == LOAD_OP_READ ? DESC_WRITE : 0)), (u16)(h + 2)};
    descs[h + 2] = (struct desc){s->aux + 16, 1, DESC_WRITE, 0};
    avail[2 + avail_idx % qs] = h;
    barrier(); /* x86 keeps stores in order: the entry before the index */
    avail[1] = ++avail_idx;
}

static int reap(u32 q, u32 *i, u32 *status)
{
    (void)q;
    u16 idx = used[1];
    if (idx == last_used)
        return 0;
    /* A device that completes more than was made available is broken: its
       entries are not taken (the host's timeout ends the run). */
    if ((u16)(idx - last_used) > (u16)(avail_idx - last_used)) {
        if (!bad_used++)
            printf("@vblk-error used index %u runs ahead of avail index %u\n", idx, avail_idx);
        return 0;
    }
    barrier();
    volatile u32 *e = (volatile u32 *)(used + 2) + 2 * (last_used % qs);
    u32 id = e[0];
    last_used++;
    /* A head that is not a slot's first descriptor maps past depth: the
       load generator reports it as unknown. */
    *i = (id % 3 || id / 3 >= depth) ? (id < depth ? depth + id : id) : id / 3;
    *status = *i < depth ? *(volatile u8 *)(slots[*i].aux + 16) : 0xff;
    /* used_event (EVENT_IDX): this driver polls, so by default it asks for an
       interrupt half the index space ahead, which never comes; with intr=1 it
       keeps it current, as an interrupt-driven driver does, and the device
       signals each completion (to no vector: the guest takes none). */
    if (event_idx)
        avail[2 + qs] = want_intr ? last_used : (u16)(last_used + 0x8000);
    return 1;
}

/* The notify rule (virtio 1.x 2.7.10): with EVENT_IDX, notify if avail_event
   lies in [kicked_idx, avail_idx), the entries made available since the last
   kick; else unless the device set NO_NOTIFY. */
static void kick(u32 q)
{
    (void)q;
    if (avail_idx == kicked_idx)
        return;
    asm volatile("mfence" ::: "memory"); /* the index store before the event load */
    int need;
    kicks++;
    if (event_idx)
        need = (u16)(avail_idx - avail_event() - 1) < (u16)(avail_idx - kicked_idx);
    else
        need = !(used[0] & 1);
    kicked_idx = avail_idx;
    if (need) {
        notifies++;
        mmio_write16(notify_reg, 0);
    }
}

static const struct load_ops vblk_ops = {"vblk", issue, reap, kick, NULL};

/* Address of a capability's structure, or 0 if it is not inside its memory BAR. */
static u64 cap_addr(const struct pci_dev *d, u8 p, u64 need, u32 *len_out)
{
    u32 bar = pci_cfg_read32(d, p + 4) & 0xff, off = pci_cfg_read32(d, p + 8), len = pci_cfg_read32(d, p + 12);
    if (bar > 5 || d->bar[bar].io || !d->bar[bar].addr || len < need || (u64)off + len > d->bar[bar].size)
        return 0;
    if (len_out)
        *len_out = len;
    return d->bar[bar].addr + off;
}

static u64 notify_base, isr;
static u32 notify_mult, notify_len;

static int find_caps(const struct pci_dev *d)
{
    u8 p = (pci_cfg_read32(d, 0x04) >> 16) & 0x10 ? (u8)(pci_cfg_read32(d, 0x34) & 0xfc) : 0;
    for (int guard = 0; p && guard < 48; guard++) {
        u32 h = pci_cfg_read32(d, p);
        u8 type = (u8)(h >> 24);
        /* The first capability of each type is the one to use. */
        if ((h & 0xff) == 0x09) {
            if (type == 1 && !common)
                common = cap_addr(d, p, 56, NULL);
            else if (type == 2 && !notify_base) {
                notify_base = cap_addr(d, p, 2, &notify_len);
                notify_mult = pci_cfg_read32(d, p + 16);
            } else if (type == 3 && !isr)
                isr = cap_addr(d, p, 1, NULL);
            else if (type == 4 && !devcfg)
                devcfg = cap_addr(d, p, 8, NULL);
        }
        p = (u8)((h >> 8) & 0xfc);
    }
    if (!common || !notify_base || !isr || !devcfg) {
        printf("@vblk-error virtio capabilities missing or outside their BAR: common=0x%lx notify=0x%lx isr=0x%lx "
               "device=0x%lx\n",
               common, notify_base, isr, devcfg);
        return -1;
    }
    return 0;
}

static void set_status(u8 st) { mmio_write8(common + CC_STATUS, st); }
static u8 get_status(void) { return mmio_read8(common + CC_STATUS); }

/* Reports what went wrong, sets FAILED; 0 is bring_up's error value. */
static u64 fail(const char *what)
{
    printf("@vblk-error %s (status 0x%x)\n", what, get_status());
    set_status(get_status() | ST_FAILED);
    return 0;
}

/* Reset, features, queue 0, DRIVER_OK. Returns the capacity in sectors, 0 on error. */
static u64 bring_up(u32 want_qs)
{
    set_status(0);
    u64 t0 = rdtsc();
    while (get_status()) {
        if (rdtsc() - t0 > tsc_khz * 2000) {
            printf("@vblk-error the device did not reset\n");
            return 0;
        }
        cpu_relax();
    }
    set_status(ST_ACK);
    set_status(ST_ACK | ST_DRIVER);
    mmio_write32(common + CC_DFSELECT, 0);
    u64 offered = mmio_read32(common + CC_DF);
    mmio_write32(common + CC_DFSELECT, 1);
    offered |= (u64)mmio_read32(common + CC_DF) << 32;
    if (!(offered & F_VERSION_1))
        return fail("the device does not offer VIRTIO_F_VERSION_1");
    want_intr = cmdline_u64("intr", 0) != 0;
    u64 want = F_VERSION_1 | (cmdline_u64("event_idx", 1) ? F_EVENT_IDX : 0);
    u64 feat = offered & want;
    mmio_write32(common + CC_GFSELECT, 0);
    mmio_write32(common + CC_GF, (u32)feat);
    mmio_write32(common + CC_GFSELECT, 1);
    mmio_write32(common + CC_GF, (u32)(feat >> 32));
    set_status(ST_ACK | ST_DRIVER | ST_FEATURES_OK);
    if (!(get_status() & ST_FEATURES_OK))
        return fail("FEATURES_OK not accepted");
    event_idx = (feat & F_EVENT_IDX) != 0;
    mmio_write16(common + CC_MSIX, 0xffff);
    if (mmio_read16(common + CC_NUMQ) < 1)
        return fail("no virtqueue");
    mmio_write16(common + CC_QSELECT, 0);
    u32 max = mmio_read16(common + CC_QSIZE);
    u32 n = want_qs ? want_qs : max;
    if (n > MAX_QSIZE)
        n = MAX_QSIZE;
    if (n > max)
        n = max;
    if (!n || (n & (n - 1)))
        return fail("queue size is not a power of 2");
    qs = (u16)n;
    descs = load_alloc(16ull * qs);
    avail = load_alloc(6 + 2ull * qs);
    used = load_alloc(6 + 8ull * qs);
    if (!descs || !avail || !used)
        return fail("out of guest memory for the virtqueue");
    if (!event_idx)
        avail[0] = 1; /* VIRTQ_AVAIL_F_NO_INTERRUPT: we poll */
    else if (!want_intr)
        avail[2 + qs] = 0x8000; /* used_event: none before the first completion either */
    mmio_write16(common + CC_QSIZE, qs);
    mmio_write16(common + CC_QMSIX, 0xffff);
    mmio_write64(common + CC_QDESC, (u64)descs);
    mmio_write64(common + CC_QDRIVER, (u64)avail);
    mmio_write64(common + CC_QDEVICE, (u64)used);
    u64 noff = (u64)mmio_read16(common + CC_QNOTIFYOFF) * notify_mult;
    if (noff + 2 > notify_len)
        return fail("queue notify offset outside the notify capability");
    notify_reg = notify_base + noff;
    mmio_write16(common + CC_QENABLE, 1);
    set_status(ST_ACK | ST_DRIVER | ST_FEATURES_OK | ST_DRIVER_OK);
    if (get_status() & 0x40)
        return fail("the device needs a reset");
    u64 cap = mmio_read32(devcfg) | (u64)mmio_read32(devcfg + 4) << 32;
    printf("@vblk-dev features=0x%lx offered=0x%lx event_idx=%d qsize=%u max_qsize=%u notify_mult=%u capacity=%lu\n",
           feat, offered, event_idx, qs, max, notify_mult, cap);
    return cap ? cap : fail("capacity 0");
}

int workload_vblk(u64 mem_bytes)
{
    struct pci_dev *d = pci_find(0x1af4, 0x1042);
    if (!d) {
        printf("@vblk-error no modern virtio-blk function (1af4:1042)\n");
        return EXIT_FAIL;
    }
    pci_cfg_write32(d, 0x04, (pci_cfg_read32(d, 0x04) & 0xffff) | 0x6 | 0x400); /* memory, bus master, INTx off */
    load_mem_next = MEM_BASE;
    load_mem_end = mem_bytes;
    load_seed(cmdline_u64("seed", 1));
    if (find_caps(d))
        return EXIT_FAIL;
    depth = (u32)cmdline_u64("iodepth", 16);
    bs = cmdline_u64("bs", 4096);
    u64 nsect = bring_up((u32)cmdline_u64("qsize", 0));
    if (!nsect)
        return EXIT_FAIL;
    /* Three descriptors per slot, fixed. */
    if (depth < 1 || 3ull * depth > qs || bs < SECTOR || bs % SECTOR || bs > (128u << 10)) {
        printf("@vblk-error bad job: iodepth=%u bs=%lu (queue of %u descriptors, 3 per request)\n", depth, bs, qs);
        set_status(get_status() | ST_FAILED);
        return EXIT_FAIL;
    }
    slots = load_alloc(sizeof(struct load_slot) * depth);
    if (!slots || load_mem_next + (bs + LOAD_PAGE) * depth > load_mem_end) {
        printf("@vblk-error %u slots of %lu bytes do not fit in guest memory (%lu MiB): give the VM more RAM\n", depth,
               bs, load_mem_end >> 20);
        return EXIT_FAIL;
    }
    for (u32 i = 0; i < depth; i++) {
        slots[i].buf = (u64)load_alloc(bs);
        slots[i].aux = (u64)load_alloc(64);
    }
    u64 size_mb = cmdline_u64("size_mb", 0);
    u64 range = size_mb ? (size_mb << 20) / SECTOR : nsect;
    if (range > nsect)
        range = nsect;
    load_reset();
    char rw[16];
    if (load_parse_rw("vblk", rw))
        return EXIT_FAIL;
    struct load_job j = {rw,
                         cmdline_u64("time_ms", 1000),
                         cmdline_u64("thinktime_us", 0),
                         bs,
                         SECTOR,
                         range,
                         cmdline_u64("batch_submit", 0),
                         1,
                         depth,
                         (u32)cmdline_u64("rwmixread", 50),
                         (int)cmdline_u64("verify", 0),
                         slots};
    struct load_result r;
    notifies = kicks = 0;
    int rc = load_run(&vblk_ops, &j, &r);
    if (!rc) {
        printf("@vblk rw=%s bs=%lu iodepth=%u event_idx=%d", j.verify ? "verify" : rw, bs, depth, event_idx);
        load_print_lat(&r);
        printf(" errors=%lu kicks=%lu notifies=%lu", load_errors, kicks, notifies);
        load_print_end("vblk", &j, &r);
    }
    set_status(0); /* reset: the device lets go of the ring */
    return (rc || load_errors || r.mismatches) ? EXIT_FAIL : EXIT_OK;
}
