"""Several long prompts beside decoding streams (issue 43): all prompts together get one
share of the time, they take it in turns by prefill time (a newcomer level with the least
served, fewer tokens left first on a tie), each chunk is sized by its own prompt's per-token
cost, and a prompt whose smallest chunk never fits in the share still finishes.

The engine tests run the real scheduler on a tiny model with costs injected through a
fake clock (a chunk's cost grows with its prompt's context; decode steps alternate between
two lengths), so what is asserted is the scheduler's accounting, not wall-clock time."""

import itertools
import random
from types import SimpleNamespace

import pytest

from mlx_mtp.models.io.loader import load
from mlx_mtp.server import engine as engine_module
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest
from mlx_mtp.server.fair_share import FairShare
from mlx_mtp.testing.tiny import make_tiny
from test_fair_share import start_two_streams

LEAST, MOST = 8, 512


def test_prompts_take_turns_by_prefill_time():
    fair = FairShare()
    assert fair.order({"long": 30000, "mid": 8000}) == ["mid", "long"]  # level: fewer left
    fair.prefill_ran(0.2, 64, competing=True, prompt="mid")
    assert fair.order({"long": 30000, "mid": 7936}) == ["long", "mid"]  # mid had its turn
    fair.prefill_ran(0.3, 64, competing=True, prompt="long")
    assert fair.order({"long": 29936, "mid": 7936}) == ["mid", "long"]
    # A newcomer starts level with the least served (mid's 0.2 s), neither behind the
    # others' past time nor owed it: with fewer tokens left it goes first, once.
    assert fair.order({"long": 29936, "mid": 7936, "chat": 20}) == ["chat", "mid", "long"]
    assert fair.prompts["chat"].served_s == 0.2
    fair.prefill_ran(0.05, 20, competing=True, prompt="chat")
    assert fair.order({"long": 29936, "mid": 7936}) == ["mid", "long"]
    assert set(fair.prompts) == {"long", "mid"}  # a finished prompt is forgotten


def test_each_prompt_sized_by_its_own_cost():
    """One allowance for all prompts: a chunk of the dear prompt and one of the cheap
    prompt each fill it by their own per-token cost; what prompts ran since the last
    decode step comes off the allowance whichever prompt ran."""
    fair = FairShare()
    fair.order({"dear": 20000, "cheap": 4000})
    fair.decode_ran(0.1, competing=False)
    fair.prefill_ran(0.16, 8, competing=False, prompt="dear")  # 20 ms a token
    fair.prefill_ran(0.016, 8, competing=False, prompt="cheap")  # 2 ms a token
    assert fair.budget(512, LEAST, MOST, "dear") == LEAST  # 5 tokens fit: the floor
    assert fair.budget(512, LEAST, MOST, "cheap") == 48  # 50 fit
    # Unmeasured: any prompt's recent cost (11 ms smoothed), 9 tokens.
    assert fair.token_s == pytest.approx(0.011)
    assert fair.budget(512, LEAST, MOST, "new") == LEAST
    fair.prefill_ran(0.1, 48, competing=True, prompt="cheap")  # the iteration's step spent
    assert fair.budget(512, LEAST, MOST, "dear") == 0
    assert fair.budget(512, LEAST, MOST, "cheap") == 0


def test_a_chunk_that_never_fits_still_runs_and_keeps_the_split():
    """At a context where the smallest chunk outlasts what the account can ever allow (8
    tokens at 0.1 s against 0.1 s decode steps), the prompt runs it once the streams have
    had as long: it finishes, and the streams keep half of the time."""
    fair = FairShare()
    fair.decode_ran(0.1, competing=False)
    fair.prefill_ran(0.8, 8, competing=False, prompt="p")
    fair.order({"p": 80})
    done, idle, waits = 0, 0.0, []
    for _ in range(200):
        n = fair.budget(112, LEAST, MOST, "p")
        if n:
            waits.append(idle)
            fair.prefill_ran(0.1 * n, n, competing=True, prompt="p")
            done, idle = done + n, 0.0
        if done >= 80:
            break
        fair.decode_ran(0.1, competing=True)
        idle += 0.1
    assert done == 80 and len(waits) == 10
    assert all(w >= 0.8 - 1e-9 for w in waits[1:]), waits  # the streams had its time first
    assert 0.45 <= fair.share() <= 0.55, fair.share()


