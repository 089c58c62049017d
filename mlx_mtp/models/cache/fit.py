"""Whether one row's cache state fits beside a batch's (``_Cache.check_joins``): shapes and
dtypes per array, checked before any cache of the batch changes; and finite values, checked
where a state is read from disk (``server/session_store.py``)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx


def check_array_joins(name: str, ours: Optional[mx.array], theirs: Optional[mx.array],
                      free_axes: Tuple[int, ...]):
    """ValueError unless ``theirs`` (one row's state array ``name``) has our dtype and, bar
    ``free_axes``, our shape."""
    if ours is None or theirs is None:  # an empty side takes the other's shape
        return
    fixed = [i for i in range(ours.ndim) if i not in free_axes]
    if (theirs.ndim != ours.ndim or theirs.shape[0] != 1 or theirs.dtype != ours.dtype
            or any(theirs.shape[i] != ours.shape[i] for i in fixed)):
        raise ValueError(f"state {name!r} {tuple(theirs.shape)} {theirs.dtype} does not fit "
                         f"beside {tuple(ours.shape)} {ours.dtype}")


def nonfinite_arrays(arrays: List[mx.array]) -> List[int]:
    """Indices of the floating arrays holding a NaN or an infinity: one reduction per array,
    evaluated in one sync."""
    floats = [i for i, a in enumerate(arrays) if mx.issubdtype(a.dtype, mx.floating)]
    if not floats:
        return []
    finite = mx.stack([mx.isfinite(arrays[i]).all() for i in floats]).tolist()
    return [i for i, ok in zip(floats, finite) if not ok]
