"""``POST /v1/messages`` (Anthropic Messages API) driven by the official ``anthropic`` SDK.

Two servers: a real ``mlx-mtp serve`` process on a tiny checkpoint (greedy text equals
``/v1/chat/completions`` for the same conversation, streaming, stop sequences, usage,
errors) and the real app in-process over a scripted engine whose output contains
thinking and a tool call, which a random tiny model never writes (content blocks,
tool_use round trip, auth, a failure mid-stream).
"""

import json
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer

from mlx_mtp.server.events import Admitted, Delta, Done, Failed
from server_process import ServerProcess

SYSTEM = "You are terse."
WEATHER_TOOL = {"name": "get_weather", "description": "Weather of a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": WEATHER_TOOL["input_schema"]}}
GREEDY = {"temperature": 0}  # the SDK has no temperature argument any more: extra_body


# --- a real server -------------------------------------------------------------------------
_shared = {}  # one server process for this module and test_responses_api


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory, request):
    if "server" not in _shared:
        ckpt = tiny_ckpt("qwen3_5", "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
        srv = ServerProcess(ckpt, tmp_path_factory.mktemp("apis"), "--max-kv-size", "1024",
                            "--fixed-k")
        srv.model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

        def stop():
            assert srv.stop() == 0, srv.logs()

        request.config.add_cleanup(stop)
        _shared["server"] = srv
    return _shared["server"]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def gpt(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def chat_text(gpt, server, messages, **kw):
    r = gpt.chat.completions.create(model=server.model, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r


def test_greedy_text_equals_chat_completions(server, claude, gpt):
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    expected, ref = chat_text(gpt, server, [{"role": "system", "content": SYSTEM}] + messages,
                              max_tokens=20)
    m = claude.messages.create(model=server.model, max_tokens=20, system=SYSTEM,
                               messages=messages, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.stop_reason == ("max_tokens" if ref.choices[0].finish_reason == "length"
                             else "end_turn")
    u = m.usage  # input_tokens excludes what came from the prefix cache
    assert u.input_tokens + u.cache_read_input_tokens == ref.usage.prompt_tokens
    assert u.cache_read_input_tokens > 0  # the same prompt ran just before
    assert u.output_tokens == ref.usage.completion_tokens
    # system prompt as blocks is the same prompt
    blocks = claude.messages.create(model=server.model, max_tokens=20, messages=messages,
                                    system=[{"type": "text", "text": SYSTEM}],
                                    extra_body=GREEDY)
    assert blocks.content[0].text == expected
    # without a system prompt the prompt is shorter and also matches chat
    bare, bare_ref = chat_text(gpt, server, messages, max_tokens=8)
    m2 = claude.messages.create(model=server.model, max_tokens=8, messages=messages,
                                extra_body=GREEDY)
    assert m2.content[0].text == bare
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens < ref.usage.prompt_tokens


def stream_events(server, body: dict) -> list:
    """The events of a streamed ``/v1/messages`` request, read off the wire."""
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60,
                      json={**body, **GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for frame in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]  # named events, no [DONE]
        events.append(data)
    return events


def test_stream_events_in_anthropic_order(server, claude):
    kw = dict(model=server.model, max_tokens=16, system=SYSTEM,
              messages=[{"role": "user", "content": "Write a line of verse"}])
    whole = claude.messages.create(extra_body=GREEDY, **kw)
    events = stream_events(server, kw)
    names = [e["type"] for e in events]
    n = len(names)
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:n - 3] == ["content_block_delta"] * (n - 6)
    assert names[n - 3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK's stream helper assembles the same message
    with claude.messages.stream(extra_body=GREEDY, **kw) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_stream_start_usage_splits_the_prompt_as_the_final_usage(server, claude):
    """message_start's usage leaves out what the prefix cache gave (cache_read_input_tokens),
    as message_delta's and a whole response's do."""
    system = "You answer questions about old sailing ships, their crews and their routes. " * 8

    def kw(question):
        return dict(model=server.model, system=system,
                    messages=[{"role": "user", "content": question}])
    questions = ["Count to 1", "Count to 2", "Count to 3"]
    sizes = {claude.messages.count_tokens(**kw(q)).input_tokens for q in questions}
    assert len(sizes) == 1  # equal prompts but for one token: each finds the same prefix
    claude.messages.create(max_tokens=4, extra_body=GREEDY, **kw(questions[0]))  # caches it
    whole = claude.messages.create(max_tokens=4, extra_body=GREEDY, **kw(questions[1])).usage
    events = stream_events(server, dict(max_tokens=4, **kw(questions[2])))
    start, final = events[0]["message"]["usage"], events[-2]["usage"]
    assert whole.cache_read_input_tokens > 0.5 * sizes.pop()  # the shared system prompt
    for usage in (start, final):
        assert usage["cache_read_input_tokens"] == whole.cache_read_input_tokens
        assert usage["input_tokens"] == whole.input_tokens
    assert start["output_tokens"] == 0


def test_stop_sequences(server, claude):
    kw = dict(model=server.model, max_tokens=24, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Count for me"}])
    text = claude.messages.create(**kw).content[0].text
    stop = text[6:10]
    assert stop.strip()
    m = claude.messages.create(stop_sequences=["@@never@@", stop], **kw)
    assert m.content[0].text == text[: text.find(stop)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    with claude.messages.stream(stop_sequences=[stop], **kw) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == m.content[0].text
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_tool_conversation_renders_like_chat(server, claude, gpt):
    """tool_use / tool_result blocks and input_schema tools give the chat prompt."""
    anthropic_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny, 21 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}]
    chat_messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"}]
    expected, ref = chat_text(gpt, server, chat_messages, max_tokens=12, tools=[OPENAI_WEATHER])
    kw = dict(model=server.model, system=SYSTEM, messages=anthropic_messages,
              tools=[WEATHER_TOOL])
    assert claude.messages.count_tokens(**kw).input_tokens == ref.usage.prompt_tokens
    m = claude.messages.create(max_tokens=12, extra_body=GREEDY, **kw)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens
    assert "".join(b.text for b in m.content if b.type == "text") == expected


def test_forced_tool_choice_yields_tool_use(server, claude):
    """tool_choice tool / any forces a call (the prompt opens it); a random model's
    arguments are garbage, but the call and its name come back as a tool_use block."""
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        m = claude.messages.create(model=server.model, max_tokens=8, tools=[WEATHER_TOOL],
                                   tool_choice=choice, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Weather in Paris?"}])
        calls = [b for b in m.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_weather", m.content
        assert isinstance(calls[0].input, dict)
        assert m.stop_reason in ("tool_use", "max_tokens")


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 4, "model": "claude-nope", "messages": [{"role": "user", "content": "hi"}]},
     404, "not_found_error", "claude-nope"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     400, "invalid_request_error", "image"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "Sure"}]},
     400, "invalid_request_error", "prefill"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "temperature"),
    ({"max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "web_search"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "max_tokens"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "context length"),
])
def test_errors_use_anthropic_shape(server, body, status, kind, words):
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind
    assert words in err["error"]["message"]


def test_errors_from_outside_the_route_use_anthropic_shape(server):
    """The request guard and routing answer in Anthropic's shape on these paths too."""
    cases = [(httpx.post(server.url + "/v1/messages", content="hi",
                         headers={"content-type": "text/plain"}), 415, "invalid_request_error"),
             (httpx.post(server.url + "/v1/messages/nope", json={}), 404, "not_found_error"),
             (httpx.get(server.url + "/v1/messages"), 405, "invalid_request_error")]
    for r, status, kind in cases:
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
        assert int(r.headers["content-length"]) == len(r.content)
    # other paths keep the OpenAI envelope
    r = httpx.post(server.url + "/v1/chat/completions", content="hi",
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "message" in r.json()["error"]


def test_sdk_raises_typed_errors(server, claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        claude.messages.create(model=server.model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document", "source": {
                "type": "text", "media_type": "text/plain", "data": "x"}}]}])


