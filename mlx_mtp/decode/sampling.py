"""Sampling and speculative acceptance.

Terminology (as in vLLM's rejection sampler): a verify pass emits
``accepted`` draft tokens, then either one ``recovered`` token (at the first
rejected position) or one ``bonus`` token (when every draft was accepted).
Mean acceptance length counts the bonus/recovered token: ``1 + accepted/drafts``.

Both target ``p`` and draft ``q`` are the *same* transform of their logits:
temperature, then top-k / top-p / min-p masks (``filtered_logprobs``). With
that, accepting a draft ``d ~ q`` with probability ``min(1, p(d)/q(d))`` and
otherwise sampling from ``normalize(max(0, p - q))`` emits tokens distributed
exactly as ``p`` (Leviathan et al. 2023). Greedy is the temperature-0 limit:
accept iff the draft is the target argmax, emit the argmax otherwise.

Randomness is keyed by output position (``noise.py``): every token is drawn by
Gumbel-max, ``argmax(logprobs + g)``, with ``g`` the noise of its position. In
the *coupled* mode (``SamplingParams.coupled``) the draft uses the target's own
noise and a draft is accepted iff it equals the target's Gumbel-max choice: the
output is then token for token the output of plain sampling with the same seed,
at any K, at the price of some acceptance (the coupling is not the optimal one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from .logits import TokenHistory


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    coupled: bool = False  # drafts share the target's per-position noise (see module doc)
    # On the raw logits, before temperature (``logits.py``); exact under MTP.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Tuple[Tuple[int, float], ...]] = None  # a dict is accepted

    def __post_init__(self):
        problems = []
        if isinstance(self.logit_bias, dict):  # frozen and hashable: sorted pairs
            try:
                pairs = tuple(sorted((int(k), v) for k, v in self.logit_bias.items()))
            except (TypeError, ValueError):
                pairs = None
                problems.append("logit_bias keys must be token ids")
            object.__setattr__(self, "logit_bias", pairs or None)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and -2 <= v <= 2):
                problems.append(f"{name} must be a number in [-2, 2] (got {v!r})")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 < r <= 10):
            problems.append(f"repetition_penalty must be in (0, 10], 1 disables it (got {r!r})")
        for tok, v in self.logit_bias or ():
            if tok < 0:
                problems.append(f"logit_bias token ids must be >= 0 (got {tok})")
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100):
                problems.append(f"logit_bias values must be numbers in [-100, 100] "
                                f"(got {v!r} for token {tok})")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k must be an integer >= 0, 0 disables it (got {self.top_k!r})")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p < 1):
            problems.append(f"min_p must be in [0, 1) (got {self.min_p!r})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            problems.append(f"seed must be an integer (got {self.seed!r})")
        if not isinstance(self.coupled, bool):
            problems.append(f"coupled must be true or false (got {self.coupled!r})")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Penalties or a bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities of the distribution actually sampled from (..., V).

    ``logprobs`` are the model's normalised log-probabilities (float32). Order as in
    Hugging Face transformers: temperature, then top-k, top-p and min-p on the
    tempered distribution, then renormalisation. (vLLM applies min-p before top-k
    and top-p; the two agree unless min-p and top-p are both set.) Greedy returns
    ``logprobs`` as they are: every filter keeps the argmax.

    Top-k selects by partition, O(V), and top-p then sorts only the k survivors, so
    with top_k set (Qwen's recommended settings use 20) no row is sorted over the
    whole vocabulary.
    """
    if params.greedy:
        return logprobs
    x = logprobs if params.temperature == 1 else logprobs / params.temperature
    V = x.shape[-1]
    neg_inf = mx.array(-float("inf"), x.dtype)
    top = None  # the top_k largest values, unordered, when top-k filters
    if 0 < params.top_k < V:
        top = mx.partition(x, kth=V - params.top_k, axis=-1)[..., V - params.top_k :]
        x = mx.where(x >= top[..., :1], x, neg_inf)  # ties with the k-th largest stay
    if params.top_p < 1.0:
        x = _top_p(x, params.top_p, x if top is None else top)
    if params.min_p > 0.0:
        cut = x.max(axis=-1, keepdims=True) + math.log(params.min_p)
        x = mx.where(x >= cut, x, neg_inf)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _top_p(x: mx.array, top_p: float, candidates: mx.array) -> mx.array:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``.

    ``candidates`` hold every value that can be kept (all of ``x``, or just the
    top-k survivors), so only they are sorted.
    """
    desc = -mx.sort(-candidates, axis=-1)
    p = mx.exp(desc - mx.logsumexp(x, axis=-1, keepdims=True))
    mass_before = mx.cumsum(p, axis=-1) - p
    # The last member of the prefix whose mass reaches top_p sets the cut.
    cut = mx.where(mass_before < top_p, desc, mx.inf).min(axis=-1, keepdims=True)
    return mx.where(x >= cut, x, mx.array(-float("inf"), x.dtype))


class Sampler:
    """The randomness of one request: a 64-bit seed, and noise keyed by output position.

    Unseeded requests draw their seed from MLX's global generator, so
    ``mx.random.seed`` makes them repeatable as it does in mlx-lm.
    """

    def __init__(self, params: SamplingParams, grammar=None):
        self.params = params
        # A grammar.GrammarState when the output is constrained (structured output).
        self.grammar = grammar
        if params.seed is not None:
            self.seed = params.seed
        elif params.greedy:
            self.seed = 0  # never used
        else:
            hi, lo = mx.random.randint(0, 1 << 31, (2,)).tolist()
            self.seed = (hi << 31) | lo
        # Tokens seen so far, for penalties and bias (None: logits go through as they are).
        self.history = TokenHistory(params) if params.processes_logits else None

    def filter(self, logprobs: mx.array) -> mx.array:
        """This request's filtered distribution (rows sampling alike share one call)."""
        return filtered_logprobs(logprobs, self.params)


