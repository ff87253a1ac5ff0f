// fakecuda.c: a fake CUDA driver (libcuda.so.1) for the tests of backends/nccl. "Device
// memory" is malloc'd host memory; each stream is an in-order queue run by its own thread;
// events complete when the stream reaches them. One mutex and condition variable guard all
// of it.
//
// Contexts behave as the driver's do where the backend's bugs would hide: the current
// context is per thread (cuCtxGetCurrent, cuCtxSetCurrent); each device has a primary
// context (cuDevicePrimaryCtxRetain) and cuCtxCreate makes others; streams, events,
// modules and allocations belong to the context current when they were made. An operation
// without a current context fails with CUDA_ERROR_INVALID_CONTEXT; one on a stream of
// another context than the current one (or an event recorded on a stream of another
// context) fails with CUDA_ERROR_INVALID_HANDLE. cuStreamWaitEvent accepts an event of
// any context, as the driver does. cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_CONTEXT) and
// cuStreamGetCtx tell whose memory and streams they are.
//
// The legacy default stream (0 or CU_STREAM_LEGACY) is one per context and synchronises as
// the real one does: work queued on it waits for the work already queued on the context's
// blocking streams (created without CU_STREAM_NON_BLOCKING), and work queued on a blocking
// stream waits for the work already queued on the legacy stream. CU_STREAM_PER_THREAD is
// not modelled: it fails with CUDA_ERROR_INVALID_HANDLE.
//
// Knobs (fakecuda_knob): device_count, gate_close (value: a stream; queues a task that
// blocks until gate_open), gate_open, tasks_run (read), syncs (read: the number of
// cuStreamSynchronize and cuEventSynchronize calls so far), kernels (read: kernels run);
// for the context tests, on the calling thread: ctx_create (value: a device; returns a new
// non-primary context), ctx_primary (value: a device; returns its primary context),
// ctx_set (value: a context or 0), ctx_get (returns the current context), mem_alloc
// (value: bytes; allocates in the current context, returns the address), stream_create
// (value: cuStreamCreate's flags; a stream of the current context), event_query (value:
// an event; its cuEventQuery result), ptr_ctx (value: an address; the context of its
// allocation, -1 if none), stream_live (value: a stream; 1 if not destroyed), h2d_hold
// (1: cuMemcpyHtoDAsync blocks its caller, on the host, until h2d_hold 0), h2d_held (read:
// callers blocked so), stream_get_ctx and stream_get_ctx_v2 (read: calls of
// cuStreamGetCtx and of cuStreamGetCtx_v2, which has the real one's three arguments),
// blas_handles (read: the fake cuBLAS's handles created and not destroyed).
// Kernels: cuModuleLoadData accepts any image; cuModuleGetFunction knows the kernels of
// backends/nccl/kernels and examples/gpumlp by name and runs a C version of each, on the
// host, in stream order (see the table at the end).
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
enum {
	OK = 0,
	ERR_INVALID_VALUE = 1,
	ERR_OUT_OF_MEMORY = 2,
	ERR_INVALID_CONTEXT = 201,
	ERR_INVALID_HANDLE = 400,
	ERR_NOT_READY = 600,
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int device_count = 8;
static int gate_closed;
static long long tasks_run, syncs, kernels_run;
static long long stream_get_ctx_calls, stream_get_ctx_v2_calls;
static int h2d_hold, h2d_held;
static long long blas_handles; // live handles of the fake cuBLAS

typedef struct task {
	void (*fn)(void *);
	void *arg;
	struct task *next;
} task;

struct stream;

typedef struct context {
	int device, primary, live;
	struct stream *legacy; // created on first use
	struct context *next;  // list of created (non-primary) contexts
} context;

#define MAXDEV 64
static context primaries[MAXDEV];
static context *created;
static __thread context *current; // the calling thread's current context

typedef struct stream {
	task *head, *tail;
	int busy, stop;
	unsigned long long queued, ran; // tasks queued and run so far
	context *ctx;
	int blocking, legacy;
	pthread_t th;
	struct stream *next; // list of live streams
} stream;

static stream *streams;

typedef struct event {
	unsigned long long recorded, completed;
	double when; // ms since the first event completed: CLOCK_MONOTONIC at the last completion
	context *ctx;
} event;

// Allocations (device and pinned host), for cuPointerGetAttribute.
typedef struct alloc {
	uintptr_t base;
	size_t size;
	context *ctx;
	struct alloc *next;
} alloc;
static alloc *allocs;

static void *worker(void *p) {
	stream *s = p;
	pthread_mutex_lock(&mu);
	for (;;) {
		while (!s->head && !s->stop) pthread_cond_wait(&cv, &mu);
		if (!s->head) break;
		task *t = s->head;
		s->head = t->next;
		if (!s->head) s->tail = NULL;
		s->busy = 1;
		pthread_mutex_unlock(&mu);
		t->fn(t->arg);
		free(t);
		pthread_mutex_lock(&mu);
		s->busy = 0;
		s->ran++;
		tasks_run++;
		pthread_cond_broadcast(&cv);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

// new_stream makes a stream of ctx; mu is held.
static stream *new_stream(context *ctx, int blocking, int legacy) {
	stream *s = calloc(1, sizeof *s);
	s->ctx = ctx;
	s->blocking = blocking;
	s->legacy = legacy;
	s->next = streams;
	streams = s;
	pthread_create(&s->th, NULL, worker, s);
	return s;
}

static int valid_ctx(context *c) {
	if (c >= primaries && c < primaries + MAXDEV) return c->live;
	for (context *x = created; x; x = x->next)
		if (x == c) return x->live;
	return 0;
}

static int live_stream(stream *s) {
	for (stream *x = streams; x; x = x->next)
		if (x == s) return 1;
	return 0;
}

// resolve is the stream of handle h for an operation of the calling thread, whose context
// must be current (the stream's own, for an explicit stream); mu is held.
static stream *resolve(void *h, CUresult *r) {
	if (!current) {
		*r = ERR_INVALID_CONTEXT;
		return NULL;
	}
	if (!h || h == (void *)1) { // the legacy default stream of the current context
		if (!current->legacy) current->legacy = new_stream(current, 1, 1);
		return current->legacy;
	}
	stream *s = h;
	if (h == (void *)2 || !live_stream(s) || s->ctx != current) {
		*r = ERR_INVALID_HANDLE;
		return NULL;
	}
	return s;
}

static void push(stream *s, void (*fn)(void *), void *arg) {
	task *t = calloc(1, sizeof *t);
	t->fn = fn;
	t->arg = arg;
	if (s->tail) s->tail->next = t;
	else s->head = t;
	s->tail = t;
	s->queued++;
}

typedef struct {
	stream *s;
	unsigned long long n;
} reach;

// reach_fn waits until stream r->s has run r->n tasks (streams are never freed, so a
// destroyed one still answers: its worker ran everything queued before it exited).
static void reach_fn(void *p) {
	reach *r = p;
	pthread_mutex_lock(&mu);
	while (r->s->ran < r->n) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	free(r);
}

static void push_reach(stream *s, stream *on) {
	if (on->ran >= on->queued) return;
	reach *r = malloc(sizeof *r);
	r->s = on;
	r->n = on->queued;
	push(s, reach_fn, r);
}

// enqueue_locked queues fn(arg) on s after the implicit synchronisation of the legacy
// stream; mu is held.
static void enqueue_locked(stream *s, void (*fn)(void *), void *arg) {
	if (s->legacy) {
		for (stream *b = streams; b; b = b->next)
			if (b != s && b->ctx == s->ctx && b->blocking) push_reach(s, b);
	} else if (s->blocking && s->ctx->legacy) {
		push_reach(s, s->ctx->legacy);
	}
	push(s, fn, arg);
	pthread_cond_broadcast(&cv);
}

// fakecuda_enqueue queues fn(arg) on a stream of the current context (for the fake NCCL
// and cuBLAS); it returns the CUresult.
int fakecuda_enqueue(void *h, void (*fn)(void *), void *arg) {
	CUresult r = OK;
	pthread_mutex_lock(&mu);
	stream *s = resolve(h, &r);
	if (s) enqueue_locked(s, fn, arg);
	pthread_mutex_unlock(&mu);
	return r;
}

// fakecuda_ctx_sync waits until every live stream of the current context has run what was
// queued on it, as cudaDeviceSynchronize does for the device's primary context (the fake
// cuBLAS's cublasDestroy_v2 calls it, as the real one does); it returns the CUresult.
int fakecuda_ctx_sync(void) {
	if (!current) return ERR_INVALID_CONTEXT;
	pthread_mutex_lock(&mu);
	for (;;) {
		int busy = 0;
		for (stream *s = streams; s; s = s->next)
			if (s->ctx == current && (s->head || s->busy)) busy = 1;
		if (!busy) break;
		pthread_cond_wait(&cv, &mu);
	}
	pthread_mutex_unlock(&mu);
	return OK;
}

// fakecuda_blas_handles adds delta to the count of live cuBLAS handles (the fake cuBLAS
// keeps it here, with the rest of the fakes' state: knob blas_handles).
void fakecuda_blas_handles(int delta) {
	pthread_mutex_lock(&mu);
	blas_handles += delta;
	pthread_mutex_unlock(&mu);
}

static void gate_fn(void *arg) {
	(void)arg;
	pthread_mutex_lock(&mu);
	while (gate_closed) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
}

static void track(void *p, size_t n) {
	alloc *a = calloc(1, sizeof *a);
	a->base = (uintptr_t)p;
	a->size = n;
	a->ctx = current;
	a->next = allocs;
	allocs = a;
}

static void untrack(void *p) {
	for (alloc **a = &allocs; *a; a = &(*a)->next)
		if ((*a)->base == (uintptr_t)p) {
			alloc *x = *a;
			*a = x->next;
			free(x);
			return;
		}
}

CUresult cuCtxCreate_v2(void **c, unsigned int flags, int dev);
CUresult cuStreamCreate(void **s, unsigned int flags);
CUresult cuEventQuery(void *p);
CUresult cuPointerGetAttribute(void *data, int attr, unsigned long long p);

long long fakecuda_knob(const char *name, long long value) {
	long long old = -1;
	if (!strcmp(name, "ctx_create")) {
		void *c = NULL;
		return cuCtxCreate_v2(&c, 0, (int)value) ? -1 : (long long)(uintptr_t)c;
	} else if (!strcmp(name, "ctx_primary")) {
		if (value < 0 || value >= MAXDEV) return -1;
		return (long long)(uintptr_t)&primaries[value];
	} else if (!strcmp(name, "ctx_set")) {
		old = (long long)(uintptr_t)current;
		current = (context *)(uintptr_t)value;
		return old;
	} else if (!strcmp(name, "ctx_get")) {
		return (long long)(uintptr_t)current;
	} else if (!strcmp(name, "stream_create")) {
		void *s = NULL;
		return cuStreamCreate(&s, (unsigned int)value) ? -1 : (long long)(uintptr_t)s;
	} else if (!strcmp(name, "ptr_ctx")) {
		void *c = NULL;
		return cuPointerGetAttribute(&c, 1, (unsigned long long)value) ? -1 : (long long)(uintptr_t)c;
	} else if (!strcmp(name, "event_query")) {
		return cuEventQuery((void *)(uintptr_t)value);
	}
	pthread_mutex_lock(&mu);
	if (!strcmp(name, "device_count")) {
		old = device_count;
		device_count = (int)value;
	} else if (!strcmp(name, "gate_close")) {
		old = gate_closed;
		gate_closed = 1;
		stream *s = (stream *)(uintptr_t)value;
		if (!s || s == (stream *)1) s = current ? current->legacy : NULL;
		if (s && live_stream(s)) enqueue_locked(s, gate_fn, NULL);
		else old = -1;
	} else if (!strcmp(name, "gate_open")) {
		old = gate_closed;
		gate_closed = 0;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "tasks_run")) {
		old = tasks_run;
	} else if (!strcmp(name, "syncs")) {
		old = syncs;
	} else if (!strcmp(name, "kernels")) {
		old = kernels_run;
	} else if (!strcmp(name, "stream_get_ctx")) {
		old = stream_get_ctx_calls;
	} else if (!strcmp(name, "stream_get_ctx_v2")) {
		old = stream_get_ctx_v2_calls;
	} else if (!strcmp(name, "stream_live")) {
		old = live_stream((stream *)(uintptr_t)value) ? 1 : 0;
	} else if (!strcmp(name, "h2d_hold")) {
		old = h2d_hold;
		h2d_hold = (int)value;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "h2d_held")) {
		old = h2d_held;
	} else if (!strcmp(name, "blas_handles")) {
		old = blas_handles;
	} else if (!strcmp(name, "mem_alloc")) {
		if (current) {
			void *m = malloc(value ? (size_t)value : 1);
			track(m, (size_t)value);
			old = (long long)(uintptr_t)m;
		}
	}
	pthread_mutex_unlock(&mu);
	return old;
}

CUresult cuInit(unsigned int flags) { return flags ? ERR_INVALID_VALUE : OK; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) {
	pthread_mutex_lock(&mu);
	*n = device_count;
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuDeviceGet(int *d, int ordinal) {
	if (ordinal < 0 || ordinal >= device_count) return 101; // CUDA_ERROR_INVALID_DEVICE
	*d = ordinal;
	return OK;
}
CUresult cuDeviceGetName(char *name, int len, int d) {
	if (len > 0) {
		strncpy(name, "Fake GPU", len);
		name[len - 1] = 0;
	}
	(void)d;
	return OK;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) {
	if (d < 0 || d >= MAXDEV || d >= device_count) return 101;
	pthread_mutex_lock(&mu);
	primaries[d].device = d;
	primaries[d].primary = 1;
	primaries[d].live = 1;
	pthread_mutex_unlock(&mu);
	*ctx = &primaries[d];
	return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; } // stays live: other ranks may share it
CUresult cuCtxCreate_v2(void **c, unsigned int flags, int dev) {
	(void)flags;
	if (dev < 0 || dev >= device_count) return 101;
	context *x = calloc(1, sizeof *x);
	x->device = dev;
	x->live = 1;
	pthread_mutex_lock(&mu);
	x->next = created;
	created = x;
	pthread_mutex_unlock(&mu);
	current = x; // cuCtxCreate makes the new context current
	*c = x;
	return OK;
}
CUresult cuCtxDestroy_v2(void *c) {
	pthread_mutex_lock(&mu);
	int ok = valid_ctx(c) && !((context *)c)->primary;
	if (ok) ((context *)c)->live = 0;
	pthread_mutex_unlock(&mu);
	if (!ok) return ERR_INVALID_CONTEXT;
	if (current == c) current = NULL;
	return OK;
}
CUresult cuCtxSetCurrent(void *c) {
	if (c) {
		pthread_mutex_lock(&mu);
		int ok = valid_ctx(c);
		pthread_mutex_unlock(&mu);
		if (!ok) return ERR_INVALID_CONTEXT;
	}
	current = c;
	return OK;
}
CUresult cuCtxGetCurrent(void **c) {
	*c = current;
	return OK;
}
static CUresult stream_get_ctx(void *h, void **c) {
	CUresult r = OK;
	if (!h || h == (void *)1) {
		if (current) *c = current;
		else r = ERR_INVALID_CONTEXT;
	} else if (h == (void *)2 || !live_stream(h)) {
		r = ERR_INVALID_HANDLE;
	} else {
		*c = ((stream *)h)->ctx;
	}
	return r;
}
CUresult cuStreamGetCtx(void *h, void **c) {
	pthread_mutex_lock(&mu);
	stream_get_ctx_calls++;
	CUresult r = stream_get_ctx(h, c);
	pthread_mutex_unlock(&mu);
	return r;
}
// cuStreamGetCtx_v2 (CUDA 12.5) is another API than cuStreamGetCtx, as in the real
// driver: it also returns the stream's green context (none here) through its third
// argument, which it writes.
CUresult cuStreamGetCtx_v2(void *h, void **c, void **green) {
	pthread_mutex_lock(&mu);
	stream_get_ctx_v2_calls++;
	CUresult r = stream_get_ctx(h, c);
	pthread_mutex_unlock(&mu);
	if (!r) *green = NULL;
	return r;
}
CUresult cuPointerGetAttribute(void *data, int attr, unsigned long long p) {
	if (attr != 1) return ERR_INVALID_VALUE; // only CU_POINTER_ATTRIBUTE_CONTEXT
	CUresult r = ERR_INVALID_VALUE;          // not memory of the driver
	pthread_mutex_lock(&mu);
	for (alloc *a = allocs; a; a = a->next)
		if (p >= a->base && p < a->base + (a->size ? a->size : 1)) {
			*(void **)data = a->ctx;
			r = OK;
			break;
		}
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult cuStreamCreate(void **s, unsigned int flags) {
	if (!current) return ERR_INVALID_CONTEXT;
	pthread_mutex_lock(&mu);
	*s = new_stream(current, !(flags & 1), 0);
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuStreamSynchronize(void *h) {
	pthread_mutex_lock(&mu);
	syncs++;
	stream *s = h;
	if (!h || h == (void *)1) {
		CUresult r = OK;
		s = resolve(h, &r);
		if (!s) {
			pthread_mutex_unlock(&mu);
			return r;
		}
	} else if (h == (void *)2 || !live_stream(s)) {
		pthread_mutex_unlock(&mu);
		return ERR_INVALID_HANDLE;
	}
	while (s->head || s->busy) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuStreamDestroy_v2(void *h) {
	pthread_mutex_lock(&mu);
	stream *s = h;
	if (!h || h == (void *)1 || h == (void *)2 || !live_stream(s)) {
		pthread_mutex_unlock(&mu);
		return ERR_INVALID_HANDLE;
	}
	for (stream **x = &streams; *x; x = &(*x)->next)
		if (*x == s) {
			*x = s->next;
			break;
		}
	s->stop = 1; // the worker runs what is queued, then exits
	pthread_cond_broadcast(&cv);
	pthread_mutex_unlock(&mu);
	pthread_join(s->th, NULL);
	return OK; // not freed: a legacy stream's reach_fn may still read it
}

CUresult cuEventCreate(void **e, unsigned int flags) {
	(void)flags;
	if (!current) return ERR_INVALID_CONTEXT;
	event *ev = calloc(1, sizeof(event));
	ev->ctx = current;
	*e = ev;
	return OK;
}
CUresult cuEventDestroy_v2(void *e) { free(e); return OK; }

typedef struct {
	event *e;
	unsigned long long gen;
} evarg;

static double now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}
static void record_fn(void *p) {
	evarg *a = p;
	double t = now_ms();
	pthread_mutex_lock(&mu);
	a->e->when = t;
	if (a->gen > a->e->completed) a->e->completed = a->gen;
	pthread_cond_broadcast(&cv);
	pthread_mutex_unlock(&mu);
	free(a);
}
static void wait_fn(void *p) {
	evarg *a = p;
	pthread_mutex_lock(&mu);
	while (a->e->completed < a->gen) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	free(a);
}
CUresult cuEventRecord(void *e, void *h) {
	CUresult r = OK;
	pthread_mutex_lock(&mu);
	stream *s = resolve(h, &r);
	if (s && ((event *)e)->ctx != s->ctx) r = ERR_INVALID_HANDLE; // event and stream of one context
	if (r == OK) {
		evarg *a = malloc(sizeof *a);
		a->e = e;
		a->gen = ++a->e->recorded;
		enqueue_locked(s, record_fn, a);
	}
	pthread_mutex_unlock(&mu);
	return r;
}
CUresult cuStreamWaitEvent(void *h, void *e, unsigned int flags) {
	(void)flags;
	CUresult r = OK;
	pthread_mutex_lock(&mu);
	stream *s = resolve(h, &r); // the event may be of any context
	if (s) {
		evarg *a = malloc(sizeof *a);
		a->e = e;
		a->gen = a->e->recorded; // the last record at the time of the call
		enqueue_locked(s, wait_fn, a);
	}
	pthread_mutex_unlock(&mu);
	return r;
}
CUresult cuEventQuery(void *p) {
	event *e = p;
	pthread_mutex_lock(&mu);
	int done = e->completed >= e->recorded;
	pthread_mutex_unlock(&mu);
	return done ? OK : ERR_NOT_READY;
}
CUresult cuEventSynchronize(void *p) {
	event *e = p;
	pthread_mutex_lock(&mu);
	syncs++;
	while (e->completed < e->recorded) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	return OK;
}

CUresult cuMemAlloc_v2(unsigned long long *p, size_t n) {
	if (!current) return ERR_INVALID_CONTEXT;
	void *m = malloc(n ? n : 1);
	if (!m) return ERR_OUT_OF_MEMORY;
	pthread_mutex_lock(&mu);
	track(m, n);
	pthread_mutex_unlock(&mu);
	*p = (unsigned long long)(uintptr_t)m;
	return OK;
}
CUresult cuMemFree_v2(unsigned long long p) {
	pthread_mutex_lock(&mu);
	untrack((void *)(uintptr_t)p);
	pthread_mutex_unlock(&mu);
	free((void *)(uintptr_t)p);
	return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
	(void)flags;
	if (!current) return ERR_INVALID_CONTEXT;
	*p = malloc(n ? n : 1);
	if (!*p) return ERR_OUT_OF_MEMORY;
	pthread_mutex_lock(&mu);
	track(*p, n);
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuMemFreeHost(void *p) { return cuMemFree_v2((unsigned long long)(uintptr_t)p); }

typedef struct {
	void *dst;
	const void *src;
	size_t n;
	unsigned int v;
} cparg;
static void copy_fn(void *p) {
	cparg *a = p;
	memcpy(a->dst, a->src, a->n);
	free(a);
}
static void set32_fn(void *p) {
	cparg *a = p;
	for (size_t i = 0; i < a->n; i++) ((unsigned int *)a->dst)[i] = a->v;
	free(a);
}
static CUresult copy_async(void *dst, const void *src, size_t n, void *h) {
	cparg *a = malloc(sizeof *a);
	a->dst = dst;
	a->src = src;
	a->n = n;
	CUresult r = fakecuda_enqueue(h, copy_fn, a);
	if (r) free(a);
	return r;
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long d, const void *s, size_t n, void *h) {
	pthread_mutex_lock(&mu);
	if (h2d_hold) { // a slow host call (a descheduled thread, a driver lock)
		h2d_held++;
		pthread_cond_broadcast(&cv);
		while (h2d_hold) pthread_cond_wait(&cv, &mu);
		h2d_held--;
	}
	pthread_mutex_unlock(&mu);
	return copy_async((void *)(uintptr_t)d, s, n, h);
}
CUresult cuMemcpyDtoHAsync_v2(void *d, unsigned long long s, size_t n, void *h) { return copy_async(d, (void *)(uintptr_t)s, n, h); }
CUresult cuMemsetD32Async(unsigned long long d, unsigned int v, size_t n, void *h) {
	cparg *a = malloc(sizeof *a);
	a->dst = (void *)(uintptr_t)d;
	a->n = n;
	a->v = v;
	CUresult r = fakecuda_enqueue(h, set32_fn, a);
	if (r) free(a);
	return r;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "no error"; break;
	case ERR_NOT_READY: *s = "device not ready"; break;
	case ERR_INVALID_HANDLE: *s = "invalid resource handle"; break;
	case ERR_INVALID_CONTEXT: *s = "invalid device context"; break;
	default: *s = "fake CUDA error"; break;
	}
	return OK;
}

CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
	event *x = a, *y = b;
	pthread_mutex_lock(&mu);
	int done = x->completed >= x->recorded && y->completed >= y->recorded && x->recorded && y->recorded;
	*ms = (float)(y->when - x->when);
	pthread_mutex_unlock(&mu);
	return done ? OK : ERR_NOT_READY;
}

CUresult cuMemcpyDtoDAsync_v2(unsigned long long d, unsigned long long s, size_t n, void *h) {
	return copy_async((void *)(uintptr_t)d, (const void *)(uintptr_t)s, n, h);
}

// ---- kernels ----

#define MAXARGS 8
typedef struct kernel {
	const char *name;
	int nargs;
	int size[MAXARGS]; // bytes of each argument
	void (*fn)(unsigned char args[][8], unsigned long long threads);
} kernel;

#define ARG(T, i) (*(T *)args[i])
#define PTR(T, i) ((T *)(uintptr_t)ARG(unsigned long long, i))

static void k_scale_f32(unsigned char args[][8], unsigned long long threads) {
	float *dst = PTR(float, 0), *src = PTR(float, 1), a = ARG(float, 3);
	unsigned long long n = ARG(unsigned long long, 2);
	int add = ARG(int, 4);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) {
		float v = src[i] * a;
		dst[i] = add ? dst[i] + v : v;
	}
}
static void k_scale_f64(unsigned char args[][8], unsigned long long threads) {
	double *dst = PTR(double, 0), *src = PTR(double, 1), a = ARG(double, 3);
	unsigned long long n = ARG(unsigned long long, 2);
	int add = ARG(int, 4);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) {
		double v = src[i] * a;
		dst[i] = add ? dst[i] + v : v;
	}
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
static float f16_to_f(uint16_t h) {
	int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
	float v;
	if (e == 0) v = (float)m / 16777216.0f; // m · 2^-24
	else if (e == 31) v = m ? __builtin_nanf("") : __builtin_inff();
	else {
		uint32_t b = ((uint32_t)(e - 15 + 127) << 23) | ((uint32_t)m << 13);
		memcpy(&v, &b, 4);
	}
	return s ? -v : v;
}
static void k_f32_to_f16(unsigned char args[][8], unsigned long long threads) {
	uint16_t *dst = PTR(uint16_t, 0);
	float *src = PTR(float, 1);
	unsigned long long n = ARG(unsigned long long, 2);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) dst[i] = f_to_f16(src[i]);
}
static void k_f16_to_f32(unsigned char args[][8], unsigned long long threads) {
	float *dst = PTR(float, 0);
	uint16_t *src = PTR(uint16_t, 1);
	unsigned long long n = ARG(unsigned long long, 2);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) dst[i] = f16_to_f(src[i]);
}
static void k_f32_to_bf16(unsigned char args[][8], unsigned long long threads) {
	uint16_t *dst = PTR(uint16_t, 0);
	uint32_t *src = PTR(uint32_t, 1);
	unsigned long long n = ARG(unsigned long long, 2);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) {
		uint32_t b = src[i];
		if ((b & 0x7fffffff) > 0x7f800000) dst[i] = (uint16_t)((b >> 16) | 0x40);
		else dst[i] = (uint16_t)((b + 0x7fff + ((b >> 16) & 1)) >> 16);
	}
}
static void k_bf16_to_f32(unsigned char args[][8], unsigned long long threads) {
	uint32_t *dst = PTR(uint32_t, 0);
	uint16_t *src = PTR(uint16_t, 1);
	unsigned long long n = ARG(unsigned long long, 2);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
}

