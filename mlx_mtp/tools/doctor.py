"""``mlx-mtp doctor``: what this machine is, and what MTP can gain on it.

Reports the platform, the MLX / mlx-lm versions, the device (Metal or CPU), which BLAS runs
MLX's CPU matmuls, whether structured output is available; then measures, on a small model
built in memory (no download), the cost of a plain decoding step, of a verify pass over K+1
tokens and of a draft call, and turns those ratios into the acceptance MTP needs to pay off
here (``bench.cost_model``). Verify passes that cost about K+1 plain steps (compute-bound
CPUs) leave MTP little room; costs near one step (bandwidth-bound GPUs) leave a lot.

It also shows what ``--dtype auto`` picks for a model (``--model``; default a bf16
checkpoint of the probe's shape) and the measured figures behind it
(``models/io/dtype_timing.py``), measuring them once if none are stored.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import metadata
from typing import Dict, Optional

KS = (1, 2, 3)
EXAMPLE_ACCEPTANCE = "80% per position"
# The probe: lm_head and MLPs dominate a step, as on real checkpoints (≈60M parameters).
PROBE = {"hidden": 512, "num_layers": 8, "vocab_size": 32768}


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def environment() -> dict:
    import mlx.core as mx

    from .. import __version__
    from ..platform import blas, gemv_limits

    return {
        "mlx_mtp": __version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "metal": bool(mx.metal.is_available()),
        "blas": blas.describe(),
        "sgemv_limits": gemv_limits.describe() if blas.active() else None,
        "llguidance": _version("llguidance"),
    }


def probe_model():
    """A random Qwen3.5-shaped model with one MTP layer, in the dtype ``--dtype auto`` picks
    here for a bf16 checkpoint of its shape (float32, or bf16 as stored)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..platform import gemv_limits
    from ..testing.tiny import build_model, tiny_text_config

    model = build_model("qwen3_5", tiny_text_config("qwen3_5", **PROBE))
    if dtype_report(None, measure=True, model=model)["dtype"] != "float32":
        model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    gemv_limits.apply(tree_flatten(model.parameters()))  # as a load would route its products
    return model


def dtype_report(model_path: Optional[str], measure: bool, model=None) -> dict:
    """What ``--dtype auto`` picks on this machine for the checkpoint at ``model_path``
    (None: a bf16 one of the probe's shape, ``model`` if built), why, and the stored figures
    behind it (``models/io/dtype_timing.py``); ``measure``: measure them now if none are
    stored (once: they are stored). Weights are opened lazily, never read."""
    from dataclasses import asdict

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..models.io import dtype_timing, loader

    if model_path is None:
        if model is None:
            from ..models.io.layout import hf_config
            from ..testing.tiny import tiny_text_config

            model = loader.build_model(hf_config("qwen3_5", tiny_text_config("qwen3_5", **PROBE)))
        weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
        what = f"a bf16 checkpoint of the probe's shape ({PROBE['hidden']} hidden)"
    else:
        path = loader.resolve_model_path(model_path)
        config = loader.model_config(path)
        model = loader.build_model(config, path / "config.json")
        weights = loader.loadable_weights(model, path, config)
        what = str(path)
    dtype, reason = loader.choose_dtype("auto", weights, model,
                                        "measure" if measure else "stored")
    shape = loader.auto_shape(weights, model)
    timing = dtype_timing.stored(shape) if shape is not None else None
    return {"model": what, "dtype": "as stored" if dtype is None else "float32",
            "reason": reason, "measured_shape": None if shape is None else asdict(shape),
            "file": str(dtype_timing.timing_file(shape)) if timing else None,
            "seconds": timing.seconds if timing else None,
            "load_when_measured": timing.load if timing else None}


def measure(reps: int = 5, context: int = 64) -> dict:
    """Plain-step seconds and verify/draft costs relative to it (``bench.inprocess``)."""
    from ..bench.inprocess import combine_costs, measure_costs
    from ..models.io.loader import parameter_count

    model = probe_model()
    ids = [(7 * i + 3) % PROBE["vocab_size"] for i in range(context)]
    costs = combine_costs([measure_costs(model, ids, KS, reps=reps)])
    return {"parameters": parameter_count(model), "reps": reps, "context_tokens": context,
            "plain_step_ms": costs["plain_step_ms"],
            "c_verify": {int(k): v for k, v in costs["c_verify"].items()},
            "c_draft": costs["c_draft"]}


