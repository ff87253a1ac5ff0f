// fakecuda.c: a fake CUDA driver (libcuda.so.1) for the tests of backends/nccl. "Device
// memory" is malloc'd host memory; each stream is an in-order queue run by its own thread;
// events complete when the stream reaches them. One mutex and condition variable guard all
// of it. Knobs (fakecuda_knob): device_count, gate_close (value: a stream; queues a task
// that blocks until gate_open), gate_open, tasks_run (read).
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
enum { OK = 0, ERR_INVALID_VALUE = 1, ERR_OUT_OF_MEMORY = 2, ERR_INVALID_HANDLE = 400, ERR_NOT_READY = 600 };

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int device_count = 8;
static int gate_closed;
static long long tasks_run;

typedef struct task {
	void (*fn)(void *);
	void *arg;
	struct task *next;
} task;

typedef struct stream {
	task *head, *tail;
	int busy, stop;
	pthread_t th;
} stream;

typedef struct event {
	unsigned long long recorded, completed;
} event;

static stream *legacy; // the NULL stream, created on first use

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
		tasks_run++;
		pthread_cond_broadcast(&cv);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

static stream *new_stream(void) {
	stream *s = calloc(1, sizeof *s);
	pthread_create(&s->th, NULL, worker, s);
	return s;
}

// get resolves a stream handle; mu is held.
static stream *get(void *h) {
	if (h) return h;
	if (!legacy) legacy = new_stream();
	return legacy;
}

static void enqueue_locked(stream *s, void (*fn)(void *), void *arg) {
	task *t = calloc(1, sizeof *t);
	t->fn = fn;
	t->arg = arg;
	if (s->tail) s->tail->next = t;
	else s->head = t;
	s->tail = t;
	pthread_cond_broadcast(&cv);
}

// fakecuda_enqueue queues fn(arg) on a stream (for the fake NCCL).
void fakecuda_enqueue(void *h, void (*fn)(void *), void *arg) {
	pthread_mutex_lock(&mu);
	enqueue_locked(get(h), fn, arg);
	pthread_mutex_unlock(&mu);
}

static void gate_fn(void *arg) {
	(void)arg;
	pthread_mutex_lock(&mu);
	while (gate_closed) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
}

long long fakecuda_knob(const char *name, long long value) {
	long long old = -1;
	pthread_mutex_lock(&mu);
	if (!strcmp(name, "device_count")) {
		old = device_count;
		device_count = (int)value;
	} else if (!strcmp(name, "gate_close")) {
		old = gate_closed;
		gate_closed = 1;
		enqueue_locked(get((void *)(uintptr_t)value), gate_fn, NULL);
	} else if (!strcmp(name, "gate_open")) {
		old = gate_closed;
		gate_closed = 0;
		pthread_cond_broadcast(&cv);
	} else if (!strcmp(name, "tasks_run")) {
		old = tasks_run;
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
static char contexts[64];
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) { *ctx = &contexts[d & 63]; return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { (void)ctx; return OK; }

CUresult cuStreamCreate(void **s, unsigned int flags) {
	(void)flags;
	*s = new_stream();
	return OK;
}
CUresult cuStreamSynchronize(void *h) {
	pthread_mutex_lock(&mu);
	stream *s = get(h);
	while (s->head || s->busy) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuStreamDestroy_v2(void *h) {
	if (!h) return ERR_INVALID_HANDLE;
	stream *s = h;
	pthread_mutex_lock(&mu);
	s->stop = 1; // the worker runs what is queued, then exits
	pthread_cond_broadcast(&cv);
	pthread_mutex_unlock(&mu);
	pthread_join(s->th, NULL);
	free(s);
	return OK;
}

CUresult cuEventCreate(void **e, unsigned int flags) {
	(void)flags;
	*e = calloc(1, sizeof(event));
	return OK;
}
CUresult cuEventDestroy_v2(void *e) { free(e); return OK; }

typedef struct {
	event *e;
	unsigned long long gen;
} evarg;

static void record_fn(void *p) {
	evarg *a = p;
	pthread_mutex_lock(&mu);
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
	evarg *a = malloc(sizeof *a);
	pthread_mutex_lock(&mu);
	a->e = e;
	a->gen = ++a->e->recorded;
	enqueue_locked(get(h), record_fn, a);
	pthread_mutex_unlock(&mu);
	return OK;
}
CUresult cuStreamWaitEvent(void *h, void *e, unsigned int flags) {
	(void)flags;
	evarg *a = malloc(sizeof *a);
	pthread_mutex_lock(&mu);
	a->e = e;
	a->gen = a->e->recorded; // the last record at the time of the call
	enqueue_locked(get(h), wait_fn, a);
	pthread_mutex_unlock(&mu);
	return OK;
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
	while (e->completed < e->recorded) pthread_cond_wait(&cv, &mu);
	pthread_mutex_unlock(&mu);
	return OK;
}

CUresult cuMemAlloc_v2(unsigned long long *p, size_t n) {
	void *m = malloc(n ? n : 1);
	if (!m) return ERR_OUT_OF_MEMORY;
	*p = (unsigned long long)(uintptr_t)m;
	return OK;
}
CUresult cuMemFree_v2(unsigned long long p) { free((void *)(uintptr_t)p); return OK; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned int flags) {
	(void)flags;
	*p = malloc(n ? n : 1);
	return *p ? OK : ERR_OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p) { free(p); return OK; }

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
	fakecuda_enqueue(h, copy_fn, a);
	return OK;
}
CUresult cuMemcpyHtoDAsync_v2(unsigned long long d, const void *s, size_t n, void *h) { return copy_async((void *)(uintptr_t)d, s, n, h); }
CUresult cuMemcpyDtoHAsync_v2(void *d, unsigned long long s, size_t n, void *h) { return copy_async(d, (void *)(uintptr_t)s, n, h); }
CUresult cuMemsetD32Async(unsigned long long d, unsigned int v, size_t n, void *h) {
	cparg *a = malloc(sizeof *a);
	a->dst = (void *)(uintptr_t)d;
	a->n = n;
	a->v = v;
	fakecuda_enqueue(h, set32_fn, a);
	return OK;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
	switch (r) {
	case OK: *s = "no error"; break;
	case ERR_NOT_READY: *s = "device not ready"; break;
	case ERR_INVALID_HANDLE: *s = "invalid resource handle"; break;
	default: *s = "fake CUDA error"; break;
	}
	return OK;
}
