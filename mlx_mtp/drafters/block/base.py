"""What a block drafter is: a separate draft model that reads the trunk's residual stream
after chosen layers (taps) and proposes a row's next positions, beside the MTP head.

Terms (one meaning each, used by every kind):
- tap: the residual after trunk layer ``i`` (0-based, before the final norm; z-lab's
  ``hidden_states[i + 1]``) for ``i`` in ``BlockSpec.target_layer_ids``.
- context: the drafter's own cache of the taps of every emitted row, projected into each
  drafter layer's K/V once (raw taps are never kept beyond a step).
- anchor: the row's last emitted token; a pass drafts the positions after it.

A kind (``dflash.py``, ``dflash2.py``, ``dspark.py``, ``eagle3.py``) implements
``BlockDraftModel``, built from the ``DrafterConfig`` that ``config.py`` reads from every
packaging (its ``spec`` a ``BlockSpec``); ``KINDS`` in ``__init__.py`` maps the kind name to
its class, ``load.py`` loads and checks one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

# draw(logits (B, V), j) -> (picks (B,), log q (B, V)): turns position j's logits into the
# row's draft under its sampling settings (greedy: argmax and a one-hot q) and returns the
# distribution the pick was drawn from, for rejection sampling.
Draw = Callable[[mx.array, int], Tuple[mx.array, mx.array]]


@dataclass(frozen=True)
class BlockSpec:
    """What the engine needs to know of a drafter, whatever its packaging."""

    kind: str  # "dflash" | "dflash2" | "dspark" | "eagle3"
    hidden_size: int  # must equal the trunk's
    vocab_size: int  # the target vocabulary the drafts are ids of
    target_layer_ids: Tuple[int, ...]  # tapped trunk layers, 0-based (see "tap" above)
    block_size: int  # positions per pass, the anchor's slot included
    mask_token_id: Optional[int] = None  # fills the block's slots after the anchor
    anchor_predicts: bool = False  # slot 0 drafts too (DeepSpec DSpark) instead of a pure anchor
    num_target_layers: Optional[int] = None  # trunk depth it was trained on, when recorded
    autoregressive: bool = False  # one pass per draft (EAGLE-3), not one per block

    @property
    def max_draft(self) -> int:
        """Drafts one pass can propose."""
        return self.block_size if self.anchor_predicts else self.block_size - 1


class BlockDraftModel(nn.Module):
    """One drafter kind. The target's token embedding and output layer are bound once
    (``bind``) unless the drafter ships its own."""

    spec: BlockSpec

    def sanitize(self, weights: dict) -> dict:
        """The checkpoint's tensors under this model's names (kinds that rename override)."""
        return weights

    def bind(self, embed: Callable[[mx.array], mx.array],
             head: Callable[[mx.array], mx.array]):
        """The target's ``embed(tokens) -> (B, S, H)`` and ``head(hidden) -> logits``."""
        raise NotImplementedError

    def make_cache(self) -> list:
        """An empty context cache (one entry per drafter layer)."""
        raise NotImplementedError

    @property
    def num_caches(self) -> int:
        """Entries of ``make_cache()``, without making them."""
        return len(self.make_cache())

    def add_context(self, taps: Sequence[mx.array], cache: list,
                    tokens: Optional[mx.array] = None, lengths: Optional[List[int]] = None):
        """Append emitted rows: ``taps`` holds one (B, S, H) array per tapped layer, in
        ``spec.target_layer_ids`` order; they take the context's next positions. ``tokens``
        (B, S): the tokens the trunk read at those rows (EAGLE-3 pairs each row with the
        token after it; block kinds ignore them). ``lengths``: each row's real rows of a
        right-aligned chunk, for a batch cache (``models.cache.prepare_chunk``)."""
        raise NotImplementedError

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw
                ) -> Tuple[mx.array, List[mx.array]]:
        """Draft ``n <= spec.max_draft`` positions after ``anchor`` (B,): the drafts (B, n)
        and, per position, the log q (B, V) each was drawn from. Leaves ``cache`` holding
        the context only (a pass's own K/V are transient: nothing of it needs rolling
        back after the verify)."""
        raise NotImplementedError
