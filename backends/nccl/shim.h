// shim.h: the slice of the NCCL and CUDA driver APIs goddp uses, declared here (not taken
// from nccl.h or cuda.h) so the package builds without them; the libraries are loaded with
// dlopen at run time. Types are renamed with a goddp_ prefix so this header can coexist with
// cuda.h in the same translation unit (see cu.go).
#ifndef GODDP_NCCL_SHIM_H
#define GODDP_NCCL_SHIM_H

#include <stddef.h>
#include <stdint.h>

// ---- CUDA driver (cuda.h) ----
typedef int goddp_CUresult; // CUresult enum: 0 = CUDA_SUCCESS, 600 = CUDA_ERROR_NOT_READY
typedef int goddp_CUdevice;
typedef unsigned long long goddp_CUdeviceptr; // CUdeviceptr_v2
typedef void *goddp_CUcontext;
typedef void *goddp_CUstream;
typedef void *goddp_CUevent;
typedef void *goddp_CUmodule;
typedef void *goddp_CUfunction;

#define GODDP_CUDA_SUCCESS 0
#define GODDP_CUDA_ERROR_NOT_READY 600
#define GODDP_CU_STREAM_NON_BLOCKING 0x1
#define GODDP_CU_EVENT_DISABLE_TIMING 0x2
#define GODDP_CU_STREAM_LEGACY ((uintptr_t)0x1)
#define GODDP_CU_STREAM_PER_THREAD ((uintptr_t)0x2)
#define GODDP_CU_POINTER_ATTRIBUTE_CONTEXT 1

// ---- NCCL (nccl.h) ----
#define GODDP_NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[GODDP_NCCL_UNIQUE_ID_BYTES]; } goddp_ncclUniqueId;
typedef void *goddp_ncclComm_t;
typedef int goddp_ncclResult_t;   // 0 ncclSuccess ... 6 ncclRemoteError, 7 ncclInProgress
typedef int goddp_ncclDataType_t; // 2 int32, 4 int64, 6 float16, 7 float32, 8 float64, 9 bfloat16
typedef int goddp_ncclRedOp_t;    // 0 sum, 1 prod, 2 max, 3 min, 4 avg (NCCL >= 2.10)

#define GODDP_NCCL_SUCCESS 0
#define GODDP_NCCL_IN_PROGRESS 7

