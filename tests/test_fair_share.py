"""A long prompt and the streams decoding beside it share the machine by time (issue 25):
chunks last about one decode step, prompts pause once they are ahead, nobody banks time."""

import pytest

from mlx_mtp.models.loader import load
from mlx_mtp.server.engine import Delta, Done, Engine, EngineRequest
from mlx_mtp.server.fair_share import FairShare
from mlx_mtp.testing.tiny import make_tiny

GRID, MOST = 64, 512


def test_chunks_last_about_one_decode_step():
    fair = FairShare()
    assert fair.budget(128, GRID, MOST) == 128  # nothing measured: the token budget
    fair.decode_ran(0.10, competing=False)
    fair.prefill_ran(0.64, 64, competing=False)  # 10 ms a token: 10 tokens a step
    assert fair.budget(128, GRID, MOST) == GRID  # at least one grid cell
    fair = FairShare()
    fair.decode_ran(0.10, competing=False)
    fair.prefill_ran(0.064, 128, competing=False)  # 0.5 ms a token: 200 a step
    assert fair.budget(1000, GRID, MOST) == 200
    assert fair.budget(150, GRID, MOST) == 150  # never above the token budget
    fair.prefill_ran(0.001, 100, competing=False)  # cheaper: smoothed toward it
    assert fair.budget(1000, GRID, MOST) == int(0.10 / fair.token_s) > 200
    fair.prefill_ran(0.0001, 100, competing=False)
    assert fair.budget(1000, GRID, MOST) == MOST


def test_prompts_pause_when_ahead_and_credit_is_bounded():
    fair = FairShare()  # binary fractions: exact sums
    fair.decode_ran(0.125, competing=True)
    assert fair.debt == -0.125  # credit of one step at most
    fair.decode_ran(0.125, competing=True)
    assert fair.debt == -0.125
    fair.prefill_ran(0.5, 64, competing=True)  # a long cell: prompts are ahead
    assert fair.budget(128, GRID, MOST) == 0
    for _ in range(2):
        fair.decode_ran(0.125, competing=True)
        assert fair.budget(128, GRID, MOST) == 0
    fair.decode_ran(0.125, competing=True)  # paid back
    assert fair.budget(128, GRID, MOST) > 0
    fair.prefill_ran(0.5, 64, competing=True)
    fair.decode_ran(0.125, competing=False)  # the prompt finished: nothing owed
    assert fair.debt == 0.0 and fair.budget(128, GRID, MOST) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(make_tiny(tmp_path_factory.mktemp("fair") / "m", "qwen3_5", "noisy",
                              vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)))


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

    def on_prefill(seconds, tokens, competing):
        if competing:
            log["prefill"] += seconds
            log["round"] += seconds
            log["longest"] = max(log["longest"], log["round"])
        prefill_ran(seconds, tokens, competing)

    def on_decode(seconds, competing):
        if competing:
            log["decode"] += seconds
            log["ahead"] = max(log["ahead"], log["prefill"] - log["decode"] - log["longest"])
        log["round"] = 0.0
        decode_ran(seconds, competing)

    eng.fair.prefill_ran, eng.fair.decode_ran = on_prefill, on_decode
    streams = [[], []]
    for i, sink in enumerate(streams):
        eng.submit(EngineRequest(prompt=[5 + i, 9, 22, 7], max_tokens=10 ** 5,
                                 on_event=sink.append))
    while not all(streams):
        eng.step()
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
        assert all(len(s) > n for s, n in zip(streams, before))  # every iteration decodes
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
