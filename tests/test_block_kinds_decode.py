"""DFlash2 and DSpark drafting in the one step, as DFlash does (``test_block_drafter_decode``):
greedy output identical to plain decoding on the Qwen3.5 hybrid at every width, alone and in
a batch of four mixing sources; sampled output follows the target's exact distribution
(rejection sampling with the kind's own q: DFlash2's selector softmax over its candidates,
DSpark's Markov-corrected softmax), checked by chi-square.

Drafters are random-weight ones in their published layouts (``testing/tiny_block``). For the
chi-square test an "oracle" body (every slot's output is the anchor's embedding; see
``test_block_drafter_decode._make_oracle``) drafts on the identity trunk, and each kind's own
part stays random (DFlash2's selector scores, DSpark's Markov bias), so q differs from the
plain softmax of the block's logits and both accepts and rejects happen."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from distribution_check import assert_follows, sample_outcomes, two_token_joint
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.drafters.block.load import (BlockDrafterError, attach_block_drafter,
                                          load_block_drafter)
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54]]
N = 12
BLOCK = 4
# kind, whether a DSpark drafter ships its own embedding and head
KINDS = [("dflash2", False), ("dspark", True), ("dspark", False)]
IDS = ["dflash2", "dspark_own_head", "dspark_target_head"]


def _with_drafter(tmp, head: str, kind: str, own: bool, oracle: bool = False):
    model = load_model(make_tiny(tmp / f"trunk_{head}", "qwen3_5", head))[0]
    args = model.text.args
    extra = {"num_key_value_heads": 4} if oracle else {}
    drafter = make_tiny_block(tmp / f"{kind}{own}{oracle}", kind, args.hidden_size,
                              args.vocab_size, [0, 2], args.num_hidden_layers,
                              own_embed_head=own, block_size=BLOCK, **extra)
    attach_block_drafter(model, str(drafter))
    assert model.block_drafter.spec.kind == kind
    if oracle:
        _make_oracle(model)
    return model


def _make_oracle(model):
    """The DFlash oracle body (slot outputs = the anchor's embedding, normed as the trunk's
    final norm); DFlash2's convolutions become identities (base kernel 1 at shift 0)."""
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


def _decode(model, prompt, k: int, source: str = "block", sampling=SamplingParams(), n=N):
    kk, drafter = DraftSources(source, adaptive=False).for_row(k)
    dec = MTPDecoder(model, kk, sampling, adaptive=False, drafter=drafter)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


@pytest.mark.parametrize("kind,own", KINDS, ids=IDS)
def test_greedy_identical_at_every_width(tmp_path, kind, own):
    model = _with_drafter(tmp_path, "random", kind, own)
    plain, _ = _decode(model, PROMPT, 0)
    for k in range(1, model.block_drafter.spec.max_draft + 1):
        got, dec = _decode(model, PROMPT, k)
        assert got == plain, f"{kind} width {k}"
        assert dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0
    got, dec = _decode(model, PROMPT, BLOCK + 1, "block+mtp")
    assert got == plain and dec.stats.head_draft_tokens > 0 < dec.stats.block_draft_tokens


@pytest.mark.parametrize("kind,own", KINDS[:2], ids=IDS[:2])
def test_a_batch_of_four_mixing_sources_decodes_each_rows_plain_tokens(tmp_path, kind, own):
    """Rows join one per step (different context lengths): the drafter, the head, the
    drafter chained with the head, lookup with the head."""
    model = _with_drafter(tmp_path, "random", kind, own)
    sources = ["block", "mtp", "block+mtp", "both"]
    want = [_decode(model, p, 0)[0] for p in PROMPTS]
    bd = BatchDecoder(model, True, adaptive=False)
    outs, decs = {}, []
    for i, (p, source) in enumerate(zip(PROMPTS, sources)):
        kk, drafter = DraftSources(source, adaptive=False).for_row(3)
        dec = MTPDecoder(model, kk, adaptive=False, drafter=drafter)
        dec.prefill(p)
        bd.add(i, dec)
        decs.append(dec)
        outs[i] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while min(len(t) for t in outs.values()) < N:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    assert [outs[i][:N] for i in range(len(PROMPTS))] == want
    assert [d.stats.block_draft_tokens > 0 for d in decs] == [True, False, True, False]


@pytest.mark.parametrize("kind,own", [KINDS[0], KINDS[2]], ids=[IDS[0], IDS[2]])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, kind, own):
    """Two drafts from the kind's own q, many seeds: the next two tokens follow the target's
    exact joint distribution (temperature 40 and top-3 spread the oracle trunk's peaked
    logits over a few tokens), drafts accepted and rejected."""
    model = _with_drafter(tmp_path, "oracle", kind, own, oracle=True)
    prompt = PROMPT[:4]
    T, top = 40.0, 3

    def target(prefix):
        logits = np.array(model(mx.array([prompt + prefix]))[0, -1], np.float64) / T
        keep = np.argsort(logits)[-top:]
        p = np.zeros_like(logits)
        p[keep] = np.exp(logits[keep] - logits[keep].max())
        return p / p.sum()

    block = []

    def draw(seed):
        got, dec = _decode(model, prompt, 2, sampling=SamplingParams(temperature=T, top_k=top),
                           n=2)
        block.append(dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0)
        return got, dec

    seen, accepted = sample_outcomes(draw, 400)
    assert all(block)
    assert 50 < accepted < 2 * 400
    assert_follows(seen, two_token_joint(target), 400)


def test_an_eagle3_drafter_is_refused_at_load():
    """EAGLE-3 caches its own drafts per row and rolls back uniformly: it runs standalone
    (``test_block_kinds``) but does not draft in the step yet."""
    eagle3 = Path(__file__).parent / "fixtures" / "block_drafters" / "eagle3"
    with pytest.raises(BlockDrafterError, match="EAGLE-3 drafters run standalone only for "
                                                "now$") as e:
        load_block_drafter(str(eagle3))
    assert "\n" not in str(e.value)
