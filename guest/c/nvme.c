/*
 * iopath guest: nvmeperf, a polled user-space NVMe driver and load generator.
 *
 * It finds the first NVMe controller (class 01/08/02), brings it up
 * (CC.EN=0, AQA/ASQ/ACQ, CC.EN=1), reads Identify, asks for queues, creates
 * I/O queue pairs with interrupts off, and uses Doorbell Buffer Config when
 * the controller offers it (shadow doorbells with the EventIdx rule: an MMIO
 * doorbell write only when the controller's EventIdx asks for one). Then it
 * runs a fio-like job (load.c, shared with vblk), time based, and prints
 * one "@nvme" record: I/Os, cycles, and latency percentiles from a
 * log-linear histogram of cycles,
 * then the histogram itself ("@nvme-hist b:count ..." lines, non-empty
 * buckets only, HIST_PER_LINE a line, then "@nvme-hist-end") for the host
 * to merge over rounds; a randrw job then its reads and writes apart
 * ("@nvme-read", "@nvme-write", each with its histogram). "@nvme-window
 * start|end" lines mark the timed window, so that the host counts only its exits.
 * Verify mode writes an LBA-tagged pattern and reads it back.
 *
 * Command line: rw=read|write|randread|randwrite|randrw bs=N iodepth=N
 *   queues=N time_ms=N rwmixread=N size_mb=N seed=N dbbuf=0|1 verify=0|1
 *   thinktime_us=N (fio's thinktime: wait N us after a completion before
 *   the slot's next command; at iodepth 1 every command then finds an idle
 *   controller, and its latency is the wake-up's)
 *   batch_submit=N (fio's iodepth_batch_submit: ring the CQ head and SQ tail
 *   doorbells after every N commands issued while reaping, so the controller
 *   starts on them while the driver still reaps; 0, the default: once per
 *   reaping pass)
 *   qsize=N irq=0|1|wait (irq=1: MSI-X on, each I/O CQ signals its own
 *   vector; the guest runs with IF=0, so the messages stay pending in the
 *   LAPIC while completions are still reaped by polling. irq=wait: MSI-X
 *   on, and a pass that finds no completion sleeps until one is signalled,
 *   as an interrupt-driven driver does: sti; hlt at CPL0, the vCPU halts
 *   in KVM until the message arrives; "sleeps" and "irqs" count them)
 * Memory: everything lives from 16 MiB up (identity mapped), bump allocated.
 */
#include "load.h"

#define NVME_CLASS 0x010802
#define PAGE 4096ull
#define MEM_BASE (16ull << 20)
#define MAX_Q 16
#define MAX_DEPTH 1024

static u64 bar0;

struct sq_cq {
    u16 qid, size;
    volatile u8 *sq;
    volatile u32 *cq;
    u16 sq_tail, cq_head;
    u32 phase;
    u16 sq_old, cq_old; /* last values rung or shadowed */
};

static struct sq_cq adminq;
static struct sq_cq ioq[MAX_Q];
static volatile u32 *dbbuf, *evidx;
static int use_dbbuf;
static u64 rings; /* MMIO doorbell writes the EventIdx rule asked for */
static int use_irq;

#define alloc load_alloc

/* A full barrier (stores before it are visible before loads after it): a
   locked add of 0 to the stack, as Linux's smp_mb() on x86-64, which costs
   less than MFENCE. */
static inline void smp_mb(void) { asm volatile("lock addl $0, -4(%%rsp)" ::: "memory", "cc"); }

static u64 db_addr(u16 qid, int cq) { return bar0 + 0x1000 + (2ull * qid + (u64)cq) * 4; }

/* x modulo qs for x < 3 * qs, without a division (this runs on every kick). */
static u32 mod3(u32 x, u32 qs)
{
    if (x >= qs)
        x -= qs;
    if (x >= qs)
        x -= qs;
    return x;
}

