"""A block drafter's context through decoding (``drafters/block``).

Its context caches ride at the end of the trunk's cache list (``make_cache``), then its
deferred taps (``models/cache/taps.DeferredTaps``): the trunk's layers read only their own
entries, and every place that moves a sequence's caches (a batch's merge and filter,
snapshots, prefix states, a verify's ``accept``) moves the context with them, so it stays
aligned with each row's emitted tokens. Every trunk pass goes through ``trunk``: with a
drafter it taps the trunk and hands the taps of every row it ran, with the tokens it read
there (EAGLE-3 pairs them), to the context. A prompt chunk's are projected at once; a decode
step's (a plain step's row, a verify's rows, of which ``accept`` keeps the accepted ones and
the one after) wait as they are, kept by reference with no graph node, until the next
drafter pass projects them in one chunk (``settle``): a resting drafter costs a step
nothing, and a drafting one projects each step's kept rows once, as before.

In a step (``step.py``): ``fit_plans`` caps each row's block drafts at the drafter's block
(the head extends past it for ``block+mtp``), ``draft`` runs the drafter once over the rows
that draft from it and draws their positions with their own q (``BlockDrafts``), before the
head chain, which is fed those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

import mlx.core as mx

from ..drafters.base import DraftPlan
from ..models.cache.taps import DeferredTaps

# Image prompts run through ``trunk_with_images``, which does not tap: the context would miss
# those rows.
NO_IMAGES = ("images cannot be combined with a block drafter yet (its context would miss the "
             "image rows): drop the images or --draft-model")


# Positions of raw taps a batch keeps deferred (``trunk``): past them the next trunk pass
# projects them, once per this many positions, which bounds their memory (a resting drafter
# probes at gaps of up to 256 steps; rows that never draft from the block still have taps).
MAX_DEFERRED = 256


def make_cache(model) -> list:
    """The trunk's caches, then the block drafter's context caches and its deferred taps
    (if it has one)."""
    drafter = model.block_drafter
    if drafter is None:
        return model.make_cache()
    return model.make_cache() + drafter.make_cache() + [DeferredTaps.empty(1)]


def context(model, cache: list) -> Optional[list]:
    """The block drafter's context caches in ``cache`` (None: the model has no drafter)."""
    drafter = model.block_drafter
    return None if drafter is None else cache[len(cache) - 1 - drafter.num_caches:-1]


def trunk(model, inputs, cache: list, capture: bool = False, defer: bool = False):
    """``model.trunk``; with a block drafter, these rows' taps also enter its context, or
    (``defer``: a decode step's) wait as they are until its next pass (``settle``), up to
    ``MAX_DEFERRED`` positions."""
    drafter = model.block_drafter
    if drafter is None:
        return model.trunk(inputs, cache, capture)
    h_norm, h_mtp, taps = model.trunk_with_taps(inputs, drafter.spec.target_layer_ids, cache,
                                                capture)
    if not taps:  # a pipeline rank without the output: its taps travel to rank 0's drafter
        return h_norm, h_mtp
    if defer and cache[-1].columns() + inputs.shape[1] <= MAX_DEFERRED:
        cache[-1].add(taps, inputs)
    else:
        settle(model, cache)
        drafter.add_context(taps, context(model, cache), inputs)
    return h_norm, h_mtp


def settle(model, cache: list):
    """Project the taps decode steps deferred into the drafter's context, in one pass (each
    row's, right-aligned): the context then equals one that took every row at once."""
    drafter = model.block_drafter
    deferred = None if drafter is None else cache[-1].take()
    if deferred is not None:
        taps, tokens, lengths = deferred
        drafter.add_context([taps], context(model, cache), tokens, lengths)


def check_restored(model, cache: list):
    """ValueError unless the deferred taps in ``cache``, a state read from elsewhere, hold
    token ids of the vocabulary."""
    if model.block_drafter is not None and not cache[-1].ids_below(model.text.args.vocab_size):
        raise ValueError("The prefix state's deferred drafter taps do not fit the model.")


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
    one pass over those rows' contexts after their last tokens (the taps decode steps
    deferred projected first, ``settle``; a resting row's context is not read), each
    position drawn by the step's ``draw`` for every row (as the head's are: position
    transforms, each group's filter, noise by output position; ``merge`` puts per-group
    results in row order; a resting row's draws are discarded), kept with its q."""
    settle(model, cache)
    picked, group_qs = [], []
    drafting = [b for b, p in enumerate(plans) if p.block]
    ctx, anchor = context(model, cache), mx.concatenate([r.y for r in rows])
    some = len(drafting) < len(rows)
    if some:  # each row reads the logits of a drafting row (its own if it drafts)
        ix = mx.array(drafting)
        ctx, anchor = [c.select(drafting) for c in ctx], anchor[ix]
        slot = {b: i for i, b in enumerate(drafting)}
        spread = mx.array([slot.get(b, 0) for b in range(len(rows))])

    def block_draw(logits, j):
        pick, qs = draw((logits[spread] if some else logits)[:, None], j, picked)
        picked.append(pick.astype(mx.uint32))
        group_qs.append(qs)
        q = merge(qs)
        return (picked[-1][ix], q[ix]) if some else (picked[-1], q)

    n = max(p.block for p in plans)
    model.block_drafter.propose(anchor, ctx, n, block_draw)
    tokens = mx.stack(picked + [mx.zeros_like(picked[0])] * (k - n), axis=1)
    where = mx.arange(k)[None] < mx.array([p.block for p in plans])[:, None]
    return BlockDrafts(mx.where(where, tokens, 0), where, group_qs)
