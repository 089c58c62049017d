import os
import tempfile

import pytest

# Keep MLX to the CPU and single-process-friendly in CI.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Exactness tests compare 1-row and multi-row products bit for bit: the reference BLAS is
# row-invariant, OpenBLAS is not (see docs/linux-cpu.md). Set before any test
# imports mlx_mtp (whose import loads the OpenBLAS shim otherwise); test_fast_blas runs the
# shim in child processes.
os.environ["MLX_MTP_BLAS"] = "reference"
# Step costs persist under $XDG_CACHE_HOME/mlx-mtp (generate stores them): a session of its own,
# so no test reads costs another process or an earlier run measured.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mlx-mtp-test-cache-")
# No test times matmuls to pick --dtype auto (models/io/dtype_timing.py): the static rule
# decides, the same on every machine; tests of the measured choice opt in.
os.environ["MLX_MTP_MEASURE_DTYPE"] = "0"


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


@pytest.fixture(scope="session")
def tiny_model():
    """An in-memory tiny Qwen3.5 model with a partly-right MTP head (no disk, no loader):
    for decode, cache and policy tests. Loader and convert tests use ``tiny_ckpt``."""
    from mlx_mtp.testing.tiny import build_model, make_oracle, tiny_text_config

    model = build_model("qwen3_5", tiny_text_config("qwen3_5"), seed=0)
    return make_oracle(model, trunk_scale=0.1, fc_noise=1.5)


@pytest.fixture
def cli(capsys):
    """``mlx-mtp ARGS`` in this process: (exit code, stdout, stderr), without an interpreter's
    start, for tests of what a command does; each command also has a test that starts it as
    users do (test_cli.py, test_hub.py, test_dependencies.py)."""
    from mlx_mtp.cli import main

    def run(*args):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors, as the process exits
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


# -- the ``slow`` marker: tests that start processes ------------------------------------
# Whole modules that run servers, ranks, a browser or child interpreters; elsewhere a
# test is slow when it, or a fixture it uses, starts one. CI runs everything.
SLOW_MODULES = {"test_bench_server", "test_cli", "test_dashboard_browser", "test_distributed",
                "test_distributed_serve", "test_fast_blas"}
_STARTS_PROCESS = ("ServerProcess(", "subprocess.", "sync_playwright", "mlx.launch", "RankJobs(",
                   "run_ranks(", "Cluster(", "served_together(")


def _starts_process(func, seen={}) -> bool:
    if func not in seen:
        import inspect

        try:
            src = inspect.getsource(func)
        except (OSError, TypeError):
            src = ""
        seen[func] = any(s in src for s in _STARTS_PROCESS)
    return seen[func]


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        fixtures = getattr(item, "_fixtureinfo", None)
        funcs = [getattr(item, "function", None)] + [
            d.func for defs in (fixtures.name2fixturedefs.values() if fixtures else ())
            for d in defs]
        if module in SLOW_MODULES or any(f is not None and _starts_process(f) for f in funcs):
            item.add_marker(pytest.mark.slow)
