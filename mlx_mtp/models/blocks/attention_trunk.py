"""Families whose trunk is attention only (GLM-4.x, GLM-4.7-Flash, MiMo-7B, DeepSeek-V3).

The trunk is mlx-lm's own module for the family (same parameter tree, same math);
the MTP layer is one generic block, parameterised per family (``Family``):

    x = eh_proj([enorm(emb(t+1)) || hnorm(h_t)])   (MiMo: hidden first)
    x = one decoder layer of the trunk's kind (own KV cache)
    out = final norm(x)  -> the trunk's lm_head; ``out`` is also what the next draft chains on

Norms are plain RMSNorm (x * w). Checkpoints store the MTP layer(s) after the trunk
(``model.layers.{N+i}.*``, DeepSeek naming) or under ``model.mtp_layers.{i}.*`` (MiMo);
``Family.key_map`` names the four tensors around the block, everything else belongs to
the block. Only the first MTP layer is built: every released checkpoint ships one, and
vLLM also drafts every depth with layer 0.

Rollback is a KV trim (no recurrent state). MLA families (``Family.mla``): mlx-lm computes
one token with the absorbed formula and several with the expanded one, so a verify pass
(``capture=True``) runs the absorbed formula on every row, as plain decoding does;
prefill stays expanded, as in mlx-lm. The MTP layer catching up on a step's accepted rows
runs absorbed too (``decoding_rows``): expanded, it would rebuild the keys and values of
its whole cache on every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import glm4_moe, mellum, mimo, mimo_v2_flash, step3p5
from mlx_lm.models.base import create_causal_mask

from ..io import layout
from ..interface import Capabilities, MTPModel
from .expert_split import has_experts
from .hybrid_shard import read_share

log = logging.getLogger("mlx_mtp")

# DeepSeek naming of the tensors around the block (GLM-4.x, GLM-4.7-Flash, DeepSeek-V3).
NEXTN_KEYS = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
              "shared_head.norm": "norm"}
# Full copies of the trunk's embedding and output layer inside the MTP layer: the trunk's are used.
NEXTN_DUPLICATES = ("embed_tokens.", "shared_head.head.")


@dataclass(frozen=True)
class Family:
    lm: ModuleType  # mlx_lm.models.<family>: its ModelArgs and Model (whose sanitize we run)
    trunk_cls: type  # the trunk's class (embed_tokens, layers, norm): mlx-lm's or a subclass
    block: Callable  # (lm args, layer index) -> the MTP layer's decoder block
    mtp_prefix: Callable  # (lm args, i) -> checkpoint prefix of MTP layer i
    key_map: Dict[str, str] = field(default_factory=lambda: dict(NEXTN_KEYS))
    duplicates: tuple = NEXTN_DUPLICATES
    hidden_first: bool = False  # MiMo concatenates [hidden, embedding]
    mla: bool = False
    tied: Callable = lambda args: False  # whether lm_head is the embedding (as mlx-lm reads it)
    args_cls: Optional[type] = None  # a subclass of ``lm.ModelArgs`` adding names we read

    @property
    def lm_args_cls(self) -> type:
        return self.args_cls or self.lm.ModelArgs


# mlx-lm blocks computing ``h = x + self_attn(input_layernorm(x))`` then
# ``h + mlp(post_attention_layernorm(h))``: an MTP pass can cut them after attention.
SPLIT_BLOCKS = (glm4_moe.DecoderLayer, mimo.TransformerBlock, mimo_v2_flash.DecoderLayer,
                step3p5.Step3p5DecoderLayer, mellum.MellumDecoderLayer)


def nextn_prefix(args, i: int) -> str:
    return f"model.layers.{args.num_hidden_layers + i}."


@dataclass
class ModelArgs:
    model_type: str
    config: dict

    @classmethod
    def from_dict(cls, params: dict):
        return cls(model_type=params["model_type"], config=dict(params))


def mlx_lm_sanitize(lm_model: type, args, weights: dict) -> dict:
    """``lm_model.sanitize`` (an mlx-lm ``Model`` class) on ``weights``. It reads only
    ``self.args``, so it runs on an instance of a subclass that skips building the model."""

    class Sanitizer(lm_model):
        def __init__(self):
            nn.Module.__init__(self)
            self.args = args

    return Sanitizer().sanitize(weights)


def mlx_lm_shard(lm_model: type, layer, group):
    """``lm_model.shard`` (an mlx-lm ``Model`` class) on one decoder layer: it reads only
    ``self.model.layers``, so it runs on an instance that skips building the model."""

    class Sharder(lm_model):
        def __init__(self):
            nn.Module.__init__(self)
            self.model = nn.Module()
            self.model.layers = [layer]

    Sharder().shard(group)


def attention_mask(cache, L: int, array: bool):
    """The mask mlx-lm's attention takes; ``array``: boolean, never ``"causal"`` (MLA)."""
    if cache is not None:
        return cache.make_mask(L, return_array=array)
    if L == 1:
        return None
    return create_causal_mask(L) if array else "causal"


