// fakecublas.c: a fake cuBLAS (libcublas.so) for the tests of examples/gpumlp and of
// backends/nccl's GemmAsync (PowerSGD on device buckets): the four entry points they use. cublasSgemm_v2 is a column-major SGEMM on "device"
// memory (host memory in the fake driver), run in stream order on the handle's stream
// through the fake driver's queue. Scalars are read from host pointers at call time
// (CUBLAS_POINTER_MODE_HOST, the default), as cuBLAS does.
#include <stdlib.h>

int fakecuda_enqueue(void *stream, void (*fn)(void *), void *arg);
int fakecuda_ctx_sync(void);
void fakecuda_blas_handles(int delta);

typedef int cublasStatus_t; // 0 CUBLAS_STATUS_SUCCESS, 7 CUBLAS_STATUS_INVALID_VALUE
enum { OK = 0, NOT_INITIALIZED = 1, INVALID_VALUE = 7 };
enum { OP_N = 0, OP_T = 1 };

typedef struct handle {
	void *stream;
} handle;

cublasStatus_t cublasCreate_v2(handle **h) {
	*h = calloc(1, sizeof **h);
	if (!*h) return NOT_INITIALIZED;
	fakecuda_blas_handles(1);
	return OK;
}
// cublasDestroy_v2 synchronises the device first (cudaDeviceSynchronize), as the real one
// does: it returns once every stream of the current context has run its work.
cublasStatus_t cublasDestroy_v2(handle *h) {
	if (fakecuda_ctx_sync()) return NOT_INITIALIZED;
	free(h);
	fakecuda_blas_handles(-1);
	return OK;
}
cublasStatus_t cublasSetStream_v2(handle *h, void *s) {
	if (!h) return NOT_INITIALIZED;
	h->stream = s;
	return OK;
}

typedef struct {
	int ta, tb, m, n, k, lda, ldb, ldc;
	float alpha, beta;
	const float *a, *b;
	float *c;
} gemm;

static void gemm_fn(void *p) {
	gemm *g = p;
	for (int j = 0; j < g->n; j++)
		for (int i = 0; i < g->m; i++) {
			float acc = 0;
			for (int l = 0; l < g->k; l++) {
				float x = g->ta ? g->a[l + i * g->lda] : g->a[i + l * g->lda];
				float y = g->tb ? g->b[j + l * g->ldb] : g->b[l + j * g->ldb];
				acc += x * y;
			}
			float *c = &g->c[i + j * g->ldc];
			*c = g->beta == 0 ? g->alpha * acc : g->alpha * acc + g->beta * *c;
		}
	free(g);
}

cublasStatus_t cublasSgemm_v2(handle *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *a, int lda,
			      const float *b, int ldb, const float *beta, float *c, int ldc) {
	if (!h) return NOT_INITIALIZED;
	if ((ta != OP_N && ta != OP_T) || (tb != OP_N && tb != OP_T) || m < 0 || n < 0 || k < 0) return INVALID_VALUE;
	if (lda < (ta ? (k > 1 ? k : 1) : (m > 1 ? m : 1)) || ldb < (tb ? (n > 1 ? n : 1) : (k > 1 ? k : 1)) || ldc < (m > 1 ? m : 1))
		return INVALID_VALUE;
	gemm *g = malloc(sizeof *g);
	*g = (gemm){ta, tb, m, n, k, lda, ldb, ldc, *alpha, *beta, a, b, c};
	if (fakecuda_enqueue(h->stream, gemm_fn, g)) { // no current context, or the stream is another's
		free(g);
		return 14; // CUBLAS_STATUS_INTERNAL_ERROR
	}
	return OK;
}
