"""Server pieces that need no model: parsers, prefix cache, metrics, request validation."""

import json
import random

import pytest

from mlx_mtp.decode.stats import SpecStats
from mlx_mtp.server.metrics import ServerMetrics
from mlx_mtp.server.parsers import OutputParser, parse_full, parse_tool_body
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                     parse_request)

WEATHER = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "ratio": {"type": "number"},
        "note": {"type": ["string", "null"]}}}}}]

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = {"city": "New York", "days": 3, "metric": True, "hours": [1, 2], "ratio": 0.5,
            "note": "line one\nline two"}


def stream(text, pieces_of=1, seed=0, **kw):
    """Feed ``text`` in random-sized pieces; returns the parser's pieces."""
    rng = random.Random(seed)
    p = OutputParser(**kw)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, pieces_of) if pieces_of > 1 else 1
        out += p.feed(text[i:i + n])
        i += n
    return out + p.finish()


def collect(pieces):
    return ("".join(p.text for p in pieces if p.kind == "content"),
            "".join(p.text for p in pieces if p.kind == "reasoning"),
            [p.call for p in pieces if p.kind == "tool_call"])


# --- tool calls -------------------------------------------------------------------------
def test_xml_tool_call_types_follow_schema():
    calls = parse_tool_body(XML_CALL[len("<tool_call>"):-len("</tool_call>")], WEATHER)
    assert len(calls) == 1
    c = calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_")
    assert c["function"]["name"] == "get_weather"
    assert json.loads(c["function"]["arguments"]) == XML_ARGS


def test_hermes_json_tool_call():
    calls = parse_tool_body('\n{"name": "f", "arguments": {"a": 1, "b": "x"}}\n')
    assert calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": "x"}
    # arguments already a string: passed through
    calls = parse_tool_body('{"name": "g", "arguments": "{\\"q\\": 2}"}')
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": 2}
    assert parse_tool_body("{not json") is None
    assert parse_tool_body("plain words") is None


@pytest.mark.parametrize("pieces_of", [1, 3, 17, 1000])
def test_streaming_xml_call_is_one_delta_whatever_the_chunking(pieces_of):
    text = "Let me check.\n</think>\n\nChecking the weather.\n" + XML_CALL
    out = stream(text, pieces_of, start_in_reasoning=True, tools=WEATHER, parse_tools=True)
    content, reasoning, calls = collect(out)
    assert reasoning.strip() == "Let me check."
    assert content.strip() == "Checking the weather."
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == XML_ARGS
    # nothing of the call's markup leaks into text
    assert "<" not in content and "parameter" not in content


