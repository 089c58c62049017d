"""How many tokens to draft per step, for one sequence or a batch: measured
acceptance against a step-cost model.

Drafting K tokens for B rows pays when the tokens a row gains per step,
``E_K = 1 + a1 + a1*a2 + ...`` (``a_j``: acceptance at draft position j), outweigh
what the step costs relative to a plain one: ``E_K / t(B, K) > 1 / t(B, 0)``.

Step times come from the one step-cost table (``costs.StepCosts``), fitted by least
squares as ``t(B, K) ~ c0 + c1*B + c2*K + c3*B*K`` over every (B, K) measured so far:
the fit carries what was measured at one batch size over to the others. Where extra rows cost almost nothing (Apple GPUs,
a good CPU BLAS) drafting stays on under load; where they cost linearly (the
reference BLAS of the Linux CPU wheel) it stops at the batch sizes where it
would lose, without probing each of them. A single sequence is the batch of one.

The policy's state (costs, acceptance) belongs to whoever decodes: the server's
engine, a generator, a benchmark; never the model object. Its ``costs`` are the table
the draft-source chooser reads too (the driver passes it to each step).

**Seeded requests.** Greedy rows and coupled rows (``SamplingParams.coupled``)
emit the target's own per-position choice whatever was drafted, so K is free for
them. A seeded row sampled with independent drafts emits tokens that depend on
*which* positions were drafted; its K therefore comes from a ``SeededSchedule``:
its own acceptance and a fixed cost model, never timings or batch mates. The
batch drafts the largest K any row asks for; a row asking for fewer stops at its
own (``step.py``), so every row's output is what it would be alone.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from . import MAX_DRAFT_TOKENS
from .costs import StepCosts


class AcceptanceEstimate:
    """Acceptance per draft position (the chance a draft at position j lands, given the
    ones before it did): a Beta estimate per position, forgetting old steps.

    Position j holds ``hits`` and ``trials`` (each multiplied by ``forget`` per step that
    reached j) and a prior of mean ``prior`` (one for all positions, or one each) worth
    ``prior_weight`` steps, forgotten alike: Beta(hits + prior * w, misses + (1 - prior) * w). ``alpha`` (the mean) drives choices;
    ``upper`` (mean + ``z`` standard deviations) is what must fall below break-even before
    a source is paused: a few early rejections leave it high, many do not.
    """

    def __init__(self, positions: int, forget: float, prior_weight: float = 1.0,
                 prior=0.7, z: float = 1.0):
        self.forget, self.z = forget, z
        self.prior = ([float(prior)] * positions if isinstance(prior, (int, float))
                      else list(prior))
        self.hits = [0.0] * positions  # observed, forgetting
        self.trials = [0.0] * positions
        self.weight = [float(prior_weight)] * positions  # the prior's, forgotten alike

    def record(self, k: int, accepted: Sequence[int], ks: Optional[Sequence[int]] = None,
               starts: Optional[Sequence[int]] = None):
        """One step: row b drafted positions ``starts[b] .. starts[b] + ks[b] - 1`` (default
        ``0 .. k - 1``; a start > 0: after context drafts, ``draft_source.py``) and
        ``accepted[b]`` drafts were accepted from its first position on."""
        ks = [k] * len(accepted) if ks is None else ks
        starts = [0] * len(accepted) if starts is None else starts
        top = min(len(self.hits), max((s + kb for s, kb in zip(starts, ks)), default=0))
        for j in range(top):
            rows = [n for n, kb, s in zip(accepted, ks, starts) if s <= j < s + kb and n >= j]
            if rows:
                self.hits[j] = self.forget * self.hits[j] + sum(n > j for n in rows)
                self.trials[j] = self.forget * self.trials[j] + len(rows)
                self.weight[j] *= self.forget

    @property
    def alpha(self) -> List[float]:
        # (hits + prior * weight) / (trials + weight), exactly the prior where unobserved
        return [p + (h - p * t) / (t + w)
                for p, h, t, w in zip(self.prior, self.hits, self.trials, self.weight)]

    @property
    def extrapolated(self) -> List[float]:
        """``alpha`` with each position's prior (after the first) replaced by the estimate
        of the position above it: a depth not drafted lately reads as the deepest one
        drafted, so a head whose deepest drafts keep landing is expected to land one
        deeper (the flat prior kept an always-right head at K=2), and one whose first
        drafts miss is not expected to land deeper either."""
        out: List[float] = []
        for p, h, t, w in zip(self.prior, self.hits, self.trials, self.weight):
            p = out[-1] if out else p
            out.append(p + (h - p * t) / (t + w))
        return out

    @property
    def upper(self) -> List[float]:
        """Optimistic acceptance: the Beta mean plus ``z`` standard deviations."""
        return self._upper(self.alpha)

    def _upper(self, means: List[float]) -> List[float]:
        return [min(1.0, a + self.z * math.sqrt(a * (1 - a) / (t + w + 1)))
                for a, t, w in zip(means, self.trials, self.weight)]

    def means(self, optimistic: bool = False, extrapolate: bool = False) -> List[float]:
        """Acceptance per position: ``alpha`` (``extrapolate``: ``extrapolated``), at its
        upper estimate if ``optimistic``."""
        means = self.extrapolated if extrapolate else self.alpha
        return self._upper(means) if optimistic else means

    def expected_tokens(self, k: int, start: int = 0, optimistic: bool = False,
                        extrapolate: bool = False) -> float:
        """Tokens a row emits per step with k drafts at positions ``start..``:
        1 + a1 + a1*a2 + ... (``extrapolate``: by ``extrapolated``)."""
        total, run = 1.0, 1.0
        for a in self.means(optimistic, extrapolate)[start:start + k]:
            run *= a
            total += run
        return total

    def landed_depth(self) -> int:
        """How many leading positions have landed lately (a hit not yet forgotten below
        half)."""
        return next((j for j, h in enumerate(self.hits) if h < 0.5), len(self.hits))

    def reach(self, k: int) -> float:
        """Probability that all k drafts of a step are accepted."""
        return math.prod(self.alpha[:k])


def context_bucket(tokens: int) -> int:
    """A row's context length as a log2 bucket: 0 below 1k tokens, then one per doubling."""
    return max(0, int(tokens).bit_length() - 10)


