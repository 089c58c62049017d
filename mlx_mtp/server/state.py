"""What every route needs: the engine, the tokenizer, the server's configuration, and
the worker threads that turn request bodies into prompts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from .engine import Engine
from .protocol import APIError

log = logging.getLogger("mlx_mtp.server")


class PromptWorkers:
    """Request parsing, chat template and tokenization, off the event loop, in two lanes.

    Bodies up to ``small_body_bytes`` go to one lane, larger ones to another, so a short
    chat never waits behind a multi-megabyte prompt being tokenized (the Rust tokenizer
    releases the GIL while it works). Each worker thread uses its own copy of the
    tokenizer: a Hugging Face fast tokenizer used from two threads at once fails with
    "Already borrowed". At most ``max_large_waiting`` large bodies are held at a time.
    """

    def __init__(self, tokenizer, small_body_bytes: int = 64 << 10, max_large_waiting: int = 8):
        self._tokenizer = tokenizer
        self._local = threading.local()
        self.small_body_bytes = small_body_bytes
        self.max_large_waiting = max_large_waiting
        self.large_waiting = 0
        self._small = concurrent.futures.ThreadPoolExecutor(1, "mlx-mtp-prompt")
        self._large = concurrent.futures.ThreadPoolExecutor(1, "mlx-mtp-prompt-large")
        for pool in (self._small, self._large):  # copy the tokenizers now, not on a request
            pool.submit(self._thread_tokenizer)

    def _thread_tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self._tokenizer)
            except Exception as e:  # an exotic tokenizer: share it (the old behaviour)
                log.warning("Could not copy the tokenizer for a worker thread (%s)", e)
                tok = self._tokenizer
            self._local.tokenizer = tok
        return tok

    def _call(self, fn, args):
        return fn(*args, tok=self._thread_tokenizer())

    async def run(self, body_bytes: int, fn, *args):
        """``fn(*args, tok=<this thread's tokenizer>)`` in the lane for a body of
        ``body_bytes`` bytes."""
        loop = asyncio.get_running_loop()
        if body_bytes <= self.small_body_bytes:
            return await loop.run_in_executor(self._small, self._call, fn, args)
        if self.large_waiting >= self.max_large_waiting:
            raise APIError(503, f"Too many large requests ({self.max_large_waiting}) are being "
                           "prepared; try again later.", code="server_overloaded",
                           type="service_unavailable_error")
        self.large_waiting += 1
        try:
            return await loop.run_in_executor(self._large, self._call, fn, args)
        finally:
            self.large_waiting -= 1

    def shutdown(self):
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer) -> int:
    """Most characters of text one token can stand for, with a margin.

    A token string in the vocabulary is at most as long as the text it covers for
    byte-level BPE (one character per byte) and SentencePiece alike; the factor 4 covers
    normalizers that merge characters (NFC composes up to three into one)."""
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:
        return 0  # unknown: no character bound
    return 4 * max(longest, 1)


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Any
    model_name: str
    aliases: set
    context_length: int
    vocab_size: int
    default_max_tokens: int = 512
    sampling_defaults: Dict[str, Any] = field(default_factory=dict)
    template_args: Dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str = "qwen3"
    reasoning_field: str = "reasoning_content"
    tool_call_parser: str = "auto"
    api_key: Optional[str] = None
    protect_metrics: bool = False  # /metrics needs the API key too
    model_path: str = ""  # for logs; the API shows model_name only
    num_mtp_layers: int = 0
    block_drafter: bool = False  # --draft-model named a block drafter (drafters/block)
    num_draft_tokens: int = 0
    adaptive: bool = True
    max_draft_tokens: int = 8
    # Prompts longer than context_length * max_chars_per_token characters cannot fit:
    # refused without tokenizing them (0: no bound).
    max_chars_per_token: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_workers: Optional[PromptWorkers] = None
    images: Optional[Any] = None  # images.ImageInputs when the model takes images

    def __post_init__(self):
        if self.prompt_workers is None:
            self.prompt_workers = PromptWorkers(self.tokenizer)
        self.im_start_id  # now, on this thread: worker threads must not touch self.tokenizer
        if self.grammar_thinking is not None:  # (likewise: builds llguidance's tokenizer)
            self.grammar_call_end

    @functools.cached_property
    def grammar_call_end(self) -> str:
        """``</tool_call>`` in a Lark grammar: bare when one special token, else quoted."""
        from ..decode import grammar

        special = grammar.is_special(self.tokenizer, "</tool_call>", self.vocab_size,
                                     self.eos_ids)
        return "</tool_call>" if special else '"</tool_call>"'

    @functools.cached_property
    def eos_ids(self) -> list:
        return sorted(getattr(self.tokenizer, "eos_token_ids", None) or [])

    @functools.cached_property
    def grammar_thinking(self) -> Optional[str]:
        """How a structured-output grammar meets ``</think>`` (``grammar.thinking_mode``);
        None when llguidance is not installed (structured output is then refused)."""
        from ..decode import grammar

        try:
            return grammar.thinking_mode(self.tokenizer, self.vocab_size, self.eos_ids)
        except grammar.GrammarError:
            return None
        except Exception:  # a tokenizer llguidance cannot read
            log.warning("Structured output is off: llguidance cannot read this tokenizer",
                        exc_info=True)
            return None

    @functools.cached_property
    def im_start_id(self) -> Optional[int]:
        tok = self.tokenizer
        try:
            i = tok.convert_tokens_to_ids("<|im_start|>")
        except Exception:
            return None
        return i if isinstance(i, int) and i != getattr(tok, "unk_token_id", None) else None
