// fakenccl.c: a fake NCCL (libnccl.so.2) for the tests of backends/nccl. The communicators
// of all ranks live in this process and meet in a shared rendezvous keyed by the unique id.
// A collective is a task on the caller's stream (through the fake driver); when it runs it
// deposits its arguments in the slot of its sequence number, and the last rank to arrive
// performs the whole collective for everyone. Abort or destroy of any rank breaks the
// shared communicator: collectives that need it fail and report ncclRemoteError through
// ncclCommGetAsyncError. Knobs (fake_knob; unknown names go to the fake driver):
// nccl_version, nccl_init_fail (result code of the next ncclCommInitRank calls, 0 = off),
// nccl_async_error (set this result on every live communicator), nccl_gate_close and
// nccl_gate_open (while closed, collectives that start running on their streams wait
// before reading their buffers: a slow all-reduce), nccl_collectives (read: collectives
// performed).
//
// Blocking host calls, as the real library's where peers are late or dead:
// nccl_connect_block (1: a communicator's first collective blocks inside its enqueue call,
// ncclAllReduce and the rest, until every rank of the communicator has entered its first
// one: the lazy connection of NCCL_RUNTIME_CONNECT=1), nccl_finalize_hang (1:
// ncclCommFinalize, and ncclCommDestroy of a communicator not finalized, block as with a
// peer that never finalizes; 0 releases them). ncclCommAbort of the communicator, from
// another thread, unblocks either: the call returns ncclRemoteError. nccl_unblock fails
// every blocked call at once (for a test to unwind after a failure); nccl_finalizes
// (read: ncclCommFinalize calls); nccl_connecting (read: calls blocked connecting now).
// nccl_finalize_hang 2: as 1, but ncclCommAbort does not unblock them. nccl_abort_hang
// (1: ncclCommAbort blocks until 0, as in NVIDIA/nccl#829). nccl_enqueue_delay_us: host
// work of every collective's call before it queues (a slow call that does not wait for
// peers); nccl_in_call (read: threads inside a collective's call now). nccl_finalize_fail
// (result code that ncclCommFinalize returns at once, 0 = off); nccl_aborting (read:
// threads held inside ncclCommAbort by nccl_abort_hang now).
//
// A communicator that ncclCommAbort or ncclCommDestroy has begun to free is poisoned: any
// later call on it (a collective, ncclCommGetAsyncError, ncclCommFinalize, ncclCommDestroy,
// ncclCommAbort) fails, is printed, and is counted in nccl_use_after_free (read), which the
// tests check. A call already inside the library when the abort comes is not: the abort is
// what unblocks it; but ncclCommAbort while a collective's call runs on the communicator
// without waiting for peers (only one thread may operate a communicator at a time) is
// counted there too.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int fakecuda_enqueue(void *stream, void (*fn)(void *), void *arg);
long long fakecuda_knob(const char *name, long long value);

typedef int ncclResult_t;
enum { ncclSuccess, ncclUnhandledCudaError, ncclSystemError, ncclInternalError, ncclInvalidArgument, ncclInvalidUsage, ncclRemoteError, ncclInProgress };
typedef struct { char internal[128]; } ncclUniqueId;
enum { KIND_ALLREDUCE = 1, KIND_BROADCAST, KIND_ALLGATHER, KIND_REDUCESCATTER };

#define MAXRANKS 16
#define NSLOTS 4

typedef struct {
	int kind, dtype, op, root;
	size_t count;
	const void *send;
	void *recv;
} args;

typedef struct {
	int active, done, failed, arrived, left;
	unsigned long long seq;
	args a[MAXRANKS];
} slot;

typedef struct shared {
	ncclUniqueId id;
	int nranks, joined, broken, connecting;
	slot slots[NSLOTS];
	struct shared *next;
} shared;

typedef struct comm {
	shared *sh;
	int rank, aborted, destroyed, async_err, connected, finalized;
	int in_call, blocked; // threads inside a collective's enqueue; of them, waiting for peers
	unsigned long long seq;
	struct comm *next;
} comm;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static shared *shareds;
static comm *comms; // every communicator ever created (never freed: streams may still refer to them)
static int version = 22105;
static int init_fail, finalize_fail, gate_closed, connect_block, finalize_hang, abort_hang, enqueue_delay_us;
static long long in_calls, aborting;
static long long performed, finalizes, unblock_gen, connecting, use_after_free;

