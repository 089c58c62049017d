"""Penalties and logit bias, exact under speculative decoding.

A row's logits at an output position depend on the tokens before it. At verify
row ``t`` of a step those are the committed tokens plus the row's first ``t``
drafts; the draft that proposed ``d_{t+1}`` saw exactly the same tokens. Both
the target (verify rows) and the draft (each chained head call) therefore get
the *same* transform of their logits, so ``p`` and ``q`` stay the same function
of their logits and acceptance stays lossless (``sampling.py``).

Per row (``TokenHistory``, kept on the row's ``Sampler``): ``counts`` (V,) of
generated tokens and ``seen`` (V,) of prompt and generated tokens, updated by a
lazy scatter-add when tokens are committed. A step stacks them into (B, V); the
K+1 verify rows get theirs by a cumulative sum over one-hot drafts. Everything
stays on device: no host sync, no loop over tokens.

Semantics as vLLM's (and Hugging Face's for the repetition penalty):
``repetition_penalty`` r scales every token of the prompt or the output so far
(positive logits divided by r, negative multiplied); ``frequency_penalty`` and
``presence_penalty`` subtract ``f * count + p * (count > 0)`` over *output*
tokens only, as OpenAI describes them. ``logit_bias`` is added first (as vLLM and
mlx-lm do). All of it acts on the raw logits, before temperature and the
top-k/top-p/min-p filters. (mlx-lm counts only the last 20 tokens of prompt and
output by default; here the window is the whole sequence.)
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx


class TokenHistory:
    """The tokens one row has seen, as vocabulary-wide counts (built on first use)."""

    def __init__(self, params, prompt: Sequence[int] = ()):
        self.params = params
        self.prompt = list(prompt)
        self.counts: Optional[mx.array] = None  # (V,) float32, generated tokens
        self.seen: Optional[mx.array] = None  # (V,) float32, > 0: in prompt or output
        self.bias: Optional[mx.array] = None  # (V,) float32 when logit_bias is set

    def set_prompt(self, prompt: Sequence[int]):
        self.prompt, self.counts, self.seen = list(prompt), None, None

    def ensure(self, vocab_size: int):
        if self.counts is not None:
            return
        self.counts = mx.zeros((vocab_size,), mx.float32)
        seen = mx.zeros((vocab_size,), mx.float32)
        if self.prompt and self.params.repetition_penalty != 1.0:
            ids = mx.array(self.prompt, mx.uint32)
            seen = seen.at[ids].add(1.0)
        self.seen = mx.minimum(seen, 1.0)
        if self.params.logit_bias:
            ids = [t for t, _ in self.params.logit_bias]
            if max(ids) >= vocab_size:
                raise ValueError(f"logit_bias token id {max(ids)} is outside the "
                                 f"vocabulary (0..{vocab_size - 1})")
            values = mx.array([float(v) for _, v in self.params.logit_bias], mx.float32)
            self.bias = mx.zeros((vocab_size,), mx.float32).at[mx.array(ids)].add(values)

    def commit(self, tokens):
        """Add emitted tokens (list of ids or an mx.array, lazy) to the counts."""
        if self.counts is None:
            return  # nothing built yet: the first use counts from the prompt on
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens, mx.uint32)
        self.counts = self.counts.at[ids.reshape(-1)].add(1.0)
        self.seen = self.seen.at[ids.reshape(-1)].add(1.0)  # only > 0 matters

    def state(self):
        return self.counts, self.seen

    def restore(self, state):
        self.counts, self.seen = state


def one_hot_counts(tokens: mx.array, vocab_size: int) -> mx.array:
    """(B, P) token ids -> (B, P, V) one-hot rows (scatter of ones)."""
    B, P = tokens.shape
    zeros = mx.zeros((B, P, vocab_size), mx.float32)
    ones = mx.ones((B, P, 1), mx.float32)
    return mx.put_along_axis(zeros, tokens.astype(mx.uint32)[..., None], ones, axis=-1)


class LogitsProcessing:
    """One step's stacked per-row state: apply it to (B, T, V) logits."""

    def __init__(self, histories: List[Optional[TokenHistory]], vocab_size: int):
        neutral = mx.zeros((vocab_size,), mx.float32)
        for h in histories:
            if h is not None:
                h.ensure(vocab_size)
        pick = lambda h, attr, d: d if h is None else getattr(h, attr)  # noqa: E731
        self.counts = mx.stack([pick(h, "counts", neutral) for h in histories])  # (B, V)
        self.seen = mx.stack([pick(h, "seen", neutral) for h in histories])
        coef = lambda name, d: mx.array(  # noqa: E731
            [d if h is None else float(getattr(h.params, name)) for h in histories],
            mx.float32)[:, None, None]
        self.rep = coef("repetition_penalty", 1.0)
        self.freq = coef("frequency_penalty", 0.0)
        self.pres = coef("presence_penalty", 0.0)
        self.any_rep = any(h is not None and h.params.repetition_penalty != 1.0
                           for h in histories)
        self.any_count = any(h is not None and (h.params.presence_penalty
                                                or h.params.frequency_penalty)
                             for h in histories)
        self.bias = None
        if any(h is not None and h.bias is not None for h in histories):
            self.bias = mx.stack([h.bias if h is not None and h.bias is not None
                                  else neutral for h in histories])[:, None]  # (B, 1, V)

    def apply(self, logits: mx.array, pending: Optional[mx.array] = None) -> mx.array:
        """Penalised logits (B, T, V). ``pending`` (B, P): this step's drafts so far;
        row ``t`` counts the first ``P - T + 1 + t`` of them on top of the committed
        tokens (verify: T = P + 1; one draft call: T = 1)."""
        x = logits.astype(mx.float32)
        B, T, V = x.shape
        if self.bias is not None:
            x = x + self.bias
        if not (self.any_rep or self.any_count):
            return x
        counts = self.counts[:, None]  # (B, 1, V)
        seen = self.seen[:, None]
        if pending is not None and pending.shape[1] > 0:
            P = pending.shape[1]
            cum = mx.cumsum(one_hot_counts(pending, V), axis=1)  # (B, P, V)
            cum = mx.concatenate([mx.zeros((B, 1, V), mx.float32), cum], axis=1)[:, P + 1 - T:]
            counts = counts + cum
            seen = seen + cum
        if self.any_rep:
            scaled = mx.where(x > 0, x / self.rep, x * self.rep)
            x = mx.where(seen > 0, scaled, x)
        if self.any_count:
            x = x - self.freq * counts - self.pres * (counts > 0)
        return x


def build(rows, vocab_size: int) -> Optional[LogitsProcessing]:
    """The step's processing, or None when no row penalises or biases."""
    histories = [getattr(r.sampler, "history", None) for r in rows]
    if all(h is None for h in histories):
        return None
    return LogitsProcessing(histories, vocab_size)
