"""MTP across processes: pipeline and tensor parallel over ``mx.distributed``.

Every rank runs the same decode code (``step.DecodeBatch``); the model it gets is a
``DistributedModel`` whose engine interface hides the split:

* **pipeline** (every family): rank ``size-1`` holds the first layers (and the
  embedding), rank 0 the last ones plus the final norm (``output_modules``), the output
  projection, the MTP head(s) and the embedding table the head needs. Each rank's trunk is
  the model's own cut to its layers, so the family's loop, masks and caches (KV, MLA
  latents, windows, DSA indexer keys, recurrent states) serve it unchanged; hidden states
  (a stream family's streams, ``stage_shape``) travel rank ``r+1 -> r`` with send/recv
  (``stage_layers`` takes the hidden, and the step's token ids beside it), so
  rank 0 (which also prints and serves HTTP) samples and drafts. On the other ranks
  ``logits`` / ``mtp_forward`` are shape-only stand-ins: their results are never read,
  because everything the step reads goes through ``share``.
* **tensor** (models whose ``capabilities.splits`` has it): every rank holds every
  layer with attention / DeltaNet / MLP / expert projections split by heads or
  intermediate columns (an ``all_sum`` after each mixer and MLP), the MTP layers split
  the same way (``shard``: ours for the Qwen layers, mlx-lm's for the others); every
  rank runs the whole step.
* **expert** (models with routed experts, ``blocks/expert_split.py``): every rank holds
  every layer with each MoE block's routed experts placed whole on ranks (rank r:
  experts [r·E/n, (r+1)·E/n)), the shared experts on rank 0, the rest whole; every rank
  runs the whole step, and one ``all_sum`` per MoE block adds the ranks' expert outputs.

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
import math
import os
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from .blocks.expert_split import expert_split_problem, split_experts
from .cache.kv import KVCache
from .interface import Capabilities, ModelInterface, forwards_interface
from .io.loader import (_upcast_cpu_experts, check_fits_memory, load_tokenizer,
                        resolve_model_path)
from .split_plan import DistributedError, open_lazily, rank_shares

MODES = ("pipeline", "tensor", "expert")
# int32 words in the first all_sum of a ``broadcast``: a serve step's message fits.
MESSAGE_FRAME_WORDS = 256


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


# Sizes a tensor split divides, among those a family's args name: heads, MLP and expert columns.
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "num_attention_groups",
               "linear_num_key_heads", "linear_num_value_heads", "intermediate_size",
               "ffn_hidden_size", "linear_num_heads", "o_groups")
MOE_SPLIT_SIZES = ("moe_intermediate_size", "shared_expert_intermediate_size",
                   "expert_ffn_hidden_size", "share_expert_dim")


def tensor_split_problem(args, size: int) -> Optional[str]:
    """Why ``args`` cannot be split ``size`` ways by heads (None: it can)."""
    names = SPLIT_SIZES + (MOE_SPLIT_SIZES if getattr(args, "num_experts", 1) else ())
    fields = vars(args)  # and the sizes of another kind of layer (Step-3.5's sliding ones)
    settings = [fields] + [v for v in fields.values() if isinstance(v, dict)]
    checks = [(name, s[name]) for s in settings for name in names if name in s]
    bad = [f"{name}={value}" for name, value in checks
           if isinstance(value, int) and value % size]
    return None if not bad else f"{', '.join(bad)} not divisible by {size} ranks"


def choose_mode(requested: Optional[str], args, size: int, kinds: Sequence[str] = MODES,
                model_type: str = "this model", text=None) -> str:
    """``requested``, or the default: tensor when the model has a tensor split
    (``kinds``) and its heads split evenly over ranks on this machine (its all_sums per
    layer need a fast link), else pipeline (one hidden per stage boundary per step, fine
    over Ethernet or Thunderbolt). Expert splits are asked for (``text``: the model whose
    experts are placed)."""
    if requested is not None:
        if requested not in MODES:
            raise DistributedError(f"--distributed must be one of {', '.join(MODES)}")
        if requested == "expert" and "expert" not in kinds:
            raise DistributedError(f"--distributed expert: {model_type} has no routed experts "
                                   "to place; use --distributed pipeline or tensor")
        if requested == "expert" and (why := expert_split_problem(text, size)):
            raise DistributedError(f"cannot split this model by experts: {why}; "
                                   "use --distributed pipeline")
        if requested == "tensor" and "tensor" not in kinds:
            raise DistributedError(f"--distributed tensor: {model_type} has no tensor split "
                                   "(mlx-lm has no shard() for it); use --distributed pipeline")
        if requested == "tensor" and (why := tensor_split_problem(args, size)):
            raise DistributedError(f"cannot split this model by tensors: {why}; "
                                   "use --distributed pipeline")
        return requested
    if ("tensor" in kinds and size > 1 and ranks_are_local()
            and tensor_split_problem(args, size) is None):
        return "tensor"
    return "pipeline"


# -- the model every rank decodes with ------------------------------------------------

@forwards_interface("inner")
class DistributedModel(ModelInterface):
    """The engine interface over a split model (see module doc); what the split does not
    change is the loaded model's (``inner``)."""

    # Ranks hold different parts of the model: nothing is compiled or sized per rank.
    capabilities = Capabilities(shares=True, distributed=True, draft_vocab=False)

    def __init__(self, model, mode: str, group, layer_range: Optional[Tuple[int, int]] = None,
                 hidden_dtype=mx.float32, mtp_counts: Tuple[int, int] = (0, 0),
                 num_layers: int = 0):
        """``layer_range``: the pipeline stage's trunk layers (``inner`` holds only them);
        ``hidden_dtype``: the dtype hiddens travel in; ``mtp_counts``: the head's MTP layers
        and caches (counted before a pipeline rank dropped its head); ``num_layers``: the
        whole trunk's."""
        self.inner = model
        self.mode = mode
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.layer_range = layer_range
        self.hidden_dtype = hidden_dtype
        self.mtp_counts = mtp_counts
        self.num_layers = num_layers
        self._last_comm: Optional[mx.array] = None
        # Taps: where every rank runs every layer, each has the whole residual stream and
        # runs a block drafter whole, replicated, with no message; a pipeline sends them
        # to rank 0 with the hidden.
        self.capabilities = replace(self.capabilities, taps=model.capabilities.taps)
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
        return self.whole_step or self.rank == 0

    @property
    def whole_step(self) -> bool:
        """Every rank runs every layer (tensor, expert); a pipeline rank only its own."""
        return self.mode != "pipeline"

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
            if self.whole_step:
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
    def trunk(self, inputs, cache=None, capture=False):
        if self.whole_step:
            return self.inner.trunk(inputs, cache, capture)
        return self._stage(inputs, cache, capture)[:2]

    def _stage(self, inputs, cache, capture, taps: Sequence[int] = ()):
        """Pipeline: this stage's layers (the model's trunk cut to them) from the tokens
        (the first stage) or what the previous stage sends: its hidden, then the taps (in
        ``taps`` order) of the layers before this stage, flattened into one array, so the
        taps reach rank 0 (the drafter's) in the pipeline's own messages."""
        text, (start, end) = self.text, self.layer_range
        before = [t for t in taps if t < start]  # tapped on the stages before this one
        own = [t - start for t in taps if start <= t < end]  # ids into this stage's layers
        B, L = inputs.shape
        if self.rank < self.size - 1:
            shape, H = text.stage_shape(B, L), text.args.hidden_size
            width = math.prod(shape[2:])  # the hidden's, flattened; then H per tap
            template = mx.zeros((B, L, width + len(before) * H) if before else shape,
                                self.hidden_dtype)
            received = self._issue(mx.distributed.recv_like(template, self.rank + 1,
                                                             group=self.group))
            hidden, *upstream = (mx.split(received, [width + i * H for i in range(len(before))],
                                          axis=-1) if before else (received,))
            h, tapped = text.stage_layers(inputs, hidden.reshape(shape), cache, capture, own)
        else:
            upstream = []
            h, tapped = text.trunk_layers(inputs, cache, capture, own)
        tapped = {**dict(zip(before, upstream)), **{start + i: v for i, v in tapped.items()}}
        if self.rank > 0:
            sent = [tapped[t] for t in taps if t < end]
            out = (h if not sent else
                   mx.concatenate([h.reshape(B, L, -1), *sent], axis=-1))
            out = self._issue(mx.distributed.send(self._after_last(out.astype(self.hidden_dtype)),
                                                  self.rank - 1, group=self.group))
            self._count(out)
            # Stand-ins, never read: the output layer's input shape, what was sent, no taps.
            return mx.zeros((B, L, text.args.hidden_size), h.dtype), out, []
        return (*text.trunk_outputs(h), [tapped[t] for t in taps])

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
        return mx.zeros((B, 1 if last_only else S, self.text.args.hidden_size), hidden.dtype)

    def use_kv_quantization(self, quant):
        """Each rank quantizes the caches it holds (its layers' in a pipeline, its heads' KV
        or the whole latents in a tensor split, every layer's in an expert split) by the
        family's own rule; the shared accept rolls every rank's back alike. A head-less
        pipeline rank's MTP caches only track positions and stay as they are."""
        self.inner.use_kv_quantization(quant)

    def make_mtp_cache(self):
        if self.is_head:
            return self.inner.make_mtp_cache()
        return [KVCache() for _ in range(self.num_mtp_caches)]  # positions only

    @property
    def num_mtp_layers(self) -> int:
        return self.mtp_counts[0]  # on every rank, the head's pruned or not

    @property
    def num_mtp_caches(self) -> int:
        return self.mtp_counts[1]

    def drafted_entries(self, k: int) -> List[int]:
        if self.is_head:
            return self.inner.drafted_entries(k)
        return [k - 1] * self.num_mtp_caches

    def set_draft_head(self, bits=None, group_size: int = 64, vocab=None):
        if self.is_head:
            self.inner.set_draft_head(bits, group_size, vocab)

    def trunk_with_taps(self, inputs, taps, cache=None, capture=False):
        """Pipeline: every stage's taps reach rank 0 with the hidden (``_stage``); the
        other ranks' taps are empty stand-ins (their drafter is a ``StageDrafter``)."""
        if self.whole_step:
            return self.inner.trunk_with_taps(inputs, taps, cache, capture)
        return self._stage(inputs, cache, capture, taps)

    def check_taps(self, taps: Sequence[int]):
        """Pipeline: against the whole trunk's layers, with no message (a stage holds only
        its own)."""
        if self.whole_step:
            return self.inner.check_taps(taps)
        missing = sorted(t for t in set(taps) if not 0 <= t < self.num_layers)
        if missing:
            raise ValueError(f"no trunk layer {missing} to tap ({self.num_layers} layers)")

    def use_block_drafter(self, drafter):
        """A pipeline rank without the output holds a ``StageDrafter`` in its place: the
        drafter runs on rank 0, which receives every tap."""
        if drafter is not None and not self.is_head:
            drafter = StageDrafter(drafter.spec, self.text.args.vocab_size)
        self.inner.use_block_drafter(drafter)

    def set_compiled(self, on: bool, max_k: Optional[int] = None):
        """Not compiled (``capabilities.compilable`` is off)."""

    @property
    def compiled(self) -> bool:
        return False


