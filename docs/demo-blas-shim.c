/* Route MLX's cblas_sgemm/dgemm (reference BLAS in the mlx-cpu wheel) to numpy's OpenBLAS (ILP64). */
#include <stdint.h>
typedef int64_t blasint64;
extern void scipy_cblas_sgemm64_(int order, int ta, int tb, blasint64 m, blasint64 n, blasint64 k,
    float alpha, const float *a, blasint64 lda, const float *b, blasint64 ldb, float beta, float *c, blasint64 ldc);
extern void scipy_cblas_dgemm64_(int order, int ta, int tb, blasint64 m, blasint64 n, blasint64 k,
    double alpha, const double *a, blasint64 lda, const double *b, blasint64 ldb, double beta, double *c, blasint64 ldc);
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
                 const double *b, int ldb, double beta, double *c, int ldc) {
  scipy_cblas_dgemm64_(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
