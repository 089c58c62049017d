"""A block drafter (DFlash) drafting in the one step: greedy output identical to plain
decoding on the Qwen3.5 hybrid (dense and MoE), an attention trunk (glm4_moe) and
Nemotron-H at every block width, alone and in a batch mixing sources; its context stays
aligned with each row's emitted tokens; sampled output follows the target distribution
(rejection sampling with the drafter's own q); a drafter that does not fit its trunk is
refused.

"Oracle" drafters are built on the tiny oracle trunks (an identity trunk whose next token
is ``t + 1``): its weights copy the anchor's embedding into every slot, so slot 1 is right
and slot 2 never is (a mean acceptance length of exactly 2), which pins the anchor and the
accept paths; random drafters exercise the reject paths."""

import mlx.core as mx
import pytest

from block_checks import assert_block_samples_follow_target, decode, decode_batch, make_oracle
from mlx_mtp.decode import block_context
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.block.load import BlockDrafterError, attach_block_drafter
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_attention import make_tiny as make_tiny_attention
from mlx_mtp.testing.tiny_block import make_tiny_dflash
from mlx_mtp.testing.tiny_special import make_tiny_nemotron_h

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54]]
N = 16
BLOCK = 5  # drafts per pass: up to 4


def _trunk(tmp_path_factory, family: str, head: str = "random"):
    path = tmp_path_factory.mktemp(f"{family}_{head}")
    if family in ("qwen3_5", "qwen3_5_moe"):
        return make_tiny(path, family, head)
    if family == "nemotron_h":
        return make_tiny_nemotron_h(path, head)
    return make_tiny_attention(path, family, head)


def _with_drafter(path, tmp, taps, oracle: bool = False, seed: int = 0, block: int = BLOCK):
    """The model at ``path`` drafting with a DFlash drafter of ``block`` positions."""
    model = load_model(path)[0]
    args = model.text.args
    extra = {"num_key_value_heads": 4} if oracle else {}
    drafter = make_tiny_dflash(tmp / f"dflash{seed}{oracle}{block}", args.hidden_size,
                               args.vocab_size, taps, args.num_hidden_layers, seed=seed,
                               block_size=block, **extra)
    attach_block_drafter(model, str(drafter))
    if oracle:
        make_oracle(model)
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafters")
    return {"random": _with_drafter(_trunk(tmp_path_factory, "qwen3_5"), tmp, [0, 2]),
            "oracle": _with_drafter(_trunk(tmp_path_factory, "qwen3_5", "oracle"), tmp, [1, 3],
                                    oracle=True)}


def test_greedy_identical_at_every_block_width_with_a_random_drafter(qwen):
    model = qwen["random"]
    plain, _ = decode(model, PROMPT, 0)
    for k in range(1, BLOCK):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"width {k}"
        assert dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0


def test_an_oracle_drafter_is_accepted_at_slot_one_exactly(qwen):
    model = qwen["oracle"]
    plain, _ = decode(model, PROMPT, 0)
    assert plain[:3] == [PROMPT[-1] + 1, PROMPT[-1] + 2, PROMPT[-1] + 3]  # the t+1 cycle
    got, dec = decode(model, PROMPT, 1)
    assert got == plain and dec.stats.acceptance_rate == 1.0  # every step: all, and the bonus
    for k in range(2, BLOCK):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"width {k}"
        s = dec.stats
        assert s.accepted_per_pos[0] == s.num_drafts and sum(s.accepted_per_pos[1:]) == 0
        assert s.by_source()["block"] == {"drafted": s.num_draft_tokens,
                                          "accepted": s.num_drafts}


