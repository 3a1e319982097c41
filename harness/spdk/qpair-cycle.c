/* qpair-cycle: I/O queue pairs freed and allocated again in a loop, through SPDK's stock NVMe
 * driver (linked as a library by build.sh). Each cycle allocates QPAIRS I/O queue pairs
 * (Create I/O CQ/SQ on the controller), writes one block on each with a pattern naming the
 * cycle and the queue pair, reads it back on the same pair, checks it (with -v), and frees them
 * (Delete I/O SQ/CQ), in reverse order on odd cycles. Every wait is bounded.
 *
 *   qpair-cycle -r 'trtype:VFIOUSER traddr:DIR subnqn:NQN' [-n CYCLES] [-q QPAIRS] [-s MEM_MB] [-v]
 *
 * Prints one line: "qpair-cycle: cycles=N qpairs=Q allocs=A frees=F ios=I errors=E mismatches=M"
 * and exits 0 only when every allocation, command and (with -v) comparison succeeded. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "spdk/env.h"
#include "spdk/nvme.h"

#define MAX_QPAIRS 32
#define IO_TIMEOUT_S 10

struct io {
	bool done;
	bool failed;
};

static void
io_done(void *arg, const struct spdk_nvme_cpl *cpl)
{
	struct io *io = arg;

	io->failed = spdk_nvme_cpl_is_error(cpl);
	io->done = true;
}

/* Polls QP until IO completes or IO_TIMEOUT_S passes; 0 on a successful completion. */
static int
wait_io(struct spdk_nvme_qpair *qp, struct io *io)
{
	uint64_t end = spdk_get_ticks() + IO_TIMEOUT_S * spdk_get_ticks_hz();

	while (!io->done) {
		if (spdk_nvme_qpair_process_completions(qp, 0) < 0) {
			fprintf(stderr, "qpair-cycle: the qpair failed while waiting\n");
			return -1;
		}
		if (spdk_get_ticks() > end) {
			fprintf(stderr, "qpair-cycle: no completion in %d s\n", IO_TIMEOUT_S);
			return -1;
		}
	}
	return io->failed ? -1 : 0;
}

static void
fill(uint8_t *buf, uint32_t len, uint32_t cycle, uint32_t q)
{
	for (uint32_t i = 0; i < len; i++) {
		buf[i] = (uint8_t)(i * 7 + cycle * 13 + q * 31 + 1);
	}
}

