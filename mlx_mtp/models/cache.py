"""Caches for hybrid (Gated DeltaNet + attention) models, with exact rollback.

Two kinds of per-layer state:

* ``KVCache`` for full-attention layers (trunk and MTP head). Rolling back
  ``n`` speculative positions is a pointer move (``trim``); the stale rows are
  overwritten by the next write.
* ``RecurrentCache`` for Gated DeltaNet layers: a convolution window and the
  recurrent (SSM) state. A recurrence cannot be trimmed, so a verify pass
  (``capture=True``) keeps the pre-verify state and the per-position
  recurrence inputs (references only: MLX arrays are immutable). ``accept``
  then *replays* the recurrence from the pre-verify state over the kept
  prefix, with the same call plain decoding makes (bit-identical to it), as
  a lazy graph; no per-position state is ever materialised.

Every cache answers ``accept(n_keep)`` after a speculative (verify) pass:
``n_keep[b]`` is how many of that pass's positions row ``b`` keeps (>= 1, the
first verified token is always committed). The decode step calls it on every
layer without knowing which kind of layer it is.

Every cache speaks one protocol (mlx-lm's shape), so nothing outside this file reads
a cache field: ``state`` / ``meta_state`` / ``from_state`` (save and load; ``kind``,
``state_names`` name them on disk), ``snapshot()`` / ``restore(snap)`` (undo a step,
by reference), ``merge(caches)`` into a batch, ``extract(row)``, ``filter(rows)``,
``empty(B)``, ``lengths()`` (attention caches: tokens per row) and ``nbytes``.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask


def _no_window(window_size: Optional[int]):
    if window_size is not None:
        raise ValueError("sliding-window attention is not supported by mlx-mtp's KV caches")


class _Cache:
    """The protocol's shared part (see the module doc)."""

    kind = ""  # the name a saved cache carries
    state_names: Tuple[str, ...] = ()  # the name of each ``state`` array

    @classmethod
    def from_state(cls, state, meta_state):
        """A cache from what ``state`` and ``meta_state`` returned (``state`` None: empty)."""
        c = cls.empty(1)
        if state is not None:
            c.state = state
        c.meta_state = meta_state
        return c

    @classmethod
    def empty(cls, B: int = 1):
        if B != 1:
            raise ValueError(f"a {cls.__name__} holds one row, not {B}")
        return cls()

    def size(self) -> int:
        """Rows held."""
        return 1

    def filter(self, rows: List[int]):
        if list(rows) != [0]:
            raise ValueError(f"a single-row cache cannot keep rows {rows}")

    def extract(self, row: int):
        self.filter([row])
        return self.copy()

    def is_trimmable(self) -> bool:
        return True  # attention caches; a recurrence cannot step back

    def arrays(self) -> List[mx.array]:
        return [a for a in self.state if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class KVCache(_Cache):
    """Growable key/value cache for one attention layer (one row)."""

    step = 256
    kind = "kv"
    state_names = ("k", "v")

    def __init__(self):
        self.keys: Optional[mx.array] = None  # (B, n_kv_heads, capacity, head_dim)
        self.values: Optional[mx.array] = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, Dk), keys.dtype)
            new_v = mx.zeros((B, H, grow, Dv), values.dtype)
            if self.keys is not None:
                new_k = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                new_v = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            self.keys, self.values = new_k, new_v
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        self.last_write = n
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @property
    def state(self):
        if self.keys is None:
            return None, None
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    @state.setter
    def state(self, v):
        self.keys, self.values = v
        self.offset = 0 if self.keys is None else self.keys.shape[2]

    @property
    def meta_state(self):
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v):
        offset = int(v[0])
        held = 0 if self.keys is None else self.keys.shape[2]
        if held != offset or (self.values is not None and self.values.shape[2] != offset):
            raise ValueError(f"KV length {held} != offset {offset}")
        self.offset = offset

    def snapshot(self):
        # Writes land past ``offset`` (and growing copies the rows below it), so the
        # pointer is enough until something is written below it again.
        return self.keys is None, self.offset

    def restore(self, snap):
        empty, self.offset = snap
        if empty:
            self.keys = self.values = None

    def lengths(self) -> List[int]:
        return [self.offset]

    @classmethod
    def merge(cls, caches) -> "BatchKVCache":
        return BatchKVCache.merge(caches)

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def accept(self, n_keep):
        """Keep the first ``n_keep[0]`` positions of the last write (one row)."""
        self.trim(self.last_write - n_keep[0])

    def prepare(self, S: int, lengths=None):
        """Per-row chunk lengths (``BatchKVCache``'s interface); one row has no holes."""
        if lengths is not None and list(lengths) != [S]:
            raise ValueError(f"a single-row cache cannot take a padded chunk ({lengths} of {S})")

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        """mlx-lm's call. ``return_array``: a boolean (n, offset + n) causal mask instead of
        ``"causal"`` (MLA attention masks its scores with it)."""
        _no_window(window_size)
        if return_array and n > 1:
            return create_causal_mask(n, self.offset)
        return "causal" if n > 1 else None

    @property
    def nbytes(self) -> int:  # the whole buffer
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def copy(self) -> "KVCache":
        c = KVCache()
        if self.keys is not None:
            k, v = self.state
            c.keys, c.values = mx.array(k), mx.array(v)
            c.offset = self.offset
        return c


