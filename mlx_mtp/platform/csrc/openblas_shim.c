/* Shim: route MLX's cblas_{s,d,c}gemm to numpy's bundled OpenBLAS.
 *
 * Why: the mlx[cpu] Linux wheel links a bundled *reference* BLAS, whose GEMM costs ~M times a
 * matrix-vector product for an M-row input, which defeats speculative decoding and batching.
 * numpy's wheel already ships an optimised OpenBLAS (ILP64, symbols prefixed "scipy_" and
 * suffixed "64_"). Loading this file with RTLD_GLOBAL before libmlx (or preloading it) makes
 * libmlx's cblas_* references bind here, and we forward them to that OpenBLAS, widening the int
 * dimensions to 64 bits.
 *
 * Thin kernel: a float32 product of 1..8 rows (or columns) whose weight shape was measured
 * fastest there (platform/gemv_limits.py), or whose weight has thin_min_elems elements or more,
 * runs on the shim's own kernel (thin_kernel.c, sgemm_thin): the weight is read once for all
 * rows, and each row is bit-identical whatever the row count. The routes below take the rest.
 *
 * Routing: a float32 product of at most `gemv_rows` rows or columns (decoding one token,
 * verifying one or two drafts) runs as one OpenBLAS sgemv per row (column) of C (see
 * sgemm_as_gemv, mlx_mtp_shim_set_gemv_rows). Other multi-row products (verify passes, batches,
 * prompts) go to OpenBLAS's gemm (mlx_mtp_shim_configure). A product with fewer than `min_rows`
 * rows or columns that is not run as sgemv (float64, complex, or gemv_rows = 0) goes to OpenBLAS
 * too, unless it is x @ W with a weight of `small_elems` elements or more: in that one layout the
 * reference BLAS's simple loop streams memory about as fast as OpenBLAS's gemm for a single row
 * (see route_openblas). use_openblas = 0 sends everything to the reference BLAS (e.g. after a
 * failed check) without restarting the process.
 *
 * Row padding: OpenBLAS products of 2..64 rows that are not a multiple of four run on a copy
 * padded with zero rows to the next multiple (see sgemm_padded), which is faster here.
 *
 * Safety: the OpenBLAS path comes from $MLX_MTP_OPENBLAS. If it is unset, cannot be loaded, or
 * lacks any of the three gemm symbols, every call goes to the next definition of the same cblas_*
 * symbol (the reference BLAS), so preloading this can change speed but never break MLX; without
 * sgemv, thin products take the gemm routes.
 * mlx_mtp_shim_uses_openblas() lets the Python side ask which path was taken.
 *
 * OpenBLAS threads: $MLX_MTP_OPENBLAS_THREADS (default 1: MLX runs its own threads, and
 * decode-sized GEMMs are memory bound; spinning OpenBLAS threads measured ~30x slower on a
 * busy 2-core machine).
 *
 * Build: cc -O3 -march=native -fopenmp -shared -fPIC -o openblas-shim.so openblas_shim.c -ldl
 * -lpthread (without -march=native and/or -fopenmp where the compiler lacks them: blas.py)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef void (*sgemm64_fn)(int, int, int, i64, i64, i64, float, const float *, i64,
                           const float *, i64, float, float *, i64);
typedef void (*dgemm64_fn)(int, int, int, i64, i64, i64, double, const double *, i64,
                           const double *, i64, double, double *, i64);
typedef void (*cgemm64_fn)(int, int, int, i64, i64, i64, const void *, const void *, i64,
                           const void *, i64, const void *, void *, i64);
typedef void (*sgemv64_fn)(int, int, i64, i64, float, const float *, i64, const float *, i64,
                           float, float *, i64);
typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);
typedef void (*dgemm_fn)(int, int, int, int, int, int, double, const double *, int,
                         const double *, int, double, double *, int);
typedef void (*cgemm_fn)(int, int, int, int, int, int, const void *, const void *, int,
                         const void *, int, const void *, void *, int);

void cblas_sgemm(int, int, int, int, int, int, float, const float *, int, const float *, int,
                 float, float *, int);
void cblas_dgemm(int, int, int, int, int, int, double, const double *, int, const double *, int,
                 double, double *, int);
void cblas_cgemm(int, int, int, int, int, int, const void *, const void *, int, const void *,
                 int, const void *, void *, int);

/* ---- OpenBLAS: resolved once, all three symbols or none ---- */
static pthread_once_t openblas_once = PTHREAD_ONCE_INIT;
static sgemm64_fn ob_sgemm;
static dgemm64_fn ob_dgemm;
static cgemm64_fn ob_cgemm;
static sgemv64_fn ob_sgemv; /* optional: without it thin products take the sgemm routes */
static volatile int use_openblas = 1;
static volatile long min_rows = 2;
static volatile long small_elems = 1300000L;
static int thin_threads = 1; /* threads of the thin-product kernel: OpenBLAS's count */

