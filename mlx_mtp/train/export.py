"""Saving for ``mlx-mtp train``: model export, checkpoints, loss curve and MTP acceptance eval."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .data import ENDOFTEXT_ID, FAMILY, IM_END_ID, TOKENIZER_DIR, _load_tokenizer


# --------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------


# Greedy samples of the demo model fall into loops (6 of 20 held-out samples one line
# repeated); a repetition penalty of 1.3 leaves none (MODEL_CARD.md, "Repetition").
DEMO_REPETITION_PENALTY = 1.3


def generation_config() -> dict:
    # No temperature: the CLI then decodes greedily by default (where MTP is exactly
    # lossless). The repetition penalty is read by generate, serve and bench as vLLM
    # reads it, and applied exactly under MTP.
    return {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID,
            "bos_token_id": None, "do_sample": False, "top_p": 0.95, "top_k": 20,
            "repetition_penalty": DEMO_REPETITION_PENALTY,
            "transformers_version": "4.57.0"}


def _full_config(model, text: dict) -> dict:
    from ..models.io.layout import hf_config

    cfg = hf_config(FAMILY, text)
    cfg["eos_token_id"] = IM_END_ID
    cfg["pad_token_id"] = ENDOFTEXT_ID
    return cfg


def _atomic_dir(final: Path):
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _swap_in(tmp: Path, final: Path):
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")


def copy_tokenizer_files(src: Path, dst: Path):
    """Copy only the tokenizer files (never weights or config) from ``src``."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def save_model(model, config: dict, out: Path, layout: str = "hf", dtype=mx.float32,
               tokenizer_dir: Optional[Path] = TOKENIZER_DIR, extra_files: Optional[dict] = None):
    """Write a loadable checkpoint (atomically) in ``hf`` or ``mlx`` layout.

    ``config`` is the full config.json (nested ``text_config`` for Qwen3.5).
    """
    from ..convert.checkpoint_io import write_checkpoint
    from ..models.io.layout import family, text_config, to_hf

    if layout == "hf":
        weights = to_hf(model, family(config) or FAMILY, nested="text_config" in config)
    elif layout == "mlx":
        weights = dict(tree_flatten(model.parameters()))
        if text_config(config).get("tie_word_embeddings"):
            weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}
    else:
        raise ValueError(f"layout must be 'hf' or 'mlx' (got {layout!r})")
    files = {"generation_config.json": json.dumps(generation_config(), indent=2)}
    write_checkpoint(out, weights, config, dtype=dtype, mtp_file=False,
                     fmt="pt" if layout == "hf" else "mlx",
                     tokenizer_from=tokenizer_dir, tokenizer_files=TOKENIZER_FILES,
                     extra_files=dict(files, **(extra_files or {})))
    return Path(out)


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------


