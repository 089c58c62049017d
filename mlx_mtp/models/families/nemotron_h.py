"""Nemotron-H / Nemotron-3 (``model_type: nemotron_h``): Mamba-2 + attention hybrid, with
its MTP layer.

Trunk: mlx-lm's module (``backbone.*`` in checkpoints; we hold it as ``model.*``): Mamba-2
mixers (``M``), attention without RoPE (``*``), ReLU² MLPs (``-``) and MoE (``E``), each a
pre-norm residual block. Mamba-2 layers keep their conv window and SSM state in
``RecurrentCache``: a verify pass (``capture``) records the pre-verify state and each
position's SSM inputs, and ``accept`` replays the kept prefix in one ``ssm_update`` call
from that state (the Gated DeltaNet design in ``cache.py``).

MTP: ``mtp.layers.{i}.*``, one layer per character of ``mtp_hybrid_override_pattern``
(e.g. ``*E``): the first carries ``enorm`` / ``hnorm`` / ``eh_proj``, the last
``final_layernorm``; ``[enorm(e) || hnorm(h)]`` -> the pattern's blocks (attention with
its own KV cache, then MoE) -> ``final_layernorm`` -> the trunk's ``lm_head``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import nemotron_h as _lm
from mlx_lm.models.ssm import ssm_update

from ..io import layout
from ..blocks.attention_trunk import Family, ModelArgs, mlx_lm_sanitize
from ..blocks.attention_trunk import Model as _Model
from ..cache.recurrent import RecurrentCache, VerifyRecord

CACHED = ("M", "*")  # block types that keep state across calls


class Trunk(_lm.NemotronHModel):
    """mlx-lm's backbone, with the names the engine reads."""

    @property
    def embed_tokens(self):
        return self.embeddings

    @property
    def norm(self):
        return self.norm_f


class MTPBlocks(nn.Module):
    """The MTP layer's blocks, in pattern order; only attention keeps a cache."""

    def __init__(self, args, pattern: str):
        super().__init__()
        self.layers = [_lm.NemotronHBlock(args, t) for t in pattern]
        # Rows after the last attention block matter only for their own output.
        self._cut = pattern.rfind("*")

    def __call__(self, x, mask=None, cache=None, last_only: bool = False):
        x = x[:, -1:] if last_only and self._cut < 0 else x
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cache) if layer.block_type == "*" else layer(x)
            x = x[:, -1:] if last_only and i == self._cut else x
        return x

    def last_row(self, x, mask=None, cache=None):
        """The last row's output (B, 1, H); every row still fills the cache."""
        return self(x, mask, cache, last_only=True)


def mtp_pattern(args) -> str:
    return getattr(args, "mtp_hybrid_override_pattern", None) or "*E"


def ssm_recurrence(mixer):
    """(x, B, C, dt, state, mask) -> (y, state): mlx-lm's Mamba-2 update. A (B, T) mask of
    kept prefixes (per-row replay) also gives each row's length."""

    def run(x, B, C, dt, state, mask=None):
        lengths = None if mask is None else mask.sum(axis=-1)
        return ssm_update(x, mixer.A_log, B, C, mixer.D.astype(x.dtype), dt, mixer.dt_bias,
                          state, mixer.time_step_limit, mask=mask, lengths=lengths)

    return run


def mamba(mixer, x, cache: RecurrentCache, capture: bool):
    """mlx-lm's Mamba-2 mixer on our cache; a verify pass records what replay needs."""
    Bsz, S, _ = x.shape
    gate, conv_in, dt = mx.split(
        mixer.in_proj(x), [mixer.intermediate_size, mixer.intermediate_size + mixer.conv_dim],
        axis=-1)
    conv_state, ssm = cache.state
    conv_input = mx.concatenate([conv_state, conv_in], axis=1)
    conv_out = nn.silu(mixer.conv1d(conv_input))
    xs, B, C = mx.split(conv_out, [mixer.intermediate_size,
                                   mixer.intermediate_size + mixer.n_groups * mixer.ssm_state_size],
                        axis=-1)
    inputs = (xs.reshape(Bsz, S, mixer.num_heads, mixer.head_dim),
              B.reshape(Bsz, S, mixer.n_groups, mixer.ssm_state_size),
              C.reshape(Bsz, S, mixer.n_groups, mixer.ssm_state_size), dt)
    recurrence = ssm_recurrence(mixer)
    y, state = recurrence(*inputs, ssm)
    cache.advance(conv_input, state, S,
                  VerifyRecord(conv_input, ssm, inputs, None, recurrence) if capture else None)
    return mixer.out_proj(mixer.norm(y.reshape(Bsz, S, -1), gate))


def mamba_cache(mixer, dtype) -> RecurrentCache:
    """A Mamba-2 layer's cache at the zero state (mlx-lm's "no state yet" on a first call)."""
    return RecurrentCache.zeros((mixer.conv_kernel_size - 1, mixer.conv_dim),
                                (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size), dtype)