static void load_openblas(void) {
  const char *path = getenv("MLX_MTP_OPENBLAS");
  void *h = (path && *path) ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : NULL;
  if (!h) return;
  sgemm64_fn s = (sgemm64_fn)dlsym(h, "scipy_cblas_sgemm64_");
  dgemm64_fn d = (dgemm64_fn)dlsym(h, "scipy_cblas_dgemm64_");
  cgemm64_fn c = (cgemm64_fn)dlsym(h, "scipy_cblas_cgemm64_");
  if (s && d && c) {
    ob_sgemm = s;
    ob_dgemm = d;
    ob_cgemm = c;
    ob_sgemv = (sgemv64_fn)dlsym(h, "scipy_cblas_sgemv64_");
    typedef void (*threads_fn)(int);
    threads_fn set_threads = (threads_fn)dlsym(h, "scipy_openblas_set_num_threads64_");
    const char *t = getenv("MLX_MTP_OPENBLAS_THREADS");
    int threads = t && *t ? atoi(t) : 1;
    if (set_threads) set_threads(threads);
    thin_threads = threads > 1 ? threads : 1; /* the thin-product kernel's (see sgemm_thin) */
  }
}

/* use: 0 = every product on the reference BLAS; rows: smallest M and N always sent to
 * OpenBLAS; small: thinner products go to OpenBLAS while K * max(M, N) stays below this. */
void mlx_mtp_shim_configure(int use, long rows, long small) {
  use_openblas = use;
  min_rows = rows < 1 ? 1 : rows;
  small_elems = small;
}

int mlx_mtp_shim_uses_openblas(void) {
  pthread_once(&openblas_once, load_openblas);
  return ob_sgemm != NULL && use_openblas;
}

/* Thin products (decoding one token) go to OpenBLAS, except one layout: x @ W with W stored
 * (k, n) row-major, one axpy per input element, where the reference BLAS streams a large weight as
 * fast or faster. Measured single-row, interleaved (benchmarks/blas_routing.py): for x @ W.T (every
 * linear layer and tied output head) the reference BLAS is 1.3-1.9x slower at every size from 0.3M
 * to 17M elements, and for W.T @ x.T about 8x slower. */
static int thin_axpy_layout(int order, int tb, int m) {
  return m < min_rows && (tb == 111) == (order == 101); /* CblasNoTrans, CblasRowMajor */
}

static int route_openblas(int order, int tb, int m, int n, int k) {
  if (!mlx_mtp_shim_uses_openblas()) return 0;
  if (m >= min_rows && n >= min_rows) return 1;
  if (!thin_axpy_layout(order, tb, m)) return 1;
  return (long)k * (m > n ? m : n) < small_elems;
}

/* ---- Fallback: the next definition of the same symbol ----
 * Resolved lazily, on the first call, because the reference BLAS is only loaded together with
 * libmlx. RTLD_NEXT only searches the global scope, and Python loads extension modules (and so
 * libmlx's libblas) with RTLD_LOCAL, so we also look through every loaded object. */