def sample(filtered: mx.array, noise: Optional[mx.array] = None) -> mx.array:
    """Gumbel-max: one token per row of ``filtered`` (..., V) -> (...); greedy without noise."""
    return mx.argmax(filtered if noise is None else filtered + noise, axis=-1)


def verify(
    target: mx.array,
    drafts: mx.array,
    draft_logprobs: Optional[mx.array] = None,
    target_noise: Optional[mx.array] = None,
    accept_uniform: Optional[mx.array] = None,
    limit: Optional[mx.array] = None,
    deterministic: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Accept a prefix of the drafts and pick the token that follows it.

    target:         (B, K+1, V) filtered target log-probs at the K+1 verified positions
    drafts:         (B, K) draft tokens
    draft_logprobs: (B, J, V) filtered draft log-probs of the first J <= K positions
                    (None: J = 0); positions from J on are deterministic proposals
    target_noise:   (B, K+1, V) Gumbel noise of the K+1 positions (None: greedy)
    accept_uniform: (B, K) uniforms of the acceptance tests: rejection sampling
                    (None: match verification)
    limit:          (B,) drafts each row asked for (<= K; None: K): a row stops there
                    and takes the target's own token at that position, as a step
                    with fewer drafts would
    deterministic:  (B, K) bool, a draft that is a deterministic proposal (``q`` is 1
                    at it: a context draft) whatever ``draft_logprobs`` holds there
    Returns ``num_accepted`` (B,) and ``next_token`` (B,): the recovered token at
    the first rejected position, or the bonus token when all K were accepted.

    Match verification (greedy, coupled): the target's choice at each position is
    ``argmax(target + noise)``; drafts are accepted while they equal it. Rejection
    sampling: accept ``d ~ q`` with probability ``min(1, p(d)/q(d))``, else draw from
    ``max(0, p - q)``. A deterministic proposal is accepted with probability ``p(d)``
    and a rejection draws from ``p`` without ``d``, renormalised: the same rule with
    ``q`` one-hot, in index form (no (B, K, V) ``q`` is built for it).
    Everything stays on device; the caller reads both in one sync.
    """
    if accept_uniform is None:
        return _match(target, drafts, target_noise, limit)
    n, recovered = _rejection(target, drafts, draft_logprobs, target_noise, accept_uniform,
                              deterministic)
    K = drafts.shape[1]
    if limit is None:
        bonus = sample(target[:, K], target_noise[:, K])  # (B,)
        candidates = mx.concatenate([recovered, bonus[:, None]], axis=1)
    else:
        n = mx.minimum(n, limit)
        choice = sample(target, target_noise)  # (B, K+1): the bonus at every cut
        cut = mx.arange(K + 1)[None] >= limit[:, None]
        candidates = mx.where(cut, choice, mx.concatenate([recovered, choice[:, K:]], axis=1))
    return n, mx.take_along_axis(candidates, n[:, None], axis=1)[:, 0]


def _match(target, drafts, target_noise, limit):
    """Match verification: drafts accepted while they equal the target's own choice."""
    K = drafts.shape[1]
    choice = sample(target, target_noise)  # (B, K+1)
    n = mx.cumprod((drafts == choice[:, :K]).astype(mx.int32), axis=1).sum(axis=1)
    if limit is not None:
        n = mx.minimum(n, limit)
    return n, mx.take_along_axis(choice, n[:, None], axis=1)[:, 0]


def _rejection(target, drafts, draft_logprobs, target_noise, accept_uniform, deterministic):
    """Rejection sampling's accepted counts (B,) and the token recovered at each of the K
    positions (B, K), were it the first rejected one."""
    K = drafts.shape[1]
    J = 0 if draft_logprobs is None else draft_logprobs.shape[1]
    fixed = mx.arange(K)[None] >= J  # (1, K): past the head's positions
    if deterministic is not None:
        fixed = fixed | deterministic
    p = mx.exp(mx.take_along_axis(target[:, :K], drafts[..., None], axis=-1)[..., 0])  # (B, K)
    q = mx.ones_like(p)
    recovered = None
    if J:  # the drafts drawn from q: q(d) and the residual max(0, p - q)
        q_all = mx.exp(draft_logprobs)
        q_head = mx.take_along_axis(q_all, drafts[:, :J, None], axis=-1)[..., 0]
        q = mx.where(fixed, q, mx.concatenate([q_head, q[:, J:]], axis=1))
        p_all = mx.exp(target[:, :J])
        residual = mx.maximum(p_all - q_all, 0.0)
        # p == q leaves no residual mass; rejection then has probability 0, any row will do.
        residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_all)
        recovered = sample(mx.log(residual), target_noise[:, :J])  # (B, J)
    accept = accept_uniform * q < p  # u < p/q without dividing; q > 0 since d was drawn from q
    n = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    if deterministic is not None or J < K:  # p without d: Gumbel-max over the other tokens
        without = mx.put_along_axis(target[:, :K] + target_noise[:, :K], drafts[..., None],
                                    mx.array(-mx.inf, target.dtype), axis=-1)
        from_p = mx.argmax(without, axis=-1)  # (B, K)
        recovered = from_p if recovered is None else mx.where(
            fixed, from_p, mx.concatenate([recovered, from_p[:, J:]], axis=1))
    return n, recovered
