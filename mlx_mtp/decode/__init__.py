"""Decoding: sampling, the speculative step, the draft policy, statistics, text streams.

This package's ``__init__`` stays free of MLX imports (the CLI reads the limits below
before the platform is set up).
"""

MAX_DRAFT_TOKENS = 8  # K range everywhere: 0 (plain decoding) .. 8


def check_num_draft_tokens(k, name: str = "num_draft_tokens") -> int:
    """The one range check for K; raises ValueError with a message for users."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{name} must be between 0 and {MAX_DRAFT_TOKENS} (got {k!r})")
    return k
