"""Quantized key/value caches (``--kv-bits``), with exact rollback.

Keys and values are stored as MLX's quantized triples ``(packed, scales, biases)``
(``mx.quantize`` over the head dimension, ``group_size`` values per scale), the form
mlx-lm's attention reads through ``mx.quantized_matmul``: its
``scaled_dot_product_attention`` takes that path for any cache with ``bits``.

Each position is quantized on its own (groups run along the head dimension), so a
position's stored triple does not depend on what was written beside it or when:
rolling back rejected drafts is the same pointer move (or mask) as in ``kv.py``, and
what stays is bit for bit what a plain decode writes.

``KVQuantization.start`` is mlx-lm's ``quantized_kv_start``: a single-row cache holds
full precision until it holds ``start`` tokens, then every later forward attends over
the quantized form (mlx-lm converts after the forward that reaches ``start``; so do
we, at the next write; at ``start`` 0 every write is quantized, where mlx-lm runs its
first forward in full precision). A batch is always quantized: its rows switch together, so
``start`` > 0 is single-row only (``check_batchable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from .kv import CACHE_KINDS, BatchKVCache, KVCache
from .slots import first_after_write, squeeze_index


@dataclass(frozen=True)
class KVQuantization:
    """How attention caches are quantized (``--kv-bits``, ``--kv-group-size``,
    ``--quantized-kv-start``)."""

    bits: int
    group_size: int = 64
    start: int = 0  # tokens held in full precision before the switch

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"--kv-bits must be 4 or 8 (got {self.bits})")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size must be 32, 64 or 128 (got {self.group_size})")
        if self.start < 0:
            raise ValueError(f"--quantized-kv-start must be >= 0 (got {self.start})")

    def check_head_dim(self, head_dim: int):
        if head_dim % self.group_size:
            raise ValueError(f"--kv-group-size {self.group_size} does not divide the attention "
                             f"head size {head_dim}")

    def check_batchable(self):
        if self.start:
            raise ValueError("--quantized-kv-start applies to one sequence: batched rows "
                             "switch together, so a batch is quantized from its first token")

    def meta(self) -> tuple:
        return str(self.bits), str(self.group_size), str(self.start)

    @classmethod
    def from_meta(cls, v) -> "KVQuantization":
        return cls(*(int(x) for x in v))

    def quantize(self, x: mx.array) -> tuple:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def zeros(self, B: int, H: int, L: int, D: int, dtype) -> tuple:
        """The quantized triple of ``L`` zero positions (room to write into)."""
        return self.quantize(mx.zeros((B, H, L, D), dtype))


def _cut(q, start: int, stop: int):
    return tree_map(lambda a: a[..., start:stop, :], q)


def _cat(parts, axis: int = 2):
    return tuple(mx.concatenate(list(xs), axis=axis) for xs in zip(*parts))


def _groups(q) -> int:
    """Quantization groups per position of a triple (head size / ``group_size``)."""
    return q[1].shape[-1]


class QuantizedKVCache(KVCache):
    """``KVCache`` for one row whose keys and values are quantized triples (after ``start``
    tokens in full precision)."""

    kind = "quantized_kv"
    state_names = ("k", "k_scales", "k_biases", "v", "v_scales", "v_biases")

    def __init__(self, quant: Optional[KVQuantization] = None):
        super().__init__()
        self.quant = quant  # None only between ``from_state``'s empty() and meta_state

    @property
    def quantized(self) -> bool:
        return isinstance(self.keys, tuple)

    @property
    def bits(self) -> int:
        # mlx-lm's attention reads quantized triples iff ``hasattr(cache, "bits")``.
        if not self.quantized:
            raise AttributeError("bits: the cache still holds full precision")
        return self.quant.bits

    @property
    def group_size(self) -> int:
        return self.quant.group_size

    def _switch(self):
        """Quantize what is held (full precision until ``start`` tokens)."""
        if self.keys is None:
            self.keys = self.values = ()
        else:
            n = self.offset
            self.keys = self.quant.quantize(self.keys[..., :n, :])
            self.values = self.quant.quantize(self.values[..., :n, :])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if not self.quantized and self.offset >= self.quant.start:
            self._switch()
        if not self.quantized:
            return super().update_and_fetch(keys, values)
        prev, n = self.offset, keys.shape[2]
        if not self.keys or prev + n > self.keys[0].shape[2]:
            B, H, _, Dk = keys.shape
            room = ((n + self.step - 1) // self.step) * self.step
            new_k = self.quant.zeros(B, H, room, Dk, keys.dtype)
            new_v = self.quant.zeros(B, H, room, values.shape[3], values.dtype)
            self.keys = _cat([_cut(self.keys, 0, prev), new_k]) if self.keys else new_k
            self.values = _cat([_cut(self.values, 0, prev), new_v]) if self.values else new_v
        for held, new in ((self.keys, self.quant.quantize(keys)),
                          (self.values, self.quant.quantize(values))):
            for a, x in zip(held, new):
                a[..., prev : prev + n, :] = x
        self.offset += n
        self.last_write = n
        return _cut(self.keys, 0, self.offset), _cut(self.values, 0, self.offset)

    @property
    def state(self):
        """The six arrays of ``state_names``; before the switch, the full-precision keys and
        values in the ``k`` and ``v`` places (and no scales or biases)."""
        if self.keys is None or (self.quantized and not self.keys):  # (): switched, empty
            return (None,) * 6
        if not self.quantized:
            k, v = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
            return k, None, None, v, None, None
        return (*_cut(self.keys, 0, self.offset), *_cut(self.values, 0, self.offset))

    @state.setter
    def state(self, v):
        if v[1] is None:
            self.keys, self.values = v[0], v[3]
        else:
            self.keys, self.values = tuple(v[:3]), tuple(v[3:])
        self.offset = v[0].shape[2]

    @property
    def meta_state(self):
        return (str(self.offset), *self.quant.meta())

    @meta_state.setter
    def meta_state(self, v):
        self.quant = KVQuantization.from_meta(v[1:])
        offset = int(v[0])
        k, _, _, values, _, _ = self.state
        held = 0 if k is None else k.shape[2]
        if held != offset or (k is not None and values.shape[2] != offset):
            raise ValueError(f"KV length {held} != offset {offset}")

    def settings(self) -> tuple:
        return self.quant.meta()

    @property
    def quantization(self) -> KVQuantization:
        return self.quant

    def snapshot(self):
        # Writes land past ``offset``; growing and the switch make new objects.
        return self.keys, self.values, self.offset

    def restore(self, snap):
        self.keys, self.values, self.offset = snap

    @classmethod
    def merge(cls, caches) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:  # the whole buffer
        if self.keys is None:
            return 0
        held = (self.keys, self.values) if self.quantized else ((self.keys,), (self.values,))
        return sum(a.nbytes for q in held for a in q)

    def _like(self) -> "QuantizedKVCache":
        return type(self)(self.quant)

    def copy(self) -> "QuantizedKVCache":
        c = self._like()
        if self.quantized:
            c.keys, c.values = (tuple(mx.array(a) for a in q) for q in (self.keys, self.values))
        elif self.keys is not None:
            c.keys, c.values = mx.array(self.keys), mx.array(self.values)
        c.offset = self.offset
        return c


def draft_room(caches) -> Optional[int]:
    """Positions one row may draft now without its verify pass crossing a cache's switch to
    quantized form (plain decoding attends over the quantized form from position ``start``
    on, a pass's rows all in one form); None: no limit."""
    rooms = [c.quant.start - 1 - c.offset for c in caches
             if isinstance(c, QuantizedKVCache) and not c.quantized]
    return max(0, min(rooms)) if rooms else None


class BatchQuantizedKVCache(BatchKVCache):
    """``BatchKVCache`` (rows of different lengths, per-row holes) over quantized triples;
    quantized from the first token (``KVQuantization.check_batchable``)."""

    kind = "batch_quantized_kv"
    row_kind = QuantizedKVCache.kind
    state_names = (*QuantizedKVCache.state_names, "valid")

    def __init__(self, pos: List[int], keys=None, values=None, valid=None,
                 quant: Optional[KVQuantization] = None):
        super().__init__(pos, None, None, valid)
        self.keys, self.values = keys, values  # quantized triples, or None while empty
        self.idx = keys[0].shape[2] if keys is not None else 0
        self.quant = quant

    @property
    def bits(self) -> int:  # mlx-lm's attention: quantized triples (see QuantizedKVCache)
        return self.quant.bits

    @property
    def group_size(self) -> int:
        return self.quant.group_size

    def _capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    @property
    def state(self):
        if self.keys is None:
            return (None,) * 7
        i = self.idx
        return (*_cut(self.keys, 0, i), *_cut(self.values, 0, i), self.valid[:, :i])

    @state.setter
    def state(self, v):
        self.keys, self.values, self.valid = tuple(v[:3]), tuple(v[3:6]), v[6]
        self.idx = self.keys[0].shape[2]
        self.first = None  # until the buffer next grows

    @property
    def meta_state(self):
        return (*self.quant.meta(), *(str(p) for p in self.pos))

    @meta_state.setter
    def meta_state(self, v):
        self.quant = KVQuantization.from_meta(v[:3])
        self.pos = [int(p) for p in v[3:]]

    def settings(self) -> tuple:
        return self.quant.meta()

    @property
    def quantization(self) -> KVQuantization:
        return self.quant

    def arrays(self) -> List[mx.array]:
        return [a for a in self.state if a is not None]

    @classmethod
    def merge(cls, caches) -> "BatchQuantizedKVCache":
        """The rows of single-row and batch caches, in order, in one new batch cache."""
        out = None
        for c in caches:
            b = cls.from_single(c) if isinstance(c, QuantizedKVCache) else c._share()
            if out is None:
                out = b
            else:
                out.extend(b)
        return out

    @classmethod
    def from_single(cls, c: QuantizedKVCache) -> "BatchQuantizedKVCache":
        c.quant.check_batchable()
        if not c.quantized or not c.keys:
            return cls([c.offset], quant=c.quant)
        n = c.offset
        valid = mx.ones((1, n), mx.bool_)
        return cls([n], _cut(c.keys, 0, n), _cut(c.values, 0, n), valid, c.quant)

    def _share(self) -> "BatchQuantizedKVCache":
        c = type(self)(self.pos, self.keys, self.values, self.valid, self.quant)
        c.idx, c.first = self.idx, self.first
        return c

    def extract(self, row: int) -> QuantizedKVCache:
        c = CACHE_KINDS[self.row_kind](self.quant)
        if self.keys is not None:
            c.state = self.row_state(row)
        c.offset = self.pos[row]
        return c

    def row_state(self, b: int):
        """Row ``b``'s valid positions, in order: ``QuantizedKVCache.state``'s six arrays."""
        m = np.array(self.valid[b, : self.idx])
        ix = mx.array(np.nonzero(m)[0].astype(np.int32))
        return tuple(a[b : b + 1][:, :, ix] for q in (self.keys, self.values) for a in q)

    def prepare(self, S: int, lengths: Optional[List[int]] = None):
        self._S, self._lengths = S, lengths
        if self.keys is not None and self.idx + S > self._capacity():
            self._grow(S)

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if self.keys is None:
            B, H, _, D = keys.shape
            self.keys = self.quant.zeros(B, H, 0, D, keys.dtype)
            self.values = self.quant.zeros(B, H, 0, values.shape[3], values.dtype)
            self.valid = mx.zeros((B, 0), mx.bool_)
        if self.idx + S > self._capacity():
            self._grow(S)  # first write; later growth happens in prepare()
        for held, new in ((self.keys, self.quant.quantize(keys)),
                          (self.values, self.quant.quantize(values))):
            for a, x in zip(held, new):
                a[..., self.idx : self.idx + S, :] = x
        self.valid[:, self.idx : self.idx + S] = self._new_valid()
        self.first = first_after_write(self, S)
        self.idx += S
        self.last_write = S
        self.pos = [p + n for p, n in zip(self.pos, self.chunk_lengths(S))]
        return _cut(self.keys, 0, self.idx), _cut(self.values, 0, self.idx)

    def _grow(self, S: int):
        """Squeeze out holes (left-pad to the longest row), then add room."""
        gather, new_valid, L, self.first = squeeze_index(self.valid, self.idx)
        room = ((S + self.step - 1) // self.step) * self.step
        B, H = len(self.pos), self.keys[0].shape[1]

        def regrown(q, dtype):
            kept = tree_map(lambda a: mx.take_along_axis(a[..., : self.idx, :], gather, axis=2), q)
            D = _groups(q) * self.quant.group_size
            return _cat([kept, self.quant.zeros(B, H, room, D, dtype)])

        self.keys = regrown(self.keys, self.keys[1].dtype)
        self.values = regrown(self.values, self.values[1].dtype)
        self.valid = mx.concatenate([new_valid, mx.zeros((B, room), mx.bool_)], axis=1)
        self.idx = L

    def _padded(self, L: int, like: "BatchQuantizedKVCache"):
        B = len(self.pos)
        src = self if self.keys is not None else like
        H, p = src.keys[0].shape[1], L - self.idx

        def pad(q):
            return self.quant.zeros(B, H, p, _groups(q) * self.quant.group_size, q[1].dtype)

        k, v, m = pad(src.keys), pad(src.values), mx.zeros((B, p), mx.bool_)
        if self.keys is not None:
            k = _cat([k, _cut(self.keys, 0, self.idx)])
            v = _cat([v, _cut(self.values, 0, self.idx)])
            m = mx.concatenate([m, self.valid[:, : self.idx]], axis=1)
        return k, v, m

    @property
    def nbytes(self) -> int:  # the whole buffer
        if self.keys is None:
            return 0
        return sum(a.nbytes for q in (self.keys, self.values) for a in q) + self.valid.nbytes

    def copy(self) -> "BatchQuantizedKVCache":
        c = self._share()
        if self.keys is not None:
            c.keys, c.values = (tuple(mx.array(a) for a in q) for q in (self.keys, self.values))
            c.valid = mx.array(self.valid)
        return c


CACHE_KINDS.update({c.kind: c for c in (QuantizedKVCache, BatchQuantizedKVCache)})
