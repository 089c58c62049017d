"""The engine's output side: what one request's client receives from the decode steps.

The scheduler (``engine.py``) decides what runs; this module only shapes the result for
the routers. ``RowOutput`` turns a request's accepted tokens into text (stop strings,
token limit and eos, by ``TextStream``), logprobs and ``Delta`` events, and its finish into
``Done`` (finish reason, usage, llama-server ``timings``, the ``mtp`` block); ``failure``
turns an exception into the ``Failed`` a client is shown.
"""

from __future__ import annotations

from typing import Collection, List, Optional, Tuple

import mlx.core as mx

from ..decode.grammar import first_line
from ..decode.speculative import SpecStats, StepOutput
from ..decode.text_stream import TextStream, token_bytes
from .events import LOGPROB_FLOOR, Delta, Done, EngineRequest, Failed, TokenLogprob


def token_logprobs(tokenizer, out: StepOutput, tokens: List[int],
                   top: int) -> List[TokenLogprob]:
    """Each of ``tokens``' logprob in the step's distributions, with ``top`` alternatives."""
    if not tokens:
        return []
    lp = out.logprobs[: len(tokens)]
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=1)[:, 0].tolist()
    tops_i = tops_v = None
    if top > 0:
        order = mx.argsort(-lp, axis=-1)[:, :top]
        tops_i = order.tolist()
        tops_v = mx.take_along_axis(lp, order, axis=-1).tolist()
    dec = tokenizer.decode
    raw = token_bytes(getattr(tokenizer, "_tokenizer", tokenizer)) or (lambda t: None)
    result = []
    for j, (t, v) in enumerate(zip(tokens, chosen)):
        # JSON has no -inf: a token the grammar forbids is left out of the top list
        entry = TokenLogprob(t, dec([t]), max(float(v), LOGPROB_FLOOR), raw=raw(t))
        if tops_i is not None:
            entry.top = [TokenLogprob(i, dec([i]), float(x), raw=raw(i))
                         for i, x in zip(tops_i[j], tops_v[j]) if x > LOGPROB_FLOOR]
        result.append(entry)
    return result


def _timings(n_prompt: int, n_generated: int, stats: SpecStats, prompt_s: float,
             gen_s: float) -> dict:
    """llama-server's ``timings`` block (``n_prompt``: the tokens prefill ran)."""
    C = n_generated
    return {
        "prompt_n": n_prompt,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / n_prompt if n_prompt else 0.0,
        "prompt_per_second": n_prompt / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": C,
        "predicted_ms": gen_s * 1e3,
        "predicted_per_token_ms": gen_s * 1e3 / C if C else 0.0,
        "predicted_per_second": C / gen_s if gen_s > 0 else 0.0,
        "draft_n": stats.num_draft_tokens,
        "draft_n_accepted": stats.num_accepted_tokens,
    }


def _usage(n_prompt: int, n_cached: int, n_generated: int, stats: SpecStats) -> dict:
    P, C = n_prompt, n_generated
    return {
        "prompt_tokens": P,
        "completion_tokens": C,
        "total_tokens": P + C,
        "prompt_tokens_details": {"cached_tokens": n_cached},
        # Ours: drafted and accepted tokens by source (the head, the context).
        "draft_tokens_by_source": stats.by_source(),
    }


class RowOutput:
    """One request's output: its text so far, and the events that carry it."""

    def __init__(self, tokenizer, req: EngineRequest, eos: Collection[int], n_cached: int):
        self.tokenizer = tokenizer
        self.eos = eos
        self.top_logprobs = req.logprobs  # None: no logprobs
        self.n_prompt = len(req.prompt)
        self.n_cached = n_cached  # prompt tokens the prefix cache gave
        self.text = TextStream(tokenizer, stop=req.stop, max_tokens=req.max_tokens,
                               eos_token_ids=eos)

    @property
    def finish_reason(self) -> Optional[str]:
        return self.text.finish_reason

    @property
    def num_tokens(self) -> int:
        return self.text.num_tokens

    def add(self, out: StepOutput) -> Tuple[List[int], Optional[Delta]]:
        """The step's tokens the client gets (up to a stop or the limit), and their event
        (None when there are none; token ids come also while text waits for a character)."""
        n_used, text = self.text.add(out.tokens)
        used = out.tokens[:n_used]
        if not used:
            return used, None
        logprobs = None
        if self.top_logprobs is not None:
            text_tokens = [t for t in used if t not in self.eos]
            logprobs = token_logprobs(self.tokenizer, out, text_tokens, self.top_logprobs)
        return used, Delta(text, used, logprobs)

    def done(self, stats: SpecStats, mtp_enabled: bool, prompt_s: float,
             gen_s: float) -> Done:
        """The finished request's last event (``prompt_s``/``gen_s``: prefill and decode time)."""
        C = self.num_tokens
        timings = {"cache_n": self.n_cached,
                   **_timings(self.n_prompt - self.n_cached, C, stats, prompt_s, gen_s)}
        mtp = {"enabled": mtp_enabled, **stats.to_dict()}
        return Done(self.finish_reason, _usage(self.n_prompt, self.n_cached, C, stats),
                    timings, mtp)


def failure(e: Exception) -> Failed:
    """The event a client gets when its request fails with ``e`` (the log has the rest)."""
    reason = first_line(e)
    if isinstance(e, MemoryError) or "out of memory" in reason.lower() \
            or "unable to allocate" in reason.lower():
        return Failed(500, f"Out of memory while generating: {reason}", "out_of_memory")
    return Failed(500, f"Generation failed: {type(e).__name__}: {reason}", "internal_error")
