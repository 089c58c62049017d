"""A long prompt and the streams decoding beside it share the machine by time (issue 25):
chunks last about one decode step plus what the prompt is owed, prompts pause once a step
ahead, the account stays within one step either way, and each side gets about half."""

import math
import random
from itertools import accumulate

import mlx.core as mx
import pytest

from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest
from mlx_mtp.server.fair_share import FairShare
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.testing.tiny import make_tiny

LEAST, MOST = 8, 512


def test_chunks_last_about_one_decode_step():
    fair = FairShare()
    assert fair.budget(128, LEAST, MOST) == 128  # nothing measured: the token budget
    fair.decode_ran(0.10, competing=False)
    fair.prefill_ran(0.64, 64, competing=False)  # 10 ms a token: 10 tokens a step
    assert fair.budget(128, LEAST, MOST) == 8  # less than a grid cell, a multiple of 8
    fair.prefill_ran(2.0, 64, competing=False)  # ~21 ms a token (smoothed): 4.9 a step
    assert fair.budget(128, LEAST, MOST) == LEAST  # half the floor fits: the floor
    fair.prefill_ran(0.5, 1, competing=False)  # a tail under the floor: not a cost sample
    assert fair.budget(128, LEAST, MOST) == LEAST
    fair.prefill_ran(4.0, 64, competing=False)  # ~41 ms a token: not half the floor fits
    assert fair.budget(128, LEAST, MOST) == 0
    fair = FairShare()
    fair.decode_ran(0.10, competing=False)
    fair.prefill_ran(0.064, 128, competing=False)  # 0.5 ms a token: 200 a step
    assert fair.budget(1000, LEAST, MOST) == 200
    assert fair.budget(150, LEAST, MOST) == 144  # never above the token budget
    fair.prefill_ran(0.001, 100, competing=False)  # cheaper: smoothed toward it
    fits = int(0.10 / fair.token_s)
    assert fair.budget(1000, LEAST, MOST) == fits - fits % LEAST > 200
    fair.prefill_ran(0.0001, 100, competing=False)
    assert fair.budget(1000, LEAST, MOST) == MOST


def test_cells_split_only_where_one_outlasts_the_decode_rounds():
    fair = FairShare()
    assert fair.floor(64, LEAST) == 64  # nothing measured: whole cells
    fair.decode_ran(0.10, competing=False)
    fair.prefill_ran(0.128, 64, competing=False)  # a cell costs 1.28 rounds
    assert fair.floor(64, LEAST) == 64  # short prompts queued behind it are not delayed
    fair.prefill_ran(1.2, 64, competing=False)  # long context: a cell outlasts the rounds
    assert fair.floor(64, LEAST) == LEAST


def test_the_account_stays_within_one_step_and_credit_is_spent():
    fair = FairShare()  # binary fractions: exact sums
    fair.decode_ran(0.125, competing=True)
    assert fair.debt == -0.125  # credit of one step at most
    fair.decode_ran(0.125, competing=True)
    assert fair.debt == -0.125
    fair.prefill_ran(0.5, 64, competing=True)  # a long cell: prompts are ahead
    assert fair.budget(128, LEAST, MOST) == 0
    fair.decode_ran(0.125, competing=True)
    assert fair.debt == 0.125  # the overrun counts one step at most
    assert fair.budget(128, LEAST, MOST) == 0  # a step ahead: decode only
    fair.decode_ran(0.125, competing=True)  # paid back: one step's worth
    assert fair.budget(128, LEAST, MOST) == 16
    fair.decode_ran(0.125, competing=True)  # owed a step: spent half a step at a time
    assert fair.budget(128, LEAST, MOST) == 24
    fair.prefill_ran(0.5, 64, competing=True)
    fair.decode_ran(0.125, competing=False)  # the prompt finished: nothing owed
    assert fair.debt == 0.0 and fair.budget(128, LEAST, MOST) > 0
    assert fair.share() == (0.5 + 0.5) / (0.5 + 0.5 + 5 * 0.125)


def _contend(fair, noise, prompt=6000, step=0.1, seed=0):
    """A prompt beside streams, the scheduler's loop with made-up costs: a chunk costs a
    fixed 10 ms plus, per token, 2 ms and 1 us per token of context (it grows as the
    prompt goes); decode steps jitter (every fourth 3x, plus log-normal noise)."""
    rng, ctx, chunks, steps, i = random.Random(seed), 0, [], [], 0
    while ctx < prompt:
        n = min(fair.budget(112, LEAST, MOST), prompt - ctx)
        if n:
            seconds = (0.01 + n * (0.002 + ctx * 1e-6)) * rng.lognormvariate(0, noise)
            fair.prefill_ran(seconds, n, competing=True)
            ctx += n
            chunks.append((n, seconds))
        steps.append(step * (3 if i % 4 == 0 else 1) * rng.lognormvariate(0, noise))
        fair.decode_ran(steps[-1], competing=True)
        i += 1
    return chunks, steps


