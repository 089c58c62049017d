"""A block drafter that does not pay pauses, as the head does (issue 36, "No harm"): decoded
on the tiny fixtures with adaptive choices and step times from a fixed machine model
(``SyntheticClock``: counts, never the wall clock).

A random drafter (never right) drafts a few positions in its first steps, then only probes
(the first after ``RECHECKS[1]`` steps, then at doubling gaps): at most a few drafts per 64
tokens. The "oracle" drafter (``block_checks
.make_oracle``: slot 1 right, slot 2 never) keeps drafting; one the shared evidence paused
resumes after a probe lands. Greedy output equals plain decoding throughout, and a paused
drafter's context (every emitted row's taps, through plain steps; EAGLE-3's pending tap
too) equals a fresh prefill's when it resumes. Rows of one batch choose for themselves."""

import mlx.core as mx
import pytest

from block_checks import decode, make_oracle
from mlx_mtp.decode import block_context
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.block_policy import RECHECKS
from mlx_mtp.decode.draft_source import DraftPlan, DraftSources
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block, make_tiny_dflash

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54],
           [9, 8, 7], [200, 1], [13, 21, 34, 55], [77, 78, 79]]
BLOCK = 5  # drafts per pass: up to 4
N_BATCH = 40  # steps of the batch of eight
PLAIN, PER_POSITION, HEAD_PASS, BLOCK_PASS = 10.0, 0.5, 2.0, 6.0  # ms


class SyntheticClock(DraftPolicy):
    """The policy, with each timed step's seconds replaced by what a fixed machine takes
    for its shape: a plain step, each verified position, head pass and drafter pass."""

    def record_step(self, B, k, seconds, accepted=(), ks=None, starts=None, head_passes=None,
                    contexts=None, block=0):
        if seconds is not None:
            head = k if head_passes is None else head_passes
            seconds = PLAIN + PER_POSITION * k + HEAD_PASS * head + BLOCK_PASS * block
        super().record_step(B, k, seconds, accepted, ks, starts, head_passes, contexts, block)


