"""One sequence: prompt processing, prefix snapshots, and the single-sequence driver.

``MTPDecoder`` runs a prompt through the trunk (and the MTP head) in chunks, then
decodes it as a batch of one through ``step.DecodeBatch`` (draft -> verify ->
accept -> roll back, one host sync per step). K per step comes from a
``DraftPolicy`` (``policy.py``) owned by the decoder or passed in by whoever
decodes many sequences in turn. Plain steps overlap: the next one is launched
before the current token is read, as mlx-lm does (``overlap``).

The server prefills each request with its own ``MTPDecoder`` and then moves it into
the running batch (``batch.BatchDecoder.add``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, List, Optional, Sequence, Tuple

import mlx.core as mx

from . import check_num_draft_tokens
from ..models.cache import cache_state_arrays
from .policy import DraftPolicy, SeededSchedule, needs_schedule
from .sampling import Sampler, SamplingParams
from .stats import SpecStats
from .step import DecodeBatch, OwedPairs, Row, StepOutput

__all__ = ["MTPDecoder", "DecoderState", "SpecStats", "StepOutput", "generate_step"]


@dataclass
class DecoderState:
    """Prompt-processing state after ``n_processed`` tokens (prefix-cache entry)."""

    n_processed: int
    cache: list
    mtp_cache: Optional[list]
    owed: OwedPairs
    last_hidden: Optional[mx.array]

    @property
    def owed_hidden(self) -> List[mx.array]:
        return self.owed.hidden

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in self.cache)
        total += sum(c.nbytes for c in self.mtp_cache or [])
        return total + sum(h.nbytes for h in self.owed.hidden)


class MTPDecoder:
    """Speculative decoding state for one sequence.

    Owns the trunk cache, the MTP cache and the MTP pairs still owed to it.
    ``prefill(prompt)`` then ``step()`` repeatedly; each step emits >= 1 token.
    ``policy``: a ``DraftPolicy`` to share across decoders of the same model (its
    step costs carry over); by default the decoder makes its own. ``grammar``: a
    ``grammar.GrammarState`` constraining the output (structured output).
    """

    def __init__(
        self,
        model,
        num_draft_tokens: int = 3,
        sampling: SamplingParams = SamplingParams(),
        adaptive: bool = True,
        prefill_step_size: int = 2048,
        cache=None,
        policy: Optional[DraftPolicy] = None,
        overlap: bool = True,
        grammar=None,
        drafter=None,
    ):
        check_num_draft_tokens(num_draft_tokens)
        if num_draft_tokens > 0 and model.num_mtp_layers == 0:
            raise ValueError(
                "This model was loaded without an MTP head; use num_draft_tokens=0 (--no-mtp)."
            )
        self.model = model
        self.K = num_draft_tokens
        self.params = sampling
        self.sampler = Sampler(sampling, grammar)  # grammar: a grammar.GrammarState
        self.adaptive = adaptive
        self.prefill_step_size = prefill_step_size
        self.overlap = overlap
        self._policy = policy
        self.cache = cache if cache is not None else model.make_cache()
        self.mtp_cache = model.make_mtp_cache() if self.K > 0 else None
        schedule = SeededSchedule(self.K, adaptive) if self.K and needs_schedule(sampling) else None
        self.row = Row(key=None, sampler=self.sampler, max_k=self.K, y=None,
                       owed=OwedPairs() if self.K else None, schedule=schedule,
                       drafter=drafter)  # draft_source.RowDrafter: context drafts too
        self.last_hidden: Optional[mx.array] = None  # hidden of the last prompt token run
        self.n_processed = 0  # prompt tokens already in the trunk cache
        self.snapshot_state: Optional[DecoderState] = None
        # Called during prefill: False when drafting is paused where the sequence
        # will decode (the server's batch), so the MTP head need not see the prompt.
        self.drafting_hint: Optional[Callable[[], bool]] = None
        self._core: Optional[DecodeBatch] = None
        self._ahead = None  # a launched plain step not yet read
        self._next_ks: Optional[List[int]] = None  # K chosen while launching ahead
        self._last_read: Optional[float] = None
        self._plain_run: List[float] = []  # times of plain steps read after their successor launched

    @property
    def policy(self) -> DraftPolicy:
        if self._policy is None:
            self._policy = DraftPolicy(self.K, self.adaptive)
        return self._policy

    @property
    def stats(self) -> SpecStats:
        return self.row.stats

    @property
    def y(self) -> Optional[mx.array]:
        return self.row.y

    @property
    def owed(self) -> Optional[OwedPairs]:
        return self.row.owed

    # -- prompt ------------------------------------------------------------
    def prefill(self, prompt: Sequence[int], progress=None, snapshot_at: Optional[int] = None):
        """Run the prompt (all but its last token) through the trunk, in chunks.

        Continues after the ``n_processed`` tokens of a restored prefix state.
        With ``snapshot_at``, keeps ``self.snapshot_state``: the state after that
        many prompt tokens (for a prefix cache).
        """
        if len(prompt) == 0:
            raise ValueError("The prompt is empty: at least one token is required.")
        # An id past the embedding table would be read out of bounds, with no error.
        # Only tokens not yet processed (the engine calls this once per prompt chunk).
        vocab = self.model.text.args.vocab_size
        new = prompt[self.n_processed:]
        bad = [t for t in (min(new), max(new)) if not 0 <= t < vocab] if len(new) else []
        if bad:
            raise ValueError(f"Prompt token id {bad[0]} is outside the vocabulary "
                             f"(0..{vocab - 1}).")
        tokens = mx.array(prompt, mx.uint32)[None]
        if self.row.drafter is not None:
            self.row.drafter.index.sync(prompt)
        n = len(prompt) - 1
        if self.sampler.history is not None:  # the repetition penalty covers the prompt
            self.sampler.history.set_prompt(prompt)
        owed = self.row.owed
        self.snapshot_state = None
        while self.n_processed < n:
            start = self.n_processed
            end = min(start + self.prefill_step_size, n)
            if snapshot_at is not None and start < snapshot_at < end:
                end = snapshot_at
            _, h_mtp = self.model.trunk(tokens[:, start:end], self.cache)
            if owed is not None:
                # A seeded schedule's drafts must not depend on the batch: it always
                # runs the head over its prompt.
                if self.row.schedule is not None or self.drafting_hint is None \
                        or self.drafting_hint():
                    self._owe_prompt(h_mtp, tokens[:, start:end])
                    # The head's pass over the prompt is prompt work: done here, the
                    # first draft step costs what later ones do (its time decides K).
                    owed.flush(self.model, self.mtp_cache)
                else:
                    # Drafting is paused where this sequence will run: the head skips
                    # this prompt, and leaving the hiddens unread lets the lazy graph
                    # skip the last layer's per-position work, as plain prefill does.
                    self.row.owed, self.last_hidden = OwedPairs(), None
                    owed = self.row.owed
            mx.eval(cache_state_arrays(self.cache), *(owed.hidden if owed else []))
            self.n_processed = end
            if end == snapshot_at:
                self.snapshot_state = self.snapshot()
            if progress is not None:
                progress(end, n)
        if self.n_processed != n:
            raise ValueError("The restored prefix state is longer than the prompt.")
        self.row.y = tokens[:, -1]
        if owed is not None and self.last_hidden is not None:
            owed.owe(self.last_hidden, self.row.y[:, None])
            self.last_hidden = None
        self._last_read = None
        self._plain_run = []

    def _owe_prompt(self, hidden, tokens):
        """Trunk hiddens for ``tokens`` (1, S): pair each with the token after it."""
        if self.last_hidden is not None:
            self.row.owed.owe(self.last_hidden, tokens[:, :1])
        if tokens.shape[1] > 1:
            self.row.owed.owe(hidden[:, :-1], tokens[:, 1:])
        self.last_hidden = hidden[:, -1:]

    def snapshot(self) -> DecoderState:
        """A copy of the prompt-processing state (between prefill chunks)."""
        return DecoderState(
            n_processed=self.n_processed,
            cache=[c.copy() for c in self.cache],
            mtp_cache=None if self.mtp_cache is None else [c.copy() for c in self.mtp_cache],
            owed=self.row.owed.copy() if self.row.owed is not None else OwedPairs(),
            last_hidden=self.last_hidden,
        )

    def restore(self, state: DecoderState):
        """Continue from a snapshot (copied again, so the snapshot stays reusable)."""
        self.n_processed = state.n_processed
        self.cache = [c.copy() for c in state.cache]
        if self.mtp_cache is not None:
            if state.mtp_cache is None:
                raise ValueError("The prefix state has no MTP cache.")
            self.mtp_cache = [c.copy() for c in state.mtp_cache]
            self.row.owed = state.owed.copy()
            self.last_hidden = state.last_hidden

    # -- decoding ----------------------------------------------------------
    def step(self) -> StepOutput:
        core = self._core
        if core is None or core.cache is not self.cache or core.mtp_cache is not self.mtp_cache:
            core = self._core = DecodeBatch(self.model, [self.row], self.cache, self.mtp_cache)
        if self._ahead is not None:
            pending, ks, self._ahead = self._ahead, [0], None
        else:
            ks = self._choose()
            pending = core.launch(ks)
        if pending.k == 0 and self.overlap and self.sampler.grammar is None and not (
                self.row.drafter is not None and self.row.drafter.has_match()):
            # (A grammar's next mask needs this step's token: no overlap then.)
            # Start the next plain step before reading this one's token.
            self._next_ks = self._choose()
            if self._next_ks[0] == 0:
                self._ahead, self._next_ks = core.launch([0]), None
        out = core.finish(pending)[0]
        seconds = self._tick()
        if self.K and not out.lookup_drafted:  # context drafts are not the policy's
            self._record(out.num_drafted, seconds, out.num_accepted)
        return out

    def _record(self, k: int, seconds: Optional[float], accepted: int):
        """Tell the policy what the step cost. A plain step read after its successor was
        launched has no cost of its own: launching the successor waited for most of its
        work on the CPU (on a GPU the two overlap), so the first step of such a chain
        reads as two and the last as almost nothing. Each counts the mean of its chain
        (recorded when the chain ends, or two at a time while it goes on, the newest step
        held back so the next pair stays together). Timed one by one, the policy's median swung
        between the two and drafting paused for two plain steps after each draft."""
        if k != 0 or seconds is None:
            self.policy.record_step(1, k, seconds, [accepted])
            return
        self._plain_run.append(seconds)
        if self._ahead is None:  # the chain ends here
            group, self._plain_run = self._plain_run, []
        elif len(self._plain_run) >= 3:
            group, self._plain_run = self._plain_run[:-1], self._plain_run[-1:]
        else:
            return
        for _ in group:
            self.policy.record_step(1, 0, sum(group) / len(group), [0])

    def _choose(self) -> List[int]:
        if self._next_ks is not None:
            ks, self._next_ks = self._next_ks, None
            return ks
        return self.policy.row_ks([self.row], 1) if self.K else [0]

    def _tick(self) -> Optional[float]:
        """Seconds since the previous read: the step's cost, overheads included."""
        now = time.perf_counter()
        prev, self._last_read = self._last_read, now
        return None if prev is None else now - prev

    def sync_mtp_cache(self):
        """Write every owed pair but the newest into the MTP cache (inspection, tests)."""
        if self.mtp_cache is not None and self.row.owed:
            self.row.owed.flush(self.model, self.mtp_cache)

    def finish_pending(self):
        """Wait for a plain step launched ahead (before timing or reusing the model)."""
        if self._ahead is not None:
            mx.eval(self._ahead.tokens)


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
