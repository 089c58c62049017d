/* The thin-product kernel of openblas_shim.c (included there, after the shape table; built
 * with it: the build hashes every csrc/*.c). */
/* ---- Thin products that read the weight once ----
 * sgemv reads the weight once per row and sgemm packs all of it every call (one thread, a
 * 1024x4096 weight: 0.69 ms per sgemv row, ~2.4 ms per sgemm at any row count 1-8), while a
 * product of a few rows is bounded by reading the weight from memory. So a product of 1..8 rows
 * (THIN_MAX_ROWS) runs here: each block of the weight is loaded once into registers and
 * multiplied into every row (FMA, vectorised by the compiler for the machine it was built on).
 * Every output element is summed in one fixed order that depends on K alone (per SIMD lane
 * along K, then a fixed tree over the lanes, then the scalar tail; or along K for the W-stored-
 * (K, N) layout), never on the row count or the block shapes, so a row of a verify pass is
 * bit-identical to the same row computed alone by a plain step. Blocks of outputs are split
 * over the OpenBLAS thread count ($MLX_MTP_OPENBLAS_THREADS, default 1). Which row counts of a
 * weight shape run here is measured per machine (platform/gemv_limits.py: thin masks). */
#define THIN_MAX_ROWS 8
#define VL 16
typedef float vf __attribute__((vector_size(VL * sizeof(float)), aligned(sizeof(float))));

static volatile int thin_on = 1;           /* 0: never ($MLX_MTP_BLAS_THIN=0) */
static volatile int thin_forced = 0;       /* 1: every product of 1..8 rows (bench route) */
static volatile long thin_min_elems = 4L << 20; /* unmeasured weights this large run here */
static volatile long thin_calls = 0;

void mlx_mtp_shim_set_thin(int on, int forced, long min_elems) {
  thin_on = on;
  thin_forced = forced;
  thin_min_elems = min_elems;
}
long mlx_mtp_shim_thin_calls(void) { return thin_calls; }

/* A thin product: y[i][j] = alpha sum_k x[i][k] w(k, j) (+ beta y[i][j]), i < m, with x rows
 * contiguous (stride ldx), w(k, j) = w[j * ldw + k] (dot: W stored (N, K)) or w[k * ldw + j]
 * (axpy: W stored (K, N)), and y[i][j] at y[i * ysr + j * ysc]. */
struct thin {
  i64 m, n, k, ldx, ldw, ysr, ysc;
  const float *x, *w;
  float *y, alpha, beta;
};

static inline void thin_store(const struct thin *t, i64 i, i64 j, float s) {
  float *y = t->y + i * t->ysr + j * t->ysc;
  *y = t->beta == 0.0f ? t->alpha * s : t->alpha * s + t->beta * *y;
}

static inline float lane_sum(const vf *v) {
  float l[VL];
  memcpy(l, v, sizeof(l));
  for (int h = VL / 2; h; h /= 2)
    for (int i = 0; i < h; i++) l[i] += l[i + h];
  return l[0];
}

/* Outputs j0..j0+JB-1 of all M rows, W stored (N, K): one pass over those JB weight rows. */
#define DOT_BLOCK(M, JB)                                                                    \
  static void dot_##M##_##JB(const struct thin *t, i64 j0) {                              \
    vf acc[M][JB] = {{{0}}};                                                                \
    i64 kv = t->k - t->k % VL;                                                              \
    for (i64 k = 0; k < kv; k += VL) {                                                      \
      vf w[JB];                                                                             \
      for (int b = 0; b < JB; b++) w[b] = *(const vf *)(t->w + (j0 + b) * t->ldw + k);      \
      for (int i = 0; i < M; i++) {                                                         \
        vf x = *(const vf *)(t->x + i * t->ldx + k);                                        \
        for (int b = 0; b < JB; b++) acc[i][b] += x * w[b];                                 \
      }                                                                                     \
    }                                                                                       \
    for (int i = 0; i < M; i++)                                                             \
      for (int b = 0; b < JB; b++) {                                                        \
        const float *x = t->x + i * t->ldx, *w = t->w + (j0 + b) * t->ldw;                  \
        float s = lane_sum(&acc[i][b]);                                                     \
        for (i64 k = kv; k < t->k; k++) s += x[k] * w[k];                                   \
        thin_store(t, i, j0 + b, s);                                                        \
      }                                                                                     \
  }

