/*
 * nfs_load: an NFSv3 load generator on libnfs's asynchronous API, QD
 * requests in flight on one TCP connection, driven by a poll() loop
 * (nfs_get_fd / nfs_which_events / nfs_service).
 *
 * Build: cc -O2 -Wall -Wextra -o nfs_load nfs_load.c -lnfs
 *
 * Usage: nfs_load URL MODE [options]
 *   URL   nfs://127.0.0.1/EXPORT?nfsport=P&mountport=M&version=3
 *   MODE  seqwrite | seqread | randwrite | randread | verify     (file -f)
 *         create | lookup | getattr | stat | list | remove     (-n files)
 * Options:
 *   -q QD        requests in flight (32)
 *   -t SECONDS   run time of randread / randwrite (10)
 *   -s MIB       file size (1024)
 *   -b BYTES     block size (4096; use 1048576 for the 1M streams)
 *   -f PATH      file (/nfs_load.bin)
 *   -n N         files for the metadata modes (1000)
 *   -p PREFIX    metadata file names: /PREFIX0000000 ... in the export's
 *                root ("m")
 *   -S           FILE_SYNC writes (opens with O_SYNC: libnfs then sends
 *                every WRITE with stable_how FILE_SYNC, otherwise UNSTABLE)
 *   -c BYTES     UNSTABLE writes: COMMIT after every BYTES written
 *                (1048576; 0 = only the final COMMIT)
 *   -V           reads check the offset stamped at the head of every 4K
 *                block by seqwrite / randwrite
 *
 * Metadata modes, what goes on the wire:
 *   create  nfs_creat_async + nfs_close_async (CREATE in the root)
 *   lookup  one raw LOOKUP3 of each name in the export's root handle
 *   getattr one raw GETATTR3 of each file's handle (handles found first by
 *           an untimed LOOKUP pass)
 *   stat    nfs_stat64_async of "/NAME" (libnfs: LOOKUP then GETATTR)
 *   list    nfs_opendir_async("/") (READDIRPLUS until EOF); one stream,
 *           ops = entries; -n is the least number of entries expected
 *   remove  nfs_unlink_async of "/NAME" (REMOVE)
 *
 * Prints one line: RESULT key=value ... (ops, seconds, ops_per_s,
 * mib_per_s, p50_us, p99_us, ...). Exits non-zero on any error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <nfsc/libnfs.h>
#include <nfsc/libnfs-raw.h>
#include <nfsc/libnfs-raw-mount.h>
#include <nfsc/libnfs-raw-nfs.h>

enum mode { SEQWRITE, SEQREAD, RANDWRITE, RANDREAD, VERIFY, CREATE, LOOKUP, GETATTR, STAT, LIST, REMOVE };
static const char *mode_names[] = {"seqwrite", "seqread", "randwrite", "randread", "verify", "create",
                                   "lookup", "getattr", "stat", "list", "remove"};

struct slot {
	int id;
	uint64_t offset; /* data modes: the block's offset */
	uint64_t index;  /* metadata modes: the file's number */
	double started;
	int committing;
	char *buf;
	char path[64];
};

struct handle {
	uint32_t len;
	char data[64];
};

static struct {
	struct nfs_context *nfs;
	struct rpc_context *rpc;
	struct nfsfh *fh;
	enum mode mode;
	int qd, sync, check_stamps;
	double seconds, deadline;
	uint64_t size, bs, files, commit_every;
	const char *file, *prefix;

	uint64_t next;          /* next block / file number to hand out */
	uint64_t total;         /* blocks / files to do (count modes) */
	uint64_t done;          /* operations completed */
	uint64_t bytes_since_commit, commits;
	int inflight, commit_inflight, failed;
	int phase_lookup_only;  /* getattr's untimed LOOKUP pass */

	uint32_t *lat;
	size_t nlat, caplat;

	struct handle root;
	struct handle *handles;
	uint64_t entries;
	uint64_t checked_blocks;
} g;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "nfs_load: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	exit(1);
}