/* The EventIdx rule, modulo the queue size (nw and old are below qs; ev is
   the controller's and may be anything). */
static int need_event(u32 ev, u32 nw, u32 old, u32 qs)
{
    if (ev >= qs)
        ev %= qs;
    return mod3(nw + 2 * qs - ev - 1, qs) < mod3(nw + qs - old, qs);
}

/* Shadow doorbells: stores the new value in the shadow; 1 if there was one. */
static int shadow(struct sq_cq *q, int cq)
{
    u16 nw = cq ? q->cq_head : q->sq_tail;
    if (nw == (cq ? q->cq_old : q->sq_old))
        return 0;
    dbbuf[2u * q->qid + (u32)cq] = nw;
    return 1;
}

/* After the fence that follows the shadow store: the register write the
   EventIdx rule asks for, if any. */
static void check_event(struct sq_cq *q, int cq)
{
    u16 nw = cq ? q->cq_head : q->sq_tail;
    u16 *old = cq ? &q->cq_old : &q->sq_old;
    if (need_event(evidx[2u * q->qid + (u32)cq], nw, *old, q->size)) {
        rings++;
        mmio_write32(db_addr(q->qid, cq), nw);
    }
    *old = nw;
}

static void ring(struct sq_cq *q, int cq)
{
    u16 nw = cq ? q->cq_head : q->sq_tail;
    u16 *old = cq ? &q->cq_old : &q->sq_old;
    if (nw == *old)
        return;
    if (use_dbbuf && q->qid) {
        shadow(q, cq);
        smp_mb();
        check_event(q, cq);
        return;
    }
    rings++;
    mmio_write32(db_addr(q->qid, cq), nw);
    *old = nw;
}

/* The CQ head and the SQ tail together. With shadow doorbells both words
   share a line, and one fence orders both stores before both EventIdx
   reads: a fence waits for the line to come back from the controller, which
   is polling it, so a fence per doorbell would wait twice. */
static void ring_both(struct sq_cq *q)
{
    if (!use_dbbuf || !q->qid) {
        ring(q, 1);
        ring(q, 0);
        return;
    }
    int cq = shadow(q, 1), sq = shadow(q, 0);
    if (!cq && !sq)
        return;
    smp_mb();
    if (cq)
        check_event(q, 1);
    if (sq)
        check_event(q, 0);
}

struct cmd {
    u8 op;
    u32 nsid;
    u64 prp1, prp2;
    u32 cdw10, cdw11, cdw12;
};

static void submit(struct sq_cq *q, u16 cid, const struct cmd *c)
{
    /* Eight quadword stores: half the store-buffer entries of sixteen dword
       ones, which a pass of several commands to lines the controller holds
       would otherwise fill. */
    volatile u64 *e = (volatile u64 *)(q->sq + (u64)q->sq_tail * 64);
    e[0] = c->op | (u64)cid << 16 | (u64)c->nsid << 32;
    e[1] = e[2] = 0;
    e[3] = c->prp1;
    e[4] = c->prp2;
    e[5] = c->cdw10 | (u64)c->cdw11 << 32;
    e[6] = c->cdw12;
    e[7] = 0;
    if (++q->sq_tail == q->size) /* no division on every command */
        q->sq_tail = 0;
    /* The entry eight ahead, taken for writing now: the controller last read
       that line, and fetching it back at the store would stall the pass's
       later stores and the fence of the kick. A hint only (a free entry,
       which the controller does not read until a later tail covers it). */
    if (q->size > 8) {
        u32 ahead = q->sq_tail + 8u;
        if (ahead >= q->size)
            ahead -= q->size;
        asm volatile("prefetchw %0" ::"m"(*(q->sq + (u64)ahead * 64)));
    }
}

