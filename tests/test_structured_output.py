"""Structured output (llguidance grammars) under MTP: greedy identity with mlx-lm's own
generation under the same mask, sampling distributed exactly as the masked target,
batches of constrained and free rows, and the server's ``response_format``."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import llguidance
import llguidance.hf

from mlx_mtp.decode import grammar as G
from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from distribution_check import assert_follows, sample_rows, two_token_joint
from grammar_fixtures import VOCAB, ckpt, grammar, tok  # noqa: F401  (fixtures)

PROMPT = [1, 5, 9, 22, 7, 3, 100, 200, 42, 17, 18]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "size": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "size", "tags"],
    "additionalProperties": False,
}


def check_schema(doc):
    assert set(doc) == {"name", "size", "tags"}, doc
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert isinstance(doc["size"], int) and 0 <= doc["size"] <= 999
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
    assert set(doc["tags"]) <= {"a", "b", "c"}


def mtp_tokens(model, prompt, n, k, sampling, gram):
    dec = MTPDecoder(model, k, sampling, adaptive=False, grammar=gram.start())
    out = []
    for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n):
        out.append(t)
        if t in gram.eos_ids:
            break
    return out, dec


def reference_tokens(path, tok, text, prompt, n):
    """mlx-lm's generation with a mask from an independent matcher (logits processor)."""
    model, _ = mlx_lm_load_model(Path(path))
    lltok = llguidance.hf.from_tokenizer(tok._tokenizer, n_vocab=VOCAB,
                                         eos_token=sorted(tok.eos_token_ids))
    matcher = llguidance.LLMatcher(lltok, text, log_level=0)
    n_prompt = len(prompt)

    def processor(tokens, logits):
        if len(tokens) > n_prompt:
            assert matcher.consume_token(int(tokens[-1])), matcher.get_error()
        mask = np.zeros((VOCAB + 31) // 32, np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    out = []
    for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n,
                                     logits_processors=[processor]):
        out.append(int(t))
        if out[-1] in tok.eos_token_ids:
            break
    return out


def test_greedy_json_schema_equals_mlx_lm_with_the_same_mask(ckpt, tok):
    text = G.json_schema_grammar(SCHEMA)
    ref = reference_tokens(ckpt, tok, text, PROMPT, 60)
    assert ref[-1] in tok.eos_token_ids  # the document ended and the grammar stopped it
    check_schema(json.loads(tok.decode(ref[:-1])))
    model, _ = load_model(Path(ckpt))
    gram = grammar(tok, text)
    for k in (0, 1, 2, 3):
        got, dec = mtp_tokens(model, PROMPT, 60, k, SamplingParams(), gram)
        assert got == ref, f"K={k}"
        if k:
            assert dec.stats.num_accepted_tokens > 0  # drafts under the mask were accepted
    # A draft vocabulary holding none of the document's tokens: under a grammar drafts come
    # from the whole output layer (a subset could hold no allowed token), so still accepted.
    model.set_draft_head(vocab=np.setdiff1d(np.arange(VOCAB), ref))
    got, dec = mtp_tokens(model, PROMPT, 60, 2, SamplingParams(), gram)
    assert got == ref and dec.stats.num_accepted_tokens > 0


def test_seeded_sampling_outputs_validate(ckpt, tok):
    model, _ = load_model(Path(ckpt))
    gram = grammar(tok, G.json_schema_grammar(SCHEMA))
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed)
        got, _ = mtp_tokens(model, PROMPT, 80, 3, params, gram)
        assert got[-1] in tok.eos_token_ids, tok.decode(got)
        check_schema(json.loads(tok.decode(got[:-1])))


def test_sampling_under_a_grammar_is_exact(ckpt, tok):
    """The first two tokens of a K=2 step (the second verified with the first draft
    consumed by the grammar) follow the exact joint distribution of the masked target."""
    text = G.lark_grammar('start: /[a-e][a-e0-3]/')
    gram = grammar(tok, text)
    model, _ = load_model(Path(ckpt))
    ref_model, _ = mlx_lm_load_model(Path(ckpt))
    params = SamplingParams(temperature=30.0)  # the oracle-like head is confident

    def target(prefix):
        state = gram.start()
        state.commit(prefix)
        allowed = np.unpackbits(state.mask().view(np.uint8), bitorder="little")[:VOCAB]
        logits = np.array(ref_model(mx.array(PROMPT + prefix)[None])[0, -1].tolist())
        x = np.where(allowed.astype(bool), logits, -np.inf)
        lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
        return np.exp(np.array(filtered_logprobs(mx.array(lp, mx.float32), params)))

    joint = two_token_joint(target)
    assert len(joint) > 4

    n_samples = 500
    seen, accepted, _ = sample_rows(model, PROMPT, 2, n_samples, sampling=params, grammar=gram)
    assert accepted > n_samples // 10  # the second token often came from a draft
    assert_follows(seen, joint, n_samples)


