"""The memory budget's worst case for one request (``Footprint``, ``server/memory_budget.py``)
against what the engine's caches hold while they decode it, per kind of cache: DeepSeek-V4
(a bounded window and raw rows beside compressed entries that grow one per 4 or 8 tokens:
counted as if every part grew per token before, ~5x), MiMo-V2-Flash (sliding windows) and a
Qwen3.5 hybrid with a DFlash block drafter (its context grows; its deferred taps, up to
``MAX_DEFERRED`` positions a row, are bounded).

The reference is the caches' own ``nbytes``, read at every engine step (the batch's and a
prefilling row's). The worst case the budget admits a request at (its prompt, max_tokens, K
and the growth slack) must be at least the most they held, and at most 1.25x it: the slack's
256 positions are under a fifth of these requests' 1408, and every other part must be
counted as it grows, not as a bound taken for growth.
"""

from pathlib import Path

import pytest

from engine_events import Sink, drive, make_engine
from mlx_mtp.decode import block_context
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.cache.window import BatchWindowKVCache, WindowKVCache
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.events import Done, EngineRequest
from mlx_mtp.server.memory_budget import Footprint, MemoryBudget
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_dflash
from mlx_mtp.testing.tiny_special import make_tiny_mimo_v2_flash

MARGIN = 1.25
PROMPT, MAX_TOKENS = 1280, 128  # past every window


def deepseek_v4(tmp, monkeypatch):
    return load(str(Path(__file__).parent / "fixtures" / "deepseek_v4"))


