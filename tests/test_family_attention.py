"""Attention-trunk families (GLM-4.x, GLM-4.7-Flash, DeepSeek-V3, MiMo-7B): the trunk is
mlx-lm's, the MTP layer ours; greedy output equals mlx-lm's plain decoding at every K."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

import family_checks as fc
from family_checks import HEADS, mlx_lm_greedy, mtp_tokens, rms
from mlx_mtp.models.blocks.attention_trunk import dequantize_fp8
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_attention import FAMILIES, MLA_FAMILIES, make_tiny

PROMPT = [1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18]
PROMPTS = [[int(x) for x in np.random.default_rng(0).integers(0, 128, n)] for n in (5, 11, 1, 8)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fc.checkpoints(tmp_path_factory, make_tiny)


def mlx_lm_model(path):
    # mlx-lm's deepseek_v3 sanitize drops only layer 61 (the real model's MTP index), so a
    # tiny checkpoint's MTP layer is left over: ignore it there.
    return fc.mlx_lm_model(path, strict=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_trunk_logits_equal_mlx_lm(ckpt, family):
    path = ckpt(family)
    fc.assert_trunk_follows_mlx_lm(load_model(path)[0], mlx_lm_model(path),
                                   [PROMPT, [4], [77], [2]])


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_rows_equal_plain_one_token_decoding(ckpt, family):
    """A verify pass (capture) computes each row as plain decoding does: bit for bit, also
    for MLA, where a multi-token pass in mlx-lm's formula would differ."""
    model = load_model(ckpt(family))[0]
    rows = [4, 77, 2, 9]
    plain = fc.one_by_one_logits(model, PROMPT, rows)
    for capture in (True, False):
        verify = fc.verify_logits(model, PROMPT, rows, capture)[0]
        if capture:
            assert mx.array_equal(verify, plain)
        elif family in MLA_FAMILIES:  # the trap: the expanded formula rounds differently
            assert not mx.array_equal(verify, plain)
            assert mx.allclose(verify, plain, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("agree", list(HEADS))
def test_greedy_identical_to_mlx_lm(ckpt, family, agree):
    fc.assert_greedy_identical(ckpt(family, HEADS[agree]), PROMPT, agree, strict=False)


def test_bfloat16_moe_checkpoint_runs_on_the_cpu(ckpt):
    """mlx-lm's experts need float32 on MLX's CPU backend: the loader upcasts them."""
    model = load_model(ckpt("glm4_moe", "noisy", dtype=mx.bfloat16))[0]
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert mtp_tokens(model, PROMPT, 2)[0] == mtp_tokens(model, PROMPT, 0)[0]


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_quantized_draft_head_keeps_greedy_output(ckpt, family):
    path = ckpt(family, "noisy")
    model, ref = load_model(path)[0], mlx_lm_greedy(mlx_lm_model(path), PROMPT)
    model.set_draft_head(bits=8)
    got, dec = mtp_tokens(model, PROMPT, 2)
    assert got == ref and dec.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layer_equals_reference(ckpt, family):
    """mtp_forward against the block written out: norms, concat order and projection in
    numpy, the decoder block called as mlx-lm calls it, the final norm in numpy."""
    model = load_model(ckpt(family, "noisy"))[0]
    layer = model.mtp.layers[0]
    eps = model.args.rms_norm_eps
    hidden, tokens = fc.reference_inputs(model.args.hidden_size)
    x = fc.fused_input(np.array(model.model.embed_tokens.weight)[tokens], hidden,
                       np.array(layer.enorm.weight), np.array(layer.hnorm.weight),
                       np.array(layer.eh_proj.weight), eps, hidden_first=family == "mimo")
    mask = create_causal_mask(3) if family in MLA_FAMILIES else "causal"
    x = np.array(layer.block(mx.array(x), mask, None))
    fc.assert_mtp_forward_equals(model, hidden, tokens, rms(x, np.array(layer.norm.weight), eps))


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_batched_rows_equal_mlx_lm(ckpt, family):
    path = ckpt(family, "noisy")
    fc.assert_batched_rows_equal_mlx_lm(load_model(path)[0], mlx_lm_model(path), PROMPTS)


@pytest.mark.parametrize("family", ["glm4_moe_lite", "mimo"])
def test_sampling_follows_the_target_distribution(ckpt, family):
    path = ckpt(family, "random", vocab_size=8)
    fc.assert_sampling_follows_target(load_model(path)[0], mlx_lm_model(path), [1, 2, 3, 4, 5])


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_without_its_mtp_layer(ckpt, family):
    path = ckpt(family, drop_mtp=True)
    fc.assert_missing_head_explained(path, "mlx-mtp add-mtp", "--no-mtp",
                                     "model.mtp_layers.0.input_proj.weight" if family == "mimo"
                                     else "model.layers.2.eh_proj.weight")
    fc.assert_decodes_without_head(path, PROMPT, strict=False)


def test_fp8_block_weights_are_dequantized():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)  # one per 128x128 block
    fp8 = mx.to_fp8(mx.array(w))
    got = dequantize_fp8({"a.weight": fp8, "a.weight_scale_inv": mx.array(scale)})
    assert set(got) == {"a.weight"} and got["a.weight"].dtype == mx.bfloat16
    blocks = np.kron(scale, np.ones((128, 128)))[:200, :300]
    want = np.array(mx.from_fp8(fp8, dtype=mx.float32)) * blocks
    np.testing.assert_allclose(np.array(got["a.weight"].astype(mx.float32)), want, rtol=1e-2)


