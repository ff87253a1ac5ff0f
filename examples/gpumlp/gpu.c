// gpu.c: see gpu.h.
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

#define SYM(h, field)                                                             \
	do {                                                                      \
		*(void **)(&l->field) = dlsym(h, #field);                         \
		if (!l->field) {                                                  \
			snprintf(err, errlen, "symbol %s not found", #field);     \
			goto fail;                                                \
		}                                                                 \
	} while (0)

// cublas_paths: a colon-separated list, tried in order.
gm_lib *gm_load(const char *cuda_path, const char *cublas_paths, char *err, size_t errlen) {
	gm_lib *l = calloc(1, sizeof *l);
	l->cuda = dlopen(cuda_path, RTLD_NOW | RTLD_GLOBAL);
	if (!l->cuda) {
		snprintf(err, errlen, "the CUDA driver %s: %s", cuda_path, dlerror());
		goto fail;
	}
	SYM(l->cuda, cuDevicePrimaryCtxRetain);
	SYM(l->cuda, cuCtxSetCurrent);
	SYM(l->cuda, cuModuleLoadData);
	SYM(l->cuda, cuModuleGetFunction);
	SYM(l->cuda, cuLaunchKernel);
	char *paths = strdup(cublas_paths), *save = NULL;
	err[0] = 0;
	for (char *p = strtok_r(paths, ":", &save); p && !l->cublas; p = strtok_r(NULL, ":", &save)) {
		l->cublas = dlopen(p, RTLD_NOW | RTLD_LOCAL);
		if (!l->cublas) {
			size_t used = strlen(err);
			snprintf(err + used, errlen - used, "%s%s", used ? "; " : "", dlerror());
		}
	}
	free(paths);
	if (!l->cublas) goto fail;
	SYM(l->cublas, cublasCreate_v2);
	SYM(l->cublas, cublasDestroy_v2);
	SYM(l->cublas, cublasSetStream_v2);
	SYM(l->cublas, cublasSgemm_v2);
	return l;
fail:
	free(l);
	return NULL;
}

int gm_context(gm_lib *l, int device, void **ctx) {
	int r = l->cuDevicePrimaryCtxRetain(ctx, device);
	return r ? r : l->cuCtxSetCurrent(*ctx);
}

int gm_module(gm_lib *l, void *ctx, const char *ptx, void **module) {
	int r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuModuleLoadData(module, ptx);
}

int gm_function(gm_lib *l, void *module, const char *name, void **fn) { return l->cuModuleGetFunction(fn, module, name); }

int gm_cublas(gm_lib *l, void *ctx, uintptr_t stream, void **handle) {
	int r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	if ((r = l->cublasCreate_v2(handle))) return 100000 + r;
	if ((r = l->cublasSetStream_v2(*handle, (void *)stream))) return 100000 + r;
	return 0;
}

int gm_cublas_destroy(gm_lib *l, void *ctx, void *handle) {
	l->cuCtxSetCurrent(ctx);
	return l->cublasDestroy_v2(handle);
}

int gm_sgemm(gm_lib *l, void *ctx, void *handle, int ta, int tb, int m, int n, int k, float alpha, uintptr_t a, int lda, uintptr_t b,
	     int ldb, float beta, uintptr_t c, int ldc) {
	int r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	r = l->cublasSgemm_v2(handle, ta, tb, m, n, k, &alpha, (const float *)a, lda, (const float *)b, ldb, &beta, (float *)c, ldc);
	return r ? 100000 + r : 0;
}

int gm_launch(gm_lib *l, void *ctx, void *fn, uintptr_t stream, unsigned long long threads, unsigned long long *u, int nu, float f,
	      int hasf) {
	int r = l->cuCtxSetCurrent(ctx);
	if (r) return r;
	if (threads == 0) return 0;
	void *params[8];
	for (int i = 0; i < nu && i < 7; i++) params[i] = &u[i];
	if (hasf) params[nu] = &f;
	unsigned long long grid = (threads + 255) / 256;
	return l->cuLaunchKernel(fn, (unsigned)grid, 1, 1, 256, 1, 1, 0, (void *)stream, params, NULL);
}