def _model(tmp_path_factory, kind: str, oracle: bool):
    tmp = tmp_path_factory.mktemp(f"{kind}{oracle}")
    model = load_model(make_tiny(tmp / "trunk", "qwen3_5", "oracle" if oracle else "random"))[0]
    args = model.text.args
    H, V, L = args.hidden_size, args.vocab_size, args.num_hidden_layers
    if kind == "dflash":
        extra = {"num_key_value_heads": 4} if oracle else {}
        drafter = make_tiny_dflash(tmp / "d", H, V, [1, 3] if oracle else [0, 2], L,
                                   block_size=BLOCK, **extra)
    else:
        drafter = make_tiny_block(tmp / "d", "eagle3", H, V, [0, 2, 3], L, block_size=BLOCK,
                                  draft_vocab_size=V // 2)
    attach_block_drafter(model, str(drafter))
    if oracle:
        make_oracle(model)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {"random": _model(tmp_path_factory, "dflash", False),
            "oracle": _model(tmp_path_factory, "dflash", True),
            "eagle3": _model(tmp_path_factory, "eagle3", False)}


def _adaptive(model, prompt, n: int, source="block", sources=None, k=BLOCK - 1, policy=None,
              overlap=True):
    """At least ``n`` tokens drafted by adaptive choice on the synthetic clock: every token
    emitted, each step's output and the decoder."""
    sources = sources or DraftSources(source)
    kk, drafter = sources.for_row(k)
    dec = MTPDecoder(model, kk, policy=policy or SyntheticClock(), drafter=drafter,
                     overlap=overlap)
    dec.prefill(prompt)
    tokens, outs = [], []
    while len(tokens) < n:
        outs.append(dec.step())
        tokens += outs[-1].tokens
    dec.finish_pending()
    return tokens, outs, dec


def _assert_same_context(model, dec, tokens):
    """The drafter's context after ``tokens`` (the last one not yet in the trunk) equals a
    fresh prefill's over the prompt and them: entries and, for EAGLE-3, the pending tap."""
    seq = PROMPT + tokens[:-1]
    fresh = block_context.make_cache(model)
    block_context.trunk(model, mx.array([seq]), fresh)
    block_context.settle(model, dec.cache)  # the taps deferred since the last drafter pass
    ours, want = block_context.context(model, dec.cache), block_context.context(model, fresh)
    for a, b in zip(ours, want):
        assert a.lengths() == b.lengths()
        for x, y in zip(a.row_state(0), b.row_state(0)):
            assert mx.allclose(x, y, atol=1e-4).item()
    if model.block_drafter.spec.autoregressive:
        H = model.text.args.hidden_size
        assert mx.allclose(ours[0].pending_rows(1, H, mx.float32),
                           want[0].pending_rows(1, H, mx.float32), atol=1e-4).item()


@pytest.mark.parametrize("source", ["block", "block+mtp"])
def test_a_useless_drafter_pauses_within_a_few_steps(models, source):
    """A random drafter (and head) on a random trunk: a few one-position drafts, then probes
    (the first after ``RECHECKS[1]`` steps: none may come within these 64 tokens); at most 8
    drafts in 64 tokens, plain decoding's output."""
    model = models["random"]
    plain, _ = decode(model, PROMPT, 0, n=64)
    got, outs, dec = _adaptive(model, PROMPT, 64, source)
    assert got[:64] == plain
    drafting = [i for i, o in enumerate(outs) if o.block_drafted]
    assert dec.stats.block_draft_tokens == len(drafting) <= 8  # one position each
    assert dec.stats.block_accepted_tokens == 0
    first = drafting[:DraftSources().first_misses]  # its first misses (fewer: paused by cost)
    assert (drafting + [len(outs)])[len(first)] - first[-1] >= 4  # paused after them
    assert outs[0].block_drafted == 0  # a plain step is timed first


def test_an_oracle_drafter_keeps_drafting(models):
    """Slot 1 always lands, slot 2 never: on a machine whose plain step is timed (as a stored
    cost table gives it: a plain cell timed once or twice is probed again, as the head's),
    every step drafts from the block (slot 2 while its estimate still allows) and its slot-1
    draft is accepted."""
    model = models["oracle"]
    plain, _ = decode(model, PROMPT, 0, n=32)
    timed = SyntheticClock()
    for _ in range(3):
        timed.record_step(1, 0, PLAIN)
    got, outs, dec = _adaptive(model, PROMPT, 32, policy=timed)
    assert got[:32] == plain
    first = next(i for i, o in enumerate(outs) if o.block_drafted)
    assert first <= 4 and all(o.block_drafted >= o.num_accepted == 1 for o in outs[first:])
    assert dec.stats.block_accepted_tokens == len(outs) - first


@pytest.mark.parametrize("name", ["oracle", "random", "eagle3"])
def test_greedy_and_the_context_stay_exact_across_a_pause_and_a_resume(models, name):
    """The shared evidence says the drafter never landed: a row starts paused (plain steps,
    no drafter pass), probes after ``RECHECKS[1]`` steps (a drafter that never landed); the
    oracle's probe lands and it drafts again for good; the random drafters pause again. Output
    is plain decoding's, and the context equals a fresh prefill's over every emitted token."""
    model = models[name]
    sources = DraftSources("block")
    for _ in range(sources.first_misses):
        sources.block_landed(1, 0)
    # no plain step launched ahead past the last one read: the context ends at its tokens
    got, outs, dec = _adaptive(model, PROMPT, RECHECKS[1] + 16, sources=sources, overlap=False)
    plain, _ = decode(model, PROMPT, 0, n=len(got))
    assert got == plain
    drafting = [i for i, o in enumerate(outs) if o.block_drafted]
    assert drafting and drafting[0] >= 4  # paused, then a probe
    if name == "oracle":
        assert drafting == list(range(drafting[0], len(outs)))  # resumed for good
    _assert_same_context(model, dec, got)


def test_batch_rows_choose_for_themselves(models, monkeypatch):
    """Eight rows on the oracle: four whose own steps showed the drafter landing, four whose
    steps showed it missing. In one step the first draft and the others rest (no clamping
    to the batch; the drafter's pass runs over the drafting rows only); the resting rows'
    probes land (every 4 steps, as the head's re-checks after one lands) and they draft again
    once their own estimate pays; every row decodes its plain tokens and keeps its own
    acceptance."""
    model = models["oracle"]
    passes = []  # rows of each drafter pass
    propose = model.block_drafter.propose

    def counted(anchor, cache, n, draw):
        passes.append(anchor.shape[0])
        return propose(anchor, cache, n, draw)

    monkeypatch.setattr(model.block_drafter, "propose", counted)
    sources = DraftSources("block")
    rows = [sources.for_row(BLOCK - 1) for _ in PROMPTS]
    for i, (_, drafter) in enumerate(rows):
        for _ in range(8 if i % 2 else 20):
            drafter.record(DraftPlan(block=1), 0 if i % 2 else 1)
    bd = BatchDecoder(model, True, policy=SyntheticClock())
    decs = [MTPDecoder(model, kk, drafter=drafter) for kk, drafter in rows]
    for i, (d, p) in enumerate(zip(decs, PROMPTS)):
        d.prefill(p)
        bd.add(i, d)
    outs = [bd.step() for _ in range(N_BATCH)]
    steps = [[o[i].block_drafted for i in range(len(PROMPTS))] for o in outs]
    split = [s for s in steps if all(s[0::2]) and not any(s[1::2])]
    assert len(split) >= 2, steps  # the rows that land draft while the others rest
    assert passes == [sum(map(bool, s)) for s in steps if any(s)]
    assert all(steps[-1]), steps  # the others' probes landed: they draft again
    for i, p in enumerate(PROMPTS):
        want, _ = decode(model, p, 0, n=N_BATCH)
        got = [t for o in outs for t in o[i].tokens][:N_BATCH]
        assert got == want, i
        s = decs[i].stats  # slot 1 of every step's block, none past it
        assert s.block_accepted_tokens == s.block_drafts > 0, i