// The function table of one loaded pair of libraries.
typedef struct goddp_lib {
	void *cuda_handle, *nccl_handle;
	// CUDA driver
	goddp_CUresult (*cuInit)(unsigned int);
	goddp_CUresult (*cuDriverGetVersion)(int *);
	goddp_CUresult (*cuDeviceGetCount)(int *);
	goddp_CUresult (*cuDeviceGet)(goddp_CUdevice *, int);
	goddp_CUresult (*cuDeviceGetName)(char *, int, goddp_CUdevice);
	goddp_CUresult (*cuDevicePrimaryCtxRetain)(goddp_CUcontext *, goddp_CUdevice);
	goddp_CUresult (*cuDevicePrimaryCtxRelease)(goddp_CUdevice);
	goddp_CUresult (*cuCtxSetCurrent)(goddp_CUcontext);
	goddp_CUresult (*cuCtxGetCurrent)(goddp_CUcontext *);
	goddp_CUresult (*cuStreamGetCtx)(goddp_CUstream, goddp_CUcontext *); // CUDA >= 9.2, not _v2; may be NULL
	goddp_CUresult (*cuPointerGetAttribute)(void *, int, goddp_CUdeviceptr);
	goddp_CUresult (*cuStreamCreate)(goddp_CUstream *, unsigned int);
	goddp_CUresult (*cuStreamDestroy)(goddp_CUstream);
	goddp_CUresult (*cuStreamSynchronize)(goddp_CUstream);
	goddp_CUresult (*cuStreamWaitEvent)(goddp_CUstream, goddp_CUevent, unsigned int);
	goddp_CUresult (*cuEventCreate)(goddp_CUevent *, unsigned int);
	goddp_CUresult (*cuEventDestroy)(goddp_CUevent);
	goddp_CUresult (*cuEventRecord)(goddp_CUevent, goddp_CUstream);
	goddp_CUresult (*cuEventQuery)(goddp_CUevent);
	goddp_CUresult (*cuEventSynchronize)(goddp_CUevent);
	goddp_CUresult (*cuMemAlloc)(goddp_CUdeviceptr *, size_t);
	goddp_CUresult (*cuMemFree)(goddp_CUdeviceptr);
	goddp_CUresult (*cuMemHostAlloc)(void **, size_t, unsigned int);
	goddp_CUresult (*cuMemFreeHost)(void *);
	goddp_CUresult (*cuMemcpyHtoDAsync)(goddp_CUdeviceptr, const void *, size_t, goddp_CUstream);
	goddp_CUresult (*cuMemcpyDtoHAsync)(void *, goddp_CUdeviceptr, size_t, goddp_CUstream);
	goddp_CUresult (*cuMemsetD32Async)(goddp_CUdeviceptr, unsigned int, size_t, goddp_CUstream);
	goddp_CUresult (*cuGetErrorString)(goddp_CUresult, const char **);
	goddp_CUresult (*cuMemcpyDtoDAsync)(goddp_CUdeviceptr, goddp_CUdeviceptr, size_t, goddp_CUstream);
	goddp_CUresult (*cuModuleLoadData)(goddp_CUmodule *, const void *);
	goddp_CUresult (*cuModuleGetFunction)(goddp_CUfunction *, goddp_CUmodule, const char *);
	goddp_CUresult (*cuModuleUnload)(goddp_CUmodule);
	goddp_CUresult (*cuLaunchKernel)(goddp_CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
					 unsigned int, unsigned int, goddp_CUstream, void **, void **);
	goddp_CUresult (*cuEventElapsedTime)(float *, goddp_CUevent, goddp_CUevent);
	// NCCL
	goddp_ncclResult_t (*ncclGetVersion)(int *);
	goddp_ncclResult_t (*ncclGetUniqueId)(goddp_ncclUniqueId *);
	goddp_ncclResult_t (*ncclCommInitRank)(goddp_ncclComm_t *, int, goddp_ncclUniqueId, int);
	goddp_ncclResult_t (*ncclCommDestroy)(goddp_ncclComm_t);
	goddp_ncclResult_t (*ncclCommFinalize)(goddp_ncclComm_t); // NCCL >= 2.14; may be NULL
	goddp_ncclResult_t (*ncclCommAbort)(goddp_ncclComm_t);
	goddp_ncclResult_t (*ncclCommGetAsyncError)(goddp_ncclComm_t, goddp_ncclResult_t *);
	const char *(*ncclGetErrorString)(goddp_ncclResult_t);
	const char *(*ncclGetLastError)(goddp_ncclComm_t); // NCCL >= 2.13; may be NULL
	goddp_ncclResult_t (*ncclAllReduce)(const void *, void *, size_t, goddp_ncclDataType_t, goddp_ncclRedOp_t, goddp_ncclComm_t, goddp_CUstream);
	goddp_ncclResult_t (*ncclBroadcast)(const void *, void *, size_t, goddp_ncclDataType_t, int, goddp_ncclComm_t, goddp_CUstream);
	goddp_ncclResult_t (*ncclAllGather)(const void *, void *, size_t, goddp_ncclDataType_t, goddp_ncclComm_t, goddp_CUstream);
	goddp_ncclResult_t (*ncclReduceScatter)(const void *, void *, size_t, goddp_ncclDataType_t, goddp_ncclRedOp_t, goddp_ncclComm_t, goddp_CUstream);
} goddp_lib;

// goddp_load opens the CUDA driver at cuda_path, then NCCL at nccl_path, and resolves every
// symbol. On failure it returns NULL and writes why into err; which says which library
// (1 = CUDA, 2 = NCCL) failed.
goddp_lib *goddp_load(const char *cuda_path, const char *nccl_path, char *err, size_t errlen, int *which);

// Collective kinds of goddp_call.
enum { GODDP_ALLREDUCE = 1, GODDP_BROADCAST, GODDP_ALLGATHER, GODDP_REDUCESCATTER };

