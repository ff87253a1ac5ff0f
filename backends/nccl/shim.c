// shim.c: loads libcuda.so.1 and libnccl.so.2 with dlopen and calls them through the
// table of shim.h.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shim.h"

// sym resolves name (trying name_v2 first when v2 is set: the driver exports the current
// ABI of many functions under that name, cuda.h #defines the plain name to it).
static void *sym(void *h, const char *name, int v2) {
	if (v2) {
		char buf[128];
		snprintf(buf, sizeof buf, "%s_v2", name);
		void *p = dlsym(h, buf);
		if (p) return p;
	}
	return dlsym(h, name);
}

#define LOAD(h, field, v2, which_lib)                                                   \
	do {                                                                            \
		*(void **)(&l->field) = sym(h, #field, v2);                             \
		if (!l->field) {                                                        \
			snprintf(err, errlen, "symbol %s not found", #field);           \
			*which = which_lib;                                             \
			goto fail;                                                      \
		}                                                                       \
	} while (0)

goddp_lib *goddp_load(const char *cuda_path, const char *nccl_path, char *err, size_t errlen, int *which) {
	goddp_lib *l = calloc(1, sizeof *l);
	if (!l) {
		snprintf(err, errlen, "out of memory");
		*which = 0;
		return NULL;
	}
	// RTLD_GLOBAL for the driver: NCCL resolves the driver itself (by dlopen of
	// libcuda.so.1 or through libcudart), and must find the same one.
	l->cuda_handle = dlopen(cuda_path, RTLD_NOW | RTLD_GLOBAL);
	if (!l->cuda_handle) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		*which = 1;
		// Is NCCL missing too? Say so in the same error (NCCL loads the driver lazily,
		// so it can be opened without it).
		void *n = dlopen(nccl_path, RTLD_LAZY | RTLD_LOCAL);
		if (n) {
			dlclose(n);
		} else {
			e = dlerror();
			size_t used = strlen(err);
			snprintf(err + used, errlen - used, "\n%s", e ? e : "dlopen failed");
			*which = 3;
		}
		goto fail;
	}
	LOAD(l->cuda_handle, cuInit, 0, 1);
	LOAD(l->cuda_handle, cuDriverGetVersion, 0, 1);
	LOAD(l->cuda_handle, cuDeviceGetCount, 0, 1);
	LOAD(l->cuda_handle, cuDeviceGet, 0, 1);
	LOAD(l->cuda_handle, cuDeviceGetName, 0, 1);
	LOAD(l->cuda_handle, cuDevicePrimaryCtxRetain, 0, 1);
	LOAD(l->cuda_handle, cuDevicePrimaryCtxRelease, 1, 1);
	LOAD(l->cuda_handle, cuCtxSetCurrent, 0, 1);
	LOAD(l->cuda_handle, cuCtxGetCurrent, 0, 1);
	LOAD(l->cuda_handle, cuPointerGetAttribute, 0, 1);
	// Optional, and by its plain name: cuStreamGetCtx_v2 (CUDA 12.5) is another API, with a
	// third argument (CUgreenCtx *), not a new ABI of this one.
	*(void **)(&l->cuStreamGetCtx) = sym(l->cuda_handle, "cuStreamGetCtx", 0);
	LOAD(l->cuda_handle, cuStreamCreate, 0, 1);
	LOAD(l->cuda_handle, cuStreamDestroy, 1, 1);
	LOAD(l->cuda_handle, cuStreamSynchronize, 0, 1);
	LOAD(l->cuda_handle, cuStreamWaitEvent, 0, 1);
	LOAD(l->cuda_handle, cuEventCreate, 0, 1);
	LOAD(l->cuda_handle, cuEventDestroy, 1, 1);
	LOAD(l->cuda_handle, cuEventRecord, 0, 1);
	LOAD(l->cuda_handle, cuEventQuery, 0, 1);
	LOAD(l->cuda_handle, cuEventSynchronize, 0, 1);
	LOAD(l->cuda_handle, cuMemAlloc, 1, 1);
	LOAD(l->cuda_handle, cuMemFree, 1, 1);
	LOAD(l->cuda_handle, cuMemHostAlloc, 0, 1);
	LOAD(l->cuda_handle, cuMemFreeHost, 0, 1);
	LOAD(l->cuda_handle, cuMemcpyHtoDAsync, 1, 1);
	LOAD(l->cuda_handle, cuMemcpyDtoHAsync, 1, 1);
	LOAD(l->cuda_handle, cuMemsetD32Async, 0, 1);
	LOAD(l->cuda_handle, cuGetErrorString, 0, 1);
	LOAD(l->cuda_handle, cuMemcpyDtoDAsync, 1, 1);
	LOAD(l->cuda_handle, cuModuleLoadData, 0, 1);
	LOAD(l->cuda_handle, cuModuleGetFunction, 0, 1);
	LOAD(l->cuda_handle, cuModuleUnload, 0, 1);
	LOAD(l->cuda_handle, cuLaunchKernel, 0, 1);
	LOAD(l->cuda_handle, cuEventElapsedTime, 0, 1);

	l->nccl_handle = dlopen(nccl_path, RTLD_NOW | RTLD_LOCAL);
	if (!l->nccl_handle) {
		const char *e = dlerror();
		snprintf(err, errlen, "%s", e ? e : "dlopen failed");
		*which = 2;
		goto fail;
	}
	LOAD(l->nccl_handle, ncclGetVersion, 0, 2);
	LOAD(l->nccl_handle, ncclGetUniqueId, 0, 2);
	LOAD(l->nccl_handle, ncclCommInitRank, 0, 2);
	LOAD(l->nccl_handle, ncclCommDestroy, 0, 2);
	LOAD(l->nccl_handle, ncclCommAbort, 0, 2);
	LOAD(l->nccl_handle, ncclCommGetAsyncError, 0, 2);
	LOAD(l->nccl_handle, ncclGetErrorString, 0, 2);
	LOAD(l->nccl_handle, ncclAllReduce, 0, 2);
	LOAD(l->nccl_handle, ncclBroadcast, 0, 2);
	LOAD(l->nccl_handle, ncclAllGather, 0, 2);
	LOAD(l->nccl_handle, ncclReduceScatter, 0, 2);
	*(void **)(&l->ncclGetLastError) = dlsym(l->nccl_handle, "ncclGetLastError"); // optional
	*(void **)(&l->ncclCommFinalize) = dlsym(l->nccl_handle, "ncclCommFinalize");  // optional
	return l;
fail:
	// The handles stay open: unloading a half-initialised CUDA driver is not safe.
	free(l);
	return NULL;
}

// Note [Caller's context]: the driver's current context is per thread, and the thread is
// the caller's (a goroutine's, which may hold a context of its own: gorgonia/cu's
// NewContext, another device's). Every helper makes ctx current for its own calls only:
// ENTER saves the thread's context and switches if it differs, LEAVE switches back. With
// the caller's context already ctx they cost one cuCtxGetCurrent.
#define ENTER(l, ctx)                                          \
	goddp_CUcontext prev_ = NULL;                          \
	do {                                                   \
		goddp_CUresult er_ = (l)->cuCtxGetCurrent(&prev_); \
		if (er_) return er_;                           \
		if (prev_ != (ctx)) {                          \
			er_ = (l)->cuCtxSetCurrent(ctx);       \
			if (er_) return er_;                   \
		}                                              \
	} while (0)
#define LEAVE(l, ctx)                                              \
	do {                                                       \
		if (prev_ != (ctx)) (void)(l)->cuCtxSetCurrent(prev_); \
	} while (0)
// RUN(l, ctx, expr) evaluates the CUresult expr with ctx current and returns it.
#define RUN(l, ctx, expr)                \
	do {                             \
		ENTER(l, ctx);           \
		goddp_CUresult rr_ = (expr); \
		LEAVE(l, ctx);           \
		return rr_;              \
	} while (0)

goddp_CUresult goddp_ctx_enter(goddp_lib *l, goddp_CUcontext ctx, goddp_CUcontext *prev) {
	goddp_CUresult r = l->cuCtxGetCurrent(prev);
	if (r) return r;
	return (ctx && *prev != ctx) ? l->cuCtxSetCurrent(ctx) : 0;
}

goddp_CUresult goddp_ctx_leave(goddp_lib *l, goddp_CUcontext prev) {
	goddp_CUcontext cur = NULL;
	goddp_CUresult r = l->cuCtxGetCurrent(&cur);
	if (r) return r;
	return cur != prev ? l->cuCtxSetCurrent(prev) : 0;
}

goddp_CUresult goddp_event_create(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent *ev) {
	RUN(l, ctx, l->cuEventCreate(ev, GODDP_CU_EVENT_DISABLE_TIMING));
}

goddp_CUresult goddp_staging_alloc(goddp_lib *l, goddp_CUcontext ctx, void **host, goddp_CUdeviceptr *dev, size_t n) {
	ENTER(l, ctx);
	goddp_CUresult r = l->cuMemHostAlloc(host, n, 0);
	if (!r) {
		r = l->cuMemAlloc(dev, n);
		if (r) l->cuMemFreeHost(*host);
	}
	LEAVE(l, ctx);
	return r;
}

// stream_owner sets *owner to the context of stream s, or to ctx where the driver cannot
// tell (cuStreamGetCtx missing or failing: a wrong stream then fails in the driver call
// that uses it). The legacy default stream is the current context's, ctx's here.
static void stream_owner(goddp_lib *l, uintptr_t s, goddp_CUcontext ctx, goddp_CUcontext *owner) {
	*owner = ctx;
	if (s == 0 || s == GODDP_CU_STREAM_LEGACY || !l->cuStreamGetCtx) return; // the current context's
	if (l->cuStreamGetCtx((goddp_CUstream)s, owner) != 0) *owner = ctx;
}

// ptr_owner sets *owner to the context of device memory at p, or to ctx where the driver
// does not say (memory of the virtual memory management API, for instance).
static void ptr_owner(goddp_lib *l, goddp_CUdeviceptr p, goddp_CUcontext ctx, goddp_CUcontext *owner) {
	goddp_CUcontext c = NULL;
	*owner = ctx;
	if (l->cuPointerGetAttribute(&c, GODDP_CU_POINTER_ATTRIBUTE_CONTEXT, p) == 0 && c) *owner = c;
}

static int check_owners(goddp_lib *l, goddp_call *c) {
	goddp_CUcontext o;
	if (c->wait_compute) {
		stream_owner(l, c->compute_stream, c->ctx, &o);
		if (o != c->ctx) return c->wrong = GODDP_WRONG_COMPUTE_STREAM, c->wrong_ctx = o, -1;
		if (c->count > 0) {
			ptr_owner(l, c->send, c->ctx, &o);
			if (o != c->ctx) return c->wrong = GODDP_WRONG_SEND, c->wrong_ctx = o, -1;
			if (c->recv != c->send) {
				ptr_owner(l, c->recv, c->ctx, &o);
				if (o != c->ctx) return c->wrong = GODDP_WRONG_RECV, c->wrong_ctx = o, -1;
			}
		}
	}
	if (c->wait_out) {
		stream_owner(l, c->out_stream, c->ctx, &o);
		if (o != c->ctx) return c->wrong = GODDP_WRONG_OUT_STREAM, c->wrong_ctx = o, -1;
	}
	return 0;
}

#define STEP(call, name, is_nccl)                   \
	do {                                        \
		int r_ = (call);                    \
		if (r_ != 0) {                      \
			c->failed_step = name;      \
			c->failed_nccl = is_nccl;   \
			return r_;                  \
		}                                   \
	} while (0)

static int nccl_call(goddp_lib *l, goddp_call *c);

static int issue(goddp_lib *l, goddp_call *c, int *gate) {
	if (check_owners(l, c)) return -1;
	if (c->wait_compute) {
		STEP(l->cuEventRecord(c->start_event, (goddp_CUstream)c->compute_stream), "cuEventRecord (compute stream)", 0);
		STEP(l->cuStreamWaitEvent(c->comm_stream, c->start_event, 0), "cuStreamWaitEvent", 0);
	}
	if (c->wait_out) {
		STEP(l->cuEventRecord(c->out_event, (goddp_CUstream)c->out_stream), "cuEventRecord (output's stream)", 0);
		STEP(l->cuStreamWaitEvent(c->comm_stream, c->out_event, 0), "cuStreamWaitEvent (output's stream)", 0);
	}
	if (c->h2d_bytes > 0)
		STEP(l->cuMemcpyHtoDAsync(c->dev + c->h2d_off, (char *)c->host + c->h2d_off, c->h2d_bytes, c->comm_stream),
		     "cuMemcpyHtoDAsync", 0);
	if (c->count > 0) {
		// Note [Communicator gate]: enter the NCCL call only if the watchdog has not
		// closed the gate, and say so while inside it.
		int open = 0;
		if (!__atomic_compare_exchange_n(gate, &open, GODDP_GATE_IN_CALL, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
			c->failed_step = "the communicator (aborted)";
			c->failed_nccl = 1;
			return GODDP_ISSUE_GATE_CLOSED;
		}
		int r = nccl_call(l, c);
		__atomic_fetch_and(gate, ~GODDP_GATE_IN_CALL, __ATOMIC_SEQ_CST);
		if (r) return r;
	}
	if (c->d2h_bytes > 0)
		STEP(l->cuMemcpyDtoHAsync((char *)c->host + c->d2h_off, c->dev + c->d2h_off, c->d2h_bytes, c->comm_stream),
		     "cuMemcpyDtoHAsync", 0);
	STEP(l->cuEventRecord(c->end_event, c->comm_stream), "cuEventRecord (comm stream)", 0);
	return 0;
}

// nccl_call makes the collective's NCCL call.
static int nccl_call(goddp_lib *l, goddp_call *c) {
	switch (c->kind) {
	case GODDP_ALLREDUCE:
		STEP(l->ncclAllReduce((const void *)c->send, (void *)c->recv, c->count, c->dtype, c->op, c->comm, c->comm_stream),
		     "ncclAllReduce", 1);
		break;
	case GODDP_BROADCAST:
		STEP(l->ncclBroadcast((const void *)c->send, (void *)c->recv, c->count, c->dtype, c->root, c->comm, c->comm_stream),
		     "ncclBroadcast", 1);
		break;
	case GODDP_ALLGATHER:
		STEP(l->ncclAllGather((const void *)c->send, (void *)c->recv, c->count, c->dtype, c->comm, c->comm_stream),
		     "ncclAllGather", 1);
		break;
	case GODDP_REDUCESCATTER:
		STEP(l->ncclReduceScatter((const void *)c->send, (void *)c->recv, c->count, c->dtype, c->op, c->comm, c->comm_stream),
		     "ncclReduceScatter", 1);
		break;
	default:
		c->failed_step = "unknown collective";
		c->failed_nccl = 1;
		return 4; // ncclInvalidArgument
	}
	return 0;
}

int goddp_issue(goddp_lib *l, goddp_call *c, int *gate) {
	c->failed_step = NULL;
	c->failed_nccl = 0;
	c->wrong = 0;
	c->wrong_ctx = NULL;
	goddp_CUcontext prev = NULL;
	STEP(l->cuCtxGetCurrent(&prev), "cuCtxGetCurrent", 0);
	if (prev != c->ctx) STEP(l->cuCtxSetCurrent(c->ctx), "cuCtxSetCurrent", 0);
	int r = issue(l, c, gate);
	if (prev != c->ctx) (void)l->cuCtxSetCurrent(prev);
	return r;
}

int goddp_gate_close(int *gate) { return __atomic_fetch_or(gate, GODDP_GATE_CLOSED, __ATOMIC_SEQ_CST); }

int goddp_gate_load(int *gate) { return __atomic_load_n(gate, __ATOMIC_SEQ_CST); }

goddp_CUresult goddp_event_query(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent ev) { RUN(l, ctx, l->cuEventQuery(ev)); }

goddp_CUresult goddp_stream_sync(goddp_lib *l, goddp_CUcontext ctx, goddp_CUstream s) { RUN(l, ctx, l->cuStreamSynchronize(s)); }

goddp_CUresult goddp_stream_wait(goddp_lib *l, goddp_CUcontext ctx, uintptr_t stream, goddp_CUevent ev) {
	RUN(l, ctx, l->cuStreamWaitEvent((goddp_CUstream)stream, ev, 0));
}

goddp_CUresult goddp_stream_sync_handle(goddp_lib *l, goddp_CUcontext ctx, uintptr_t s) {
	RUN(l, ctx, l->cuStreamSynchronize((goddp_CUstream)s));
}

goddp_CUresult goddp_stream_destroy_handle(goddp_lib *l, uintptr_t s) { return l->cuStreamDestroy((goddp_CUstream)s); }

goddp_CUresult goddp_copy_sync(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dev, void *host, size_t n, int h2d, uintptr_t s) {
	ENTER(l, ctx);
	goddp_CUresult r =
	    h2d ? l->cuMemcpyHtoDAsync(dev, host, n, (goddp_CUstream)s) : l->cuMemcpyDtoHAsync(host, dev, n, (goddp_CUstream)s);
	if (!r) r = l->cuStreamSynchronize((goddp_CUstream)s);
	LEAVE(l, ctx);
	return r;
}

goddp_CUresult goddp_memset32(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dev, unsigned int v, size_t n, uintptr_t s) {
	RUN(l, ctx, l->cuMemsetD32Async(dev, v, n, (goddp_CUstream)s));
}

// The NCCL calls below return ncclUnhandledCudaError (1) if ctx cannot be made current.
#define NCCL_ENTER(l, ctx)                                                \
	goddp_CUcontext prev_ = NULL;                                     \
	do {                                                              \
		if ((l)->cuCtxGetCurrent(&prev_) != 0) return 1;          \
		if (prev_ != (ctx) && (l)->cuCtxSetCurrent(ctx) != 0) return 1; \
	} while (0)

goddp_ncclResult_t goddp_comm_destroy(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm) {
	NCCL_ENTER(l, ctx);
	goddp_ncclResult_t r = l->ncclCommDestroy(comm);
	LEAVE(l, ctx);
	return r;
}

goddp_ncclResult_t goddp_comm_finalize(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm) {
	if (!l->ncclCommFinalize) return 0;
	NCCL_ENTER(l, ctx);
	goddp_ncclResult_t r = l->ncclCommFinalize(comm);
	LEAVE(l, ctx);
	return r;
}

int goddp_has_finalize(goddp_lib *l) { return l->ncclCommFinalize != NULL; }

goddp_ncclResult_t goddp_comm_abort(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm) {
	NCCL_ENTER(l, ctx);
	goddp_ncclResult_t r = l->ncclCommAbort(comm);
	LEAVE(l, ctx);
	return r;
}

goddp_ncclResult_t goddp_comm_init(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t *comm, int nranks, const void *id, int rank) {
	NCCL_ENTER(l, ctx);
	goddp_ncclUniqueId uid;
	memcpy(&uid, id, sizeof uid);
	goddp_ncclResult_t r = l->ncclCommInitRank(comm, nranks, uid, rank);
	LEAVE(l, ctx);
	return r;
}

goddp_ncclResult_t goddp_get_unique_id(goddp_lib *l, void *id) {
	goddp_ncclUniqueId uid;
	goddp_ncclResult_t r = l->ncclGetUniqueId(&uid);
	memcpy(id, &uid, sizeof uid);
	return r;
}

const char *goddp_cu_error(goddp_lib *l, goddp_CUresult r) {
	const char *s = NULL;
	if (l->cuGetErrorString(r, &s) != 0 || !s) return "unknown CUDA error";
	return s;
}

const char *goddp_nccl_error(goddp_lib *l, goddp_ncclResult_t r) {
	const char *s = l->ncclGetErrorString(r);
	return s ? s : "unknown NCCL error";
}

const char *goddp_nccl_last_error(goddp_lib *l, goddp_ncclComm_t comm) {
	if (!l->ncclGetLastError) return "";
	const char *s = l->ncclGetLastError(comm);
	return s ? s : "";
}

goddp_CUresult goddp_module_load(goddp_lib *l, goddp_CUcontext ctx, const char *image, goddp_CUmodule *m) {
	RUN(l, ctx, l->cuModuleLoadData(m, image));
}

goddp_CUresult goddp_module_function(goddp_lib *l, goddp_CUmodule m, const char *name, goddp_CUfunction *f) {
	return l->cuModuleGetFunction(f, m, name);
}

enum { BLOCK = 256 };

static goddp_CUresult launch(goddp_lib *l, goddp_CUfunction f, uintptr_t s, unsigned long long n, void **params) {
	if (n == 0) return 0;
	unsigned long long grid = (n + BLOCK - 1) / BLOCK;
	if (grid > 0x7fffffffULL) return 1; // CUDA_ERROR_INVALID_VALUE: too many elements
	return l->cuLaunchKernel(f, (unsigned int)grid, 1, 1, BLOCK, 1, 1, 0, (goddp_CUstream)s, params, NULL);
}

goddp_CUresult goddp_launch_scale(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr dst,
				  goddp_CUdeviceptr src, unsigned long long n, double a, int add, int f64) {
	float a32 = (float)a;
	void *params[] = {&dst, &src, &n, f64 ? (void *)&a : (void *)&a32, &add};
	RUN(l, ctx, launch(l, f, s, n, params));
}

goddp_CUresult goddp_launch_convert(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr dst,
				    goddp_CUdeviceptr src, unsigned long long n) {
	void *params[] = {&dst, &src, &n};
	RUN(l, ctx, launch(l, f, s, n, params));
}

goddp_CUresult goddp_copy_d2d(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dst, goddp_CUdeviceptr src, size_t n, uintptr_t s) {
	RUN(l, ctx, l->cuMemcpyDtoDAsync(dst, src, n, (goddp_CUstream)s));
}

goddp_CUresult goddp_event_record(goddp_lib *l, goddp_CUcontext ctx, uintptr_t ev, uintptr_t s) {
	RUN(l, ctx, l->cuEventRecord((goddp_CUevent)ev, (goddp_CUstream)s));
}

goddp_CUresult goddp_stream_wait_handle(goddp_lib *l, goddp_CUcontext ctx, uintptr_t s, uintptr_t ev) {
	RUN(l, ctx, l->cuStreamWaitEvent((goddp_CUstream)s, (goddp_CUevent)ev, 0));
}

goddp_CUresult goddp_event_destroy_handle(goddp_lib *l, uintptr_t ev) { return l->cuEventDestroy((goddp_CUevent)ev); }

goddp_CUresult goddp_module_unload(goddp_lib *l, goddp_CUcontext ctx, goddp_CUmodule m) { RUN(l, ctx, l->cuModuleUnload(m)); }

goddp_CUresult goddp_event_create_timed(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent *ev, int timing) {
	RUN(l, ctx, l->cuEventCreate(ev, timing ? 0 : GODDP_CU_EVENT_DISABLE_TIMING));
}

goddp_CUresult goddp_event_elapsed(goddp_lib *l, goddp_CUcontext ctx, float *ms, uintptr_t a, uintptr_t b) {
	RUN(l, ctx, l->cuEventElapsedTime(ms, (goddp_CUevent)a, (goddp_CUevent)b));
}

goddp_blas *goddp_blas_load(const char *paths, char *err, size_t errlen) {
	goddp_blas *b = calloc(1, sizeof *b);
	char *list = strdup(paths), *save = NULL;
	if (!b || !list) {
		snprintf(err, errlen, "out of memory");
		free(b);
		free(list);
		return NULL;
	}
	err[0] = 0;
	for (char *p = strtok_r(list, ":", &save); p && !b->handle; p = strtok_r(NULL, ":", &save)) {
		b->handle = dlopen(p, RTLD_NOW | RTLD_LOCAL);
		if (!b->handle) {
			const char *e = dlerror();
			size_t used = strlen(err);
			snprintf(err + used, errlen - used, "%s%s", used ? "; " : "", e ? e : p);
		}
	}
	free(list);
	if (!b->handle) {
		free(b);
		return NULL;
	}
#define BLAS_SYM(field)                                                             \
	do {                                                                        \
		*(void **)(&b->field) = dlsym(b->handle, #field);                   \
		if (!b->field) {                                                    \
			snprintf(err, errlen, "symbol %s not found", #field);       \
			dlclose(b->handle);                                         \
			free(b);                                                    \
			return NULL;                                                \
		}                                                                   \
	} while (0)
	BLAS_SYM(cublasCreate_v2);
	BLAS_SYM(cublasDestroy_v2);
	BLAS_SYM(cublasSetStream_v2);
	BLAS_SYM(cublasSgemm_v2);
#undef BLAS_SYM
	return b;
}

goddp_CUresult goddp_blas_create(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t *h, goddp_cublasStatus_t *st) {
	ENTER(l, ctx);
	*st = b->cublasCreate_v2(h);
	LEAVE(l, ctx);
	return 0;
}

goddp_CUresult goddp_blas_destroy(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t h, goddp_cublasStatus_t *st) {
	ENTER(l, ctx);
	*st = b->cublasDestroy_v2(h);
	LEAVE(l, ctx);
	return 0;
}

goddp_CUresult goddp_blas_sgemm(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t h, uintptr_t s, int ta, int tb,
				int m, int n, int k, float alpha, goddp_CUdeviceptr a, int lda, goddp_CUdeviceptr bm, int ldb, float beta,
				goddp_CUdeviceptr c, int ldc, goddp_cublasStatus_t *st) {
	ENTER(l, ctx);
	*st = b->cublasSetStream_v2(h, (goddp_CUstream)s);
	if (*st == 0)
		*st = b->cublasSgemm_v2(h, ta, tb, m, n, k, &alpha, (const float *)(uintptr_t)a, lda, (const float *)(uintptr_t)bm, ldb, &beta,
					(float *)(uintptr_t)c, ldc);
	LEAVE(l, ctx);
	return 0;
}

goddp_CUresult goddp_launch_orth(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr a,
				 unsigned long long rows, unsigned int cols, unsigned long long seed) {
	void *params[] = {&a, &rows, &cols, &seed};
	RUN(l, ctx, l->cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, (goddp_CUstream)s, params, NULL));
}

long long goddp_fake_knob(goddp_lib *l, const char *name, long long value) {
	long long (*f)(const char *, long long) = NULL;
	*(void **)(&f) = dlsym(l->nccl_handle, "fake_knob");
	if (!f) *(void **)(&f) = dlsym(l->cuda_handle, "fake_knob");
	if (!f) return -1;
	return f(name, value);
}

goddp_CUresult goddp_cuInit(goddp_lib *l) { return l->cuInit(0); }
goddp_CUresult goddp_cuDriverGetVersion(goddp_lib *l, int *v) { return l->cuDriverGetVersion(v); }
goddp_CUresult goddp_cuDeviceGetCount(goddp_lib *l, int *n) { return l->cuDeviceGetCount(n); }
goddp_CUresult goddp_cuDeviceGet(goddp_lib *l, goddp_CUdevice *d, int o) { return l->cuDeviceGet(d, o); }
goddp_CUresult goddp_cuDeviceGetName(goddp_lib *l, char *n, int len, goddp_CUdevice d) { return l->cuDeviceGetName(n, len, d); }
goddp_CUresult goddp_cuDevicePrimaryCtxRetain(goddp_lib *l, goddp_CUcontext *c, goddp_CUdevice d) { return l->cuDevicePrimaryCtxRetain(c, d); }
goddp_CUresult goddp_cuDevicePrimaryCtxRelease(goddp_lib *l, goddp_CUdevice d) { return l->cuDevicePrimaryCtxRelease(d); }
goddp_CUresult goddp_cuCtxSetCurrent(goddp_lib *l, goddp_CUcontext c) { return l->cuCtxSetCurrent(c); }
goddp_CUresult goddp_cuStreamCreate(goddp_lib *l, goddp_CUstream *s, unsigned int f) { return l->cuStreamCreate(s, f); }
goddp_CUresult goddp_cuStreamDestroy(goddp_lib *l, goddp_CUstream s) { return l->cuStreamDestroy(s); }
goddp_CUresult goddp_cuStreamWaitEvent(goddp_lib *l, goddp_CUstream s, goddp_CUevent e) { return l->cuStreamWaitEvent(s, e, 0); }
goddp_CUresult goddp_cuEventCreate(goddp_lib *l, goddp_CUevent *e) { return l->cuEventCreate(e, GODDP_CU_EVENT_DISABLE_TIMING); }
goddp_CUresult goddp_cuEventDestroy(goddp_lib *l, goddp_CUevent e) { return l->cuEventDestroy(e); }
goddp_CUresult goddp_cuMemAlloc(goddp_lib *l, goddp_CUdeviceptr *p, size_t n) { return l->cuMemAlloc(p, n); }
goddp_CUresult goddp_cuMemFree(goddp_lib *l, goddp_CUdeviceptr p) { return l->cuMemFree(p); }
goddp_CUresult goddp_cuMemHostAlloc(goddp_lib *l, void **p, size_t n) { return l->cuMemHostAlloc(p, n, 0); }
goddp_CUresult goddp_cuMemFreeHost(goddp_lib *l, void *p) { return l->cuMemFreeHost(p); }
goddp_CUresult goddp_cuMemcpyHtoDAsync(goddp_lib *l, goddp_CUdeviceptr d, const void *s, size_t n, goddp_CUstream st) { return l->cuMemcpyHtoDAsync(d, s, n, st); }
goddp_CUresult goddp_cuMemcpyDtoHAsync(goddp_lib *l, void *d, goddp_CUdeviceptr s, size_t n, goddp_CUstream st) { return l->cuMemcpyDtoHAsync(d, s, n, st); }
goddp_CUresult goddp_cuMemsetD32Async(goddp_lib *l, goddp_CUdeviceptr d, unsigned int v, size_t n, goddp_CUstream st) { return l->cuMemsetD32Async(d, v, n, st); }
goddp_ncclResult_t goddp_ncclGetVersion(goddp_lib *l, int *v) { return l->ncclGetVersion(v); }
goddp_ncclResult_t goddp_ncclCommDestroy(goddp_lib *l, goddp_ncclComm_t c) { return l->ncclCommDestroy(c); }
goddp_ncclResult_t goddp_ncclCommAbort(goddp_lib *l, goddp_ncclComm_t c) { return l->ncclCommAbort(c); }
goddp_ncclResult_t goddp_ncclCommGetAsyncError(goddp_lib *l, goddp_ncclComm_t c, goddp_ncclResult_t *r) { return l->ncclCommGetAsyncError(c, r); }
