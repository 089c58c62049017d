"""Split MTP drafters between mlx-mtp and mlx-vlm, both directions, on tiny checkpoints.

mlx-vlm pulls heavy dependencies, so this runs in a venv of its own, never in the test
extra::

    python3 -m venv /tmp/vlm && . /tmp/vlm/bin/activate
    pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2 transformers pillow requests
    pip install --no-deps mlx-vlm==0.7.10 && pip install --no-deps -e .
    python benchmarks/mlx_vlm_interop.py --out docs/mlx-vlm-interop.json \
        --fixtures tests/fixtures/mlx_vlm_split

Directions:
* mlx-vlm -> mlx-mtp: ``mlx_vlm.split_mtp`` writes the drafter of a tiny original
  checkpoint; mlx-mtp loads it with ``--mtp-model`` onto its own trunk conversion: greedy
  output must equal plain decoding and the merged checkpoint's, the float tensors must equal
  those ``convert --split-mtp`` writes. ``--fixtures`` records the source and mlx-vlm's
  drafter for the test suite (tests/test_split_drafter_fixtures.py).
* mlx-mtp -> mlx-vlm: ``mlx_vlm.speculative.drafters.load_drafter`` loads the drafter that
  ``convert --split-mtp`` wrote: every parameter must equal mlx-mtp's head.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.convert.main import convert
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]
CASES = {  # name -> (make_tiny arguments, mlx-vlm split quantization, our convert options)
    "dense": (dict(family="qwen3_5"), {}, {}),
    "moe": (dict(family="qwen3_5_moe", expert_layout="per_expert"), {}, {}),
    "dense-q4": (dict(family="qwen3_5"), {"q_bits": 4, "q_group_size": 64},
                 dict(quantize=True, mtp_bits=4)),
}


def greedy(model, k, n=16):
    dec = MTPDecoder(model, k, adaptive=False)
    tokens = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]
    return tokens, dec.stats.num_accepted_tokens


def tensors(path: Path) -> dict:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def vlm_to_ours(root: Path, name: str) -> dict:
    from mlx_vlm.split_mtp import split_mtp

    tiny, vlm_quant, ours_opts = CASES[name]
    src = make_tiny(root / name / "source", head="noisy", vocab_size=256, num_layers=2,
                    dtype=mx.bfloat16, tokenizer_dir=root / "no-tokenizer", **tiny)
    vlm_drafter = root / name / "drafter-mlx-vlm"
    split_mtp(str(src), str(vlm_drafter), **vlm_quant)
    trunk, our_drafter = root / name / "trunk", root / name / "drafter-mlx-mtp"
    convert(src, trunk, split_mtp=our_drafter, verbose=False, **ours_opts)
    merged = root / name / "merged"
    convert(src, merged, verbose=False, **ours_opts)
    whole, _ = load_model(merged)
    pair, _ = load_model(trunk, mtp_model=str(vlm_drafter))
    plain, _ = greedy(whole, 0)
    out = {"direction": "mlx-vlm split_mtp -> mlx-mtp --mtp-model", "case": name}
    for k in (1, 2, 3):
        tokens, accepted = greedy(pair, k)
        out[f"K={k}"] = {"greedy_equals_plain": tokens == plain, "accepted": accepted,
                         "equals_merged": (tokens, accepted) == greedy(whole, k)}
    if not vlm_quant:
        a, b = tensors(vlm_drafter), tensors(our_drafter)
        out["same_tensor_names"] = sorted(a) == sorted(b)
        out["same_tensors"] = a.keys() == b.keys() and all(
            mx.array_equal(a[x], b[x]).item() for x in a)
    out["mlx_vlm_config"] = json.loads((vlm_drafter / "config.json").read_text())
    return out


def ours_to_vlm(root: Path, name: str) -> dict:
    from mlx_vlm.speculative.drafters import load_drafter

    trunk, our_drafter = root / name / "trunk", root / name / "drafter-mlx-mtp"
    drafter, kind = load_drafter(str(our_drafter), kind="mtp")
    theirs = dict(tree_flatten(drafter.parameters()))
    model, _ = load_model(trunk, mtp_model=str(our_drafter))
    ours = dict(tree_flatten(model.language_model.mtp.parameters()))
    return {"direction": "mlx-mtp convert --split-mtp -> mlx-vlm load_drafter", "case": name,
            "kind": kind, "same_parameter_names": sorted(ours) == sorted(theirs),
            "same_parameters": ours.keys() == theirs.keys() and all(
                mx.array_equal(ours[k], theirs[k]).item() for k in ours)}


def record_fixture(root: Path, name: str, fixtures: Path):
    """``dense/source``, ``dense/drafter``, ``dense/drafter-q4`` (same source), ``moe/...``."""
    family, _, variant = name.partition("-")
    out = fixtures / family
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "source").exists():
        shutil.copytree(root / name / "source", out / "source")
    target = out / ("drafter-" + variant if variant else "drafter")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(root / name / "drafter-mlx-vlm", target)


def main():
    import mlx_vlm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/mlx-vlm-interop.json")
    p.add_argument("--fixtures", default=None, help="Record mlx-vlm-written drafters here")
    args = p.parse_args()
    results = {"mlx_vlm_version": mlx_vlm.__version__, "mlx_version": mx.__version__,
               "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in CASES:
            results["cases"].append(vlm_to_ours(root, name))
            results["cases"].append(ours_to_vlm(root, name))
            if args.fixtures:
                record_fixture(root, name, Path(args.fixtures))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for c in results["cases"]:
        print(c["direction"], c["case"], {k: v for k, v in c.items()
                                          if k not in ("direction", "case", "mlx_vlm_config")})


if __name__ == "__main__":
    main()