#define MAX_OBJECTS 1024
struct names { int n; char *v[MAX_OBJECTS]; };

static int collect_name(struct dl_phdr_info *info, size_t size, void *data) {
  struct names *names = data;
  (void)size;
  if (info->dlpi_name && *info->dlpi_name && names->n < MAX_OBJECTS)
    names->v[names->n++] = strdup(info->dlpi_name);
  return 0;
}

static void *find_next(const char *sym, void *self) {
  void *p = dlsym(RTLD_NEXT, sym);
  if (p && p != self) return p;
  struct names names = {0};
  dl_iterate_phdr(collect_name, &names); /* dlopen is not called under its lock */
  p = NULL;
  for (int i = 0; i < names.n; i++) {
    if (!p) {
      void *h = dlopen(names.v[i], RTLD_LAZY | RTLD_NOLOAD);
      if (h) {
        void *q = dlsym(h, sym);
        if (q && q != self) p = q;
        dlclose(h);
      }
    }
    free(names.v[i]);
  }
  if (!p) {
    fprintf(stderr, "mlx-mtp openblas shim: no BLAS provides %s\n", sym);
    abort();
  }
  return p;
}

static pthread_once_t ref_once = PTHREAD_ONCE_INIT;
static sgemm_fn ref_sgemm;
static dgemm_fn ref_dgemm;
static cgemm_fn ref_cgemm;

static void load_reference(void) {
  ref_sgemm = (sgemm_fn)find_next("cblas_sgemm", (void *)cblas_sgemm);
  ref_dgemm = (dgemm_fn)find_next("cblas_dgemm", (void *)cblas_dgemm);
  ref_cgemm = (cgemm_fn)find_next("cblas_cgemm", (void *)cblas_cgemm);
}

/* ---- Row padding ----
 * OpenBLAS's float32 kernels take rows four at a time; a remainder of 1-3 rows runs an edge path
 * that costs about as much as four more rows (one 4096x384 weight, x @ W.T: M=2 370 us, M=3
 * 510 us, M=4 324 us; M=9 599 us, M=12 533 us). Verify passes (K+1 rows) and small batches are
 * exactly such products, so a row-major product of 2..PAD_MAX_ROWS rows that is not a multiple of
 * four runs on a copy of A padded with zero rows; the extra rows of C are dropped. */
#define PAD_MAX_ROWS 64
#define SCRATCH_KEEP ((size_t)4 << 20) /* floats kept between calls (16 MB) */
static volatile int pad_rows = 1;
static volatile long padded_calls = 0;
static __thread float *scratch;
static __thread size_t scratch_len;

void mlx_mtp_shim_set_padding(int on) { pad_rows = on; }
long mlx_mtp_shim_padded_calls(void) { return padded_calls; }

static int sgemm_padded(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                        const float *b, int ldb, float beta, float *c, int ldc) {
  int mp = (m + 3) & ~3;
  size_t need = (size_t)mp * ((size_t)k + (size_t)n);
  if (need > scratch_len) {
    float *grown = realloc(scratch, need * sizeof(float));
    if (!grown) return 0;
    scratch = grown;
    scratch_len = need;
  }
  float *ap = scratch, *cp = scratch + (size_t)mp * k;  /* A as mp x k, C as mp x n */
  for (int i = 0; i < m; i++) {
    if (ta == 111)  /* CblasNoTrans: row i of A is contiguous */
      memcpy(ap + (size_t)i * k, a + (size_t)i * lda, (size_t)k * sizeof(float));
    else
      for (int l = 0; l < k; l++) ap[(size_t)i * k + l] = a[(size_t)l * lda + i];
  }
  memset(ap + (size_t)m * k, 0, (size_t)(mp - m) * k * sizeof(float));
  for (int i = 0; i < m; i++)  /* beta may be nonzero: C is an input too */
    memcpy(cp + (size_t)i * n, c + (size_t)i * ldc, (size_t)n * sizeof(float));
  memset(cp + (size_t)m * n, 0, (size_t)(mp - m) * n * sizeof(float));
  ob_sgemm(101, 111, tb, mp, n, k, alpha, ap, k, b, ldb, beta, cp, n);
  for (int i = 0; i < m; i++)
    memcpy(c + (size_t)i * ldc, cp + (size_t)i * n, (size_t)n * sizeof(float));
  if (scratch_len > SCRATCH_KEEP) {  /* a large output layer: do not hold its copy */
    free(scratch);
    scratch = NULL;
    scratch_len = 0;
  }
  __sync_fetch_and_add(&padded_calls, 1);
  return 1;
}

