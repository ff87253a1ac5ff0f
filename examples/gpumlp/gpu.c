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

gm_lib *gm_load(const char *cuda_path, char *err, size_t errlen) {
	gm_lib *l = calloc(1, sizeof *l);
	if (!l) {
		snprintf(err, errlen, "out of memory");
		return NULL;
	}
	l->cuda = dlopen(cuda_path, RTLD_NOW | RTLD_GLOBAL);
	if (!l->cuda) {
		const char *e = dlerror();
		snprintf(err, errlen, "the CUDA driver %s: %s", cuda_path, e ? e : "dlopen failed");
		goto fail;
	}
	SYM(l->cuda, cuDeviceGet);
	SYM(l->cuda, cuDevicePrimaryCtxRetain);
	SYM(l->cuda, cuCtxSetCurrent);
	SYM(l->cuda, cuModuleLoadData);
	SYM(l->cuda, cuModuleGetFunction);
	SYM(l->cuda, cuLaunchKernel);
	return l;
fail:
	if (l->cuda) dlclose(l->cuda);
	free(l);
	return NULL;
}

// The nccl group has called cuInit already, in the same process and library.
int gm_context(gm_lib *l, int ordinal, void **ctx) {
	int dev = 0;
	int r = l->cuDeviceGet(&dev, ordinal);
	if (r) return r;
	r = l->cuDevicePrimaryCtxRetain(ctx, dev);
	return r ? r : l->cuCtxSetCurrent(*ctx);
}

int gm_module(gm_lib *l, void *ctx, const char *ptx, void **module) {
	int r = l->cuCtxSetCurrent(ctx);
	return r ? r : l->cuModuleLoadData(module, ptx);
}

int gm_function(gm_lib *l, void *module, const char *name, void **fn) { return l->cuModuleGetFunction(fn, module, name); }

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