// The kernels of examples/gpumlp (row-major float32 matrices).
static void k_add_bias(unsigned char args[][8], unsigned long long threads) {
	float *h = PTR(float, 0), *b = PTR(float, 1);
	unsigned long long rows = ARG(unsigned long long, 2), cols = ARG(unsigned long long, 3);
	(void)threads;
	for (unsigned long long r = 0; r < rows; r++)
		for (unsigned long long c = 0; c < cols; c++) h[r * cols + c] += b[c];
}
static void k_relu(unsigned char args[][8], unsigned long long threads) {
	float *h = PTR(float, 0);
	unsigned long long n = ARG(unsigned long long, 1);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++)
		if (!(h[i] > 0)) h[i] = 0;
}
static void k_relu_bwd(unsigned char args[][8], unsigned long long threads) {
	float *dh = PTR(float, 0), *h = PTR(float, 1);
	unsigned long long n = ARG(unsigned long long, 2);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++)
		if (!(h[i] > 0)) dh[i] = 0;
}
static void k_sub_scale(unsigned char args[][8], unsigned long long threads) {
	float *dst = PTR(float, 0), *a = PTR(float, 1), *b = PTR(float, 2), s = ARG(float, 4);
	unsigned long long n = ARG(unsigned long long, 3);
	(void)threads;
	for (unsigned long long i = 0; i < n; i++) dst[i] = s * (a[i] - b[i]);
}
static void k_colsum(unsigned char args[][8], unsigned long long threads) {
	float *out = PTR(float, 0), *in = PTR(float, 1);
	unsigned long long rows = ARG(unsigned long long, 2), cols = ARG(unsigned long long, 3);
	(void)threads;
	for (unsigned long long c = 0; c < cols; c++) {
		float acc = 0;
		for (unsigned long long r = 0; r < rows; r++) acc += in[r * cols + c];
		out[c] = acc;
	}
}

