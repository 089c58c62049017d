"""FP8 releases of the DSA families (DeepSeek-V3.2 ships FP8 only; GLM-5 has -FP8 repos):
``add-mtp`` grafts the head from an FP8 Hugging Face original onto an mlx-lm conversion of
it, and the result decodes as the original does (same tokens, same drafts accepted)."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.convert.add_mtp import add_mtp
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.layout import MissingMTPWeightsError
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_dsa

PROMPT = [1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18, 64, 2, 90]  # past index_topk (6)


def decode(model, k, n=16):
    dec = MTPDecoder(model, k, adaptive=False)
    toks = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]
    return toks, dec.stats.num_accepted_tokens


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_add_mtp_from_an_fp8_original_onto_an_mlx_lm_conversion(tmp_path, family):
    from mlx_lm import convert as mlx_lm_convert

    src = make_tiny_dsa(tmp_path / "src", family, "noisy", fp8=True)
    keys = {k for f in src.glob("*.safetensors") for k in mx.load(str(f))}
    assert "model.layers.2.self_attn.q_a_proj.weight_scale_inv" in keys  # the head is FP8
    assert "model.layers.2.eh_proj.weight_scale_inv" not in keys  # eh_proj is bf16, as released
    dst = tmp_path / "mlx-community"
    mlx_lm_convert(str(src), str(dst))  # dequantizes FP8 (bf16) and drops the MTP layer
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    add_mtp(dst, src, verbose=False)
    grafted, original = load_model(dst)[0], load_model(src)[0]
    want = dict(tree_flatten(original.mtp.parameters()))
    got = dict(tree_flatten(grafted.mtp.parameters()))
    assert got.keys() == want.keys()
    for k in want:  # the FP8 blocks dequantized exactly as loading the original does
        assert mx.array_equal(got[k].astype(mx.float32), want[k].astype(mx.float32)), k
    plain = mlx_lm_load_model(dst)[0]  # plain mlx-lm still loads it, without the head
    ref = [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), plain, max_tokens=16)]
    toks, accepted = decode(grafted, 2)
    assert toks == ref and accepted > 0
    assert (toks, accepted) == decode(original, 2)  # the original's output and drafts