def _contend_two(fair, first, second, delay, seed=0):
    """Two prompts beside streams, the engine's loop (``_prefill_round``) with made-up
    costs: a call costs 3 ms plus, per token, 0.5 ms and 5 us per token of its own context;
    decode steps take 50 ms, every third 80 ms, with 20 % noise (chunks 10 %). ``second``
    arrives ``delay`` iterations after ``first``. Per iteration: the prompts' seconds, the
    decode step, the prompts that ran (in order), those in prefill, and the prompts'
    prefill time so far."""
    rng, ctx, iters = random.Random(seed), {}, []
    lengths = {"first": first, "second": second}
    for i in range(100000):
        ctx.setdefault("first", 0)
        if i >= delay:
            ctx.setdefault("second", 0)
        left = {k: lengths[k] - c for k, c in ctx.items() if c < lengths[k]}
        if not left and len(ctx) == 2:
            return iters
        spent, ran, seconds = 0, [], 0.0
        for key in fair.order(left):
            n = 1
            while ctx[key] < lengths[key] and n:
                n = min(fair.budget(112 - spent, LEAST, MOST, key), lengths[key] - ctx[key])
                if n:
                    s = (0.003 + n * (0.0005 + ctx[key] * 5e-6)) * rng.uniform(0.9, 1.1)
                    fair.prefill_ran(s, n, competing=True, prompt=key)
                    ctx[key], spent, seconds = ctx[key] + n, spent + n, seconds + s
                    ran.append(key)
            if not n:
                break
        step = (0.08 if i % 3 == 0 else 0.05) * rng.uniform(0.8, 1.2)
        fair.decode_ran(step, competing=True)
        served = {k: a.served_s for k, a in fair.prompts.items()}
        iters.append(SimpleNamespace(prompt_s=seconds, step=step, ran=ran, active=set(left),
                                     served=served))
    raise AssertionError("the prompts did not finish")


@pytest.mark.parametrize("delay", [0, 150])
def test_two_prompts_take_one_share_and_both_advance(delay):
    """A 3,000- and an 800-token prompt (the second arriving ``delay`` iterations later)
    beside streams: the streams keep half of the timed time, as beside one prompt; while
    both are in prefill, their prefill times stay within one iteration's prompt time of
    each other, so neither waits while the other runs more than two such iterations' time
    (the cheap one's turns are shorter, capped by the token budget: it may take several in
    a row); no iteration's prompts run past ``SPEND`` of the longest decode step (a dear
    prompt's chunks are not sized by the cheap one's cost)."""
    fair = FairShare()
    fair.decode_ran(0.05, competing=False)
    iters = _contend_two(fair, 3000, 800, delay)
    assert 0.45 <= fair.share() <= 0.55, fair.share()
    both = [it for it in iters if it.active == {"first", "second"}]
    assert sum(1 for it in both if it.ran) > 20
    longest = max(it.prompt_s for it in iters)
    for it in both:
        assert abs(it.served["first"] - it.served["second"]) <= longest + 1e-9
    for key in ("first", "second"):
        waited = 0.0  # prompt time the other ran since this one last did
        for it in both:
            waited = 0.0 if key in it.ran else waited + it.prompt_s
            assert waited <= 2 * longest + 1e-9, (key, waited, longest)
    assert longest <= FairShare.SPEND * max(it.step for it in iters) * 1.1, longest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(make_tiny(tmp_path_factory.mktemp("fair2") / "m", "qwen3_5", "noisy",
                              vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)))


def _tokens(events):
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def _engine_on_a_fake_clock(tiny, monkeypatch, round_cost):
    """The real engine with its clock faked, two streams decoding on it: a prompt chunk costs
    3 ms plus, per token, 1 ms and 10 us per token of its prompt's context; a decode round
    ``round_cost(eng)`` seconds (asked before the round runs). Returns the engine and the
    streams' event lists."""
    model, tok = tiny
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    eng = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                 calibrate=False, prefill_step_size=512)
    chunk, decode_step = eng._prefill_chunk, eng._decode_step

    def costed_chunk(seq, max_tokens, below_grid=False):
        context = seq.dec.n_processed
        n = chunk(seq, max_tokens, below_grid)
        clock[0] += 0.003 + n * (0.001 + context * 1e-5)
        return n

    def costed_step(decoding):
        seconds = round_cost(eng)
        decode_step(decoding)
        clock[0] += seconds

    monkeypatch.setattr(eng, "_prefill_chunk", costed_chunk)
    monkeypatch.setattr(eng, "_decode_step", costed_step)
    return eng, start_two_streams(eng)


