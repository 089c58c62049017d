"""One sequence: its row (sampler, last token, owed MTP pairs, stats), its caches and
its prompt processing, with snapshots of the prompt state for prefix caches.

A ``Sequence`` prefills its prompt in chunks and then joins a ``batch.BatchDecoder``,
the one driver that steps any number of rows (``speculative.MTPDecoder`` is a
sequence that drives a batch of one itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence as Seq

import mlx.core as mx

from . import block_context, check_num_draft_tokens
from ..models.cache.kv import cache_state_arrays
from ..models.vision.images import ImageError
from .policy import SeededSchedule, needs_schedule
from .sampling import Sampler, SamplingParams
from .stats import SpecStats
from .step import OwedPairs, Row


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

    def arrays(self) -> List[mx.array]:
        """Every array the state holds (to evaluate it before keeping it)."""
        return (cache_state_arrays(self.cache) + cache_state_arrays(self.mtp_cache or [])
                + list(self.owed.hidden))

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in self.cache)
        total += sum(c.nbytes for c in self.mtp_cache or [])
        return total + sum(h.nbytes for h in self.owed.hidden)


def check_state_fits(state: DecoderState, cache: list, mtp_cache: Optional[list]):
    """ValueError unless every cache of ``state`` fits beside ``cache`` and ``mtp_cache``
    (None: not checked), a model's: new ones check kinds and settings, those of a state
    computed here (``reference_state``) shapes and dtypes too."""
    if mtp_cache is not None and state.mtp_cache is None:
        raise ValueError("The prefix state has no MTP cache.")
    pairs = [(cache, state.cache)] + ([] if mtp_cache is None else [(mtp_cache, state.mtp_cache)])
    for ours, saved in pairs:
        if len(saved) != len(ours):
            raise ValueError(f"The prefix state has {len(saved)} caches, not {len(ours)}.")
        for c, s in zip(ours, saved):
            c.check_joins(s)


def reference_state(model) -> DecoderState:
    """The state of a short prompt computed here, every cache filled: what a state read from
    elsewhere must be shaped like (``check_state_fits``)."""
    seq = Sequence(model, 1 if model.num_mtp_layers else 0, adaptive=False)
    seq.prefill(list(range(8)))
    return seq.snapshot()


class Sequence:
    """One sequence's caches, row and prompt processing.

    ``prefill(prompt)`` runs the prompt; the sequence then joins a batch
    (``BatchDecoder.add``), which takes its caches. ``grammar``: a
    ``grammar.GrammarState`` constraining the output (structured output).
    """

    def __init__(self, model, num_draft_tokens: int = 3,
                 sampling: SamplingParams = SamplingParams(), adaptive: bool = True,
                 prefill_step_size: int = 2048, cache=None, grammar=None, drafter=None,
                 images=None):
        check_num_draft_tokens(num_draft_tokens)
        if images is not None and model.block_drafter is not None:
            raise ImageError(block_context.NO_IMAGES)
        head = model.num_mtp_layers > 0  # without: only the block drafter drafts
        if num_draft_tokens > 0 and not head and not (
                model.block_drafter is not None and drafter is not None and drafter.blocks):
            raise ValueError(
                "This model was loaded without an MTP head; use num_draft_tokens=0 (--no-mtp)."
            )
        if drafter is not None and drafter.blocks and model.block_drafter is not None:
            spec = model.block_drafter.spec
            drafter.fit_block(spec.max_draft, spec.autoregressive)
        self.model = model
        k = num_draft_tokens  # kept in the row (``max_k``), its one home
        self.params = sampling
        self.sampler = Sampler(sampling, grammar)
        self.adaptive = adaptive
        self.prefill_step_size = prefill_step_size
        self.cache = cache if cache is not None else block_context.make_cache(model)
        self.mtp_cache = model.make_mtp_cache() if k > 0 and head else None
        schedule = SeededSchedule(adaptive) if k and needs_schedule(sampling) else None
        self.row = Row(key=None, sampler=self.sampler, max_k=k, y=None,
                       owed=OwedPairs() if k and head else None, schedule=schedule,
                       drafter=drafter)  # draft_source.RowDrafter: drafts beside the head
        self.last_hidden: Optional[mx.array] = None  # hidden of the last prompt token run
        self.n_processed = 0  # prompt tokens already in the trunk cache
        self.snapshot_state: Optional[DecoderState] = None
        self.images = images  # vision.images.PromptImages of the prompt, or None

    @property
    def stats(self) -> SpecStats:
        return self.row.stats

    @property
    def y(self) -> Optional[mx.array]:
        return self.row.y

    @property
    def owed(self) -> Optional[OwedPairs]:
        return self.row.owed

    def release(self):
        """A batch holds this sequence's state now: drop the references to it."""
        self.cache = None
        if self.mtp_cache is not None:
            self.mtp_cache = []

    # -- prompt ------------------------------------------------------------
    def prefill(self, prompt: Seq[int], progress=None, snapshot_at: Optional[int] = None,
                run_head: bool = True):
        """Run the prompt (all but its last token) through the trunk, in chunks.

        Continues after the ``n_processed`` tokens of a restored prefix state.
        With ``snapshot_at``, keeps ``self.snapshot_state``: the state after that
        many prompt tokens (for a prefix cache). ``run_head=False``: drafting is paused
        where the sequence will decode (the server's batch), so the MTP head need not
        read these tokens.
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
            self.row.drafter.sync(prompt)
        n = len(prompt) - 1
        if self.sampler.history is not None:  # the repetition penalty covers the prompt
            self.sampler.history.set_prompt(prompt)
        self.snapshot_state = None
        while self.n_processed < n:
            start = self.n_processed
            end = min(start + self.prefill_step_size, n)
            if snapshot_at is not None and start < snapshot_at < end:
                end = snapshot_at
            if self.images is None:
                _, h_mtp = block_context.trunk(self.model, tokens[:, start:end], self.cache)
            else:
                _, h_mtp = self.model.trunk_with_images(tokens[:, start:end], self.images,
                                                        start, self.cache)
            if self.row.owed is not None:
                self._head_prompt(h_mtp, tokens[:, start:end], run_head)
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
        if self.row.owed is not None and self.last_hidden is not None:
            self.row.owed.owe(self.last_hidden, self.row.y[:, None])
            self.last_hidden = None

    def _head_prompt(self, hidden, tokens, run_head: bool):
        """The MTP head's share of a prompt chunk: run it now, or skip it while paused."""
        # A seeded schedule's drafts must not depend on the batch: it always runs the
        # head over its prompt.
        if self.row.schedule is not None or run_head:
            self._owe_prompt(hidden, tokens)
            # The head's pass over the prompt is prompt work: done here, the first
            # draft step costs what later ones do (its time decides K).
            self.row.owed.flush(self.model, self.mtp_cache)
        else:
            # Drafting is paused where this sequence will run: the head skips this
            # prompt, and leaving the hiddens unread lets the lazy graph skip the last
            # layer's per-position work, as plain prefill does.
            self.row.owed, self.last_hidden = OwedPairs(), None

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
        """Continue from a snapshot (copied again, so the snapshot stays reusable).

        A state that does not fit this sequence's caches (kinds, settings, layer count) or
        the model (owed MTP pairs, deferred drafter taps): a damaged or forged entry,
        raises ValueError and changes nothing."""
        check_state_fits(state, self.cache, self.mtp_cache)
        block_context.check_restored(self.model, state.cache)
        if self.mtp_cache is not None:
            self._check_owed(state.owed, state.last_hidden)
        self.n_processed = state.n_processed
        self.cache = [c.copy() for c in state.cache]
        if self.mtp_cache is not None:
            self.mtp_cache = [c.copy() for c in state.mtp_cache]
            self.row.owed = state.owed.copy()
            self.last_hidden = state.last_hidden

    def _check_owed(self, owed: OwedPairs, last_hidden: Optional[mx.array]):
        """ValueError unless a state's owed MTP pairs are (1, S, [streams,] hidden) hiddens
        beside (1, S) ids of the vocabulary: an id past the embedding table is read out of
        bounds."""
        args = self.model.text.args
        width = self.model.text.stage_shape(1, 1)[-1]  # a stream family's: its streams' width
        hiddens = list(owed.hidden) + ([] if last_hidden is None else [last_hidden])
        fits = len(owed.hidden) == len(owed.tokens) and all(
            h.ndim in (3, 4) and h.shape[0] == 1 and width in (None, h.shape[-1])
            for h in hiddens)
        fits = fits and all(t.shape == h.shape[:2] and mx.issubdtype(t.dtype, mx.integer)
                            for h, t in zip(owed.hidden, owed.tokens))
        if fits and owed.tokens:
            ids = mx.concatenate([t.reshape(-1) for t in owed.tokens]).astype(mx.int64)
            fits = 0 <= ids.min().item() and ids.max().item() < args.vocab_size
        if not fits:
            raise ValueError("The prefix state's owed MTP pairs do not fit the model.")

    def sync_mtp_cache(self):
        """Write every owed pair but the newest into the MTP cache (inspection, tests)."""
        if self.mtp_cache is not None and self.row.owed:
            self.row.owed.flush(self.model, self.mtp_cache)