int
main(int argc, char **argv)
{
	const char *trstr = NULL;
	uint32_t cycles = 100, nq = 4, mem_mb = 64;
	bool verify = false;
	int c;

	while ((c = getopt(argc, argv, "r:n:q:s:v")) != -1) {
		switch (c) {
		case 'r': trstr = optarg; break;
		case 'n': cycles = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 'q': nq = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 's': mem_mb = (uint32_t)strtoul(optarg, NULL, 10); break;
		case 'v': verify = true; break;
		default:
			fprintf(stderr, "usage: %s -r TRID [-n CYCLES] [-q QPAIRS] [-s MEM_MB] [-v]\n", argv[0]);
			return 2;
		}
	}
	if (trstr == NULL || nq == 0 || nq > MAX_QPAIRS || cycles == 0 || mem_mb == 0) {
		fprintf(stderr, "qpair-cycle: need -r TRID, 1 <= -q <= %d, -n >= 1, -s >= 1\n", MAX_QPAIRS);
		return 2;
	}

	struct spdk_env_opts opts;
	opts.opts_size = sizeof(opts);
	spdk_env_opts_init(&opts);
	opts.name = "qpair_cycle";
	opts.mem_size = (int)mem_mb;
	opts.shm_id = -1;
	opts.no_pci = true;			/* a vfio-user controller is no PCI device of the host */
	opts.hugepage_single_segments = true;	/* one fd per memory segment list, as perf's -g */
	if (spdk_env_init(&opts) < 0) {
		fprintf(stderr, "qpair-cycle: spdk_env_init failed\n");
		return 1;
	}
	struct spdk_nvme_transport_id trid;
	memset(&trid, 0, sizeof(trid));
	if (spdk_nvme_transport_id_parse(&trid, trstr) != 0) {
		fprintf(stderr, "qpair-cycle: bad transport id '%s'\n", trstr);
		return 1;
	}
	struct spdk_nvme_ctrlr *ctrlr = spdk_nvme_connect(&trid, NULL, 0);
	if (ctrlr == NULL) {
		fprintf(stderr, "qpair-cycle: spdk_nvme_connect failed\n");
		return 1;
	}
	uint32_t nsid = spdk_nvme_ctrlr_get_first_active_ns(ctrlr);
	struct spdk_nvme_ns *ns = nsid ? spdk_nvme_ctrlr_get_ns(ctrlr, nsid) : NULL;
	if (ns == NULL) {
		fprintf(stderr, "qpair-cycle: the controller has no active namespace\n");
		spdk_nvme_detach(ctrlr);
		return 1;
	}
	uint32_t bsz = spdk_nvme_ns_get_sector_size(ns);
	uint64_t nblocks = spdk_nvme_ns_get_num_sectors(ns);
	uint8_t *wbuf = spdk_zmalloc(bsz, 4096, NULL, SPDK_ENV_NUMA_ID_ANY, SPDK_MALLOC_DMA);
	uint8_t *rbuf = spdk_zmalloc(bsz, 4096, NULL, SPDK_ENV_NUMA_ID_ANY, SPDK_MALLOC_DMA);
	if (wbuf == NULL || rbuf == NULL || nblocks == 0) {
		fprintf(stderr, "qpair-cycle: no DMA buffer or an empty namespace\n");
		spdk_nvme_detach(ctrlr);
		return 1;
	}

	struct spdk_nvme_qpair *qp[MAX_QPAIRS];
	uint64_t allocs = 0, frees = 0, ios = 0, errors = 0, mismatches = 0;
	uint32_t cycle;
	for (cycle = 0; cycle < cycles && errors == 0; cycle++) {
		uint32_t got = 0;
		for (uint32_t q = 0; q < nq; q++) {
			qp[q] = spdk_nvme_ctrlr_alloc_io_qpair(ctrlr, NULL, 0);
			if (qp[q] == NULL) {
				fprintf(stderr, "qpair-cycle: cycle %u: allocating qpair %u failed\n", cycle, q);
				errors++;
				break;
			}
			got++;
			allocs++;
		}
		for (uint32_t q = 0; q < got && errors == 0; q++) {
			uint64_t lba = ((uint64_t)cycle * nq + q) % nblocks;
			struct io w = {0}, r = {0};
			fill(wbuf, bsz, cycle, q);
			memset(rbuf, 0, bsz);
			if (spdk_nvme_ns_cmd_write(ns, qp[q], wbuf, lba, 1, io_done, &w, 0) != 0 ||
			    wait_io(qp[q], &w) != 0) {
				fprintf(stderr, "qpair-cycle: cycle %u qpair %u: write of LBA %lu failed\n",
					cycle, q, (unsigned long)lba);
				errors++;
				break;
			}
			if (spdk_nvme_ns_cmd_read(ns, qp[q], rbuf, lba, 1, io_done, &r, 0) != 0 ||
			    wait_io(qp[q], &r) != 0) {
				fprintf(stderr, "qpair-cycle: cycle %u qpair %u: read of LBA %lu failed\n",
					cycle, q, (unsigned long)lba);
				errors++;
				break;
			}
			ios += 2;
			if (verify && memcmp(wbuf, rbuf, bsz) != 0) {
				fprintf(stderr, "qpair-cycle: cycle %u qpair %u: LBA %lu read back differs\n",
					cycle, q, (unsigned long)lba);
				mismatches++;
			}
		}
		for (uint32_t i = 0; i < got; i++) {
			uint32_t q = (cycle & 1) ? got - 1 - i : i;
			if (spdk_nvme_ctrlr_free_io_qpair(qp[q]) != 0) {
				fprintf(stderr, "qpair-cycle: cycle %u: freeing qpair %u failed\n", cycle, q);
				errors++;
			} else {
				frees++;
			}
		}
	}
	printf("qpair-cycle: cycles=%u qpairs=%u allocs=%lu frees=%lu ios=%lu errors=%lu mismatches=%lu\n",
	       cycle, nq, (unsigned long)allocs, (unsigned long)frees, (unsigned long)ios,
	       (unsigned long)errors, (unsigned long)mismatches);
	spdk_free(wbuf);
	spdk_free(rbuf);
	if (spdk_nvme_detach(ctrlr) != 0) {
		fprintf(stderr, "qpair-cycle: detach failed\n");
		errors++;
	}
	spdk_env_fini();
	return errors == 0 && mismatches == 0 ? 0 : 1;
}