@dataclass
class LmArgs(_lm.ModelArgs):
    mtp_hybrid_override_pattern: Optional[str] = None

    @property
    def rms_norm_eps(self) -> float:  # what the MTP layer's norms read
        return self.layer_norm_epsilon


class Model(_Model):
    family = Family(lm=_lm, args_cls=LmArgs, trunk_cls=Trunk,
                    block=lambda args, index: MTPBlocks(args, mtp_pattern(args)),
                    mtp_prefix=lambda args, i: f"mtp.layers.{i}.")

    def __init__(self, args: ModelArgs):
        config = dict(args.config)
        if "mtp_hybrid_override_pattern" in config and layout.config_mtp_layers(config) == 0 \
                and "num_nextn_predict_layers" not in config:
            config["num_nextn_predict_layers"] = 1  # the pattern is the layer
        super().__init__(ModelArgs(args.model_type, config))

    # --- forward ----------------------------------------------------------
    @property
    def layers(self):
        """The layers that keep a cache, in cache order."""
        return [layer for layer in self.model.layers if layer.block_type in CACHED]

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        """``taps`` count every block of the pattern (``model.layers``), cached or not."""
        h = self.embed(inputs)
        L = h.shape[1]
        caches = iter(cache if cache is not None else self.make_cache())
        tapped = {}
        for i, layer in enumerate(self.model.layers):
            if layer.block_type == "M":
                h = h + mamba(layer.mixer, layer.norm(h), next(caches), capture)
            elif layer.block_type == "*":
                c = next(caches)
                h = layer(h, c.make_mask(L), c)
            else:
                h = layer(h)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def make_cache(self):
        emb = self.model.embed_tokens  # a quantized table's weight is packed uint32
        dtype = (emb.scales if isinstance(emb, nn.QuantizedEmbedding) else emb.weight).dtype
        return [self.full_attention_cache() if layer.block_type == "*"
                else mamba_cache(layer.mixer, dtype) for layer in self.layers]

    def use_kv_quantization(self, quant):
        """Attention layers only: the Mamba-2 states keep their precision."""
        args = self.args
        self.quantize_attention_caches(
            quant, args.head_dim or args.hidden_size // args.num_attention_heads)

    @staticmethod
    def cast_predicate(path: str) -> bool:
        return "e_score_correction_bias" not in path and "A_log" not in path

    # --- weights ----------------------------------------------------------
    def lm_sanitize(self, weights: dict) -> dict:
        """mlx-lm's sanitize (conv layout, expert stacking) on ``backbone.*`` names."""
        back = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v
                for k, v in weights.items()}
        out = mlx_lm_sanitize(_lm.Model, self.args, back)
        return {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
                for k, v in out.items()}

    def sanitize(self, weights: dict) -> dict:
        weights = layout.text_weight_names(weights)
        trunk = self.lm_sanitize({k: v for k, v in weights.items() if not k.startswith("mtp.")})
        if "mtp" not in self:
            return trunk
        raw = {k: v for k, v in weights.items() if k.startswith("mtp.")}
        if not raw:
            raise layout.MissingMTPWeightsError(self.missing_mtp_message())
        ours = any(".block." in k for k in raw)
        trunk.update(raw if ours else self.mtp_weights(raw))
        expected = {k for k, _ in tree_flatten(self.parameters()) if k.startswith("mtp.")}
        missing = sorted(expected - trunk.keys())
        if missing:
            raise layout.MissingMTPWeightsError(self.missing_mtp_message(missing))
        return trunk

    def mtp_weights(self, raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """``mtp.layers.{i}.X`` (one per pattern block) -> ``mtp.layers.0.*``."""
        out, blocks = {}, {}
        for k, v in raw.items():
            i, name = re.match(r"mtp\.layers\.(\d+)\.(.*)", k).groups()
            if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
                out["mtp.layers.0." + name] = v
            elif name.startswith("final_layernorm."):
                out["mtp.layers.0.norm." + name.split(".", 1)[1]] = v
            elif not name.startswith("embeddings."):
                blocks[f"model.layers.{i}.{name}"] = v  # sanitized as trunk layers are
        for k, v in self.lm_sanitize(blocks).items():
            out["mtp.layers.0.block.layers." + k[len("model.layers."):]] = v
        return out

    def checkpoint_name(self, key: str) -> str:
        if key.startswith("model."):
            return "backbone." + key[len("model."):]
        if not key.startswith("mtp.layers.0."):
            return key
        name = key[len("mtp.layers.0."):]
        if name.startswith("block.layers."):
            return "mtp.layers." + name[len("block.layers."):]
        if name.startswith("norm"):
            last = len(mtp_pattern(self.args)) - 1
            return f"mtp.layers.{last}.final_layernorm" + name[len("norm"):]
        return key

    def expected_mtp_keys(self) -> List[str]:
        last = len(mtp_pattern(self.args)) - 1
        return ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
                "mtp.layers.0.eh_proj.weight", f"mtp.layers.{last}.final_layernorm.weight"]

    def is_mtp_key(self, key: str) -> bool:
        return layout.is_mtp_key(key)
