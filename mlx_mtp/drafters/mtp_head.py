"""The checkpoint's MTP head as a draft source: one batched chain for every row that
uses it.

Its first pass writes the MTP pairs the rows owe (trunk hidden at ``i`` with token
``i+1``) and drafts the first position; pass ``j`` feeds the head its own output and
the draft at ``j - 1``, which is a row drafter's token where that row's plan has one
(``where``), so a run the head extends conditions it as the trunk will. The head's
logits become tokens through the step's ``draw`` (position transforms as verify row
``j``, each group's filter, noise keyed by output position): the same draws, in the
same order, whichever source asks. The drafts' distribution ``q`` is the head's own,
returned per position for rejection sampling.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from ..models.cache import prepare_chunk
from .base import HEAD, HEAD_PASSES

# draw(logits (B, 1, V), j, drafts so far) -> (picks (B,), each group's filtered log q (b, V))
Draw = Callable[[mx.array, int, List[mx.array]], Tuple[mx.array, list]]


class MtpHead:
    """The head chain (declared as ``base.Drafter`` declares a source)."""

    name = HEAD  # its key in the registry and in acceptance estimates (per chain depth)
    cost = HEAD_PASSES  # one head pass per position it chains through
    deterministic = False  # drawn from its own q: verify takes it, (B, J, V)
    needs_taps = False  # it reads the trunk's MTP hidden (``model.trunk``), not taps

    def propose(self, model, mtp_cache: list, owed: Tuple[mx.array, mx.array, List[int]],
                J: int, draw: Draw, transforms, fixed: Optional[mx.array],
                where: Optional[mx.array]):
        """Chain J passes. ``owed``: every row's owed pairs right-aligned, (B, S, H) and
        (B, S), and their lengths; ``transforms``: the step's position transforms
        (``decode/logits.py``), told each position's drafts; ``fixed``/``where``: the
        rows' drafter tokens (B, k) and where they stand (None: nowhere). Returns the
        drafts per position (B,) and each group's filtered log q per position."""
        hidden, tokens, lengths = owed
        prepare_chunk(mtp_cache, hidden.shape[1], lengths)
        out = model.mtp_forward(hidden, tokens, mtp_cache, last_only=True)
        drafts, draft_lps = [], []  # per position j: (B,), per group (b, V)
        for j in range(J):
            if j:
                prepare_chunk(mtp_cache, 1)
                out = model.mtp_forward(out, drafts[-1][:, None], mtp_cache, depth=j)
            logits = model.draft_logits(out[:, -1:], any_token=transforms.any_token)
            pick, qs = draw(logits, j, drafts)
            drafts.append(pick if fixed is None
                          else mx.where(where[:, j], fixed[:, j], pick.astype(mx.uint32)))
            draft_lps.append(qs)
            transforms.advance(drafts[-1])
            # Start the head's work now: it runs while Python builds the rest of the step
            # (a GPU would otherwise idle until the step's graph is complete). No sync.
            mx.async_eval(drafts[-1])
        return drafts, draft_lps
