"""One text stream for ``generate`` and ``serve``: generated token ids in, text out.

``TextStream`` turns the tokens of each decode step into text that is safe to send:

* **Detokenizing** is incremental and exact: everything a stream sends, joined, equals
  ``tokenizer.decode(ids)`` of the tokens it kept (eos excluded, stop string cut). Nothing
  is trimmed: mlx-lm's streaming detokenizers drop the first leading space of a completion,
  which turns 4-space indentation into 3. For byte-level BPE vocabularies (all Qwen models)
  each token maps to its bytes and an incremental UTF-8 decoder turns them into text; other
  tokenizers re-decode a short window of recent tokens.
* **Hold-back**: bytes of an incomplete UTF-8 character, and the shortest tail that could
  still grow into a stop string, wait for the next step; nothing else waits.
* **Finish reasons**: ``"stop"`` at an eos token or a stop string, ``"length"`` at
  ``max_tokens``. ``num_tokens`` counts the tokens consumed, the eos token and the token
  that completed a stop string included (what ``usage.completion_tokens`` reports).
"""

from __future__ import annotations

import codecs
import functools
from typing import Dict, List, Optional, Sequence, Tuple

# A probe of what byte-level decoding must reproduce: leading spaces, indentation,
# newlines, multi-byte characters.
_PROBE = "  x\n    def f():\n\tr\u00e9sum\u00e9 \u20ac \U0001F600 ok  "


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> Dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable stand-in character Hugging Face
    vocabularies spell it with (read only: shared)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
                 + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            out[b] = chr(256 + n)
            n += 1
    return out


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> Dict[str, int]:
    """Printable stand-in character -> byte."""
    return {c: b for b, c in byte_alphabet().items()}


class TokenBytes:
    """Token id -> the bytes it decodes to, for a byte-level BPE tokenizer (built lazily)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._added = {i: s for s, i in tokenizer.get_added_vocab().items()}
        self._bytes: Dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            b = self._bytes[token] = self._compute(token)
        return b

    def _compute(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode("utf-8")
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        table = _byte_decoder()
        return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in piece)

    def matches_decode(self) -> bool:
        """Whether joining token bytes reproduces ``tokenizer.decode`` (checked on a probe)."""
        tok = self._tokenizer
        ids = list(tok.encode(_PROBE, add_special_tokens=False)) + sorted(self._added)
        joined = b"".join(self(i) for i in ids).decode("utf-8", "replace")
        return joined == tok.decode(ids)


@functools.lru_cache(maxsize=8)
def token_bytes(tokenizer) -> Optional[TokenBytes]:
    """The byte table of ``tokenizer``, or None when it is not byte-level BPE."""
    try:
        table = TokenBytes(tokenizer)
        return table if table.matches_decode() else None
    except (AttributeError, KeyError, TypeError):
        return None


class _ByteDecoder:
    """Token bytes through an incremental UTF-8 decoder (holds incomplete characters)."""

    def __init__(self, table: TokenBytes):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        return self._utf8.decode(self._table(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowDecoder:
    """Any tokenizer: re-decode the tokens since the last complete piece (vLLM's method)."""

    def __init__(self, tokenizer):
        self._decode = tokenizer.decode
        self._tokens: List[int] = []
        self._prefix = 0  # decoding starts here (context for word-initial spaces)
        self._read = 0  # text up to this token has been returned

    def add(self, token: int) -> str:
        self._tokens.append(token)
        window = self._tokens[self._prefix:]
        done = self._decode(self._tokens[self._prefix:self._read])
        text = self._decode(window)
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""  # an incomplete character: wait for the rest
        self._prefix, self._read = self._read, len(self._tokens)
        return text[len(done):]

    def flush(self) -> str:
        done = self._decode(self._tokens[self._prefix:self._read])
        text = self._decode(self._tokens[self._prefix:])
        self._prefix = self._read = len(self._tokens)
        return text[len(done):]


def incremental_decoder(tokenizer):
    table = token_bytes(getattr(tokenizer, "_tokenizer", tokenizer))
    return _ByteDecoder(table) if table is not None else _WindowDecoder(tokenizer)


def partial_match_start(text: str, patterns: Sequence[str], first_chars=None) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of a pattern.

    ``len(text)`` when there is none: everything before the returned index can be sent,
    since no pattern can begin there any more.
    """
    longest = max((len(p) for p in patterns), default=0)
    firsts = first_chars if first_chars is not None else {p[0] for p in patterns if p}
    for i in range(max(0, len(text) - longest + 1), len(text)):
        if text[i] in firsts:
            tail = text[i:]
            if any(len(p) > len(tail) and p.startswith(tail) for p in patterns):
                return i
    return len(text)


class TextStream:
    """Text of one generation, a decode step at a time (see the module docstring)."""

    def __init__(self, tokenizer, *, stop: Sequence[str] = (), max_tokens: Optional[int] = None,
                 eos_token_ids=None):
        self._decoder = incremental_decoder(tokenizer)
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or ()
        self.eos = frozenset(eos_token_ids)
        self.stops = [s for s in stop if s]
        self._stop_firsts = {s[0] for s in self.stops}
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.finish_reason: Optional[str] = None
        self._held = ""  # decoded, not yet sent: could be the start of a stop string

    def add(self, tokens: Sequence[int]) -> Tuple[int, str]:
        """Consume a step's tokens -> (how many were used, text ready to send).

        Tokens after the one that finishes the stream (eos, stop string, ``max_tokens``)
        are not used. Once finished, the text includes everything still held.
        """
        if self.finish_reason is not None:
            return 0, ""
        pieces: List[str] = []
        ends: List[int] = []  # text length after each used token (offsets past _held)
        length = 0
        used = 0
        for tok in tokens:
            used += 1
            self.num_tokens += 1
            if tok in self.eos:
                self.finish_reason = "stop"
            else:
                piece = self._decoder.add(tok)
                pieces.append(piece)
                length += len(piece)
            if self.max_tokens is not None and self.num_tokens >= self.max_tokens \
                    and self.finish_reason is None:
                self.finish_reason = "length"
            ends.append(length)
            if self.finish_reason is not None:
                break
        if self.finish_reason is not None:
            tail = self._decoder.flush()
            pieces.append(tail)
            ends[-1] += len(tail)
        text = self._held + "".join(pieces)
        if self.stops:
            cut = self._find_stop(text, ends)
            if cut is not None:
                text, n_keep = cut
                self.num_tokens -= used - n_keep
                used = n_keep
                self.finish_reason = "stop"
        if self.finish_reason is not None:
            self._held = ""
            return used, text
        keep = partial_match_start(text, self.stops, self._stop_firsts) if self.stops \
            else len(text)
        self._held = text[keep:]
        return used, text[:keep]

    def _find_stop(self, text: str, ends: List[int]) -> Optional[Tuple[str, int]]:
        """The earliest-completed stop string -> (text before it, tokens used through it)."""
        found = [(i, i + len(s)) for s in self.stops for i in (text.find(s),) if i >= 0]
        if not found:
            return None
        first_end = min(end for _, end in found) - len(self._held)
        n_keep = next(k + 1 for k, e in enumerate(ends) if e >= first_end)
        # Every stop string complete by that token counts; the text ends at the earliest.
        limit = ends[n_keep - 1] + len(self._held)
        start = min(i for i, end in found if end <= limit)
        return text[:start], n_keep

    def close(self) -> str:
        """End the stream early (cancelled, failed): the text still held back."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
        text, self._held = self._held + self._decoder.flush(), ""
        return text
