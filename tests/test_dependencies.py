"""What a plain `pip install` brings: structured output and Prometheus metrics, not matplotlib.

matplotlib is the optional `plots` extra: bench and train run without it and say how to get
plots (checked in subprocesses whose import system refuses matplotlib)."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from mlx_mtp.testing.tiny import make_tiny

BLOCK_MATPLOTLIB = textwrap.dedent("""
    import sys

    class NoMatplotlib:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ImportError("No module named 'matplotlib' (blocked by the test)")
            return None

    sys.meta_path.insert(0, NoMatplotlib())
""")


def run_without_matplotlib(code: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(BLOCK_MATPLOTLIB + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600)


def base_requirements() -> dict:
    """Distribution name -> whether it is a base dependency (no extra marker), as installed."""
    from importlib.metadata import requires

    out = {}
    for req in requires("mlx-mtp"):
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")
        out[name] = out.get(name, False) or "extra ==" not in req
    return out


def test_base_install_has_structured_output_and_metrics_not_plots():
    base = base_requirements()
    assert base["llguidance"] and base["prometheus-client"]
    assert base["matplotlib"] is False  # only through an extra (plots, test)
    from mlx_mtp.decode.grammar import json_schema_grammar

    assert json_schema_grammar({"type": "object"})


@pytest.fixture(scope="module")
def oracle_path(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("oracle"), "qwen3_5", "oracle",
                         vocab_size=4096, trunk_scale=0.1))


def test_bench_runs_without_matplotlib(oracle_path, tmp_path):
    out = tmp_path / "out"
    proc = run_without_matplotlib(f"""
        from mlx_mtp.cli import main
        try:
            import matplotlib
        except ImportError:
            pass
        else:
            raise SystemExit("matplotlib was not blocked")
        sys.exit(main(["bench", "--model", {oracle_path!r}, "--num-draft-tokens", "0,1",
                       "--max-tokens", "6", "--repeats", "1", "--prompts", "builtin:qa",
                       "--cost-reps", "1", "--warmup-tokens", "2", "-o", {str(out)!r}]))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlx-mtp[plots]" in proc.stdout + proc.stderr
    assert not list(out.glob("*.png"))
    assert json.loads((out / "inprocess.json").read_text())["settings"]
    assert ".png" not in (out / "README_snippet.md").read_text()


def test_train_loss_curve_without_matplotlib(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    proc = run_without_matplotlib(f"""
        from pathlib import Path
        from mlx_mtp.train.export import plot_loss_curve
        assert plot_loss_curve(Path({str(metrics)!r}), Path({str(tmp_path / "loss.png")!r})) is None
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss.png skipped" in proc.stderr and "mlx-mtp[plots]" in proc.stderr
    assert not (tmp_path / "loss.png").exists()