// goddp_call is one collective as the backend issues it, in one cgo call, with ctx current
// on the calling thread for its duration (the caller's context is restored after): check
// that device buffers and their streams belong to ctx, make the comm stream wait for the
// compute stream (if wait_compute) and the output's stream (if wait_out), stage host data
// in, run the collective, stage the result out, record the end event.
typedef struct goddp_call {
	goddp_CUcontext ctx;
	goddp_ncclComm_t comm;
	goddp_CUstream comm_stream;
	uintptr_t compute_stream; // a CUstream, used when wait_compute
	int wait_compute;
	goddp_CUevent start_event; // recorded on compute_stream when wait_compute
	uintptr_t out_stream;      // the output buffer's CUstream, used when wait_out
	int wait_out;
	goddp_CUevent out_event; // recorded on out_stream when wait_out
	goddp_CUevent end_event; // recorded on comm_stream after the collective
	int kind;
	goddp_CUdeviceptr send, recv;
	size_t count; // NCCL's count argument
	goddp_ncclDataType_t dtype;
	goddp_ncclRedOp_t op;
	int root;
	// Host staging: copy h2d_bytes from host+h2d_off to dev+h2d_off before, and d2h_bytes
	// from dev+d2h_off to host+d2h_off after the collective.
	void *host;
	goddp_CUdeviceptr dev;
	size_t h2d_off, h2d_bytes, d2h_off, d2h_bytes;
	// Out: which step failed and its result code.
	const char *failed_step;
	int failed_nccl; // 1 if the failing code is an ncclResult_t, 0 if a CUresult
	// Out: GODDP_WRONG_* when a device buffer or a stream belongs to another context than
	// ctx (goddp_issue then returns -1), and that context.
	int wrong;
	goddp_CUcontext wrong_ctx;
} goddp_call;

enum { GODDP_WRONG_COMPUTE_STREAM = 1, GODDP_WRONG_OUT_STREAM, GODDP_WRONG_SEND, GODDP_WRONG_RECV };

// Note [Communicator gate]: an int per group, shared by the issuer and the watchdog, and
// changed only atomically. goddp_issue sets GODDP_GATE_IN_CALL right before its NCCL call
// and clears it right after, and makes no NCCL call (returning GODDP_ISSUE_GATE_CLOSED)
// once GODDP_GATE_CLOSED is set; goddp_gate_close sets GODDP_GATE_CLOSED and returns the
// gate as it was, so the watchdog knows whether an issuer is inside NCCL when it aborts.
enum { GODDP_GATE_IN_CALL = 1, GODDP_GATE_CLOSED = 2 };
#define GODDP_ISSUE_GATE_CLOSED (-2)

int goddp_issue(goddp_lib *l, goddp_call *c, int *gate);
int goddp_gate_close(int *gate);
int goddp_gate_load(int *gate);

// Helpers that make ctx current on the calling thread for the call and then restore the
// caller's context (goroutines move between threads, the driver's current context is per
// thread, and the thread's context is the caller's: Note [Caller's context]).
goddp_CUresult goddp_ctx_enter(goddp_lib *l, goddp_CUcontext ctx, goddp_CUcontext *prev);
goddp_CUresult goddp_ctx_leave(goddp_lib *l, goddp_CUcontext prev);
goddp_CUresult goddp_event_create(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent *ev);
goddp_CUresult goddp_staging_alloc(goddp_lib *l, goddp_CUcontext ctx, void **host, goddp_CUdeviceptr *dev, size_t n);
goddp_ncclResult_t goddp_comm_finalize(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm);
int goddp_has_finalize(goddp_lib *l);
goddp_CUresult goddp_event_query(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent ev);
goddp_CUresult goddp_stream_sync(goddp_lib *l, goddp_CUcontext ctx, goddp_CUstream s);
goddp_CUresult goddp_stream_wait(goddp_lib *l, goddp_CUcontext ctx, uintptr_t stream, goddp_CUevent ev);
goddp_CUresult goddp_stream_sync_handle(goddp_lib *l, goddp_CUcontext ctx, uintptr_t s);
goddp_CUresult goddp_stream_destroy_handle(goddp_lib *l, uintptr_t s);
// goddp_copy_sync copies n bytes host→dev (h2d) or dev→host on stream s and waits for s.
goddp_CUresult goddp_copy_sync(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dev, void *host, size_t n, int h2d, uintptr_t s);
goddp_CUresult goddp_memset32(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dev, unsigned int v, size_t n, uintptr_t s);
goddp_ncclResult_t goddp_comm_destroy(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm);
goddp_ncclResult_t goddp_comm_abort(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t comm);
goddp_ncclResult_t goddp_comm_init(goddp_lib *l, goddp_CUcontext ctx, goddp_ncclComm_t *comm, int nranks, const void *id, int rank);
goddp_ncclResult_t goddp_get_unique_id(goddp_lib *l, void *id);
const char *goddp_cu_error(goddp_lib *l, goddp_CUresult r);
const char *goddp_nccl_error(goddp_lib *l, goddp_ncclResult_t r);
const char *goddp_nccl_last_error(goddp_lib *l, goddp_ncclComm_t comm);

