"""Structured output: a grammar's token masks, exact under speculative decoding.

A constrained row samples, at every output position, from the model's (penalised)
distribution restricted to the tokens its grammar allows after the tokens before that
position. At verify row ``t`` those tokens are the committed ones plus the row's first
``t`` drafts, the same tokens the head saw when it proposed ``d_{t+1}``: ``p`` at verify
row ``t`` and ``q`` at draft position ``t`` get the same mask, so the acceptance rule
(``sampling.verify``) stays lossless and a draft can never leave the grammar (it is
drawn from the masked ``q``). EOS is allowed only where the grammar may end.

The grammar runs on the host (llguidance's matcher, in Rust): the mask at draft
position ``j`` needs ``d_j``, so a step with a constrained row reads each draft as it is
drawn (``k`` extra host syncs; steps without one keep the single sync). Masks travel to
the device packed (one bit per token, as llguidance writes them) and are unpacked there.

Grammars are llguidance grammar strings (``json_schema_grammar`` builds one from a JSON
schema); ``Grammar`` compiles one against a tokenizer, ``GrammarState`` is one row's
matcher.
"""

from __future__ import annotations

import json
import weakref
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A grammar or schema llguidance cannot compile (the request's fault)."""


class GrammarFailure(RuntimeError):
    """A row's matcher failed while decoding; the message is its reason's first line."""


def first_line(reason: object, limit: int = 200) -> str:
    """What a client may see of llguidance's reason: its first line, bounded (the rest is
    parser state, a Rust backtrace or build paths)."""
    lines = str(reason).strip().splitlines()
    line = lines[0].strip() if lines else "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


# Bounds checked before a schema is compiled: compile time grows with its size (a 1.5 MB
# schema takes seconds and can exceed llguidance's symbol table), and a position where more
# than ``llguidance``'s 2,000 alternatives are open fails the matcher mid-output.
MAX_SCHEMA_BYTES = 256 << 10
MAX_SCHEMA_BRANCHES = 1000  # anyOf / oneOf alternatives, summed over the schema
MAX_GRAMMAR_SYMBOLS = 200_000  # llguidance's max_grammar_size (default 500,000)


def _limits():
    """Parser limits: short errors (no parser-state dump) and a bounded grammar size."""
    return _llguidance().LLParserLimits(verbose_errors=False,
                                        max_grammar_size=MAX_GRAMMAR_SYMBOLS)


def check_schema_bounds(schema: dict):
    """Refuse a schema too large, or with too many alternatives, to compile and run safely."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the JSON schema is too large ({size} bytes; at most "
                           f"{MAX_SCHEMA_BYTES})")
    branches, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in ("anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    branches += len(node[key])
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    if branches > MAX_SCHEMA_BRANCHES:
        raise GrammarError(f"the JSON schema has {branches} anyOf/oneOf alternatives "
                           f"(at most {MAX_SCHEMA_BRANCHES})")


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a base dependency: missing only from a partial install
        raise GrammarError("Structured output needs llguidance: pip install 'llguidance>=1.9,<2'") from e
    return llguidance


THINK_END = "</think>"
WHITESPACE = r"(?:\n {0,16}| ?)"  # a space, or a newline and indentation


def json_body(schema: dict) -> str:
    """``schema`` as the JSON after Lark's ``%json``, with the whitespace rule added."""
    if not isinstance(schema, dict):
        raise GrammarError("the JSON schema must be an object")
    check_schema_bounds(schema)
    options = dict(schema.get("x-guidance") or {})
    options.setdefault("whitespace_pattern", WHITESPACE)
    return json.dumps({**schema, "x-guidance": options})


def json_schema_grammar(schema: Optional[dict] = None, *, after_thinking: Optional[str] = None) -> str:
    """The grammar of JSON documents matching ``schema`` (None: any JSON object).

    ``after_thinking``: the output starts inside a think block (the prompt opened it):
    any text up to the first ``</think>``, then whitespace, then the document (as vLLM
    constrains only the answer of a reasoning model). ``"special"`` when ``</think>``
    is one special token of the tokenizer, ``"text"`` when it is spelled in ordinary
    tokens (``thinking_mode`` tells which).
    Whitespace between JSON tokens is bounded (``WHITESPACE``: one space, or a newline and
    indentation), so a small model cannot pad the document with runs of blank lines.
    """
    llg = _llguidance()
    body = json_body({"type": "object"} if schema is None else schema)
    if after_thinking is None:
        lark = f"start: answer\nanswer: %json {body}"
    elif after_thinking == "special":
        lark = f"start: /(?s:.*)/ {THINK_END} /[ \\n]*/ answer\nanswer: %json {body}"
    else:
        lark = (f"start: thinking /[ \\n]*/ answer\n"
                f"thinking[suffix={json.dumps(THINK_END)}]: /(?s:.*)/\n"
                f"answer: %json {body}")
    try:
        return llg.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {first_line(e)}") from e


def check_json_schema(schema: dict):
    """Raise ``GrammarError`` unless llguidance compiles ``schema`` (no tokenizer: cheap).
    For schemas a grammar only partly uses (a Qwen3-Coder call's string parameters are free
    text), so a broken one is refused as it is in ``response_format``."""
    llg = _llguidance()
    text = json_schema_grammar(schema)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, limits=_limits())
    if is_error:
        raise GrammarError(f"invalid JSON schema: {first_line('; '.join(messages))}")