@pytest.mark.parametrize("noise", [0.0, 0.3, 0.6])
def test_the_prompt_gets_half_of_the_time(noise):
    """The record's time share stays near one half whatever the jitter; no chunk under the
    floor but the prompt's last; no chunk much longer than 1.5 decode steps."""
    fair = FairShare()
    chunks, steps = _contend(fair, noise)
    assert 0.45 <= fair.share() <= 0.55, fair.share()
    assert abs(fair.prompt_s - sum(s for _, s in chunks)) < 1e-9
    assert abs(fair.decode_s - sum(steps)) < 1e-9
    assert all(n >= LEAST for n, _ in chunks[:-1])
    typical = sorted(steps)[len(steps) // 2]
    # typical: the median step; a spiked step is 3x; the noise of the chunk itself on top
    assert max(s for _, s in chunks) < 1.5 * 3 * typical * math.exp(2 * noise)


def test_one_long_step_does_not_lengthen_the_next_chunks():
    """A long row joining makes one decode round several times the others (0.64 s among
    0.2 s steps on the demo model, an 8k row joining 4 streams); the prompt's next chunk
    stays within ``SPEND`` typical rounds (the smoothed round gave it 0.56 s), while the
    round still counts in the account."""
    fair = FairShare()
    for _ in range(10):
        fair.prefill_ran(0.08, 8, competing=True)  # 10 ms a token
        fair.decode_ran(0.2, competing=True)
    fair.decode_ran(0.64, competing=True)  # the join's round
    assert fair.debt < 0  # the prompts are owed time
    n = fair.budget(512, LEAST, MOST)
    assert 0 < n * 0.01 <= FairShare.SPEND * 0.2


def test_a_join_round_is_the_prompts_time():
    """The round after a prompt finishes beside the streams carries its row's join (0.64 s
    among 0.2 s rounds for an 8k row): what it ran over a typical round counts as the
    prompts', so the prompt still in prefill waits for a round instead of spending 1.5
    rounds at once (a 2.5-round gap right after the join's long one)."""
    def run(finish: bool) -> FairShare:
        fair = FairShare()
        for _ in range(10):
            fair.order({"8k": 1000, "30k": 20000})
            fair.prefill_ran(0.04, 4, competing=True, prompt="8k")
            fair.prefill_ran(0.04, 4, competing=True, prompt="30k")
            fair.decode_ran(0.08, competing=True)
        fair.order({"8k": 8 if finish else 16, "30k": 19960})
        fair.prefill_ran(0.08, 8, competing=True, prompt="8k")  # its last chunk, or not
        prompt_s, decode_s = fair.prompt_s, fair.decode_s
        fair.decode_ran(0.64, competing=True)
        extra = 0.64 - 0.08 if finish else 0.0
        assert fair.prompt_s - prompt_s == pytest.approx(extra)
        assert fair.decode_s - decode_s == pytest.approx(0.64 - extra)
        fair.order({"30k": 19960})
        return fair

    assert run(finish=False).budget(512, LEAST, MOST, "30k") > 0  # owed: it runs at once
    joined = run(finish=True)
    assert joined.debt > 0 and joined.budget(512, LEAST, MOST, "30k") == 0
    waited = 0  # plain rounds until the prompts are no longer ahead (the account's bound)
    while not joined.budget(512, LEAST, MOST, "30k"):
        joined.decode_ran(0.08, competing=True)
        waited += 1
    assert 1 <= waited <= 4


@pytest.mark.parametrize("every, typical", [(25, 0.1), (7, (6 * 0.1 + 0.6) / 7)])
def test_spiked_rounds_keep_the_split_and_bound_the_chunks(every, typical):
    """Rounds that spike (joins, pauses: 6x the others) leave the split near one half; no
    chunk lasts much beyond ``SPEND`` typical rounds (the gap a stream sees), where a rare
    spike is not typical (1 in 25: 0.1 s) and a frequent one is (1 in 7: the mean)."""
    fair, ctx, chunks, steps = FairShare(), 0, [], []
    while ctx < 4000:
        n = min(fair.budget(112, LEAST, MOST), 4000 - ctx)
        if n:
            seconds = 0.01 + n * (0.002 + ctx * 1e-6)
            fair.prefill_ran(seconds, n, competing=True)
            ctx += n
            chunks.append(seconds)
        steps.append(0.6 if len(steps) % every == every - 1 else 0.1)
        fair.decode_ran(steps[-1], competing=True)
    assert 0.45 <= fair.share() <= 0.55, fair.share()
    longest = max(chunks[1:])  # the first: nothing measured yet
    assert longest <= 1.1 * FairShare.SPEND * typical, longest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(make_tiny(tmp_path_factory.mktemp("fair") / "m", "qwen3_5", "noisy",
                              vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)))


def start_two_streams(eng) -> list:
    """Two streams decoding on ``eng`` (their first tokens out): each one's event list."""
    streams = [[], []]
    for i, sink in enumerate(streams):
        eng.submit(EngineRequest(prompt=[5 + i, 9, 22, 7], max_tokens=10 ** 5,
                                 on_event=sink.append))
    while not all(streams):
        eng.step()
    return streams


