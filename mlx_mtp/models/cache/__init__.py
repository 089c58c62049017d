"""Per-layer caches with exact rollback, all speaking one protocol (``kv.py``'s doc).

Importing any of them imports them all, so ``kv.CACHE_KINDS`` names every kind: a new
kind is a module here that registers itself, listed below.
"""

from . import chain, compressed, context, index, kv, quantized  # noqa: F401  (each registers)
from . import quantized_compressed, recurrent, short, taps, window  # noqa: F401


def prepare_chunk(caches: list, S: int, lengths=None):
    """Announce the next chunk of ``S`` positions (``lengths``: each row's, right-aligned)
    to every cache (``_Cache.prepare``)."""
    for c in caches:
        c.prepare(S, lengths)
