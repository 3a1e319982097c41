/*
 * iopath guest: the fio-like load generator the block drivers share
 * (nvmeperf in nvme.c, vblk in virtio.c). A driver provides three hooks
 * (issue a command for a slot, reap one completion, tell the device about
 * new commands); load_job() runs the job, time based or verify, keeps the
 * latency histogram, and the driver prints its record with load_print_*().
 * Records carry the driver's prefix: "@PREFIX-window start|end",
 * "@PREFIX-hist b:count ...", "@PREFIX-hist-end", "@PREFIX-error ...". A
 * randrw job (rwmixread=N percent reads) adds its reads and writes apart
 * after them: "@PREFIX-read ios=.. lat_sum=.. ..." with its
 * "@PREFIX-read-hist" lines and "-hist-end", then the same for "-write";
 * the driver's own record and histogram hold both.
 */
#ifndef IOPATH_LOAD_H
#define IOPATH_LOAD_H
#include "guest.h"

#define LOAD_PAGE 4096ull
#define LOAD_OP_WRITE 1
#define LOAD_OP_READ 2

/* One command slot: its data buffer, a driver-owned page (PRP list, request
 * header), and what is in flight in it. */
struct load_slot {
    u64 buf, aux, t0, lba;
    u8 op, busy;
};

struct load_ops {
    const char *prefix;
    /* Queue command op (LOAD_OP_*) for slot i of queue q on lba; not yet told. */
    void (*issue)(u32 q, u32 i, struct load_slot *s, u8 op, u64 lba);
    /* One completion of queue q if there is one: its slot index and status (0 ok). */
    int (*reap)(u32 q, u32 *i, u32 *status);
    /* Tell the device about what was reaped and issued on queue q. */
    void (*kick)(u32 q);
    /* Optional: after a pass that found no completion (I/O in flight),
       sleep until the device signals one. NULL: poll. */
    void (*wait)(void);
};

struct load_job {
    const char *rw; /* read|write|randread|randwrite|randrw */
    u64 time_ms, think_us, bs, lba_bytes, range_lbas, batch_submit;
    u32 nq, depth, mixread;
    int verify;
    struct load_slot *slots; /* nq * depth */
};

/* The deepest queue a job may keep (nvme's and virtio's limits are lower). */
#define LOAD_MAX_DEPTH 1024

/* How many of the longest gaps between consecutive completions a job keeps. */
#define LOAD_GAPS 32

struct load_result {
    u64 ios, cycles, mismatches, verified;
    /* The LOAD_GAPS longest gaps between consecutive reaping passes that
       found completions (the first from the window's start), in cycles,
       longest first: a device that stopped (its process killed and
       replaced) shows as one of them. */
    u64 gaps[LOAD_GAPS];
    u32 ngaps;
    /* Cycles of reaping passes that found no completion: the driver waiting
       for the device (near cycles: the device is the bottleneck). */
    u64 wait_cycles;
    u64 sleeps; /* ops->wait calls */
};

/* Bump allocator over identity-mapped guest RAM (zeroed, page aligned). */
extern u64 load_mem_next, load_mem_end;
void *load_alloc(u64 n);

void load_seed(u64 seed);
/* Resets the latency statistics and error count. */
void load_reset(void);
extern u64 load_errors;
/* rw= from the command line into rw[16]; 0, or -1 after an error record. */
int load_parse_rw(const char *prefix, char rw[16]);
/* Runs the job; 0, or -1 after an error record (the result is then partial). */
int load_run(const struct load_ops *ops, const struct load_job *j, struct load_result *r);
/* " ios=.. cycles=.. wait_cycles=.. sleeps=.. lat_sum=.. lat_min=.. lat_max=.. p50=.. p90=.. p99=.. p999=.." */
void load_print_lat(const struct load_result *r);
/* " thinktime_us=.." / " verified_blocks=.. mismatches=.. gaps=c1,c2,.." (cycles, longest
   first) / " rwmixread=..", the newline,
   the histogram; a randrw job's read and write records and histograms. */
void load_print_end(const char *prefix, const struct load_job *j, const struct load_result *r);

#endif