def decoding_rows(cache, L: int) -> bool:
    """Whether ``L`` new rows are decoding work (one token, or the head catching up on a
    verify's accepted rows), not a prompt: no more rows than every sequence already holds.
    MLA then runs the absorbed formula, as for one token: the expanded one would rebuild
    every cached position's keys and values per head on each step (T x heads x (d_nope +
    d_v) at T tokens of context), work and memory a one-token call never pays."""
    return L == 1 or (cache is not None and L <= min(cache.lengths()))


def quantized_latent_attention(q_abs, latent: tuple, pe_scores, scale: float, quant: dict):
    """MLA's absorbed attention over a quantized latent (B, 1, T, r): what
    ``mx.fast.scaled_dot_product_attention(q_abs, latent, latent, mask=pe_scores)`` computes
    (the one latent head shared by every query head by broadcasting)."""
    scores = mx.quantized_matmul(q_abs * scale, *latent, transpose=True, **quant) + pe_scores
    probs = mx.softmax(scores, axis=-1, precise=True)
    return mx.quantized_matmul(probs, *latent, transpose=False, **quant)


def mla_attention(attn, x, mask, cache, absorbed: bool):
    """mlx-lm's MLA attention (``attn``'s weights), with the formula chosen by the caller:
    ``absorbed`` is what mlx-lm runs for one token (q W_k^T against the cached latent,
    W_v after), otherwise keys and values are expanded from the latent."""
    B, L, _ = x.shape
    return attn.o_proj(mla_heads(attn, x, mask, cache, absorbed).reshape(B, L, -1))


def mla_heads(attn, x, mask, cache, absorbed: bool):
    """``mla_attention`` before its output projection: each head's output (B, L, heads, Dv)."""
    B, L, _ = x.shape
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    # mlx-lm names the head sizes differently in LongCat (num_attention_heads, qk_head_dim).
    heads = getattr(attn, "num_heads", None) or attn.num_attention_heads
    head_dim = getattr(attn, "q_head_dim", None) or attn.qk_head_dim
    q = q.reshape(B, L, heads, head_dim).transpose(0, 2, 1, 3)
    if getattr(attn, "mla_scale_q_lora", None) is not None:  # LongCat's LoRA scaling
        q = q * attn.mla_scale_q_lora
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = attn.kv_a_layernorm(latent)
    if getattr(attn, "mla_scale_kv_lora", None) is not None:
        latent = latent * attn.mla_scale_kv_lora
    offset = cache.offset if cache is not None else 0
    q_pe = attn.rope(q_pe, offset)
    k_pe = attn.rope(k_pe, offset)
    latent = mx.expand_dims(latent, axis=1)
    if cache is not None:
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
    # A quantized cache (--kv-bits) returns (packed, scales, biases) triples.
    quant = None
    if isinstance(latent, tuple):
        quant = dict(group_size=cache.group_size, bits=cache.bits)
    if quant is None:
        scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    else:
        scores = mx.quantized_matmul(q_pe * attn.scale, *k_pe, transpose=True, **quant)
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    if absorbed and quant is not None:
        out = attn.unembed_out(quantized_latent_attention(attn.embed_q(q_nope), latent, scores,
                                                          attn.scale, quant))
    elif absorbed:
        out = mx.fast.scaled_dot_product_attention(
            attn.embed_q(q_nope), latent, latent, scale=attn.scale, mask=scores)
        out = attn.unembed_out(out)
    else:
        if quant is not None:  # the expanded formula reads the latent the cache holds
            latent = mx.dequantize(*latent, **quant)
        k = attn.embed_q(latent, transpose=False)
        v = attn.unembed_out(latent)
        out = mx.fast.scaled_dot_product_attention(q_nope, k, v, scale=attn.scale, mask=scores)
    return out.transpose(0, 2, 1, 3)


def mlp_after(layer, x, r, last_only: bool = False):
    """The second half of a pre-norm block, ``h = x + r`` then ``h + mlp(norm(h))``;
    ``last_only``: for the last row alone (an MTP pass reads only that row's output)."""
    h = x + r if not last_only else x[:, -1:] + r[:, -1:]
    return h + layer.mlp(layer.post_attention_layernorm(h))


