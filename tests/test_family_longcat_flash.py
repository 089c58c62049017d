"""LongCat-Flash: two MLA attention sublayers per layer (two KV caches, both rolled back),
zero-compute experts, MLA LoRA scaling, MTP at model.mtp.*; greedy output equals mlx-lm's
plain decoding."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

import family_checks as fc
from family_checks import HEADS, mlx_lm_model, raw_tensors, rms
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_longcat_flash

RNG = np.random.default_rng(3)
PROMPT = [int(x) for x in RNG.integers(0, 128, 11)]
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 11, 1, 8)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # mlx_lm_model loads them strictly: its sanitize drops model.mtp*.
    return fc.one_family(tmp_path_factory, "longcat", make_tiny_longcat_flash)


def test_trunk_logits_equal_mlx_lm(ckpt):
    path = ckpt()
    ours, theirs = fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                                  [PROMPT, [4], [77], [2]])
    assert len(ours) == 2 * len(theirs)  # one cache per attention sublayer


def test_verify_rows_equal_plain_decoding_and_both_sublayers_roll_back(ckpt):
    model = load_model(ckpt("noisy"))[0]
    rows = [4, 77, 2, 9]
    want = fc.one_by_one_logits(model, PROMPT, rows)
    verify, spec = fc.verify_logits(model, PROMPT, rows)
    assert mx.array_equal(verify, want)  # absorbed formula on every verify row
    for c in spec:
        c.accept([2])
    assert [c.offset for c in spec] == [len(PROMPT) + 2] * len(spec)
    again = model.logits(model.trunk(mx.array([[2]]), spec)[0])
    assert mx.array_equal(again, want[:, 2:3])
    other = fc.verify_logits(model, PROMPT, rows, capture=False)[0]  # the expanded formula
    assert not mx.array_equal(other, want) and mx.allclose(other, want, atol=1e-4)


@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, agree):
    fc.assert_greedy_identical(ckpt(HEADS[agree]), PROMPT, agree)


def test_mtp_layer_equals_reference(ckpt):
    """[enorm.m(e) || hnorm.m(h)] @ eh_proj, the block (mlx-lm's LongCat MLA and MLP),
    model.mtp.norm; tensors under the release's names."""
    path = ckpt("noisy")
    raw, p = raw_tensors(path), "model.mtp.layers.0."
    model = load_model(path)[0]
    eps = model.args.rms_norm_eps
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = mx.array(fc.fused_input(raw["model.embed_tokens.weight"][tokens], hidden,
                                raw[p + "enorm.m.weight"], raw[p + "hnorm.m.weight"],
                                raw[p + "eh_proj.weight"], eps))
    block = model.mtp.layers[0].block
    np.testing.assert_array_equal(np.array(block.mlp.down_proj.weight),
                                  raw[p + "transformer_layer.mlp.down_proj.weight"])
    x = x + block.self_attn(block.input_layernorm(x), create_causal_mask(3), None)
    x = np.array(x + block.mlp(block.post_attention_layernorm(x)))
    fc.assert_mtp_forward_equals(model, hidden, tokens, rms(x, raw["model.mtp.norm.weight"], eps))


def test_batched_rows_equal_mlx_lm(ckpt):
    path = ckpt("noisy")
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], mlx_lm_model(path), PROMPTS)


def test_checkpoint_without_its_mtp_layer(ckpt):
    path = ckpt(drop_mtp=True)
    fc.assert_missing_head_explained(path, "model.mtp.layers.0.eh_proj.weight",
                                     "model.mtp.norm.weight")
    fc.assert_decodes_without_head(path, PROMPT)


def test_convert_and_add_mtp_keep_the_released_names(ckpt, tmp_path):
    src = ckpt("noisy")
    fc.assert_convert_round_trip(src, tmp_path / "out", PROMPT)
    fc.assert_add_mtp_onto_mlx_lm_conversion(src, tmp_path / "mlx-community", PROMPT,
                                             quantize=True)
