import os

import pytest

# Keep MLX to the CPU and single-process-friendly in CI.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Exactness tests compare 1-row and multi-row products bit for bit: the reference BLAS is
# row-invariant, OpenBLAS is not (see docs/linux-cpu.md). Set before any test
# imports mlx_mtp (whose import loads the OpenBLAS shim otherwise); test_fast_blas runs the
# shim in child processes.
os.environ["MLX_MTP_BLAS"] = "reference"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory for tiny Hugging Face-layout checkpoints, built once per session."""
    from mlx_mtp.testing.tiny import make_tiny

    made = {}

    def make(family="qwen3_5", head="random", **kw):
        key = (family, head, tuple(sorted(kw.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}_{head}")
            made[key] = make_tiny(path, family, head, **kw)
        return made[key]

    return make