// gone reports (and counts, and prints) a call on a communicator that ncclCommAbort or
// ncclCommDestroy has freed, or is freeing: the real library would read freed memory.
// mu is held.
static int gone(comm *c, const char *fn) {
	if (!c->aborted && !c->destroyed) return 0;
	use_after_free++;
	fprintf(stderr, "fakenccl: %s on the %s communicator of rank %d\n", fn, c->destroyed ? "destroyed" : "aborted", c->rank);
	return 1;
}
static unsigned long long id_counter;

long long fake_knob(const char *name, long long value) {
	long long old = -1;
	if (strncmp(name, "nccl_", 5)) return fakecuda_knob(name, value);
	pthread_mutex_lock(&mu);
	if (!strcmp(name, "nccl_version")) {
		old = version;
		version = (int)value;
	} else if (!strcmp(name, "nccl_init_fail")) {
		old = init_fail;
		init_fail = (int)value;
	} else if (!strcmp(name, "nccl_finalize_fail")) {
		old = finalize_fail;
		finalize_fail = (int)value;
	} else if (!strcmp(name, "nccl_aborting")) {
		old = aborting;
	} else if (!strcmp(name, "nccl_gate_close")) {
		old = gate_closed;
		gate_closed = 1;
	} else if (!strcmp(name, "nccl_gate_open")) {
		old = gate_closed;
		gate_closed = 0;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "nccl_collectives")) {
		old = performed;
	} else if (!strcmp(name, "nccl_finalizes")) {
		old = finalizes;
	} else if (!strcmp(name, "nccl_connecting")) {
		old = connecting;
	} else if (!strcmp(name, "nccl_connect_block")) {
		old = connect_block;
		connect_block = (int)value;
	} else if (!strcmp(name, "nccl_finalize_hang")) {
		old = finalize_hang;
		finalize_hang = (int)value;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "nccl_use_after_free")) {
		old = use_after_free;
	} else if (!strcmp(name, "nccl_enqueue_delay_us")) {
		old = enqueue_delay_us;
		enqueue_delay_us = (int)value;
	} else if (!strcmp(name, "nccl_in_call")) {
		old = in_calls;
	} else if (!strcmp(name, "nccl_abort_hang")) {
		old = abort_hang;
		abort_hang = (int)value;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "nccl_unblock")) {
		old = ++unblock_gen;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "nccl_async_error")) {
		old = 0;
		for (comm *c = comms; c; c = c->next)
			if (!c->aborted && !c->destroyed) {
				c->async_err = (int)value;
				c->sh->broken = 1; // the collectives in flight cannot complete either
				old++;
			}
		pthread_cond_broadcast(&cv);
	}
	pthread_mutex_unlock(&mu);
	return old;
}

ncclResult_t ncclGetVersion(int *v) {
	pthread_mutex_lock(&mu);
	*v = version;
	pthread_mutex_unlock(&mu);
	return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
	memset(id, 0, sizeof *id);
	pthread_mutex_lock(&mu);
	unsigned long long n = ++id_counter;
	pthread_mutex_unlock(&mu);
	snprintf(id->internal, sizeof id->internal, "fake-nccl-%p-%llu", (void *)&mu, n);
	return ncclSuccess;
}

