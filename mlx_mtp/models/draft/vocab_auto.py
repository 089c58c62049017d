"""The default draft vocabulary: a shipped ranking for known tokenizers, sized by the cost
model, re-sized at run time from the tokens the model really emits.

Used by ``--draft-vocab auto`` when no ``draft_vocab.json`` is beside the model. The ranking
(``assets/draft-vocab/<name>.npy``, token ids most frequent first; ``<name>.json``: the
BPE vocabulary's hash and the ranking's coverage of held-out text, built by
``scripts/build_draft_ranking.py``) applies only to a tokenizer.json whose BPE vocabulary
hashes the same.

Cost model (plain-step units, one speculative step of ``K`` drafts):

    speed(N) = E_K(a * coverage(N)) / (c_verify(K) + K * (c_block + c_output * N / V))

A draft of a token outside the N kept rows is always rejected, so acceptance scales by the
share of emitted tokens inside them (coverage); the output layer's share of a draft shrinks
by N / V. The shares start from the bytes each part reads (``draft_shares``); once the
step-cost table (``decode/costs.py``, the driver's) has timed K-draft steps against plain
ones, they are scaled so the model's step cost at the current size is the measured one. The size with the best speed is kept when it beats the whole vocabulary by
``MARGIN``, else drafts keep the whole vocabulary. ``DraftVocabTuner`` recomputes coverage from
the tokens emitted (each is the target's token at its position; the shipped figure is a prior
worth ``PRIOR_TOKENS``) and widens, narrows or drops the subset when the best size changes.

It re-sizes on evidence. A rejected draft whose target token lies outside the subset is a
draft the subset lost (no draft from it could have landed there): the driver hands over the
target token of every rejected head position (host-side ids the step already read), and a
step that lost one re-sizes at once, so a subset too small for the text loses a few drafts,
not one per step for ``CHECK_EVERY`` tokens. Other steps re-size every ``CHECK_EVERY``
tokens; narrowing also needs the last ``NARROW_RUN`` emitted tokens all inside the smaller
size, so a subset widened on evidence is not narrowed back on the prior.
Output never changes (``draft_vocab.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import numpy as np
from mlx.utils import tree_flatten

from .vocab import vocab_hash

ASSETS = Path(__file__).parents[2] / "assets" / "draft-vocab"
# Typical per-position acceptance of a trained MTP head and K, for sizing only (the
# acceptance cancels out of which N is best to first order; it sets how much to gain).
ACCEPTANCE, K, VERIFY_PER_DRAFT = 0.8, 3, 0.35
MARGIN = 0.02  # a subset must promise this much over the whole vocabulary
PRIOR_TOKENS = 8  # weight of the shipped coverage against tokens seen: lost drafts move it
CHECK_EVERY = 128  # emitted tokens between re-sizing decisions without a lost draft
NARROW_RUN = 256  # emitted tokens in a row inside a smaller size before narrowing to it
MEMORY = 4096  # counts are halved past this many tokens: recent text weighs most


@dataclass(frozen=True)
class Ranking:
    ids: np.ndarray  # token ids, most frequent first
    coverage: Dict[int, float]  # subset size -> share of held-out tokens inside it
    name: str


@dataclass(frozen=True)
class DraftShares:
    """A speculative step's parts in plain decoding steps."""

    block: float  # the MTP block (fc, decoder layer(s), norm)
    output: float  # the whole output layer
    vocab_size: int
    verify_per_draft: float = VERIFY_PER_DRAFT  # a verify pass's extra cost per position

    def draft(self, size: Optional[int]) -> float:
        """One draft over ``size`` rows of the output layer (None: all of them)."""
        n = self.vocab_size if size is None else min(size, self.vocab_size)
        return self.block + self.output * n / self.vocab_size

    def measured(self, table, size: Optional[int], min_steps: int = 3) -> "DraftShares":
        """These shares scaled so that a K-draft step at ``size`` costs what ``table``
        (the one step-cost table) measured against a plain step, one row; unchanged until
        both are measured."""
        plain, step = table.predict(1, 0), table.predict(1, K)
        if not plain or not step or table.count(1, K) < min_steps:
            return self
        scale = max(step / plain - 1.0, 0.0) / (K * (self.verify_per_draft + self.draft(size)))
        return DraftShares(self.block * scale, self.output * scale, self.vocab_size,
                           self.verify_per_draft * scale)


def _bytes(module, scale=lambda key: 1.0) -> float:
    """Bytes read per token: not the embedding table (one row of it), routed experts scaled."""
    return sum(v.nbytes * scale(k) for k, v in tree_flatten(module.parameters())
               if not k.startswith("embed_tokens"))


def draft_shares(model) -> DraftShares:
    """A draft's parts from the bytes each reads (before any step is timed)."""
    text = model.text
    args = text.args
    head = text.model.embed_tokens if args.tie_word_embeddings else text.lm_head
    out = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    active = (getattr(args, "num_experts_per_tok", 0) or 1) / (getattr(args, "num_experts", 0) or 1)

    def expert_share(key):  # MoE: only the routed experts' rows are read
        return active if "switch_mlp" in key else 1.0

    trunk = _bytes(text.model, expert_share)
    block = _bytes(text.mtp, expert_share) if "mtp" in text else 0.0
    plain = trunk + out  # text.model: the trunk without embedding or output layer
    return DraftShares(block / plain, out / plain, args.vocab_size)


def expected_speed(costs: DraftShares, size: int, coverage: float) -> float:
    a = ACCEPTANCE * coverage
    tokens = sum(a ** j for j in range(K + 1))
    return tokens / (1 + costs.verify_per_draft * K + K * costs.draft(size))