// Device operations of procgroup.Device (devops.go): the kernels of kernels.ptx, launched
// with one thread per element in blocks of 256, and device-to-device copies.
goddp_CUresult goddp_module_load(goddp_lib *l, goddp_CUcontext ctx, const char *image, goddp_CUmodule *m);
goddp_CUresult goddp_module_function(goddp_lib *l, goddp_CUmodule m, const char *name, goddp_CUfunction *f);
goddp_CUresult goddp_launch_scale(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr dst,
				  goddp_CUdeviceptr src, unsigned long long n, double a, int add, int f64);
goddp_CUresult goddp_launch_convert(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr dst,
				    goddp_CUdeviceptr src, unsigned long long n);
goddp_CUresult goddp_copy_d2d(goddp_lib *l, goddp_CUcontext ctx, goddp_CUdeviceptr dst, goddp_CUdeviceptr src, size_t n, uintptr_t s);
goddp_CUresult goddp_event_record(goddp_lib *l, goddp_CUcontext ctx, uintptr_t ev, uintptr_t s);
goddp_CUresult goddp_stream_wait_handle(goddp_lib *l, goddp_CUcontext ctx, uintptr_t s, uintptr_t ev);
goddp_CUresult goddp_event_destroy_handle(goddp_lib *l, uintptr_t ev);
goddp_CUresult goddp_module_unload(goddp_lib *l, goddp_CUcontext ctx, goddp_CUmodule m);
goddp_CUresult goddp_event_create_timed(goddp_lib *l, goddp_CUcontext ctx, goddp_CUevent *ev, int timing);
goddp_CUresult goddp_event_elapsed(goddp_lib *l, goddp_CUcontext ctx, float *ms, uintptr_t a, uintptr_t b);

// ---- cuBLAS (cublas_api.h), loaded on first use by GemmAsync (blas.go) ----
typedef int goddp_cublasStatus_t; // 0 CUBLAS_STATUS_SUCCESS
typedef void *goddp_cublasHandle_t;

typedef struct goddp_blas {
	void *handle;
	goddp_cublasStatus_t (*cublasCreate_v2)(goddp_cublasHandle_t *);
	goddp_cublasStatus_t (*cublasDestroy_v2)(goddp_cublasHandle_t);
	goddp_cublasStatus_t (*cublasSetStream_v2)(goddp_cublasHandle_t, goddp_CUstream);
	// column-major; transa/transb: 0 CUBLAS_OP_N, 1 CUBLAS_OP_T
	goddp_cublasStatus_t (*cublasSgemm_v2)(goddp_cublasHandle_t, int, int, int, int, int, const float *, const float *, int,
					       const float *, int, const float *, float *, int);
} goddp_blas;

// goddp_blas_load opens the first of the colon-separated paths that loads and resolves
// cuBLAS's symbols; NULL (and why, in err) if none does.
goddp_blas *goddp_blas_load(const char *paths, char *err, size_t errlen);
// The cuBLAS calls, each with ctx current for its duration: the return value is a CUresult
// of the context switch (0 if none failed), *st the cuBLAS status.
goddp_CUresult goddp_blas_create(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t *h, goddp_cublasStatus_t *st);
goddp_CUresult goddp_blas_destroy(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t h, goddp_cublasStatus_t *st);
// goddp_blas_sgemm sets h's stream to s, then enqueues the SGEMM on it (host pointer mode:
// alpha and beta are read during the call).
goddp_CUresult goddp_blas_sgemm(goddp_lib *l, goddp_CUcontext ctx, goddp_blas *b, goddp_cublasHandle_t h, uintptr_t s, int ta, int tb,
				int m, int n, int k, float alpha, goddp_CUdeviceptr a, int lda, goddp_CUdeviceptr bm, int ldb, float beta,
				goddp_CUdeviceptr c, int ldc, goddp_cublasStatus_t *st);