/* Outputs j0..j0+JV*VL-1 of all M rows, W stored (K, N): one pass down those weight columns,
 * fetching AXPY_AHEAD rows ahead (each row is a new page: the hardware prefetcher stops there). */
#define AXPY_AHEAD 16
#define AXPY_BLOCK(M, JV)                                                                   \
  static void axpy_##M##_##JV(const struct thin *t, i64 j0) {                             \
    vf acc[M][JV] = {{{0}}};                                                                \
    for (i64 k = 0; k < t->k; k++) {                                                        \
      vf w[JV];                                                                             \
      for (int b = 0; b < JV; b++) {                                                        \
        w[b] = *(const vf *)(t->w + k * t->ldw + j0 + b * VL);                              \
        __builtin_prefetch(t->w + (k + AXPY_AHEAD) * t->ldw + j0 + b * VL);                 \
      }                                                                                     \
      for (int i = 0; i < M; i++) {                                                         \
        float x = t->x[i * t->ldx + k];                                                     \
        for (int b = 0; b < JV; b++) acc[i][b] += x * w[b];                                 \
      }                                                                                     \
    }                                                                                       \
    for (int i = 0; i < M; i++)                                                             \
      for (int b = 0; b < JV; b++) {                                                        \
        float s[VL];                                                                        \
        memcpy(s, &acc[i][b], sizeof(s));                                                   \
        for (int l = 0; l < VL; l++) thin_store(t, i, j0 + b * VL + l, s[l]);               \
      }                                                                                     \
  }

#define BLOCKS(M, JB, JV) DOT_BLOCK(M, JB) DOT_BLOCK(M, 1) AXPY_BLOCK(M, JV) AXPY_BLOCK(M, 1)
BLOCKS(1, 8, 4) BLOCKS(2, 4, 4) BLOCKS(3, 4, 4) BLOCKS(4, 4, 2)
BLOCKS(5, 2, 2) BLOCKS(6, 2, 2) BLOCKS(7, 2, 2) BLOCKS(8, 2, 2)

typedef void (*block_fn)(const struct thin *, i64);
static const struct { block_fn dot, dot1, axpy, axpy1; int jb, jv; } blocks[THIN_MAX_ROWS] = {
#define ENTRY(M, JB, JV) {dot_##M##_##JB, dot_##M##_1, axpy_##M##_##JV, axpy_##M##_1, JB, JV}
    ENTRY(1, 8, 4), ENTRY(2, 4, 4), ENTRY(3, 4, 4), ENTRY(4, 4, 2),
    ENTRY(5, 2, 2), ENTRY(6, 2, 2), ENTRY(7, 2, 2), ENTRY(8, 2, 2)};

/* Columns the W-stored-(K, N) layout leaves after whole vectors: one at a time, along K. */
static void axpy_columns(const struct thin *t, i64 j0, i64 j1) {
  for (i64 j = j0; j < j1; j++)
    for (i64 i = 0; i < t->m; i++) {
      float s = 0.0f;
      for (i64 k = 0; k < t->k; k++) s += t->x[i * t->ldx + k] * t->w[k * t->ldw + j];
      thin_store(t, i, j, s);
    }
}