def test_the_head_extends_the_block_fed_its_drafts(tmp_path_factory):
    """``block+mtp``: a one-draft block (slot 1, the oracle's right one) extended by the
    oracle MTP head, fed the block's token: every draft accepted at every K; the head alone
    after a random block is fed wrong tokens, yet the output is plain decoding's."""
    trunk = _trunk(tmp_path_factory, "qwen3_5", "oracle")
    tmp = tmp_path_factory.mktemp("fused")
    oracle = _with_drafter(trunk, tmp, [1, 3], oracle=True, block=2)
    plain, _ = decode(oracle, PROMPT, 0)
    for k in (2, 4):
        got, dec = decode(oracle, PROMPT, k, "block+mtp")
        s = dec.stats
        assert got == plain and s.acceptance_rate == 1.0, f"K={k}"
        assert s.block_draft_tokens == s.num_drafts
        assert s.head_draft_tokens == (k - 1) * s.num_drafts
    random = _with_drafter(trunk, tmp, [1, 3], block=3)
    got, dec = decode(random, PROMPT, 4, "block+mtp")
    assert got == plain and dec.stats.by_source()["block"]["drafted"] == 2 * dec.stats.num_drafts


def test_the_context_holds_every_emitted_row_as_a_fresh_prefill_would(qwen):
    """After speculative steps (verify rows kept up to each acceptance), the drafter's
    context equals one built from the taps of a plain pass over the emitted tokens."""
    model = qwen["oracle"]
    kk, drafter = DraftSources("block", adaptive=False).for_row(3)
    dec = MTPDecoder(model, kk, adaptive=False, drafter=drafter)
    dec.prefill(PROMPT)
    got = [t for _ in range(4) for t in dec.step().tokens]
    dec.finish_pending()
    seq = PROMPT + got[:-1]  # the last token is not in the trunk yet
    block_context.settle(model, dec.cache)  # the last verify's rows wait for the next pass
    ctx = block_context.context(model, dec.cache)
    fresh = block_context.make_cache(model)
    block_context.trunk(model, mx.array([seq]), fresh)
    for ours, want in zip(ctx, block_context.context(model, fresh)):
        assert ours.lengths() == want.lengths() == [len(seq)]
        for a, b in zip(ours.row_state(0), want.row_state(0)):
            assert mx.allclose(a, b, atol=1e-4).item()


def test_a_batch_mixing_sources_keeps_each_rows_tokens_and_acceptance(qwen):
    """Rows join one per step (different positions), with the block drafter, the head, the
    drafter again and context lookup with the head: every row decodes its plain tokens,
    and the oracle rows keep their own acceptance (slot 1, every step)."""
    model = qwen["oracle"]
    sources = ["block", "mtp", "block", "both"]
    want = [decode(model, p, 0)[0] for p in PROMPTS]
    for k in (1, 3):
        got, decs = decode_batch(model, PROMPTS, sources, k, N)
        assert got == want, f"K={k}"
        for i in (0, 2):
            s = decs[i].stats
            assert s.block_draft_tokens == s.num_draft_tokens > 0
            assert s.accepted_per_pos[0] == s.num_drafts
        assert decs[1].stats.block_draft_tokens == 0 < decs[1].stats.num_draft_tokens


@pytest.mark.parametrize("family,taps", [("qwen3_5_moe", [1, 2]), ("glm4_moe", [0, 1]),
                                         ("nemotron_h", [0, 2, 4])])
def test_greedy_identical_on_other_trunks(tmp_path_factory, family, taps):
    model = _with_drafter(_trunk(tmp_path_factory, family), tmp_path_factory.mktemp("d"), taps)
    plain, _ = decode(model, PROMPT, 0)
    for k in (1, 2, BLOCK - 1):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"{family} width {k}"
        assert dec.stats.block_draft_tokens > 0


def test_sampled_tokens_follow_the_target_distribution(qwen):
    """Two drafts from the drafter's own q (its slot 1 close to the target, slot 2 not),
    many seeds: the next two tokens follow the target's exact joint distribution
    (chi-square; temperature 40 and top-3 spread the oracle trunk's peaked logits over a
    few tokens), drafts often accepted and often rejected."""
    accepted = assert_block_samples_follow_target(qwen["oracle"], PROMPT[:4])
    assert 100 < accepted < 2 * 400  # slot 1 mostly accepted, slot 2 not always