/* ---- Thin products as matrix-vector products ----
 * OpenBLAS's sgemm copies B into packed panels first, which for one to three rows costs more than
 * the product: one row times a 4096x1024 weight takes ~0.6 ms as an sgemv and ~2.2 ms as an
 * sgemm (or on the reference BLAS), in either layout; each further row costs one more sgemv, and
 * from four rows on sgemm wins. So a product with at most `gemv_rows` rows runs as one sgemv per
 * row of C, one with at most `gemv_rows` columns as one sgemv per column (per weight shape:
 * gemv_limit). */
static volatile long gemv_rows = 3;
static volatile long gemv_calls = 0;

void mlx_mtp_shim_set_gemv_rows(long rows) { gemv_rows = rows; }
long mlx_mtp_shim_gemv_rows(void) { return ob_sgemv ? gemv_rows : 0; }
long mlx_mtp_shim_gemv_calls(void) { return gemv_calls; }

/* Where sgemv stops paying depends on the weight: one that stays in the caches is re-read
 * cheaply by each row's sgemv (a 384x768 weight: eight sgemv beat one 8-row sgemm), one that
 * streams from memory is read once per row (1024x4096: sgemm wins from four rows). So a weight
 * shape (k inputs, n outputs) may carry its own limit, measured by platform/gemv_limits.py;
 * other shapes use gemv_rows. Entries are written before the count that publishes them. */
#define GEMV_SHAPES 64
static volatile long shape_k[GEMV_SHAPES], shape_n[GEMV_SHAPES], shape_rows[GEMV_SHAPES];
static volatile long shape_thin[GEMV_SHAPES]; /* rows on the thin kernel (bit m-1), -1: unset */
static volatile int shapes_known = 0;
static volatile int shape_limits_on = 1;

int mlx_mtp_shim_set_gemv_shape(long k, long n, long rows) {
  for (int i = 0; i < shapes_known; i++)
    if (shape_k[i] == k && shape_n[i] == n) { shape_rows[i] = rows; return 1; }
  if (shapes_known >= GEMV_SHAPES) return 0;
  shape_k[shapes_known] = k;
  shape_n[shapes_known] = n;
  shape_rows[shapes_known] = rows;
  shape_thin[shapes_known] = -1;
  __sync_synchronize();
  shapes_known++;
  return 1;
}

void mlx_mtp_shim_use_shape_limits(int on) { shape_limits_on = on; }

/* The row counts (bit m - 1 for m rows) of a weight shape that run on the thin kernel. */
int mlx_mtp_shim_set_thin_shape(long k, long n, long mask) {
  for (int i = 0; i < shapes_known; i++)
    if (shape_k[i] == k && shape_n[i] == n) { shape_thin[i] = mask; return 1; }
  return 0;
}

static long shape_thin_mask(long k, long n) {
  if (shape_limits_on)
    for (int i = 0; i < shapes_known; i++)
      if (shape_k[i] == k && shape_n[i] == n) return shape_thin[i];
  return -1;
}

