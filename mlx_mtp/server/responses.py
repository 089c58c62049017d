"""Engine events -> OpenAI response bodies: whole ``chat.completion`` /
``text_completion`` objects and the chunks of a stream (reasoning and tool calls
split out by the output parser, logprobs, ``usage``/``timings``/``mtp``).
"""

from __future__ import annotations

import codecs
import time
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .events import Delta, Done, TokenLogprob
from .parsers import Piece
from .prompts import PreparedChat, output_parser

if TYPE_CHECKING:
    from .state import ServerState


def _token_bytes(t: TokenLogprob) -> List[int]:
    """The token's bytes: they join to the text even where a token holds part of a
    character (its ``token`` string then shows a replacement character)."""
    return list(t.raw if t.raw is not None else t.token.encode("utf-8", errors="replace"))


def chat_logprobs(items: List[TokenLogprob], top: bool) -> List[dict]:
    out = []
    for t in items:
        e = {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t),
             "top_logprobs": [{"token": x.token, "logprob": x.logprob,
                               "bytes": _token_bytes(x)} for x in t.top] if top else []}
        out.append(e)
    return out


class TextOffsets:
    """Character offsets of tokens into the text their bytes decode to (UTF-8, invalid
    bytes replaced, as the tokenizer decodes). A token that starts inside a multibyte
    character points at that character; one token's ``token`` string is no guide, as it
    shows a replacement character for part of a character."""

    def __init__(self):
        self.chars = 0  # characters decoded so far (a pending partial one not counted)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, raw: bytes) -> int:
        """The offset of the token with bytes ``raw``, the next one in the text."""
        pending = self._decoder.getstate()[0]
        at = self.chars
        if pending and raw and not _continues(pending, raw[:1]):
            at += 1  # the pending partial character ends as one replacement character
        self.chars += len(self._decoder.decode(raw))
        return at


def _continues(pending: bytes, byte: bytes) -> bool:
    """Whether ``byte`` continues the partial character ``pending`` (a valid prefix)."""
    try:
        (pending + byte).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"  # still a valid, longer prefix
    return True


def completion_logprobs(items: List[TokenLogprob], offsets: TextOffsets) -> dict:
    tokens, lps, tops, text_offset = [], [], [], []
    for t in items:
        tokens.append(t.token)
        lps.append(t.logprob)
        tops.append({x.token: x.logprob for x in t.top} if t.top else None)
        text_offset.append(offsets.next(bytes(_token_bytes(t))))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": text_offset}


def end_of_stream(fmt, finish_chunk: dict, done: Done, include_usage: bool) -> List[dict]:
    """The finish chunk, then (only for ``stream_options.include_usage``, as OpenAI does) a
    chunk with no choices and the ``usage``. No other chunk carries ``usage``: clients that
    add up the usage of every chunk (LangChain's ``stream_usage``) count the tokens once.
    ``timings`` and ``mtp`` go on the last chunk, as llama-server puts its ``timings``.
    """
    chunks = [finish_chunk]
    if include_usage:
        chunks.append({"id": fmt.id, "object": fmt.object_chunk, "created": fmt.created,
                       "model": fmt.model, "choices": [], "usage": done.usage})
    chunks[-1].update(timings=done.timings, mtp=done.mtp)
    return chunks


