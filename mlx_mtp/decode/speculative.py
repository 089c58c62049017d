"""The decode loop: MTP drafts, one verify pass, exact rollback.

One speculative step, with ``y`` the last emitted token (not yet in the trunk):

1. draft: chain the MTP head K times. Its first call also writes the MTP KV
   entries still owed for committed positions (pairs ``(h_i, t_{i+1})``); each
   later call feeds the head its own post-norm output and the previous draft.
2. verify: run the trunk once over ``[y, d_1..d_K]``, capturing the recurrent
   state after every position.
3. accept: ``sampling.verify`` -> number accepted ``n`` and the next token
   (recovered or bonus). This is the only host sync of the step.
4. rollback: Gated DeltaNet layers take the captured state after ``n+1``
   tokens, attention KV drops ``K-n`` rows, the MTP cache drops its ``K-1``
   chained (draft-conditioned) entries. The trunk hiddens of the accepted
   positions become the MTP pairs owed for the next draft.

K = 0 is plain decoding through the same loop (and, like mlx-lm, overlaps the
next step with reading the current token). A ``DraftController`` picks K per
step from measured acceptance and step costs, so drafting stops when it does
not pay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..models.cache import cache_state_arrays, rollback
from .policy import AcceptanceEstimate
from .sampling import Sampler, SamplingParams, filtered_logprobs, log_softmax, verify

from . import MAX_DRAFT_TOKENS, check_num_draft_tokens  # noqa: F401
MAX_OWED_WHILE_PAUSED = 4


def trim_owed(hidden: list, tokens: list, keep: int = MAX_OWED_WHILE_PAUSED):
    """While drafting pauses, keep only the newest ``keep`` owed entries (in place).

    The MTP head then sees a shorter history when drafting resumes (it only drafts,
    so output is unaffected), and a probe after a long pause costs one short MTP pass
    instead of one over every token since. Plain steps owe one pair each, so this is
    list trimming, no array work.
    """
    if len(hidden) > 2 * keep:
        del hidden[:-keep], tokens[:-keep]


@dataclass
class SpecStats:
    """Speculative-decoding counters (vLLM's names)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_pos: List[int] = field(default_factory=list)
    accepted_per_pos: List[int] = field(default_factory=list)

    def record(self, k: int, n_accepted: int):
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += n_accepted
        while len(self.drafted_per_pos) < k:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(k):
            self.drafted_per_pos[j] += 1
            self.accepted_per_pos[j] += j < n_accepted

    def merge(self, other: "SpecStats"):
        for j in range(len(other.drafted_per_pos)):
            while len(self.drafted_per_pos) <= j:
                self.drafted_per_pos.append(0)
                self.accepted_per_pos.append(0)
            self.drafted_per_pos[j] += other.drafted_per_pos[j]
            self.accepted_per_pos[j] += other.accepted_per_pos[j]
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_per_pos(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "acceptance_per_pos": self.acceptance_per_pos,
        }


class DraftController:
    """Chooses K per step so that drafting pays, and stops drafting when it does not.

    Works in epochs: K stays fixed for a few steps, the epoch's throughput
    (tokens per second, wall time between host syncs, so every overhead counts)
    updates a moving average for that K, and the next epoch takes the best K.
    A deeper K is explored (a short epoch) when the current depth's last position
    is accepted often; when plain decoding wins, K = 1 is re-probed with short
    epochs at doubling intervals, so an always-wrong head costs a few percent.
    ``timed=False`` (seeded sampling, which must be reproducible) replaces the
    measured throughput by a model: expected tokens / (1 + draft_cost * K).
    """

    def __init__(self, max_k: int, adaptive: bool = True, timed: bool = True,
                 draft_cost: float = 0.35, epoch: int = 8, probe_epoch: int = 2):
        self.max_k = max_k
        self.adaptive = adaptive
        self.timed = timed
        self.draft_cost = draft_cost
        self.epoch, self.probe_epoch = epoch, probe_epoch
        self.acceptance = AcceptanceEstimate(max_k, forget=0.9)
        self.rate: List[Optional[float]] = [None] * (max_k + 1)  # tokens/s per K
        self.decay = 0.5
        self.margin = 1.05
        self.k = 0 if adaptive else max_k
        self.length = epoch
        self._steps = self._tokens = 0
        self._time = 0.0
        self.probe_every = 4  # epochs at K=0 between probes
        self._since_probe = 0
        self._exploit = 0

    def modelled_rate(self, k: int) -> float:
        return self.acceptance.expected_tokens(k) / (1 + self.draft_cost * k)

    def choose(self) -> int:
        if not self.adaptive or self.max_k == 0:
            return self.max_k
        if self._steps < self.length:
            return self.k
        if not self.timed:  # deterministic: the model's rate for every explored K
            self.rate[self.k] = 0.0
            self.rate = [None if r is None else self.modelled_rate(k)
                         for k, r in enumerate(self.rate)]
        elif self._time > 0:
            rate, prev = self._tokens / self._time, self.rate[self.k]
            self.rate[self.k] = rate if prev is None else prev + self.decay * (rate - prev)
        self.k, self.length = self._next_epoch()
        self._steps = self._tokens = 0
        self._time = 0.0
        return self.k

    def _next_epoch(self):
        measured = [k for k in range(self.max_k + 1) if self.rate[k] is not None]
        best = max(measured, key=lambda k: self.rate[k])
        if best and self.rate[0] is not None and self.rate[best] < self.margin * self.rate[0]:
            best = 0  # drafting must win clearly: timing noise should not cost the user
        # Explore an unmeasured depth whose drafts would mostly be accepted, even
        # past a losing K: fixed per-step overheads can make K=1 lose where K=3 wins.
        for k in range(1, self.max_k + 1):
            if self.rate[k] is None and self.acceptance.reach(k) >= 0.5:
                return k, self.probe_epoch
        if best > 0:
            self._since_probe = 0
            self.probe_every = 4
            self._exploit += 1
            if self._exploit % 8 == 0:  # refresh the neighbours' stale estimates
                for k in (best - 1, best + 1):
                    if 0 < k <= self.max_k:
                        self.rate[k] = None
            return best, self.epoch
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            self.probe_every = min(2 * self.probe_every, 256)
            self.rate[1] = None  # re-measure; the head may have started to agree
            return 1, 1  # one step: enough to see whether drafts agree again
        return 0, self.epoch

    def update(self, k: int, n_accepted: int, seconds: Optional[float]):
        self.acceptance.record(k, [n_accepted])
        self.record_time(k, seconds, 1 + n_accepted)

    def record_time(self, k: int, seconds: Optional[float], tokens: int):
        if not self.timed:
            seconds = 1.0 if seconds is None else seconds  # count steps only
        if seconds is not None and k == self.k:  # steps of the current epoch only
            self._steps += 1
            self._tokens += tokens
            self._time += seconds

class _Controllers:
    """Timed controllers of one model, by K (kept on the model object)."""

    def __init__(self):
        self.by_k = {}


def shared_controller(model, max_k: int) -> DraftController:
    """One timed controller per (model, K): step costs belong to the model, so a new
    generation starts from what earlier ones measured instead of exploring again.
    (Seeded runs keep their own deterministic controller.)"""
    reg = getattr(model, "_mtp_controllers", None)
    if reg is None:
        reg = _Controllers()
        model._mtp_controllers = reg  # a plain object: not a module parameter
    if max_k not in reg.by_k:
        reg.by_k[max_k] = DraftController(max_k, adaptive=True, timed=True)
    return reg.by_k[max_k]


@dataclass
class DecoderState:
    """Prompt-processing state after ``n_processed`` tokens (prefix-cache entry)."""

    n_processed: int
    cache: list
    mtp_cache: Optional[list]
    owed_hidden: list
    owed_tokens: list
    last_hidden: Optional[mx.array]

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in self.cache)
        total += sum(c.nbytes for c in self.mtp_cache or [])
        return total + sum(h.nbytes for h in self.owed_hidden)