/* Outputs j0..j1-1: whole blocks, then single weight rows (columns, vectors). */
static void thin_range(const struct thin *t, int dot, i64 j0, i64 j1) {
  int mi = (int)t->m - 1;
  i64 step = dot ? blocks[mi].jb : (i64)blocks[mi].jv * VL, j = j0;
  block_fn big = dot ? blocks[mi].dot : blocks[mi].axpy;
  block_fn one = dot ? blocks[mi].dot1 : blocks[mi].axpy1;
  for (; j + step <= j1; j += step) big(t, j);
  for (; j + (dot ? 1 : VL) <= j1; j += dot ? 1 : VL) one(t, j);
  if (!dot) axpy_columns(t, j, j1);
}

static void thin_run(const struct thin *t, int dot) {
  int nt = thin_threads;
  i64 unit = dot ? 8 : 4 * VL; /* thread boundaries on whole blocks of any row count */
  i64 units = (t->n + unit - 1) / unit;
  if (nt > units) nt = (int)units;
#ifdef _OPENMP /* built without OpenMP: one thread */
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
#endif
  for (int p = 0; p < nt; p++) {
    i64 j0 = units * p / nt * unit, j1 = units * (p + 1) / nt * unit;
    thin_range(t, dot, j0, j1 < t->n ? j1 : t->n);
  }
}

/* Whether m rows against a weight of k inputs and n outputs run here (shape_thin_mask: the
 * measured row counts; unmeasured weights of thin_min_elems or more: all of 1..8, where
 * streaming the weight from memory bounds every route). */
static int thin_route(long k, long n, long m) {
  if (!thin_on || m < 1 || m > THIN_MAX_ROWS) return 0;
  if (thin_forced) return 1;
  long mask = shape_thin_mask(k, n);
  if (mask < 0) return k * n >= thin_min_elems;
  return (int)(mask >> (m - 1)) & 1;
}

static __thread float *thin_scratch;
static __thread size_t thin_scratch_len;

/* x[i][k] = x[i * xsr + k * xsc] (i < m), copied to contiguous rows unless it already is. */
static const float *contiguous_rows(const float *x, i64 m, i64 k, i64 xsr, i64 xsc, i64 *ldx) {
  *ldx = xsr;
  if (xsc == 1) return x;
  size_t need = (size_t)m * (size_t)k;
  if (need > thin_scratch_len) {
    float *grown = realloc(thin_scratch, need * sizeof(float));
    if (!grown) return NULL;
    thin_scratch = grown;
    thin_scratch_len = need;
  }
  for (i64 i = 0; i < m; i++)
    for (i64 l = 0; l < k; l++) thin_scratch[i * k + l] = x[i * xsr + l * xsc];
  *ldx = k;
  return thin_scratch;
}

/* Row-major C (m x n) = alpha op(A) op(B) + beta C on the kernel, by rows of C when m is thin,
 * else by columns (C^T = op(B)^T op(A)^T) when n is; 0 if neither is routed here. */
static int sgemm_thin(int ta, int tb, int m, int n, int k, float alpha, const float *a,
                      int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  int at = ta != 111, bt = tb != 111;
  struct thin t = {.k = k, .alpha = alpha, .beta = beta};
  int dot;
  const float *x;
  if (thin_route(k, n, m)) { /* x = op(A), weight op(B) (k x n) */
    t.m = m, t.n = n, t.w = b, t.ldw = ldb, t.y = c, t.ysr = ldc, t.ysc = 1, dot = bt;
    x = contiguous_rows(a, m, k, at ? 1 : lda, at ? lda : 1, &t.ldx);
  } else if (thin_route(k, m, n)) { /* x = op(B)^T, weight op(A)^T (k x m) */
    t.m = n, t.n = m, t.w = a, t.ldw = lda, t.y = c, t.ysr = 1, t.ysc = ldc, dot = !at;
    x = contiguous_rows(b, n, k, bt ? ldb : 1, bt ? 1 : ldb, &t.ldx);
  } else {
    return 0;
  }
  if (!x) return 0;
  t.x = x;
  thin_run(&t, dot);
  __sync_fetch_and_add(&thin_calls, 1);
  return 1;
}
