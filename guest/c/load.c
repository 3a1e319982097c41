/*
 * iopath guest: the shared load generator (load.h). A log-linear latency
 * histogram of cycles (HIST_SUB buckets per power of two), xorshift LBAs,
 * and the verify pattern: every 8 bytes carry their LBA and offset. A
 * randrw job keeps reads and writes apart (a histogram, count, sum and
 * extremes each) and adds them up for the job's own figures at its end.
 */
#include "load.h"

/* 64 buckets per power of two: each at most 1/64 (1.6 %) of its value wide,
   finer than the 2 % a timing model's latency is judged by. */
#define HIST_SUB_BITS 6
#define HIST_SUB (1u << HIST_SUB_BITS)
#define HIST_BUCKETS (64 * HIST_SUB)
#define HIST_PER_LINE 32

u64 load_mem_next, load_mem_end, load_errors;
/* The latencies of a set of I/Os, in cycles. */
struct lat_stats {
    u64 hist[HIST_BUCKETS];
    u64 ios, sum, min, max;
};
/* Every I/O of the job; a randrw job's reads ([0]) and writes ([1]) apart,
   added into all at its end. */
static struct lat_stats all, dirs[2];
static const char *const dir_names[2] = {"read", "write"};
static u64 rng_state;
/* The slots a reaping pass found completed. */
static u32 reaped[LOAD_MAX_DEPTH];
/* Their latencies, in cycles, and what each command was (LOAD_OP_*). */
static u64 lat[LOAD_MAX_DEPTH];
static u8 lat_op[LOAD_MAX_DEPTH];

void *load_alloc(u64 n)
{
    u64 a = (load_mem_next + LOAD_PAGE - 1) & ~(LOAD_PAGE - 1);
    if (a + n > load_mem_end)
        return NULL;
    load_mem_next = a + n;
    memset((void *)a, 0, n);
    return (void *)a;
}

void load_seed(u64 seed) { rng_state = seed * 0x9e3779b97f4a7c15ull | 1; }

void load_reset(void)
{
    memset(&all, 0, sizeof(all));
    memset(dirs, 0, sizeof(dirs));
    all.min = dirs[0].min = dirs[1].min = ~0ull;
    load_errors = 0;
}