@dataclass
class StepOutput:
    tokens: List[int]  # accepted drafts then the recovered/bonus token
    logprobs: mx.array  # (len(tokens), V) target log-probs for each emitted token
    num_drafted: int
    num_accepted: int


class MTPDecoder:
    """Speculative decoding state for one sequence.

    Owns the trunk cache, the MTP cache and the MTP pairs still owed to it.
    ``prefill(prompt)`` then ``step()`` repeatedly; each step emits >= 1 token.
    """

    def __init__(
        self,
        model,
        num_draft_tokens: int = 3,
        sampling: SamplingParams = SamplingParams(),
        adaptive: bool = True,
        prefill_step_size: int = 2048,
        cache=None,
    ):
        check_num_draft_tokens(num_draft_tokens)
        if num_draft_tokens > 0 and model.num_mtp_layers == 0:
            raise ValueError(
                "This model was loaded without an MTP head; use num_draft_tokens=0 (--no-mtp)."
            )
        self.model = model
        self.K = num_draft_tokens
        self.sampler = Sampler(sampling)
        self.params = sampling
        self.prefill_step_size = prefill_step_size
        self.cache = cache if cache is not None else model.make_cache()
        self.mtp_cache = model.make_mtp_cache() if self.K > 0 else None
        self.controller = (shared_controller(model, self.K) if adaptive and sampling.seed is None
                           else DraftController(self.K, adaptive, timed=sampling.seed is None))
        self.next_k = 0
        self.stats = SpecStats()
        # MTP pairs (hidden at i, token i+1) committed but not yet in the MTP cache.
        self.owed_hidden: List[mx.array] = []
        self.owed_tokens: List[mx.array] = []
        self.last_hidden: Optional[mx.array] = None  # hidden of the last prompt token run
        self.n_processed = 0  # prompt tokens already in the trunk cache
        self.snapshot_state: Optional[DecoderState] = None
        self.y: Optional[mx.array] = None  # last emitted token, shape (1,)
        self._ahead: Optional[Tuple] = None  # a launched plain step not yet read
        # Called during prefill: False when drafting is paused where the sequence
        # will decode (the server's batch), so the MTP head need not see the prompt.
        self.drafting_hint: Optional[Callable[[], bool]] = None
        self._last_read: Optional[float] = None

    # -- prompt ------------------------------------------------------------
    def prefill(self, prompt: Sequence[int], progress=None, snapshot_at: Optional[int] = None):
        """Run the prompt (all but its last token) through the trunk, in chunks.

        Continues after the ``n_processed`` tokens of a restored prefix state.
        With ``snapshot_at``, keeps ``self.snapshot_state``: the state after that
        many prompt tokens (for a prefix cache).
        """
        if len(prompt) == 0:
            raise ValueError("The prompt is empty: at least one token is required.")
        tokens = mx.array(prompt, mx.uint32)[None]
        n = len(prompt) - 1
        self.snapshot_state = None
        while self.n_processed < n:
            start = self.n_processed
            end = min(start + self.prefill_step_size, n)
            if snapshot_at is not None and start < snapshot_at < end:
                end = snapshot_at
            _, h_mtp = self.model.trunk(tokens[:, start:end], self.cache)
            if self.mtp_cache is not None:
                if self.drafting_hint is None or self.drafting_hint():
                    self._owe_hidden(h_mtp, tokens[:, start:end])
                    self._flush_owed(max_owed=self.prefill_step_size)
                else:
                    # Drafting is paused where this sequence will run: the head skips
                    # this prompt, and leaving the hiddens unread lets the lazy graph
                    # skip the last layer's per-position work, as plain prefill does.
                    self.owed_hidden, self.owed_tokens, self.last_hidden = [], [], None
            mx.eval(cache_state_arrays(self.cache), *self.owed_hidden)
            self.n_processed = end
            if end == snapshot_at:
                self.snapshot_state = self.snapshot()
            if progress is not None:
                progress(end, n)
        if self.n_processed != n:
            raise ValueError("The restored prefix state is longer than the prompt.")
        self.y = tokens[:, -1]
        if self.mtp_cache is not None and self.last_hidden is not None:
            self._owe(self.last_hidden, self.y[:, None])
            self.last_hidden = None
        self._last_read = None
        self.next_k = self.controller.choose() if self.mtp_cache is not None else 0

    def _owe_hidden(self, hidden, tokens):
        """Trunk hiddens for ``tokens`` (B, S): pair each with the token after it."""
        if self.last_hidden is not None:
            self._owe(self.last_hidden, tokens[:, :1])
        if tokens.shape[1] > 1:
            self._owe(hidden[:, :-1], tokens[:, 1:])
        self.last_hidden = hidden[:, -1:]

    def snapshot(self) -> "DecoderState":
        """A copy of the prompt-processing state (between prefill chunks)."""
        return DecoderState(
            n_processed=self.n_processed,
            cache=[c.copy() for c in self.cache],
            mtp_cache=None if self.mtp_cache is None else [c.copy() for c in self.mtp_cache],
            owed_hidden=list(self.owed_hidden),
            owed_tokens=list(self.owed_tokens),
            last_hidden=self.last_hidden,
        )

    def restore(self, state: "DecoderState"):
        """Continue from a snapshot (copied again, so the snapshot stays reusable)."""
        self.n_processed = state.n_processed
        self.cache = [c.copy() for c in state.cache]
        if self.mtp_cache is not None:
            if state.mtp_cache is None:
                raise ValueError("The prefix state has no MTP cache.")
            self.mtp_cache = [c.copy() for c in state.mtp_cache]
            self.owed_hidden = list(state.owed_hidden)
            self.owed_tokens = list(state.owed_tokens)
            self.last_hidden = state.last_hidden

    def _owe(self, hidden, next_tokens):
        self.owed_hidden.append(hidden)
        self.owed_tokens.append(next_tokens)

    def _take_owed(self):
        h = mx.concatenate(self.owed_hidden, axis=1) if len(self.owed_hidden) > 1 else self.owed_hidden[0]
        t = mx.concatenate(self.owed_tokens, axis=1) if len(self.owed_tokens) > 1 else self.owed_tokens[0]
        self.owed_hidden, self.owed_tokens = [], []
        return h, t

    def _flush_owed(self, max_owed: int = 0):
        """Write owed pairs into the MTP cache when more than ``max_owed`` are pending.

        The newest pair stays owed: the next draft starts from its output.
        """
        if sum(h.shape[1] for h in self.owed_hidden) > max(max_owed, 1):
            h, t = self._take_owed()
            self.model.mtp_forward(h[:, :-1], t[:, :-1], self.mtp_cache)
            self._owe(h[:, -1:], t[:, -1:])
            mx.eval([c.state for c in self.mtp_cache])

    # -- decoding ----------------------------------------------------------
    def _launch_plain(self, y):
        h_norm, h_mtp = self.model.trunk(y[:, None], self.cache)
        lp = log_softmax(self.model.logits(h_norm[:, -1]))  # (1, V)
        tok = self.sampler.sample(filtered_logprobs(lp, self.params))
        if self.mtp_cache is not None:
            self._owe(h_mtp, tok[:, None])
            trim_owed(self.owed_hidden, self.owed_tokens)
        mx.async_eval(tok, lp)
        return tok, lp

    def _draft(self, k):
        model, sample = self.model, self.sampler.sample
        h, t = self._take_owed()
        out = model.mtp_forward(h, t, self.mtp_cache)[:, -1:]
        drafts, draft_lps = [], []
        for j in range(k):
            if j:
                out = model.mtp_forward(out, drafts[-1][:, None], self.mtp_cache)
            q = filtered_logprobs(log_softmax(model.logits(out[:, -1])), self.params)
            drafts.append(sample(q))
            draft_lps.append(q)
        drafts = mx.stack(drafts, axis=1)  # (1, k)
        return drafts, (None if self.params.greedy else mx.stack(draft_lps, axis=1))

    def step(self) -> StepOutput:
        if self._ahead is not None:
            tok, lp = self._ahead
            self._ahead = None
            return self._finish_plain(tok, lp)
        k = self.next_k if self.owed_hidden else 0
        if k == 0:
            tok, lp = self._launch_plain(self.y)
            return self._finish_plain(tok, lp)

        drafts, draft_lps = self._draft(k)
        inputs = mx.concatenate([self.y[:, None], drafts], axis=1)  # (1, k+1)
        h_norm, h_mtp = self.model.trunk(inputs, self.cache, capture=True)
        raw = log_softmax(self.model.logits(h_norm))  # (1, k+1, V)
        n_acc, nxt = verify(filtered_logprobs(raw, self.params), drafts, draft_lps, self.sampler)
        values = mx.concatenate([n_acc, nxt, drafts[0]]).tolist()  # the one host sync
        n, nxt_id, draft_ids = values[0], values[1], values[2:]
        seconds = self._tick()

        rollback(self.cache, n_keep=n + 1, n_total=k + 1)
        for c in self.mtp_cache:
            c.trim(k - 1)  # entries conditioned on drafts, not on trunk hiddens
        nxt_arr = mx.array([nxt_id], mx.uint32)
        self._owe(h_mtp[:, : n + 1], mx.concatenate([drafts[:, :n], nxt_arr[:, None]], axis=1))
        self.y = nxt_arr
        self.controller.update(k, n, seconds)
        self.next_k = self.controller.choose()
        self.stats.record(k, n)
        return StepOutput(draft_ids[:n] + [nxt_id], raw[0, : n + 1], k, n)

    def _finish_plain(self, tok, lp):
        self.next_k = self.controller.choose() if self.mtp_cache is not None else 0
        if self.next_k == 0:
            # Overlap: start the next plain step before reading this one's token.
            self._ahead = self._launch_plain(tok)
        token = tok.item()
        seconds = self._tick()
        if seconds is not None:
            self.controller.update(0, 0, seconds)
        self.y = tok
        return StepOutput([token], lp, 0, 0)

    def _tick(self) -> Optional[float]:
        now = time.perf_counter()
        prev, self._last_read = self._last_read, now
        return None if prev is None else now - prev

    def sync_mtp_cache(self):
        """Write every owed pair but the newest into the MTP cache (inspection, tests)."""
        if self.mtp_cache is not None and self.owed_hidden:
            self._flush_owed(0)


def generate_step(
    prompt: Sequence[int],
    model,
    *,
    num_draft_tokens: int = 3,
    sampling: SamplingParams = SamplingParams(),
    max_tokens: int = 256,
    adaptive: bool = True,
    prefill_step_size: int = 2048,
    decoder: Optional[MTPDecoder] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield ``(token, target logprobs (V,), from_draft)`` for up to ``max_tokens`` tokens."""
    dec = decoder or MTPDecoder(
        model, num_draft_tokens, sampling, adaptive=adaptive, prefill_step_size=prefill_step_size
    )
    dec.prefill(prompt)
    emitted = 0
    while emitted < max_tokens:
        out = dec.step()
        for i, tok in enumerate(out.tokens):
            yield tok, out.logprobs[i], i < out.num_accepted
            emitted += 1
            if emitted >= max_tokens:
                return