class StageDrafter(nn.Module):
    """A block drafter's stand-in on a pipeline rank without the output: the drafter runs on
    rank 0, and every rank verifies rank 0's drafts (the step's draft message), so here the
    drafts are shape-only, never read, and no context is kept (no caches; taps ignored). It
    holds no weights: the drafter's, opened lazily, are never read on this rank."""

    num_caches = 0

    def __init__(self, spec, vocab_size: int):
        super().__init__()
        self.spec, self.vocab_size = spec, vocab_size

    def bind(self, embed, head):
        """Nothing to bind: it reads neither."""

    def make_cache(self) -> list:
        return []

    def add_context(self, taps, cache, tokens=None, lengths=None):
        """No context on this rank."""

    def propose(self, anchor: mx.array, cache: list, n: int, draw):
        zeros = mx.zeros((anchor.shape[0], self.vocab_size), mx.float32)
        picks, log_qs = zip(*(draw(zeros, j) for j in range(n)))
        return mx.stack(picks, axis=1), list(log_qs)


# -- loading --------------------------------------------------------------------------

def _drop(module: nn.Module, name: str):
    if name in module:
        module.pop(name)


def _prune_pipeline(text, start: int, end: int, rank: int, size: int, hidden_dtype):
    """Keep only what this pipeline rank runs: its trunk layers (the trunk's list cut to
    them, so the family's own loop, masks and caches cover just these, and what a tap reads),
    and on rank 0 the head. Parameters are still lazy: nothing dropped is ever read."""
    trunk = text.model
    trunk.layers = trunk.layers[start:end]
    if rank != 0:
        for name in ("lm_head", "mtp"):
            _drop(text, name)
        for module in text.output_modules():
            if not any(module is m for m in text.tap_modules()):
                trunk.pop(_child_name(trunk, module))
        if rank != size - 1:  # the batch reads the model's dtype from the embedding
            stand_in = nn.Embedding(1, 1)
            stand_in.set_dtype(hidden_dtype)
            trunk[_child_name(trunk, trunk.embed_tokens)] = stand_in


