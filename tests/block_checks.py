"""What the block-drafter decoding tests share, written once: decoding one prompt with a
draft source, the "oracle" drafter bodies (DFlash's; EAGLE-3's, also written to disk for
the command line), a batch of rows joining one per step, and the chi-square check of
sampled tokens drafted from the drafter's own q."""

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from distribution_check import assert_follows, sample_outcomes, two_token_joint
from family_checks import run_batch
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_block import make_tiny_block


def decode(model, prompt, k: int, source: str = "block", sampling=SamplingParams(), n=16):
    kk, drafter = DraftSources(source, adaptive=False).for_row(k)
    dec = MTPDecoder(model, kk, sampling, adaptive=False, drafter=drafter)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


def make_oracle(model):
    """Slot j's output is the anchor's embedding (the mask token embeds to zero, the context
    projects to zero, attention is uniform, v/o pass through; DFlash2's convolutions are
    identities), normed as the trunk's final norm does: on an identity trunk the drafter
    predicts what the target does after the anchor, at every slot. A kind's own scoring
    (DFlash2's selector, DSpark's Markov bias) stays as it is."""
    text, d = model.text, model.block_drafter
    H, V, mask = text.args.hidden_size, text.args.vocab_size, d.spec.mask_token_id
    emb = text.model.embed_tokens.weight
    text.model.embed_tokens.weight = mx.where(mx.arange(V)[:, None] == mask, 0.0, emb)
    layer = d.layers[0]
    layer.self_attn.q_proj.weight = mx.zeros_like(layer.self_attn.q_proj.weight)
    layer.self_attn.v_proj.weight = mx.eye(H)
    layer.self_attn.o_proj.weight = mx.eye(H)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    layer.input_layernorm.weight = mx.ones((H,))
    for conv in (layer.attention_conv, layer.mlp_conv) if d.spec.kind == "dflash2" else ():
        conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
        conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    d.fc.weight = mx.zeros_like(d.fc.weight)
    d.norm.weight = text.model.norm.weight


def make_eagle3_oracle(model, sharpness: float = 4.0):
    """Layer 0's attention sees [normed token embedding, 0] (``hidden_norm`` zeroed, which
    is also the residual under ``norm_before_residual``); its queries and keys are the
    token half scaled by ``sharpness``, so with RoPE an entry scores highest against
    itself; values and output pass the token half through, the MLP adds nothing, and the
    final norm is the trunk's: the output is scored as the trunk scores that token."""
    text, d = model.text, model.block_drafter
    H = text.args.hidden_size
    token_half = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1)
    layer = d.layers[0]
    attn = layer.self_attn
    attn.q_proj.weight = attn.k_proj.weight = sharpness * token_half
    attn.v_proj.weight, attn.o_proj.weight = token_half, mx.eye(H)
    layer.hidden_norm.weight = mx.zeros((H,))
    layer.input_layernorm.weight = mx.ones((H,))
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    d.norm.weight = text.model.norm.weight
    mx.eval(d.parameters())


def write_eagle3_oracle(trunk, path, block_size: int = 4) -> Path:
    """``make_eagle3_oracle``'s drafter for the oracle trunk at ``trunk`` (tapping layers 0,
    2, 3), saved in the speculators layout at ``path``: right at every depth."""
    model = load_model(trunk)[0]
    args = model.text.args
    H = args.hidden_size
    path = make_tiny_block(path, "eagle3", H, args.vocab_size, [0, 2, 3],
                           args.num_hidden_layers, block_size=block_size,
                           num_attention_heads=1, num_key_value_heads=1, head_dim=H,
                           norm_before_residual=True)
    attach_block_drafter(model, str(path))
    make_eagle3_oracle(model)
    file = str(path / "model.safetensors")
    params = dict(tree_flatten(model.block_drafter.parameters()))
    mx.save_safetensors(file, {k: params[k] for k in mx.load(file)}, metadata={"format": "mlx"})
    return path


def decode_batch(model, prompts, sources, k: int, n: int):
    """Rows joining one per step (different positions), each with its draft source: their
    first ``n`` tokens and their decoders."""
    decs = []
    for source in sources:
        kk, drafter = DraftSources(source, adaptive=False).for_row(k)
        decs.append(MTPDecoder(model, kk, adaptive=False, drafter=drafter))
    return run_batch(model, k, prompts, n, decs)[0], decs


def assert_block_samples_follow_target(model, prompt, samples: int = 400):
    """Two drafts from the block drafter's own q, many seeds: the next two tokens follow the
    target's exact joint distribution (temperature 40 and top-3 spread the oracle trunk's
    peaked logits over a few tokens). Returns the drafts accepted in all."""
    T, top = 40.0, 3

    def target(prefix):
        logits = np.array(model(mx.array([prompt + prefix]))[0, -1], np.float64) / T
        keep = np.argsort(logits)[-top:]
        p = np.zeros_like(logits)
        p[keep] = np.exp(logits[keep] - logits[keep].max())
        return p / p.sum()

    block = []

    def draw(seed):  # unseeded: a seeded row drafts from the head (its own K schedule)
        got, dec = decode(model, prompt, 2, sampling=SamplingParams(temperature=T, top_k=top),
                          n=2)
        block.append(dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0)
        return got, dec

    seen, accepted = sample_outcomes(draw, samples)
    assert all(block)
    assert_follows(seen, two_token_joint(target), samples)
    return accepted
