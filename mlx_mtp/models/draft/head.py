"""The draft-only output head: what drafts read instead of the whole output layer."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn


class DraftHead:
    """A cheaper copy of the output projection, for draft logits only.

    Drafting reads the whole output projection once per draft token (248k rows on
    Qwen3.5/3.6). Two ways to read less, alone or together:

    * ``bits``: a 4- or 8-bit copy (a fraction of the bytes where decoding is
      bandwidth-bound, as on Apple GPUs);
    * ``vocab``: only the rows of a token subset (``draft_vocab.py``); logits outside it
      are -inf, so the draft distribution q is zero there.

    Lossless either way: acceptance compares the full-precision target with the
    distribution the draft was really sampled from. Not a module: never among the
    model's parameters, so never saved or loaded.
    """

    def __init__(self, projection: nn.Module, bits: Optional[int] = None, vocab=None,
                 group_size: int = 64):
        if bits not in (None, 4, 8):
            raise ValueError(f"draft head bits must be 4 or 8 (got {bits!r})")
        quantized = "scales" in projection
        rows = None if vocab is None else mx.array(vocab)
        pick = (lambda a: a) if rows is None else (lambda a: a[rows])
        if bits is None and quantized:  # keep the checkpoint's quantization: rows slice exactly
            self.bits, self.group_size = projection.bits, projection.group_size
            biases = projection.get("biases")
            self.weight, self.scales = pick(projection.weight), pick(projection.scales)
            self.biases = None if biases is None else pick(biases)
        else:
            weight = projection.weight
            if quantized:  # requantize from its values
                weight = mx.dequantize(weight, projection.scales, projection.get("biases"),
                                       projection.group_size, projection.bits)
            weight = pick(weight)
            self.bits, self.group_size = bits, group_size
            if bits is None:
                self.weight, self.scales, self.biases = weight, None, None
            else:
                self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits)
        self.vocab_size = projection.weight.shape[0]
        self.size = self.vocab_size if rows is None else rows.size
        # Subset position of every token, or the size (the -inf column) when outside it.
        self.slot = None
        if rows is not None:
            self.slot = mx.full((self.vocab_size,), rows.size, mx.uint32)
            self.slot[rows] = mx.arange(rows.size, dtype=mx.uint32)
        mx.eval([a for a in (self.weight, self.scales, self.biases, self.slot) if a is not None])

    @property
    def restricted(self) -> bool:
        return self.slot is not None

    def __call__(self, hidden: mx.array) -> mx.array:
        if self.scales is None:
            logits = hidden @ self.weight.T
        else:
            logits = mx.quantized_matmul(hidden, self.weight, self.scales, self.biases,
                                         transpose=True, group_size=self.group_size,
                                         bits=self.bits)
        if self.slot is None:
            return logits
        # (..., N) -> (..., V): one gather, -inf outside the subset.
        outside = mx.full((*logits.shape[:-1], 1), -mx.inf, logits.dtype)
        return mx.take(mx.concatenate([logits, outside], axis=-1), self.slot, axis=-1)
