"""Fast checks of the shipped demo tokenizer (mlx_mtp/assets/tokenizer).

Nothing here retrains the 4096-id tokenizer; only ``test_smoke_build`` trains
a tiny 300-id one on five files.
"""

import json
import random
import shutil
import unicodedata

import pytest

from mlx_mtp.train import tokenizer_build as tb

ASSET = tb.ASSET_DIR
VOCAB = 4096
N_BPE = VOCAB - len(tb.ADDED_TOKENS)
IDS = {t: N_BPE + i for i, (t, _) in enumerate(tb.ADDED_TOKENS)}

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "class Foo(Bar):\n\t'''Doc.'''\n\n\n    pass\r\n",
    "héllo wörld, naïve café — “quotes” «guillemets»",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "中文字符，日本語のテキスト、한국어 텍스트",
    "tabs\tand\x00nul\x01ctl\x7f and  many    spaces   ",
    "   leading spaces and trailing newline\n\n",
    "it's they'll I'M WE'RE 12345 3.14159 0xDEADBEEF",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n<tool_call>x</tool_call>",
    "",
    " ",
    "\n",
    "\ufeffBOM and \u200b zero width \U0010ffff last plane",
]


def _random_strings(n=40, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:  # arbitrary code points (no surrogates)
            cps = [rng.randrange(0x110000) for _ in range(rng.randrange(1, 40))]
            out.append("".join(chr(c) for c in cps if not 0xD800 <= c < 0xE000))
        elif kind == 1:  # arbitrary bytes seen as latin-1 text
            out.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))).decode("latin-1"))
        else:  # ASCII incl. control characters
            out.append("".join(chr(rng.randrange(128)) for _ in range(rng.randrange(1, 80))))
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """The asset plus a minimal config.json, like a model directory."""
    d = tmp_path_factory.mktemp("tok") / "model"
    shutil.copytree(ASSET, d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_5"}))
    return d


@pytest.fixture(scope="module")
def raw_tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(ASSET / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_plain():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSET))