// goddp_launch_orth launches the single-thread kernel goddp_orth_f32 (one block of one
// thread) on a rows×cols column-major matrix.
goddp_CUresult goddp_launch_orth(goddp_lib *l, goddp_CUcontext ctx, goddp_CUfunction f, uintptr_t s, goddp_CUdeviceptr a,
				 unsigned long long rows, unsigned int cols, unsigned long long seed);

// goddp_fake_knob calls fake_knob(name, value) in either library, if it exports it (the
// fake libraries of the tests do; the real ones do not: then it returns -1).
long long goddp_fake_knob(goddp_lib *l, const char *name, long long value);

#endif

// Thin trampolines: cgo cannot call through C function pointers, so each pointer of the
// table the Go side calls directly has one (the caller makes the context current first,
// on a locked OS thread: Group.onDevice).
goddp_CUresult goddp_cuInit(goddp_lib *l);
goddp_CUresult goddp_cuDriverGetVersion(goddp_lib *l, int *v);
goddp_CUresult goddp_cuDeviceGetCount(goddp_lib *l, int *n);
goddp_CUresult goddp_cuDeviceGet(goddp_lib *l, goddp_CUdevice *d, int ordinal);
goddp_CUresult goddp_cuDeviceGetName(goddp_lib *l, char *name, int len, goddp_CUdevice d);
goddp_CUresult goddp_cuDevicePrimaryCtxRetain(goddp_lib *l, goddp_CUcontext *ctx, goddp_CUdevice d);
goddp_CUresult goddp_cuDevicePrimaryCtxRelease(goddp_lib *l, goddp_CUdevice d);
goddp_CUresult goddp_cuCtxSetCurrent(goddp_lib *l, goddp_CUcontext ctx);
goddp_CUresult goddp_cuStreamCreate(goddp_lib *l, goddp_CUstream *s, unsigned int flags);
goddp_CUresult goddp_cuStreamDestroy(goddp_lib *l, goddp_CUstream s);
goddp_CUresult goddp_cuStreamWaitEvent(goddp_lib *l, goddp_CUstream s, goddp_CUevent ev);
goddp_CUresult goddp_cuEventCreate(goddp_lib *l, goddp_CUevent *ev);
goddp_CUresult goddp_cuEventDestroy(goddp_lib *l, goddp_CUevent ev);
goddp_CUresult goddp_cuMemAlloc(goddp_lib *l, goddp_CUdeviceptr *p, size_t n);
goddp_CUresult goddp_cuMemFree(goddp_lib *l, goddp_CUdeviceptr p);
goddp_CUresult goddp_cuMemHostAlloc(goddp_lib *l, void **p, size_t n);
goddp_CUresult goddp_cuMemFreeHost(goddp_lib *l, void *p);
goddp_CUresult goddp_cuMemcpyHtoDAsync(goddp_lib *l, goddp_CUdeviceptr dst, const void *src, size_t n, goddp_CUstream s);
goddp_CUresult goddp_cuMemcpyDtoHAsync(goddp_lib *l, void *dst, goddp_CUdeviceptr src, size_t n, goddp_CUstream s);
goddp_CUresult goddp_cuMemsetD32Async(goddp_lib *l, goddp_CUdeviceptr dst, unsigned int v, size_t n, goddp_CUstream s);
goddp_ncclResult_t goddp_ncclGetVersion(goddp_lib *l, int *v);
goddp_ncclResult_t goddp_ncclCommDestroy(goddp_lib *l, goddp_ncclComm_t c);
goddp_ncclResult_t goddp_ncclCommAbort(goddp_lib *l, goddp_ncclComm_t c);
goddp_ncclResult_t goddp_ncclCommGetAsyncError(goddp_lib *l, goddp_ncclComm_t c, goddp_ncclResult_t *r);
