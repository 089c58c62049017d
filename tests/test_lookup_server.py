"""``draft_source`` in the server: per request, same tokens as plain decoding, counts by
source in usage and /metrics, a clear 400 for a bad value."""

import pytest

from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.events import Delta, Done, EngineRequest
from mlx_mtp.server.protocol import APIError, check_draft_source
from mlx_mtp.testing.tiny import make_tiny

CYCLE = list(range(300, 360))
COPY_PROMPT = CYCLE + [7, 8] + CYCLE[:6]  # the oracle continues the cycle: a copy


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("lookup_engine") / "ckpt", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=0.1)
    return load(str(path))


def _run(engine, reqs):
    sinks = []
    for kw in reqs:
        events = []
        engine.submit(EngineRequest(prompt=list(COPY_PROMPT), max_tokens=40,
                                    on_event=events.append, **kw))
        sinks.append(events)
    for _ in range(2000):
        if all(any(isinstance(e, Done) for e in s) for s in sinks):
            break
        engine.step()
    tokens = [[t for e in s if isinstance(e, Delta) for t in e.token_ids] for s in sinks]
    done = [next(e for e in s if isinstance(e, Done)) for s in sinks]
    return tokens, done


def test_requests_choose_their_source_and_report_it(oracle):
    model, tok = oracle
    engine = Engine(model, tok, num_draft_tokens=3, log_interval=0, calibrate=False,
                    draft_sources=DraftSources("both"))
    tokens, done = _run(engine, [dict(num_draft_tokens=0, draft_source="mtp"),
                                 dict(draft_source="lookup"), dict(), dict(draft_source="mtp")])
    assert all(t == tokens[0] for t in tokens[1:])  # lossless, batched together
    by_source = [d.usage["draft_tokens_by_source"] for d in done]
    assert by_source[0]["lookup"]["drafted"] == by_source[0]["mtp"]["drafted"] == 0
    assert by_source[1]["lookup"]["accepted"] > 20 and by_source[1]["mtp"]["drafted"] == 0
    assert by_source[2]["lookup"]["accepted"] > 0  # "both", the server's default
    assert by_source[3]["lookup"]["drafted"] == 0 and by_source[3]["mtp"]["drafted"] > 0
    assert done[1].mtp["lookup_accepted_tokens"] == by_source[1]["lookup"]["accepted"]
    text = engine.metrics.render()
    assert 'spec_decode_num_accepted_tokens_by_source_total{' in text
    assert 'source="lookup"' in text
    assert engine.metrics.snapshot()["lookup_accepted_tokens"] >= by_source[1]["lookup"]["accepted"]


def test_a_server_without_head_copies_with_lookup(oracle):
    model, tok = oracle
    engine = Engine(model, tok, num_draft_tokens=0, log_interval=0, calibrate=False,
                    draft_sources=DraftSources("lookup"))
    tokens, done = _run(engine, [dict(), dict(draft_source="mtp")])
    assert tokens[0] == tokens[1]
    assert done[0].usage["draft_tokens_by_source"]["lookup"]["accepted"] > 20


def test_bad_draft_source_is_a_400():
    with pytest.raises(APIError) as e:
        check_draft_source("ngram")
    assert e.value.status == 400 and e.value.param == "draft_source"
    assert "draft_source must be one of mtp, lookup, both" in e.value.message
    assert check_draft_source(None) is None and check_draft_source("both") == "both"


def test_num_draft_tokens_0_drafts_from_no_source(oracle):
    """Issue 43: under the default source (both), a request's num_draft_tokens 0 is plain
    decoding: nothing drafted from the head or the context, the same text."""
    model, tok = oracle
    engine = Engine(model, tok, num_draft_tokens=3, log_interval=0, calibrate=False,
                    draft_sources=DraftSources("both"))
    plain = Engine(model, tok, num_draft_tokens=0, log_interval=0, calibrate=False)
    tokens, done = _run(engine, [dict(num_draft_tokens=0), dict()])
    (plain_tokens,), _ = _run(plain, [dict()])
    assert tokens[0] == tokens[1] == plain_tokens
    assert done[0].mtp["num_draft_tokens"] == 0 and done[0].mtp["num_drafts"] == 0
    assert all(s["drafted"] == 0 for s in done[0].usage["draft_tokens_by_source"].values())
    assert done[1].usage["draft_tokens_by_source"]["lookup"]["drafted"] > 0  # the default


def test_num_draft_tokens_0_with_a_context_source_is_a_400():
    from types import SimpleNamespace

    from mlx_mtp.server.params import resolve_common
    from mlx_mtp.server.protocol import ChatCompletionRequest

    state = SimpleNamespace(aliases={"m"}, model_name="m", vocab_size=16, context_length=64,
                            default_max_tokens=8, num_mtp_layers=1, sampling_defaults={})

    def resolve(body):
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **body})
        return resolve_common(state, req, 4, None)

    assert resolve({"num_draft_tokens": 0})["num_draft_tokens"] == 0
    assert resolve({"num_draft_tokens": 0, "draft_source": "mtp"})["draft_source"] == "mtp"
    for source in ("lookup", "both"):
        with pytest.raises(APIError) as e:
            resolve({"num_draft_tokens": 0, "draft_source": source})
        assert e.value.status == 400 and e.value.param == "num_draft_tokens"
        assert "turns drafting off" in e.value.message