def lark_grammar(lark: str) -> str:
    try:
        return _llguidance().LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid grammar: {first_line(e)}") from e


def _tokenizer_json(tokenizer) -> str:
    """The Hugging Face ``tokenizers`` JSON behind an mlx-lm or transformers tokenizer."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("Structured output needs a fast (tokenizers) tokenizer.")
    return backend.to_str()


def llg_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """llguidance's view of ``tokenizer`` (built once per tokenizer: about a second)."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    try:
        cache: Dict = _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no caching
        cache = {}
    if key not in cache:
        cache[key] = _llguidance().LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size,
                                               eos_token=list(key[1]))
    return cache[key]


def is_special(tokenizer, text: str, vocab_size: int, eos_ids: Sequence[int]) -> bool:
    """Whether ``text`` is one special token to llguidance (then Lark names it ``<text>``;
    a quoted literal would match only its spelling in ordinary tokens)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    llg_tok = llg_tokenizer(tokenizer, vocab_size, eos_ids)
    return len(ids) == 1 and llg_tok.is_special_token(ids[0])


def thinking_mode(tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> str:
    """How ``</think>`` reaches llguidance: ``"special"`` (one special token) or ``"text"``."""
    return "special" if is_special(tokenizer, THINK_END, vocab_size, eos_ids) else "text"


class Grammar:
    """A grammar compiled for one tokenizer and vocabulary; ``start()`` gives a row's state.

    Construction proves the grammar usable before any row depends on it (on the prompt
    worker, in the server): it validates, builds a matcher and computes the first mask,
    so a grammar whose matcher fails at once (a pure ``$ref`` cycle) is a ``GrammarError``
    (the request's 400), never a failure inside a batched step.
    """

    def __init__(self, tokenizer, grammar: str, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.llg_tokenizer = llg_tokenizer(tokenizer, vocab_size, eos_ids)
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        try:
            is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
                grammar, self.llg_tokenizer, limits=_limits())
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"invalid grammar: {first_line(e)}") from e
        if is_error:
            raise GrammarError(f"invalid grammar: {first_line('; '.join(messages))}")
        probe = GrammarState(self)
        try:
            probe.mask()
        except GrammarFailure as e:
            raise GrammarError(f"invalid grammar: {e}") from e
        self._unused: Optional[GrammarState] = probe  # the first row's state

    def start(self) -> "GrammarState":
        state, self._unused = self._unused, None
        return state if state is not None else GrammarState(self)


class GrammarState:
    """One row's matcher: committed tokens, plus this step's drafts until ``end_step``."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self.matcher = llg.LLMatcher(grammar.llg_tokenizer, grammar.grammar, log_level=0,
                                     limits=_limits())
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {first_line(self.matcher.get_error())}")
        self.words = (grammar.vocab_size + 31) // 32
        self._eos_mask = np.zeros(self.words, np.int32)
        for t in grammar.eos_ids:
            if t < grammar.vocab_size:
                self._eos_mask.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))
        self._drafted = 0  # tokens consumed speculatively in the current step
        self.n_committed = 0

    @property
    def done(self) -> bool:
        """The grammar has ended (only EOS can follow)."""
        return self.matcher.is_stopped()

    def mask(self) -> np.ndarray:
        """(W,) int32 bitmask of the tokens allowed next; never empty (EOS at worst)."""
        out = np.zeros(self.words, np.int32)
        if not self.matcher.is_stopped():
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self.matcher.is_error():
            raise GrammarFailure(f"grammar matcher failed: "
                                 f"{first_line(self.matcher.get_error())}")
        if not out.any():
            out[:] = self._eos_mask
        return out

    def draft(self, token: int) -> np.ndarray:
        """Consume a draft tentatively; the mask after it."""
        if not self.matcher.is_stopped():
            self._drafted += self.matcher.try_consume_tokens([int(token)])
        return self.mask()

    def end_step(self):
        """Forget this step's drafts (the committed tokens come through ``commit``)."""
        if self._drafted:
            self.matcher.rollback(self._drafted)
            self._drafted = 0

    def commit(self, tokens: Sequence[int]):
        """Consume the step's emitted tokens (drafts rolled back first)."""
        self.end_step()
        for t in tokens:
            if self.matcher.is_stopped():
                break  # EOS ended the grammar; the caller stops the row there
            if not self.matcher.consume_token(int(t)):
                raise GrammarFailure(f"token {t} left the grammar: "
                                     f"{first_line(self.matcher.get_error())}")
            self.n_committed += 1

    def state(self) -> int:
        """What ``restore`` needs to undo the commits of a failed step."""
        return self.n_committed

    def restore(self, n_committed: int):
        self.end_step()
        if self.n_committed > n_committed:
            self.matcher.rollback(self.n_committed - n_committed)
            self.n_committed = n_committed