def save_checkpoint(run_dir: Path, step: int, model, optimizer, meta: dict, keep: int = 1):
    ck = run_dir / f"ckpt-{step:07d}"
    tmp = _atomic_dir(ck)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    opt_state = dict(tree_flatten(optimizer.state))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt_state)
    with open(tmp / "state.json", "w") as f:
        json.dump(dict(meta, step=step), f, indent=2)
    _swap_in(tmp, ck)
    latest = run_dir / "latest.json"
    with open(run_dir / ".latest.tmp", "w") as f:
        json.dump({"step": step, "dir": ck.name}, f)
    os.replace(run_dir / ".latest.tmp", latest)
    old = sorted(p for p in run_dir.glob("ckpt-*") if p.is_dir() and not p.name.endswith(".tmp")
                 and p.name != ck.name)
    for p in old[:max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return ck


def load_checkpoint(run_dir: Path, model, optimizer) -> Optional[dict]:
    latest = run_dir / "latest.json"
    if not latest.exists():
        return None
    with open(latest) as f:
        ck = run_dir / json.load(f)["dir"]
    model.load_weights(list(mx.load(str(ck / "model.safetensors")).items()), strict=False)
    opt = mx.load(str(ck / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(opt.items()))
    with open(ck / "state.json") as f:
        meta = json.load(f)
    mx.eval(model.parameters(), optimizer.state)
    return meta


# --------------------------------------------------------------------------
# Loss curve
# --------------------------------------------------------------------------


def read_metrics(path: Path) -> List[dict]:
    if not Path(path).exists():
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def plot_loss_curve(metrics_path: Path, png: Path, title: str = "") -> Optional[Path]:
    from ..plots import missing_note, pyplot

    rows = read_metrics(metrics_path)
    if not rows:
        return None
    plt = pyplot()
    if plt is None:
        print(missing_note(f"{png.name}"), file=sys.stderr)
        return None

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]

    def smooth(y, n=20):
        if len(y) < n:
            return y
        k = np.ones(n) / n
        return np.convolve(y, k, mode="valid").tolist()

    keys = [("loss", "next-token CE (train)"), ("mtp_loss", "MTP t+2 CE (train)"),
            ("kl", "MTP KL to trunk (train)"), ("ce", "drafter block CE (train)")]
    for key, label in keys:
        pts = [(r["step"], r[key]) for r in train if key in r]
        if pts:
            s, y = zip(*pts)
            ys = smooth(list(y))
            ax.plot(s[len(s) - len(ys):], ys, label=label, lw=1.2)
    for key, label in [("loss", "next-token CE (held-out)"), ("mtp_loss", "MTP t+2 CE (held-out)"),
                       ("kl", "MTP KL (held-out)"), ("ce", "drafter block CE (held-out)")]:
        pts = [(r["step"], r[key]) for r in evals if key in r]
        if pts:
            s, y = zip(*pts)
            ax.plot(s, y, "o--", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title(title or "mlx-mtp train")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


# --------------------------------------------------------------------------
# Acceptance evaluation
# --------------------------------------------------------------------------


def heldout_prompts(n_prompts: int, prompt_tokens: int, tokenizer_dir: Path = TOKENIZER_DIR,
                    files: Optional[Sequence[Path]] = None, seed: int = 0) -> List[List[int]]:
    """Prompts cut from held-out files: each the first ``prompt_tokens`` tokens after a
    random line start of a different file (files long enough)."""
    from .tokenizer_build import corpus_files, read_corpus_file

    files = list(files) if files is not None else corpus_files("heldout")
    tok = _load_tokenizer(tokenizer_dir)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(files))
    prompts = []
    for i in order:
        ids = tok.encode(read_corpus_file(files[i]), add_special_tokens=False).ids
        if len(ids) < prompt_tokens + 64:
            continue
        start = int(rng.integers(0, len(ids) - prompt_tokens - 64))
        prompts.append(ids[start:start + prompt_tokens])
        if len(prompts) >= n_prompts:
            break
    return prompts


def evaluate_acceptance(model_path=None, ks: Sequence[int] = (1, 2, 3),
                        temps: Sequence[float] = (0.0, 0.7), n_prompts: int = 16,
                        prompt_tokens: int = 128, max_tokens: int = 64, seed: int = 0,
                        files: Optional[Sequence[Path]] = None, model=None,
                        repetition_penalty: float = 1.0) -> dict:
    """Per-position acceptance of the MTP head on held-out text, fixed K (not adaptive).

    Returns ``{"K=k,T=t": {"acceptance_per_pos": [...], "mean_acceptance_length": ..}}``.
    """
    from ..models.io.loader import load_model, resolve_model_path
    from ..decode.sampling import SamplingParams
    from ..decode.speculative import MTPDecoder

    if model is None:
        path = resolve_model_path(None if model_path is None else str(model_path))
        model, _ = load_model(path)
    prompts = heldout_prompts(n_prompts, prompt_tokens, files=files, seed=seed)
    results = {}
    for t in temps:
        for k in ks:
            from ..decode.speculative import SpecStats

            total = SpecStats()
            for i, p in enumerate(prompts):
                params = SamplingParams(temperature=float(t), seed=seed + i if t > 0 else None,
                                        repetition_penalty=repetition_penalty)
                dec = MTPDecoder(model, k, params, adaptive=False)
                dec.prefill(p)
                emitted = 0
                while emitted < max_tokens:
                    out = dec.step()
                    emitted += len(out.tokens)
                total.merge(dec.stats)
            results[f"K={k},T={t}"] = {
                "K": k, "temperature": t,
                "acceptance_per_pos": total.acceptance_per_pos,
                "mean_acceptance_length": total.mean_acceptance_length,
                "acceptance_rate": total.acceptance_rate,
                "num_drafts": total.num_drafts,
            }
    return results


def format_acceptance_table(results: dict) -> str:
    lines = ["| K | temperature | pos 1 | pos 2 | pos 3 | mean acceptance length |",
             "|---|---|---|---|---|---|"]
    for r in results.values():
        pos = [f"{100 * a:.1f}%" for a in r["acceptance_per_pos"]] + ["–"] * 3
        lines.append(f"| {r['K']} | {r['temperature']} | {pos[0]} | {pos[1]} | {pos[2]} | "
                     f"{r['mean_acceptance_length']:.2f} |")
    return "\n".join(lines)
