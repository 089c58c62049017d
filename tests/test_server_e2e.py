"""``mlx-mtp serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client."""

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from mlx_mtp.testing.tiny import make_tiny
# ServerProcess stays importable from here for the modules that import it from this one.
from server_process import ServerProcess, free_port  # noqa: F401
from test_anthropic_api import scripted  # noqa: F401 (the app over a scripted engine)

CTX = 1024  # --max-kv-size of the main server: small, so "prompt too long" is cheap


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Context-dependent greedy output (trunk_scale=2) and partial MTP acceptance.
    return make_tiny(tmp_path_factory.mktemp("e2e") / "tiny-noisy", "qwen3_5", "noisy",
                     vocab_size=4096, trunk_scale=2.0, fc_noise=1.0)


@pytest.fixture(scope="module")
def nomtp_server(ckpt, tmp_path_factory):
    """The second server (``--no-mtp``, an API key), started with the first (whose setup
    waits for both): the starts overlap, and it idles until its test."""
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("nomtp"), "--no-mtp", "--api-key",
                        "s3cret", "--served-model-name", "tiny", wait=False)
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def server(ckpt, nomtp_server, tmp_path_factory):
    # --fixed-k: always draft, so every test exercises MTP inside the batch (the adaptive
    # policy may rightly pause drafting for this tiny model; it is tested on its own).
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("srv"), "--max-kv-size", str(CTX),
                        "--fixed-k")
    nomtp_server.wait()  # idle through the timed tests
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model_id(client, ckpt):
    return client.models.list().data[0].id


def chat(client, model, content, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kw)


def stream_chat(client, model, content, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- discovery ---------------------------------------------------------------------------
def test_health_and_models_without_hf_cache(server, client, ckpt):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert len(models) == 1
    m = models[0]
    assert m.id == ckpt.name and m.object == "model"  # a served name, not a local path
    assert str(ckpt) not in httpx.get(server.url + "/v1/models").text
    extra = m.model_extra
    assert extra["mtp"]["enabled"] and extra["mtp"]["num_layers"] == 1
    assert extra["mtp"]["num_draft_tokens"] == 3
    assert extra["max_model_len"] == CTX
    assert client.models.retrieve(m.id).id == m.id
    assert not server.hf_home.exists()  # no Hugging Face cache was touched


# --- chat and completions -------------------------------------------------------------
def test_chat_non_streaming(client, model_id):
    r = chat(client, model_id, "Hello there, how are you?")
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    t = r.model_extra["timings"]
    for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
              "draft_n", "draft_n_accepted"):
        assert k in t
    assert t["predicted_n"] == u.completion_tokens
    mtp = r.model_extra["mtp"]
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
              "accepted_per_pos"):
        assert k in mtp
    assert mtp["num_draft_tokens"] == t["draft_n"]
    assert mtp["num_accepted_tokens"] == t["draft_n_accepted"]


