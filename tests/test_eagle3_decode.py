"""EAGLE-3 drafting in the one step, as the block kinds do (``test_block_kinds_decode``):
greedy output identical to plain decoding on the Qwen3.5 hybrid, an attention trunk
(glm4_moe) and Nemotron-H at every width, alone and in a batch of four mixing sources; the drafter's
context (its layers' K/V and the pending tap) stays aligned with each row's emitted tokens
through verifies, as a fresh prefill over them builds it; sampled output follows the
target's exact distribution (rejection sampling with the drafter's own q), by chi-square;
the taps it reads are the trunk residuals its speculators ids name (transformers'
``hidden_states[id]``: id 0 is the embedding output), checked against mlx-lm's layers.

Random drafters (``testing/tiny_block``, the speculators layout, a reduced draft vocabulary
mapped by ``d2t``) exercise the reject paths. The "oracle" drafter on the oracle trunk (an
identity trunk whose next token is ``t + 1``) attends only to its newest entry's token
(queries and keys are the token's normed embedding, scaled), so each pass predicts what the
target does after the token it was fed: every draft is right, at every depth."""

import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from block_checks import (assert_block_samples_follow_target, decode, decode_batch,
                          make_eagle3_oracle)
from family_checks import mlx_lm_model
from mlx_mtp.decode import block_context
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.sequence import check_state_fits
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.server.session_store import _state_from_tensors, _state_tensors
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_attention import make_tiny as make_tiny_attention
from mlx_mtp.testing.tiny_block import make_tiny_block
from mlx_mtp.testing.tiny_special import make_tiny_nemotron_h

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54]]
N = 12
BLOCK = 5  # 4 speculative tokens
FAMILIES = ["qwen3_5", "glm4_moe", "nemotron_h"]
FIXTURE = Path(__file__).parent / "fixtures" / "block_drafters" / "eagle3"


def _trunk(tmp_path_factory, family: str, head: str = "random"):
    path = tmp_path_factory.mktemp(f"{family}_{head}")
    if family == "qwen3_5":
        return make_tiny(path, family, head)
    if family == "nemotron_h":
        return make_tiny_nemotron_h(path, head)
    return make_tiny_attention(path, family, head, num_layers=4)