def _child_name(module: nn.Module, child: nn.Module) -> str:
    """The name ``module`` holds ``child`` under (Nemotron-H: ``embeddings``, ``norm_f``)."""
    return next(k for k, v in module.children().items() if v is child)


def _hidden_dtype(text) -> mx.Dtype:
    """The dtype of the trunk's hiddens: the embedding's output's."""
    emb = text.model.embed_tokens  # a quantized table's weight is packed uint32
    return (emb.scales if isinstance(emb, nn.QuantizedEmbedding) else emb.weight).dtype


def load_distributed(path: Optional[str], mode: Optional[str] = None, group=None,
                     mtp: bool = True, mtp_hidden: Optional[str] = None, dtype=None,
                     mtp_model=None):
    """Load this rank's part of the model at ``path``; returns (model, tokenizer).
    ``mtp_model``: a split MTP drafter whose head replaces the model's, held where the
    head is (pipeline: rank 0; tensor: split by heads like the model's own MTP layers).

    The checkpoint's tensors are opened lazily and this rank's share checked against its
    memory limit before any is read; a rank then reads only the tensors it keeps (in
    tensor mode, whole tensors are read and sliced, one layer at a time).
    """
    group = group or mx.distributed.init()
    p = resolve_model_path(path)
    model, config = open_lazily(p, mtp, mtp_hidden, dtype, mtp_model)
    text = model.text
    kinds = model.capabilities.splits
    if not kinds:
        raise DistributedError(f"--distributed cannot split {model.model_type} models yet; "
                               "run this model on one machine (without --distributed).")
    mode = choose_mode(mode, text.args, group.size(), kinds, model.model_type, text)
    share = rank_shares(model, mode, group.size())[group.rank()]
    check_fits_memory(share.weight_bytes, f"rank {group.rank()}'s share of {p} ({mode})",
                      "launch more ranks (docs/distributed.md)")
    hidden_dtype = _hidden_dtype(text)
    mtp_counts = (text.num_mtp_layers, len(text.make_mtp_cache()))
    num_layers = len(text.model.layers)
    layer_range = None
    if mode == "pipeline":
        layer_range = share.layers
        _prune_pipeline(text, *layer_range, group.rank(), group.size(), hidden_dtype)
    _upcast_cpu_experts(model)
    model.eval()
    if mode == "tensor":
        text.shard(group)
    elif mode == "expert":
        split_experts(text, group)
    mx.eval(model.parameters())
    return (DistributedModel(model, mode, group, layer_range, hidden_dtype, mtp_counts,
                             num_layers),
            load_tokenizer(p, config))


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