// goddp_orth_f32 (backends/nccl/kernels): modified Gram-Schmidt of a rows×cols
// column-major float32 matrix in float64 arithmetic, one thread; the same operations in
// the same order as the PTX (procgroup.DeviceBLAS.OrthonormalizeAsync).
static double orth_dot(const float *x, const float *y, unsigned long long n) {
	double s = 0;
	for (unsigned long long i = 0; i < n; i++) s += (double)x[i] * (double)y[i];
	return s;
}
static void k_orth_f32(unsigned char args[][8], unsigned long long threads) {
	float *a = PTR(float, 0);
	unsigned long long rows = ARG(unsigned long long, 1), seed = ARG(unsigned long long, 3);
	unsigned int cols = ARG(unsigned int, 2);
	(void)threads;
	for (unsigned int c = 0; c < cols; c++) {
		float *col = a + (unsigned long long)c * rows;
		for (unsigned long long t = 0;; t++) {
			double before = __builtin_sqrt(orth_dot(col, col, rows));
			for (int pass = 0; pass < 2; pass++)
				for (unsigned int k = 0; k < c; k++) {
					const float *prev = a + (unsigned long long)k * rows;
					double d = orth_dot(col, prev, rows);
					for (unsigned long long i = 0; i < rows; i++) col[i] = (float)((double)col[i] - d * (double)prev[i]);
				}
			double norm = __builtin_sqrt(orth_dot(col, col, rows));
			int good = norm > 1e-5 * before && norm > 0 && norm < __builtin_inf();
			if (good || t == 3) {
				double inv = good ? 1 / norm : 0;
				for (unsigned long long i = 0; i < rows; i++) col[i] = (float)((double)col[i] * inv);
				break;
			}
			uint64_t g = seed ^ ((uint64_t)c + 1 + (t << 32));
			for (unsigned long long i = 0; i < rows; i++) {
				g += 0x9e3779b97f4a7c15ULL;
				uint64_t z = g;
				z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
				z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
				z ^= z >> 31;
				col[i] = (float)((double)(z >> 11) * 0x1p-52 - 1);
			}
		}
	}
}

