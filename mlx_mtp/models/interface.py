"""What the engine may ask of a model: ``ModelInterface`` declares it (with the defaults of
the optional parts), ``MTPModel`` implements the parts every family shares.

    trunk(inputs, cache, capture)          -> (post-norm hidden, hidden fed to the MTP head)
    trunk_with_taps(inputs, taps, ...)     -> the same, plus the residual after each tapped layer
    trunk_with_images(inputs, images, start, cache) -> the same over a prompt chunk with images
    logits(hidden) / draft_logits(hidden)  -> the output layer / the one drafts sample from
    embed(tokens)                          -> the trunk's token embedding (block drafters bind it)
    mtp_forward(hidden, next_tokens, mtp_cache, depth, last_only) -> the head's post-norm hidden
    make_cache(), make_mtp_cache(), layers, num_mtp_layers
    share(*arrays), drafted_entries(k)     -> hooks with defaults (see each)
    capabilities                           -> what a caller may rely on (``Capabilities``)

State set after construction lives in declared slots, set through declared methods
(``record_load_dtype``, ``use_draft_vocab_tuner``, ``use_image_encoder``,
``use_block_drafter``). A model wrapping another (a ``language_model.*`` checkpoint, a model
split across processes) reads every name it does not define from the wrapped one
(``forwards_interface``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from .cache.kv import KVCache
from .cache.quantized import KVQuantization, QuantizedKVCache
from .draft.head import DraftHead
from .io import layout


@dataclass(frozen=True)
class Capabilities:
    """What a model offers beyond the required interface."""

    shares: bool = False  # share() hands rank 0's values to every rank
    distributed: bool = False  # runs split over a group of processes
    compilable: bool = False  # set_compiled() compiles its decode steps
    draft_vocab: bool = True  # the draft vocabulary may be tuned on it (same on every rank)
    splits: Tuple[str, ...] = ()  # how models/distributed.py can split it ("pipeline", "tensor")
    taps: bool = True  # trunk_with_taps() is available
    images: bool = False  # takes image inputs


class ModelInterface:
    """Everything the engine (decode/, server/, options) may ask of a model."""

    model_type: str
    capabilities = Capabilities()
    # Slots set after construction, through the methods below.
    load_dtype: Optional[mx.Dtype] = None  # the dtype weights were cast to (None: as stored)
    dtype_choice: Optional[str] = None  # how that dtype was chosen, for the stats line
    draft_vocab_tuner = None  # re-sizes the draft vocabulary from emitted text (vocab_auto)
    kv_quantization: Optional[KVQuantization] = None  # trunk attention caches (--kv-bits)
    image_encoder = None  # vision.encoder.ImageEncoder, when images are taken (use_image_encoder)
    block_drafter = None  # drafters/block: a separate drafter reading trunk taps (None: none)

    @property
    def text(self) -> "MTPModel":
        """The model holding the text weights (itself, unless it wraps one)."""
        return self

    @property
    def num_mtp_layers(self) -> int:
        raise NotImplementedError

    @property
    def num_mtp_caches(self) -> int:
        """Entries of ``make_mtp_cache()``."""
        return self.num_mtp_layers

    @property
    def layers(self) -> list:
        """The trunk layers, in cache order."""
        raise NotImplementedError

    def trunk(self, inputs, cache=None, capture: bool = False) -> Tuple[mx.array, mx.array]:
        """(post-norm hidden, hidden for the MTP head). ``capture``: a verify pass, whose rows
        are computed as plain one-token decoding computes them."""
        raise NotImplementedError

    def trunk_with_taps(self, inputs, taps: Sequence[int], cache=None, capture: bool = False
                        ) -> Tuple[mx.array, mx.array, List[mx.array]]:
        """``trunk``'s outputs and the residual stream after each trunk layer in ``taps``
        (ids into the trunk's layers, in the order given)."""
        raise NotImplementedError("this model offers no hidden-state taps")

    def check_taps(self, taps: Sequence[int]):
        """ValueError (one line) when a layer in ``taps`` cannot be tapped: builds the graph
        of a one-token pass, never evaluated."""
        self.trunk_with_taps(mx.zeros((1, 1), mx.uint32), taps, self.make_cache())

    def trunk_with_images(self, inputs, images, start: int, cache=None
                          ) -> Tuple[mx.array, mx.array]:
        """``trunk`` over rows ``start..start+S`` of a prompt with images
        (``vision.images.PromptImages``): their embeddings and multimodal positions
        (``capabilities.images``)."""
        raise NotImplementedError("this model takes no images")

    def logits(self, hidden) -> mx.array:
        raise NotImplementedError

    def embed(self, tokens) -> mx.array:
        """The trunk's input embedding of ``tokens`` (B, S) -> (B, S, H)."""
        raise NotImplementedError

    def draft_logits(self, hidden, any_token: bool = False) -> mx.array:
        raise NotImplementedError

    def set_draft_head(self, bits: Optional[int] = None, group_size: int = 64, vocab=None):
        raise NotImplementedError

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False) -> mx.array:
        raise NotImplementedError

    def make_cache(self) -> list:
        raise NotImplementedError

    def make_mtp_cache(self) -> list:
        raise NotImplementedError

    def __call__(self, inputs, cache=None) -> mx.array:
        return self.logits(self.trunk(inputs, cache)[0])

    # --- optional hooks ---------------------------------------------------
    def share(self, *arrays: mx.array) -> Tuple[mx.array, ...]:
        """Rank 0's ``arrays`` on every rank (``capabilities.shares``); one process: as given."""
        return arrays

    def drafted_entries(self, k: int) -> List[int]:
        """Entries each MTP cache got from a step's k drafts (rolled back after the step)."""
        return [k - 1] * self.num_mtp_caches

    def set_compiled(self, on: bool, max_k: Optional[int] = None):
        """Run decode steps as compiled graphs (``capabilities.compilable``); else nothing."""

    @property
    def compiled(self) -> bool:
        return False

    # --- weights ----------------------------------------------------------
    def quant_predicate(self, path: str, module) -> Union[bool, dict]:
        # Router gates are tiny and sensitive: keep them at 8 bits.
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    @staticmethod
    def cast_predicate(path: str) -> bool:
        """Whether a float weight takes the load dtype (a recurrence's A_log stays float32)."""
        return not path.endswith("A_log")

    def is_mtp_key(self, key: str) -> bool:
        """Whether checkpoint tensor ``key`` belongs to the MTP head."""
        return layout.is_mtp_key(key)

    def checkpoint_name(self, key: str) -> str:
        """Our name of a tensor or module -> the checkpoint's."""
        return key

    def checkpoint_mtp_names(self, weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """Our MTP tensors under the checkpoint's names and in its form."""
        return weights

    # --- slots ------------------------------------------------------------
    def record_load_dtype(self, dtype: Optional[mx.Dtype], choice: str):
        self.load_dtype, self.dtype_choice = dtype, choice

    def use_draft_vocab_tuner(self, tuner):
        self.draft_vocab_tuner = tuner

    def use_kv_quantization(self, quant: Optional[KVQuantization]):
        """Quantize the trunk's attention caches from now on (``make_cache``); None: full
        precision. ValueError (one line) for a model whose caches cannot be."""
        if quant is not None:
            raise ValueError(f"--kv-bits is not available for {self.model_type}: "
                             "its attention caches have no quantized kind yet")

    def use_image_encoder(self, encoder):
        self.image_encoder = encoder

    def use_block_drafter(self, drafter):
        """Draft with ``drafter`` (``drafters/block``, None: none), bound to this model's
        embedding and output layer, its (lazily opened) weights read now. Kept out of the
        parameter tree: it is not the model's."""
        if drafter is not None:
            drafter.bind(self.embed, self.logits)
            mx.eval(drafter.parameters())
        object.__setattr__(self, "block_drafter", drafter)


INTERFACE_NAMES = tuple(n for n in vars(ModelInterface) if not n.startswith("_"))


def forwards_interface(wrapped: str):
    """Class decorator for a model wrapping another (``self.<wrapped>``): every name of
    ``ModelInterface`` the class does not define itself is the wrapped model's."""

    def forward(name: str):
        return property(lambda self: getattr(getattr(self, wrapped), name))

    def decorate(cls):
        for name in INTERFACE_NAMES:
            if name not in vars(cls):
                setattr(cls, name, forward(name))
        return cls

    return decorate


class MTPModel(ModelInterface, nn.Module):
    """A family's text model: ``self.model`` (the trunk: ``embed_tokens``, ``layers``,
    ``norm``), ``self.lm_head`` unless tied, ``self.mtp`` (``layers``) when it has a head.
    A family implements ``trunk_layers``, ``mtp_forward`` and ``make_cache``."""

    mtp_hidden = "post_norm"  # which trunk hidden feeds the MTP head (or "pre_norm")

    def __init__(self):
        super().__init__()
        self.draft_head: Optional[DraftHead] = None  # set_draft_head

    def trunk_layers(self, inputs, cache=None, capture: bool = False, taps: Sequence[int] = ()
                     ) -> Tuple[mx.array, Dict[int, mx.array]]:
        """The trunk's layers: (the last layer's residual, {layer id in ``taps``: the
        residual after it}). Loops keep nothing when ``taps`` is empty."""
        raise NotImplementedError

    def embed(self, inputs) -> mx.array:
        """Token ids (B, L) -> the first layer's input (B, L, H). A float (B, L, H) input is
        the hidden state a previous pipeline stage sent (``models/distributed.py``): as is."""
        return inputs if inputs.ndim == 3 else self.model.embed_tokens(inputs)

    # --- a pipeline stage (models/distributed.py) ---------------------------
    def stage_layers(self, ids, hidden, cache=None, capture: bool = False, taps=()):
        """``trunk_layers`` of a stage after the first: from the previous stage's ``hidden``
        (``stage_shape``); ``ids``, the tokens of the same rows, for layers that read them."""
        return self.trunk_layers(hidden, cache, capture, taps)

    def stage_shape(self, B: int, L: int) -> tuple:
        """The shape of the hidden one stage hands the next (a stream family: its streams)."""
        return (B, L, self.args.hidden_size)

    def output_modules(self) -> list:
        """The trunk's modules only ``trunk_outputs`` reads (held by the head's stage)."""
        return [self.model.norm]

    def tap_modules(self) -> list:
        """The trunk's modules outside its layers that a tap reads (held by every stage)."""
        return []

    def stage_may_start(self, layer: int) -> bool:
        """Whether a stage may begin at trunk layer ``layer`` (not where it reads what the
        layer before it computed besides the hidden)."""
        return True

    def shard(self, group):
        """Split the trunk and MTP layers across ``group`` by heads / columns, reading one
        layer at a time (``capabilities.splits`` has "tensor")."""
        raise NotImplementedError(f"{self.model_type} has no tensor split")

    def trunk(self, inputs, cache=None, capture=False):
        return self.trunk_outputs(self.trunk_layers(inputs, cache, capture)[0])

    def trunk_with_taps(self, inputs, taps, cache=None, capture=False):
        h, tapped = self.trunk_layers(inputs, cache, capture, taps)
        missing = sorted(set(taps) - tapped.keys())
        if missing:
            raise ValueError(f"no trunk layer {missing} to tap ({len(self.model.layers)} layers)")
        return (*self.trunk_outputs(h), [tapped[t] for t in taps])

    def trunk_outputs(self, h):
        normed = self.model.norm(h)
        return normed, (normed if self.mtp_hidden == "post_norm" else h)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp.layers) if "mtp" in self else 0

    @property
    def layers(self):
        return self.model.layers

    def logits(self, hidden):
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def draft_logits(self, hidden, any_token: bool = False):
        """Logits the MTP draft samples from (full vocabulary, (..., V)). The target
        distribution always comes from ``logits``; a cheaper draft head only lowers
        acceptance, never changes output. ``any_token``: every token must stay possible
        (drafts under a grammar, whose allowed tokens may all lie outside a draft
        vocabulary), so a vocabulary-restricted head is bypassed."""
        head = self.draft_head
        if head is not None and not (any_token and head.restricted):
            return head(hidden)
        return self.logits(hidden)

    def set_draft_head(self, bits: Optional[int] = None, group_size: int = 64, vocab=None):
        """Draft from a ``bits``-bit copy of the output projection and/or only the rows of
        the token ids ``vocab`` (both None: the output projection itself)."""
        if bits is None and vocab is None:
            self.draft_head = None
            return
        out = self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head
        self.draft_head = DraftHead(out, bits, vocab, group_size)

    def make_mtp_cache(self):
        return [self.full_attention_cache() for _ in range(self.num_mtp_layers)]

    def full_attention_cache(self) -> KVCache:
        """A full-attention layer's cache (trunk or MTP head): quantized after
        ``use_kv_quantization`` (the head's only change acceptance, never output)."""
        q = self.kv_quantization
        return KVCache() if q is None else QuantizedKVCache(q)

    def quantize_attention_caches(self, quant: Optional[KVQuantization], *head_dims: int):
        """``use_kv_quantization`` for a family whose ``make_cache`` uses
        ``full_attention_cache`` (cached arrays' last dimensions ``head_dims``)."""
        if quant is not None:
            for d in head_dims:
                quant.check_head_dim(d)
        self.kv_quantization = quant


@forwards_interface("language_model")
class LanguageModelWrapper(ModelInterface, nn.Module):
    """A checkpoint whose text model sits under ``language_model.*`` (the multimodal
    layout): the parameter tree keeps that level, the engine's calls reach the text model."""

    def __init__(self, args, language_model: MTPModel):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.language_model = language_model

    @property
    def text(self) -> MTPModel:
        return self.language_model
