"""A draft source plugs in through the drafters' registry alone (drafters/registry.py):
a toy drafter, defined here, drafts in a batch beside the head (its run extended by the
head, next to a row drafting from the head only) and greedy output stays plain decoding's."""

import pytest

from mlx_mtp import decode
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.drafters.base import Drafter
from mlx_mtp.drafters.registry import SOURCES, register

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 90, 91], [200, 17, 18, 19]]
N_TOKENS = 24


class CountingRun(Drafter):
    """Proposes the next three integers after the row's last token, the second one wrong
    after a multiple of 3 (the tiny oracle trunk counts up): deterministic (a function of
    emitted tokens), free (no model pass), shorter than ``max_draft`` so the head extends
    it."""

    name = "counting"
    max_draft = 8

    def __init__(self, settings):
        self.last = None
        self.observed = []

    def sync(self, prompt):
        self.last = prompt[-1]

    def extend(self, tokens):
        self.last = tokens[-1]

    def propose(self):
        return [(self.last + i) % 512 for i in (1, 9 if self.last % 3 == 0 else 2, 3)]

    def observe(self, drafted, accepted):
        self.observed.append((drafted, accepted))


@pytest.fixture
def counting():
    register("counting", CountingRun, head=True)  # the one line a new source needs
    yield
    del SOURCES["counting"]


def _plain(model, prompt):
    dec = MTPDecoder(model, 0, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=N_TOKENS)]


def test_a_registered_source_is_a_draft_source_value(counting):
    assert "counting" in decode.DRAFT_SOURCES
    assert decode.check_draft_source("counting") == "counting"
    k, drafter = DraftSources("mtp").for_row(3, source="counting")
    assert k == 3 and isinstance(drafter.drafter, CountingRun)


def test_a_toy_source_drafts_beside_the_head_and_keeps_greedy_output(tiny_model, counting):
    model = tiny_model
    sources = DraftSources("counting", adaptive=False)
    bd = BatchDecoder(model, adaptive=False)
    outs = {}
    for i, prompt in enumerate(PROMPTS):
        drafter = None if i == 1 else sources.drafter()  # row 1 drafts from the head only
        dec = MTPDecoder(model, 2, adaptive=False, drafter=drafter)
        dec.prefill(prompt)
        bd.add(i, dec)
        outs[i] = []
    while min(len(t) for t in outs.values()) < N_TOKENS:
        for key, out in bd.step().items():
            outs[key] += out.tokens
    for i, prompt in enumerate(PROMPTS):
        assert outs[i][:N_TOKENS] == _plain(model, prompt), f"row {i}"
    rows = bd.rows
    assert rows[0].stats.lookup_draft_tokens > 0 and rows[1].stats.lookup_draft_tokens == 0
    # The head chained after the toy's run in the same rows, and both were told the outcome.
    assert all(r.stats.num_draft_tokens > r.stats.lookup_draft_tokens for r in rows)
    observed = rows[0].drafter.drafter.observed
    assert all(d == 3 for d, _ in observed) and {1, 3} <= {a for _, a in observed}


def test_a_source_the_step_cannot_feed_is_refused_when_a_row_takes_it(counting):
    class Tapping(CountingRun):
        needs_taps = True

    register("tapping", Tapping, head=False)
    try:
        with pytest.raises(ValueError, match="no trunk taps"):
            DraftSources("tapping").drafter()
    finally:
        del SOURCES["tapping"]


def test_the_head_chain_starts_each_draft_and_the_step_once(tiny_model, monkeypatch):
    """``mx.async_eval`` per step: one per head pass (its drafts start as drawn) and the
    step's own; moving the chain into drafters/ added none."""
    import mlx.core as mx

    import mlx_mtp.decode.step as step_module
    import mlx_mtp.drafters.mtp_head as head_module

    calls = []

    class Counting:
        def __getattr__(self, name):
            if name == "async_eval":
                return lambda *a: (calls.append(1), mx.async_eval(*a))[1]
            return getattr(mx, name)

    dec = MTPDecoder(tiny_model, 3, adaptive=False)
    dec.prefill(PROMPTS[0])
    dec.step()  # the first step after prefill
    monkeypatch.setattr(step_module, "mx", Counting())
    monkeypatch.setattr(head_module, "mx", Counting())
    for _ in range(3):
        calls.clear()
        out = dec.step()
        assert out.num_drafted == 3 and len(calls) == 3 + 1
