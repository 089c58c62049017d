"""A block drafter's context through decoding (``drafters/block``).

Its context caches ride at the end of the trunk's cache list (``make_cache``): the trunk's
layers read only their own entries, and every place that moves a sequence's caches (a
batch's merge and filter, snapshots, prefix states, a verify's ``accept``) moves the
context with them, so it stays aligned with each row's emitted tokens. Every trunk pass
goes through ``trunk``: with a drafter it taps the trunk and projects the taps of every
row it ran, with the tokens it read there (EAGLE-3 pairs them), into the context at once
(prompt chunks at prefill; every verify row, of which ``accept`` keeps the accepted ones
and the one after).

In a step (``step.py``): ``fit_plans`` caps each row's block drafts at the drafter's block
(the head extends past it for ``block+mtp``), ``draft`` runs the drafter once for every
row and draws its positions with their own q (``BlockDrafts``), before the head chain,
which is fed those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

import mlx.core as mx

from ..drafters.base import DraftPlan

# Image prompts run through ``trunk_with_images``, which does not tap: the context would miss
# those rows.
NO_IMAGES = ("images cannot be combined with a block drafter yet (its context would miss the "
             "image rows): drop the images or --draft-model")


def make_cache(model) -> list:
    """The trunk's caches, then the block drafter's context caches (if it has one)."""
    drafter = model.block_drafter
    return model.make_cache() + ([] if drafter is None else drafter.make_cache())


def context(model, cache: list) -> Optional[list]:
    """The block drafter's context caches in ``cache`` (None: the model has no drafter)."""
    drafter = model.block_drafter
    return None if drafter is None else cache[len(cache) - drafter.num_caches:]


def trunk(model, inputs, cache: list, capture: bool = False):
    """``model.trunk``; with a block drafter, these rows' taps also enter its context."""
    drafter = model.block_drafter
    if drafter is None:
        return model.trunk(inputs, cache, capture)
    h_norm, h_mtp, taps = model.trunk_with_taps(inputs, drafter.spec.target_layer_ids, cache,
                                                capture)
    drafter.add_context(taps, context(model, cache), inputs)
    return h_norm, h_mtp


def fit_plans(batch, plans: List[DraftPlan]) -> List[DraftPlan]:
    """A step's plans (``batch``: its ``step.DecodeBatch``) with block drafts capped at the
    drafter's block, the head extending past it for a source that chains it (``block+mtp``);
    where the drafter cannot draft (none; a grammar in the batch, whose masks its draws would
    need position by position) the head drafts instead, if it can."""
    drafter = batch.model.block_drafter
    heads = [batch.mtp_cache is not None and r.owed is not None and r.can_draft()
             for r in batch.rows]  # a row without a head (owed None) drafts from the block
    plans = [p if h or not p.head else replace(p, head=0) for p, h in zip(plans, heads)]
    if not any(p.block for p in plans):
        return plans
    if drafter is None or any(r.sampler.grammar is not None for r in batch.rows):
        return [DraftPlan([], p.block if h else 0) if p.block else p
                for p, h in zip(plans, heads)]
    fitted = []
    for r, p, h in zip(batch.rows, plans, heads):
        if p.block:
            n = min(p.block, drafter.spec.max_draft)
            p = replace(p, block=n, head=p.block - n if h and r.drafter.uses_head else 0)
        fitted.append(p)
    return fitted


@dataclass
class BlockDrafts:
    """A step's block drafts: ``tokens`` (B, k) (0 past each row's), ``where`` (B, k) the
    positions each row takes from the block drafter, ``qs`` per position each group's log q."""

    tokens: mx.array
    where: mx.array
    qs: list

    def feed(self, fixed: Optional[mx.array], where: Optional[mx.array]):
        """The tokens (B, k) and where (B, k) the head chain is fed instead of its picks: the
        block's, and a row drafter's (``fixed``/``where``, None: none)."""
        if fixed is None:
            return self.tokens, self.where
        return mx.where(self.where, self.tokens, fixed), self.where | where

    def with_q(self, draft_lps: list, groups) -> list:
        """q per position and group: the block drafter's where its drafts stand, the head's
        (``draft_lps``) elsewhere."""
        n, J = len(self.qs), len(draft_lps)
        return [self.qs[j] if j >= J else draft_lps[j] if j >= n else
                [mx.where(g.take(self.where[:, j])[:, None], bq, hq)
                 for g, bq, hq in zip(groups, self.qs[j], draft_lps[j])]
                for j in range(max(n, J))]


def draft(model, cache: list, rows, plans: List[DraftPlan], k: int, draw, merge) -> BlockDrafts:
    """The block drafter's drafts for the rows whose plan takes them (``plans[b].block``):
    one pass over every row's context after its last token, each position drawn by the
    step's ``draw`` (as the head's are: position transforms, each group's filter, noise by
    output position; ``merge`` puts per-group results in row order), kept with its q."""
    picked, group_qs = [], []

    def block_draw(logits, j):
        pick, qs = draw(logits[:, None], j, picked)
        picked.append(pick.astype(mx.uint32))
        group_qs.append(qs)
        return picked[-1], merge(qs)

    n = max(p.block for p in plans)
    anchor = mx.concatenate([r.y for r in rows])
    model.block_drafter.propose(anchor, context(model, cache), n, block_draw)
    tokens = mx.stack(picked + [mx.zeros_like(picked[0])] * (k - n), axis=1)
    where = mx.arange(k)[None] < mx.array([p.block for p in plans])[:, None]
    return BlockDrafts(mx.where(where, tokens, 0), where, group_qs)