static void fail(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "nfs_load: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	g.failed = 1;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng(void)
{
	/* xorshift64* */
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

static void record_latency(double started)
{
	if (g.nlat == g.caplat) {
		g.caplat = g.caplat ? g.caplat * 2 : 1 << 16;
		g.lat = realloc(g.lat, g.caplat * sizeof(*g.lat));
		if (!g.lat)
			die("out of memory");
	}
	double us = (now() - started) * 1e6;
	g.lat[g.nlat++] = us > 4e9 ? 4000000000u : (uint32_t)us;
}

/* Every 4K block written carries its own offset in its first 8 bytes. */
static void stamp(char *buf, uint64_t offset, uint64_t len)
{
	for (uint64_t o = 0; o + 8 <= len; o += 4096) {
		uint64_t v = offset + o;
		memcpy(buf + o, &v, 8);
	}
}

static int check_stamps(const char *buf, uint64_t offset, uint64_t len)
{
	for (uint64_t o = 0; o + 8 <= len; o += 4096) {
		uint64_t v;
		memcpy(&v, buf + o, 8);
		if (v != offset + o) {
			fail("read at %" PRIu64 ": block %" PRIu64 " carries stamp %" PRIu64, offset, offset + o, v);
			return -1;
		}
		g.checked_blocks++;
	}
	return 0;
}

/* The full pattern of verify mode: every byte a function of the offset. */
static void pattern(char *buf, uint64_t offset, uint64_t len)
{
	uint64_t s = offset * 0x9e3779b97f4a7c15ull + 0x1234567;
	for (uint64_t i = 0; i < len; i += 8) {
		s ^= s >> 12;
		s ^= s << 25;
		s ^= s >> 27;
		uint64_t v = s * 0x2545f4914f6cdd1dull;
		memcpy(buf + i, &v, len - i < 8 ? len - i : 8);
	}
	stamp(buf, offset, len); /* so that -V reads still pass afterwards */
}

static void issue(struct slot *s);

static void retire(struct slot *s)
{
	(void)s;
	g.inflight--;
}

/* Hands the slot its next operation, or retires it. */
static void next(struct slot *s)
{
	if (g.failed) {
		retire(s);
		return;
	}
	if (g.mode == RANDREAD || g.mode == RANDWRITE) {
		if (now() >= g.deadline) {
			retire(s);
			return;
		}
	} else if (g.next >= g.total) {
		retire(s);
		return;
	}
	issue(s);
}

static void commit_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	(void)nfs;
	g.commit_inflight = 0;
	s->committing = 0;
	if (err < 0) {
		fail("COMMIT: %s", (char *)data);
		retire(s);
		return;
	}
	g.commits++;
	next(s);
}

static void write_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	if (err < 0) {
		fail("WRITE at %" PRIu64 ": %s", s->offset, (char *)data);
		retire(s);
		return;
	}
	if ((uint64_t)err != g.bs) {
		fail("WRITE at %" PRIu64 ": %d bytes of %" PRIu64, s->offset, err, g.bs);
		retire(s);
		return;
	}
	record_latency(s->started);
	g.done++;
	if (!g.sync && g.commit_every) {
		g.bytes_since_commit += g.bs;
		if (g.bytes_since_commit >= g.commit_every && !g.commit_inflight && !g.failed) {
			g.bytes_since_commit = 0;
			g.commit_inflight = 1;
			s->committing = 1;
			if (nfs_fsync_async(nfs, g.fh, commit_cb, s) < 0) {
				fail("COMMIT: %s", nfs_get_error(nfs));
				retire(s);
			}
			return;
		}
	}
	next(s);
}

static void read_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	(void)nfs;
	if (err < 0) {
		fail("READ at %" PRIu64 ": %s", s->offset, (char *)data);
		retire(s);
		return;
	}
	if ((uint64_t)err != g.bs) {
		fail("READ at %" PRIu64 ": %d bytes of %" PRIu64, s->offset, err, g.bs);
		retire(s);
		return;
	}
	record_latency(s->started);
	if (g.check_stamps && check_stamps(data, s->offset, g.bs) < 0) {
		retire(s);
		return;
	}
	if (g.mode == VERIFY) {
		pattern(s->buf, s->offset, g.bs);
		if (memcmp(s->buf, data, g.bs) != 0) {
			fail("verify: block at %" PRIu64 " differs from what was written", s->offset);
			retire(s);
			return;
		}
		g.checked_blocks++;
	}
	g.done++;
	next(s);
}

static void close_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	(void)nfs;
	if (err < 0) {
		fail("close %s: %s", s->path, (char *)data);
		retire(s);
		return;
	}
	record_latency(s->started);
	g.done++;
	next(s);
}

