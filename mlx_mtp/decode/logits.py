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

A step applies these and the grammar masks (``grammar.py``) through one list,
``PositionTransforms``: the same transforms at output position ``j`` whether the
logits come from the head's j-th draft call or from verify row ``j``.

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

from typing import Callable, List, Optional, Sequence, Union

import mlx.core as mx

from .grammar import apply_masks, stack_masks


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


Drafts = Union[mx.array, Sequence[mx.array]]  # (B, P), or P arrays (B,) in position order


class Penalties:
    """Logit bias and penalties over the tokens before each position (built at the first
    logits, when the vocabulary size is known; a no-op when no row asks for them)."""

    def __init__(self, rows, on_row: Callable):
        self.rows, self.on_row = rows, on_row
        self.built, self.processing = False, None

    def __call__(self, logits: mx.array, start: int, drafts: Drafts) -> mx.array:
        if not self.built:
            self.processing, self.built = self._build(logits.shape[-1]), True
        if self.processing is None:
            return logits
        P = start + logits.shape[1] - 1  # the drafts before the last position
        if P == 0:
            return self.processing.apply(logits)
        before = drafts[:, :P] if isinstance(drafts, mx.array) else mx.stack(drafts[:P], axis=1)
        return self.processing.apply(logits, before)

    def _build(self, vocab_size: int) -> Optional[LogitsProcessing]:
        for b, r in enumerate(self.rows):  # each row's state checked alone
            if r.sampler.history is not None:
                self.on_row(b, lambda: r.sampler.history.ensure(vocab_size))
        return build(self.rows, vocab_size)


class GrammarMasks:
    """Each constrained row's mask at every position: the first from the committed
    output, each later one after the draft before it (read as drawn: ``advance``)."""

    def __init__(self, states: list, on_row: Callable):
        self.states, self.on_row = states, on_row
        self.masks = [self._stack(lambda b, g: g.mask())]  # per position: (B, 1, W)

    def _stack(self, fn) -> mx.array:
        """(B, 1, W): ``fn(b, state)`` for each constrained row, checked alone."""
        return stack_masks(self.states, [None if g is None else self.on_row(b, lambda: fn(b, g))
                                         for b, g in enumerate(self.states)])

    def advance(self, draft: mx.array):
        ids = draft.tolist()  # a host read: the next mask depends on this draft
        self.masks.append(self._stack(lambda b, g: g.draft(ids[b])))

    def __call__(self, logits: mx.array, start: int, drafts: Drafts) -> mx.array:
        T = logits.shape[1]
        masks = self.masks[start : start + T]
        if len(masks) < T:  # past the head's drafts only unconstrained rows go on
            free = stack_masks(self.states, [None] * len(self.states))
            masks = masks + [free] * (T - len(masks))
        return apply_masks(logits, masks[0] if T == 1 else mx.concatenate(masks, axis=1))


class PositionTransforms:
    """The one list of transforms a step's logits at output position ``j`` go through,
    draft call ``j`` and verify row ``j`` alike: bias and penalties given the tokens
    before ``j``, then the grammar's mask after them. ``p`` and ``q`` stay the same
    function of their logits, so acceptance stays exact."""

    def __init__(self, rows, grammars: Optional[list], on_row: Callable):
        self.grammar = None if grammars is None else GrammarMasks(grammars, on_row)
        self.transforms = [Penalties(rows, on_row)]
        if self.grammar is not None:
            self.transforms.append(self.grammar)

    @property
    def any_token(self) -> bool:
        """Drafts must be able to reach every token (a grammar's allowed ones may all lie
        outside a draft vocabulary, ``models/draft_head.py``)."""
        return self.grammar is not None

    def __call__(self, logits: mx.array, start: int = 0, drafts: Drafts = ()) -> mx.array:
        """Logits (B, T, V) of positions ``start .. start+T-1``; ``drafts``: the step's
        drafts so far (at least the ``start + T - 1`` before the last position)."""
        for transform in self.transforms:
            logits = transform(logits, start, drafts)
        return logits

    def advance(self, draft: mx.array):
        """The draft (B,) at the next position was drawn (the grammar's next mask)."""
        if self.grammar is not None:
            self.grammar.advance(draft)
