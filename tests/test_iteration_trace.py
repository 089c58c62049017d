"""The opt-in iteration trace (``server/iteration_trace.py``, issue 43) records what the
scheduler ran without changing it: a prompt's chunks cover it in order and name its join,
each decode step's rows and K are the batch's, and the answers equal an untraced engine's."""

import json

import pytest

from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest
from mlx_mtp.server.iteration_trace import IterationTrace
from mlx_mtp.testing.tiny import make_tiny

PROMPT = [(7 * j) % 3000 + 50 for j in range(300)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load(str(make_tiny(tmp_path_factory.mktemp("trace") / "m", "qwen3_5", "noisy",
                              vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)))


def _run(model, tok, trace_path=None):
    """Two streams, then a 300-token prompt arriving beside them; the prompt's events and
    the trace (if any)."""
    eng = Engine(model, tok, num_draft_tokens=2, adaptive=False, log_interval=0,
                 calibrate=False, prefill_step_size=64, max_batched_tokens=40)
    trace = IterationTrace.attach(eng, trace_path) if trace_path else None
    streams = [[], []]
    for i, sink in enumerate(streams):
        eng.submit(EngineRequest(prompt=[5 + i, 9, 22, 7], max_tokens=400, on_event=sink.append))
    while not all(streams):
        eng.step()
    events = []
    req = EngineRequest(prompt=PROMPT, max_tokens=4, on_event=events.append)
    eng.submit(req)
    while not any(isinstance(e, Done) for e in events):
        eng.step()
    if trace:
        trace.close()
    tokens = [t for e in events if isinstance(e, Delta) for t in e.token_ids]
    return req.request_id, tokens


def test_the_trace_records_the_scheduler_without_changing_it(tiny, tmp_path):
    model, tok = tiny
    path = tmp_path / "trace.jsonl"
    key, traced = _run(model, tok, str(path))
    _, plain = _run(model, tok)
    assert traced == plain and len(traced) == 4
    its = [json.loads(line) for line in path.read_text().splitlines()]
    chunks = [c for it in its for c in it["chunks"] if c["prompt"] == key]
    # beside streams, in several chunks, contiguous from 0 to the prompt's last token
    assert len(chunks) > 3
    offsets = [c["offset"] for c in chunks]
    assert offsets == [0] + [sum(c["tokens"] for c in chunks[:i]) for i in range(1, len(chunks))]
    assert sum(c["tokens"] for c in chunks) == len(PROMPT) - 1
    assert [c["joined"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c["est_ms"] is not None for c in chunks[1:])  # its own cost, once measured
    assert all(c["ms"] >= 0 and c["run_head"] is not None for c in chunks)
    joined = next(i for i, it in enumerate(its)
                  if any(c["joined"] and c["prompt"] == key for c in it["chunks"]))
    for it in its:
        d = it["decode"]
        if d is None:
            continue
        assert d["ks"] == [2] * d["rows"] and len(d["contexts"]) == d["rows"]
        assert it["wall_ms"] >= d["ms"] + sum(c["ms"] for c in it["chunks"]) - 0.05
    # the prompt's row decodes beside the two streams from the join's own iteration on
    assert its[joined]["decode"]["rows"] == 3
    assert max(its[joined]["decode"]["contexts"]) >= len(PROMPT) - 1
    assert all(it["decode"]["rows"] == 2 for it in its[:joined] if it["decode"])