def test_chat_streaming_matches_and_reports_usage(client, model_id):
    full = chat(client, model_id, "Tell me a story", max_tokens=20)
    text, chunks = stream_chat(client, model_id, "Tell me a story", max_tokens=20,
                               stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == \
        full.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran before
    assert "draft_n" in last.model_extra["timings"] and "mtp" in last.model_extra


def test_completions_streaming_and_not(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens > 0
    assert "timings" in r.model_extra and "mtp" in r.model_extra
    chunks = list(client.completions.create(model=model_id, prompt="Once upon a time",
                                            max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # token-id prompts work too
    r2 = client.completions.create(model=model_id, prompt=[100, 200, 300], max_tokens=3,
                                   temperature=0)
    assert r2.usage.prompt_tokens == 3


def test_stop_sequences(client, model_id):
    text = chat(client, model_id, "Count for me", max_tokens=24).choices[0].message.content
    stop = text[6:10]
    assert stop.strip()
    cut = text[: text.find(stop)]
    r = chat(client, model_id, "Count for me", max_tokens=24, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed, chunks = stream_chat(client, model_id, "Count for me", max_tokens=24, stop=stop)
    assert streamed == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    c = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=24,
                                  temperature=0)
    t = c.choices[0].text
    c2 = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=24,
                                   temperature=0, stop=[t[4:7]])
    assert c2.choices[0].text == t[: t.find(t[4:7])] and c2.choices[0].finish_reason == "stop"


def test_max_completion_tokens_and_length(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    if r.usage.completion_tokens == 3:
        assert r.choices[0].finish_reason == "length"


def test_reasoning_and_tool_fields(client, model_id):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    plain = chat(client, model_id, "Weather in Paris?")
    with_tools = chat(client, model_id, "Weather in Paris?", tools=tools,
                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    # the tool list went into the prompt
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    msg = with_tools.choices[0].message
    # thinking enabled: the prompt ends inside <think>, so a random model's whole
    # output is reasoning (it never writes </think>)
    reasoning = msg.model_extra.get("reasoning_content")
    assert isinstance(reasoning, str) and reasoning
    assert msg.content in ("", None)
    assert msg.tool_calls is None  # a random model does not call tools
    assert with_tools.choices[0].finish_reason in ("stop", "length")
    _, chunks = stream_chat(client, model_id, "Weather in Paris?", tools=tools,
                            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                       for c in chunks if c.choices)
    assert streamed.strip() == reasoning
    # multi-turn with a tool call (arguments as a JSON string) and a tool result
    r = client.chat.completions.create(model=model_id, temperature=0, max_tokens=4, tools=tools,
                                       messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert r.usage.prompt_tokens > 0


def test_logprobs(client, model_id):
    r = chat(client, model_id, "Hi", max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert 0 < len(content) <= 5
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.logprob - 1e-4
    c = client.completions.create(model=model_id, prompt="Hi", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) > 0
    assert "".join(lp.tokens) == c.choices[0].text


def test_seeded_sampling_is_reproducible(client, model_id):
    a = chat(client, model_id, "Pick", temperature=1.0, seed=7, max_tokens=12)
    b = chat(client, model_id, "Pick", temperature=1.0, seed=7, max_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_coupled_seeded_output_is_the_same_with_mtp_on_and_off(client, model_id):
    """mtp_coupled: sampled drafts share the target's noise, so a seeded answer does not
    depend on whether (or how much) the request drafts."""
    kw = dict(temperature=0.6, seed=5, max_tokens=24)
    on = chat(client, model_id, "Tell me a story", extra_body={"mtp_coupled": True}, **kw)
    off = chat(client, model_id, "Tell me a story",
               extra_body={"mtp_coupled": True, "num_draft_tokens": 0}, **kw)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.model_extra["mtp"]["num_accepted_tokens"] > 0  # drafts were accepted
    assert off.model_extra["mtp"]["num_drafts"] == 0
    text = client.completions.create(model=model_id, prompt="Once upon", extra_body={
        "mtp_coupled": True, "num_draft_tokens": 1}, **kw).choices[0].text
    assert text == client.completions.create(model=model_id, prompt="Once upon", extra_body={
        "mtp_coupled": True, "num_draft_tokens": 0}, **kw).choices[0].text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_choices_stream_interleaved_by_index(client, model_id, endpoint):
    """n > 1 streamed as OpenAI does: the choices' chunks interleave, each names its choice
    by index; every choice has its own role chunk and finish_reason; with include_usage a
    last chunk without choices carries the usage of all of them. The texts equal the
    non-streamed n > 1 answer with the same seed."""
    kw = dict(model=model_id, temperature=2.0, seed=7, max_tokens=12, n=3)
    if endpoint == "chat":
        create = client.chat.completions.create
        kw["messages"] = [{"role": "user", "content": "Tell me a story"}]
    else:
        create = client.completions.create
        kw["prompt"] = "Once upon a time"
    whole = create(**kw)
    chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
    *body, last = chunks
    assert last.choices == [] and len({c.id for c in chunks}) == 1
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(last.usage, key) == getattr(whole.usage, key), key
    texts, finish, order = {}, {}, []
    for c in body:
        assert len(c.choices) == 1 and c.usage is None
        ch = c.choices[0]
        if endpoint == "chat":
            if ch.index not in texts:  # a choice opens with its role
                assert ch.delta.role == "assistant"
            piece = ch.delta.content or ""
        else:
            piece = ch.text
        assert ch.index not in finish, "a chunk after the choice's finish_reason"
        texts[ch.index] = texts.get(ch.index, "") + piece
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
        order.append(ch.index)
    want = [(c.message.content if endpoint == "chat" else c.text) for c in whole.choices]
    assert [texts[i] for i in range(3)] == want and len(set(want)) > 1
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert order != sorted(order)  # interleaved: the rows decode side by side
    # no include_usage: no usage chunk
    plain = list(create(stream=True, **kw))
    assert all(c.choices and c.usage is None for c in plain)


def test_n_choices_stream_ends_with_the_error_of_a_failing_choice(scripted):
    """One choice failing mid-stream ends the stream with its error event (no [DONE])."""
    from mlx_mtp.server.events import Failed

    scripted.engine.scripts += [("the first choice goes on", "stop"),
                                ("the second breaks", Failed(500, "Out of memory while "
                                                                  "generating"))]
    r = httpx.post(scripted.url + "/v1/chat/completions", timeout=30,
                   headers={"authorization": "Bearer secret-key"},
                   json={"model": "scripted", "messages": MSG, "n": 2, "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "Out of memory" in events[-1]["error"]["message"]
    assert {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}


def test_completion_logprobs_offsets_on_a_real_server(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon", max_tokens=16,
                                  temperature=0, logprobs=1)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for off, tok in zip(lp.text_offset, lp.tokens):
        if "\ufffd" not in tok:  # a token of whole characters is found at its offset
            assert text[off:off + len(tok)] == tok


def test_prefix_cache_multi_turn(client, model_id):
    system = {"role": "system", "content": "You are a terse assistant for the unit tests."}
    turn1 = [system, {"role": "user", "content": "First question about the weather?"}]
    r1 = client.chat.completions.create(model=model_id, messages=turn1, max_tokens=8,
                                        temperature=0)
    p1 = r1.usage.prompt_tokens
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And tomorrow?"}]
    r2 = client.chat.completions.create(model=model_id, messages=turn2, max_tokens=8,
                                        temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # everything up to turn 1's generation header is reused
    assert p1 - 12 <= cached < p1
    assert r2.model_extra["timings"]["cache_n"] == cached
    # another conversation with the same system prompt reuses the system turn
    r3 = client.chat.completions.create(
        model=model_id, max_tokens=4, temperature=0,
        messages=[system, {"role": "user", "content": "Something else entirely"}])
    assert 10 < r3.usage.prompt_tokens_details.cached_tokens < p1 - 12


# --- continuous batching ----------------------------------------------------------------
def test_16_concurrent_streams_equal_alone_and_accept_drafts(server, client, model_id):
    prompts = [f"Request {i}: write about topic number {i * 7 + 3}" for i in range(16)]
    extra = {"cache_prompt": False}  # prefill runs in the batch too, not from the cache
    alone = [chat(client, model_id, p, extra_body=extra).choices[0].message.content
             for p in prompts]
    accepted_before = server.metric("mlx_mtp:spec_decode_num_accepted_tokens_total")
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                 timeout=120)

    async def one(p):
        stream = await aclient.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": p}], max_tokens=16,
            temperature=0, stream=True, extra_body=extra)
        text, first, mtp, finish = "", None, None, None
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                first = first or time.perf_counter()
                text += c.choices[0].delta.content
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
                mtp = c.model_extra["mtp"]
        return text, first, time.perf_counter(), mtp, finish

    async def run_all():
        try:
            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == alone
    assert all(r[4] in ("stop", "length") for r in results)
    # they streamed together: every stream had its first token before half had finished
    # (one at a time, the last would start after 15 had finished). Streams decoding keep
    # half of the machine while later prompts are processed (fair share), so the earliest
    # may finish before the last prompt is done. Events of one engine step reach the client
    # in any order, hence one step's slack (serial decoding would miss by ~8 streams' time).
    finish = sorted(r[2] for r in results)
    assert max(r[1] for r in results) < finish[len(finish) // 2] + 0.05
    assert sum(r[3]["num_accepted_tokens"] for r in results) > 0
    assert server.metric("mlx_mtp:spec_decode_num_accepted_tokens_total") > accepted_before
    assert server.metric("mlx_mtp:spec_decode_num_accepted_tokens_per_pos_total",
                         position="0") > 0
    assert server.metric("mlx_mtp:num_requests_running") == 0


def test_metrics_endpoint(server, model_id):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "num_requests_running",
                 "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"mlx_mtp:{name}{{" in r.text, name
    assert f'model_name="{model_id}"' in r.text
    assert server.metric("mlx_mtp:generation_tokens_total") > 0


# --- errors -----------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("wrong type", "/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, 400, None),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, 404,
     "model_not_found"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "y"}]}, 400,
     None),
    ("prompt longer than context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 3000}]}, 400,
     "context_length_exceeded"),
    ("absurd max_tokens", "/v1/chat/completions", {"messages": MSG, "max_tokens": 10 ** 12},
     400, "context_length_exceeded"),
    ("negative max_tokens", "/v1/chat/completions", {"messages": MSG, "max_tokens": -5}, 400,
     None),
    ("n too large", "/v1/chat/completions", {"messages": MSG, "n": 99}, 400, None),
    ("bad top_p", "/v1/chat/completions", {"messages": MSG, "top_p": 5}, 400, None),
    ("too many top_logprobs", "/v1/chat/completions",
     {"messages": MSG, "logprobs": True, "top_logprobs": 99}, 400, None),
    ("bad tool arguments", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]},
    ]}, 400, None),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, None),
    ("token id = vocab size", "/v1/completions", {"prompt": [1, 4096]}, 400, None),
    ("negative token id", "/v1/completions", {"prompt": [[-1, 5]]}, 400, None),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, None),
    ("completions unknown model", "/v1/completions", {"model": "nope", "prompt": "a"}, 404,
     "model_not_found"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, path, body, status, code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code


def test_openai_client_raises_typed_errors_and_server_still_healthy(server, client, model_id):
    with pytest.raises(openai.NotFoundError):
        chat(client, "no-such-model", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, model_id, "hi", max_tokens=10 ** 9)
    assert "maximum context length" in str(e.value)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert chat(client, model_id, "still there?").usage.completion_tokens > 0


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_frees_the_slot(server, client, model_id, n):
    aborted = server.metric("mlx_mtp:request_failure_total", reason="abort") \
        if "reason=\"abort\"" in httpx.get(server.url + "/metrics").text else 0
    body = {"model": model_id, "messages": MSG, "max_tokens": 900, "temperature": 0,
            "stream": True, "n": n}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines >= 4 + n:
                    break
        assert server.metric("mlx_mtp:num_requests_running") <= n
    deadline = time.time() + 5  # 900 tokens would take far longer than this
    while server.metric("mlx_mtp:num_requests_running") != 0:
        assert time.time() < deadline, "the disconnected stream kept its slot"
        time.sleep(0.05)
    assert server.metric("mlx_mtp:request_failure_total", reason="abort") == aborted + n
    assert chat(client, model_id, "next one").usage.completion_tokens > 0


# --- a second server: --no-mtp, API key, shutdown with a stream in flight -----------------
def test_no_mtp_is_lossless_api_key_and_clean_shutdown(nomtp_server, client, model_id):
    srv = nomtp_server
    srv.wait()
    try:
        plain = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0,
                              timeout=60)
        card = plain.models.list().data[0]
        assert card.id == "tiny" and card.model_extra["mtp"]["enabled"] is False
        # MTP is lossless: greedy output equals plain decoding
        for p in ("Hello there", "Explain MTP", "Write a haiku about caches"):
            a = chat(plain, "tiny", p, max_tokens=24, extra_body={"cache_prompt": False})
            b = chat(client, model_id, p, max_tokens=24, extra_body={"cache_prompt": False})
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.model_extra["mtp"]["num_drafts"] == 0
        with pytest.raises(openai.AuthenticationError):
            chat(openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0),
                 "tiny", "x")
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "num_draft_tokens": 2},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft_tokens"

        # SIGTERM while a stream is running: the stream ends with an error event
        # and the process exits cleanly.
        events = []

        def consume():
            body = {"messages": MSG, "max_tokens": 1000, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"Authorization": "Bearer s3cret"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(line[5:].strip())

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.time() + 20
        while len(events) < 3 and time.time() < deadline:
            time.sleep(0.02)
        t0 = time.time()
        assert srv.stop(signal.SIGTERM) == 0, srv.logs()
        assert time.time() - t0 < 10
        t.join(10)
        assert not t.is_alive()
        last = json.loads(events[-1])
        assert last["error"]["code"] == "shutting_down"
    finally:
        srv.stop(signal.SIGKILL)


def test_chat_prompt_equals_the_generate_prompt(server, client, model_id, ckpt):
    from mlx_mtp.decode.prompt import build_prompt
    from mlx_mtp.models.io.loader import load_tokenizer

    tok = load_tokenizer(ckpt, {})
    for kwargs in ({}, {"enable_thinking": True}):
        r = chat(client, model_id, "Hello there", max_tokens=1,
                 extra_body={"chat_template_kwargs": kwargs} if kwargs else {})
        ids = tok.encode(build_prompt(tok, "Hello there", template_args=kwargs),
                         add_special_tokens=False)
        assert r.usage.prompt_tokens == len(ids)