# Fields the Messages API lacks (penalties, bias, seed, min_p, our mtp_coupled): accepted as
# the chat endpoint's vendor extensions, as vLLM and llama-server do.
TOKENIZER = Tokenizer.from_file(str(Path(__file__).parent.parent / "mlx_mtp" / "assets" /
                                    "tokenizer" / "tokenizer.json"))  # the tiny models' one
SAMPLED = {"temperature": 0.8, "seed": 3, "min_p": 0.02, "presence_penalty": 0.6,
           "frequency_penalty": 0.4, "repetition_penalty": 1.3, "logit_bias": {"198": -100}}


def test_penalties_bias_and_seed_equal_chat_completions(server, claude, gpt):
    messages = [{"role": "user", "content": "Write a story"}]
    ref = gpt.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                      extra_body=dict(SAMPLED, top_k=50))
    # (this SDK has no temperature or top_k arguments any more: extra_body)
    m = claude.messages.create(model=server.model, max_tokens=16, messages=messages,
                               extra_body=dict(SAMPLED, top_k=50))
    assert m.content[0].text == ref.choices[0].message.content
    # the fields reach the sampler (each one: test_vendor_fields_reach_the_engine): a bias of
    # +100 on one token makes it the whole answer
    forced = claude.messages.create(model=server.model, max_tokens=6, messages=messages,
                                    extra_body={"logit_bias": {"87": 100}, "seed": 1,
                                                "temperature": 1.0})
    assert forced.content[0].text == TOKENIZER.decode([87] * 6)