def test_batch_of_constrained_and_free_rows_equals_solo(ckpt, tok):
    from mlx_mtp.decode.batch import BatchDecoder

    model, _ = load_model(Path(ckpt))
    gram = grammar(tok, G.json_schema_grammar(SCHEMA))
    prompts = [PROMPT, PROMPT[:6], PROMPT[3:]]
    grams = [gram, None, gram]
    bd = BatchDecoder(model, adaptive=False)
    decs = []
    for i, (pr, g) in enumerate(zip(prompts, grams)):
        dec = MTPDecoder(model, 3, SamplingParams(), adaptive=False,
                         grammar=None if g is None else g.start())
        dec.prefill(pr)
        bd.add(i, dec)
        decs.append(dec)
    outs = {i: [] for i in range(3)}
    for _ in range(30):
        for key, out in bd.step().items():
            outs[key].extend(out.tokens)
    for i, (pr, g) in enumerate(zip(prompts, grams)):
        if g is None:
            dec = MTPDecoder(model, 0, SamplingParams(), adaptive=False)
            solo = [t for t, _, _ in generate_step(pr, model, decoder=dec, max_tokens=30)]
            assert outs[i][:30] == solo, i
        else:
            solo, _ = mtp_tokens(model, pr, 30, 0, SamplingParams(), g)
            end = solo.index(solo[-1]) + 1 if solo[-1] in g.eos_ids else len(solo)
            assert outs[i][:end] == solo[:end], i


def test_invalid_schema_is_a_grammar_error(tok):
    with pytest.raises(G.GrammarError):
        grammar(tok, G.json_schema_grammar({"type": "no-such-type"}))
    with pytest.raises(G.GrammarError):
        G.response_format_grammar({"type": "xml"})
    assert G.response_format_grammar({"type": "text"}) is None


def test_thinking_then_answer(tok):
    """After an opened think block: free text up to the first ``</think>``, then JSON."""
    mode = G.thinking_mode(tok, VOCAB, sorted(tok.eos_token_ids))
    assert mode == "special"  # one special token in this tokenizer
    gram = grammar(tok, G.json_schema_grammar(None, after_thinking=mode))
    for text, ok in (('plan {x}</think>\n\n{"a": [1, 2]}', True), ('{"a": 1}', False),
                     ('x</think>not json', False)):
        state = gram.start()
        ids = tok.encode(text, add_special_tokens=False)
        fine = all(state.matcher.consume_token(i) for i in ids) and state.matcher.is_accepting()
        assert fine == ok, text


# --- server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    import signal

    from server_process import ServerProcess

    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("structured"), "--num-draft-tokens", "3",
                        "--fixed-k")
    srv.model = Path(ckpt).name
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.logs()


@pytest.fixture(scope="module")
def gpt(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Describe an item as JSON."}]


def test_server_json_schema_greedy_equals_plain_decoding(server, gpt, ckpt, tok):
    """The API's output parses, validates, and is the greedy masked decode of the prompt."""
    r = gpt.chat.completions.create(model=server.model, messages=ASK, temperature=0, max_tokens=80,
                                    response_format=JSON_SCHEMA_FORMAT, logprobs=True,
                                    top_logprobs=5)
    content = r.choices[0].message.content
    # Log-probabilities are of the masked distribution: impossible tokens are not listed
    for entry in r.choices[0].logprobs.content:
        assert entry.logprob > -9999 and entry.top_logprobs
        assert all(t.logprob > -9999 for t in entry.top_logprobs)
    assert any(len(e.top_logprobs) < 5 for e in r.choices[0].logprobs.content)
    assert r.choices[0].finish_reason == "stop"
    check_schema(json.loads(content))
    ids = tok.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False)
    model, _ = load_model(Path(ckpt))
    want, _ = mtp_tokens(model, ids, 80, 0, SamplingParams(),
                         grammar(tok, G.json_schema_grammar(SCHEMA)))
    assert content == tok.decode(want[:-1])
    assert r.usage.completion_tokens == len(want)
    # MTP drafted and had drafts accepted inside the grammar
    assert r.model_extra["mtp"]["num_accepted_tokens"] > 0, r.model_extra


