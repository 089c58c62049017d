"""Decoding: sampling, the speculative step, the draft policy, statistics, text streams.

This package's ``__init__`` stays free of MLX imports (the CLI reads the limits below
before the platform is set up).
"""

from ..drafters.registry import SOURCES

MAX_DRAFT_TOKENS = 8  # K range everywhere: 0 (plain decoding) .. 8
# Where a row's drafts come from (draft_source.py): the values of the drafters' registry,
# a live view (a source registered there is accepted here too).
DRAFT_SOURCES = SOURCES.keys()


def check_num_draft_tokens(k, name: str = "num_draft_tokens") -> int:
    """The one range check for K; raises ValueError with a message for users."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{name} must be between 0 and {MAX_DRAFT_TOKENS} (got {k!r})")
    return k


def check_draft_source(value, name: str = "draft_source") -> str:
    """The one check of a draft-source value; raises ValueError with a message for users."""
    if value not in DRAFT_SOURCES:
        raise ValueError(f"{name} must be one of {', '.join(DRAFT_SOURCES)} (got {value!r})")
    return value