static void creat_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	if (err < 0) {
		fail("creat %s: %s", s->path, (char *)data);
		retire(s);
		return;
	}
	if (nfs_close_async(nfs, data, close_cb, s) < 0) {
		fail("close %s: %s", s->path, nfs_get_error(nfs));
		retire(s);
	}
}

static void plain_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	struct slot *s = priv;
	(void)nfs;
	if (err < 0) {
		fail("%s %s: %s", mode_names[g.mode], s->path, (char *)data);
		retire(s);
		return;
	}
	if (g.mode == STAT) {
		struct nfs_stat_64 *st = data;
		if ((st->nfs_mode & S_IFMT) != S_IFREG) {
			fail("stat %s: not a regular file (mode %o)", s->path, (unsigned)st->nfs_mode);
			retire(s);
			return;
		}
	}
	record_latency(s->started);
	g.done++;
	next(s);
}

/* The checks both raw calls' replies share: the RPC went through and the
 * NFS status (the first field of every result union) is NFS3_OK. Fails
 * the slot and returns 0 otherwise. */
static int check_reply(const char *what, struct slot *s, int status, void *data)
{
	if (status != RPC_STATUS_SUCCESS) {
		fail("%s %s: rpc status %d %s", what, s->path, status, status == RPC_STATUS_ERROR ? (char *)data : "");
		retire(s);
		return 0;
	}
	nfsstat3 nfs_status = *(nfsstat3 *)data;
	if (nfs_status != NFS3_OK) {
		fail("%s %s: nfsstat3 %d", what, s->path, (int)nfs_status);
		retire(s);
		return 0;
	}
	return 1;
}

static void lookup_cb(struct rpc_context *rpc, int status, void *data, void *priv)
{
	struct slot *s = priv;
	(void)rpc;
	if (!check_reply("LOOKUP", s, status, data))
		return;
	LOOKUP3res *res = data;
	nfs_fh3 *fh = &res->LOOKUP3res_u.resok.object;
	if (fh->data.data_len == 0 || fh->data.data_len > sizeof(g.handles[0].data)) {
		fail("LOOKUP %s: handle of %u bytes", s->path, fh->data.data_len);
		retire(s);
		return;
	}
	if (g.handles) {
		g.handles[s->index].len = fh->data.data_len;
		memcpy(g.handles[s->index].data, fh->data.data_val, fh->data.data_len);
	}
	record_latency(s->started);
	g.done++;
	next(s);
}

static void getattr_cb(struct rpc_context *rpc, int status, void *data, void *priv)
{
	struct slot *s = priv;
	(void)rpc;
	if (!check_reply("GETATTR", s, status, data))
		return;
	GETATTR3res *res = data;
	if (res->GETATTR3res_u.resok.obj_attributes.type != NF3REG) {
		fail("GETATTR %s: not a regular file", s->path);
		retire(s);
		return;
	}
	record_latency(s->started);
	g.done++;
	next(s);
}

static void issue(struct slot *s)
{
	int rc = 0;
	s->started = now();
	switch (g.mode) {
	case SEQWRITE:
	case SEQREAD:
		s->offset = g.next++ * g.bs;
		break;
	case RANDWRITE:
	case RANDREAD:
		s->offset = (rng() % (g.size / g.bs)) * g.bs;
		break;
	case VERIFY:
		s->offset = g.next++ * (g.size / g.total / g.bs) * g.bs;
		break;
	default:
		s->index = g.next++;
		snprintf(s->path, sizeof(s->path), "/%s%07" PRIu64, g.prefix, s->index);
	}
	switch (g.mode) {
	case SEQWRITE:
	case RANDWRITE:
		stamp(s->buf, s->offset, g.bs);
		rc = nfs_pwrite_async(g.nfs, g.fh, s->offset, g.bs, s->buf, write_cb, s);
		break;
	case SEQREAD:
	case RANDREAD:
	case VERIFY:
		rc = nfs_pread_async(g.nfs, g.fh, s->offset, g.bs, read_cb, s);
		break;
	case CREATE:
		rc = nfs_creat_async(g.nfs, s->path, 0644, creat_cb, s);
		break;
	case STAT:
		rc = nfs_stat64_async(g.nfs, s->path, plain_cb, s);
		break;
	case REMOVE:
		rc = nfs_unlink_async(g.nfs, s->path, plain_cb, s);
		break;
	case LOOKUP:
	case GETATTR:
		if (g.mode == LOOKUP || g.phase_lookup_only) {
			LOOKUP3args args;
			memset(&args, 0, sizeof(args));
			args.what.dir.data.data_len = g.root.len;
			args.what.dir.data.data_val = g.root.data;
			args.what.name = s->path + 1;
			rc = rpc_nfs3_lookup_async(g.rpc, lookup_cb, &args, s);
		} else {
			GETATTR3args args;
			memset(&args, 0, sizeof(args));
			args.object.data.data_len = g.handles[s->index].len;
			args.object.data.data_val = g.handles[s->index].data;
			rc = rpc_nfs3_getattr_async(g.rpc, getattr_cb, &args, s);
		}
		break;
	case LIST:
		break;
	}
	if (rc < 0) {
		fail("%s: queueing failed: %s", mode_names[g.mode], nfs_get_error(g.nfs));
		retire(s);
	}
}

