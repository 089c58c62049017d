"""The one text stream (detokenizing, stop strings, hold-back) and its users' output.

Property: what a stream sends, joined, equals ``tokenizer.decode`` of the generated ids
(eos excluded, cut before a stop string), whatever the step sizes.
"""

import random

import pytest

from mlx_mtp.decode.text_stream import TextStream, _WindowDecoder, partial_match_start
from mlx_mtp.models.io.loader import load

TEXTS = [
    "    return x\n",  # 4-space indentation as the first token
    " leading space",
    "  \u00e9t\u00e9 \u20ac\U0001F600 caf\u00e9\n\tdone",  # 2-, 3- and 4-byte characters
    "\n\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load(None)[1]  # the demo model's byte-level BPE tokenizer


def feed(stream, ids, step):
    out = []
    for i in range(0, len(ids), step):
        out.append(stream.add(ids[i:i + step])[1])
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 4])
def test_streamed_text_equals_decode(tokenizer, text, step):
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, max_tokens=len(ids))
    pieces = feed(stream, ids, step)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert stream.finish_reason == "length" and stream.num_tokens == len(ids)


def test_first_leading_space_is_kept_unlike_mlx_lm(tokenizer):
    ids = tokenizer.encode("    pass", add_special_tokens=False)
    stream = TextStream(tokenizer)
    assert "".join(stream.add([t])[1] for t in ids) == "    pass"
    # mlx-lm's streaming detokenizer trims it: the defect this stream replaces.
    detok = tokenizer.detokenizer
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    assert detok.text == "   pass"


def test_incomplete_utf8_is_held_then_sent_whole(tokenizer):
    ids = tokenizer.encode("\U0001F600", add_special_tokens=False)
    assert len(ids) > 1
    stream = TextStream(tokenizer)
    pieces = [stream.add([t])[1] for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "\U0001F600"


def test_random_ids_equal_decode_both_decoders(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(4087) for _ in range(rng.randrange(1, 40))]
        stream = TextStream(tokenizer, eos_token_ids=())
        text = "".join(feed(stream, ids, rng.randrange(1, 5))) + stream.close()
        assert text == tokenizer.decode(ids)
        window = _WindowDecoder(tokenizer)
        assert "".join(window.add(t) for t in ids) + window.flush() == tokenizer.decode(ids)


def test_eos_ends_the_stream_and_is_not_text(tokenizer):
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    eos = next(iter(tokenizer.eos_token_ids))
    stream = TextStream(tokenizer)
    used, text = stream.add(ids + [eos] + ids)
    assert (used, text, stream.finish_reason) == (len(ids) + 1, "ab cd", "stop")
    assert stream.num_tokens == len(ids) + 1
    assert stream.add(ids) == (0, "")


def test_stop_string_across_steps_cuts_text_and_counts_tokens(tokenizer):
    text = "x = 1\ny = 2\nSTOP here\nz = 3"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for step in (1, 3, len(ids)):
        stream = TextStream(tokenizer, stop=["STOP"])
        got = "".join(feed(stream, ids, step))
        assert got == "x = 1\ny = 2\n" and stream.finish_reason == "stop"
        # Tokens up to the one completing "STOP" count; later ones are not used.
        n = stream.num_tokens
        assert "STOP" in tokenizer.decode(ids[:n]) and "STOP" not in tokenizer.decode(ids[:n - 1])


def test_only_a_possible_stop_prefix_is_held_back(tokenizer):
    stream = TextStream(tokenizer, stop=["</answer>"])
    ids = tokenizer.encode("a < b </ans", add_special_tokens=False)
    _, text = stream.add(ids)
    assert text == "a < b "  # "</ans" could still become the stop string
    _, more = stream.add(tokenizer.encode("wer> tail", add_special_tokens=False))
    assert more == "" and stream.finish_reason == "stop"
    stream = TextStream(tokenizer, stop=["</answer>"])
    assert stream.add(tokenizer.encode("a </b>", add_special_tokens=False))[1] == "a </b>"


def test_earliest_completed_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    stream = TextStream(tokenizer, stop=["three", "two"])
    assert stream.add(ids)[1] == "one " and stream.finish_reason == "stop"


def test_partial_match_start():
    assert partial_match_start("abc <", ["<stop>"]) == 4
    assert partial_match_start("abc", ["<stop>"]) == 3
    assert partial_match_start("xx<st", ["<stop>", "st"]) == 2
    assert partial_match_start("", ["a"]) == 0


# --- users of the stream: stream_generate and the engine ------------------------------
@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    # The oracle trunk continues any token t with t+1, t+2, ...: from token 255 on the
    # output starts with whitespace tokens ("  ", "    ", "   ", ...).
    return load(str(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)))