def stack_masks(states: List[Optional[GrammarState]], masks: List[Optional[np.ndarray]]):
    """Per-row (W,) masks (None: unconstrained row) -> (B, 1, W) int32 on device."""
    words = next(s.words for s in states if s is not None)
    full = np.full(words, -1, np.int32)
    rows = [full if m is None else m for m in masks]
    return mx.array(np.stack(rows)[:, None])


# What a forbidden token's logit becomes: exp() of it minus any real logit is exactly 0 in
# float32, so it is out of every distribution as -inf would be. (An add and a multiply:
# mx.where against a scalar costs 4-5x more on the CPU at a 248k vocabulary.)
MASKED = 1e30


def apply_masks(logits: mx.array, bitmask: mx.array) -> mx.array:
    """Logits (B, T, V) with tokens outside ``bitmask`` (B, T, W) int32 pushed to -1e30."""
    B, T, V = logits.shape
    bits = (bitmask[..., None] >> mx.arange(32, dtype=mx.int32)) & 1  # (B, T, W, 32)
    allowed = bits.reshape(B, T, -1)[..., :V].astype(mx.float32)
    return logits + (allowed - 1.0) * MASKED


def response_format_grammar(response_format, after_thinking: Optional[str] = None) -> Optional[str]:
    """The grammar an OpenAI-style ``response_format`` asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(None, after_thinking=after_thinking)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):  # as OpenAI: a 400, not unconstrained output
            raise GrammarError("response_format.json_schema (an object with the schema) is "
                               "required when type is json_schema")
        schema = spec.get("schema")
        if isinstance(schema, str):
            schema = json.loads(schema)
        if schema is None:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("json_schema.schema must be a JSON object")
        return json_schema_grammar(schema, after_thinking=after_thinking)
    raise GrammarError(f"unknown response_format type {kind!r} "
                       "(expected text, json_object or json_schema)")
