"""DeepSeek-V4's layer cache with ``--kv-bits``: the window's keys (K = V) and the compressed
entries of each series (the compressor's, CSA's indexer's keys) held as ``mx.quantize``
triples; the raw projections a series keeps to build its next entries (the compressors'
running state, at most two windows of rows) stay in their precision.

Each key and each entry is quantized on its own (groups run along its last dimension), so
what a position or an entry stores does not depend on what was written beside it or when:
``accept`` rebuilds the kept prefix by slicing as ``compressed.py`` does, and a head window's
``trim`` is a slice, both leaving the cache bit for bit as plain decoding writes it. The
attention reads the window and entries dequantized (a pass's own keys and entries included,
as mlx-lm's quantized attention reads its own writes). Kind ``quantized_dsv4``; a batch keeps
its rows apart in ``CompressedRows`` as before. Quantized from the first token
(``--quantized-kv-start`` is refused by the family).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .compressed import SERIES, CompressedWindowCache, Series
from .kv import CACHE_KINDS
from .quantized import KVQuantization

QUANTIZED = ("", ".scales", ".biases")  # the parts of a quantized triple, as state names


class QuantizedCompressedWindowCache(CompressedWindowCache):
    """``CompressedWindowCache`` whose window keys and compressed entries are quantized."""

    kind = "quantized_dsv4"
    state_names = tuple(f"keys{p}" for p in QUANTIZED) + tuple(
        f"{n}.{f}" for n in SERIES for f in ("rows_kv", "rows_gate")
        + tuple(f"entries{p}" for p in QUANTIZED))

    def __init__(self, window: int = 0, ratio: int = 0, names=(), spare: int = 0,
                 quant: Optional[KVQuantization] = None):
        super().__init__(window, ratio, names, spare)
        self.quant = quant  # None only between ``from_state``'s cls() and meta_state

    @property
    def quantization(self) -> KVQuantization:
        return self.quant

    def settings(self) -> tuple:
        return super().settings() + self.quant.meta()

    def _like(self) -> "QuantizedCompressedWindowCache":
        return QuantizedCompressedWindowCache(self.window_size, self.ratio, self.names,
                                              self.spare, self.quant)

    def _stored(self, x: mx.array) -> tuple:
        return self.quant.quantize(x)

    def _read(self, held: tuple) -> mx.array:
        packed, scales, _ = held
        if packed.shape[-2] == 0:  # mx.dequantize cannot reshape an empty array
            width = scales.shape[-1] * self.quant.group_size
            return mx.zeros(packed.shape[:-1] + (width,), scales.dtype)
        return mx.dequantize(*held, group_size=self.quant.group_size, bits=self.quant.bits)

    @property
    def state(self):
        """The window's triple, then per series its raw rows and its entries' triple (a
        layer without the series: empty arrays)."""
        empty = (mx.zeros((1, 0, 0)),) * 5
        out = self.keys or (None,) * 3
        for n in SERIES:
            if n not in self.names:
                out += empty
                continue
            s = self.series[n]
            out += (s.rows_kv, s.rows_gate) + (s.entries or (None,) * 3)
        return out

    @state.setter
    def state(self, v):
        self.keys = None if v[0] is None else tuple(v[:3])
        for i, n in enumerate(SERIES):
            if n in self.names:
                rows_kv, rows_gate, *entries = v[3 + 5 * i: 8 + 5 * i]
                self.series[n] = Series(rows_kv, rows_gate,
                                        None if entries[0] is None else tuple(entries))
        self.pass_rows = self.before = None

    @property
    def meta_state(self):
        meta = CompressedWindowCache.meta_state.fget(self)
        return meta[:4] + self.quant.meta() + meta[4:]

    @meta_state.setter
    def meta_state(self, v):
        self.quant = KVQuantization.from_meta(v[4:7])
        CompressedWindowCache.meta_state.fset(self, tuple(v[:4]) + tuple(v[7:]))


CACHE_KINDS[QuantizedCompressedWindowCache.kind] = QuantizedCompressedWindowCache
