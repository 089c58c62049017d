"""Draft sources behind one small interface (``base.Drafter``), named in one registry.

* ``base.py``: ``Drafter`` (what the step asks of a source and tells it), ``DraftPlan``
  (one row's drafts for a step) and the cost kinds the chooser prices.
* ``mtp_head.py``: the checkpoint's MTP head, one batched chain for the rows that use
  it; it draws through the step's ``draw`` (``decode/step.py``: position transforms,
  group filters, noise streams), so its draws are the step's whichever source asks.
* ``lookup.py``: context lookup, an n-gram index over the row's tokens.
* ``registry.py``: each draft-source value (``--draft-source``, a request's
  ``draft_source``) and what it runs: a row drafter, the head, or both.

The per-row choice between them lives with the decoder (``decode/draft_source.py``);
it asks the registry and the sources, never names them. ``registry`` and what it
imports load no MLX (the CLI reads the source values before the platform is set up);
nothing here imports ``decode/``.
"""
