"""What a request to the engine is, and the events it sends back.

``EngineRequest`` goes to ``Engine.submit``; its ``on_event`` callback then receives
``Admitted`` once the request joins the batch, ``Delta`` events (new text, token ids,
logprobs) and exactly one ``Done`` or ``Failed`` (a request that fails before it joins
gets no ``Admitted``).
``EngineUnavailable`` is raised by ``submit`` when no request can be taken.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from ..decode.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0  # what the API reports for an impossible token (JSON has no -inf)


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: List["TokenLogprob"] = field(default_factory=list)
    # The token's own bytes (its text can be part of a character): these join to the text.
    raw: Optional[bytes] = None


@dataclass
class Admitted:
    """The request joined the batch: ``cached_tokens`` of its prompt come from the prefix
    cache (the count ``Done.usage`` reports as ``prompt_tokens_details.cached_tokens``)."""

    cached_tokens: int


@dataclass
class Delta:
    text: str
    token_ids: List[int]
    logprobs: Optional[List[TokenLogprob]] = None


@dataclass
class Done:
    finish_reason: str  # "stop" | "length"
    usage: dict
    timings: dict
    mtp: dict


@dataclass
class Failed:
    status: int
    message: str
    code: Optional[str] = None
    retry_after: Optional[int] = None  # seconds, a 429's Retry-After


@dataclass
class EngineRequest:
    prompt: List[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    on_event: Callable[[object], None] = lambda ev: None
    stop: Sequence[str] = ()
    num_draft_tokens: Optional[int] = None  # None: the server's K; 0: no drafts at all
    draft_source: Optional[str] = None  # mtp | lookup | both; None: the server's
    logprobs: Optional[int] = None  # None: off; n >= 0: chosen token plus top n
    cache_prompt: bool = True
    grammar: Optional[object] = None  # decode.grammar.Grammar: structured output
    # Prompt positions worth a prefix-cache snapshot (number of tokens processed).
    boundaries: Sequence[int] = ()
    images: Optional[object] = None  # models.vision.images.ImageBatch of the prompt's images
    # The prompt as the prefix cache keys it (None: ``prompt``; images name their pads).
    cache_tokens: Optional[tuple] = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    @property
    def prefix_key(self) -> Sequence:
        return self.prompt if self.cache_tokens is None else self.cache_tokens

    def encoded_images(self, model):
        """What prefill needs of ``images``: the tower's pass over them (called on the
        engine thread, where MLX runs); None without images."""
        if self.images is None:
            return None
        return model.image_encoder.encode(self.prompt, self.images)[1]


class EngineUnavailable(RuntimeError):
    """The engine takes no new requests: it is stopping, or a rank of a split model is
    gone. ``code`` names which, for the API's error."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def emit(req: EngineRequest, ev):
    """Send ``ev`` to ``req``'s consumer, which may be gone (a closed event loop)."""
    try:
        req.on_event(ev)
    except Exception:
        logging.getLogger("mlx_mtp.server").debug("Dropped an event for %s", req.request_id,
                                                  exc_info=True)
