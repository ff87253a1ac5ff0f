// gpu.h: what examples/gpumlp calls in the CUDA driver (libcuda.so.1: its kernels) and in
// cuBLAS (libcublas.so: SGEMM), loaded with dlopen like backends/nccl does.
#ifndef GPUMLP_GPU_H
#define GPUMLP_GPU_H
#include <stddef.h>
#include <stdint.h>

typedef struct gm_lib {
	void *cuda, *cublas;
	int (*cuDevicePrimaryCtxRetain)(void **, int);
	int (*cuCtxSetCurrent)(void *);
	int (*cuModuleLoadData)(void **, const void *);
	int (*cuModuleGetFunction)(void **, void *, const char *);
	int (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
	int (*cublasCreate_v2)(void **);
	int (*cublasDestroy_v2)(void *);
	int (*cublasSetStream_v2)(void *, void *);
	int (*cublasSgemm_v2)(void *, int, int, int, int, int, const float *, const float *, int, const float *, int, const float *,
			      float *, int);
} gm_lib;

gm_lib *gm_load(const char *cuda_path, const char *cublas_paths, char *err, size_t errlen);
int gm_context(gm_lib *l, int device, void **ctx);
int gm_module(gm_lib *l, void *ctx, const char *ptx, void **module);
int gm_function(gm_lib *l, void *module, const char *name, void **fn);
int gm_cublas(gm_lib *l, void *ctx, uintptr_t stream, void **handle);
int gm_cublas_destroy(gm_lib *l, void *ctx, void *handle);
int gm_sgemm(gm_lib *l, void *ctx, void *handle, int ta, int tb, int m, int n, int k, float alpha, uintptr_t a, int lda, uintptr_t b,
	     int ldb, float beta, uintptr_t c, int ldc);
// gm_launch launches fn over threads threads (blocks of 256) on stream with nu 64-bit
// arguments u[0..nu) followed, if hasf, by one float f.
int gm_launch(gm_lib *l, void *ctx, void *fn, uintptr_t stream, unsigned long long threads, unsigned long long *u, int nu, float f,
	      int hasf);
#endif
