"""Ling-3.0 (``bailing_hybrid``: KDA + MLA): the KDA conv windows and delta-rule state rolled
back by replaying the kept prefix from the pre-verify state; greedy output equals mlx-lm's
plain decoding at every K; the trunk's logits equal transformers 5.24's
``BailingHybridForCausalLM`` on a recorded fixture (``fixtures/bailing_hybrid_reference.py``)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_checks as fc
from family_checks import HEADS, mlx_lm_model, raw_tensors, rms
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_bailing import make_tiny_bailing_hybrid

RNG = np.random.default_rng(0)
PROMPT = [int(x) for x in RNG.integers(0, 128, 14)]
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 2, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fc.one_family(tmp_path_factory, "bailing", make_tiny_bailing_hybrid)


REFERENCE = Path(__file__).parent / "fixtures" / "bailing_hybrid_reference.npz"


def test_trunk_equals_transformers(ckpt):
    """transformers 5.24's ``BailingHybridForCausalLM`` (recorded by
    ``fixtures/bailing_hybrid_reference.py``) on the same released-layout checkpoint: our
    logits over the prompt and its continuation match its forward (KDA's chunked kernel),
    and our greedy continuation at K = 0..3 is its cached one-token decoding's."""
    ref = np.load(REFERENCE)
    path = ckpt()
    weights = raw_tensors(path)
    np.testing.assert_allclose([weights[k].astype(np.float64).sum() for k in sorted(weights)],
                               ref["fingerprint"], rtol=1e-6, err_msg="rerun the generator")
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    model = load_model(path)[0]
    logits = model.logits(model.trunk(mx.array([prompt + tokens]))[0])[0]
    np.testing.assert_allclose(np.array(logits), ref["forward_logits"], atol=2e-5)
    for k in range(4):
        assert fc.mtp_tokens(model, prompt, k, n=len(tokens))[0] == tokens, f"K={k}"


def test_trunk_logits_follow_mlx_lm(ckpt):
    path = ckpt()
    fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                   [PROMPT, [4], [77], [2, 9, 11]], atol=2e-5)


def test_replay_after_partial_acceptance_equals_plain_decoding(ckpt):
    """Verify four tokens, keep two: the KDA conv windows and states (and the MLA caches) are
    those of decoding the two one by one, and so are the logits that follow."""
    model = load_model(ckpt("noisy"))[0]
    plain = model.make_cache()
    model.trunk(mx.array([PROMPT]), plain)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), plain)
    plain_state = [np.array(a) for a in cache_state_arrays(plain)]
    want = model.logits(model.trunk(mx.array([[5]]), plain)[0])
    spec = model.make_cache()
    model.trunk(mx.array([PROMPT]), spec)
    model.trunk(mx.array([[4, 77, 2, 9]]), spec, capture=True)
    for c in spec:
        c.accept([2])
    assert sum(isinstance(c, RecurrentCache) for c in spec) == 2
    replayed = [np.array(a) for a in cache_state_arrays(spec)]
    assert [a.shape for a in replayed] == [a.shape for a in plain_state]
    for a, b in zip(replayed, plain_state):  # one replayed call vs two steps: rounding only
        np.testing.assert_allclose(a, b, atol=1e-5)
    got = model.logits(model.trunk(mx.array([[5]]), spec)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    assert int(got.argmax()) == int(want.argmax())


def test_kda_state_stays_float32_in_a_bfloat16_model(ckpt):
    model = load_model(ckpt("noisy", dtype=mx.bfloat16), dtype="bfloat16")[0]
    cache = model.make_cache()
    model.trunk(mx.array([PROMPT]), cache)
    conv, state = cache[0].state
    assert conv.dtype == mx.bfloat16 and state.dtype == mx.float32
    assert model.model.layers[0].attention.A_log.dtype == mx.float32


@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, agree):
    """At partial acceptance the KDA replay runs on kept prefixes shorter than K+1."""
    fc.assert_greedy_identical(ckpt(HEADS[agree]), PROMPT, agree)


