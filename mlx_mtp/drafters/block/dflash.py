"""z-lab DFlash (``DFlashDraftModel`` checkpoints): the shared body (``layers.ContextDrafter``)
drafting a whole block in one pass.

A pass embeds ``[anchor, mask x (block_size - 1)]`` with the target's embedding, runs every
layer over the context plus the block (bidirectional; causal where the config says so, and a
sliding layer sees the context within its window), and the target's head turns slots 1..
into the drafts' logits. The block is always the trained width: a shorter draft takes the
first positions of it; each slot is drawn from its own logits, so q is their softmax.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .base import Draw
from .config import DrafterConfig
from .layers import ContextDrafter, ContextLayer, softcap


class DFlash(ContextDrafter):
    def __init__(self, config: DrafterConfig):
        super().__init__(config, [ContextLayer(config, i)
                                  for i in range(config.args.num_hidden_layers)])

    def block_logits(self, anchor: mx.array, cache: list, n: Optional[int] = None) -> mx.array:
        """Logits (B, n, V) of the first ``n`` slots after ``anchor`` (B,) (all of them)."""
        n = self.spec.max_draft if n is None else n
        self.check_draft_count(n)
        hidden = self.block_hidden(anchor, self.spec.block_size, cache)[:, 1:n + 1]
        logits = self._head(hidden) * self.settings.output_multiplier
        return softcap(logits, self.settings.final_logit_softcapping)

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        logits = self.block_logits(anchor, cache, n)
        picks, log_qs = [], []
        for j in range(n):  # one pass drafted every slot: each draw reads its own logits
            pick, lq = draw(logits[:, j], j)
            picks.append(pick)
            log_qs.append(lq)
        return mx.stack(picks, axis=1), log_qs