def test_streaming_holds_back_until_the_call_closes():
    p = OutputParser(tools=WEATHER, parse_tools=True)
    out = p.feed("Hi <tool_")
    assert collect(out)[0] == "Hi "  # "<tool_" held back: may start a tag
    out = p.feed('call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert out == []  # inside the call: nothing streamed
    out = p.feed("\n</tool_call>")
    assert [x.kind for x in out] == ["tool_call"]


def test_multiple_calls_and_hermes_in_stream():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": [1]}}\n</tool_call>')
    content, _, calls = collect(stream(text, 4, tools=WEATHER, parse_tools=True))
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert content.strip() == ""


def test_unparseable_call_is_passed_through_as_content():
    r = parse_full("<tool_call>\nnonsense\n</tool_call> after", tools=WEATHER, parse_tools=True)
    assert r["tool_calls"] == [] and "nonsense" in r["content"]


def test_unclosed_call_at_end_is_still_parsed():
    r = parse_full('x <tool_call>\n{"name": "f", "arguments": {"a": 1}}', parse_tools=True)
    assert r["tool_calls"][0]["function"]["name"] == "f"


def test_tools_not_requested_means_no_parsing():
    r = parse_full('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert r["tool_calls"] == [] and "<tool_call>" in r["content"]


# --- reasoning -------------------------------------------------------------------------
def test_reasoning_split_when_prompt_opened_think():
    r = parse_full("\nsome thoughts\n</think>\n\nThe answer.", start_in_reasoning=True)
    assert r == {"content": "The answer.", "reasoning": "some thoughts", "tool_calls": []}


def test_reasoning_split_when_model_opens_think():
    r = parse_full("<think>\nhmm\n</think>\n\nDone.")
    assert r["reasoning"] == "hmm" and r["content"] == "Done."


def test_tool_call_inside_reasoning_ends_it():
    r = parse_full("I should call it " + XML_CALL, start_in_reasoning=True, tools=WEATHER,
                   parse_tools=True)
    assert r["reasoning"] == "I should call it" and len(r["tool_calls"]) == 1


def test_unfinished_reasoning_is_all_reasoning():
    content, reasoning, _ = collect(stream("thinking and thinking", 3, start_in_reasoning=True))
    assert content == "" and reasoning == "thinking and thinking"


def test_reasoning_parser_off_keeps_tags():
    r = parse_full("<think>x</think>y", reasoning=False)
    assert r["content"] == "<think>x</think>y" and r["reasoning"] is None


def test_think_tag_after_content_is_text():
    r = parse_full("Use <think> tags like this.")
    assert r["content"] == "Use <think> tags like this."


# --- prefix cache ---------------------------------------------------------------------
class FakeState:
    def __init__(self, n):
        self.n_processed = n


def test_prefix_cache_longest_prefix_and_lru():
    pc = PrefixCache(max_entries=2, max_bytes=1000)
    pc.store([1, 2, 3], FakeState(2), 100, True)
    pc.store([1, 2, 3, 4, 5], FakeState(4), 100, True)
    assert pc.lookup([1, 2, 3, 4, 5, 6], need_mtp=True).state.n_processed == 4
    assert pc.lookup([1, 2, 3, 9], need_mtp=True).state.n_processed == 2
    assert pc.lookup([1, 2], need_mtp=True) is None  # longer than the prompt
    assert pc.lookup([7, 1, 2, 3], need_mtp=True) is None
    pc.store([9, 9], FakeState(1), 100, True)  # evicts the least recently used ([1,2,3,4,5])
    assert pc.lookup([1, 2, 3, 4, 5, 6], need_mtp=True).state.n_processed == 2
    assert len(pc) == 2


def test_prefix_cache_bytes_bound_and_mtp_flag():
    pc = PrefixCache(max_entries=10, max_bytes=250)
    pc.store([1], FakeState(0), 100, False)
    assert pc.lookup([1, 2], need_mtp=True) is None  # no MTP state in it
    assert pc.lookup([1, 2], need_mtp=False) is not None
    pc.store([2], FakeState(0), 100, True)
    pc.store([3], FakeState(0), 100, True)
    assert pc.nbytes <= 250 and len(pc) == 2
    assert not pc.store([4], FakeState(0), 1000, True)  # larger than the whole cache
    assert not PrefixCache(0, 100).store([1], FakeState(0), 1, True)


# --- metrics --------------------------------------------------------------------------
def test_metrics_parse_with_prometheus_client():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics("my-model", running=lambda: 3, waiting=lambda: 1)
    m.record_step(3, 2)
    m.record_step(2, 0)
    m.ttft.observe(0.05)
    m.request_success.inc(finished_reason="stop")
    families = {f.name: f for f in text_string_to_metric_families(m.render())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted({"model_name": "my-model", **labels}.items())))]

    assert value("mlx_mtp:num_requests_running") == 3
    assert value("mlx_mtp:num_requests_waiting") == 1
    assert value("mlx_mtp:spec_decode_num_drafts_total") == 2
    assert value("mlx_mtp:spec_decode_num_draft_tokens_total") == 5
    assert value("mlx_mtp:spec_decode_num_accepted_tokens_total") == 2
    per_pos = "mlx_mtp:spec_decode_num_accepted_tokens_per_pos_total"
    assert [value(per_pos, position=str(j)) for j in range(3)] == [1, 1, 0]
    drafted = "mlx_mtp:spec_decode_num_drafted_tokens_per_pos_total"
    assert [value(drafted, position=str(j)) for j in range(3)] == [2, 2, 1]
    assert value("mlx_mtp:time_to_first_token_seconds_bucket", le="0.04") == 0
    assert value("mlx_mtp:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value("mlx_mtp:time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert value("mlx_mtp:time_to_first_token_seconds_count") == 1
    assert value("mlx_mtp:request_success_total", finished_reason="stop") == 1
    assert families["mlx_mtp:inter_token_latency_seconds"].type == "histogram"
    assert families["mlx_mtp:prompt_tokens"].type == "counter"
    # Every sample is one of the names the server has always exposed, labelled with the model.
    assert all(name.startswith("mlx_mtp:") and not name.endswith("_created")
               and dict(labels)["model_name"] == "my-model" for name, labels in samples)
    snap = m.snapshot()
    assert snap["num_drafts"] == 2 and snap["requests_finished"] == 1
    assert snap["per_position"][2] == {"position": 2, "drafted": 1, "accepted": 0, "rate": 0.0}
    assert snap["acceptance_rate"] == pytest.approx(2 / 5)
    assert snap["mean_acceptance_length"] == pytest.approx(1 + 2 / 2)
    # The live page and /metrics render the same counts.
    assert snap["accepted_per_pos"] == [value(per_pos, position=str(j)) for j in range(3)]
    assert ServerMetrics("m").snapshot()["acceptance_rate"] is None  # nothing drafted yet
    assert snap["mean_ttft_seconds"] == pytest.approx(0.05) and snap["mean_itl_seconds"] is None


def test_spec_stats_rendered_once_for_every_surface():
    s = SpecStats()
    s.record(3, 2)
    s.record(2, 0)
    line = s.describe()
    assert line == ("MTP: accepted 2/5 (40.0%), mean acceptance length 2.00, "
                    "per-pos [0.50 0.50 0.00], drafts 2")
    fields = s.to_dict()
    assert fields["acceptance_rate"] == pytest.approx(0.4) and fields["num_drafts"] == 2
    assert (fields["accepted_per_pos"], fields["drafted_per_pos"]) == ([1, 1, 0], [2, 2, 1])
    assert fields["mtp_acceptance_rate"] == pytest.approx(0.4)
    assert SpecStats().to_dict()["acceptance_rate"] == 0.0  # a response that drafted nothing
    assert SpecStats().to_dict(missing=None)["lookup_acceptance_rate"] is None
    s.record(4, 3, lookup_drafted=3, lookup_accepted=3)  # a context run the head extended
    assert s.by_source() == {"mtp": {"drafted": 6, "accepted": 2},
                             "lookup": {"drafted": 3, "accepted": 3}}
    assert s.describe().endswith("; by source: context 3/3, head 2/6")


def test_the_periodic_log_line_is_the_stats_line(caplog):
    import logging

    from mlx_mtp.server.metrics import PeriodicLog

    periodic = PeriodicLog(1e-9)
    periodic.record(4, 3, 4, lookup_drafted=3, lookup_accepted=3)
    with caplog.at_level(logging.INFO, logger="mlx_mtp.server"):
        periodic.maybe_log(1, 0, lambda: None)
    assert "Running: 1 reqs, Waiting: 0 reqs" in caplog.text
    assert "MTP: accepted 3/4 (75.0%)" in caplog.text
    assert "by source: context 3/3, head 0/1" in caplog.text


# --- request validation ---------------------------------------------------------------
def _err(raw, cls=ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse_request(raw if isinstance(raw, bytes) else json.dumps(raw).encode(), cls)
    assert e.value.status == 400
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return e.value


def test_request_validation():
    ok = parse_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                   "temperature": 1, "user": "ignored"}).encode(),
                       ChatCompletionRequest)
    assert ok.temperature == 1.0 and ok.model_extra["user"] == "ignored"
    assert _err(b"{not json").code == "invalid_json"
    assert _err(b"[1, 2]").code == "invalid_json"
    assert _err({"messages": []}).param == "messages"
    assert _err({"messages": "hi"}).param == "messages"
    e = _err({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})
    assert e.param == "temperature" and e.code == "invalid_type"
    assert _err({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}).param \
        == "max_tokens"
    assert _err({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}).param \
        == "max_tokens"
    assert _err({"messages": [{"role": "wizard", "content": "x"}]}).param == "messages"
    assert _err({"prompt": 5}, CompletionRequest).param == "prompt"
    assert _err({}, CompletionRequest).param == "prompt"