/* Returns 1 and the completion if one is there. */
static int reap(struct sq_cq *q, u16 *cid, u16 *status, u32 *dw0)
{
    volatile u32 *e = q->cq + (u64)q->cq_head * 4;
    u32 dw3 = e[3];
    if (((dw3 >> 16) & 1) != q->phase)
        return 0;
    barrier();
    *dw0 = e[0];
    *cid = (u16)dw3;
    *status = (u16)(dw3 >> 17);
    if (++q->cq_head == q->size) {
        q->cq_head = 0;
        q->phase ^= 1;
    }
    return 1;
}

static u16 admin(const struct cmd *c, u32 *dw0)
{
    static u16 acid;
    u16 cid = ++acid, rc, st;
    u32 d;
    submit(&adminq, cid, c);
    ring(&adminq, 0);
    u64 t0 = rdtsc(), limit = tsc_khz * 2000;
    for (;;) {
        if (reap(&adminq, &rc, &st, &d)) {
            ring(&adminq, 1);
            if (rc != cid)
                continue;
            if (dw0)
                *dw0 = d;
            return st;
        }
        if (rdtsc() - t0 > limit) {
            printf("@nvme-error admin opcode=0x%x timeout\n", c->op);
            return 0xffff;
        }
        cpu_relax();
    }
}

static int wait_rdy(u32 want)
{
    u64 t0 = rdtsc(), limit = tsc_khz * 5000;
    while ((mmio_read32(bar0 + 0x1c) & 1) != want) {
        if (mmio_read32(bar0 + 0x1c) & 2) {
            printf("@nvme-error controller fatal status\n");
            return -1;
        }
        if (rdtsc() - t0 > limit) {
            printf("@nvme-error CSTS.RDY did not become %u\n", want);
            return -1;
        }
        cpu_relax();
    }
    return 0;
}

static struct load_slot *slots;
static u64 nsze, lba_bytes, bs, range_lbas;
static u32 nlb0;

static void fill_prps(struct cmd *c, struct load_slot *s)
{
    c->prp1 = s->buf;
    c->prp2 = 0;
    if (bs <= PAGE)
        return;
    if (bs <= 2 * PAGE) {
        c->prp2 = s->buf + PAGE;
        return;
    }
    u64 *l = (u64 *)s->aux;
    for (u64 i = 1; i < (bs + PAGE - 1) / PAGE; i++)
        l[i - 1] = s->buf + i * PAGE;
    c->prp2 = s->aux;
}

/* The load generator's hooks: op is the NVMe opcode (1 write, 2 read). */
static void issue(u32 q, u32 i, struct load_slot *s, u8 op, u64 lba)
{
    struct cmd c = {op, 1, 0, 0, (u32)lba, (u32)(lba >> 32), nlb0};
    fill_prps(&c, s);
    submit(&ioq[q], (u16)i, &c);
}

static int reap_io(u32 q, u32 *i, u32 *status)
{
    u16 cid, st;
    u32 dw0;
    if (!reap(&ioq[q], &cid, &st, &dw0))
        return 0;
    *i = cid;
    *status = st;
    return 1;
}

/* The CQ head too: a driver that only rang its SQ would let the CQ fill
   while a pass goes on reaping. */
static void kick(u32 q)
{
    ring_both(&ioq[q]);
}

/* irq=wait: halts until an interrupt. Ring 3 runs with IF=0, so a message
   that came after the pass looked stays pending in the LAPIC and is taken
   at the sti (its one-instruction shadow covers the hlt): no lost wake-up. */
static u64 r0_halt(void *a)
{
    (void)a;
    asm volatile("sti; hlt; cli" ::: "memory");
    return 0;
}

static void irq_wait(void) { ring0_call(r0_halt, NULL); }

static struct load_ops nvme_ops = {"nvme", issue, reap_io, kick, NULL};