static const kernel kernels[] = {
	{"goddp_scale_f32", 5, {8, 8, 8, 4, 4}, k_scale_f32},
	{"goddp_scale_f64", 5, {8, 8, 8, 8, 4}, k_scale_f64},
	{"goddp_f32_to_f16", 3, {8, 8, 8}, k_f32_to_f16},
	{"goddp_f16_to_f32", 3, {8, 8, 8}, k_f16_to_f32},
	{"goddp_f32_to_bf16", 3, {8, 8, 8}, k_f32_to_bf16},
	{"goddp_bf16_to_f32", 3, {8, 8, 8}, k_bf16_to_f32},
	{"goddp_orth_f32", 4, {8, 8, 4, 8}, k_orth_f32},
	{"gpumlp_add_bias", 4, {8, 8, 8, 8}, k_add_bias},
	{"gpumlp_relu", 2, {8, 8}, k_relu},
	{"gpumlp_relu_bwd", 3, {8, 8, 8}, k_relu_bwd},
	{"gpumlp_sub_scale", 5, {8, 8, 8, 8, 4}, k_sub_scale},
	{"gpumlp_colsum", 4, {8, 8, 8, 8}, k_colsum},
};

static char modules[4];
CUresult cuModuleLoadData(void **m, const void *image) {
	if (!image) return ERR_INVALID_VALUE;
	if (!current) return ERR_INVALID_CONTEXT;
	*m = modules;
	return OK;
}
CUresult cuModuleUnload(void *m) { return m == modules ? OK : ERR_INVALID_HANDLE; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
	if (m != modules) return ERR_INVALID_HANDLE;
	for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++)
		if (!strcmp(kernels[i].name, name)) {
			*f = (void *)&kernels[i];
			return OK;
		}
	return 500; // CUDA_ERROR_NOT_FOUND
}

typedef struct {
	const kernel *k;
	unsigned long long threads;
	unsigned char args[MAXARGS][8];
} launch;
static void launch_fn(void *p) {
	launch *l = p;
	l->k->fn(l->args, l->threads);
	pthread_mutex_lock(&mu);
	kernels_run++;
	pthread_mutex_unlock(&mu);
	free(l);
}
CUresult cuLaunchKernel(void *f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx, unsigned int by,
			unsigned int bz, unsigned int shmem, void *h, void **params, void **extra) {
	const kernel *k = f;
	(void)shmem;
	(void)extra;
	if (!k || !params || !gx || !gy || !gz || !bx || !by || !bz || bx * by * bz > 1024) return ERR_INVALID_VALUE;
	launch *l = calloc(1, sizeof *l);
	l->k = k;
	l->threads = (unsigned long long)gx * gy * gz * bx * by * bz;
	for (int i = 0; i < k->nargs; i++) memcpy(l->args[i], params[i], (size_t)k->size[i]); // copied at launch, as CUDA does
	CUresult r = fakecuda_enqueue(h, launch_fn, l);
	if (r) free(l);
	return r;
}
