"""Issue 25: a request's grammar fails alone, before its request joins the batch or, when a
matcher fails mid-output, as its own row; short error bodies; the low-severity API fixes."""

import json
import threading
from pathlib import Path

import httpx
import pytest

from grammar_fixtures import VOCAB, ckpt, grammar, tok  # noqa: F401  (fixtures)
from mlx_mtp.decode import grammar as G
from mlx_mtp.decode.batch import BatchDecoder, BatchStepError
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.server.structured import tool_call_grammar

PROMPTS = [[1, 5, 9, 22, 7, 3, 100, 200], [4, 8, 15, 16, 23, 42], [7, 7, 1, 2, 3, 9, 11]]

CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# A position with 2,500 open alternatives: llguidance's matcher fails once output starts.
WIDE = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                   "required": [f"k{i}"]} for i in range(2500)]}
HUGE = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 60}
                                         for i in range(14000)}}
BAD_REGEX = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}},
             "required": ["a"]}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def assert_short(message: str):
    """One line, no parser state, no backtrace, no paths."""
    assert "\n" not in message and len(message) < 300, message
    for leak in ("<state>", "backtrace", "Parser:", "/home", "/work", ".rs"):
        assert leak not in message, message


def compile_format(tok, response_format):
    return grammar(tok, G.response_format_grammar(response_format))


@pytest.mark.parametrize("fmt,reason", [
    (schema_format(CYCLE), "NoExtensionBias"),
    (schema_format(WIDE), "anyOf/oneOf alternatives"),
    (schema_format(HUGE), "too large"),
    (schema_format(BAD_REGEX), "regex parse error"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": "x"}, "json_schema"),
], ids=["ref-cycle", "2500-branch-anyOf", "1.5MB-schema", "bad-regex", "no-json_schema",
        "json_schema-not-object"])
def test_bad_schemas_are_refused_at_compile_time_with_one_line(tok, fmt, reason):
    with pytest.raises(G.GrammarError) as e:
        compile_format(tok, fmt)
    assert reason in str(e.value)
    assert_short(str(e.value))


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("forced", ["f", "required"])
def test_strict_tool_with_an_invalid_regex_is_refused(tok, fmt, forced):
    """Also the XML format, whose string parameters are free text (the regex unused)."""
    tools = [{"type": "function", "function": {"name": "f", "strict": True,
                                               "parameters": BAD_REGEX}}]
    with pytest.raises(G.GrammarError, match="regex parse error"):
        text = tool_call_grammar(fmt, tools, forced)
        G.Grammar(tok, text, VOCAB, sorted(tok.eos_token_ids))


def solo_tokens(model, prompt, n, k):
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)]


@pytest.mark.parametrize("k", [0, 2])
def test_a_grammar_failing_mid_output_fails_only_its_row(ckpt, tok, k):
    """A matcher that fails after its first token (compiled here without the schema bounds
    that refuse it in the server) fails its own row, named; the other rows, one of them
    constrained, decode on exactly as alone (a constrained row's commits from the failed
    step are rolled back with the batch)."""
    model, _ = load_model(Path(ckpt))
    eos = sorted(tok.eos_token_ids)
    wide = G.Grammar(tok, G.lark_grammar(f"start: %json {json.dumps(WIDE)}"), VOCAB, eos)
    good = G.Grammar(tok, G.json_schema_grammar(None), VOCAB, eos)
    grams = [good, wide, None]  # the failing row between the two others
    bd = BatchDecoder(model, k > 0, adaptive=False)
    for i, (prompt, g) in enumerate(zip(PROMPTS, grams)):
        dec = MTPDecoder(model, k, SamplingParams(), adaptive=False,
                         grammar=None if g is None else g.start())
        dec.prefill(prompt)
        bd.add(i, dec)
    outs = {i: [] for i in range(3)}
    failed = []
    for _ in range(40):
        try:
            for key, out in bd.step().items():
                outs[key].extend(out.tokens)
        except BatchStepError as e:
            failed.append(e.key)
            assert isinstance(e.cause, G.GrammarFailure)
            assert_short(str(e.cause))
            bd.remove(e.key)
        if len(outs[2]) >= 24:
            break
    assert failed == [1]
    dec = MTPDecoder(model, 0, SamplingParams(), adaptive=False, grammar=good.start())
    want0 = []
    for t, _, _ in generate_step(PROMPTS[0], model, decoder=dec, max_tokens=24):
        want0.append(t)
        if t in eos:
            break
    assert outs[0][:len(want0)] == want0
    assert outs[2][:24] == solo_tokens(model, PROMPTS[2], 24, 0)