class ContextAcceptance:
    """Acceptance per draft position by the rows' context lengths (``context_bucket``):
    acceptance falls with context (vLLM measured Qwen's MTP at 80-91% near 100 tokens,
    ~53% at 34k), so a long row learns how deep drafting pays for it.

    A bucket first recorded starts from its nearest recorded neighbour's estimate (its
    prior, worth the usual ``prior_weight`` steps); a bucket not yet recorded reads as that
    neighbour, or as ``overall`` (every row's estimate) while no bucket is.
    """

    def __init__(self, overall: AcceptanceEstimate, prior_weight: float):
        self.overall, self.prior_weight = overall, prior_weight
        self.buckets: Dict[int, AcceptanceEstimate] = {}

    def estimate(self, context: int) -> AcceptanceEstimate:
        """The estimate a row of ``context`` tokens reads (no side effects)."""
        b = context_bucket(context)
        near = min(self.buckets, key=lambda n: (abs(n - b), n), default=None)
        return self.overall if near is None else self.buckets[near]

    def record(self, k: int, accepted: Sequence[int], ks: Optional[Sequence[int]],
               starts: Optional[Sequence[int]], contexts: Sequence[int]):
        """``AcceptanceEstimate.record``, each row into its context's bucket."""
        ks = [k] * len(accepted) if ks is None else ks
        starts = [0] * len(accepted) if starts is None else starts
        rows: Dict[int, List[int]] = {}
        for i, c in enumerate(contexts):
            rows.setdefault(context_bucket(c), []).append(i)
        for b, idx in rows.items():
            if b not in self.buckets:
                near = self.estimate(contexts[idx[0]])
                self.buckets[b] = AcceptanceEstimate(len(near.hits), near.forget,
                                                     self.prior_weight, near.alpha, near.z)
            self.buckets[b].record(k, [accepted[i] for i in idx], [ks[i] for i in idx],
                                   [starts[i] for i in idx])

    def expected_tokens(self, k: int, contexts: Sequence[int], optimistic: bool = False,
                        extrapolate: bool = False) -> float:
        """Tokens per row per step with k drafts, over rows of these context lengths."""
        return sum(self.estimate(c).expected_tokens(k, optimistic=optimistic,
                                                    extrapolate=extrapolate)
                   for c in contexts) / len(contexts)

    def reach(self, k: int, contexts: Sequence[int]) -> float:
        """The chance that all k drafts of a row land, over rows of these context lengths."""
        return sum(self.estimate(c).reach(k) for c in contexts) / len(contexts)