class VerifyRecord(NamedTuple):
    """What ``accept`` needs to recompute a Gated DeltaNet layer's state after
    a verify pass: the state before it, the pass's conv input (pre-verify
    window followed by the new positions) and the recurrence inputs."""

    conv_input: mx.array  # (B, kernel-1+T, conv_dim)
    ssm: Optional[mx.array]  # (B, Hv, Dv, Dk) before the pass (None: zeros)
    inputs: Tuple[mx.array, ...]  # per-position (q, k, v, a, b), time axis 1
    mask: Optional[mx.array]  # (B, T) mask the pass ran with
    recurrence: Callable  # (*inputs, state, mask) -> (y, state): the layer's call


class RecurrentCache(_Cache):
    """Conv window + recurrent state of one Gated DeltaNet layer (B rows).

    ``conv``: (B, kernel-1, conv_dim) in the activation dtype.
    ``ssm``:  (B, Hv, Dv, Dk) in float32.
    After a verify pass both hold the state after *all* its positions and
    ``verify_record`` what ``accept`` needs to step back.
    """

    kind = "rec"
    state_names = ("conv", "ssm")

    def __init__(self, rows: int = 1):
        self.conv: Optional[mx.array] = None  # None: no token seen yet (zeros)
        self.ssm: Optional[mx.array] = None
        self.offset = 0
        self.verify_record: Optional[VerifyRecord] = None
        self._rows = rows  # while empty

    @classmethod
    def empty(cls, B: int = 1) -> "RecurrentCache":
        return cls(B)

    def size(self) -> int:
        return self._rows if self.conv is None else self.conv.shape[0]

    # mlx-lm's ArraysCache indexing, so its kernels and helpers can read us.
    def __getitem__(self, i):
        return (self.conv, self.ssm)[i]

    def __setitem__(self, i, v):
        setattr(self, self.state_names[i], v)

    @property
    def state(self):
        return self.conv, self.ssm

    @state.setter
    def state(self, v):
        self.conv, self.ssm = v
        self.verify_record = None

    @property
    def meta_state(self):
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v):
        self.offset = int(v[0])

    def snapshot(self):
        return self.conv, self.ssm, self.offset, self._rows

    def restore(self, snap):
        self.conv, self.ssm, self.offset, self._rows = snap
        self.verify_record = None

    def advance(self, conv_input, new_ssm, T: int, record: Optional[VerifyRecord] = None):
        """After a pass of ``T`` positions over ``conv_input`` (old window + them); ``record``
        (a verify pass): what ``accept`` replays from."""
        self.verify_record = record
        self.conv = mx.contiguous(conv_input[:, T:])
        self.ssm = new_ssm
        self.offset += T

    def accept(self, n_keep):
        """Row ``b`` keeps its state after ``n_keep[b]`` positions of the verify pass."""
        if self.verify_record is None:
            raise RuntimeError("accept() needs a forward pass run with capture=True")
        T = self.verify_record.inputs[0].shape[1]
        self.offset -= T - max(n_keep)
        self.select_rows(list(n_keep))

    def select_rows(self, n_keep: List[int]):
        """Keep row b's state after ``n_keep[b]`` positions (offset untouched).

        One replay call for the whole batch: the recurrence over the longest kept
        prefix from the pre-verify state, with a (B, T) mask when rows differ.
        """
        rec = self.verify_record
        if rec is None:
            raise RuntimeError("select_rows() needs a forward pass run with capture=True")
        T = rec.inputs[0].shape[1]
        longest = max(n_keep)
        if not 1 <= min(n_keep) <= longest <= T or len(n_keep) != rec.conv_input.shape[0]:
            raise ValueError(f"n_keep {n_keep} does not fit a verify pass of {T} positions")
        self.verify_record = None
        if all(n == T for n in n_keep):
            return  # conv and ssm already hold the state after every position
        window = rec.conv_input.shape[1] - T
        mask = rec.mask[:, :longest] if rec.mask is not None else None
        if any(n != longest for n in n_keep):
            keep = mx.arange(longest)[None] < mx.array(n_keep)[:, None]
            mask = keep if mask is None else mask & keep
            # Row b's window is conv_input[b, n_b : n_b + window].
            ix = mx.array(n_keep)[:, None] + mx.arange(window)[None]
            self.conv = mx.take_along_axis(rec.conv_input, ix[..., None], axis=1)
        else:
            self.conv = mx.contiguous(rec.conv_input[:, longest : longest + window])
        prefix = [x[:, :longest] for x in rec.inputs]
        _, self.ssm = rec.recurrence(*prefix, rec.ssm, mask)

    @classmethod
    def merge(cls, caches: List["RecurrentCache"]) -> "RecurrentCache":
        """The caches' rows in order; an empty cache's rows hold the zero state."""
        ref = next((c for c in caches if c.conv is not None), None)
        out = cls(sum(c.size() for c in caches))
        out.offset = max(c.offset for c in caches)
        if ref is not None:
            def rows(c, a, like):
                return a if a is not None else mx.zeros((c.size(), *like.shape[1:]), like.dtype)
            out.conv = mx.concatenate([rows(c, c.conv, ref.conv) for c in caches])
            out.ssm = mx.concatenate([rows(c, c.ssm, ref.ssm) for c in caches])
        return out
    concat = merge  # the older name

    def filter(self, rows: List[int]):
        self.verify_record = None  # its rows no longer line up
        self._rows = len(rows)
        if self.conv is not None:
            ix = mx.array(rows)
            self.conv, self.ssm = self.conv[ix], self.ssm[ix]

    def extract(self, row: int) -> "RecurrentCache":
        c = RecurrentCache()
        if self.conv is not None:
            c.conv, c.ssm = self.conv[row : row + 1], self.ssm[row : row + 1]
        c.offset = self.offset
        return c

    def is_trimmable(self) -> bool:
        return False

    def copy(self) -> "RecurrentCache":
        c = RecurrentCache(self._rows)
        c.conv, c.ssm = (None if a is None else mx.array(a) for a in (self.conv, self.ssm))
        c.offset = self.offset
        return c