class MTPLayer(nn.Module):
    def __init__(self, H: int, eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(H, eps=eps)
        self.hnorm = nn.RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(H, eps=eps)


class MTPStack(nn.Module):
    def __init__(self, layers: List[MTPLayer]):
        super().__init__()
        self.layers = layers


class TextModel(MTPModel):
    """Trunk (mlx-lm's module) + lm_head + MTP layer."""

    def __init__(self, family: Family, config: dict):
        super().__init__()
        self.family = family
        lm_args = family.lm_args_cls.from_dict(config)
        lm_args.tie_word_embeddings = family.tied(lm_args)
        self.args = lm_args
        self.model_type = config["model_type"]
        self.mtp_hidden = config.get("mtp_hidden", "post_norm")
        if self.mtp_hidden not in ("post_norm", "pre_norm"):
            raise ValueError(f"mtp_hidden must be 'post_norm' or 'pre_norm', got {self.mtp_hidden!r}")
        self.declared_mtp_layers = layout.config_mtp_layers(config)
        self.model = family.trunk_cls(lm_args)
        if not lm_args.tie_word_embeddings:
            self.lm_head = nn.Linear(lm_args.hidden_size, lm_args.vocab_size, bias=False)
        if self.declared_mtp_layers > 0:
            block = family.block(lm_args, lm_args.num_hidden_layers)
            self.mtp = MTPStack([MTPLayer(lm_args.hidden_size, lm_args.rms_norm_eps, block)])
        self.routed_experts = has_experts(self)  # read by capabilities on every step

    # --- forward ----------------------------------------------------------
    def decoder_layer(self, layer, x, mask, cache, absorbed: bool, last_only: bool = False):
        """``last_only``: the last row's output only (every row still fills ``cache``)."""
        if not (self.family.mla or last_only):
            return layer(x, mask, cache)
        if last_only and hasattr(layer, "last_row"):  # a block that cuts itself (Nemotron-H)
            return layer.last_row(x, mask, cache)
        if self.family.mla:
            r = mla_attention(layer.self_attn, layer.input_layernorm(x), mask, cache, absorbed)
        else:
            r = layer.self_attn(layer.input_layernorm(x), mask, cache)
        return mlp_after(layer, x, r, last_only)

    def splits_mtp_block(self) -> bool:
        """Whether the MTP block can skip its MLP on rows whose output is not used: the
        attention-then-MLP shape ``decoder_layer`` computes, or a block with ``last_row``."""
        if type(self).decoder_layer is not TextModel.decoder_layer:
            return False  # a family's own layer
        block = self.mtp.layers[0].block
        return self.family.mla or isinstance(block, SPLIT_BLOCKS) or hasattr(block, "last_row")

    def trunk_layers(self, inputs, cache=None, capture=False, taps=()):
        """``capture``: a verify pass, whose rows must be computed as plain one-token
        decoding computes them."""
        h = self.embed(inputs)
        L = h.shape[1]
        cache = cache if cache is not None else [None] * len(self.model.layers)
        mask = attention_mask(cache[0], L, self.family.mla)
        absorbed = capture or L == 1
        tapped = {}
        for i, (layer, c) in enumerate(zip(self.model.layers, cache)):
            h = self.decoder_layer(layer, h, mask, c, absorbed)
            if i in taps:
                tapped[i] = h
        return h, tapped

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        """hidden (B,S,H) at positions i, next_tokens (B,S) = t_{i+1} -> the MTP layer's
        post-norm output (B,S,H): its logits predict t_{i+2}; the next draft chains on it.
        ``last_only``: (B,1,H), the last row's; the cache gets every row's entries."""
        layer = self.mtp.layers[0]
        e = layer.enorm(self.model.embed_tokens(next_tokens))
        h = layer.hnorm(hidden)
        x = layer.eh_proj(mx.concatenate([h, e] if self.family.hidden_first else [e, h], axis=-1))
        cache = mtp_cache[0] if mtp_cache else None
        L = x.shape[1]
        mask = attention_mask(cache, L, self.family.mla)
        absorbed = decoding_rows(cache, L)
        if last_only and self.splits_mtp_block():
            return layer.norm(self.decoder_layer(layer.block, x, mask, cache, absorbed, True))
        x = self.decoder_layer(layer.block, x, mask, cache, absorbed=absorbed)
        return layer.norm(x[:, -1:] if last_only else x)

    def make_cache(self):
        return [self.full_attention_cache() for _ in self.model.layers]

    def use_kv_quantization(self, quant):
        """Full attention and MLA latents (the latent and its RoPE part, both quantized);
        a family that makes its own caches says what it quantizes."""
        if quant is not None and type(self).make_cache is not TextModel.make_cache:
            raise ValueError(f"--kv-bits is not available for {self.model_type}: its "
                             "caches have no quantized kind yet")
        self.quantize_attention_caches(quant, *self.cached_head_dims())

    def cached_head_dims(self) -> tuple:
        """The last dimension of each array the attention caches hold."""
        args = self.args
        if self.family.mla:
            return args.kv_lora_rank, args.qk_rope_head_dim
        return (getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,)

    # --- split across processes (models/distributed.py) ----------------------
    @property
    def capabilities(self) -> Capabilities:
        # Tensor: the families mlx-lm can ``shard()``; pipeline: every layer list;
        # expert: the trunks with routed experts (mlx-lm's ``switch_mlp``).
        tensor = ("tensor",) if hasattr(self.family.lm.Model, "shard") else ()
        expert = ("expert",) if self.routed_experts else ()
        return Capabilities(splits=("pipeline",) + tensor + expert)

    def shard(self, group):
        """mlx-lm's ``shard()`` for the family, one layer at a time; an MTP block that is a
        trunk layer is split the same way, another (LongCat's dense block) kept whole."""
        trunk_kind = type(self.model.layers[-1])
        blocks = [l.block for l in self.mtp.layers] if "mtp" in self else []
        for layer in list(self.model.layers) + [b for b in blocks if isinstance(b, trunk_kind)]:
            mlx_lm_shard(self.family.lm.Model, layer, group)
            read_share(layer)  # read and slice one layer at a time

    @staticmethod
    def cast_predicate(path: str) -> bool:
        return "e_score_correction_bias" not in path  # mlx-lm keeps it in float32

    # --- weights ----------------------------------------------------------
    def lm_sanitize(self, weights: dict) -> dict:
        """mlx-lm's own sanitize for this family (stacks experts, splits MLA's kv_b_proj)."""
        return mlx_lm_sanitize(self.family.lm.Model, self.args, weights)

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in layout.text_weight_names(weights).items()
                   if "rotary_emb.inv_freq" not in k}
        weights = dequantize_fp8(weights)
        prefixes = [self.family.mtp_prefix(self.args, i) for i in range(self.declared_mtp_layers)]
        out = self.lm_sanitize({k: v for k, v in weights.items() if not self.is_mtp_key(k)})
        if "mtp" not in self:
            return out
        converted = {k: v for k, v in weights.items() if k.startswith("mtp.layers.0.")}
        raw = {k[len(prefixes[0]):]: v for k, v in weights.items() if k.startswith(prefixes[0])}
        if not raw and not converted:
            raise layout.MissingMTPWeightsError(self.missing_mtp_message())
        out.update(converted)
        out.update(self.mtp_weights(raw))
        if len(prefixes) > 1:
            log.info("Using the first of %d MTP layers (as vLLM does).", len(prefixes))
        expected = {k for k, _ in tree_flatten(self.parameters()) if k.startswith("mtp.")}
        missing = sorted(expected - out.keys())
        if missing:
            raise layout.MissingMTPWeightsError(self.missing_mtp_message(missing))
        return out

    def is_mtp_key(self, key: str) -> bool:
        return is_mtp_checkpoint_key(key, self.args.num_hidden_layers)

    def mtp_weights(self, raw: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Checkpoint tensors of MTP layer 0 (keys relative to its prefix) -> ``mtp.layers.0.*``."""
        out, block = {}, {}
        for k, v in raw.items():
            if k.startswith(self.family.duplicates):
                continue
            head = next((h for h in self.family.key_map if k.startswith(h + ".")), None)
            if head is not None:
                out[f"mtp.layers.0.{self.family.key_map[head]}{k[len(head):]}"] = v
            else:
                block[f"model.layers.0.{k}"] = v  # sanitized as a trunk layer would be
        for k, v in self.lm_sanitize(block).items():
            out["mtp.layers.0.block." + k[len("model.layers.0."):]] = v
        return out

    def checkpoint_name(self, key: str) -> str:
        """``mtp.layers.0.*`` (a tensor or module path) -> the checkpoint's own name (the
        inverse of ``mtp_weights``' renaming); other keys unchanged."""
        if not key.startswith("mtp.layers.0."):
            return key
        head, _, tail = key[len("mtp.layers.0."):].partition(".")
        if head != "block":
            inverse = {ours: theirs for theirs, ours in self.family.key_map.items()}
            tail = inverse[head] + ("." + tail if tail else "")
        return self.family.mtp_prefix(self.args, 0) + tail

    def checkpoint_mtp_names(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        return {self.checkpoint_name(k): v for k, v in weights.items()}

    def expected_mtp_keys(self) -> List[str]:
        prefix = self.family.mtp_prefix(self.args, 0)
        return [prefix + h + ".weight" for h in self.family.key_map]

    def missing_mtp_message(self, missing: Optional[List[str]] = None) -> str:
        what = (f"{len(missing)} MTP tensors are missing, e.g. {', '.join(missing[:4])}"
                if missing else "none of its tensors are present")
        return (
            f"config.json declares {self.declared_mtp_layers} MTP layer(s) "
            f"(model_type={self.model_type!r}) but the weights lack it: {what}. Expected keys such "
            f"as {', '.join(self.expected_mtp_keys())} (plus the layer's attention and MLP). "
            "mlx-lm conversions (mlx-community) drop them. Fix: graft the layer from the original "
            "Hugging Face checkpoint with `mlx-mtp add-mtp --model THIS --source ORIGINAL`, or "
            "convert the original with `mlx-mtp convert --hf-path ORIGINAL --mlx-path DST`. "
            "To run without MTP, pass --no-mtp."
        )


class Model(TextModel):
    """A family module's ``Model``: set ``family``."""

    family: Family = None

    def __init__(self, args: ModelArgs):
        super().__init__(type(self).family, args.config)


FP8_BLOCK = 128


def dequantize_fp8(weights: dict) -> dict:
    """FP8 (e4m3) weights with 128x128-block ``weight_scale_inv`` -> bfloat16."""
    scaled = [k for k in weights if k.endswith(".weight_scale_inv")]
    if not scaled:
        return weights
    weights = dict(weights)
    for k in scaled:
        scale = weights.pop(k)
        name = k[: -len("_scale_inv")]
        w = mx.from_fp8(weights[name], dtype=mx.bfloat16)
        m, n = w.shape
        pm, pn = -m % FP8_BLOCK, -n % FP8_BLOCK
        w = mx.pad(w, ((0, pm), (0, pn))).reshape(
            (m + pm) // FP8_BLOCK, FP8_BLOCK, (n + pn) // FP8_BLOCK, FP8_BLOCK)
        w = (w * scale[:, None, :, None]).reshape(m + pm, n + pn)
        weights[name] = w[:m, :n].astype(mx.bfloat16)
    return weights


# Families with a trunk of their own whose head is also layer ``num_hidden_layers``.
LAYER_N_HEADS = ("glm5_next",)


def is_mtp_checkpoint_key(key: str, num_hidden_layers: int) -> bool:
    """Any MTP layer's tensor, in checkpoint naming (``model.layers.{>=N}.*``,
    ``model.mtp_layers.*``, a VLM's ``model.language_model.layers.{>=N}.*``) or ours
    (``mtp.*``)."""
    if layout.is_mtp_key(key) or key.startswith("model.mtp_layers."):
        return True
    parts = key.replace("model.language_model.", "model.", 1).split(".", 3)
    return (len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= num_hidden_layers)


def trunk_layer_count(config: dict) -> int:
    """``num_hidden_layers`` (LongCat names it ``num_layers``) of the text model."""
    text = layout.text_config(config)
    return int(text.get("num_hidden_layers", text.get("num_layers", 0)))


def mtp_key_predicate(config: dict) -> Callable[[str], bool]:
    """Which of a checkpoint's keys belong to the MTP layers, for any supported family."""
    if family_of(config) is None and config.get("model_type") not in LAYER_N_HEADS:
        return layout.is_mtp_key
    n = trunk_layer_count(config)
    return lambda key: is_mtp_checkpoint_key(key, n)


def family_of(config: dict) -> Optional[Family]:
    """The attention-trunk family of ``config`` (None: another kind of model)."""
    from .. import MODEL_TYPES, get_model_module

    name = config.get("model_type")
    return getattr(get_model_module(name).Model, "family", None) if name in MODEL_TYPES else None


def count_checkpoint_mtp_layers(config: dict, keys) -> int:
    """MTP layers stored under a family's own prefixes (``model.layers.{>=N}``,
    ``model.mtp_layers.{i}``); 0 for other families."""
    if family_of(config) is None and config.get("model_type") not in LAYER_N_HEADS:
        return 0
    n, found = trunk_layer_count(config), set()
    for k in keys:
        parts = k.replace("model.language_model.", "model.", 1).split(".", 3)
        if len(parts) < 4 or parts[0] != "model" or not parts[2].isdigit():
            continue
        if parts[1] == "mtp_layers" or (parts[1] == "layers" and int(parts[2]) >= n):
            found.add(int(parts[2]))
    return len(found)