static u64 rnd(void)
{
    u64 x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

/* The next block of a sequential stream (below blocks), without a division. */
static u64 next_seq(u64 *at, u64 blocks)
{
    u64 b = *at;
    *at = b + 1 >= blocks ? 0 : b + 1;
    return b;
}

/* A random number below n: the high half of rnd() * n, a multiply where
   rnd() % n would be a 64-bit division (tens of cycles) on every I/O. */
static u64 rnd_below(u64 n) { return (u64)(((unsigned __int128)rnd() * n) >> 64); }

static void hist_add(struct lat_stats *st, u64 c)
{
    u32 msb = 63 - (u32)__builtin_clzll(c | 1);
    u32 sub = msb >= HIST_SUB_BITS ? (u32)(c >> (msb - HIST_SUB_BITS)) & (HIST_SUB - 1) : (u32)c & (HIST_SUB - 1);
    u32 b = msb * HIST_SUB + sub;
    st->hist[b < HIST_BUCKETS ? b : HIST_BUCKETS - 1]++;
    st->ios++;
    st->sum += c;
    if (c < st->min)
        st->min = c;
    if (c > st->max)
        st->max = c;
}

/* Adds a's I/Os into st. */
static void stats_add(struct lat_stats *st, const struct lat_stats *a)
{
    for (u32 b = 0; b < HIST_BUCKETS; b++)
        st->hist[b] += a->hist[b];
    st->ios += a->ios;
    st->sum += a->sum;
    if (a->min < st->min)
        st->min = a->min;
    if (a->max > st->max)
        st->max = a->max;
}

/* Upper edge of bucket b, in cycles. */
static u64 hist_value(u32 b)
{
    u32 msb = b / HIST_SUB, sub = b % HIST_SUB;
    if (msb < HIST_SUB_BITS)
        return sub;
    return ((u64)(HIST_SUB + sub + 1) << (msb - HIST_SUB_BITS)) - 1;
}

static u64 percentile(const struct lat_stats *st, u64 per_mille_x10)
{
    u64 want = (st->ios * per_mille_x10 + 9999) / 10000, seen = 0;
    for (u32 b = 0; b < HIST_BUCKETS; b++) {
        seen += st->hist[b];
        if (seen >= want && want)
            return hist_value(b);
    }
    return 0;
}

/* st's histogram as "@PREFIX[-DIR]-hist" lines, non-empty buckets only:
 * bucket index and count (the host knows the bucket layout of hist_add). At
 * most 32 pairs a line, so a line stays under 900 bytes and the whole dump
 * under 128 lines. dir: "" or "-read", "-write". */
static void hist_dump(const char *prefix, const char *dir, const struct lat_stats *st)
{
    u32 n = 0, lines = 0;
    for (u32 b = 0; b < HIST_BUCKETS; b++) {
        if (!st->hist[b])
            continue;
        if (n % HIST_PER_LINE == 0) {
            printf(n ? "\n@%s%s-hist" : "@%s%s-hist", prefix, dir);
            lines++;
        }
        printf(" %u:%lu", b, st->hist[b]);
        n++;
    }
    if (n)
        printf("\n");
    printf("@%s%s-hist-end buckets=%u lines=%u\n", prefix, dir, n, lines);
}

/* " lat_sum=.. lat_min=.. lat_max=.. p50=.. p90=.. p99=.. p999=.." of st
   (lat_min 0 when it holds no I/O). */
static void print_stats(const struct lat_stats *st)
{
    printf(" lat_sum=%lu lat_min=%lu lat_max=%lu p50=%lu p90=%lu p99=%lu p999=%lu", st->sum, st->ios ? st->min : 0,
           st->max, percentile(st, 5000), percentile(st, 9000), percentile(st, 9900), percentile(st, 9990));
}

/* A job's next command: a write or a read, as rw= and rwmixread= say. */
static u8 next_op(const struct load_job *j, int mixed, int is_write)
{
    int w = mixed ? rnd_below(100) >= j->mixread : is_write;
    return w ? LOAD_OP_WRITE : LOAD_OP_READ;
}

/* Fills in slot s for its next command, issued at t0, and issues it. */
static void start_io(const struct load_ops *ops, u32 q, u32 i, struct load_slot *s, u8 op, u64 lba, u64 t0)
{
    s->op = op;
    s->lba = lba;
    s->t0 = t0;
    s->busy = 1;
    ops->issue(q, i, s, op, lba);
}

static u64 pattern_word(const struct load_job *j, u64 lba, u64 i, u64 seed)
{
    return (lba + i * 8 / j->lba_bytes) * 0x9e3779b97f4a7c15ull ^ (i * 8 % j->lba_bytes) ^ seed;
}

static void pattern(const struct load_job *j, u64 buf, u64 lba, u64 seed)
{
    u64 *p = (u64 *)buf;
    for (u64 i = 0; i < j->bs / 8; i++)
        p[i] = pattern_word(j, lba, i, seed);
}

/* 1 if the buffer read back from s->lba is not the pattern. */
static int mismatch(const char *prefix, const struct load_job *j, const struct load_slot *s, u64 seed, u64 seen)
{
    u64 *p = (u64 *)s->buf;
    for (u64 i = 0; i < j->bs / 8; i++) {
        u64 w = pattern_word(j, s->lba, i, seed);
        if (p[i] != w) {
            if (seen < 10)
                printf("@%s-mismatch lba=%lu offset=%lu got=0x%lx want=0x%lx\n", prefix,
                       s->lba + i * 8 / j->lba_bytes, i * 8 % j->lba_bytes, p[i], w);
            return 1;
        }
    }
    return 0;
}

int load_parse_rw(const char *prefix, char rw[16])
{
    const char *rwv = cmdline_get("rw");
    memcpy(rw, "randread", 9);
    for (u32 i = 0; rwv && i < 15; i++) {
        rw[i] = (rwv[i] == ' ') ? 0 : rwv[i];
        rw[i + 1] = 0;
        if (!rwv[i] || rwv[i] == ' ')
            break;
    }
    if (strncmp(rw, "read", 5) && strncmp(rw, "write", 6) && strncmp(rw, "randread", 9) && strncmp(rw, "randwrite", 10) &&
        strncmp(rw, "randrw", 7)) {
        printf("@%s-error rw=%s: use read, write, randread, randwrite or randrw\n", prefix, rw);
        return -1;
    }
    return 0;
}

/* Keeps gap g among r's LOAD_GAPS longest, longest first (most gaps are
   short: one comparison with the shortest kept). */
static void gap_add(struct load_result *r, u64 g)
{
    u32 n = r->ngaps;
    if (n == LOAD_GAPS && g <= r->gaps[n - 1])
        return;
    u32 i = n < LOAD_GAPS ? n : LOAD_GAPS - 1;
    for (; i > 0 && r->gaps[i - 1] < g; i--)
        r->gaps[i] = r->gaps[i - 1];
    r->gaps[i] = g;
    if (n < LOAD_GAPS)
        r->ngaps = n + 1;
}

int load_run(const struct load_ops *ops, const struct load_job *j, struct load_result *r)
{
    const char *rw = j->rw, *px = ops->prefix;
    u32 nq = j->nq, depth = j->depth;
    int verify = j->verify;
    u64 bs = j->bs, lbs = bs / j->lba_bytes;
    u64 think = j->think_us * tsc_khz / 1000;
    int rnd_rw = rw[0] == 'r' && rw[1] == 'a';
    int is_write = !strncmp(rw, "write", 5) || !strncmp(rw, "randwrite", 9);
    int mixed = !strncmp(rw, "randrw", 6);
    /* A randrw job counts and times reads and writes apart (verify: write then read back, one set). */
    int split = mixed && !verify;
    u64 seq[16];
    u64 blocks = j->range_lbas / lbs;
    memset(r, 0, sizeof(*r));
    if (!blocks) {
        printf("@%s-error the range holds no block of %lu bytes\n", px, bs);
        return -1;
    }
    if (mixed && j->mixread > 100) {
        printf("@%s-error rwmixread=%u: a percentage of reads, 0 to 100\n", px, j->mixread);
        return -1;
    }
    if (nq > 16 || depth > LOAD_MAX_DEPTH) {
        printf("@%s-error %u queues of depth %u: at most 16 of %u\n", px, nq, depth, LOAD_MAX_DEPTH);
        return -1;
    }
    for (u32 q = 0; q < nq; q++)
        seq[q] = q * (blocks / nq);
    u64 ios = 0, mismatches = 0, unrung = 0;
    printf("@%s-window start\n", px);
    u64 t_start = rdtsc(), t_end = t_start + j->time_ms * tsc_khz;
    int stopping = 0;
    u64 inflight = 0;
    u64 verify_written = 0;
    /* Verify: write every block of the range once, then read them all back. */
    for (u32 q = 0; q < nq; q++) {
        for (u32 i = 0; i < depth; i++) {
            struct load_slot *s = &j->slots[q * depth + i];
            u64 blk;
            u8 op;
            if (verify) {
                blk = verify_written++;
                if (blk >= blocks)
                    break;
                op = LOAD_OP_WRITE;
            } else {
                op = next_op(j, mixed, is_write);
                blk = rnd_rw ? rnd_below(blocks) : next_seq(&seq[q], blocks);
            }
            if (op == LOAD_OP_WRITE && verify)
                pattern(j, s->buf, blk * lbs, rng_state);
            start_io(ops, q, i, s, op, blk * lbs, rdtsc());
            inflight++;
        }
        ops->kick(q);
    }
    u64 vseed = rng_state, read_back = 0;
    int vphase = 0; /* 0 writing, 1 reading */
    /* now: the last clock read. idle_since: when the passes began to find
       nothing (0 while they find completions); wait sums those spans. */
    u64 now = rdtsc(), idle_since = now, wait = 0, idle_passes = 0;
    u64 last_seen = t_start; /* the last pass that found completions */
    while (inflight) {
        if (!verify && now >= t_end)
            stopping = 1;
        int any = 0;
        for (u32 q = 0; q < nq; q++) {
            u32 i, st, n = 0;
            int got = 0;
            /* First every completion there is, then one clock read: the end of
               their latencies and the start of the commands that replace them.
               RDTSC takes tens of cycles, and reading it twice for every I/O
               was a large part of the driver's own cost at QD16 (the ring
               floor times its batches the same way). Read after the last
               completion was seen and before the first new command is built,
               it never shortens a latency: it may lengthen one by the pass's
               own work. The histogram is filled after the kick, while the
               controller serves the new commands. */
            while (ops->reap(q, &i, &st)) {
                got = 1;
                /* An unknown slot, or one completed twice, is the device's
                   error, not an I/O: inflight stays as it is. */
                if (i >= depth) {
                    printf("@%s-error unknown cid=%u\n", px, i);
                    load_errors++;
                    continue;
                }
                struct load_slot *s = &j->slots[q * depth + i];
                if (!s->busy) {
                    printf("@%s-error cid=%u completed twice\n", px, i);
                    load_errors++;
                    continue;
                }
                s->busy = 0;
                inflight--;
                ios++;
                if (st && load_errors++ < 10)
                    printf("@%s-error op=%u lba=%lu status=0x%x\n", px, s->op, s->lba, st);
                if (verify && s->op == LOAD_OP_READ)
                    mismatches += (u64)mismatch(px, j, s, vseed, mismatches);
                reaped[n++] = i; /* at most depth: each was busy */
            }
            if (!n) {
                if (got) /* only errors: the CQ head moved all the same */
                    ops->kick(q);
                continue;
            }
            const u64 t_seen = now = rdtsc();
            u64 t = t_seen; /* when the next command is issued */
            gap_add(r, t_seen - last_seen);
            last_seen = t_seen;
            if (idle_since) {
                wait += t_seen - idle_since;
                idle_since = 0;
            }
            any = 1;
            for (u32 k = 0; k < n; k++) {
                i = reaped[k];
                struct load_slot *s = &j->slots[q * depth + i];
                lat[k] = t_seen - s->t0;
                lat_op[k] = s->op;
                /* Next command in this slot. */
                u64 blk;
                u8 op;
                if (verify) {
                    if (vphase == 0 && verify_written < blocks) {
                        blk = verify_written++;
                        op = LOAD_OP_WRITE;
                        pattern(j, s->buf, blk * lbs, vseed);
                    } else if (vphase == 1 && read_back < blocks) {
                        blk = read_back++;
                        op = LOAD_OP_READ;
                        memset((void *)s->buf, 0, bs);
                    } else {
                        continue;
                    }
                } else if (!stopping) {
                    if (think) {
                        for (u64 t1 = rdtsc(); rdtsc() - t1 < think;)
                            cpu_relax();
                        t = rdtsc(); /* issued after its own think time */
                    }
                    op = next_op(j, mixed, is_write);
                    blk = rnd_rw ? rnd_below(blocks) : next_seq(&seq[q], blocks);
                } else {
                    continue;
                }
                start_io(ops, q, i, s, op, blk * lbs, t);
                inflight++;
                /* Told after every batch_submit commands issued while reaping. */
                if (!verify && j->batch_submit && ++unrung >= j->batch_submit) {
                    ops->kick(q);
                    unrung = 0;
                }
            }
            ops->kick(q);
            for (u32 k = 0; k < n; k++)
                hist_add(split ? &dirs[lat_op[k] == LOAD_OP_WRITE] : &all, lat[k]);
        }
        /* A pass that found nothing reads the clock when the waiting starts
           and then every 64th pass only: a read in every pass would delay
           seeing the next completion by up to its own length. */
        if (!any && (!idle_since || ++idle_passes % 64 == 0)) {
            now = rdtsc();
            if (!idle_since)
                idle_since = now;
        }
        /* An interrupt-driven driver: nothing there, sleep until a completion
           is signalled (its time counts as waiting, as polling's does). */
        if (!any && ops->wait && inflight) {
            ops->wait();
            r->sleeps++;
            now = rdtsc();
        }
        /* Verify: once every write is done, read everything back. */
        if (verify && vphase == 0 && !inflight && verify_written >= blocks) {
            vphase = 1;
            for (u32 q = 0; q < nq; q++) {
                for (u32 i = 0; i < depth && read_back < blocks; i++) {
                    struct load_slot *s = &j->slots[q * depth + i];
                    u64 blk = read_back++;
                    memset((void *)s->buf, 0, bs);
                    start_io(ops, q, i, s, LOAD_OP_READ, blk * lbs, rdtsc());
                    inflight++;
                }
                ops->kick(q);
            }
        }
        if (!verify && now - t_start > (j->time_ms + 5000) * tsc_khz) {
            printf("@%s-error %lu I/Os never completed\n", px, inflight);
            return -1;
        }
    }
    r->cycles = rdtsc() - t_start;
    r->wait_cycles = wait;
    printf("@%s-window end\n", px);
    if (split) {
        stats_add(&all, &dirs[0]);
        stats_add(&all, &dirs[1]);
    }
    r->ios = ios;
    r->mismatches = mismatches;
    r->verified = read_back;
    return 0;
}

void load_print_lat(const struct load_result *r)
{
    printf(" ios=%lu cycles=%lu wait_cycles=%lu sleeps=%lu", r->ios, r->cycles, r->wait_cycles, r->sleeps);
    print_stats(&all);
}

void load_print_end(const char *prefix, const struct load_job *j, const struct load_result *r)
{
    int split = !j->verify && !strncmp(j->rw, "randrw", 6);
    if (j->think_us)
        printf(" thinktime_us=%lu", j->think_us);
    if (j->verify) {
        printf(" verified_blocks=%lu mismatches=%lu gaps=", r->verified, r->mismatches);
        for (u32 i = 0; i < r->ngaps; i++)
            printf(i ? ",%lu" : "%lu", r->gaps[i]);
        if (!r->ngaps)
            printf("0");
    }
    if (split)
        printf(" rwmixread=%u", j->mixread);
    printf("\n");
    hist_dump(prefix, "", &all);
    /* randrw: reads and writes apart, each a record and a histogram of its own. */
    for (u32 d = 0; split && d < 2; d++) {
        printf("@%s-%s ios=%lu", prefix, dir_names[d], dirs[d].ios);
        print_stats(&dirs[d]);
        printf("\n");
        hist_dump(prefix, d ? "-write" : "-read", &dirs[d]);
    }
}