ncclResult_t ncclCommInitRank(comm **out, int nranks, ncclUniqueId id, int rank) {
	if (nranks < 1 || nranks > MAXRANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	if (init_fail) {
		int r = init_fail;
		pthread_mutex_unlock(&mu);
		return r;
	}
	shared *sh = shareds;
	while (sh && memcmp(&sh->id, &id, sizeof id)) sh = sh->next;
	if (!sh) {
		sh = calloc(1, sizeof *sh);
		sh->id = id;
		sh->nranks = nranks;
		sh->next = shareds;
		shareds = sh;
	}
	if (sh->nranks != nranks) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	sh->joined++;
	pthread_cond_broadcast(&cv);
	while (sh->joined < nranks && !sh->broken) pthread_cond_wait(&cv, &mu);
	comm *c = calloc(1, sizeof *c);
	c->sh = sh;
	c->rank = rank;
	c->next = comms;
	comms = c;
	pthread_mutex_unlock(&mu);
	*out = c;
	return ncclSuccess;
}

static void break_comm(comm *c) {
	pthread_mutex_lock(&mu);
	c->sh->broken = 1;
	pthread_cond_broadcast(&cv);
	pthread_mutex_unlock(&mu);
}

ncclResult_t ncclCommAbort(comm *c) {
	if (!c) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	if (gone(c, "ncclCommAbort")) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	if (c->in_call > c->blocked) { // NCCL: one thread at a time may operate a communicator
		use_after_free++;
		fprintf(stderr, "fakenccl: ncclCommAbort of rank %d while a collective runs on it, not waiting for peers\n", c->rank);
	}
	c->aborted = 1;
	c->sh->broken = 1;
	pthread_cond_broadcast(&cv);
	long long gen = unblock_gen;
	aborting++;
	while (abort_hang && gen == unblock_gen) pthread_cond_wait(&cv, &mu); // NVIDIA/nccl#829
	aborting--;
	pthread_mutex_unlock(&mu);
	return ncclSuccess;
}

// hang_finalize blocks while nccl_finalize_hang is set, until c is aborted or nccl_unblock;
// mu is held. It returns ncclRemoteError if the wait ended otherwise than by the knob.
static ncclResult_t hang_finalize(comm *c) {
	long long gen = unblock_gen;
	while (finalize_hang && (finalize_hang == 2 || !c->aborted) && gen == unblock_gen) pthread_cond_wait(&cv, &mu);
	return finalize_hang ? ncclRemoteError : ncclSuccess;
}

ncclResult_t ncclCommFinalize(comm *c) {
	if (!c) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	finalizes++;
	if (gone(c, "ncclCommFinalize") || c->finalized) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	ncclResult_t r = finalize_fail ? finalize_fail : hang_finalize(c);
	if (r == ncclSuccess) c->finalized = 1;
	pthread_mutex_unlock(&mu);
	return r;
}

ncclResult_t ncclCommDestroy(comm *c) {
	if (!c) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	if (gone(c, "ncclCommDestroy")) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	ncclResult_t r = c->finalized ? ncclSuccess : hang_finalize(c); // destroy finalizes first
	c->destroyed = 1;
	pthread_mutex_unlock(&mu);
	break_comm(c);
	return r;
}

ncclResult_t ncclCommGetAsyncError(comm *c, ncclResult_t *r) {
	pthread_mutex_lock(&mu);
	if (gone(c, "ncclCommGetAsyncError")) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	*r = c->async_err;
	pthread_mutex_unlock(&mu);
	return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r) {
	switch (r) {
	case ncclSuccess: return "no error";
	case ncclUnhandledCudaError: return "unhandled cuda error";
	case ncclSystemError: return "unhandled system error";
	case ncclInternalError: return "internal error";
	case ncclInvalidArgument: return "invalid argument";
	case ncclInvalidUsage: return "invalid usage";
	case ncclRemoteError: return "remote process exited or there was a network error";
	case ncclInProgress: return "NCCL operation in progress";
	}
	return "unknown result code";
}

const char *ncclGetLastError(comm *c) {
	(void)c;
	return "fake NCCL";
}

// ---- arithmetic ----

static size_t esize(int dt) {
	switch (dt) {
	case 2: return 4;
	case 4: return 8;
	case 6: return 2;
	case 7: return 4;
	case 8: return 8;
	case 9: return 2;
	}
	return 0;
}

static float bf16_to_f(uint16_t h) {
	uint32_t b = (uint32_t)h << 16;
	float f;
	memcpy(&f, &b, 4);
	return f;
}
static uint16_t f_to_bf16(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	if ((b & 0x7fffffff) > 0x7f800000) return (uint16_t)((b >> 16) | 0x40);
	b += 0x7fff + ((b >> 16) & 1);
	return (uint16_t)(b >> 16);
}
static float f16_to_f(uint16_t h) {
	int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
	float v;
	if (e == 0) v = ldexpf((float)m, -24);
	else if (e == 31) v = m ? NAN : INFINITY;
	else v = ldexpf((float)(m | 0x400), e - 25);
	return s ? -v : v;
}
static uint16_t f_to_f16(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	uint16_t sign = (b >> 16) & 0x8000;
	int exp = (b >> 23) & 0xff;
	uint32_t man = b & 0x7fffff;
	if (exp == 0xff) return sign | (man ? 0x7e00 : 0x7c00);
	if (exp == 0 && man == 0) return sign;
	int e = exp - 127 + 15;
	if (e >= 0x1f) return sign | 0x7c00;
	if (e <= 0) {
		if (e < -10) return sign;
		man |= 0x800000;
		int shift = 14 - e;
		uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1), h = man >> shift;
		if (rest > half || (rest == half && (h & 1))) h++;
		return sign | (uint16_t)h;
	}
	uint32_t h = ((uint32_t)e << 10) | (man >> 13), rest = man & 0x1fff;
	if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
	return sign | (uint16_t)h;
}

