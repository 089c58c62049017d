"""``python -m mlx_mtp.platform``: which BLAS runs MLX's CPU matmuls, and 1- to 8-row timings
on each path."""

import logging
import sys

from mlx_mtp.platform import blas  # importing mlx_mtp preloads the shim before MLX

logging.basicConfig(level=logging.INFO, format="%(message)s")
try:
    blas.configure()
except blas.BlasError as e:
    sys.exit(f"mlx_mtp.platform: error: {e}")
print(blas.describe())
from mlx_mtp.platform import bench, gemv_limits  # imports MLX: after configure

if blas.active():
    print(f"sgemv limits: {gemv_limits.describe()}")

bench.main()