static int job(const char *rw, u64 time_ms, u32 nq, u32 depth, u32 mixread, int verify, u64 think_us)
{
    struct load_job j = {rw, time_ms, think_us, bs, lba_bytes, range_lbas, cmdline_u64("batch_submit", 0),
                         nq, depth, mixread, verify, slots};
    struct load_result r;
    rings = 0;
    if (load_run(&nvme_ops, &j, &r))
        return -1;
    printf("@nvme rw=%s bs=%lu iodepth=%u queues=%u dbbuf=%d irq=%d", verify ? "verify" : rw, bs, depth, nq, use_dbbuf,
           use_irq);
    load_print_lat(&r);
    printf(" errors=%lu io_doorbell_writes=%lu irqs=%lu", load_errors, rings, irq_count);
    load_print_end("nvme", &j, &r);
    return (load_errors || r.mismatches) ? -1 : 0;
}

/* Finds the MSI-X capability, points vectors 1..nq at the LAPIC and enables MSI-X. */
static int msix_setup(struct pci_dev *d, u32 nq)
{
    u8 p = (pci_cfg_read32(d, 0x04) >> 16) & 0x10 ? (u8)(pci_cfg_read32(d, 0x34) & 0xfc) : 0;
    for (int guard = 0; p && guard < 48; guard++) {
        if ((pci_cfg_read32(d, p) & 0xff) == 0x11)
            break;
        p = (u8)((pci_cfg_read32(d, p) >> 8) & 0xfc);
    }
    if (!p) {
        printf("@nvme-error no MSI-X capability\n");
        return -1;
    }
    u32 hdr = pci_cfg_read32(d, p);
    u32 ctl = hdr >> 16, tsize = (ctl & 0x7ff) + 1, tbl = pci_cfg_read32(d, p + 4);
    u64 base = d->bar[tbl & 7].addr;
    if (!base || tsize <= nq) {
        printf("@nvme-error MSI-X table of %u vectors in BAR%u at 0x%lx\n", tsize, tbl & 7, base);
        return -1;
    }
    u64 table = base + (tbl & ~7u);
    for (u32 v = 1; v <= nq; v++) {
        mmio_write32(table + 16 * v, 0xfee00000);
        mmio_write32(table + 16 * v + 4, 0);
        mmio_write32(table + 16 * v + 8, 0x40 + v);
        mmio_write32(table + 16 * v + 12, 0);
    }
    /* Message Control alone (cap + 2): MSI-X Enable. */
    pci_cfg_write16(d, (u8)(p + 2), (u16)(ctl | 0x8000));
    return 0;
}

static int create_queues(u32 nq, u32 qsize)
{
    u32 dw0;
    struct cmd c = {0x09, 0, 0, 0, 0x07, (nq - 1) | (nq - 1) << 16, 0};
    u16 st = admin(&c, &dw0);
    if (st) {
        printf("@nvme-error set features (queues) status=0x%x\n", st);
        return -1;
    }
    u32 got = (dw0 & 0xffff) + 1;
    if (((dw0 >> 16) + 1) < got)
        got = (dw0 >> 16) + 1;
    if (got < nq) {
        printf("@nvme-error the controller grants %u queue pairs, not %u\n", got, nq);
        return -1;
    }
    for (u32 q = 0; q < nq; q++) {
        struct sq_cq *p = &ioq[q];
        p->qid = (u16)(q + 1);
        p->size = (u16)qsize;
        p->sq = alloc((u64)qsize * 64);
        p->cq = alloc((u64)qsize * 16);
        p->phase = 1;
        if (!p->sq || !p->cq) {
            printf("@nvme-error out of guest memory for queues\n");
            return -1;
        }
        u32 ien = use_irq ? 2u | (u32)p->qid << 16 : 0;
        struct cmd cq = {0x05, 0, (u64)p->cq, 0, p->qid | (qsize - 1) << 16, 1 | ien, 0};
        if ((st = admin(&cq, NULL))) {
            printf("@nvme-error create I/O CQ %u status=0x%x\n", p->qid, st);
            return -1;
        }
        struct cmd sq = {0x01, 0, (u64)p->sq, 0, p->qid | (qsize - 1) << 16, 1 | (u32)p->qid << 16, 0};
        if ((st = admin(&sq, NULL))) {
            printf("@nvme-error create I/O SQ %u status=0x%x\n", p->qid, st);
            return -1;
        }
    }
    return 0;
}