def test_a_long_prompt_never_runs_ahead_of_the_streams(tiny):
    """While a long prompt is processed beside two streams, its time never exceeds the
    decode steps' by more than one prefill round; every iteration decodes; its output is
    the same as alone."""
    model, tok = tiny
    eng = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                 calibrate=False, prefill_step_size=512)
    # round: prompt time since the last decode step; ahead: how far prompts got in front
    log = {"prefill": 0.0, "decode": 0.0, "round": 0.0, "longest": 0.0, "ahead": 0.0}
    prefill_ran, decode_ran = eng.fair.prefill_ran, eng.fair.decode_ran

    def on_prefill(seconds, tokens, competing, prompt):
        if competing:
            log["prefill"] += seconds
            log["round"] += seconds
            log["longest"] = max(log["longest"], log["round"])
        prefill_ran(seconds, tokens, competing, prompt)

    def on_decode(seconds, competing):
        if competing:
            log["decode"] += seconds
            log["ahead"] = max(log["ahead"], log["prefill"] - log["decode"] - log["longest"])
        log["round"] = 0.0
        decode_ran(seconds, competing)

    eng.fair.prefill_ran, eng.fair.decode_ran = on_prefill, on_decode
    streams = start_two_streams(eng)
    long_prompt = [(7 * j) % 3000 + 50 for j in range(1200)]
    events = []
    eng.submit(EngineRequest(prompt=long_prompt, max_tokens=4, on_event=events.append))
    eng.step()
    seq = next(s for s in eng.running if s.req.prompt == long_prompt)
    iterations = 0
    while seq.prefilling:
        before = [len(s) for s in streams]
        eng.step()
        iterations += 1
        # Every iteration decodes every stream (one may end at its EOS meanwhile).
        live = [(s, n) for s, n in zip(streams, before) if not isinstance(s[n - 1], Done)]
        assert live and all(len(s) > n for s, n in live)
    assert log["ahead"] <= 1e-9, log
    assert log["prefill"] > 0 and iterations > 1
    while not any(isinstance(e, Done) for e in events):
        eng.step()
    alone = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                   calibrate=False, prefill_step_size=4096)
    solo = []
    alone.submit(EngineRequest(prompt=long_prompt, max_tokens=4, on_event=solo.append))
    while not any(isinstance(e, Done) for e in solo):
        alone.step()
    tokens = lambda evs: [t for e in evs if isinstance(e, Delta) for t in e.token_ids]  # noqa
    assert tokens(events) == tokens(solo)


def _greedy(engine, prompt, n=6, boundaries=()):
    events = []
    engine.submit(EngineRequest(prompt=prompt, max_tokens=n, boundaries=boundaries,
                                on_event=events.append))
    while not any(isinstance(e, Done) for e in events):
        engine.step()
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def test_chunks_below_a_grid_cell_beside_streams_keep_the_answer(tiny):
    """Beside decoding streams a prompt runs in chunks shorter than a 64-token cell (the
    Gated DeltaNet recurrence in other pieces than the grid's): it still stops exactly at its prefix-cache
    boundary, its snapshot there matches the grid-computed one to float rounding, and its
    greedy output is the output alone."""
    model, tok = tiny
    prompt = [(11 * j) % 3000 + 40 for j in range(400)]
    kw = dict(num_draft_tokens=2, adaptive=False, log_interval=0, calibrate=False)
    alone = Engine(model, tok, prefix_cache=PrefixCache(), prefill_step_size=512, **kw)
    first = _greedy(alone, prompt + [0], 1, [300])
    expected = _greedy(alone, prompt[:301] + [7, 8])
    eng = Engine(model, tok, prefix_cache=PrefixCache(), prefill_step_size=512, **kw)
    eng.fair.budget = lambda tokens, least, most, prompt: 13  # a long cell: 13 tokens a step
    eng.fair.floor = lambda cell, least, prompt: least  # cells outlast the decode rounds: split
    sizes, chunk = [], eng._prefill_chunk

    def recorded(seq, max_tokens, below_grid=False):
        sizes.append(chunk(seq, max_tokens, below_grid))
        return sizes[-1]

    eng._prefill_chunk = recorded
    stream = []
    eng.submit(EngineRequest(prompt=[5, 9, 22, 7], max_tokens=10 ** 5, on_event=stream.append))
    while not stream:
        eng.step()
    sizes.clear()
    assert _greedy(eng, prompt + [0], 1, [300]) == first
    assert sizes[:3] == [13, 13, 13] and sum(sizes) == 400 and 300 in accumulate(sizes)
    # The boundary's remainder under the floor joins the chunk before it: no tiny chunks.
    assert all(n >= FairShare.FLOOR for n in sizes[:-1]), sizes
    key = tuple(prompt[:301])
    shared, grid = eng.prefix_cache.entries[key].state, alone.prefix_cache.entries[key].state
    for a, b in zip(shared.arrays(), grid.arrays()):
        assert a.shape == b.shape and mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()
    for r in eng.running:
        eng.cancel(r.req)
    eng.step()
    assert _greedy(eng, prompt[:301] + [7, 8]) == expected  # restored from that snapshot