def best_size(costs: DraftShares, coverage: Dict[int, float]) -> Optional[int]:
    """The subset size the cost model prefers (None: the whole vocabulary)."""
    options = {n: c for n, c in coverage.items() if n < costs.vocab_size}
    if not options:
        return None
    best = max(options, key=lambda n: expected_speed(costs, n, options[n]))
    whole = expected_speed(costs, costs.vocab_size, 1.0)
    return best if expected_speed(costs, best, options[best]) > whole * (1 + MARGIN) else None


def tokenizer_vocab_hash(model_dir) -> Optional[str]:
    """``vocab_hash`` of the BPE vocabulary in ``model_dir/tokenizer.json`` (None: none)."""
    f = Path(model_dir) / "tokenizer.json"
    try:
        vocab = json.loads(f.read_text())["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if [vocab[t] for t in (tokens[0], tokens[-1])] != [0, len(tokens) - 1]:
        return None  # not one contiguous id range
    return vocab_hash(tokens)


def shipped_ranking(model_dir, vocab_size: int) -> Optional[Ranking]:
    """The shipped ranking for the model's tokenizer, if one matches."""
    metas = []
    for f in sorted(ASSETS.glob("*.json")):
        meta = json.loads(f.read_text())
        if meta.get("bpe_tokens", vocab_size + 1) <= vocab_size:
            metas.append((f, meta))
    if not metas:  # cheap exit before reading a large tokenizer.json
        return None
    digest = tokenizer_vocab_hash(model_dir)
    for f, meta in metas:
        if meta["vocab_hash"] == digest:
            ids = np.load(f.with_suffix(".npy")).astype(np.int64)
            coverage = {int(n): float(c) for n, c in meta["coverage"].items()}
            return Ranking(ids[ids < vocab_size], coverage, f.stem)
    return None


class DraftVocabTuner:
    """Keeps the model's draft vocabulary at the size the cost model prefers for the
    tokens it actually emits (``observe``: every step's tokens, the target's tokens where
    head drafts were rejected, and the driver's step-cost table)."""

    def __init__(self, model, ranking: Ranking, bits: Optional[int] = None):
        self.model, self.ranking, self.bits = model, ranking, bits
        self.costs = draft_shares(model)
        self.sizes = np.array(sorted(n for n in ranking.coverage if n <= ranking.ids.size))
        self.prior = np.array([ranking.coverage[n] for n in self.sizes])
        self.rank = np.full(self.costs.vocab_size, ranking.ids.size, np.int64)
        self.rank[ranking.ids] = np.arange(ranking.ids.size)
        self.seen, self.inside, self._since = 0.0, np.zeros(self.sizes.size), 0
        self.run = np.zeros(self.sizes.size, np.int64)  # tokens in a row inside each size
        self.size: Optional[int] = None  # the head as apply_model_options left it
        self.changes = 0
        self.lost = 0  # rejected drafts whose target lay outside the subset
        self._apply(best_size(self.costs, self.coverage()))

    def coverage(self) -> Dict[int, float]:
        share = (self.inside + PRIOR_TOKENS * self.prior) / (self.seen + PRIOR_TOKENS)
        return dict(zip(self.sizes.tolist(), share.tolist()))

    def observe(self, tokens, table=None, rejected=()) -> np.ndarray:
        """A step's emitted ``tokens`` (in order) and the target's tokens at its rejected
        head positions (``rejected``: each is one of ``tokens``); ``table``: the driver's
        step-cost table. Returns which of ``rejected`` the subset lost (outside it)."""
        ranks = self.rank[np.asarray(tokens, np.int64)]
        inside = ranks[:, None] < self.sizes[None]  # (tokens, sizes)
        self.inside += inside.sum(axis=0)
        self.seen += ranks.size
        self._since += ranks.size
        out = ~inside[::-1]  # newest first: the run since the last token outside each size
        self.run = np.where(out.any(axis=0), out.argmax(axis=0), self.run + ranks.size)
        lost = self.rank[np.asarray(rejected, np.int64)] >= self._limit()
        self.lost += int(lost.sum())
        if self._since < CHECK_EVERY and not lost.any():
            return lost
        self._since = 0
        costs = self.costs if table is None else self.costs.measured(table, self.size)
        self._apply(self._narrowed(best_size(costs, self.coverage())))
        if self.seen > MEMORY:
            self.seen, self.inside = self.seen / 2, self.inside / 2
        return lost

    def _limit(self) -> int:
        return self.costs.vocab_size if self.size is None else self.size

    def _narrowed(self, size: Optional[int]) -> Optional[int]:
        """``size``, or the current one when ``size`` narrows it and the last
        ``NARROW_RUN`` tokens were not all inside ``size``."""
        if size is None or size >= self._limit():
            return size
        return size if self.run[self.sizes.tolist().index(size)] >= NARROW_RUN else self.size

    def _apply(self, size: Optional[int]):
        if size == self.size:
            return
        vocab = None if size is None else np.sort(self.ranking.ids[:size])
        self.model.set_draft_head(self.bits, vocab=vocab)
        self.size, self.changes = size, self.changes + 1

    def describe(self) -> str:
        used = "whole vocabulary" if self.size is None else f"{self.size} tokens"
        return f"{used} (shipped {self.ranking.name} ranking, sized by the cost model)"


def install(model, model_dir, bits: Optional[int] = None) -> Optional[DraftVocabTuner]:
    """Draft from the shipped ranking's best subset, re-sized as text is emitted; the tuner
    is ``model.draft_vocab_tuner`` (None, and the model unchanged, without a match)."""
    ranking = shipped_ranking(model_dir, model.text.args.vocab_size)
    tuner = None if ranking is None else DraftVocabTuner(model, ranking, bits)
    model.use_draft_vocab_tuner(tuner)
    return tuner