def test_mtp_layer_equals_reference(ckpt):
    """[enorm(e) || hnorm(h)] @ eh_proj, mlx-lm's MLA + MoE decoder layer, final_layernorm;
    tensors read from the checkpoint's own names."""
    from mlx_lm.models.base import create_causal_mask

    path = ckpt("noisy")
    raw = raw_tensors(path)
    model = load_model(path)[0]
    eps, p = model.args.rms_norm_eps, "model.layers.4."
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = mx.array(fc.fused_input(raw["model.word_embeddings.weight"][tokens], hidden,
                                raw[p + "enorm.weight"], raw[p + "hnorm.weight"],
                                raw[p + "eh_proj.weight"], eps))
    block = model.mtp.layers[0].block
    assert not block.is_linear and type(block.mlp).__name__ == "BailingSparseMoE"
    np.testing.assert_array_equal(np.array(block.attention.dense.weight),
                                  raw[p + "attention.dense.weight"])
    x = np.array(block(x, create_causal_mask(x.shape[1]), None))
    fc.assert_mtp_forward_equals(model, hidden, tokens,
                                 rms(x, raw[p + "final_layernorm.weight"], eps))


def test_batched_rows_equal_mlx_lm(ckpt):
    """Rows keep different numbers of drafts: one replay call with per-row lengths."""
    path = ckpt("noisy")
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], mlx_lm_model(path), PROMPTS)


def test_checkpoint_without_its_mtp_layer(ckpt):
    path = ckpt(drop_mtp=True)
    fc.assert_missing_head_explained(path, "model.layers.4.eh_proj.weight",
                                     "model.layers.4.final_layernorm.weight")
    fc.assert_decodes_without_head(path, PROMPT)


def test_convert_keeps_the_released_names_and_mlx_lm_still_loads(ckpt, tmp_path):
    out = tmp_path / "out"
    ours = fc.assert_convert_round_trip(ckpt("noisy"), out, PROMPT, atol=1e-5)
    names = {k for k, _ in tree_flatten(ours.parameters())}
    assert "mtp.layers.0.block.mlp.switch_mlp.gate_proj.weight" in names
    stored = raw_tensors(out, "mtp*.safetensors")
    assert "model.layers.4.final_layernorm.weight" in stored and not any(
        k.startswith("mtp.") for k in stored)


@pytest.mark.parametrize("quantize", [False, True])
def test_add_mtp_onto_an_mlx_lm_conversion(ckpt, tmp_path, quantize):
    fc.assert_add_mtp_onto_mlx_lm_conversion(ckpt("noisy"), tmp_path / "mlx-community", PROMPT,
                                             quantize)


def test_splits_by_layers_and_experts_only(ckpt):
    """Pipeline (tested with the other families in test_distributed_families.py) and
    experts (test_distributed_experts.py); no tensor split: mlx-lm's bailing_moe_v3 has no
    shard()."""
    model, _ = load_model(ckpt())
    assert model.capabilities.splits == ("pipeline", "expert")


def test_sampling_follows_the_target_distribution(ckpt):
    """Sampled drafts accepted in part: the replayed KDA state keeps the joint of the next
    two tokens exactly the target's."""
    path = ckpt("random", vocab_size=8)
    fc.assert_sampling_follows_target(load_model(path)[0], mlx_lm_model(path),
                                      [1, 2, 3, 4, 5, 6, 7])


def test_inspect_finds_the_head_and_sizes_the_caches(ckpt, capsys):
    """The head under ``model.layers.4.``; the recurrent state per sequence is what a
    bfloat16 model's KDA caches hold (float32 state, 16-bit conv windows), and the cache per
    token what its MLA caches (the MTP layer's too) grow by."""
    from mlx_mtp.tools.inspect_model import inspect_model, render

    path = ckpt("noisy", dtype=mx.bfloat16)
    report = inspect_model(str(path))
    assert report["mtp"]["present_layers"] == 1 and report["head_stripped"] is False
    assert report["mtp"]["key_prefix"] == "model.layers.4."
    model = load_model(path, dtype="bfloat16")[0]
    cache, mtp_cache = model.make_cache(), model.make_mtp_cache()
    h = model.trunk(mx.array([PROMPT[:8]]), cache)[1]
    model.mtp_forward(h, mx.array([PROMPT[1:9]]), mtp_cache)
    kda = [c for c in cache if isinstance(c, RecurrentCache)]
    mx.eval([c.state for c in cache + mtp_cache])
    assert report["memory"]["state_bytes_per_sequence"] == sum(
        a.nbytes for c in kda for a in c.state)
    per_token = sum(a.nbytes for c in cache + mtp_cache if c not in kda for a in c.state) // 8
    assert report["memory"]["kv_bytes_per_1k_tokens"] == 1024 * per_token
    assert "float32 at any weight precision" in render(report)