int workload_nvme(u64 mem_bytes)
{
    struct pci_dev *d = NULL;
    for (int i = 0; i < pci_ndevs; i++)
        if ((pci_devs[i].class_rev >> 8) == NVME_CLASS)
            d = &pci_devs[i];
    if (!d || !d->bar[0].addr) {
        printf("@nvme-error no NVMe controller\n");
        return EXIT_FAIL;
    }
    pci_cfg_write32(d, 0x04, (pci_cfg_read32(d, 0x04) & 0xffff) | 0x6 | 0x400); /* memory, bus master, INTx off */
    bar0 = d->bar[0].addr;
    load_mem_next = MEM_BASE;
    load_mem_end = mem_bytes;
    load_seed(cmdline_u64("seed", 1));
    u64 cap = mmio_read64(bar0);
    u32 mqes = (u32)(cap & 0xffff) + 1;
    if ((cap >> 32) & 0xf) {
        printf("@nvme-error doorbell stride %lu not supported\n", (cap >> 32) & 0xf);
        return EXIT_FAIL;
    }
    /* Disable, set up the admin queues, enable. */
    mmio_write32(bar0 + 0x14, 0);
    if (wait_rdy(0))
        return EXIT_FAIL;
    adminq.qid = 0;
    adminq.size = 32;
    adminq.sq = alloc(PAGE);
    adminq.cq = alloc(PAGE);
    adminq.phase = 1;
    mmio_write32(bar0 + 0x24, (32 - 1) << 16 | (32 - 1));
    mmio_write64(bar0 + 0x28, (u64)adminq.sq);
    mmio_write64(bar0 + 0x30, (u64)adminq.cq);
    mmio_write32(bar0 + 0x14, 0x00460001); /* IOCQES 4, IOSQES 6, MPS 0, CSS NVM, EN */
    if (wait_rdy(1))
        return EXIT_FAIL;
    u8 *id = alloc(PAGE);
    struct cmd idc = {0x06, 0, (u64)id, 0, 1, 0, 0};
    u16 st = admin(&idc, NULL);
    if (st) {
        printf("@nvme-error identify controller status=0x%x\n", st);
        return EXIT_FAIL;
    }
    u16 oacs = (u16)(id[256] | id[257] << 8);
    u32 mdts = id[77];
    u64 max_xfer = mdts ? (PAGE << mdts) : (1ull << 30);
    u32 nn = id[516] | (u32)id[517] << 8;
    char model[41];
    memcpy(model, id + 24, 40);
    model[40] = 0;
    for (int i = 39; i >= 0 && model[i] == ' '; i--)
        model[i] = 0;
    struct cmd idn = {0x06, 1, (u64)id, 0, 0, 0, 0};
    if ((st = admin(&idn, NULL))) {
        printf("@nvme-error identify namespace status=0x%x\n", st);
        return EXIT_FAIL;
    }
    nsze = *(u64 *)id;
    u32 flbas = id[26] & 0xf;
    lba_bytes = 1ull << id[128 + 4 * flbas + 2];
    use_dbbuf = (oacs & (1 << 8)) && cmdline_u64("dbbuf", 1);
    if (use_dbbuf) {
        dbbuf = alloc(PAGE);
        evidx = alloc(PAGE);
        struct cmd db = {0x7c, 0, (u64)dbbuf, (u64)evidx, 0, 0, 0};
        if ((st = admin(&db, NULL))) {
            printf("@nvme-note doorbell buffer config status=0x%x: using MMIO doorbells\n", st);
            use_dbbuf = 0;
        }
    }
    u32 nq = (u32)cmdline_u64("queues", 1), depth = (u32)cmdline_u64("iodepth", 16);
    u32 qsize = (u32)cmdline_u64("qsize", 0);
    bs = cmdline_u64("bs", 4096);
    if (nq < 1 || nq > MAX_Q || depth < 1 || depth > MAX_DEPTH || bs < lba_bytes || bs % lba_bytes ||
        bs > max_xfer || bs > (128u << 10)) {
        printf("@nvme-error bad job: queues=%u iodepth=%u bs=%lu (lba %lu, max transfer %lu)\n", nq, depth, bs,
               lba_bytes, max_xfer);
        return EXIT_FAIL;
    }
    /* Room for four times the depth keeps a polling controller's EventIdx out
     * of every range the driver crosses (no doorbell write at all). */
    if (!qsize)
        qsize = 4 * depth < 32 ? 32 : 4 * depth;
    if (qsize > mqes)
        qsize = mqes;
    if (qsize < depth + 1) {
        printf("@nvme-error iodepth %u needs queues of %u entries; the controller allows %u\n", depth, depth + 1, mqes);
        return EXIT_FAIL;
    }
    printf("@nvme-ctrl model=\"%s\" mqes=%u mdts=%u oacs=0x%x nn=%u nsze=%lu lba=%lu dbbuf=%d\n", model, mqes, mdts,
           oacs, nn, nsze, lba_bytes, use_dbbuf);
    const char *irqv = cmdline_get("irq");
    use_irq = irqv && !strncmp(irqv, "wait", 4) ? 2 : (int)cmdline_u64("irq", 0);
    if (use_irq && msix_setup(d, nq))
        return EXIT_FAIL;
    if (use_irq == 2) {
        /* Only the controller's messages may end a halt: the legacy PICs
           masked (under QEMU the firmware left the PIT's IRQ 0 unmasked at
           vector 8, which the sti would take as a double fault), and the
           local APIC software-enabled (SVR bit 8) so that it delivers the
           messages; the spurious vector stays 0xff. */
        outb(0x21, 0xff);
        outb(0xa1, 0xff);
        mmio_write32(0xfee000f0, mmio_read32(0xfee000f0) | 0x100);
        nvme_ops.wait = irq_wait;
    }
    if (create_queues(nq, qsize))
        return EXIT_FAIL;
    slots = alloc(sizeof(struct load_slot) * nq * depth);
    u64 per_slot = bs + (bs > 2 * PAGE ? PAGE : 0);
    if (!slots || load_mem_next + per_slot * nq * depth > load_mem_end) {
        printf("@nvme-error %u x %u slots of %lu bytes do not fit in guest memory (%lu MiB): give the VM more RAM\n",
               nq, depth, per_slot, load_mem_end >> 20);
        return EXIT_FAIL;
    }
    for (u32 i = 0; i < nq * depth; i++) {
        slots[i].buf = (u64)alloc(bs);
        slots[i].aux = bs > 2 * PAGE ? (u64)alloc(PAGE) : 0;
    }
    u64 size_mb = cmdline_u64("size_mb", 0);
    range_lbas = size_mb ? (size_mb << 20) / lba_bytes : nsze;
    if (range_lbas > nsze)
        range_lbas = nsze;
    nlb0 = (u32)(bs / lba_bytes - 1);
    load_reset();
    char rw[16];
    if (load_parse_rw("nvme", rw))
        return EXIT_FAIL;
    int verify = (int)cmdline_u64("verify", 0);
    int rc = job(rw, cmdline_u64("time_ms", 1000), nq, depth, (u32)cmdline_u64("rwmixread", 50), verify,
                 cmdline_u64("thinktime_us", 0));
    /* Stop cleanly: shut down, wait for shutdown complete. */
    mmio_write32(bar0 + 0x14, 0x00464001);
    return rc ? EXIT_FAIL : EXIT_OK;
}
