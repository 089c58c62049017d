"""Per-layer caches with exact rollback, all speaking one protocol (``kv.py``'s doc).

Importing any of them imports them all, so ``kv.CACHE_KINDS`` names every kind: a new
kind is a module here that registers itself, listed below.
"""

from . import chain, index, kv, recurrent, window  # noqa: F401  (each registers its kinds)