@pytest.fixture(scope="module")
def hf_qwen(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.fixture(scope="module")
def mlx_tok(qwen_dir):
    from mlx_lm.tokenizer_utils import load

    return load(qwen_dir)


# --------------------------------------------------------------------------
# The files themselves
# --------------------------------------------------------------------------


def test_asset_files_and_layout():
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        assert (ASSET / name).is_file(), name
    assert (ASSET / "tokenizer.json").stat().st_size < 300_000

    tj = json.loads((ASSET / "tokenizer.json").read_text())
    model = tj["model"]
    assert model["type"] == "BPE" and model["unk_token"] is None
    assert not model["byte_fallback"]
    assert tj["normalizer"] is None
    assert tj["decoder"]["type"] == "ByteLevel"
    pre = tj["pre_tokenizer"]["pretokenizers"]
    assert pre[0]["type"] == "Split" and pre[0]["pattern"]["Regex"] == tb.QWEN3_5_PRETOKENIZE_REGEX
    assert pre[1] == {"type": "ByteLevel", "add_prefix_space": False,
                      "trim_offsets": False, "use_regex": False}
    # BPE ids 0..N_BPE-1 (dense), all 256 byte symbols present.
    assert sorted(model["vocab"].values()) == list(range(N_BPE))
    from tokenizers import pre_tokenizers

    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(model["vocab"])
    # Added tokens right after the BPE vocab, in the documented order.
    added = {a["content"]: a for a in tj["added_tokens"]}
    assert {t: a["id"] for t, a in added.items()} == IDS
    for t, special in tb.ADDED_TOKENS:
        assert added[t]["special"] is special and added[t]["normalized"] is False


def test_tokenizer_config():
    cfg = json.loads((ASSET / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None
    assert cfg["add_bos_token"] is False
    assert cfg["model_max_length"] == 4096
    template = (ASSET / "chat_template.jinja").read_text()
    assert cfg["chat_template"] == template == tb.CHAT_TEMPLATE
    assert {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()} == {
        i: t for t, i in IDS.items()
    }


def test_regex_matches_transformers_qwen3_5():
    from transformers.models.qwen3_5 import tokenization_qwen3_5 as q

    assert tb.QWEN3_5_PRETOKENIZE_REGEX == q.PRETOKENIZE_REGEX


# --------------------------------------------------------------------------
# Loading paths
# --------------------------------------------------------------------------


def _check_hf(tok):
    assert len(tok) == VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == IDS["<|im_end|>"]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == IDS["<|endoftext|>"]
    assert tok.bos_token is None
    assert tok.model_max_length == 4096
    for t, i in IDS.items():
        assert tok.convert_tokens_to_ids(t) == i
        assert tok.encode(t, add_special_tokens=False) == [i]
    # No BOS/EOS added implicitly.
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)
    for s in SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        assert bool(ids) == bool(s)
        assert all(0 <= i < VOCAB for i in ids)
        assert tok.decode(ids) == s
    # The think / tool markers survive skip_special_tokens (parsers need them).
    ids = tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think><tool_call>c</tool_call>"


def test_autotokenizer_plain_dir(hf_plain):
    _check_hf(hf_plain)


def test_autotokenizer_qwen3_5_model_dir(hf_qwen):
    # transformers 5 maps model_type qwen3_5 to Qwen3_5Tokenizer, which rebuilds
    # the BPE from vocab + merges with its own pipeline (NFC + Qwen regex).
    assert type(hf_qwen).__name__ == "Qwen3_5Tokenizer"
    _check_hf(hf_qwen)


def test_mlx_lm_load(mlx_tok, qwen_dir):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    for tok in (mlx_tok, load_tokenizer(qwen_dir)):
        _check_hf(tok._tokenizer)
        assert len(tok) == VOCAB
        assert isinstance(tok.detokenizer, BPEStreamingDetokenizer)
        assert tok.eos_token_ids == {IDS["<|im_end|>"]}
        assert tok.has_thinking
        assert tok.think_start_id == IDS["<think>"] and tok.think_end_id == IDS["</think>"]
        assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
        assert tok.tool_call_start_tokens == (IDS["<tool_call>"],)
        assert tok.tool_call_end_tokens == (IDS["</tool_call>"],)
        assert tok.init_kwargs.get("tool_parser_type") == "qwen3_coder"


def test_same_ids_on_every_loading_path(raw_tok, hf_plain, hf_qwen, mlx_tok):
    """The model is trained on ids from tokenizer.json; serving goes through
    Qwen3_5Tokenizer.  Both must agree (for NFC text)."""
    texts = list(SAMPLES)
    for f in tb.corpus_files("heldout")[:10]:
        texts.append(tb.read_corpus_file(f)[:20000])
    for s in texts:
        s = unicodedata.normalize("NFC", s)
        ref = raw_tok.encode(s, add_special_tokens=False).ids
        assert hf_plain.encode(s, add_special_tokens=False) == ref
        assert hf_qwen.encode(s, add_special_tokens=False) == ref
        assert mlx_tok.encode(s, add_special_tokens=False) == ref


# --------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------


def test_round_trip_arbitrary_text(raw_tok, hf_plain, hf_qwen):
    nfd = "e\u0301 A\u030a \u1100\u1161"  # decomposed (non-NFC) text
    for s in SAMPLES + _random_strings() + [nfd]:
        ids = raw_tok.encode(s, add_special_tokens=False).ids
        assert raw_tok.decode(ids, skip_special_tokens=False) == s
        assert hf_plain.decode(hf_plain.encode(s, add_special_tokens=False)) == s
        # Qwen3_5Tokenizer hard-codes an NFC normalizer: exact for NFC text.
        nfc = unicodedata.normalize("NFC", s)
        assert hf_qwen.decode(hf_qwen.encode(s, add_special_tokens=False)) == nfc


def test_bytes_are_all_reachable(raw_tok):
    # Each single byte (as latin-1 char or as part of UTF-8) encodes without unk.
    for b in range(256):
        s = bytes([b]).decode("latin-1")
        ids = raw_tok.encode(s, add_special_tokens=False).ids
        assert ids and raw_tok.decode(ids) == s


# --------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def test_chat_template_system_user(hf_qwen, hf_plain):
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi!"}]
    expected = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    for tok in (hf_qwen, hf_plain):
        assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == expected
        assert tok.apply_chat_template(
            msgs, add_generation_prompt=True, enable_thinking=False, tokenize=False) == expected
        thinking = tok.apply_chat_template(
            msgs, add_generation_prompt=True, enable_thinking=True, tokenize=False)
        assert thinking.endswith("<|im_start|>assistant\n<think>\n")
        assert not thinking.endswith("</think>\n\n")
        no_prompt = tok.apply_chat_template(msgs, tokenize=False)
        assert no_prompt == expected[: -len("<|im_start|>assistant\n<think>\n\n</think>\n\n")]
        # Content given as OpenAI-style text parts renders the same.
        parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
        assert tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == expected

    ids = hf_qwen.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == IDS["<|im_start|>"]
    assert ids.count(IDS["<|im_end|>"]) == 2
    nn = hf_qwen.encode("\n\n", add_special_tokens=False)
    tail = [IDS["<think>"], *nn, IDS["</think>"], *nn]
    assert ids[-len(tail):] == tail
    assert hf_qwen.decode(ids) == expected


def test_chat_template_no_system():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    # The template also renders with plain sandboxed Jinja (HF adds raise_exception etc.).
    tpl = env.from_string(tb.CHAT_TEMPLATE)
    out = tpl.render(messages=[{"role": "user", "content": "x"}], add_generation_prompt=True)
    assert out == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_tools_and_tool_calls(hf_qwen):
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
    ]
    out = hf_qwen.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert out.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in out
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n" in out
    call = (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
    )
    assert call in out
    responses = (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n22C\n</tool_response><|im_end|>\n"
    )
    assert out.endswith(call + responses + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert out.count("<|im_start|>system") == 1

    # The rendered call is what mlx_lm's qwen3_coder parser understands.
    from mlx_lm.tool_parsers import qwen3_coder

    body = call.split("<tool_call>")[1].split("</tool_call>")[0]
    assert qwen3_coder.parse_tool_call(body, TOOLS) == {
        "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}

    # Tools without a system message still open with a system turn.
    out2 = hf_qwen.apply_chat_template(msgs[1:2], tools=TOOLS, tokenize=False)
    assert out2.startswith("<|im_start|>system\n# Tools\n\n")


def test_chat_template_reasoning_history(hf_qwen):
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "reasoning_content": "new", "content": "a2"},
    ]
    out = hf_qwen.apply_chat_template(msgs, tokenize=False)
    # Reasoning before the last user turn is dropped, after it kept.
    assert "<|im_start|>assistant\na1<|im_end|>\n" in out
    assert out.endswith("<|im_start|>assistant\n<think>\nnew\n</think>\n\na2<|im_end|>\n")


def test_chat_template_errors(hf_qwen):
    with pytest.raises(Exception, match="system message must be the first"):
        hf_qwen.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}], tokenize=False)