/* Rows (of a product with k inputs and n outputs) that still run as sgemv. */
static long gemv_limit(long k, long n) {
  if (shape_limits_on)
    for (int i = 0; i < shapes_known; i++)
      if (shape_k[i] == k && shape_n[i] == n) return shape_rows[i];
  return gemv_rows;
}

long mlx_mtp_shim_gemv_limit(long k, long n) { return ob_sgemv ? gemv_limit(k, n) : 0; }

/* y (len elements, stride inc) = 0 where beta is 0: gemm then ignores C's old contents (MLX
 * passes uninitialised memory), while sgemv would scale it, and 0 * NaN is NaN. */
static void zero_if_no_beta(float beta, float *y, i64 len, i64 inc) {
  if (beta != 0.0f) return;
  if (inc == 1) memset(y, 0, (size_t)len * sizeof(float));
  else for (i64 i = 0; i < len; i++) y[i * inc] = 0.0f;
}

/* C = alpha op(A) op(B) + beta C, row-major C (m x n), op(A) (m x k), op(B) (k x n). */
static int sgemm_as_gemv(int order, int ta, int tb, int m, int n, int k, float alpha,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc) {
  if (!ob_sgemv || m < 1 || n < 1 || k < 1) return 0;
  if (order == 102) /* column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T */
    return sgemm_as_gemv(101, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
  if (order != 101) return 0;
  int by_rows = m <= gemv_limit(k, n);
  if (!by_rows && n > gemv_limit(k, m)) return 0;
  int at = ta != 111, bt = tb != 111; /* Trans or ConjTrans (the same for real matrices) */
  if (by_rows) {
    for (i64 i = 0; i < m; i++) { /* row i of C = op(B)^T (row i of op(A)) */
      float *y = c + i * ldc;
      const float *x = at ? a + i : a + i * lda;
      zero_if_no_beta(beta, y, n, 1);
      if (bt) ob_sgemv(101, 111, n, k, alpha, b, ldb, x, at ? lda : 1, beta, y, 1);
      else ob_sgemv(101, 112, k, n, alpha, b, ldb, x, at ? lda : 1, beta, y, 1);
    }
  } else {
    for (i64 j = 0; j < n; j++) { /* column j of C = op(A) (column j of op(B)) */
      float *y = c + j;
      const float *x = bt ? b + j * ldb : b + j;
      zero_if_no_beta(beta, y, m, ldc);
      if (at) ob_sgemv(101, 112, k, m, alpha, a, lda, x, bt ? 1 : ldb, beta, y, ldc);
      else ob_sgemv(101, 111, m, k, alpha, a, lda, x, bt ? 1 : ldb, beta, y, ldc);
    }
  }
  __sync_fetch_and_add(&gemv_calls, 1);
  return 1;
}

#include "thin_kernel.c" /* sgemm_thin: products of 1..8 rows, the weight read once */

/* ---- The exported cblas entry points (standard signatures, int dimensions) ---- */
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  if (mlx_mtp_shim_uses_openblas() && m > 0 && n > 0 && k > 0 &&
      (order == 101 ? sgemm_thin(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
       : order == 102 && sgemm_thin(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc)))
    return;
  if (mlx_mtp_shim_uses_openblas() &&
      sgemm_as_gemv(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
    return;
  if (route_openblas(order, tb, m, n, k)) {
    if (pad_rows && order == 101 && m >= 2 && m <= PAD_MAX_ROWS && m % 4 &&
        sgemm_padded(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc))
      return;
    ob_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  pthread_once(&ref_once, load_reference);
  ref_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                 int lda, const double *b, int ldb, double beta, double *c, int ldc) {
  if (route_openblas(order, tb, m, n, k)) {
    ob_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  pthread_once(&ref_once, load_reference);
  ref_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c,
                 int ldc) {
  if (route_openblas(order, tb, m, n, k)) {
    ob_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  pthread_once(&ref_once, load_reference);
  ref_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