# --- engine: queue -------------------------------------------------------------------------


def test_max_queue_counts_only_requests_that_wait(ckpt, tok):
    """--max-queue 2 with one free slot: three requests go in (one starts, two wait)."""
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.events import EngineRequest

    model, _ = load_model(Path(ckpt))
    engine = Engine(model, tok, max_concurrency=1, max_queue=2, calibrate=False)
    reqs = [EngineRequest(prompt=[1, 2, 3], sampling=SamplingParams(), max_tokens=50,
                          on_event=lambda ev: None) for _ in range(4)]
    for r in reqs[:3]:
        engine.submit(r)
    with pytest.raises(OverflowError):
        engine.submit(reqs[3])
    engine.step()  # the first starts: its slot is taken, two wait
    assert engine.num_running == 1 and engine.num_waiting == 2
    with pytest.raises(OverflowError):
        engine.submit(reqs[3])


# --- server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    from server_process import ServerProcess

    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("round5"), "--num-draft-tokens", "2",
                        "--allowed-origins", "http://ui.example")
    yield srv
    srv.stop()


CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Describe an item."}]


def post(srv, path, body, headers=None, timeout=180):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=timeout)


def envelope(r, status, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert_short(err["message"])
    return err


def chat(srv, i: int) -> dict:
    r = post(srv, CHAT, {"messages": [{"role": "user", "content": f"Story {i}"}],
                         "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_streams_survive_bad_schemas(server):
    """N chats beside every bad schema: N of N finish with their lone output; each bad
    request gets a 400 invalid_response_format."""
    n = 4
    alone = [chat(server, i) for i in range(n)]
    results, bad = [None] * n, []

    def run(i):
        results[i] = chat(server, i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for schema in (CYCLE, WIDE, HUGE, BAD_REGEX):
        bad.append(post(server, CHAT, {"messages": ASK, "max_tokens": 8,
                                       "response_format": schema_format(schema)}))
    for t in threads:
        t.join()
    assert results == alone
    for r in bad:
        envelope(r, 400, "response_format", "invalid_response_format")


@pytest.mark.parametrize("name,path,body,param", [
    ("json_schema missing", CHAT, {"messages": ASK, "response_format": {"type": "json_schema"}},
     "response_format"),
    ("strict forced tool, invalid regex", CHAT, {
        "messages": ASK, "tool_choice": {"type": "function", "function": {"name": "f"}},
        "tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                    "parameters": BAD_REGEX}}]}, "tools"),
    ("reasoning summary not a list", "/v1/responses", {"input": [
        {"type": "reasoning", "summary": "thought"},
        {"role": "user", "content": "hi"}]}, "input"),
    ("reasoning text not a string", "/v1/responses", {"input": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]},
        {"role": "user", "content": "hi"}]}, "input"),
    ("reasoning content not a list", "/v1/responses", {"input": [
        {"type": "reasoning", "content": 7}, {"role": "user", "content": "hi"}]}, "input"),
    ("text part with non-string text", CHAT, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("responses text part with non-string text", "/v1/responses", {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
])
def test_low_severity_inputs_are_400(server, name, path, body, param):
    err = envelope(post(server, path, body), 400, param)
    assert "(got type 'text')" not in err["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_reasoning_items_still_work(server):
    r = post(server, "/v1/responses", {"input": [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"role": "user", "content": "hi"}], "max_output_tokens": 4})
    assert r.status_code == 200, r.text


def test_disallowed_cors_preflight_answers_like_the_request(server):
    preflight = {"origin": "http://evil.example", "access-control-request-method": "POST"}
    r = httpx.options(server.url + CHAT, headers=preflight, timeout=30)
    err = envelope(r, 403, code="origin_not_allowed")
    request = post(server, CHAT, {"messages": ASK, "max_tokens": 2},
                   headers={"origin": "http://evil.example"})
    assert envelope(request, 403)["code"] == err["code"]
    ok = httpx.options(server.url + CHAT, headers=dict(preflight, origin="http://ui.example"),
                       timeout=30)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://ui.example"