class ChatFormatter:
    object_chunk = "chat.completion.chunk"
    index = 0  # the choice this formatter streams (n > 1: choices.stream_choices sets it)

    def __init__(self, state: ServerState, model: str, prepared: PreparedChat,
                 logprobs: Optional[int]):
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.state = state
        self.logprobs = logprobs
        self.parser = output_parser(state, prepared)
        self.num_calls = 0
        self.lp_items: List[TokenLogprob] = []

    def _chunk(self, delta: dict, finish=None, logprobs=None, **extra) -> dict:
        choice = {"index": self.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}
        out = {"id": self.id, "object": self.object_chunk, "created": self.created,
               "model": self.model, "choices": [choice]}
        out.update(extra)
        return out

    def _reasoning_delta(self, text: str) -> dict:
        f = self.state.reasoning_field
        d = {}
        if f in ("reasoning_content", "both"):
            d["reasoning_content"] = text
        if f in ("reasoning", "both"):
            d["reasoning"] = text
        return d

    def _piece_deltas(self, pieces: List[Piece]) -> List[dict]:
        deltas = []
        for p in pieces:
            if p.kind == "content":
                deltas.append({"content": p.text})
            elif p.kind == "reasoning":
                deltas.append(self._reasoning_delta(p.text))
            else:
                call = dict(p.call, index=self.num_calls)
                self.num_calls += 1
                deltas.append({"tool_calls": [call]})
        return deltas

    # streaming
    def start(self) -> List[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_delta(self, ev: Delta) -> List[dict]:
        deltas = self._piece_deltas(self.parser.feed(ev.text))
        lp = None
        if self.logprobs is not None and ev.logprobs:
            lp = {"content": chat_logprobs(ev.logprobs, self.logprobs > 0), "refusal": None}
        if lp is not None and not deltas:
            deltas = [{}]
        return [self._chunk(d, logprobs=lp if i == 0 else None) for i, d in enumerate(deltas)]

    def finish_reason(self, done: Done) -> str:
        if self.num_calls and done.finish_reason == "stop":
            return "tool_calls"
        return done.finish_reason

    def on_done(self, done: Done, include_usage: bool) -> List[dict]:
        chunks = [self._chunk(d) for d in self._piece_deltas(self.parser.finish())]
        finish = self._chunk({}, finish=self.finish_reason(done))
        return chunks + end_of_stream(self, finish, done, include_usage)

    # whole response
    def response(self, deltas: List[Delta], done: Done) -> dict:
        pieces: List[Piece] = []
        lp_items: List[TokenLogprob] = []
        for ev in deltas:
            pieces += self.parser.feed(ev.text)
            lp_items += ev.logprobs or []
        pieces += self.parser.finish()
        content = "".join(p.text for p in pieces if p.kind == "content")
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning").strip()
        calls = []
        for p in pieces:
            if p.kind == "tool_call":
                calls.append(p.call)
                self.num_calls += 1
        if calls:
            content = content.strip()
        message: Dict[str, Any] = {"role": "assistant",
                                   "content": content if (content or not calls) else None}
        if reasoning:
            message.update(self._reasoning_delta(reasoning))
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if self.logprobs is not None:
            logprobs = {"content": chat_logprobs(lp_items, self.logprobs > 0), "refusal": None}
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                             "finish_reason": self.finish_reason(done)}],
                "usage": done.usage, "timings": done.timings, "mtp": done.mtp}


class CompletionFormatter:
    object_chunk = "text_completion"
    index = 0  # the choice this formatter streams (n > 1: choices.stream_choices sets it)

    def __init__(self, state: ServerState, model: str, logprobs: Optional[int]):
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.offsets = TextOffsets()  # text_offset of the tokens, across the stream

    def _chunk(self, text: str, finish=None, logprobs=None, **extra) -> dict:
        out = {"id": self.id, "object": "text_completion", "created": self.created,
               "model": self.model,
               "choices": [{"index": self.index, "text": text, "logprobs": logprobs,
                            "finish_reason": finish}]}
        out.update(extra)
        return out

    def start(self) -> List[dict]:
        return []

    def on_delta(self, ev: Delta) -> List[dict]:
        lp = None
        if self.logprobs is not None and ev.logprobs:
            lp = completion_logprobs(ev.logprobs, self.offsets)
        if not ev.text and lp is None:
            return []
        return [self._chunk(ev.text, logprobs=lp)]

    def on_done(self, done: Done, include_usage: bool) -> List[dict]:
        return end_of_stream(self, self._chunk("", finish=done.finish_reason), done,
                             include_usage)

    def response(self, deltas: List[Delta], done: Done) -> dict:
        text = "".join(d.text for d in deltas)
        lp = None
        if self.logprobs is not None:
            lp = completion_logprobs([x for d in deltas for x in (d.logprobs or [])],
                                     self.offsets)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp,
                             "finish_reason": done.finish_reason}],
                "usage": done.usage, "timings": done.timings, "mtp": done.mtp}

