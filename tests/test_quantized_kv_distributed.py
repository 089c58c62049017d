"""``--kv-bits`` with ``--distributed pipeline|tensor|expert`` over two local ranks (ring
backend): each rank quantizes the caches it holds (its layers', its heads' KV or the whole
MLA latents, every layer's; DSA: the indexer's keys too; DeepSeek-V4: every layer's window
and compressed entries, which every rank holds whole), and with a noisy head (drafts
rejected: every rank rolls its quantized caches back with the shared accept) greedy output of
both ranks equals the single-process decode with the same quantized caches at K = 0 and 3.
The first three families' heads follow an oracle, so tokens alone would not see the
quantization: rank 0's logits (trunk and MTP head) after the prompt equal one process's with
the same quantized caches, and differ from the full-precision ones by far more than the
tolerance.

The stream trunks (Qwen4-Exp, GLM-5.3-Flash, DeepSeek-V4) are their fixtures widened to 32
(``test_quantized_kv_streams.widened``: random weights and heads; Qwen4-Exp with two
key/value heads, so its heads split over two ranks), in every mode they split by.

One pair of ranks runs every job (``rank_jobs.RankJobs``); the reference is this process's
decode (itself equal to plain decoding and to mlx-lm's quantized generation:
``test_quantized_kv.py``). Heads 32 wide, 4-bit caches in groups of 32.
"""

import json

from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing import tiny, tiny_attention, tiny_special
from distributed_rank import prompt_logits
from rank_jobs import RankJobs
from test_distributed import RANK_SCRIPT
from test_distributed_streams import with_tokenizer
from test_quantized_kv_streams import fixture_checkpoint, widened

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 101, 44, 9, 120, 77, 3, 25, 61, 18]
MAX_TOKENS = 10
KS = [0, 3]
KV_BITS = (4, 32)
MODES = ("pipeline", "tensor", "expert")
FAMILIES = ("qwen3_5_moe", "deepseek_v3", "deepseek_v32", "qwen4_exp", "glm5_next",
            "deepseek_v4")
QUANTIZED_KIND = {"deepseek_v4": "quantized_dsv4"}  # the others: "quantized_kv"


def qwen_moe(path):
    """The Qwen hybrid with routed experts: full attention beside DeltaNet states."""
    text = dict(tiny.tiny_text_config("qwen3_5_moe"), head_dim=32)
    model = tiny.make_oracle(tiny.build_model("qwen3_5_moe", text, seed=2), 0.2, 1.5, 2)
    return tiny.save_hf_checkpoint(model, "qwen3_5_moe", text, path)


def mla_moe(path):
    """DeepSeek-V3: MLA latents (kv_lora_rank 32) and their RoPE part, made 32 wide."""
    return tiny_attention.write_tiny(
        path, lambda **c: dict(tiny_attention.tiny_config("deepseek_v3", **c),
                               qk_rope_head_dim=32), tiny_attention.to_hf, "noisy", seed=3)


def dsa_moe(path):
    """DeepSeek-V3.2: the latents and the indexer's keys (32 wide), a top-k of 6 the prompt
    crosses."""
    return tiny_attention.write_tiny(
        path, lambda **c: dict(tiny_special.dsa_config("deepseek_v32", **c),
                               qk_rope_head_dim=32, index_head_dim=32),
        tiny_attention.to_hf, "noisy", seed=4)


def stream_trunk(family: str, path):
    """A stream family's fixture checkpoint widened to 32 (random weights, a random head)."""
    config, model = widened(family, **({"num_key_value_heads": 2} if family == "qwen4_exp"
                                       else {}))
    path = with_tokenizer(fixture_checkpoint(family), path)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


@cache
def single_process(path: str) -> tuple:
    """(ids per K, the prompt's logits) with quantized caches, and the logits without."""
    model, _ = load_model(Path(path), mtp=True)
    full = prompt_logits(model, PROMPT)
    model.use_kv_quantization(KVQuantization(*KV_BITS))
    tokens = {str(k): [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=k,
                                                      sampling=SamplingParams(),
                                                      max_tokens=MAX_TOKENS, adaptive=False)]
              for k in KS}
    return tokens, prompt_logits(model, PROMPT), full


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One pair of ranks: the six families x the three modes; {(family, mode): (job, rank 0,
    rank 1)}. The single-process references are decoded while the ranks run."""
    root = tmp_path_factory.mktemp("kvq_dist")
    models = {"qwen3_5_moe": qwen_moe(root / "qwen"), "deepseek_v3": mla_moe(root / "mla"),
              "deepseek_v32": dsa_moe(root / "dsa"),
              **{f: stream_trunk(f, root / f) for f in FAMILIES[3:]}}
    jobs = [{"name": f"{fam}-{mode}", "model": str(path), "mode": mode, "ks": KS,
             "kv_bits": list(KV_BITS), "logits": True, "prompt": PROMPT, "max_tokens": MAX_TOKENS}
            for fam, path in models.items() for mode in MODES]
    with RankJobs(RANK_SCRIPT, jobs, root) as ranks:
        for path in models.values():
            single_process(str(path))
        results = ranks.results()
    return {tuple(j["name"].rsplit("-", 1)): (j, *results[j["name"]]) for j in jobs}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", MODES)
def test_greedy_over_two_ranks_equals_one_process_with_the_same_quantized_cache(runs, family,
                                                                                 mode):
    job, r0, r1 = runs[(family, mode)]
    assert r0["mode"] == r1["mode"] == mode
    for r in (r0, r1):  # every rank holds its attention (and indexer) caches quantized
        assert QUANTIZED_KIND.get(family, "quantized_kv") in r["cache_kinds"], r["cache_kinds"]
        assert ("quantized_index_kv" in r["cache_kinds"]) == (family == "deepseek_v32")
        assert "kv" not in r["cache_kinds"] or mode == "pipeline", r["cache_kinds"]
    tokens, logits, full = single_process(job["model"])
    assert r0["tokens"] == tokens
    assert r1["tokens"] == r0["tokens"]
    for got, want, unquantized in zip(r0["logits"], logits, full):
        got, want, unquantized = np.array(got), np.array(want), np.array(unquantized)
        close = dict(rtol=1e-4, atol=1e-4 * np.abs(want).max())  # sums in another order
        assert np.allclose(got, want, **close), np.abs(got - want).max()
        assert not np.allclose(unquantized, want, **close)