def test_server_json_object_stream_and_sampling(server, gpt):
    stream = gpt.chat.completions.create(model=server.model, messages=ASK, temperature=0.9, seed=5,
                                         max_tokens=120, stream=True,
                                         response_format={"type": "json_object"})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict), text
    # A grammar holds what a document may be, not when it ends: a bounded schema ends.
    for seed in (1, 2):
        r = httpx_post(server, "/v1/completions", {"prompt": "item =", "max_tokens": 120,
                                                   "temperature": 0.7, "seed": seed,
                                                   "response_format": JSON_SCHEMA_FORMAT})
        assert r["choices"][0]["finish_reason"] == "stop"
        check_schema(json.loads(r["choices"][0]["text"]))


def test_server_responses_text_format(server, gpt):
    r = gpt.responses.create(model=server.model, input="Describe an item as JSON.", temperature=0,
                             max_output_tokens=80,
                             text={"format": {"type": "json_schema", "name": "item",
                                              "schema": SCHEMA, "strict": True}})
    check_schema(json.loads(r.output_text))


def httpx_post(server, path, body, status=200):
    import httpx

    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "xml"},
    "json",
])
def test_server_rejects_a_bad_response_format(server, fmt):
    err = httpx_post(server, "/v1/chat/completions",
                     {"messages": ASK, "response_format": fmt}, status=400)["error"]
    assert err["param"] == "response_format", err
    assert err["type"] == "invalid_request_error"


# --- strict tool calls --------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 16},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "days", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}


def check_weather(args):
    assert set(args) == {"city", "days", "unit"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 16
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 14
    assert args["unit"] in ("celsius", "fahrenheit")


def test_server_strict_named_tool_call(server, gpt):
    """A forced call to a strict tool: arguments follow its schema; MTP on and off agree."""
    calls = []
    for k in (0, 3):
        r = gpt.chat.completions.create(
            model=server.model, temperature=0, max_tokens=80, tools=[WEATHER, TIME],
            messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_body={"num_draft_tokens": k})
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        check_weather(json.loads(call.function.arguments))
        calls.append(call.function.arguments)
    assert calls[0] == calls[1]


def test_server_strict_required_tool_call_and_anthropic(server, gpt):
    r = gpt.chat.completions.create(
        model=server.model, temperature=0.8, seed=3, max_tokens=80, tools=[WEATHER, TIME],
        messages=[{"role": "user", "content": "What now?"}], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        check_weather(args)
    else:
        assert call.function.name == "get_time" and isinstance(args["zone"], str)
    body = httpx_post(server, "/v1/messages", {
        "model": server.model, "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "strict": True,
                   "input_schema": WEATHER["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}})
    (use,) = [b for b in body["content"] if b["type"] == "tool_use"]
    check_weather(use["input"])


def test_hermes_tool_grammar(tok):
    from mlx_mtp.server.structured import opening_json, tool_call_grammar

    assert G.is_special(tok, "</tool_call>", VOCAB, sorted(tok.eos_token_ids))
    text = tool_call_grammar("hermes", [WEATHER, TIME], "required", "</tool_call>")
    gram = grammar(tok, text)
    good = opening_json("get_time") + '{"zone": "UTC"}}\n</tool_call>'
    bad = opening_json("get_weather") + '{"city": "Paris"}}\n</tool_call>'  # days missing
    for doc, ok in ((good, True), (bad, False)):
        state = gram.start()
        ids = tok.encode(doc, add_special_tokens=False)
        assert (all(state.matcher.consume_token(i) for i in ids)
                and state.matcher.is_accepting()) == ok, doc


def test_thinking_spelled_out_and_rollback(tok):
    """``</think>`` in ordinary tokens (tokenizers without it as one token): the think text
    ends at its spelling, and the matcher still rolls back drafts (no ``stop=`` lexemes)."""
    gram = grammar(tok, G.json_schema_grammar(None, after_thinking="text"))
    text = 'a </thi b</think>\n{"k": 2}'
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    state = gram.start()
    mask_before = state.mask()
    for t in ids[:9]:
        state.draft(t)
    state.end_step()  # rolled back: the same mask as before the drafts
    assert np.array_equal(state.mask(), mask_before)
    state.commit(ids)
    assert state.matcher.is_accepting()
