"""What a client sends never hurts the server or other clients (issue 12, items 1, 2, 4-7).

Pieces without a model first (request parsing, template variables, tool_choice, the
prompt worker lanes, the guard's rules), then real server processes driven over HTTP and
raw sockets: size and time limits, browser checks, disconnects, status codes, API keys.
"""

import json
import socket
import threading
import time

import httpx
import pytest

from mlx_mtp.server.params import check_stop
from mlx_mtp.server.http_guard import GuardConfig, host_name, split_list
from mlx_mtp.server.prompts import check_template_variables, prepare_chat
from mlx_mtp.server.protocol import APIError, ChatCompletionRequest, load_json_body
from mlx_mtp.server.state import PromptWorkers, ServerState, max_token_chars

from server_process import ServerProcess

MSG = [{"role": "user", "content": "hi"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]


def status_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    return e.value


# --- request bodies ---------------------------------------------------------------------
def test_deep_json_and_lone_surrogates_are_400():
    for depth in (100, 5000):  # 5000 overflows json's recursion: was a 500
        raw = b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
        e = status_of(load_json_body, raw)
        assert e.status == 400 and "nested" in e.message
    assert load_json_body(b'{"a": ' + b"[" * 60 + b"]" * 60 + b"}")
    for raw in (b'{"a": "\\ud800"}', b'{"a": "x\\uDC00y"}', b'{"a": "\xed\xa0\x80"}'):
        e = status_of(load_json_body, raw)
        assert e.status == 400 and "surrogate" in e.message
    assert load_json_body(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}  # a pair is fine
    assert load_json_body(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash


def test_stop_strings_are_capped():
    assert check_stop(["a"] * 16) == ["a"] * 16
    assert check_stop(["x" * 256, ""]) == ["x" * 256]
    assert status_of(check_stop, ["s"] * 17).param == "stop"
    assert status_of(check_stop, "y" * 257).param == "stop"


# --- chat template variables and tool_choice (real tokenizer, no model) -------------------
@pytest.fixture(scope="module")
def tiny_state(tiny_ckpt):
    from mlx_mtp.models.io.loader import load_config, load_tokenizer

    path = tiny_ckpt("qwen3_5", "random", vocab_size=4096)
    tok = load_tokenizer(path, load_config(path))
    return ServerState(engine=None, tokenizer=tok, model_name="tiny", aliases={"tiny"},
                       context_length=1024, vocab_size=4096,
                       max_chars_per_token=max_token_chars(tok))


def chat_request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(dict({"messages": MSG}, **kw))


@pytest.mark.parametrize("name", ["chat_template", "documents", "continue_final_message",
                                  "tokenizer_kwargs", "tools", "add_generation_prompt",
                                  "messages", "return_dict", "eos_token", "not a name"])
def test_renderer_parameters_are_refused(tiny_state, name):
    evil = "{% for i in range(10**9) %}{% for j in range(10**9) %}x{% endfor %}{% endfor %}"
    req = chat_request(chat_template_kwargs={name: evil})
    t0 = time.perf_counter()
    e = status_of(prepare_chat, tiny_state, req)
    assert e.status == 400 and e.param == f"chat_template_kwargs.{name}" and name in e.message
    assert time.perf_counter() - t0 < 1.0  # refused, never rendered


def test_template_variables_are_accepted(tiny_state):
    check_template_variables(tiny_state.tokenizer, {"enable_thinking": True, "my_flag": [1]})
    on = prepare_chat(tiny_state, chat_request(chat_template_kwargs={"enable_thinking": True}))
    off = prepare_chat(tiny_state, chat_request(chat_template_kwargs={"enable_thinking": False}))
    assert on.start_in_reasoning and not off.start_in_reasoning


def test_tool_choice_is_checked_and_forced(tiny_state):
    tok = tiny_state.tokenizer
    e = status_of(prepare_chat, tiny_state, chat_request(
        tools=WEATHER, tool_choice={"type": "function", "function": {"name": "nope"}}))
    assert e.status == 400 and e.param == "tool_choice" and "nope" in e.message
    for bad in ("sometimes", {"type": "function"}):
        assert status_of(prepare_chat, tiny_state, chat_request(
            tools=WEATHER, tool_choice=bad)).param == "tool_choice"
    assert status_of(prepare_chat, tiny_state, chat_request(tool_choice="required")).param \
        == "tool_choice"
    auto = prepare_chat(tiny_state, chat_request(tools=WEATHER))
    assert auto.forced_prefix == ""
    named = prepare_chat(tiny_state, chat_request(
        tools=WEATHER, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    # The Qwen3.5 template writes XML tool calls: the prompt ends inside a call to get_time.
    assert named.forced_prefix.endswith("<tool_call>\n<function=get_time>\n")
    assert tok.decode(named.ids).endswith(named.forced_prefix)
    required = prepare_chat(tiny_state, chat_request(tools=WEATHER, tool_choice="required"))
    assert required.forced_prefix.endswith("<tool_call>\n<function=")
    # with thinking on, the forced call closes the think block first
    think = prepare_chat(tiny_state, chat_request(
        tools=WEATHER, tool_choice="required", chat_template_kwargs={"enable_thinking": True}))
    assert think.forced_prefix.startswith("\n\n</think>\n\n<tool_call>")


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_state):
    calls = []

    class CountingTokenizer:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def encode(self, *a, **kw):
            calls.append(len(a[0]))
            return self.inner.encode(*a, **kw)

    limit = tiny_state.context_length * tiny_state.max_chars_per_token
    assert 0 < tiny_state.max_chars_per_token < 1000
    big = chat_request(messages=[{"role": "user", "content": "a" * (limit + 1)}])
    e = status_of(prepare_chat, tiny_state, big, CountingTokenizer(tiny_state.tokenizer))
    assert e.code == "context_length_exceeded" and e.param == "messages" and calls == []
    small = prepare_chat(tiny_state, chat_request(), CountingTokenizer(tiny_state.tokenizer))
    assert calls and small.ids


def test_small_prompts_never_wait_behind_a_large_one(tiny_state):
    workers = PromptWorkers(tiny_state.tokenizer, small_body_bytes=1000)
    seen = {}

    def job(name, seconds, tok=None):
        seen[name] = tok
        time.sleep(seconds)
        return time.perf_counter()

    async def scenario():
        import asyncio

        large = asyncio.ensure_future(workers.run(10 ** 6, job, "large", 1.5))
        await asyncio.sleep(0.1)
        small_done = await workers.run(100, job, "small", 0.0)
        return small_done, await large

    import asyncio

    small_done, large_done = asyncio.run(scenario())
    workers.shutdown()
    assert small_done < large_done - 0.5
    # each lane tokenizes with its own copy ("Already borrowed" otherwise)
    assert seen["small"] is not seen["large"]
    assert tiny_state.tokenizer not in (seen["small"], seen["large"])
    assert seen["small"].encode("hello") == tiny_state.tokenizer.encode("hello")


def test_guard_rules():
    assert split_list(["http://a.com,http://b.com", "http://c.com"]) == [
        "http://a.com", "http://b.com", "http://c.com"]
    assert [host_name(h) for h in ("LocalHost:8080", "[::1]:80", "::1", "a.b")] == [
        "localhost", "::1", "::1", "a.b"]
    g = GuardConfig(allowed_hosts={"localhost", "127.0.0.1", "::1"},
                    allowed_origins={"http://ui.example"})
    assert g.host_allowed("127.0.0.1:8080") and g.host_allowed("app.localhost")
    assert not g.host_allowed("evil.example") and not g.host_allowed("127.0.0.1.evil.example")
    assert g.origin_allowed("http://ui.example", "127.0.0.1:8080")
    assert g.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080")  # same origin
    assert not g.origin_allowed("http://evil.example", "127.0.0.1:8080")
    assert not g.origin_allowed("null", "127.0.0.1:8080")


# --- a real server ------------------------------------------------------------------------------
CTX = 4096
CAP = 2 << 20
READ_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def keyed_server(tiny_ckpt, tmp_path_factory):
    """``test_api_key``'s server, started with the first (whose setup waits for both): the
    starts overlap, and it idles until its test."""
    path = tiny_ckpt("qwen3_5", "random", vocab_size=4096)
    srv = ServerProcess(path, tmp_path_factory.mktemp("key"), "--no-mtp", "--api-key",
                        "s3cret", "--protect-metrics", wait=False)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(tiny_ckpt, keyed_server, tmp_path_factory):
    path = tiny_ckpt("qwen3_5", "noisy", vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)
    srv = ServerProcess(path, tmp_path_factory.mktemp("hardening"), "--max-kv-size", str(CTX),
                        "--max-request-bytes", str(CAP), "--read-timeout", str(READ_TIMEOUT),
                        "--allowed-origins", "http://ui.example,http://b.example")
    keyed_server.wait()  # idle through the timed tests
    yield srv
    srv.stop()


def post(srv, path, body=None, raw=None, headers=None, timeout=60):
    kw = {"json": body} if raw is None else {"content": raw}
    return httpx.post(srv.url + path, headers=headers, timeout=timeout, **kw)


def envelope(r, status, code=None, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


JSON = {"content-type": "application/json"}
CHAT = "/v1/chat/completions"
BAD = [  # name, path, body (bytes: sent as is), status, code, param
    ("deep JSON", CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     "invalid_json", None),
    ("lone surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400,
     "invalid_json", None),
    ("temperature above 2", CHAT, {"messages": MSG, "temperature": 2.5}, 400, None,
     "temperature"),
    ("completion too long names prompt", "/v1/completions", {"prompt": "word " * 5000}, 400,
     "context_length_exceeded", "prompt"),
    ("17 stop strings", CHAT, {"messages": MSG, "stop": ["x"] * 17}, 400, None, "stop"),
    ("stop string too long", CHAT, {"messages": MSG, "stop": "x" * 300}, 400, None, "stop"),
    ("request chat_template", CHAT, {"messages": MSG, "chat_template_kwargs": {
        "chat_template": "{% for i in range(99999) %}{{ i }}{% endfor %}"}}, 400, None,
     "chat_template_kwargs.chat_template"),
    ("unknown tool_choice function", CHAT, {"messages": MSG, "tools": WEATHER, "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, 400, None, "tool_choice"),
    ("tool_choice required without tools", CHAT, {"messages": MSG, "tool_choice": "required"},
     400, None, "tool_choice"),
]


@pytest.mark.parametrize("name,path,body,status,code,param", BAD, ids=[b[0] for b in BAD])
def test_status_codes(server, name, path, body, status, code, param):
    raw = body if isinstance(body, bytes) else None
    envelope(post(server, path, None if raw else body, raw=raw, headers=JSON), status, code,
             param)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_temperature_2_is_accepted(server):
    assert post(server, CHAT, {"messages": MSG, "temperature": 2, "max_tokens": 2}) \
        .status_code == 200


def test_named_tool_choice_forces_the_call(server):
    r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What time is it?"}], "max_tokens": 8,
        "temperature": 0, "tools": WEATHER,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    choice = r.json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]][0] == "get_weather"


def test_request_size_limits(server):
    big = json.dumps({"prompt": "a" * (CAP + 10)}).encode()
    t0 = time.perf_counter()
    envelope(post(server, "/v1/completions", raw=big,
                  headers={"content-type": "application/json"}), 413, "request_too_large")

    def chunks():  # no Content-Length: cut off while streaming in
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    envelope(post(server, "/v1/completions", raw=chunks(),
                  headers={"content-type": "application/json"}), 413, "request_too_large")
    assert time.perf_counter() - t0 < 20


def test_a_short_chat_does_not_wait_for_a_long_prompt(server):
    """Prompts just under the character bound are tokenized (then refused as too many
    tokens); a short chat sent meanwhile finishes before them. Three of them queue in the
    large-body lane one after another, so the chat, however slow the machine, is sent
    while they are being tokenized and must overtake at least the last: it would wait
    behind all three if it shared their lane."""
    tok_chars = 140  # max_token_chars of the tiny tokenizer (checked in the unit tests)
    text = ("def f(x):\n    return x + 1\n" * 100000)[: CTX * tok_chars - 100]
    answers = []

    def long_one():
        r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 4})
        answers.append((r, time.perf_counter()))

    threads = [threading.Thread(target=long_one) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 4,
                                               "temperature": 0})
    short_done = time.perf_counter()
    for t in threads:
        t.join(300)
    assert r.status_code == 200 and len(answers) == 3
    assert short_done < max(done for _, done in answers)
    for long_r, _ in answers:
        envelope(long_r, 400, "context_length_exceeded")
        assert "tokens" in long_r.json()["error"]["message"]  # tokenized, not pre-refused


def raw_exchange(srv, data: bytes, wait: float) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(data)
        s.settimeout(wait)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def test_half_open_connections_are_dropped(server):
    t0 = time.perf_counter()
    # half the headers: the connection is closed without an answer
    assert raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                        READ_TIMEOUT + 10) == b""
    assert raw_exchange(server, b"", READ_TIMEOUT + 10) == b""  # nothing at all
    # half the body: 408
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: 100\r\n\r\n{\"messages\": [")
    answer = raw_exchange(server, head, READ_TIMEOUT + 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.perf_counter() - t0 < 3 * READ_TIMEOUT + 5


def test_browser_requests(server):
    chat, body = "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}
    envelope(post(server, chat, raw=json.dumps(body).encode(),
                  headers={"content-type": "text/plain"}), 415, "unsupported_media_type")
    envelope(post(server, chat, body, headers={"origin": "http://evil.example"}), 403,
             "origin_not_allowed")
    envelope(post(server, chat, body, headers={"sec-fetch-site": "cross-site"}), 403,
             "origin_not_allowed")
    envelope(post(server, chat, body, headers={"host": "evil.example"}), 403,
             "host_not_allowed")
    # curl -d sends form-urlencoded; allowed origins get CORS headers
    assert post(server, chat, raw=json.dumps(body).encode(), headers={
        "content-type": "application/x-www-form-urlencoded"}).status_code == 200
    r = post(server, chat, body, headers={"origin": "http://b.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == \
        "http://b.example"
    same = f"http://127.0.0.1:{server.port}"
    assert post(server, chat, body, headers={"origin": same}).status_code == 200


def test_models_show_a_served_name(server, tiny_ckpt):
    text = httpx.get(server.url + "/v1/models").text
    card = json.loads(text)["data"][0]
    assert card["id"] == card["root"] and "/" not in card["id"]
    assert "/tmp" not in text and str(tiny_ckpt("qwen3_5", "noisy", vocab_size=4096,
                                                 trunk_scale=2.0, fc_noise=1.0)) not in text


def test_non_streaming_request_is_cancelled_when_the_client_leaves(server):
    def metric(name, **labels):
        try:
            return server.metric(name, **labels)
        except KeyError:
            return 0.0

    aborted = metric("mlx_mtp:request_failure_total", reason="abort")
    body = {"messages": MSG, "max_tokens": CTX - 100, "temperature": 0}
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        raw = json.dumps(body).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(raw)).encode()
                  + b"\r\n\r\n" + raw)
        deadline = time.time() + 30
        while metric("mlx_mtp:num_requests_running") < 1:  # tokens are flowing
            assert time.time() < deadline
            time.sleep(0.05)
        time.sleep(1.0)
    left = time.time()
    while metric("mlx_mtp:num_requests_running") != 0:
        assert time.time() - left < 3, "the disconnected request kept its slot"
        time.sleep(0.05)
    assert metric("mlx_mtp:request_failure_total", reason="abort") == aborted + 1


# --- API key --------------------------------------------------------------------------------------
def test_api_key(keyed_server):
    srv = keyed_server
    srv.wait()
    try:
        chat, body = "/v1/chat/completions", {"messages": MSG, "max_tokens": 2}
        for auth in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret"):
            assert post(srv, chat, body, headers={"authorization": auth}).status_code == 200
        assert post(srv, chat, body, headers={"x-api-key": "s3cret"}).status_code == 200
        for headers in ({}, {"authorization": "Bearer s3cre"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            r = post(srv, chat, body, headers=headers)
            envelope(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics",
                         headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("flags,message", [
    (["--read-timeout", "0"], "--read-timeout must be > 0"),
    (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1K"),
    (["--max-request-bytes", "lots"], "not a size"),
])
def test_bad_limit_flags_exit_2(flags, message, capsys):
    """In this process (the CLI's exit code as a process: test_cli.py): refused before any
    model loads, in one line."""
    code, err = cli_exit(["serve", "--port", "1", *flags], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert err.strip().count("\n") == 0 or err.startswith("usage:")  # argparse: usage first


def cli_exit(argv, capsys) -> tuple:
    """``mlx-mtp ARGV``'s exit code and stderr, run in this process."""
    from mlx_mtp.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err
