"""What the model wrote reaches the client unchanged: returned text equals the decode of the
generated ids (leading spaces, whitespace-only answers), streamed or not; completions'
``text_offset`` counts characters of that text; usage only where the client asks for it."""

import json
import signal

import httpx
import pytest

from mlx_mtp.server.events import Delta, Done, TokenLogprob
from mlx_mtp.server.responses import CompletionFormatter
from server_process import ServerProcess


# --- output fidelity: what the model wrote reaches the client unchanged ----------------------
# The oracle model continues any token t with t+1, t+2, ..., so the generated ids are known.
# A chat template that renders the messages' text alone makes a chat's last prompt token
# the last token of its message.
RAW_TEMPLATE = "{%- for m in messages %}{{ m.content }}{%- endfor %}"


@pytest.fixture(scope="module")
def oracle_server(tiny_ckpt, tmp_path_factory):
    path = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    work = tmp_path_factory.mktemp("oracle")
    (work / "raw.jinja").write_text(RAW_TEMPLATE)
    srv = ServerProcess(path, work, "--chat-template", str(work / "raw.jinja"))
    srv.decode = __import__("tokenizers").Tokenizer.from_file(str(path / "tokenizer.json")).decode
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.logs()


def sse_chunks(url, body) -> list:
    with httpx.stream("POST", url, json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_text_equals_decode_of_generated_ids(oracle_server):
    srv = oracle_server
    # "def f():\n   " ends with token 258 ("   "); then come 8 spaces, "se", 7 spaces...
    body = {"prompt": "def f():\n   ", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    expected = srv.decode(list(range(259, 267)), skip_special_tokens=False)
    assert expected.startswith(" " * 8)
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == expected
    assert "".join(r["choices"][0]["logprobs"]["tokens"]) == expected
    chunks = sse_chunks(srv.url + "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected


def test_chat_text_equals_decode_of_generated_ids(oracle_server):
    srv = oracle_server
    # "re" is token 263; the answer starts with token 264, " t" (a leading space).
    body = {"messages": [{"role": "user", "content": "re"}], "max_tokens": 10,
            "temperature": 0, "logprobs": True}
    expected = srv.decode(list(range(264, 274)), skip_special_tokens=False)
    assert expected.startswith(" t")
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == expected
    token_bytes = b"".join(bytes(t["bytes"]) for t in r["choices"][0]["logprobs"]["content"])
    assert token_bytes.decode() == expected
    chunks = sse_chunks(srv.url + "/v1/chat/completions", body)
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert streamed == expected


def test_whitespace_only_answer_is_kept(oracle_server):
    srv = oracle_server
    # After "\x08" (token 196) come "\t", "\n", "\x0b", "\x0c", "\r": only whitespace.
    body = {"messages": [{"role": "user", "content": "\x08"}], "max_tokens": 5,
            "temperature": 0}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["message"]["content"] == "\t\n\x0b\x0c\r"
    assert r["usage"]["completion_tokens"] == 5
    chunks = sse_chunks(srv.url + "/v1/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == \
        "\t\n\x0b\x0c\r"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "re"}]}),
    ("/v1/completions", {"prompt": "re"}),
])
def test_stream_usage_only_in_a_final_chunk_and_only_when_asked(oracle_server, path, body):
    body = dict(body, max_tokens=6, temperature=0)
    plain = sse_chunks(oracle_server.url + path, body)
    assert not any("usage" in c for c in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    assert plain[-1]["timings"]["predicted_n"] == 6 and "mtp" in plain[-1]
    asked = sse_chunks(oracle_server.url + path,
                       dict(body, stream_options={"include_usage": True}))
    with_usage = [c for c in asked if "usage" in c]
    assert with_usage == [asked[-1]] and asked[-1]["choices"] == []
    assert asked[-1]["usage"]["completion_tokens"] == 6
    assert asked[-2]["choices"][0]["finish_reason"] == "length"


# --- completions logprobs: text_offset in characters of the returned text ----------------
def _offsets_of(pieces, split_at=()):
    """text_offset and text of a completion whose tokens have bytes ``pieces``, whole
    (response) and streamed in deltas split before the token indices ``split_at``."""
    items = [TokenLogprob(i, b.decode("utf-8", "replace"), -1.0, raw=b)
             for i, b in enumerate(pieces)]
    text = b"".join(pieces).decode("utf-8", "replace")
    done = Done("stop", {"prompt_tokens": 1, "completion_tokens": len(items),
                         "total_tokens": 1 + len(items)}, {}, {})
    whole = CompletionFormatter(None, "m", 0).response([Delta(text, [], items)], done)
    fmt, streamed = CompletionFormatter(None, "m", 0), []
    bounds = [0, *split_at, len(items)]
    for a, b in zip(bounds, bounds[1:]):
        for chunk in fmt.on_delta(Delta("", [], items[a:b])):
            streamed += chunk["choices"][0]["logprobs"]["text_offset"]
    assert streamed == whole["choices"][0]["logprobs"]["text_offset"]
    return streamed, text


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "a🙂b🙂", "mixed é 中 🙂 end"])
def test_text_offset_counts_characters_of_the_text(text):
    """Whatever the token boundaries (here every byte its own token, as a byte-level BPE
    may split a rare character), a token's offset is the index of the character its first
    byte belongs to."""
    raw = text.encode()
    char_of_byte = [i for i, c in enumerate(text) for _ in c.encode()]
    for pieces in ([raw[i:i + 1] for i in range(len(raw))],  # every byte
                   [raw[i:i + 2] for i in range(0, len(raw), 2)],  # pairs across characters
                   [c.encode() for c in text]):  # whole characters
        starts = [sum(map(len, pieces[:j])) for j in range(len(pieces))]
        offsets, decoded = _offsets_of(pieces, split_at=(1, len(pieces) // 2))
        assert decoded == text
        assert offsets == [char_of_byte[p] for p in starts]


def test_text_offset_with_invalid_bytes_follows_the_replaced_text():
    # a lead byte cut off by another lead byte becomes one U+FFFD of its own
    offsets, text = _offsets_of([b"\xc3", b"\xc3", b"\xa9", b"\xa9", b"a"], split_at=(2,))
    assert text == "\ufffdé\ufffda" and offsets == [0, 1, 1, 2, 3]
