"""mlx-mtp: lossless MTP speculative decoding for Qwen3.5/3.6 and Qwen3-Next on MLX.

``from mlx_mtp import load, stream_generate, generate`` (imported on first use, so the
command line can set up the platform before MLX loads).
"""

__version__ = "0.1.0"

# Linux CPU wheel: load the OpenBLAS shim before anything imports MLX (platform/blas.py).
from .platform import blas as _blas  # noqa: E402

_blas.preload()

_LAZY = {
    "load": "mlx_mtp.models.io.loader",
    "stream_generate": "mlx_mtp.decode.generation",
    "generate": "mlx_mtp.decode.generation",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_mtp' has no attribute {name!r}")
