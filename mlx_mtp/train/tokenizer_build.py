"""Build the byte-level BPE tokenizer shipped with the demo model.

No model hub is reachable, so the project trains its own tokenizer offline on
the CPython standard library (the ``.py`` files of the running interpreter's
stdlib, test directories and site-packages excluded), which is also the corpus
the demo model is trained on.

Usage::

    python -m mlx_mtp.train.tokenizer_build OUT_DIR [--vocab-size 4096]

Design notes
------------
* Pre-tokenization is exactly the one ``transformers`` hard-codes for
  ``model_type == "qwen3_5"`` (``Qwen3_5Tokenizer``): a ``Split`` on the
  Qwen3.5 regex followed by ``ByteLevel(add_prefix_space=False,
  use_regex=False)``.  When a model directory with ``config.json``
  ``{"model_type": "qwen3_5"}`` is loaded through ``AutoTokenizer`` (and so
  through ``mlx_lm``), transformers 5 ignores the pipeline in tokenizer.json
  and rebuilds a BPE from its vocab + merges with that fixed pipeline (plus
  an NFC normalizer).  Training with the same splitting makes both loading
  paths produce the same ids (for NFC text).
* No normalizer in tokenizer.json, initial alphabet = all 256 byte symbols and
  no unknown token: any string round-trips exactly through encode/decode.
* Vocabulary layout: ids ``0 .. vocab_size-10`` are BPE tokens (the 256 byte
  symbols first), followed by the nine added tokens of ``ADDED_TOKENS`` in
  that order, so the total is exactly ``vocab_size``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from ..text_corpus import (  # noqa: F401  (re-exported: the corpus API's old home)
    HELDOUT_MODULUS, _split_of, corpus_files, iter_corpus_texts, read_corpus_file, stdlib_root,
)

# The pre-tokenizer regex of transformers' Qwen3_5Tokenizer (identical to the
# one in Qwen3.5's tokenizer.json).  A test checks it against transformers.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (content, special).  Order fixes the ids: they follow the BPE vocab.  As in
# Qwen's checkpoints, the think / tool markers are added tokens that are *not*
# "special", so ``decode(..., skip_special_tokens=True)`` keeps them and the
# reasoning / tool-call parsers still see them.
ADDED_TOKENS = [
    ("<|endoftext|>", True),  # pad
    ("<|im_start|>", True),
    ("<|im_end|>", True),  # eos
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
]
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
DEFAULT_VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"

CHAT_TEMPLATE = r"""{#- ChatML template in the Qwen3.5 style for the mlx_mtp demo model.
    Variables: messages, tools (optional), add_generation_prompt,
    enable_thinking (default false: the prompt ends with an empty think block). -#}
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content is supported, got a part of type ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Unsupported message content') -}}
    {%- endif -%}
{%- endmacro -%}

{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set has_tools = tools is defined and tools is not none and tools | length > 0 %}

{#- System turn: the system prompt first, then the tool descriptions. #}
{%- if messages[0].role == 'system' %}
    {%- set system_prompt = render_content(messages[0].content) | trim %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_prompt = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if system_prompt is not none or has_tools %}
    {{- '<|im_start|>system\n' }}
    {%- if system_prompt %}
        {{- system_prompt }}
    {%- endif %}
    {%- if has_tools %}
        {%- if system_prompt %}
            {{- '\n\n' }}
        {%- endif %}
        {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
        {%- for tool in tools %}
            {{- '\n' ~ (tool | tojson) }}
        {%- endfor %}
        {{- '\n</tools>\n\n' }}
        {{- 'If you choose to call a function ONLY reply in the following format with NO suffix:\n\n' }}
        {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n' }}
        {{- '<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n' }}
        {{- '<IMPORTANT>\nReminder:\n' }}
        {{- '- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n' }}
        {{- '- Required parameters MUST be specified\n' }}
        {{- '- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n' }}
        {{- '- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n' }}
        {{- '</IMPORTANT>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}

{#- Assistant turns after the last user message keep their think block. #}
{%- set ns = namespace(last_user=-1) %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}

{%- for message in loop_messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content | trim %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- if tool_call.arguments is mapping %}
                    {%- for name, value in tool_call.arguments | items %}
                        {{- '<parameter=' + name + '>\n' }}
                        {%- if value is string %}
                            {{- value }}
                        {%- else %}
                            {{- value | tojson }}
                        {%- endif %}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- elif tool_call.arguments is defined and tool_call.arguments %}
                    {{- raise_exception('tool_call arguments must be a mapping; decode JSON argument strings first') }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'system' %}
        {{- raise_exception('The system message must be the first message.') }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}

{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def _pipeline(tok):
    from tokenizers import Regex, decoders, pre_tokenizers, processors

    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    return tok


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    length: Optional[int] = None,
):
    """Train and return a ``tokenizers.Tokenizer`` with ``vocab_size`` ids in
    total (BPE vocab followed by the added tokens)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    n_added = len(ADDED_TOKENS)
    bpe_size = vocab_size - n_added
    if bpe_size < 256:
        raise ValueError(f"vocab_size must be >= {256 + n_added}, got {vocab_size}")
    tok = _pipeline(Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False)))
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    base = tok.get_vocab_size(with_added_tokens=False)
    tok.add_tokens(
        [
            AddedToken(t, special=s, normalized=False, single_word=False, lstrip=False, rstrip=False)
            for t, s in ADDED_TOKENS
        ]
    )
    # add_tokens() ignores the special flag; mark the special ones as such.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, s in ADDED_TOKENS if s]
    )
    for i, (t, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(t) == base + i, (t, tok.token_to_id(t), base + i)
    return tok


def _tokenizer_config(added_ids: dict) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "extra_special_tokens": [t for t, s in ADDED_TOKENS if s and t not in (EOS_TOKEN, PAD_TOKEN)],
        # Needed by loaders that rebuild the BPE from vocab + merges (e.g.
        # transformers' Qwen3_5Tokenizer): tokenizer.json's added_tokens are
        # not read on that path.
        "added_tokens_decoder": {
            str(added_ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for t, s in ADDED_TOKENS
        },
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, out_dir: Union[str, Path]) -> Path:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    chat_template.jinja for ``tok`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compact JSON keeps the asset small (~100 KB for 4096 ids).
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    added_ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}

    def dump(name, obj):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")

    dump("tokenizer_config.json", _tokenizer_config(added_ids))
    dump(
        "special_tokens_map.json",
        {
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [
                t for t, s in ADDED_TOKENS if s and t not in (EOS_TOKEN, PAD_TOKEN)
            ],
        },
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return out_dir


def build_tokenizer(
    out_dir: Union[str, Path],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    files: Optional[Sequence[Union[str, Path]]] = None,
):
    """Train the byte-level BPE on ``files`` (default: ``corpus_files("train")``)
    and write it to ``out_dir``.  Returns the ``tokenizers.Tokenizer``."""
    files = list(files) if files is not None else corpus_files("train")
    if not files:
        raise ValueError("no corpus files")
    tok = train_tokenizer(iter_corpus_texts(files), vocab_size=vocab_size, length=len(files))
    save_tokenizer(tok, out_dir)
    return tok


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mlx_mtp.train.tokenizer_build",
        description="Train the demo byte-level BPE tokenizer on the CPython stdlib.",
    )
    ap.add_argument("out_dir", help="output directory")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                    help="total ids including the added tokens (default %(default)s)")
    args = ap.parse_args(argv)
    files = corpus_files("train")
    t0 = time.perf_counter()
    tok = build_tokenizer(args.out_dir, vocab_size=args.vocab_size, files=files)
    dt = time.perf_counter() - t0
    ids = {t: tok.token_to_id(t) for t, _ in ADDED_TOKENS}
    print(
        f"trained on {len(files)} files from {stdlib_root()} in {dt:.1f}s; "
        f"vocab {tok.get_vocab_size(with_added_tokens=True)} "
        f"(BPE {tok.get_vocab_size(with_added_tokens=False)}); added tokens {ids}; "
        f"wrote {args.out_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