static double getf(const void *p, int dt, size_t i) {
	switch (dt) {
	case 6: return f16_to_f(((const uint16_t *)p)[i]);
	case 7: return ((const float *)p)[i];
	case 8: return ((const double *)p)[i];
	case 9: return bf16_to_f(((const uint16_t *)p)[i]);
	}
	return 0;
}
static void setf(void *p, int dt, size_t i, double v) {
	switch (dt) {
	case 6: ((uint16_t *)p)[i] = f_to_f16((float)v); break;
	case 7: ((float *)p)[i] = (float)v; break;
	case 8: ((double *)p)[i] = v; break;
	case 9: ((uint16_t *)p)[i] = f_to_bf16((float)v); break;
	}
}

// reduce reduces n elements of every rank's send (at element offset 0) into out.
static void reduce(slot *s, int nranks, size_t n, void *out) {
	int dt = s->a[0].dtype, op = s->a[0].op;
	for (size_t i = 0; i < n; i++) {
		if (dt == 2 || dt == 4) {
			long long acc = 0;
			for (int r = 0; r < nranks; r++) {
				long long v = dt == 2 ? ((const int32_t *)s->a[r].send)[i] : ((const int64_t *)s->a[r].send)[i];
				if (r == 0) acc = v;
				else if (op == 0 || op == 4) acc = (long long)((unsigned long long)acc + (unsigned long long)v);
				else if (op == 1) acc = (long long)((unsigned long long)acc * (unsigned long long)v);
				else if (op == 2) acc = v > acc ? v : acc;
				else acc = v < acc ? v : acc;
			}
			if (dt == 2) {
				int32_t a32 = (int32_t)acc; // 32-bit wrap-around, as on the device
				if (op == 4) a32 /= nranks;
				((int32_t *)out)[i] = a32;
			} else {
				if (op == 4) acc /= nranks; // truncating, like NCCL's SumPostDiv
				((int64_t *)out)[i] = acc;
			}
			continue;
		}
		double acc = 0;
		for (int r = 0; r < nranks; r++) {
			double v = getf(s->a[r].send, dt, i);
			if (r == 0) acc = v;
			else if (op == 0 || op == 4) acc += v;
			else if (op == 1) acc *= v;
			else if (op == 2) acc = v > acc ? v : acc;
			else acc = v < acc ? v : acc;
		}
		if (op == 4) acc /= nranks;
		setf(out, dt, i, acc);
	}
}

// consistent reports whether every rank called the same collective.
static int consistent(slot *s, int nranks) {
	for (int r = 1; r < nranks; r++) {
		args *a = &s->a[r], *b = &s->a[0];
		if (a->kind != b->kind || a->dtype != b->dtype || a->count != b->count || a->op != b->op || a->root != b->root) return 0;
	}
	return 1;
}

static void perform(slot *s, int nranks) {
	args *a0 = &s->a[0];
	size_t es = esize(a0->dtype), n = a0->count;
	void *tmp;
	switch (a0->kind) {
	case KIND_ALLREDUCE:
		tmp = malloc(n * es + 1);
		reduce(s, nranks, n, tmp);
		for (int r = 0; r < nranks; r++) memcpy(s->a[r].recv, tmp, n * es);
		break;
	case KIND_BROADCAST:
		tmp = malloc(n * es + 1);
		memcpy(tmp, s->a[a0->root].send, n * es);
		for (int r = 0; r < nranks; r++) memcpy(s->a[r].recv, tmp, n * es);
		break;
	case KIND_ALLGATHER:
		tmp = malloc(nranks * n * es + 1);
		for (int r = 0; r < nranks; r++) memcpy((char *)tmp + r * n * es, s->a[r].send, n * es);
		for (int r = 0; r < nranks; r++) memcpy(s->a[r].recv, tmp, nranks * n * es);
		break;
	default: // KIND_REDUCESCATTER
		tmp = malloc(nranks * n * es + 1);
		reduce(s, nranks, nranks * n, tmp);
		for (int r = 0; r < nranks; r++) memcpy(s->a[r].recv, (char *)tmp + r * n * es, n * es);
		break;
	}
	free(tmp);
}

typedef struct {
	comm *c;
	unsigned long long seq;
	args a;
} job;

