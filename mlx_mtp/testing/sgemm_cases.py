"""``cblas_sgemm`` called directly on the shim, case by case, against numpy float64 (tests
only): every order, transpose, thin shape and K given, leading dimensions wider than the
product (padding filled with NaN: never read, never written), alpha/beta and beta = 0 over a
C of NaN. Run in a child process that loaded the shim (the suite runs on the reference BLAS)."""

import ctypes
import itertools

import numpy as np

ROW_MAJOR, COL_MAJOR = 101, 102
NO_TRANS = 111


def _stored(mat, order, pad):
    """A BLAS matrix with leading dimension len + pad, NaN in the padding."""
    if order == COL_MAJOR:
        mat = mat.T
    buf = np.full((mat.shape[0], mat.shape[1] + pad), np.nan, np.float32)
    buf[:, :mat.shape[1]] = mat
    return buf, buf.shape[1]


def _unstored(buf, shape, order):
    return buf[:, :shape[0]].T if order == COL_MAJOR else buf[:, :shape[1]]


def check_direct_calls(sgemm, route_calls, route: str, shapes, ks, pads, seed: int) -> dict:
    """Each case through ``sgemm`` (the shim's ``cblas_sgemm``); ``route_calls()`` must grow by
    one per call (the case ran on ``route``). Returns ``{"cases": n, "errors": [...]}``."""
    P = ctypes.c_void_p
    sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, P, ctypes.c_int, P, ctypes.c_int,
                                           ctypes.c_float, P, ctypes.c_int]
    rng = np.random.default_rng(seed)
    errors, cases = [], 0
    for order, ta, tb, (m, n), k, (alpha, beta), pad in itertools.product(
            (ROW_MAJOR, COL_MAJOR), (111, 112, 113), (111, 112), shapes, ks,
            ((1.0, 0.0), (0.5, -2.0)), pads):
        op_a = rng.standard_normal((m, k)).astype(np.float32)
        op_b = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        c0 = (np.full((m, n), np.nan, np.float32) if beta == 0
              else rng.standard_normal((m, n)).astype(np.float32))
        a, lda = _stored(op_a if ta == NO_TRANS else op_a.T, order, pad)
        b, ldb = _stored(op_b if tb == NO_TRANS else op_b.T, order, pad)
        c, ldc = _stored(c0, order, pad)
        before = route_calls()
        sgemm(order, ta, tb, m, n, k, alpha, a.ctypes.data, lda, b.ctypes.data, ldb, beta,
              c.ctypes.data, ldc)
        want = alpha * (op_a.astype(np.float64) @ op_b) + (beta * c0 if beta else 0)
        got = _unstored(c, (m, n), order)
        tag = f"order {order} ta {ta} tb {tb} m {m} n {n} k {k} alpha {alpha} beta {beta} pad {pad}"
        if route_calls() != before + 1:
            errors.append(f"{tag}: not run on {route}")
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            errors.append(f"{tag}: max error {np.nanmax(np.abs(got - want))}")
        if pad and not np.isnan(c[:, -pad:]).all():
            errors.append(f"{tag}: wrote C's padding")
        cases += 1
    return {"cases": cases, "errors": errors[:10]}