CACHE_KINDS = {cls.kind: cls for cls in (KVCache, RecurrentCache)}  # what can be saved


def cache_state_arrays(caches) -> List[mx.array]:
    """Every array that makes up the live state (for mx.eval and comparisons)."""
    return [a for c in caches for a in c.arrays()]


def snapshot_caches(caches) -> list:
    return [(c, c.snapshot()) for c in caches]


def restore_caches(snaps):
    for c, snap in snaps:
        c.restore(snap)


class BatchKVCache(_Cache):
    """KV cache for a batch of sequences of different lengths, with per-row rollback.

    All rows write at a shared pointer ``idx``; a (B, capacity) ``valid`` mask marks
    which slots hold a row's tokens (padding and rejected drafts become holes), and
    ``pos`` (B,) is each row's own token count, i.e. its next RoPE position. A chunk
    of S new tokens per row is right-aligned: ``prepare(S, lengths)`` says how many
    of the S are real for each row. Holes are squeezed out when the buffer grows.
    """

    step = 256

    def __init__(self, pos: List[int], keys=None, values=None, valid=None):
        self.keys, self.values = keys, values  # (B, H, cap, D) or None while empty
        self.valid = valid  # (B, cap) bool
        self.idx = keys.shape[2] if keys is not None else 0
        self.pos = list(pos)
        self._lengths: Optional[List[int]] = None
        self._S = 0

    kind = "batch_kv"
    state_names = ("k", "v", "valid")

    @classmethod
    def empty(cls, B: int = 1) -> "BatchKVCache":
        return cls([0] * B)

    def size(self) -> int:
        return len(self.pos)

    def lengths(self) -> List[int]:
        return list(self.pos)

    @property
    def state(self):
        if self.keys is None:
            return None, None, None
        i = self.idx
        return self.keys[..., :i, :], self.values[..., :i, :], self.valid[:, :i]

    @state.setter
    def state(self, v):
        self.keys, self.values, self.valid = v
        self.idx = 0 if self.keys is None else self.keys.shape[2]

    @property
    def meta_state(self):
        return tuple(str(p) for p in self.pos)

    @meta_state.setter
    def meta_state(self, v):
        self.pos = [int(p) for p in v]

    def snapshot(self):
        # Writes land past ``idx`` and ``drop_last`` makes a new mask: references suffice.
        return self.idx, list(self.pos), self.valid, self.keys, self.values

    def restore(self, snap):
        self.idx, pos, self.valid, self.keys, self.values = snap
        self.pos = list(pos)

    @classmethod
    def merge(cls, caches) -> "BatchKVCache":
        """The rows of single-row and batch caches, in order, in one new batch cache."""
        out = None
        for c in caches:
            b = cls.from_single([c]) if isinstance(c, KVCache) else c._share()
            if out is None:
                out = b
            else:
                out.extend(b)
        return out

    def _share(self) -> "BatchKVCache":
        """A new cache object over the same arrays (they are only ever replaced)."""
        c = BatchKVCache(self.pos, self.keys, self.values, self.valid)
        c.idx = self.idx
        return c

    def extract(self, row: int) -> KVCache:
        c = KVCache()
        if self.keys is not None:
            c.state = self.row_state(row)
        c.offset = self.pos[row]
        return c

    @classmethod
    def from_single(cls, caches: List[KVCache]) -> "BatchKVCache":
        """Batch single-sequence caches, left-padded to a common length."""
        ref = next((c for c in caches if c.keys is not None), None)
        pos = [c.offset for c in caches]
        if ref is None:
            return cls(pos)
        L = max(pos)
        H, D, Dv = ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3]
        ks, vs = [], []
        for c in caches:
            pad = L - c.offset
            zk = mx.zeros((1, H, pad, D), ref.keys.dtype)
            zv = mx.zeros((1, H, pad, Dv), ref.values.dtype)
            k, v = c.state
            ks.append(zk if k is None else mx.concatenate([zk, k], axis=2))
            vs.append(zv if v is None else mx.concatenate([zv, v], axis=2))
        valid = mx.arange(L)[None] >= mx.array([L - p for p in pos])[:, None]
        return cls(pos, mx.concatenate(ks), mx.concatenate(vs), valid)

    def prepare(self, S: int, lengths: Optional[List[int]] = None):
        """Announce the next chunk (before the forward, so masks see final positions)."""
        self._S = S
        self._lengths = lengths
        if self.keys is not None and self.idx + S > self.keys.shape[2]:
            self._grow(S)

    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offsets so a row's real tokens continue at its ``pos``."""
        lengths = self._lengths or [self._S] * len(self.pos)
        return mx.array([p - (self._S - n) for p, n in zip(self.pos, lengths)])

    def _new_valid(self) -> mx.array:
        S = self._S
        if self._lengths is None:
            return mx.ones((len(self.pos), S), mx.bool_)
        return mx.arange(S)[None] >= mx.array([S - n for n in self._lengths])[:, None]

    def update_and_fetch(self, keys, values):
        S = keys.shape[2]
        if self.keys is None:
            B, H, _, D = keys.shape
            self.keys = mx.zeros((B, H, 0, D), keys.dtype)
            self.values = mx.zeros((B, H, 0, values.shape[3]), values.dtype)
            self.valid = mx.zeros((B, 0), mx.bool_)
        if self.idx + S > self.keys.shape[2]:
            self._grow(S)  # first write; later growth happens in prepare()
        self.keys[..., self.idx : self.idx + S, :] = keys
        self.values[..., self.idx : self.idx + S, :] = values
        self.valid[:, self.idx : self.idx + S] = self._new_valid()
        self.idx += S
        self.last_write = S
        lengths = self._lengths or [S] * len(self.pos)
        self.pos = [p + n for p, n in zip(self.pos, lengths)]
        return self.keys[..., : self.idx, :], self.values[..., : self.idx, :]

    def make_mask(self, S: int, return_array: bool = True, window_size: Optional[int] = None):
        """(B, 1, S, idx + S) boolean: causal and each row's valid slots (always an array)."""
        _no_window(window_size)
        L = self.idx + S
        old = self.valid[:, : self.idx] if self.valid is not None else mx.zeros((len(self.pos), 0), mx.bool_)
        valid = mx.concatenate([old, self._new_valid()], axis=1)
        causal = mx.arange(L)[None] <= (self.idx + mx.arange(S))[:, None]  # (S, L)
        return valid[:, None, None, :] & causal[None, None]

    def drop_last(self, counts: List[int]):
        """Invalidate each row's last ``counts[b]`` written tokens (rejected drafts)."""
        if not any(counts):
            return
        # A row's newest tokens sit just below the shared write pointer.
        i = mx.arange(self.valid.shape[1])[None]
        cut = mx.array([self.idx - c for c in counts])[:, None]
        self.valid = self.valid & ~((i >= cut) & (i < self.idx))
        self.pos = [p - c for p, c in zip(self.pos, counts)]

    def accept(self, n_keep):
        """Row ``b`` keeps the first ``n_keep[b]`` positions of the last write."""
        self.drop_last([self.last_write - n for n in n_keep])

    def trim(self, n: int) -> int:
        """Drop every row's last ``n`` tokens (``KVCache.trim`` for a batch)."""
        self.drop_last([n] * len(self.pos))
        return n

    def _grow(self, S: int):
        """Squeeze out holes (left-pad to the longest row), then add room."""
        valid = np.array(self.valid[:, : self.idx])
        counts = valid.sum(axis=1)
        L = int(counts.max()) if counts.size else 0
        order = np.argsort(~valid, axis=1, kind="stable")  # valid slots first, in order
        idx = np.zeros((len(counts), L), np.int32)
        for b, n in enumerate(counts):
            idx[b, L - n :] = order[b, :n]
        gather = mx.array(idx)[:, None, :, None]
        k = mx.take_along_axis(self.keys[..., : self.idx, :], gather, axis=2)
        v = mx.take_along_axis(self.values[..., : self.idx, :], gather, axis=2)
        new_valid = mx.arange(L)[None] >= mx.array(L - counts)[:, None]
        room = ((S + self.step - 1) // self.step) * self.step
        B, H, _, D = k.shape
        self.keys = mx.concatenate([k, mx.zeros((B, H, room, D), k.dtype)], axis=2)
        self.values = mx.concatenate([v, mx.zeros((B, H, room, v.shape[3]), v.dtype)], axis=2)
        self.valid = mx.concatenate([new_valid, mx.zeros((B, room), mx.bool_)], axis=1)
        self.idx = L

    def filter(self, rows: List[int]):
        self.pos = [self.pos[r] for r in rows]
        if self.keys is not None:
            ix = mx.array(rows)
            self.keys, self.values, self.valid = self.keys[ix], self.values[ix], self.valid[ix]

    def _padded(self, L: int, like: "BatchKVCache"):
        B = len(self.pos)
        src = self if self.keys is not None else like
        H, D, Dv = src.keys.shape[1], src.keys.shape[3], src.values.shape[3]
        p = L - self.idx
        k = mx.zeros((B, H, p, D), src.keys.dtype)
        v = mx.zeros((B, H, p, Dv), src.values.dtype)
        m = mx.zeros((B, p), mx.bool_)
        if self.keys is not None:
            k = mx.concatenate([k, self.keys[..., : self.idx, :]], axis=2)
            v = mx.concatenate([v, self.values[..., : self.idx, :]], axis=2)
            m = mx.concatenate([m, self.valid[:, : self.idx]], axis=1)
        return k, v, m

    def extend(self, other: "BatchKVCache"):
        """Append the rows of ``other``, both right-aligned at the write pointer."""
        if self.keys is None and other.keys is None:
            self.pos += other.pos
            return
        L = max(self.idx, other.idx)
        ka, va, ma = self._padded(L, other)
        kb, vb, mb = other._padded(L, self)
        self.keys = mx.concatenate([ka, kb])
        self.values = mx.concatenate([va, vb])
        self.valid = mx.concatenate([ma, mb])
        self.idx = L
        self.pos = self.pos + other.pos

    def row_state(self, b: int):
        """(keys, values) of row ``b``'s valid tokens, in order (for tests)."""
        m = np.array(self.valid[b, : self.idx])
        ix = mx.array(np.nonzero(m)[0].astype(np.int32))
        return self.keys[b : b + 1][:, :, ix], self.values[b : b + 1][:, :, ix]

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def copy(self) -> "BatchKVCache":
        c = self._share()
        if self.keys is not None:
            c.keys, c.values, c.valid = (mx.array(a) for a in (c.keys, c.values, c.valid))
        return c