def test_n_is_refused_in_anthropic_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError, match="n is not a Messages API field"):
        claude.messages.create(model=server.model, max_tokens=4, extra_body={"n": 2},
                               messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(server.url + "/v1/messages", json={
        "max_tokens": 4, "n": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", json={
        "max_tokens": 4, "presence_penalty": "lots", "messages": [{"role": "user",
                                                                   "content": "hi"}]})
    assert r.status_code == 400 and "presence_penalty" in r.json()["error"]["message"]


# --- the app over a scripted engine --------------------------------------------------------
class ScriptedEngine:
    """Stands in for the engine: answers each request with the next scripted output,
    a few characters per event, and records what it was asked."""

    alive = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = set(tokenizer.eos_token_ids)
        self.scripts = []  # (text, finish_reason) or (text, Failed)
        self.requests = []
        self.prefix_cache = SimpleNamespace(enabled=False)
        self.metrics = SimpleNamespace(render=lambda: "")

    def submit(self, req):
        self.requests.append(req)
        text, end = self.scripts.pop(0)

        def run():
            req.on_event(Admitted(0))  # as the engine: joined the batch, nothing cached
            n = 0
            for i in range(0, len(text), 5):
                ids = self.tokenizer.encode(text[i:i + 5], add_special_tokens=False)
                n += len(ids)
                req.on_event(Delta(text[i:i + 5], ids))
                time.sleep(0.002)
            if isinstance(end, Failed):
                req.on_event(end)
                return
            usage = {"prompt_tokens": len(req.prompt), "completion_tokens": n,
                     "total_tokens": len(req.prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            req.on_event(Done(end, usage, {}, {}))

        threading.Thread(target=run, daemon=True).start()

    def cancel(self, req):
        pass


def serve_app(app):
    """Run ``app`` with uvicorn on a free port in a thread; returns (url, server, thread)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", srv, thread


@pytest.fixture(scope="module")
def scripted():
    from mlx_mtp.models.io.loader import load_tokenizer
    from mlx_mtp.server.app import create_app
    from mlx_mtp.server.state import ServerState

    tok = load_tokenizer(Path(__file__).parent.parent / "mlx_mtp" / "assets" / "tokenizer", {})
    engine = ScriptedEngine(tok)
    state = ServerState(engine=engine, tokenizer=tok, model_name="scripted",
                        aliases={"scripted"}, context_length=4096, vocab_size=tok.vocab_size,
                        api_key="secret-key")
    url, srv, thread = serve_app(create_app(state))
    yield SimpleNamespace(url=url, engine=engine, tok=tok)
    srv.should_exit = True
    thread.join(10)


THOUGHT_AND_CALL = ("Paris, so the weather tool.\n</think>\n\nChecking.\n<tool_call>\n"
                    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>")


def test_thinking_text_and_tool_use_blocks(scripted):
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="secret-key", max_retries=0)
    kw = dict(model="scripted", max_tokens=64, tools=[WEATHER_TOOL],
              thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    scripted.engine.scripts += [(THOUGHT_AND_CALL, "stop")] * 2
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "Paris, so the weather tool."
    assert m.content[1].text == "Checking."
    call = m.content[2]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id.startswith("toolu_")
    assert m.stop_reason == "tool_use"
    # thinking enabled: the prompt ends inside an open think block
    prompt = scripted.tok.decode(scripted.engine.requests[-1].prompt)
    assert prompt.endswith("<think>\n") and "get_weather" in prompt

    with claude.messages.stream(**kw) as s:
        events = [e.type for e in s]
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[2].input == {"city": "Paris"}
    assert "input_json" in events and streamed.stop_reason == "tool_use"
    assert streamed.content[0].thinking.strip() == m.content[0].thinking

    # the round trip: the tool_use goes back with a tool_result and renders exactly as
    # the same conversation in chat-completions form
    answer = "The tool says sunny.\n</think>\n\nIt is sunny."
    scripted.engine.scripts += [(answer, "stop")] * 2
    follow = claude.messages.create(**dict(kw, messages=kw["messages"] + [
        {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "sunny, 21 C"}]}]))
    assert [b.type for b in follow.content] == ["thinking", "text"]
    assert follow.content[1].text == "It is sunny." and follow.stop_reason == "end_turn"
    gpt = openai.OpenAI(base_url=scripted.url + "/v1", api_key="secret-key", max_retries=0)
    gpt.chat.completions.create(
        model="scripted", max_tokens=64, tools=[OPENAI_WEATHER],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "Checking.",
                   "reasoning_content": "Paris, so the weather tool.",
                   "tool_calls": [{"id": call.id, "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}])
    anthropic_prompt, chat_prompt = (r.prompt for r in scripted.engine.requests[-2:])
    assert anthropic_prompt == chat_prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in scripted.tok.decode(chat_prompt)


def test_tool_choice_and_parameters_reach_the_engine(scripted):
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="secret-key", max_retries=0)
    scripted.engine.scripts.append(("ok STOP here", "stop"))
    m = claude.messages.create(model="scripted", max_tokens=7, stop_sequences=["STOP"],
                               tools=[WEATHER_TOOL], tool_choice={"type": "none"},
                               metadata={"user_id": "u1"},
                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
                               messages=[{"role": "user", "content": "hi"}])
    req = scripted.engine.requests[-1]
    assert req.max_tokens == 7 and list(req.stop) == ["STOP"]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.5, 0.9, 20)
    # tool_choice none: the tools stay out of the prompt
    assert "get_weather" not in scripted.tok.decode(req.prompt)
    assert m.content[0].text == "ok STOP here"  # the scripted engine ignores stop strings


def test_vendor_fields_reach_the_engine(scripted):
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="secret-key", max_retries=0)
    scripted.engine.scripts.append(("ok", "stop"))
    claude.messages.create(model="scripted", max_tokens=5,
                           extra_body=dict(SAMPLED, top_k=7, mtp_coupled=True),
                           messages=[{"role": "user", "content": "hi"}])
    req = scripted.engine.requests[-1]
    s = req.sampling
    assert (s.temperature, s.seed, s.top_k, s.min_p, s.coupled) == (0.8, 3, 7, 0.02, True)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.6, 0.4, 1.3)
    assert s.logit_bias == ((198, -100.0),)


def test_auth_and_failure_mid_stream(scripted):
    body = {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    url = scripted.url + "/v1/messages"
    for headers in ({}, {"x-api-key": "wrong"}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=scripted.url, api_key="wrong", max_retries=0) \
            .messages.create(**body)
    scripted.engine.scripts.append(("fine", "stop"))
    ok = httpx.post(url, json=body, headers={"Authorization": "Bearer secret-key"})
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == "fine"
    scripted.engine.scripts.append(("some text before it breaks",
                                    Failed(500, "Out of memory while generating")))
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="secret-key", max_retries=0)
    with pytest.raises(anthropic.APIStatusError, match="Out of memory"):
        with claude.messages.stream(**body) as s:
            for _ in s:
                pass
    scripted.engine.scripts.append(("", Failed(503, "The server is overloaded")))
    r = httpx.post(url, json=body, headers={"x-api-key": "secret-key"})
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    # streamed, a failure right after admission (before any token) still gets its status
    scripted.engine.scripts.append(("", Failed(503, "The server is overloaded")))
    r = httpx.post(url, json={**body, "stream": True}, headers={"x-api-key": "secret-key"})
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
