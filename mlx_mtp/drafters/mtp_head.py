"""The checkpoint's MTP head as a draft source: declared here, chained in the step.

The head drafts for every row that uses it in one batched chain of ``J`` passes (the
longest such row's drafts): its first pass writes the MTP pairs each row owes, later
ones feed it its own output and the previous draft (a row drafter's token where that
row has one). Each pass draws through the step's own machinery: the per-position logit
transforms (penalties, grammar masks, also applied to verify row ``j``), the per-group
filters and the Gumbel noise streams keyed by output position, which coupled drafts
share with the target. Those live in ``decode/`` (``sampling.py``, ``noise.py``,
``logits.py``), so the chain runs there (``decode/step.py``, ``DecodeBatch._draft_head``):
moving it here would make this package import ``decode/`` back, or hand all of them
over one by one. What the step and the chooser need to know of the head is below.
"""

from .base import HEAD_PASSES


class MtpHead:
    """Declaration of the head chain (the fields of ``base.Drafter``)."""

    name = "mtp"  # its key in the registry and in acceptance estimates (per chain depth)
    cost = HEAD_PASSES  # one head pass per position it chains through
    deterministic = False  # its drafts are drawn from its own q (verify takes q, (B, J, V))
    needs_taps = False  # it reads the trunk's MTP hidden (``model.trunk``), not taps