static void run_loop(void)
{
	while (g.inflight > 0) {
		struct pollfd p = {.fd = nfs_get_fd(g.nfs), .events = nfs_which_events(g.nfs)};
		int n = poll(&p, 1, 100);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			die("poll: %s", strerror(errno));
		}
		if (nfs_service(g.nfs, n > 0 ? p.revents : 0) < 0)
			die("nfs_service: %s", nfs_get_error(g.nfs));
	}
}

/* Starts QD slots (or as many as there is work for) and runs them dry. */
static void run_slots(struct slot *slots)
{
	g.inflight = g.qd;
	for (int i = 0; i < g.qd; i++)
		next(&slots[i]);
	run_loop();
}

static int done_flag;

static void final_commit_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	(void)nfs;
	(void)priv;
	if (err < 0)
		fail("final COMMIT: %s", (char *)data);
	else
		g.commits++;
	done_flag = 1;
	g.inflight--;
}

static void final_commit(void)
{
	if (g.sync || g.failed)
		return;
	g.inflight = 1;
	if (nfs_fsync_async(g.nfs, g.fh, final_commit_cb, NULL) < 0)
		die("final COMMIT: %s", nfs_get_error(g.nfs));
	run_loop();
}

static void list_cb(int err, struct nfs_context *nfs, void *data, void *priv)
{
	(void)priv;
	g.inflight--;
	if (err < 0) {
		fail("opendir /: %s", (char *)data);
		return;
	}
	struct nfsdir *dir = data;
	struct nfsdirent *e;
	while ((e = nfs_readdir(nfs, dir)) != NULL)
		g.entries++;
	nfs_closedir(nfs, dir);
}

/* The root handle from a MOUNT of our own (raw API): LOOKUP and GETATTR
 * go out as single raw RPCs on the libnfs context's connection. */
static void mount_connect_cb(struct rpc_context *rpc, int status, void *data, void *priv)
{
	(void)rpc;
	(void)priv;
	if (status != RPC_STATUS_SUCCESS)
		die("connect to MOUNT: %s", status == RPC_STATUS_ERROR ? (char *)data : "cancelled");
	done_flag = 1;
}

static void mount_mnt_cb(struct rpc_context *rpc, int status, void *data, void *priv)
{
	(void)rpc;
	(void)priv;
	if (status != RPC_STATUS_SUCCESS)
		die("MNT: %s", status == RPC_STATUS_ERROR ? (char *)data : "cancelled");
	mountres3 *res = data;
	if (res->fhs_status != MNT3_OK)
		die("MNT: status %d", (int)res->fhs_status);
	fhandle3 *fh = &res->mountres3_u.mountinfo.fhandle;
	if (fh->fhandle3_len == 0 || fh->fhandle3_len > sizeof(g.root.data))
		die("MNT: handle of %u bytes", fh->fhandle3_len);
	g.root.len = fh->fhandle3_len;
	memcpy(g.root.data, fh->fhandle3_val, fh->fhandle3_len);
	done_flag = 1;
}

static void wait_rpc(struct rpc_context *rpc)
{
	done_flag = 0;
	while (!done_flag) {
		struct pollfd p = {.fd = rpc_get_fd(rpc), .events = rpc_which_events(rpc)};
		int n = poll(&p, 1, 100);
		if (n < 0 && errno != EINTR)
			die("poll: %s", strerror(errno));
		if (rpc_service(rpc, n > 0 ? p.revents : 0) < 0)
			die("rpc_service: %s", rpc_get_error(rpc));
	}
}