def implications(costs: dict) -> dict:
    """Break-even acceptance for K=1, and the best K and its predicted speedup at an
    example acceptance, from the measured cost ratios."""
    from ..bench.cost_model import (ACCEPTANCE_EXAMPLES, MeasuredProfile, best_k,
                                    predicted_speedup)

    profile = MeasuredProfile("this machine", costs["c_verify"], costs["c_draft"])
    # K=1 emits 1 + a tokens for c_verify(1) + c_draft plain steps.
    break_even = costs["c_verify"][1] + costs["c_draft"] - 1
    acc = ACCEPTANCE_EXAMPLES[EXAMPLE_ACCEPTANCE]
    k = best_k(acc, profile, max_k=max(KS))
    return {"k1_break_even_acceptance": break_even, "example_acceptance": EXAMPLE_ACCEPTANCE,
            "best_k": k, "predicted_speedup": predicted_speedup(acc[:k], profile) if k else 1.0,
            "full_acceptance_speedup": {kk: predicted_speedup([1.0] * kk, profile) for kk in KS}}


def verdict(imp: dict) -> str:
    b = imp["k1_break_even_acceptance"]
    if b >= 1:
        head = ("MTP cannot pay off here even at 100% acceptance: one verify pass plus a draft "
                "costs at least two plain steps. Use --no-mtp (or --num-draft-tokens auto, "
                "which falls back to plain decoding).")
    else:
        head = f"MTP at K=1 pays off when more than {max(b, 0):.0%} of drafts are accepted."
    if imp["best_k"]:
        head += (f" At {imp['example_acceptance']} acceptance the best K is {imp['best_k']} "
                 f"(predicted {imp['predicted_speedup']:.2f}x).")
    else:
        head += f" At {imp['example_acceptance']} acceptance plain decoding is fastest."
    return head


def _gb(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GB"


def render(report: dict) -> str:
    env = report["environment"]
    rows = [
        ("mlx-mtp", f"{env['mlx_mtp']} (Python {env['python']}, {env['platform']}, "
                    f"{env['cpus']} CPUs, {_gb(env['memory_bytes'])} RAM)"),
        ("MLX", f"{env['mlx']}, mlx-lm {env['mlx_lm'] or 'not installed'}"),
        ("device", f"{env['device']} (Metal {'available' if env['metal'] else 'not available'})"),
        ("BLAS", env["blas"]),
        *([("sgemv limits", env["sgemv_limits"])] if env.get("sgemv_limits") else []),
        ("structured", f"llguidance {env['llguidance']}" if env["llguidance"]
                       else "off: pip install 'llguidance>=1.9,<2'"),
    ]
    d = report.get("dtype")
    if d:
        rows.append(("dtype auto", f"for {d['model']}: {d['reason']}"))
        if d["measured_shape"] is not None:  # figures decide this checkpoint's dtype
            load = d["load_when_measured"]
            rows.append(("dtype file", (
                f"{d['file']} (measured at load {'?' if load is None else f'{load:.1f}'}; "
                "delete it to measure again)") if d["file"] else
                "none stored: the static rule decides until a load measures them"))
    m = report.get("measured")
    if m:
        verify = ", ".join(f"K={k} {v:.2f}" for k, v in sorted(m["c_verify"].items()))
        rows += [
            ("probe", f"{m['parameters'] / 1e6:.0f}M-parameter model built in memory, "
                      f"{m['context_tokens']}-token context, median of {m['reps']}"),
            ("plain step", f"{m['plain_step_ms']:.1f} ms"),
            ("verify", f"{verify} plain steps (K drafts + 1 token in one pass)"),
            ("draft", f"{m['c_draft']:.2f} plain steps per draft token"),
            ("MTP here", verdict(report["implications"])),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--no-measure", action="store_true",
                        help="Report versions and devices only (skip the few-second timing)")
    parser.add_argument("--reps", type=int, default=9, help="Timed repetitions per pass")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON")
    parser.add_argument("--model", default=None,
                        help="A checkpoint (directory or Hugging Face id) whose --dtype auto "
                             "choice to show with the figures behind it (default: a bf16 "
                             "checkpoint of the probe's shape); its weights are not read")
    parser.set_defaults(quiet=True)  # the BLAS line is part of the report, not printed twice
    return parser


def run(args) -> int:
    from ..options import UserError

    if args.reps < 1:
        raise UserError(f"--reps must be at least 1 (got {args.reps})")
    report: Dict[str, object] = {"environment": environment()}
    report["dtype"] = dtype_report(args.model, measure=not args.no_measure)
    if not args.no_measure:
        if not args.json:
            print("measuring a plain step, verify passes and a draft call ...", file=sys.stderr)
        report["measured"] = measure(args.reps)
        report["implications"] = implications(report["measured"])
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