def test_a_drafter_that_does_not_fit_its_trunk_is_refused(tmp_path_factory):
    path = _trunk(tmp_path_factory, "qwen3_5")
    model = load_model(path)[0]
    tmp = tmp_path_factory.mktemp("misfit")
    cases = {"hidden size 32": dict(hidden=32, vocab=512, taps=[0]),
             "vocabulary 256": dict(hidden=64, vocab=256, taps=[0]),
             # trained on a deeper trunk (its own config would refuse a tap past it)
             "taps layers [1, 4]": dict(hidden=64, vocab=512, taps=[1, 4], num_target_layers=8)}
    for i, (msg, kw) in enumerate(cases.items()):
        d = make_tiny_dflash(tmp / str(i), **{"num_target_layers": 4, **kw})
        with pytest.raises(BlockDrafterError, match=msg.replace("[", r"\[")) as e:
            attach_block_drafter(model, str(d))
        assert "\n" not in str(e.value)
    assert model.block_drafter is None


def test_a_prefix_state_carries_the_drafter_context(qwen):
    """A prompt state snapshotted mid-prompt (a prefix-cache entry) and restored into a new
    sequence holds the drafter's context too: decoding from it drafts and accepts exactly
    as from a fresh prefill."""
    model = qwen["oracle"]
    kk, _ = DraftSources("block", adaptive=False).for_row(3)

    def decoder():
        return MTPDecoder(model, kk, adaptive=False,
                          drafter=DraftSources("block", adaptive=False).drafter())

    fresh = decoder()
    fresh.prefill(PROMPT, snapshot_at=5)
    state = fresh.snapshot_state
    restored = decoder()
    restored.restore(state)
    restored.prefill(PROMPT)
    for ours, want in zip(block_context.context(model, restored.cache),
                          block_context.context(model, fresh.cache)):
        assert ours.lengths() == want.lengths() == [len(PROMPT) - 1]
        for a, b in zip(ours.row_state(0), want.row_state(0)):
            assert mx.array_equal(a, b).item()
    want = [t for _ in range(4) for t in fresh.step().tokens]
    assert [t for _ in range(4) for t in restored.step().tokens] == want
    assert restored.stats.to_dict() == fresh.stats.to_dict()
    assert restored.stats.accepted_per_pos[0] == restored.stats.num_drafts > 0


def test_a_model_loaded_without_its_head_drafts_from_the_block_drafter(tmp_path_factory):
    """``--no-mtp`` with a block drafter: no MTP head, no owed pairs; ``block`` rows draft
    from the drafter (``block+mtp`` too, the head having nothing to add), alone and beside
    a plain row, with plain decoding's tokens."""
    trunk = _trunk(tmp_path_factory, "qwen3_5", "oracle")
    model = load_model(trunk, mtp=False)[0]
    assert model.num_mtp_layers == 0
    drafter = make_tiny_dflash(tmp_path_factory.mktemp("headless"), 64, 512, [1, 3], 4,
                               block_size=BLOCK, num_key_value_heads=4)
    attach_block_drafter(model, str(drafter))
    make_oracle(model)
    plain, _ = decode(model, PROMPT, 0)
    for source in ("block", "block+mtp"):
        got, dec = decode(model, PROMPT, 3, source)
        assert got == plain and dec.mtp_cache is None and dec.row.owed is None
        s = dec.stats
        assert s.block_draft_tokens == s.num_draft_tokens == 3 * s.num_drafts > 0
        assert dec.stats.accepted_per_pos[0] == dec.stats.num_drafts
    with pytest.raises(ValueError, match="without an MTP head"):
        decode(model, PROMPT, 3, "mtp")
    bd = BatchDecoder(model, True, adaptive=False)
    for i, source in enumerate(("block", "mtp")):
        kk, row_drafter = DraftSources(source, adaptive=False).for_row(3, has_head=False)
        dec = MTPDecoder(model, kk, adaptive=False, drafter=row_drafter)
        dec.prefill(PROMPT)
        bd.add(i, dec)
    outs = {0: [], 1: []}
    while min(len(t) for t in outs.values()) < N:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    assert outs[0][:N] == outs[1][:N] == plain