static void root_handle(const char *server, const char *export, int mountport)
{
	struct rpc_context *rpc = rpc_init_context();
	if (!rpc)
		die("rpc_init_context");
	if (rpc_connect_async(rpc, server, mountport, mount_connect_cb, NULL) < 0)
		die("connect to MOUNT: %s", rpc_get_error(rpc));
	wait_rpc(rpc);
	if (rpc_mount3_mnt_async(rpc, mount_mnt_cb, (char *)export, NULL) < 0)
		die("MNT: %s", rpc_get_error(rpc));
	wait_rpc(rpc);
	rpc_destroy_context(rpc);
}

static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

static double percentile(double p)
{
	if (!g.nlat)
		return 0;
	size_t i = (size_t)(p * (g.nlat - 1) + 0.5);
	return g.lat[i];
}

static void usage(void)
{
	fprintf(stderr, "usage: nfs_load URL seqwrite|seqread|randwrite|randread|verify|create|lookup|getattr|stat|list|remove\n"
			"       [-q QD] [-t SECONDS] [-s MIB] [-b BYTES] [-f PATH] [-n FILES] [-p PREFIX] [-S] [-c BYTES] [-V]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	if (argc < 3)
		usage();
	const char *url = argv[1];
	const char *mode = argv[2];
	g.mode = (enum mode)-1;
	for (unsigned i = 0; i < sizeof(mode_names) / sizeof(mode_names[0]); i++)
		if (!strcmp(mode, mode_names[i]))
			g.mode = (enum mode)i;
	if ((int)g.mode < 0)
		usage();
	g.qd = 32;
	g.seconds = 10;
	g.size = 1024ull << 20;
	g.bs = 4096;
	g.files = 1000;
	g.file = "/nfs_load.bin";
	g.prefix = "m";
	g.commit_every = 1 << 20;
	optind = 3;
	int opt;
	while ((opt = getopt(argc, argv, "q:t:s:b:f:n:p:Sc:V")) != -1) {
		switch (opt) {
		case 'q': g.qd = atoi(optarg); break;
		case 't': g.seconds = atof(optarg); break;
		case 's': g.size = strtoull(optarg, NULL, 0) << 20; break;
		case 'b': g.bs = strtoull(optarg, NULL, 0); break;
		case 'f': g.file = optarg; break;
		case 'n': g.files = strtoull(optarg, NULL, 0); break;
		case 'p': g.prefix = optarg; break;
		case 'S': g.sync = 1; break;
		case 'c': g.commit_every = strtoull(optarg, NULL, 0); break;
		case 'V': g.check_stamps = 1; break;
		default: usage();
		}
	}
	if (g.qd < 1 || g.bs < 4096 || g.bs % 4096 || g.size < g.bs || g.size % g.bs)
		die("bad -q / -b / -s");

	g.nfs = nfs_init_context();
	if (!g.nfs)
		die("nfs_init_context");
	struct nfs_url *u = nfs_parse_url_dir(g.nfs, url);
	if (!u)
		die("bad url %s: %s", url, nfs_get_error(g.nfs));
	/* Every operation must reach the server: no page cache, no read-ahead,
	 * no directory cache answering lookups from an earlier listing. */
	nfs_set_pagecache(g.nfs, 0);
	nfs_set_readahead(g.nfs, 0);
	nfs_set_dircache(g.nfs, 0);
	if (nfs_mount(g.nfs, u->server, u->path) < 0)
		die("mount %s: %s", url, nfs_get_error(g.nfs));
	g.rpc = nfs_get_rpc_context(g.nfs);

	struct slot *slots = calloc(g.qd, sizeof(*slots));
	if (!slots)
		die("out of memory");
	for (int i = 0; i < g.qd; i++) {
		slots[i].id = i;
		if (g.mode <= VERIFY) {
			slots[i].buf = malloc(g.bs);
			if (!slots[i].buf)
				die("out of memory");
			for (uint64_t j = 0; j < g.bs; j += 8) {
				uint64_t v = rng();
				memcpy(slots[i].buf + j, &v, 8);
			}
		}
	}
	rng_state ^= (uint64_t)getpid() << 17;

	int flags = 0;
	switch (g.mode) {
	case SEQWRITE:
		flags = O_RDWR | O_CREAT | O_TRUNC;
		break;
	case RANDWRITE:
	case VERIFY:
		flags = O_RDWR;
		break;
	case SEQREAD:
	case RANDREAD:
		flags = O_RDONLY;
		break;
	default:
		break;
	}
	if (g.sync)
		flags |= O_SYNC;
	if (flags || g.mode == SEQREAD || g.mode == RANDREAD) {
		int rc = (flags & O_CREAT) ? nfs_open2(g.nfs, g.file, flags, 0644, &g.fh)
					   : nfs_open(g.nfs, g.file, flags, &g.fh);
		if (rc < 0)
			die("open %s: %s", g.file, nfs_get_error(g.nfs));
	}

	if (g.mode == VERIFY) {
		/* Untimed: 64 blocks spread over the file, written with the full
		 * pattern (UNSTABLE + COMMIT, or FILE_SYNC with -S), read back. */
		g.total = 64;
		if (g.size / g.total < g.bs)
			die("verify: file too small");
		for (uint64_t i = 0; i < g.total; i++) {
			uint64_t off = i * (g.size / g.total / g.bs) * g.bs;
			pattern(slots[0].buf, off, g.bs);
			if (nfs_pwrite(g.nfs, g.fh, off, g.bs, slots[0].buf) != (int)g.bs)
				die("verify write at %" PRIu64 ": %s", off, nfs_get_error(g.nfs));
		}
		if (!g.sync && nfs_fsync(g.nfs, g.fh) < 0)
			die("verify COMMIT: %s", nfs_get_error(g.nfs));
	}

	if (g.mode == LOOKUP || g.mode == GETATTR) {
		char server[256];
		const char *mp = strstr(url, "mountport=");
		if (!mp)
			die("lookup / getattr need mountport= in the URL");
		snprintf(server, sizeof(server), "%s", u->server);
		root_handle(server, u->path, atoi(mp + 10));
	}
	if (g.mode == GETATTR) {
		g.handles = calloc(g.files, sizeof(*g.handles));
		if (!g.handles)
			die("out of memory");
		g.phase_lookup_only = 1;
		g.total = g.files;
		g.next = 0;
		run_slots(slots);
		if (g.failed)
			die("failed");
		g.phase_lookup_only = 0;
		g.next = 0;
		g.done = 0;
		g.nlat = 0;
	}

	switch (g.mode) {
	case SEQWRITE:
	case SEQREAD:
		g.total = g.size / g.bs;
		break;
	case RANDWRITE:
	case RANDREAD:
		g.total = UINT64_MAX;
		break;
	case VERIFY:
		g.total = 64;
		break;
	default:
		g.total = g.files;
	}

	double start = now();
	g.deadline = start + g.seconds;
	if (g.mode == LIST) {
		g.inflight = 1;
		double t = now();
		if (nfs_opendir_async(g.nfs, "/", list_cb, NULL) < 0)
			die("opendir: %s", nfs_get_error(g.nfs));
		run_loop();
		record_latency(t);
		g.done = g.entries;
		if (!g.failed && g.entries < g.files)
			fail("listed %" PRIu64 " entries, expected at least %" PRIu64, g.entries, g.files);
	} else {
		run_slots(slots);
		if (g.mode == SEQWRITE || g.mode == RANDWRITE)
			final_commit();
	}
	double secs = now() - start;
	if (g.failed)
		die("%s failed after %" PRIu64 " operations", mode_names[g.mode], g.done);

	qsort(g.lat, g.nlat, sizeof(*g.lat), cmp_u32);
	printf("RESULT mode=%s qd=%d bs=%" PRIu64 " sync=%d ops=%" PRIu64 " seconds=%.3f ops_per_s=%.1f"
	       " mib_per_s=%.1f p50_us=%.0f p99_us=%.0f commits=%" PRIu64 " checked_blocks=%" PRIu64
	       " readmax=%" PRIu64 " writemax=%" PRIu64 "\n",
	       mode_names[g.mode], g.qd, g.bs, g.sync, g.done, secs, g.done / secs,
	       g.mode <= VERIFY ? g.done * (double)g.bs / secs / 1048576.0 : 0.0, percentile(0.50),
	       percentile(0.99), g.commits, g.checked_blocks, nfs_get_readmax(g.nfs), nfs_get_writemax(g.nfs));
	if (g.fh)
		nfs_close(g.nfs, g.fh);
	nfs_destroy_url(u);
	nfs_destroy_context(g.nfs);
	return 0;
}
