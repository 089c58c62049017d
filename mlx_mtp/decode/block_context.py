"""A block drafter's context through decoding (``drafters/block``).

Its context caches ride at the end of the trunk's cache list (``make_cache``): the trunk's
layers read only their own entries, and every place that moves a sequence's caches (a
batch's merge and filter, snapshots, prefix states, a verify's ``accept``) moves the
context with them, so it stays aligned with each row's emitted tokens. Every trunk pass
goes through ``trunk``: with a drafter it taps the trunk and projects the taps of every
row it ran into the context at once (prompt chunks at prefill; every verify row, of which
``accept`` keeps the accepted ones and the one after).
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Optional

import mlx.core as mx

from ..drafters.base import DraftPlan


def make_cache(model) -> list:
    """The trunk's caches, then the block drafter's context caches (if it has one)."""
    drafter = model.block_drafter
    return model.make_cache() + ([] if drafter is None else drafter.make_cache())


def context(model, cache: list) -> Optional[list]:
    """The block drafter's context caches in ``cache`` (None: the model has no drafter)."""
    drafter = model.block_drafter
    return None if drafter is None else cache[len(cache) - len(drafter.make_cache()):]


def trunk(model, inputs, cache: list, capture: bool = False):
    """``model.trunk``; with a block drafter, these rows' taps also enter its context."""
    drafter = model.block_drafter
    if drafter is None:
        return model.trunk(inputs, cache, capture)
    h_norm, h_mtp, taps = model.trunk_with_taps(inputs, drafter.spec.target_layer_ids, cache,
                                                capture)
    drafter.add_context(taps, context(model, cache))
    return h_norm, h_mtp


def fit_plans(batch, plans: List[DraftPlan]) -> List[DraftPlan]:
    """A step's plans (``batch``: its ``step.DecodeBatch``) with block drafts capped at the
    drafter's block; where it cannot draft (no drafter; a grammar in the batch, whose masks
    its draws would need position by position) the head drafts instead, if it can."""
    drafter = batch.model.block_drafter
    if not any(p.block for p in plans):
        return plans
    if drafter is None or any(r.sampler.grammar is not None for r in batch.rows):
        head = batch.mtp_cache is not None
        return [DraftPlan([], p.block if head and r.can_draft() else 0) if p.block else p
                for r, p in zip(batch.rows, plans)]
    return [replace(p, block=min(p.block, drafter.spec.max_draft)) if p.block else p
            for p in plans]


def draft(model, cache: list, rows, plans: List[DraftPlan], draw, merge, drafts: list,
          draft_lps: list, groups, fixed: Optional[mx.array]):
    """The block drafter's drafts for the rows whose plan takes them: one pass over every
    row's context after its last token, each position drawn by the step's ``draw`` (as the
    head's are: position transforms, each group's filter, noise by output position;
    ``merge`` puts per-group results in row order) and kept with its q. Returns the step's
    drafts and q per position with those rows' replaced at 0..n-1 (``drafts``: the head's;
    ``fixed``: row drafters' tokens (B, k), the other rows' drafts past the head's)."""
    picked, group_qs = [], []

    def block_draw(logits, j):
        pick, qs = draw(logits[:, None], j, picked)
        picked.append(pick.astype(mx.uint32))
        group_qs.append(qs)
        return picked[-1], merge(qs)

    anchor = mx.concatenate([r.y for r in rows])
    model.block_drafter.propose(anchor, context(model, cache), max(p.block for p in plans),
                                block_draw)
    on = mx.array([p.block > 0 for p in plans])
    none = mx.zeros((len(rows),), mx.uint32)  # positions no other source drafts
    drafts = drafts + [none if fixed is None else fixed[:, j]
                       for j in range(len(drafts), len(picked))]
    return take_block(on, picked, group_qs, drafts, draft_lps, groups)


def take_block(rows, block: list, block_qs: list, drafts: list, draft_lps: list, groups):
    """Drafts and q per position with the block drafter's (``block``: (B,) per position,
    ``block_qs``: each group's log q per position) where ``rows`` (B,) bool draft from it;
    the head's (or none) elsewhere and past the block."""
    n = len(block)  # drafts has at least n positions
    drafts = [mx.where(rows, block[j], d) if j < n else d for j, d in enumerate(drafts)]
    lps = [block_qs[j] if j >= len(draft_lps) else draft_lps[j] if j >= n else
           [mx.where(g.take(rows)[:, None], bq, hq)
            for g, bq, hq in zip(groups, block_qs[j], draft_lps[j])]
           for j in range(max(n, len(draft_lps)))]
    return drafts, lps
