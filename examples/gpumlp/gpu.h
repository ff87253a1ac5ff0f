// gpu.h: what examples/gpumlp calls in the CUDA driver (libcuda.so.1: its kernels), loaded
// with dlopen like backends/nccl does. SGEMM is the nccl group's (procgroup.DeviceBLAS).
#ifndef GPUMLP_GPU_H
#define GPUMLP_GPU_H
#include <stddef.h>
#include <stdint.h>

typedef struct gm_lib {
	void *cuda;
	int (*cuDeviceGet)(int *, int);
	int (*cuDevicePrimaryCtxRetain)(void **, int);
	int (*cuCtxSetCurrent)(void *);
	int (*cuModuleLoadData)(void **, const void *);
	int (*cuModuleGetFunction)(void **, void *, const char *);
	int (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);
} gm_lib;

gm_lib *gm_load(const char *cuda_path, char *err, size_t errlen);
int gm_context(gm_lib *l, int device, void **ctx);
int gm_module(gm_lib *l, void *ctx, const char *ptx, void **module);
int gm_function(gm_lib *l, void *module, const char *name, void **fn);
// gm_launch launches fn over threads threads (blocks of 256) on stream with nu 64-bit
// arguments u[0..nu) followed, if hasf, by one float f.
int gm_launch(gm_lib *l, void *ctx, void *fn, uintptr_t stream, unsigned long long threads, unsigned long long *u, int nu, float f,
	      int hasf);
#endif