def _with_eagle(path, tmp, oracle: bool = False, sharpness: float = 4.0):
    """The model at ``path`` drafting with an EAGLE-3 drafter tapping layers 0, 2, 3: a
    random one over half the vocabulary, or the oracle (one head as wide as the layer,
    the target's head)."""
    model = load_model(path)[0]
    args = model.text.args
    H, V = args.hidden_size, args.vocab_size
    kw = (dict(num_attention_heads=1, num_key_value_heads=1, head_dim=H,
               norm_before_residual=True) if oracle else dict(draft_vocab_size=V // 2))
    drafter = make_tiny_block(tmp / f"eagle3{oracle}", "eagle3", H, V, [0, 2, 3],
                              args.num_hidden_layers, block_size=BLOCK, **kw)
    attach_block_drafter(model, str(drafter))
    assert model.block_drafter.spec.target_layer_ids == (0, 2, 3)
    if oracle:
        make_eagle3_oracle(model, sharpness)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def random_model(request, tmp_path_factory):
    return _with_eagle(_trunk(tmp_path_factory, request.param), tmp_path_factory.mktemp("d"))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return _with_eagle(_trunk(tmp_path_factory, "qwen3_5", "oracle"),
                       tmp_path_factory.mktemp("o"), oracle=True)


def test_greedy_identical_at_every_width(random_model):
    model = random_model
    plain, _ = decode(model, PROMPT, 0)
    for k in range(1, BLOCK):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"width {k}"
        assert dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0
    got, dec = decode(model, PROMPT, BLOCK + 1, "block+mtp")
    assert got == plain and dec.stats.head_draft_tokens > 0 < dec.stats.block_draft_tokens


def test_a_batch_of_four_mixing_sources_decodes_each_rows_plain_tokens(random_model):
    """Rows join one per step (different context lengths): the drafter, the head, the
    drafter chained with the head, lookup with the head."""
    model = random_model
    want = [decode(model, p, 0, n=N)[0] for p in PROMPTS]
    got, decs = decode_batch(model, PROMPTS, ["block", "mtp", "block+mtp", "both"], 3, N)
    assert got == want
    assert [d.stats.block_draft_tokens > 0 for d in decs] == [True, False, True, False]


def test_an_oracle_drafter_is_accepted_at_every_depth(oracle):
    plain, _ = decode(oracle, PROMPT, 0)
    assert plain[:3] == [PROMPT[-1] + 1, PROMPT[-1] + 2, PROMPT[-1] + 3]  # the t+1 cycle
    for k in range(1, BLOCK):
        got, dec = decode(oracle, PROMPT, k)
        assert got == plain and dec.stats.acceptance_rate == 1.0, f"width {k}"


def test_a_batch_keeps_each_rows_own_acceptance(oracle):
    """The oracle rows accept every draft beside rows whose head drafts are random (no
    clamping to the batch's least acceptance); every row decodes its plain tokens."""
    want = [decode(oracle, p, 0, n=N)[0] for p in PROMPTS]
    got, decs = decode_batch(oracle, PROMPTS, ["block", "mtp", "block", "both"], 4, N)
    assert got == want
    for i in (0, 2):
        s = decs[i].stats
        assert s.block_draft_tokens == s.num_draft_tokens > 0 and s.acceptance_rate == 1.0


def _assert_same_context(model, cache, seq):
    """``cache``'s drafter context equals a fresh prefill's over ``seq`` (the row's tokens
    in the trunk): each layer's K/V, entry for entry, and the pending tap."""
    fresh = block_context.make_cache(model)
    block_context.trunk(model, mx.array([seq]), fresh)
    block_context.settle(model, cache)  # the rows decode steps ran wait for the next pass
    ours, want = block_context.context(model, cache), block_context.context(model, fresh)
    for a, b in zip(ours, want):
        assert a.lengths() == b.lengths() == [len(seq) - 1]  # (tap t, token t+1) pairs
        for x, y in zip(a.row_state(0), b.row_state(0)):
            assert mx.allclose(x, y, atol=1e-4).item()
    H, dtype = model.text.args.hidden_size, mx.float32
    assert mx.allclose(ours[0].pending_rows(1, H, dtype), want[0].pending_rows(1, H, dtype),
                       atol=1e-4).item()


def test_the_context_holds_every_emitted_row_as_a_fresh_prefill_would(random_model):
    """After speculative steps (each verify's rows entered, the rejected dropped by
    ``accept``, the pending moved to the last kept row's tap), the context is what a plain
    pass over the emitted tokens builds."""
    model = random_model
    kk, drafter = DraftSources("block", adaptive=False).for_row(3)
    dec = MTPDecoder(model, kk, adaptive=False, drafter=drafter)
    dec.prefill(PROMPT)
    got = [t for _ in range(4) for t in dec.step().tokens]
    dec.finish_pending()
    _assert_same_context(model, dec.cache, PROMPT + got[:-1])  # the last is not in the trunk


def test_a_prefix_or_disk_state_carries_the_context(random_model):
    """A prompt state snapshotted mid-prompt (a prefix-cache entry) and one saved and
    loaded as a disk session (``session_store``: each cache's ``state``/``meta_state`` under
    its kind) hold the drafter's context and pending tap: prefilling the rest of the prompt
    from either builds a fresh prefill's context, and decoding drafts, accepts and emits as
    from the fresh one."""
    model = random_model
    kk, _ = DraftSources("block", adaptive=False).for_row(3)

    def decoder():
        return MTPDecoder(model, kk, adaptive=False,
                          drafter=DraftSources("block", adaptive=False).drafter())

    fresh = decoder()
    fresh.prefill(PROMPT, snapshot_at=5)
    saved = _state_from_tensors(*_state_tensors(fresh.snapshot_state))
    check_state_fits(saved, block_context.make_cache(model), model.make_mtp_cache())
    want = [t for _ in range(4) for t in fresh.step().tokens]
    for state in (fresh.snapshot_state, saved):
        restored = decoder()
        restored.restore(state)
        restored.prefill(PROMPT)
        _assert_same_context(model, restored.cache, PROMPT[:-1])
        assert [t for _ in range(4) for t in restored.step().tokens] == want
        assert restored.stats.to_dict() == fresh.stats.to_dict()


def test_sampled_tokens_follow_the_target_distribution(tmp_path_factory):
    """Two drafts from the drafter's own q, many seeds: the next two tokens follow the
    target's exact joint distribution (temperature 40 and top-3 spread the oracle trunk's
    peaked logits over a few tokens). A blunt oracle (its attention mixes the context's
    tokens into each pass) makes q differ from the target's p: about a third of the drafts
    are accepted, the rest rejected and resampled from the residual."""
    model = _with_eagle(_trunk(tmp_path_factory, "qwen3_5", "oracle"),
                        tmp_path_factory.mktemp("blunt"), oracle=True, sharpness=0.2)
    accepted = assert_block_samples_follow_target(model, PROMPT[:4])
    assert 150 < accepted < 600


def test_the_taps_are_the_residuals_the_speculators_ids_name(tmp_path_factory):
    """ids [1, 3, 4] in the config (transformers' ``hidden_states`` index, 0 the embedding
    output; mlx-vlm taps layer id - 1) are the residuals after layers 0, 2, 3: the taps a
    prefill hands the drafter equal mlx-lm's layers run one by one."""
    path = _trunk(tmp_path_factory, "glm4_moe")
    model = _with_eagle(path, tmp_path_factory.mktemp("t"))
    seen = []
    model.block_drafter.add_context = lambda taps, *a: seen.append(taps)
    block_context.trunk(model, mx.array([PROMPT]), block_context.make_cache(model))
    ref = mlx_lm_model(path).model
    hidden_states = [ref.embed_tokens(mx.array([PROMPT]))]
    for layer in ref.layers:
        hidden_states.append(layer(hidden_states[-1], "causal", None))
    for tap, i in zip(seen[0], [1, 3, 4]):
        np.testing.assert_allclose(np.array(tap), np.array(hidden_states[i]), atol=1e-5)


def test_the_published_layout_loads_and_drafts_in_the_step(tmp_path):
    """The mlx-vlm parity fixture (legacy ``midlayer.*`` names, a 64-token draft vocabulary,
    ids [2, 4, 6]) through ``--draft-model``'s loader, on a trunk of its shape: greedy
    output is plain decoding's at every width."""
    model = load_model(make_tiny(tmp_path / "t", "qwen3_5", vocab_size=256, num_layers=8))[0]
    drafter = tmp_path / "eagle3"  # the drafter's files, without the recorded reference
    drafter.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, drafter / name)
    attach_block_drafter(model, str(drafter))
    assert model.block_drafter.spec.target_layer_ids == (1, 3, 5)
    plain, _ = decode(model, PROMPT, 0, n=N)
    for k in range(1, BLOCK):
        got, dec = decode(model, PROMPT, k, n=N)
        assert got == plain and dec.stats.block_draft_tokens > 0, f"width {k}"


def test_generate_drafts_with_an_eagle3_drafter(tiny_ckpt, tmp_path, cli):
    """``--draft-model`` naming an EAGLE-3 drafter: ``generate`` drafts with it
    (``--draft-source block``, and the default ``block+mtp``) and prints plain decoding's
    text; ``inspect`` reports its kind, its 0-based taps and its block."""
    trunk = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    eagle = make_tiny_block(tmp_path / "eagle3", "eagle3", 64, 4096, [0, 2, 3], 4,
                            block_size=4, draft_vocab_size=1024)
    gen = ["generate", "--model", str(trunk), "--prompt", "def f():", "-m", "12", "--temp", "0"]
    code, plain, err = cli(*gen, "--verbose", "False", "--no-mtp")
    assert code == 0, err
    code, out, err = cli(*gen, "--draft-model", str(eagle), "--draft-source", "block",
                         "--fixed-k", "--num-draft-tokens", "3")
    assert code == 0 and plain.strip() in out, out + err
    assert re.search(r"head 0/0, block \d+/[1-9]\d*", out), out
    code, quiet, err = cli(*gen, "--draft-model", str(eagle), "--verbose", "False")
    assert code == 0 and quiet == plain, err
    code, out, err = cli("inspect", str(eagle))
    assert code == 0 and "eagle3 block drafter" in out and "[0, 2, 3]" in out, out + err
    assert "3 drafts, one pass each" in out, out