def test_tool_format_restriction():
    body = '{"name": "f", "arguments": {}}'
    assert parse_tool_body(body, fmt="hermes") and parse_tool_body(body, fmt="auto")
    assert parse_tool_body(body, fmt="qwen3_coder") is None
    xml = XML_CALL[len("<tool_call>"):-len("</tool_call>")]
    assert parse_tool_body(xml, WEATHER, fmt="qwen3_coder")
    assert parse_tool_body(xml, WEATHER, fmt="hermes") is None


def test_every_api_is_one_router_the_app_includes_the_same_way():
    """Each API's routes come from its ``routers.<api>.router(pipe)``, and the app routes every
    one of those paths (another method on it is a 405, not a 404): the catalogue is unchanged."""
    from pathlib import Path
    from types import SimpleNamespace

    from fastapi import APIRouter
    from fastapi.testclient import TestClient

    from mlx_mtp.models.io.loader import load_tokenizer
    from mlx_mtp.server.app import create_app
    from mlx_mtp.server.pipeline import Pipeline
    from mlx_mtp.server.routers import APIS
    from mlx_mtp.server.state import ServerState

    tok = load_tokenizer(Path(__file__).parent.parent / "mlx_mtp" / "assets" / "tokenizer", {})
    state = ServerState(engine=SimpleNamespace(alive=True), tokenizer=tok, model_name="m",
                        aliases={"m"}, context_length=64, vocab_size=len(tok.get_vocab()))
    expected = {("POST", p) for p in (
        "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
        "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/responses")}
    expected |= {("GET", p) for p in (
        "/health", "/v1/health", "/metrics", "/v1/models", "/v1/models/{model_id:path}",
        "/", "/static/{name}", "/v1/dashboard", "/v1/dashboard/events")}
    routed = set()
    for api in APIS:
        router = api.router(Pipeline(state))
        assert isinstance(router, APIRouter), api.__name__
        routed |= {(m, r.path) for r in router.routes for m in r.methods if m in ("GET", "POST")}
    assert routed == expected
    client = TestClient(create_app(state))
    for method, path in sorted(expected):
        url = path.replace("{model_id:path}", "m").replace("{name}", "app.js")
        r = client.request("GET" if method == "POST" else "POST", url)
        assert r.status_code == 405, (method, path, r.text)
    assert client.get("/v1/nothing").status_code == 404
    state.prompt_workers.shutdown()