def test_the_engine_gives_two_prompts_one_share(tiny, monkeypatch):
    """The real scheduler beside two streams, a 900- and a 300-token prompt arriving
    together, every cost injected through the engine's clock: a chunk costs 3 ms plus,
    per token, 1 ms and 10 us per token of its prompt's context; a decode round 60 ms,
    every third 90 ms. The streams keep half of the timed time over the union of the
    prefills; both prompts run while both wait (each within two iterations' prompt time);
    every iteration decodes every stream; each prompt's answer is its answer alone."""
    model, tok = tiny
    rounds = itertools.count()
    eng, streams = _engine_on_a_fake_clock(
        tiny, monkeypatch, lambda eng: 0.09 if next(rounds) % 3 == 0 else 0.06)
    prompts = {"long": [(7 * j) % 3000 + 50 for j in range(900)],
               "short": [(13 * j) % 3000 + 60 for j in range(300)]}
    events = {name: [] for name in prompts}
    ids = {}
    for name, prompt in prompts.items():
        req = EngineRequest(prompt=prompt, max_tokens=4, on_event=events[name].append)
        ids[req.request_id] = name
        eng.submit(req)
    prompt_s0, decode_s0 = eng.fair.prompt_s, eng.fair.decode_s
    history = []  # per iteration: prompts in prefill, chunks' time per prompt
    while True:
        prefilling = {ids[s.req.request_id] for s in eng.running
                      if s.prefilling and s.req.request_id in ids}
        if history and not prefilling:
            break
        served = {ids[k]: a.served_s for k, a in eng.fair.prompts.items() if k in ids}
        before = [len(s) for s in streams]
        eng.step()
        after = {ids[k]: a.served_s for k, a in eng.fair.prompts.items() if k in ids}
        ran = {k: after.get(k, served.get(k, 0.0)) - served.get(k, 0.0) for k in prefilling}
        history.append((prefilling, ran))
        live = [(s, n) for s, n in zip(streams, before) if not isinstance(s[n - 1], Done)]
        assert live and all(len(s) > n for s, n in live)
    prompt_s, decode_s = eng.fair.prompt_s - prompt_s0, eng.fair.decode_s - decode_s0
    assert 0.45 <= prompt_s / (prompt_s + decode_s) <= 0.55, (prompt_s, decode_s)
    both = [ran for prefilling, ran in history if prefilling == {"long", "short"}]
    assert sum(1 for ran in both if any(ran.values())) > 10
    longest = max(sum(ran.values()) for _, ran in history)
    for name in prompts:
        waited = 0.0
        for ran in both:
            waited = 0.0 if ran[name] else waited + sum(ran.values())
            assert waited <= 2 * longest + 1e-9, (name, waited, longest)
    while not all(any(isinstance(e, Done) for e in evs) for evs in events.values()):
        eng.step()
    alone = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                   calibrate=False, prefill_step_size=4096)
    for name, prompt in prompts.items():
        solo = []
        alone.submit(EngineRequest(prompt=prompt, max_tokens=4, on_event=solo.append))
        while not any(isinstance(e, Done) for e in solo):
            alone.step()
        assert _tokens(events[name]) == _tokens(solo), name


def test_the_engine_charges_a_join_to_the_prompts(tiny, monkeypatch):
    """The round right after a prompt's row joins beside the streams is long (injected: 10x
    a plain round, as a long row's first step is); the engine tells the share which chunk was
    a prompt's last (``order``'s tokens left reach 0), so that round's excess is the
    prompts' time and the prompt still in prefill waits the next iteration instead of
    running 1.5 rounds at once."""
    rows = [0]

    def round_cost(eng):  # a row joined since the last round: 10x
        joined, rows[0] = len(eng.batch) > rows[0], len(eng.batch)
        return 0.6 if joined else 0.06

    eng, _ = _engine_on_a_fake_clock(tiny, monkeypatch, round_cost)
    names = {}
    for name, n in (("short", 200), ("long", 900)):
        req = EngineRequest(prompt=[(7 * j + n) % 3000 + 50 for j in range(n)], max_tokens=2,
                            on_event=lambda e: None)
        names[req.request_id] = name
        eng.submit(req)
    history = []  # per iteration: prompts in prefill after it, the long one's prefill time
    while not history or history[-1][0]:
        eng.step()
        served = {names[k]: a.served_s for k, a in eng.fair.prompts.items() if k in names}
        history.append(({names[s.req.request_id] for s in eng.running
                          if s.prefilling and s.req.request_id in names}, served.get("long")))
    joined = next(i for i, (prefilling, _) in enumerate(history) if prefilling == {"long"})
    assert history[joined + 1][1] == history[joined][1]  # the long prompt waited a round
    assert history[joined + 4][1] > history[joined][1]  # and runs again after it paid back