def test_mlx_wrapper_chat_template(mlx_tok):
    msgs = [{"role": "user", "content": "Hi"}]
    # Note: mlx_lm's wrapper passes enable_thinking=True unless told otherwise
    # (the vocab has <think>); pass it explicitly to get the demo default.
    out = mlx_tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False,
                                      tokenize=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = mlx_tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    assert mlx_tok.decode(ids) == out


# --------------------------------------------------------------------------
# Streaming detokenizer
# --------------------------------------------------------------------------


def _stream(mlx_tok, ids):
    d = mlx_tok.detokenizer
    seen = []
    for t in ids:
        d.add_token(t)
        seen.append(d.text)
    d.finalize()
    for s in seen:  # the text only ever grows
        assert d.text.startswith(s)
    return d.text


STREAM_SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "héllo wörld — “quotes” naïve",
    "emoji 😀👍🏽 family 👨‍👩‍👧 and 中文字符 한국어",
    "tabs\tand  spaces   end ",
    "if a:\n\tb = 'it''s'\n\n\nclass X: pass",
    "Sure.<|im_end|>",
    "<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
]


def test_streaming_detokenizer(mlx_tok):
    for s in STREAM_SAMPLES:
        ids = mlx_tok.encode(s, add_special_tokens=False)
        assert _stream(mlx_tok, ids) == s
    # A chat-formatted generation, token by token.
    gen = "Here is code:\n```python\nprint('ok')\n```\nDone 👍<|im_end|>"
    assert _stream(mlx_tok, mlx_tok.encode(gen, add_special_tokens=False)) == gen


@pytest.mark.xfail(reason="mlx_lm BPEStreamingDetokenizer: its byte decoder maps the 0x00 symbol to 0, "
                          "which `if res:` treats as missing (emits \"Ā\")", strict=True)
def test_streaming_detokenizer_nul(mlx_tok):
    s = "a\x00b"
    assert _stream(mlx_tok, mlx_tok.encode(s, add_special_tokens=False)) == s


@pytest.mark.xfail(reason="mlx_lm BPEStreamingDetokenizer drops a leading space "
                          "of the first segment (SPM-style trimming)", strict=True)
def test_streaming_detokenizer_leading_space(mlx_tok):
    s = " leading"
    assert _stream(mlx_tok, mlx_tok.encode(s, add_special_tokens=False)) == s


# --------------------------------------------------------------------------
# Corpus + build
# --------------------------------------------------------------------------


def test_corpus_files_split():
    train = tb.corpus_files("train")
    held = tb.corpus_files("heldout")
    assert train == tb.corpus_files("train")  # deterministic
    assert train and held and not set(train) & set(held)
    assert set(train) | set(held) == set(tb.corpus_files("all"))
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.10
    root = tb.stdlib_root()
    rels = [p.relative_to(root).as_posix() for p in train + held]
    assert rels[: len(train)] == sorted(rels[: len(train)])
    for r in rels:
        parts = r.split("/")[:-1]
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), r
        assert r.endswith(".py")
    with pytest.raises(ValueError):
        tb.corpus_files("dev")


def test_smoke_build(tmp_path):
    from transformers import AutoTokenizer

    files = tb.corpus_files("train")[:5]
    tok = tb.build_tokenizer(tmp_path / "t", vocab_size=300, files=files)
    assert tok.get_vocab_size(with_added_tokens=True) == 300
    assert tok.token_to_id("<|endoftext|>") == 300 - len(tb.ADDED_TOKENS)
    assert tok.token_to_id("</tool_response>") == 299
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        assert (tmp_path / "t" / name).is_file()
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    assert len(hf) == 300 and hf.eos_token_id == 293 and hf.pad_token_id == 291
    for s in SAMPLES:
        assert hf.decode(hf.encode(s)) == s
