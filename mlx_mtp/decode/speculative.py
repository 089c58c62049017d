"""Single-sequence decoding: ``MTPDecoder`` and ``generate_step``.

An ``MTPDecoder`` is a ``sequence.Sequence`` that drives itself as a batch of one
through the one driver, ``batch.BatchDecoder`` (draft -> verify -> accept -> roll
back, one host sync per step; plain steps overlap, as mlx-lm's do). K per step
comes from a ``DraftPolicy`` owned by the decoder or passed in by whoever decodes
many sequences in turn (how K travels: docs/architecture.md, "Following K").
"""

from __future__ import annotations

import time  # noqa: F401  (tests patch time.perf_counter through this module)
from typing import Generator, Optional, Sequence as Seq, Tuple

import mlx.core as mx

from .batch import BatchDecoder, BatchStepError
from .policy import DraftPolicy
from .sampling import SamplingParams
from .sequence import DecoderState, Sequence
from .stats import SpecStats
from .step import StepOutput

__all__ = ["MTPDecoder", "DecoderState", "Sequence", "SpecStats", "StepOutput",
           "generate_step"]


class MTPDecoder(Sequence):
    """Speculative decoding of one sequence: ``prefill(prompt)`` then ``step()``
    repeatedly; each step emits >= 1 token.

    ``policy``: a ``DraftPolicy`` to share across decoders of the same model (its
    step costs carry over); by default the decoder makes its own. ``overlap``:
    launch the next plain step before reading the current one.
    """

    def __init__(self, model, num_draft_tokens: int = 3,
                 sampling: SamplingParams = SamplingParams(), adaptive: bool = True,
                 prefill_step_size: int = 2048, cache=None,
                 policy: Optional[DraftPolicy] = None, overlap: bool = True, grammar=None,
                 drafter=None, images=None):
        super().__init__(model, num_draft_tokens, sampling, adaptive, prefill_step_size,
                         cache, grammar, drafter, images)
        # K per step: the policy's choice up to the row's cap (not adaptive: the cap).
        self.policy = policy if policy is not None else DraftPolicy(adaptive)
        self.overlap = overlap
        self._batch: Optional[BatchDecoder] = None

    def prefill(self, prompt: Seq[int], progress=None, snapshot_at: Optional[int] = None):
        self._batch = None  # a new prompt: the batch of one starts again
        super().prefill(prompt, progress, snapshot_at)

    def step(self) -> StepOutput:
        try:
            return self._batch_of_one().step()[None]
        except BatchStepError as e:
            raise e.cause

    def _batch_of_one(self) -> BatchDecoder:
        """The driver of this sequence alone, sharing its caches (made again after they
        were replaced, e.g. by ``restore``)."""
        batch = self._batch
        if batch is None or batch.cache is not self.cache or batch.mtp_cache is not self.mtp_cache:
            batch = self._batch = BatchDecoder(self.model, self.row.max_k > 0, self.adaptive,
                                               policy=self.policy, overlap=self.overlap)
            batch.add(None, self, share=True)
        return batch

    def finish_pending(self):
        """Wait for a plain step launched ahead (before timing or reusing the model)."""
        if self._batch is not None:
            self._batch.finish_pending()


def generate_step(
    prompt: Seq[int],
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