def mimo_v2_flash(tmp, monkeypatch):
    """Buffers of 8: a window's bound is then mostly its window, as in a released model,
    whose windows (128+) are not dwarfed by a 256-position buffer step."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(BatchWindowKVCache, "step", 8)
    return load(str(make_tiny_mimo_v2_flash(tmp / "mimo", "noisy", vocab_size=4096)))


def qwen3_5_dflash(tmp, monkeypatch):
    model, tok = load(str(make_tiny(tmp / "qwen", "qwen3_5", "noisy", vocab_size=4096,
                                    trunk_scale=0.1)))
    attach_block_drafter(model, str(make_tiny_dflash(tmp / "dflash", 64, 4096, [0, 2], 4,
                                                     block_size=4)))
    return model, tok


def qwen3_5(tmp, monkeypatch):
    return load(str(make_tiny(tmp / "qwen", "qwen3_5", "noisy", vocab_size=4096,
                              trunk_scale=0.1)))


def held(engine) -> int:
    """What the engine's sequences' caches hold now, from the caches themselves."""
    caches = list(engine.batch.cache or []) + list(engine.batch.mtp_cache or [])
    caches += [c for s in engine.running if s.prefilling and s.dec.cache is not None
               for c in s.dec.cache + (s.dec.mtp_cache or [])]
    return sum(c.nbytes for c in caches)


@pytest.mark.parametrize("family", [deepseek_v4, mimo_v2_flash, qwen3_5_dflash],
                         ids=lambda f: f.__name__)
def test_the_worst_case_covers_what_the_caches_hold_within_a_quarter(family, tmp_path,
                                                                     monkeypatch):
    model_tok = family(tmp_path, monkeypatch)
    vocab = model_tok[0].text.args.vocab_size
    budget = MemoryBudget(1 << 40)  # measured by the engine, as a server does
    # the head drafts at every step (not adaptive): its caches fill as the trunk's
    eng = make_engine(model_tok, memory=budget, num_draft_tokens=2, adaptive=False)
    eng.eos = set()  # every request decodes its max_tokens
    sink = Sink()
    req = EngineRequest(prompt=[(7 * i) % (vocab - 8) + 4 for i in range(PROMPT)],
                        max_tokens=MAX_TOKENS, on_event=sink)
    eng.submit(req)
    most = 0
    for _ in range(4 * MAX_TOKENS):
        if sink.done is not None:
            break
        eng.step()
        most = max(most, held(eng))
    assert isinstance(sink.done, Done) and len(sink.tokens) == MAX_TOKENS
    worst = budget.footprint.row_bytes(budget.worst_tokens(req, eng.num_draft_tokens))
    assert most <= worst <= MARGIN * most, (most, worst, budget.footprint)
    if model_tok[0].block_drafter is not None:  # the taps' bound is part of it
        taps = budget.footprint.bounded[-1]
        assert taps[1] == block_context.MAX_DEFERRED and taps[0] > 0


def test_a_queue_under_a_budget_of_three_rows_runs_three_at_once_and_loses_none(tmp_path,
                                                                               monkeypatch):
    """DeepSeek-V4, 8 requests at once under a budget of three rows' worst case: three run at
    a time, the caches never hold more than the budget, and all finish with the tokens an
    unbudgeted engine gives."""
    model_tok = deepseek_v4(tmp_path, monkeypatch)
    length, max_tokens = 200, 12
    prompts = [[(7 * i + 13 * j) % 248 + 4 for i in range(length)] for j in range(8)]

    def submit(engine):
        engine.eos = set()
        sinks = [Sink() for _ in prompts]
        for p, s in zip(prompts, sinks):
            engine.submit(EngineRequest(prompt=p, max_tokens=max_tokens, on_event=s))
        return sinks

    free = make_engine(model_tok, max_concurrency=8)
    expected = [s.tokens for s in drive(free, submit(free))]
    fp = Footprint.measure(model_tok[0])
    budget = MemoryBudget(3 * fp.row_bytes(length + max_tokens + free.num_draft_tokens + 1
                                           + 256) + 1000, footprint=fp)
    eng = make_engine(model_tok, max_concurrency=8, memory=budget)
    sinks = submit(eng)
    most_rows = 0
    for _ in range(2000):
        if all(s.done is not None for s in sinks):
            break
        eng.step()
        assert held(eng) <= budget.limit
        most_rows = max(most_rows, eng.num_running)
    assert all(isinstance(s.done, Done) for s in sinks), [s.done for s in sinks]
    assert [s.tokens for s in sinks] == expected and most_rows == 3


@pytest.mark.parametrize("family", [qwen3_5, mimo_v2_flash, deepseek_v4],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("drafting", [{"num_draft_tokens": 0}, {"draft_source": "lookup"}],
                         ids=["no-drafts", "lookup"])
def test_a_row_that_does_not_draft_from_the_head_is_reserved_what_its_caches_reach(
        family, drafting, tmp_path, monkeypatch):
    """A row with ``num_draft_tokens`` 0 or a lookup-only source keeps no MTP head caches
    that grow (the batch's are empty while no row drafts from the head): its reservation
    leaves the head's part out (a quarter of the tiny Qwen's bytes), and is what its caches
    reach beside the slack for holes and a verify pass (``GROWTH_SLACK``)."""
    model_tok = family(tmp_path, monkeypatch)
    vocab = model_tok[0].text.args.vocab_size
    budget = MemoryBudget(1 << 40)
    eng = make_engine(model_tok, memory=budget, num_draft_tokens=2, adaptive=False)
    eng.eos = set()
    sink = Sink()
    req = EngineRequest(prompt=[(7 * i) % (vocab - 8) + 4 for i in range(PROMPT)],
                        max_tokens=MAX_TOKENS, on_event=sink, **drafting)
    eng.submit(req)
    most, reserved = 0, 0
    for _ in range(4 * MAX_TOKENS):
        if sink.done is not None:
            break
        eng.step()
        most, reserved = max(most, held(eng)), max(reserved, budget.reserved)
    assert isinstance(sink.done, Done) and len(sink.tokens) == MAX_TOKENS
    fp = budget.footprint
    worst = budget.worst_tokens(req, eng.num_draft_tokens)
    slack = fp.row_bytes(worst, 0) - fp.row_bytes(PROMPT + MAX_TOKENS, 0)  # the holes' room
    assert reserved == fp.row_bytes(worst, head_tokens=0) < fp.row_bytes(worst)  # no head
    # what its caches reach, but for the growth slack and the windows' bounds (MiMo: 1.3 %)
    assert most <= reserved <= 1.02 * most + slack, (most, reserved, slack, fp)


@pytest.mark.parametrize("family", [qwen3_5, mimo_v2_flash], ids=lambda f: f.__name__)
def test_a_row_that_does_not_draft_beside_one_that_does_stays_within_the_account(
        family, tmp_path, monkeypatch):
    """The batch pads a row that does not draft to a drafting row's head caches and holes:
    at every step, a longer non-drafting row beside a drafting one holds at most what the
    account reserves for the two."""
    model_tok = family(tmp_path, monkeypatch)
    vocab = model_tok[0].text.args.vocab_size
    budget = MemoryBudget(1 << 40)
    eng = make_engine(model_tok, memory=budget, num_draft_tokens=2, adaptive=False)
    eng.eos = set()
    sinks = [Sink(), Sink()]
    for n, k, sink in ((PROMPT // 2, None, sinks[0]), (PROMPT, 0, sinks[1])):
        eng.submit(EngineRequest(prompt=[(7 * i) % (vocab - 8) + 4 for i in range(n)],
                                 max_tokens=MAX_TOKENS, on_event=sink, num_draft_tokens=k))
    for _ in range(8 * MAX_TOKENS):
        if all(s.done is not None for s in sinks):
            break
        eng.step()
        assert held(eng) <= budget.reserved, (held(eng), budget.reserved)
    assert all(isinstance(s.done, Done) and len(s.tokens) == MAX_TOKENS for s in sinks)
    assert eng.metrics.spec_draft_tokens.get() > 0  # the first row drafted
