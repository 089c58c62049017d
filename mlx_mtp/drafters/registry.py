"""Every draft-source value (``--draft-source``, a request's ``draft_source``) and what
it runs for a row. ``decode.DRAFT_SOURCES`` is a view of ``SOURCES``: a value registered
here is accepted everywhere. Adding a row drafter: its module in this package and one
``register`` line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Type

from .base import HEAD, Drafter
from .block_source import BlockSource
from .lookup import LookupIndex


@dataclass(frozen=True)
class Source:
    """What a draft-source value runs: the row's drafter (built as ``drafter(settings)``
    from the decoder's drafter settings, ``lookup.LookupSettings``; None: none) and
    whether the head drafts too (alone, or after the drafter's run where that ends)."""

    drafter: Optional[Type[Drafter]]
    head: bool

    @property
    def capped_by_k(self) -> bool:
        """K caps its drafts per step: the head's, or a block drafter's (``needs_taps``)."""
        return self.head or (self.drafter is not None and self.drafter.needs_taps)


SOURCES: Dict[str, Source] = {}


def register(name: str, drafter: Optional[Type[Drafter]], head: bool):
    SOURCES[name] = Source(drafter, head)


register(HEAD, None, head=True)  # "mtp": the head alone
register(LookupIndex.name, LookupIndex, head=False)  # "lookup": the context alone
register("both", LookupIndex, head=True)  # per row and step, the chooser picks
register(BlockSource.name, BlockSource, head=False)  # "block": the model's block drafter
register("block+mtp", BlockSource, head=True)  # its block, extended by the head past it
