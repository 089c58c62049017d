"""MTP across processes: pipeline and tensor parallel over ``mx.distributed``.

Every rank runs the same decode code (``step.DecodeBatch``); the model it gets is a
``DistributedModel`` whose engine interface hides the split:

* **pipeline**: rank ``size-1`` holds the first layers (and the embedding), rank 0
  the last ones plus the final norm, the output projection, the MTP head and the
  embedding table the head needs. Hidden states travel rank ``r+1 -> r`` with
  send/recv, so rank 0 (which also prints and serves HTTP) samples and drafts. On the
  other ranks ``logits`` / ``mtp_forward`` are shape-only stand-ins: their results
  are never read, because everything the step reads goes through ``share``.
* **tensor**: every rank holds every layer with attention / DeltaNet / MLP / expert
  projections split by heads or intermediate columns (an ``all_sum`` after each
  mixer and MLP), the MTP layers split the same way; every rank runs the whole step.

``share(*arrays)`` is the step's one message per result: rank 0's values reach every
rank in one ``all_sum`` of a small int32 array (the others add zeros), so all ranks
roll back their caches identically and never diverge. Each communication op is
queued (``async_eval``, no host sync) as soon as it is built and depends on the
previous one: a stream runs its work in order, so every rank issues its ops in program
order (a ``recv`` has no inputs to order it otherwise) and no rank waits on an op its
peer has not reached.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten

from .io import layout
from .cache.kv import KVCache
from .cache.recurrent import RecurrentCache
from .blocks.hybrid import GatedAttention, GatedDeltaNetBase, SparseMoeBlock
from .interface import Capabilities, ModelInterface, forwards_interface
from .io.loader import (ModelLoadError, _upcast_cpu_experts, build_model, load_tokenizer,
                     model_config, quantize_and_cast, read_weights, resolve_model_path)

MODES = ("pipeline", "tensor")
# int32 words in the first all_sum of a ``broadcast``: a serve step's message fits.
MESSAGE_FRAME_WORDS = 256


class DistributedError(ModelLoadError):
    """The model cannot be split this way over this group (a user error: exit 2)."""


# -- choosing the mode ----------------------------------------------------------------

def ranks_are_local() -> bool:
    """All ranks on this machine (mlx.launch's hostfile lists only loopback hosts)."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if not hostfile:
        return True
    try:
        with open(hostfile) as f:
            hosts = json.load(f)
    except (OSError, ValueError):
        return False
    addrs = []
    for h in hosts if isinstance(hosts, list) else []:
        for a in (h if isinstance(h, list) else [h]):
            addrs.append(str(a.get("ssh", a) if isinstance(a, dict) else a))
            if isinstance(a, dict):
                addrs += [str(x) for x in a.get("ips", [])]
    return all(a.split(":")[0] in ("127.0.0.1", "localhost", "::1", "") for a in addrs)


def tensor_split_problem(args, size: int) -> Optional[str]:
    """Why ``args`` cannot be split ``size`` ways by heads (None: it can)."""
    checks = [("num_attention_heads", args.num_attention_heads),
              ("num_key_value_heads", args.num_key_value_heads),
              ("linear_num_key_heads", args.linear_num_key_heads),
              ("linear_num_value_heads", args.linear_num_value_heads),
              ("intermediate_size", args.intermediate_size)]
    if args.num_experts:
        checks += [("moe_intermediate_size", args.moe_intermediate_size),
                   ("shared_expert_intermediate_size", args.shared_expert_intermediate_size)]
    bad = [f"{name}={value}" for name, value in checks if value % size]
    return None if not bad else f"{', '.join(bad)} not divisible by {size} ranks"


def choose_mode(requested: Optional[str], args, size: int) -> str:
    """``requested``, or the default: tensor when the heads split evenly over ranks on
    this machine (its all_sums per layer need a fast link), else pipeline (one hidden
    per stage boundary per step, fine over Ethernet or Thunderbolt)."""
    if requested is not None:
        if requested not in MODES:
            raise DistributedError(f"--distributed must be one of {', '.join(MODES)}")
        if requested == "tensor" and (why := tensor_split_problem(args, size)):
            raise DistributedError(f"cannot split this model by tensors: {why}; "
                                   "use --distributed pipeline")
        return requested
    if size > 1 and ranks_are_local() and tensor_split_problem(args, size) is None:
        return "tensor"
    return "pipeline"


# -- pipeline split -------------------------------------------------------------------

def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def split_layers(layer_bytes: Sequence[int], head_bytes: int, size: int) -> List[Tuple[int, int]]:
    """Contiguous layer ranges per rank, balanced by bytes; rank 0 (which also holds
    ``head_bytes``) gets the last layers, rank ``size-1`` the first ones."""
    n = len(layer_bytes)
    if n < size:
        raise DistributedError(f"{n} layers cannot be split over {size} ranks")
    target = (sum(layer_bytes) + head_bytes) / size
    ranges, start = [None] * size, 0
    for stage, rank in enumerate(range(size - 1, 0, -1)):
        end, acc = start, 0
        left_after = size - 1 - stage  # ranks still to fill, rank 0 included
        while end < n - left_after and (end == start or acc + layer_bytes[end] <= target):
            acc += layer_bytes[end]
            end += 1
        ranges[rank], start = (start, end), end
    ranges[0] = (start, n)
    return ranges


# -- tensor split ---------------------------------------------------------------------

class _AllSumMoe(SparseMoeBlock):
    """A MoE block whose experts and shared expert hold a slice of the intermediate
    columns: their partial outputs add up, so one all_sum finishes the block."""

    def __call__(self, x):
        return mx.distributed.all_sum(super().__call__(x), group=self._group)


def _shard_by_rows(module, group, segments=1):
    shard_inplace(module, "all-to-sharded", segments=segments, group=group)


def _shard_mlp(mlp, group, reduce: bool):
    for proj in ("gate_proj", "up_proj"):
        _shard_by_rows(getattr(mlp, proj), group)
    if reduce:
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    else:
        shard_inplace(mlp.down_proj, "sharded-to-all", group=group)


def _shard_attention(attn: GatedAttention, group):
    N = group.size()
    for proj in ("q_proj", "k_proj", "v_proj"):  # q_proj rows: [q | gate] per head
        _shard_by_rows(getattr(attn, proj), group)
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    attn.n_heads //= N
    attn.n_kv_heads //= N


def _shard_delta_net(gdn: GatedDeltaNetBase, group):
    N = group.size()
    qkv_split = [gdn.key_dim, 2 * gdn.key_dim]  # conv channels: q | k | v, each by heads
    if "in_proj_qkvz" in gdn:  # Qwen3-Next: grouped per key head, contiguous by rows
        _shard_by_rows(gdn.in_proj_qkvz, group)
        _shard_by_rows(gdn.in_proj_ba, group)
    else:
        _shard_by_rows(gdn.in_proj_qkv, group, segments=qkv_split)
        for proj in ("in_proj_z", "in_proj_b", "in_proj_a"):
            _shard_by_rows(getattr(gdn, proj), group)
    shard_inplace(gdn.conv1d, lambda path, w: (0, qkv_split), group=group)
    shard_inplace(gdn, lambda path, w: 0 if path in ("dt_bias", "A_log") else None, group=group)
    gdn.out_proj = shard_linear(gdn.out_proj, "sharded-to-all", group=group)
    gdn.num_k_heads //= N
    gdn.num_v_heads //= N
    gdn.key_dim //= N
    gdn.value_dim //= N
    gdn.conv_dim //= N
    gdn.conv1d.groups = gdn.conv_dim


def shard_layer(layer, group):
    """Split one decoder layer (trunk or MTP) across ``group`` by heads / columns."""
    if getattr(layer, "is_linear", False):
        _shard_delta_net(layer.linear_attn, group)
    else:
        _shard_attention(layer.self_attn, group)
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        for proj in ("gate_proj", "up_proj"):
            _shard_by_rows(getattr(mlp.switch_mlp, proj), group)
        shard_inplace(mlp.switch_mlp.down_proj, "sharded-to-all", group=group)
        _shard_mlp(mlp.shared_expert, group, reduce=False)
        mlp.__class__ = _AllSumMoe
        mlp._group = group
    else:
        _shard_mlp(mlp, group, reduce=True)


# -- the model every rank decodes with ------------------------------------------------

@forwards_interface("inner")
class DistributedModel(ModelInterface):
    """The engine interface over a split model (see module doc); what the split does not
    change is the loaded model's (``inner``)."""

    # Ranks hold different parts of the model: nothing is compiled or sized per rank.
    capabilities = Capabilities(shares=True, distributed=True, draft_vocab=False, taps=False)

    def __init__(self, model, mode: str, group, layer_range: Optional[Tuple[int, int]] = None):
        self.inner = model
        self.mode = mode
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.layer_range = layer_range
        self._last_comm: Optional[mx.array] = None
        self.bytes_sent = 0  # this rank's payload bytes over the group (benchmarks)
        self.messages = 0

    def __getattr__(self, name):  # the loaded model's other attributes (args, sanitize...)
        return getattr(self.__dict__["inner"], name)

    @property
    def text(self):
        return self.inner.text

    @property
    def is_head(self) -> bool:
        """Whether this rank holds the output projection and the MTP head."""
        return self.mode == "tensor" or self.rank == 0

    # communication, chained in program order
    def _after_last(self, x: mx.array) -> mx.array:
        return x if self._last_comm is None else mx.depends(x, self._last_comm)

    def restart_comm_chain(self):
        """Issue the next collective without waiting on the last one (which a lost
        peer may never complete)."""
        self._last_comm = None

    def _issue(self, op: mx.array) -> mx.array:
        self._last_comm = op
        mx.async_eval(op)
        return op

    def _count(self, x: mx.array):
        self.bytes_sent += x.nbytes
        self.messages += 1

    def share(self, *arrays: mx.array) -> Tuple[mx.array, ...]:
        """Rank 0's ``arrays`` (integers) on every rank, in one small all_sum."""
        flat = mx.concatenate([a.reshape(-1).astype(mx.int32) for a in arrays])
        if self.rank == 0:
            mine = flat
        else:
            # Tensor ranks ran the same collectives to get here: depend on them, so this
            # all_sum runs after them as rank 0's does. Without it, queued early
            # (async_eval) it ran before this rank's layer all_sums while rank 0's ran
            # after its own: each rank waited on a different collective (deadlock,
            # reproduced). Pipeline ranks' stand-in values are never computed.
            mine = mx.zeros(flat.shape, mx.int32)
            if self.mode == "tensor":
                mine = mx.depends(mine, flat)
        total = self._issue(mx.distributed.all_sum(self._after_last(mine), group=self.group))
        self._count(flat)
        out, start = [], 0
        for a in arrays:
            out.append(total[start : start + a.size].reshape(a.shape).astype(a.dtype))
            start += a.size
        return tuple(out)

    def broadcast(self, payload: Optional[bytes] = None) -> bytes:
        """Rank 0's ``payload`` on every rank (the others pass None): one all_sum of
        ``MESSAGE_FRAME_WORDS`` int32 words (length, ranks present, then the bytes), and
        one more for the rest of a longer message. Ordered after the model's own
        collectives. Raises when a rank did not take part: after a peer's connection
        failed, the ring was seen to complete later all_sums without it."""
        frame = MESSAGE_FRAME_WORDS - 2
        words = np.zeros(0, np.int32)
        first = np.zeros(MESSAGE_FRAME_WORDS, np.int32)
        first[1] = 1  # every rank counts itself
        if self.rank == 0:
            data = payload or b""
            words = np.frombuffer(data + b"\0" * (-len(data) % 4), np.int32)
            first[0] = len(data)
            first[2 : 2 + min(frame, words.size)] = words[:frame]
        head = self._all_sum_words(first)
        if int(head[1]) != self.size:
            raise RuntimeError(f"{self.size - int(head[1])} rank(s) missing from a message")
        n = int(head[0])
        size = (n + 3) // 4
        parts = [head[2 : 2 + min(frame, size)]]
        if size > frame:
            rest = words[frame:] if self.rank == 0 else np.zeros(size - frame, np.int32)
            parts.append(self._all_sum_words(rest))
        return np.concatenate(parts).tobytes()[:n]

    def _all_sum_words(self, words: np.ndarray) -> np.ndarray:
        x = mx.array(words)  # other ranks: zeros (and their presence word)
        total = self._issue(mx.distributed.all_sum(self._after_last(x), group=self.group))
        if self.rank == 0:
            self._count(x)
        return np.array(total)  # the host sync: the message is read now

    # engine interface
    @property
    def layers(self):
        """The trunk layers this rank runs (its caches' order)."""
        if self.mode == "tensor":
            return self.inner.layers
        start, end = self.layer_range
        return self.text.model.layers[start:end]

    def trunk(self, inputs, cache=None, capture=False):
        if self.mode == "tensor":
            return self.inner.trunk(inputs, cache, capture)
        text = self.text
        start, end = self.layer_range
        layers = text.model.layers[start:end]
        B, L = inputs.shape
        dtype = layers[0].input_layernorm.weight.dtype
        if self.rank == self.size - 1:
            h = text.model.embed_tokens(inputs)
        else:
            template = mx.zeros((B, L, text.args.hidden_size), dtype)
            h = self._issue(mx.distributed.recv_like(template, self.rank + 1, group=self.group))
        cache = cache if cache is not None else [None] * len(layers)
        kv = next((c for c in cache if c is not None and c.is_trimmable()), None)
        fa_mask = kv.make_mask(L) if kv is not None else ("causal" if L > 1 else None)
        for layer, c in zip(layers, cache):
            h = layer(h, None if layer.is_linear else fa_mask, c, capture)
        if self.rank > 0:
            h = self._issue(mx.distributed.send(self._after_last(h.astype(dtype)),
                                                self.rank - 1, group=self.group))
            self._count(h)
            return h, h
        normed = text.model.norm(h)
        return normed, (normed if text.args.mtp_hidden == "post_norm" else h)

    def logits(self, hidden):
        if self.is_head:
            return self.inner.logits(hidden)
        return mx.zeros((*hidden.shape[:-1], self.text.args.vocab_size), mx.float32)

    def draft_logits(self, hidden, any_token: bool = False):
        if self.is_head:
            return self.inner.draft_logits(hidden, any_token)
        return self.logits(hidden)

    def mtp_forward(self, hidden, next_tokens, mtp_cache, depth: int = 0,
                    last_only: bool = False):
        if self.is_head:
            return self.inner.mtp_forward(hidden, next_tokens, mtp_cache, depth, last_only)
        # Without the head: the caches only track positions (one-element entries), so
        # batching, trimming and rollback work on them as on the head rank's.
        B, S = next_tokens.shape
        for c in mtp_cache:
            z = mx.zeros((B, 1, S, 1), hidden.dtype)
            c.update_and_fetch(z, z)
        return mx.zeros((B, 1 if last_only else S, hidden.shape[-1]), hidden.dtype)

    def make_cache(self):
        if self.mode == "tensor":
            return self.inner.make_cache()
        start, end = self.layer_range
        return [RecurrentCache() if l.is_linear else KVCache()
                for l in self.text.model.layers[start:end]]

    def use_kv_quantization(self, quant):
        if quant is not None:
            raise ValueError("--kv-bits is not available with --distributed yet")

    def make_mtp_cache(self):
        if self.is_head:
            return self.inner.make_mtp_cache()
        return [KVCache() for _ in range(self.num_mtp_layers)]  # positions only

    @property
    def num_mtp_layers(self) -> int:
        return self.text.args.mtp_num_hidden_layers

    @property
    def num_mtp_caches(self) -> int:
        return self.num_mtp_layers  # on every rank, the head's pruned or not

    def drafted_entries(self, k: int) -> List[int]:
        return [k - 1] * self.num_mtp_caches

    def set_draft_head(self, bits=None, group_size: int = 64, vocab=None):
        if self.is_head:
            self.inner.set_draft_head(bits, group_size, vocab)

    def trunk_with_taps(self, inputs, taps, cache=None, capture=False):
        raise NotImplementedError("hidden-state taps on a model split across processes")

    def set_compiled(self, on: bool, max_k: Optional[int] = None):
        """Not compiled (``capabilities.compilable`` is off)."""

    @property
    def compiled(self) -> bool:
        return False


# -- loading --------------------------------------------------------------------------

def _drop(module: nn.Module, name: str):
    if name in module:
        module.pop(name)


def _prune_pipeline(text, start: int, end: int, rank: int, size: int):
    """Keep only what this pipeline rank runs (lazy parameters: nothing read yet)."""
    for i, layer in enumerate(text.model.layers):
        if not start <= i < end:
            text.model.layers[i] = nn.Module()  # keeps the indices of the weight names
    if rank != 0:
        for name in ("lm_head", "mtp"):
            _drop(text, name)
        _drop(text.model, "norm")
        if rank != size - 1:
            _drop(text.model, "embed_tokens")


def load_distributed(path: Optional[str], mode: Optional[str] = None, group=None,
                     mtp: bool = True, mtp_hidden: Optional[str] = None, dtype=None):
    """Load this rank's part of the model at ``path``; returns (model, tokenizer).

    The checkpoint's tensors are opened lazily; a rank evaluates only the ones it keeps
    (in tensor mode, whole tensors are read once and sliced, one layer at a time).
    """
    group = group or mx.distributed.init()
    p = resolve_model_path(path)
    config = model_config(p, mtp, mtp_hidden)
    model = build_model(config, p / "config.json")
    if not model.capabilities.splits:
        raise DistributedError(f"--distributed cannot split {model.model_type} models yet; "
                               "run this model on one machine (without --distributed).")
    weights = model.sanitize(read_weights(p))
    # Every rank decides the dtype from the whole checkpoint, so all pick the same one.
    weights = quantize_and_cast(model, weights, layout.config_quantization(config), dtype)
    text = model.text
    mode = choose_mode(mode, text.args, group.size())
    layer_range = None
    if mode == "pipeline":
        head = sum(_nbytes(text[n]) for n in ("lm_head", "mtp") if n in text)
        head += _nbytes(text.model.embed_tokens) + _nbytes(text.model.norm)
        layer_range = split_layers([_nbytes(l) for l in text.model.layers], head, group.size())
        _prune_pipeline(text, *layer_range[group.rank()], group.rank(), group.size())
        layer_range = layer_range[group.rank()]
    wanted = {k for k, _ in tree_flatten(model.parameters())}
    missing = sorted(wanted - weights.keys())
    if missing:
        raise ModelLoadError(f"Weights in {p} do not match the model: missing {missing[:3]}")
    model.load_weights([(k, v) for k, v in weights.items() if k in wanted], strict=True)
    del weights
    _upcast_cpu_experts(model)
    model.eval()
    if mode == "tensor":
        for layer in list(text.model.layers) + (list(text.mtp.layers) if "mtp" in text else []):
            shard_layer(layer, group)
            mx.eval(layer.parameters())  # read and slice one layer at a time
    if mode == "pipeline" and "embed_tokens" not in text.model:  # a middle rank
        # The batch reads the model's dtype from the embedding: a one-element stand-in.
        dtype = text.model.layers[layer_range[0]].input_layernorm.weight.dtype
        text.model.embed_tokens = nn.Embedding(1, 1)
        text.model.embed_tokens.set_dtype(dtype)
    mx.eval(model.parameters())
    return DistributedModel(model, mode, group, layer_range), load_tokenizer(p, config)


def distributed_group(requested: Optional[str]):
    """The group to split the model over, None to run in one process (no backend, or a
    single rank without ``--distributed``)."""
    if not mx.distributed.is_available():
        if requested:
            raise DistributedError("--distributed: this MLX build has no distributed backend")
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 or requested else None


def shared_seed(group=None) -> int:
    """One random seed for all ranks (rank 0's), so unseeded requests agree everywhere."""
    group = group or mx.distributed.init()
    mine = mx.random.randint(0, 1 << 30, (1,)) if group.rank() == 0 else mx.zeros((1,), mx.int32)
    return int(mx.distributed.all_sum(mine.astype(mx.int32), group=group).item())