// run is a collective's task on its stream.
static void run(void *p) {
	job *j = p;
	comm *c = j->c;
	shared *sh = c->sh;
	int n = sh->nranks, ok = 0;
	pthread_mutex_lock(&mu);
	while (gate_closed && !sh->broken && !c->aborted) pthread_cond_wait(&cv, &mu);
	slot *s = &sh->slots[j->seq % NSLOTS];
	for (;;) {
		if (sh->broken || c->aborted) goto out;
		if (!s->active) {
			memset(s, 0, sizeof *s);
			s->active = 1;
			s->seq = j->seq;
		}
		if (s->seq == j->seq) break;
		pthread_cond_wait(&cv, &mu);
	}
	s->a[c->rank] = j->a;
	if (++s->arrived == n) {
		if (consistent(s, n)) {
			perform(s, n);
			performed++;
			s->done = 1;
		} else {
			s->failed = 1;
		}
		pthread_cond_broadcast(&cv);
	}
	while (!s->done && !s->failed && !sh->broken && !c->aborted) pthread_cond_wait(&cv, &mu);
	ok = s->done;
	if (s->failed && !c->async_err) c->async_err = ncclInvalidUsage;
	if (++s->left == n) {
		s->active = 0;
		pthread_cond_broadcast(&cv);
	}
out:
	if (!ok && !c->aborted && !c->async_err) c->async_err = ncclRemoteError;
	pthread_mutex_unlock(&mu);
	free(j);
}

static ncclResult_t enqueue_in(comm *c, int kind, const void *send, void *recv, size_t count, int dtype, int op, int root, void *stream);

// enqueue is a collective's host call: it takes nccl_enqueue_delay_us of host work (not
// waiting for peers) before it queues the collective.
static ncclResult_t enqueue(comm *c, int kind, const void *send, void *recv, size_t count, int dtype, int op, int root, void *stream) {
	if (!c) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	c->in_call++;
	in_calls++;
	int delay = enqueue_delay_us;
	pthread_mutex_unlock(&mu);
	if (delay) {
		struct timespec ts = {delay / 1000000, (long)(delay % 1000000) * 1000};
		nanosleep(&ts, NULL);
	}
	ncclResult_t r = enqueue_in(c, kind, send, recv, count, dtype, op, root, stream);
	pthread_mutex_lock(&mu);
	c->in_call--;
	in_calls--;
	pthread_mutex_unlock(&mu);
	return r;
}

static ncclResult_t enqueue_in(comm *c, int kind, const void *send, void *recv, size_t count, int dtype, int op, int root, void *stream) {
	if (!esize(dtype) || op < 0 || op > 4) return ncclInvalidArgument;
	if (count > 0 && (!send || !recv)) return ncclInvalidArgument;
	pthread_mutex_lock(&mu);
	if (gone(c, "a collective")) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidUsage;
	}
	if (op == 4 && version < 21000) {
		pthread_mutex_unlock(&mu);
		return ncclInvalidArgument;
	}
	if (connect_block && !c->connected) {
		// The first collective connects to the peers, inside this call.
		shared *sh = c->sh;
		long long gen = unblock_gen;
		sh->connecting++;
		connecting++;
		c->blocked++;
		pthread_cond_broadcast(&cv);
		while (sh->connecting < sh->nranks && !sh->broken && !c->aborted && gen == unblock_gen) pthread_cond_wait(&cv, &mu);
		c->blocked--;
		connecting--;
		if (sh->connecting < sh->nranks) {
			if (!c->async_err) c->async_err = ncclRemoteError;
			pthread_mutex_unlock(&mu);
			return ncclRemoteError;
		}
	}
	c->connected = 1;
	job *j = calloc(1, sizeof *j);
	j->c = c;
	j->seq = c->seq++;
	j->a = (args){kind, dtype, op, root, count, send, recv};
	pthread_mutex_unlock(&mu);
	if (fakecuda_enqueue(stream, run, j)) { // no current context, or a stream of another
		free(j);
		return ncclUnhandledCudaError;
	}
	return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int dt, int op, comm *c, void *st) {
	return enqueue(c, KIND_ALLREDUCE, s, r, n, dt, op, 0, st);
}
ncclResult_t ncclBroadcast(const void *s, void *r, size_t n, int dt, int root, comm *c, void *st) {
	if (c && (root < 0 || root >= c->sh->nranks)) return ncclInvalidArgument;
	return enqueue(c, KIND_BROADCAST, s, r, n, dt, 0, root, st);
}
ncclResult_t ncclAllGather(const void *s, void *r, size_t n, int dt, comm *c, void *st) {
	return enqueue(c, KIND_ALLGATHER, s, r, n, dt, 0, 0, st);
}
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, int dt, int op, comm *c, void *st) {
	return enqueue(c, KIND_REDUCESCATTER, s, r, n, dt, op, 0, st);
}