class DraftPolicy:
    """Chooses K for each batch step (``choose``) from what steps cost and what rows accept,
    up to the cap it is given (the rows' ``max_k``: K is stored per row, nowhere else)."""

    # While prompts wait, K only where its step (at the rows there are) is at most this many
    # plain steps: a stream's gap is then ~2.5 steps (docs/reliability.md, issue 43).
    PROMPT_CAP = 1.5

    def __init__(self, adaptive: bool = True, margin: float = 1.05,
                 forget: float = 0.97, probe_gap: Tuple[int, int] = (8, 1024),
                 recheck_gap: Tuple[int, int, int] = (4, 32, 512), prior_weight: float = 3.0,
                 probe_budget: float = 0.005):
        self.adaptive = adaptive
        self.margin = margin  # drafting must win clearly: timing noise must not cost users
        self.waiting_margin = 0.1
        self.costs = StepCosts()
        # A prior worth 3 steps, and pausing only once the upper estimate says so: a few
        # unlucky drafts of a good head do not pause it; a useless head stops after ~4-8
        # (after ``first_misses`` if none of its drafts ever landed).
        self.acceptance = AcceptanceEstimate(MAX_DRAFT_TOKENS, forget, prior_weight)
        self.by_context = ContextAcceptance(self.acceptance, prior_weight)
        self.probe_gap = probe_gap  # cost probes, per batch size
        # Acceptance re-checks while paused start sooner: a good head paused by bad luck
        # loses every step until one; a useless one costs a fraction of a step per probe.
        # Their interval (first, shortest and longest cap) doubles up to where re-checks
        # cost ``probe_budget`` of the time at most (``_recheck_gaps``): a paused head that
        # would pay is found again within that many steps, whatever luck paused it. A
        # re-check that lands starts the intervals again: one more is due soon, so the
        # evidence that paused the head is weighed against fresh steps, not rare ones.
        self.recheck_gap = recheck_gap
        self.probe_budget = probe_budget
        # A probe is worth it if drafting could win with a somewhat cheaper step than
        # predicted: a probe measures the cell itself, correcting the fit.
        self.optimism = 0.8
        # Probe intervals: key -> (steps between probes, steps to go); key is a
        # batch size (cost probes) or None (acceptance re-checks while paused).
        self._gaps: Dict[Optional[int], Tuple[int, int]] = {}
        self._drafting = False
        # A head that has never landed a draft pauses after this many drafting steps,
        # whatever the costs: where drafts are cheap, its upper estimate stays above
        # break-even for a dozen misses, and a fresh process has no evidence for it.
        self.first_misses = 3
        self._landed_once, self._dry_steps = False, 0

    # -- measurements ------------------------------------------------------------
    def record_step(self, B: int, k: int, seconds: Optional[float], accepted: Sequence[int] = (),
                    ks: Optional[Sequence[int]] = None, starts: Optional[Sequence[int]] = None,
                    head_passes: Optional[int] = None, contexts: Optional[Sequence[int]] = None,
                    block: int = 0):
        """One finished step: its batch size, positions drafted, wall time (None:
        unknown) and each row's accepted count (``ks``: each row's own head drafts, if
        not all drafted ``k``; ``starts``: the position of each row's first head draft,
        after its context drafts, ``AcceptanceEstimate.record``; ``head_passes``: the
        head passes chained, if not ``k``; ``contexts``: each row's context length, for
        ``by_context``; ``block``: 1 if the block drafter ran its pass). Its time goes to
        ``costs``, the one table."""
        if seconds is not None:
            self.costs.observe(B, k, k if head_passes is None else head_passes, seconds, block)
        self.acceptance.record(k, accepted, ks, starts)
        if contexts:
            self.by_context.record(k, accepted, ks, starts, contexts)
        landed = any(n > s for n, s in zip(accepted, starts or [0] * len(accepted)))
        self._landed_once |= landed
        # a step whose drafts were all the block drafter's says nothing about the head
        self._dry_steps += (k > 0 if ks is None else any(ks)) and not landed
        whole = any(kb and n >= s + kb for n, s, kb in zip(
            accepted, starts or [0] * len(accepted), ks or [k] * len(accepted)))
        if not self._drafting and ((landed and self._could_pay(B, 1))
                                   or (whole and self._could_pay(B))):
            # paused, yet a re-check landed (every draft, where only deeper steps can
            # pay): the next one soon, one position deeper if it landed every draft
            self._gaps[None] = (self.recheck_gap[0], self.recheck_gap[0])

    def row_ks(self, rows, B: int, prompts_waiting: bool = False,
               contexts: Optional[Sequence[int]] = None) -> List[int]:
        """Drafts per row for the next step (``step.Row``s): seeded schedules for rows
        that need one, the policy's K for the others, 0 where a row cannot draft.
        ``contexts``: each row's context length (acceptance by context, ``by_context``)."""
        free = [i for i, r in enumerate(rows) if r.schedule is None and r.can_draft()]
        max_k = max((rows[i].max_k for i in free), default=0)
        if prompts_waiting and self.adaptive:
            max_k = self.costs.deepest_within(len(rows), max_k, self.PROMPT_CAP)
        k = self.choose(B, max_k, prompts_waiting,
                        contexts and [contexts[i] for i in free]) if free else 0
        return [0 if not r.can_draft() else r.schedule.next_k(r.max_k) if r.schedule is not None
                else min(k, r.max_k) for r in rows]

    # -- decision ----------------------------------------------------------------
    def choose(self, B: int, max_k: int, prompts_waiting: bool = False,
               contexts: Optional[Sequence[int]] = None) -> int:
        """K (up to ``max_k``) for the next step of a batch of B rows. ``prompts_waiting``:
        sequences are waiting for their prompt to run, and a longer step delays them (the
        batch stays smaller for longer), so drafting must win by a wider margin.
        ``contexts``: the drafting rows' context lengths (their acceptance by context);
        None: every row's acceptance alike."""
        if not self.adaptive or max_k == 0:
            return max_k
        depth = min(max_k, self._landed_depth(contexts) + 1)
        k = self._decide(B, depth, self.margin + (self.waiting_margin if prompts_waiting else 0),
                         contexts)
        if k and not self._drafting:  # drafting pays again: re-check soon after a pause
            self._gaps.pop(None, None)
        self._drafting = k > 0
        probe = self._maybe_probe(B, max_k, k)
        return k if probe is None else probe

    def would_draft(self, B: int, max_k: int) -> bool:
        """Whether a batch of B rows drafts now (or explores): no side effects."""
        if not self.adaptive or max_k == 0:
            return max_k > 0
        return self._decide(B, max_k) > 0

    def _landed_depth(self, contexts: Optional[Sequence[int]]) -> int:
        """Positions that have landed lately, for the deepest-landing row: K goes at most
        one past them, so a head earns each depth and one that is never right drafts one
        position per step (a fresh policy's prior alone would draft K=3 where drafts are
        cheap)."""
        if not contexts:
            return self.acceptance.landed_depth()
        return max(self.by_context.estimate(c).landed_depth() for c in contexts)

    def _expected(self, k: int, contexts: Optional[Sequence[int]], optimistic: bool = False):
        """Tokens per row per step with k drafts, deeper positions than drafted lately
        extrapolated (``AcceptanceEstimate.extrapolated``): by the rows' context lengths
        if known."""
        if not contexts:
            return self.acceptance.expected_tokens(k, optimistic=optimistic, extrapolate=True)
        return self.by_context.expected_tokens(k, contexts, optimistic, extrapolate=True)

    def _decide(self, B: int, max_k: int, margin: Optional[float] = None,
                contexts: Optional[Sequence[int]] = None) -> int:
        """The best K by predicted tokens per second per row (rows of ``contexts``)."""
        t0 = self.costs.predict(B, 0)
        if t0 is None or (not self._landed_once and self._dry_steps >= self.first_misses):
            return 0  # time plain steps at this batch size first; a head never right
        best, best_rate = 0, (margin or self.margin) / t0
        for k in range(1, max_k + 1):
            t = self.costs.predict(B, k)
            if t is None:
                # Unknown cost: try it for a step if it could win (measuring it is the
                # only way to find out; a deeper K is not tried before this one is known,
                # nor past a K that loses to a shallower one).
                if best in (0, k - 1) and self._worth_trying(B, k, best_rate, contexts):
                    return k
                break
            rate = self._expected(k, contexts) / t
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0 and self._unproven(B, best_rate, contexts):
            return 1
        return best

    def _unproven(self, B: int, plain_rate: float,
                  contexts: Optional[Sequence[int]] = None) -> bool:
        """Whether K=1 could still beat plain steps by what the acceptance evidence allows
        (its upper estimate): pausing needs evidence, not a few unlucky drafts."""
        t1 = self.costs.predict(B, 1)
        return t1 is not None and self._expected(1, contexts, optimistic=True) / t1 > plain_rate

    def _cost_guess(self, B: int, k: int) -> Optional[float]:
        """K's cost as measured, else optimistically continued from the two K below it
        (each measured a few times): the last step of cost growth, discounted (None for
        K=1, or with too little data)."""
        t = self.costs.predict(B, k)
        if t is not None or k < 2:
            return t
        if min(self.costs.count(B, k - 1), self.costs.count(B, k - 2)) < 3:
            return None  # not on one-off figures (a first step at a new shape, a spike)
        below, two_below = self.costs.predict(B, k - 1), self.costs.predict(B, k - 2)
        return below + self.optimism * max(below - two_below, 0.0)

    def _worth_trying(self, B: int, k: int, best_rate: float,
                      contexts: Optional[Sequence[int]] = None) -> bool:
        """Whether K=k could beat ``best_rate`` at its guessed cost with its acceptance at
        the upper estimate. Without anything to go on (K=1 unmeasured) drafts must mostly
        land (the acceptance prior is 0.7)."""
        guess = self._cost_guess(B, k)
        if guess is None:
            reach = self.by_context.reach(k, contexts) if contexts else self.acceptance.reach(k)
            return reach >= 0.5
        return self._expected(k, contexts, optimistic=True) / guess > best_rate

    def _maybe_probe(self, B: int, max_k: int, chosen: int) -> Optional[int]:
        """Now and then (at doubling intervals) try another K.

        Per batch size: a K whose cost here is barely or long ago measured (a fit, one
        or two perhaps unlucky steps, an old figure): plain steps, or a K whose drafts
        would mostly land or that could beat the chosen one at an optimistic cost.
        Across batch sizes, while paused: K=1 to re-check acceptance, where even
        perfect acceptance would beat plain steps or K=1's cost here is barely measured
        (its first step carries one-off work: new shapes, a backlog of MTP pairs).
        """
        t0 = self.costs.predict(B, 0)
        if t0 is None:
            return None
        chosen_t = self.costs.predict(B, chosen)
        chosen_rate = (self.acceptance.expected_tokens(chosen) / chosen_t if chosen_t
                       else self.margin / t0)
        thin = [k for k in range(max_k + 1) if k != chosen
                and (self.costs.count(B, k) < 3 or self.costs.stale(B, k))
                and (k == 0 or self.acceptance.reach(k) >= 0.5
                     or self._worth_trying(B, k, chosen_rate))]
        if thin and self._due(B):
            return min(thin, key=lambda k: (self.costs.count(B, k), k))
        k = self._recheck_k(B, max_k)
        t = self.costs.predict(B, k)
        if chosen == 0 and (t is None or self.costs.count(B, k) < 3
                            or (k + 1) / (self.optimism * t) > self.margin / t0):
            first, longest = self._recheck_gaps(B, k)
            if self._due(None, longest, first):
                return k
        return None

    def _recheck_k(self, B: int, max_k: int) -> int:
        """K of an acceptance re-check while paused: 1 where K=1 can pay; where only deeper
        drafts can (a dear verify pass: the real shape's c_verify(1) = 1.88 plain steps,
        K=3 4/2.99), up to one past the positions that landed lately, the K whose upper
        estimate pays best: a head that keeps landing climbs to the depth that pays, one
        that does not land re-checks one position."""
        if self._could_pay(B, 1):
            return 1
        deepest = max(1, min(max_k, self.acceptance.landed_depth() + 1))

        def rate(k):  # at the upper estimate: what the re-check could show
            t = self.costs.predict(B, k)
            return math.inf if t is None else self._expected(k, None, optimistic=True) / t
        return max(range(1, deepest + 1), key=lambda k: (rate(k), k))

    def _could_pay(self, B: int, max_k: int = MAX_DRAFT_TOKENS) -> bool:
        """Whether drafting at some K up to ``max_k`` measured at B rows would beat plain
        steps if every draft landed."""
        t0 = self.costs.predict(B, 0)
        return t0 is not None and any(
            t is not None and (k + 1) / t > self.margin / t0
            for k in range(1, max_k + 1) for t in [self.costs.predict(B, k)])

    def _recheck_gaps(self, B: int, k: int = 1) -> Tuple[int, int]:
        """The first and the longest interval between acceptance re-checks of K=k while
        paused. A re-check costs ``t(B, k) / t(B, 0) - 1`` plain steps; the intervals
        double up to where one per interval stays within ``probe_budget``. Where only
        drafts deeper than one can pay and none has landed yet, the first comes after ten
        times that many steps (the real shape's K=1 re-check, 0.97 plain steps more than a
        plain one, after 10 steps, not 4: a never-right head keeps more of plain speed)."""
        first, shortest, longest = self.recheck_gap
        t0, t = self.costs.predict(B, 0), self.costs.predict(B, k)
        if not t0 or t is None:
            return first, longest
        extra = max(t / t0 - 1.0, 0.0)
        if not self._landed_once and not self._could_pay(B, 1):
            first = max(first, min(shortest, math.ceil(10 * extra)))
        return first, max(shortest, min(longest, math.ceil(extra / self.probe_budget)))

    def _due(self, key, longest: Optional[int] = None, first: Optional[int] = None) -> bool:
        """Count down the probe interval of ``key`` (starting at ``first``); True (and
        double it, up to ``longest``) when it ends."""
        start, cap = (self.recheck_gap[0], self.recheck_gap[2]) if key is None else self.probe_gap
        first = start if first is None else first
        longest = cap if longest is None else longest
        gap, wait = self._gaps.get(key, (first, first))
        wait -= 1
        if wait <= 0:
            gap = min(2 * gap, longest)
            wait = gap
        self._gaps[key] = (gap, wait)
        return wait == gap

    def describe(self, B: int, max_k: int) -> str:
        """One log line: the choice at batch size B (up to ``max_k``) and what it rests on."""
        if not self.adaptive or max_k == 0:
            return f"K={max_k} (fixed)"
        parts = []
        for k in range(max_k + 1):
            t = self.costs.predict(B, k)
            n = self.costs.count(B, k)
            parts.append("?" if t is None else f"{1e3 * t:.1f}" + ("" if n >= 3 else "~"))
        gains = " ".join(f"{self._expected(k, None):.2f}" for k in range(1, max_k + 1))
        return (f"batch {B}: K={self._decide(B, max_k)}; step ms by K=0..{max_k}: "
                f"{' '.join(parts)} (~ fitted); tokens/row by K=1..: {gains}")