@pytest.mark.parametrize("last,k", [(255, 3), (255, 0), (219, 2)])
def test_stream_generate_text_equals_decode_of_ids(oracle, last, k):
    from mlx_mtp.decode.generation import stream_generate

    model, tok = oracle
    rs = list(stream_generate(model, tok, [10, 11, last], max_tokens=20, num_draft_tokens=k))
    ids = [r.token for r in rs]
    assert ids[:2] == [last + 1, last + 2]
    text = "".join(r.text for r in rs)
    assert text == tok.decode(ids) and text[:1].isspace()
    assert rs[-1].finish_reason == "length" and rs[-1].generation_tokens == 20


def test_stream_generate_stop_strings(oracle):
    from mlx_mtp.decode.generation import stream_generate

    model, tok = oracle
    full = "".join(r.text for r in stream_generate(model, tok, [10, 11, 262], max_tokens=12))
    stop = full[5:8]
    rs = list(stream_generate(model, tok, [10, 11, 262], max_tokens=12, stop=[stop]))
    assert "".join(r.text for r in rs) == full[:full.index(stop)]
    assert rs[-1].finish_reason == "stop"


def test_engine_text_equals_decode_of_ids(oracle):
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.events import Delta, Done, EngineRequest

    model, tok = oracle
    eng = Engine(model, tok, log_interval=0, calibrate=False)
    events = []
    eng.submit(EngineRequest(prompt=[10, 11, 255], max_tokens=16, on_event=events.append))
    for _ in range(200):
        if any(isinstance(e, Done) for e in events):
            break
        eng.step()
    deltas = [e for e in events if isinstance(e, Delta)]
    ids = [t for d in deltas for t in d.token_ids]
    assert len(ids) == 16 and ids[0] == 256
    assert "".join(d.text for d in deltas) == tok.decode(ids)
    assert deltas[0].text == "  "  # the first token's two spaces, none trimmed


def test_partial_match_start_holds_the_longest_possible_stop_prefix():
    assert partial_match_start("hello wor", ["world"]) == 6
    assert partial_match_start("hello", ["world"]) == 5
    assert partial_match_start("abc\n\n", ["\n\n\n", "x"]) == 3


# --- the output parser removes only reasoning and tool-call markup ----------------------
def test_whitespace_only_content_is_content():
    from mlx_mtp.server.parsers import OutputParser, parse_full

    assert parse_full("\n" * 24)["content"] == "\n" * 24
    p = OutputParser()
    pieces = [x for piece in ("  ", "\n", "\t") for x in p.feed(piece)] + p.finish()
    assert "".join(x.text for x in pieces if x.kind == "content") == "  \n\t"


def test_indentation_after_a_think_block_is_kept():
    from mlx_mtp.server.parsers import parse_full

    r = parse_full("plan\n</think>\n\n    return 1\n", start_in_reasoning=True)
    assert r == {"content": "    return 1\n", "reasoning": "plan", "tool_calls": []}


def test_whitespace_around_a_tool_call_is_markup():
    from mlx_mtp.server.parsers import parse_full

    r = parse_full('\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n',
                   parse_tools=True)
    assert r["content"] == "" and len(r["tool_calls"]) == 1


def test_logprob_bytes_join_to_the_text_inside_a_character(oracle):
    import mlx.core as mx

    from mlx_mtp.decode.speculative import StepOutput
    from mlx_mtp.server.output import token_logprobs
    from mlx_mtp.server.responses import chat_logprobs

    model, tok = oracle
    ids = tok.encode("\u00e9\u20ac", add_special_tokens=False)  # 2 + 3 bytes
    assert len(ids) > 2  # some token holds part of a character
    lp = mx.log(mx.softmax(mx.random.normal((len(ids), 4096)), axis=-1))
    items = token_logprobs(tok, StepOutput(ids, lp, 0, 0), ids, 2)
    entries = chat_logprobs(items, top=True)
    assert bytes(b for e in entries for b in e["bytes"]).decode() == "\u00e9\u20ac"
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_generation_tps_is_computed_as_mlx_lm_does(oracle, monkeypatch):
    import itertools
    import types

    from mlx_mtp.decode import generation

    # A clock that advances one second per reading: plain decoding makes one token per
    # step, so mlx-lm's figure (all tokens over the time since the first) is exactly 1.
    ticks = itertools.count()
    monkeypatch.setattr(generation, "time",
                        types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    model, tok = oracle
    rs = list(generation.stream_generate(model, tok, [10, 11, 300], max_tokens=6,
                                         num_draft_tokens=0))
    assert rs[-1].generation_tokens == 6 and rs[-1].generation_tps == 1.0
