"""Nemotron-H (Mamba-2 + attention hybrid): Mamba-2 conv/SSM state rolled back by replaying
the kept prefix from the pre-verify state; greedy output equals mlx-lm's plain decoding."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_checks as fc
from family_checks import HEADS, mlx_lm_model, mtp_tokens, raw_tensors, rms
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_nemotron_h

RNG = np.random.default_rng(0)
PROMPT = [int(x) for x in RNG.integers(0, 128, 14)]
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 2, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # mlx_lm_model loads them strictly: its sanitize drops mtp.*.
    return fc.one_family(tmp_path_factory, "nemotron", make_tiny_nemotron_h)


def test_trunk_logits_follow_mlx_lm(ckpt):
    path = ckpt()
    fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                   [PROMPT, [4], [77], [2, 9, 11]], atol=2e-5)


def test_replay_after_partial_acceptance_equals_plain_decoding(ckpt):
    """Verify four tokens, keep two: the Mamba-2 conv and SSM states (and the KV caches)
    are those of decoding the two one by one, and so are the logits that follow."""
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
    assert sum(isinstance(c, RecurrentCache) for c in spec) == 3
    replayed = [np.array(a) for a in cache_state_arrays(spec)]
    assert [a.shape for a in replayed] == [a.shape for a in plain_state]
    for a, b in zip(replayed, plain_state):  # one replayed call vs two steps: rounding only
        np.testing.assert_allclose(a, b, atol=1e-5)
    got = model.logits(model.trunk(mx.array([[5]]), spec)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, agree):
    """At partial acceptance the SSM replay runs on kept prefixes shorter than K+1."""
    fc.assert_greedy_identical(ckpt(HEADS[agree]), PROMPT, agree)


def test_mtp_layer_equals_reference(ckpt):
    """[enorm(e) || hnorm(h)] @ eh_proj, the pattern's blocks (attention, then MoE) as mlx-lm
    runs them, final_layernorm; tensors read from the checkpoint's own names."""
    path = ckpt("noisy")
    raw = raw_tensors(path)
    model = load_model(path)[0]
    eps, p = model.args.layer_norm_epsilon, "mtp.layers.0."
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = mx.array(fc.fused_input(raw["backbone.embeddings.weight"][tokens], hidden,
                                raw[p + "enorm.weight"], raw[p + "hnorm.weight"],
                                raw[p + "eh_proj.weight"], eps))
    attn, moe = model.mtp.layers[0].block.layers
    assert (attn.block_type, moe.block_type) == ("*", "E")
    np.testing.assert_array_equal(np.array(moe.norm.weight), raw["mtp.layers.1.norm.weight"])
    x = np.array(moe(attn(x, "causal", None)))
    fc.assert_mtp_forward_equals(model, hidden, tokens,
                                 rms(x, raw["mtp.layers.1.final_layernorm.weight"], eps))


def test_batched_rows_equal_mlx_lm(ckpt):
    """Rows keep different numbers of drafts: one replay call with per-row lengths."""
    path = ckpt("noisy")
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], mlx_lm_model(path), PROMPTS)


def test_checkpoint_without_its_mtp_layer(ckpt):
    path = ckpt(drop_mtp=True)
    fc.assert_missing_head_explained(path, "mtp.layers.0.eh_proj.weight")
    fc.assert_decodes_without_head(path, PROMPT)


def test_convert_keeps_the_released_names_and_mlx_lm_still_loads(ckpt, tmp_path):
    ours = fc.assert_convert_round_trip(ckpt("noisy"), tmp_path / "out", PROMPT, atol=1e-5)
    names = {k for k, _ in tree_flatten(ours.parameters())}
    assert "mtp.layers.0.block.layers.1.mixer.switch_mlp.fc1.weight" in names


def test_bfloat16_checkpoint_runs_on_the_cpu(ckpt):
    """mlx-lm's Nemotron experts (SwitchMLP) need float32 on MLX's CPU backend: the loader
    upcasts them as it does GLU experts."""
    model = load_model(ckpt("noisy", dtype=mx.bfloat16), dtype="bfloat16")[0]
    assert model.model.layers[1].mixer.q_proj.weight.dtype == mx.bfloat16
    assert mtp_tokens(model, PROMPT, 2)[0] == mtp_tokens(model, PROMPT, 0)[0]


@pytest.mark.parametrize("quantize", [False, True])
def test_add_mtp_onto_an_mlx_lm_conversion(ckpt, tmp_path, quantize):
    fc.assert_add_mtp_onto_mlx_lm_conversion(ckpt("noisy"), tmp_path / "mlx-community", PROMPT,
                                             quantize)


def test_distributed_tensor_split_is_refused_clearly(ckpt):
    """Nemotron-H splits by layers (tests/test_distributed_families.py), not by tensors:
    mlx-lm has no shard() for it."""
    from mlx_mtp.models.distributed import DistributedError, load_distributed

    with pytest.raises(DistributedError, match="nemotron_h has no tensor split"):
        load_distributed(str(ckpt()), "tensor")


def test_sampling_follows_the_target_distribution(ckpt):
    """Sampled drafts accepted in part: the replayed Mamba-2 state keeps the joint of the
    next two tokens exactly the target's."""
    path = ckpt("random", vocab_size=8)
    fc.assert_sampling_follows_target(load_model(path)[0], mlx_lm_model(path),
                                      [1, 2, 3, 4, 5, 6, 7])