def test_distributed_tensor_split_is_refused_clearly_without_mlx_lm_shard(ckpt):
    """Every family splits by layers (tests/test_distributed_families.py); by tensors only
    those mlx-lm can shard(): MiMo-7B cannot."""
    from mlx_mtp.models.distributed import DistributedError, load_distributed

    with pytest.raises(DistributedError, match="mimo has no tensor split"):
        load_distributed(str(ckpt("mimo")), "tensor")


def test_caches_answer_mlx_lm_mask_calls():
    """mlx-lm's attention code asks caches for masks; MLA needs boolean arrays, with a
    batch's holes."""
    from mlx_lm.models.base import create_attention_mask

    from mlx_mtp.models.cache.kv import BatchKVCache, KVCache

    solo = KVCache()
    solo.update_and_fetch(mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)))
    h = mx.zeros((1, 3, 8))
    assert create_attention_mask(h, solo) == "causal"
    assert create_attention_mask(h[:, :1], solo, return_array=True) is None
    assert mx.array_equal(create_attention_mask(h, solo, return_array=True),
                          create_causal_mask(3, 5))
    batch = BatchKVCache.from_single([solo, KVCache()])  # row 1: five padding slots
    batch.prepare(3)
    mask = create_attention_mask(mx.zeros((2, 3, 8)), batch, return_array=True)
    assert mask.shape == (2, 1, 3, 8)
    assert mx.array_equal(mask[0, 0], create_causal_mask(3, 5))
    assert not mask[1, 0, :, :5].any() and mx.array_equal(mask[1, 0, :, 5:], create_causal_mask(3))
    with pytest.raises(ValueError, match="sliding-window"):
        create_attention_mask(h, solo, window_size=4)


def test_pre_norm_hidden_keeps_greedy_output(ckpt):
    """--mtp-hidden pre_norm feeds the head the trunk's last residual instead: drafts
    change, output does not."""
    path = ckpt("glm4_moe", "noisy")
    model = load_model(path, mtp_hidden="pre_norm")[0]
    h_norm, h_mtp = model.trunk(mx.array([PROMPT]))
    assert not mx.array_equal(h_norm, h_mtp)
    assert mtp_tokens(model, PROMPT, 2)[0] == mlx_lm_greedy(mlx_lm_model(path), PROMPT)