def needs_schedule(params) -> bool:
    """The rule for seeded requests (module docstring): a seeded row sampled with
    independent drafts takes its K from its own ``SeededSchedule``."""
    return params.seed is not None and not params.greedy and not params.coupled


class SeededSchedule:
    """K per step for one seeded row, from its own acceptance and a fixed cost model.

    The modelled rate of K is ``E_K / (1 + draft_cost * K)`` (a step that drafts K
    costs ``1 + draft_cost * K`` plain steps). When plain decoding wins, K=1 is
    re-tried after a pause that doubles each time, so a useless head costs little.
    Deterministic: the same request takes the same K at every step.
    """

    def __init__(self, adaptive: bool = True, draft_cost: float = 0.35,
                 margin: float = 1.05, probe_gap: Tuple[int, int] = (4, 256)):
        self.adaptive = adaptive
        self.draft_cost, self.margin = draft_cost, margin
        self.acceptance = AcceptanceEstimate(MAX_DRAFT_TOKENS, forget=0.9)
        self.probe_gap = probe_gap
        self._gap = self._wait = probe_gap[0]

    def next_k(self, max_k: int) -> int:
        """K for the row's next step, up to its cap ``max_k``."""
        if not self.adaptive:
            return max_k
        rates = [self.acceptance.expected_tokens(k) / (1 + self.draft_cost * k)
                 for k in range(max_k + 1)]
        best = max(range(max_k + 1), key=lambda k: rates[k])
        if best and rates[best] >= self.margin:
            self._gap = self._wait = self.probe_gap[0]
            return best
        self._wait -= 1
        if self._wait > 0:
            return 0
        self._gap = min(2 * self._gap, self.probe_gap[1])
        self._wait = self._gap
        return 1

    def record(self, k: int, n_accepted: int):
        self.acceptance.record(k, [n_accepted])
