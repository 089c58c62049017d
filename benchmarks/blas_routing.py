"""Single-row matmul time on OpenBLAS vs the reference BLAS, interleaved in one process
(switching the shim's routing at run time). Used to pick MLX_MTP_BLAS_SMALL."""
import time, mlx_mtp
from mlx_mtp.platform import blas
blas.configure()
import mlx.core as mx
shapes = [(256, 768), (384, 1152), (384, 4096), (1024, 1024), (1024, 3072), (2048, 2048), (4096, 4096)]
def t(x, w, n=300):
    mx.eval(x @ w)
    ts = []
    for _ in range(n):
        s = time.perf_counter(); mx.eval(x @ w); ts.append(time.perf_counter() - s)
    return sorted(ts)[n // 2] * 1e6
for k, n in shapes:
    w = mx.random.normal((k, n)); x = mx.random.normal((1, k)); mx.eval(w, x)
    cfg = {"openblas": (1, 1, 0), "reference": (0, 2, 0)}
    res = {c: [] for c in cfg}
    for rep in range(3):
        for c in ("openblas", "reference", "reference", "openblas"):
            blas._shim.mlx_mtp_shim_configure(*cfg[c]); res[c].append(t(x, w, 60))
    print(f"1x{k}@{k}x{n} ({k*n/1e6:.2f}M): " + ", ".join(f"{c} {sorted(v)[len(v)//2]:.0f} us" for c, v in res.items()), flush=True)
