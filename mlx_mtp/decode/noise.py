"""Sampling noise as a function of (seed, output position, stream).

A request's randomness is not a stream that each draw advances: the noise for
the token at output position ``p`` is derived from ``(seed, p)`` alone. So the
tokens of a seeded request do not depend on how many draws earlier steps made,
i.e. on the K the draft policy chose or on the other rows of a batch.

Three independent streams per position:

* ``TARGET``: Gumbel noise over the vocabulary for the token the target emits
  (plain sampling, the bonus token, the recovered token, coupled verification);
* ``DRAFT``: Gumbel noise for the MTP draft (independent drafting);
* ``ACCEPT``: the uniform of the acceptance test.

Keys are mixed on the host (SplitMix64, a few integer operations per row and
position); the per-token noise is a counter-based hash evaluated on the device,
one elementwise graph for every row and position of a step.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

TARGET, DRAFT, ACCEPT = 0, 1, 2

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_keys(seeds: Sequence[int], starts: Sequence[int], count: int, stream: int) -> mx.array:
    """Keys (B, count, 2) uint32 for positions ``starts[b] .. starts[b] + count - 1``."""
    rows = []
    for seed, start in zip(seeds, starts):
        base = _splitmix64((seed & _MASK64) ^ _splitmix64(stream))
        row = []
        for p in range(start, start + count):
            h = _splitmix64(base ^ _splitmix64(p + (stream << 48)))
            row.append((h & 0xFFFFFFFF, h >> 32))
        rows.append(row)
    return mx.array(rows, mx.uint32).reshape(len(rows), count, 2)


def _fmix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


def _uniform(keys: mx.array, counter: mx.array) -> mx.array:
    """Uniforms in (0, 1) for every key (..., 2) and counter (n,) -> (..., n)."""
    x = _fmix32((counter * 0x9E3779B9) ^ keys[..., 0:1])
    x = _fmix32(x + keys[..., 1:2])
    # 23 bits + 1/2: strictly inside (0, 1) in float32 (1 - 2**-24 is representable).
    return ((x >> 9).astype(mx.float32) + 0.5) * (2.0**-23)


def gumbel(keys: mx.array, vocab_size: int) -> mx.array:
    """Standard Gumbel noise (B, P, V) for keys (B, P, 2)."""
    u = _uniform(keys, mx.arange(vocab_size, dtype=mx.uint32))
    return -mx.log(-mx.log(u))


def uniform(keys: mx.array) -> mx.array:
    """One uniform in (0, 1) per key: (B, P) for keys (B, P, 2)."""
    return _uniform(keys, mx.zeros((1,), mx.uint32))[..., 0]
