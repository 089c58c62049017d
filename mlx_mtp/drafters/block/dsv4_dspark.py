"""DeepSeek-V4's own DSpark drafter: the stages a V4 checkpoint ships under ``mtp.<stage>.*``
when its text config names ``dspark_target_layer_ids`` (then ``mtp.*`` holds these stages and
no MTP head: mlx-vlm 0.7.10 reads such a checkpoint the same way).

Config (the target's): ``dspark_target_layer_ids`` (taps, 0-based), ``dspark_block_size``
(drafts per pass; ``BlockSpec.block_size`` is one more, the anchor's slot),
``dspark_noise_token_id`` (fills the slots after the anchor), ``dspark_markov_rank``,
``num_nextn_predict_layers`` (stages). A tap is the mean over the trunk's ``hc_mult`` streams.

Each stage is a V4 block (MLA with sinks, top-k MoE, hyper-connections, released names) whose
attention reads the context beside the block: the context is ``main_norm(main_proj(taps))``
(stage 0's), projected into each stage's single shared key/value head once
(``add_context``) and kept in its ``ContextCache`` within the trunk's sliding window. A pass
over ``n`` drafts runs the block ``[anchor, noise x (n-1)]`` bidirectionally, slot ``j``
predicting the token after slot ``j``; the last stage's ``hc_head`` and ``norm`` collapse the
streams and the target's head scores them. Slot ``j``'s draft is drawn from
``logits[j] + markov(prev)`` (the anchor, then the previous draft): rejection sampling uses
that q. ``confidence_head`` (optional) is not used for drafting and is not loaded.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from ...models.blocks.dsv4 import Block, HyperHead, hc_block, inv_freq, stream_input
from ...models.cache import prepare_chunk
from ...models.cache.context import ContextCache
from ...models.families.deepseek_v4 import Model as V4Model
from ...models.families.deepseek_v4 import ModelArgs
from ...models.io.files import load_safetensors
from ...models.io.loader import weight_files
from .base import BlockDraftModel, BlockSpec, Draw
from .dspark import MarkovHead

KIND = "deepseek_v4_dspark"
FIELDS = ("dspark_target_layer_ids", "dspark_block_size", "dspark_noise_token_id",
          "dspark_markov_rank", "num_nextn_predict_layers")


def declares_stages(config: dict) -> bool:
    """Whether a model's config says its ``mtp.*`` holds DSpark stages."""
    text = config.get("text_config") or config
    return bool(text.get("dspark_target_layer_ids"))


def stage_spec(config: dict) -> BlockSpec:
    """The drafter's ``BlockSpec`` from a V4 config (ValueError naming a bad field)."""
    text = config.get("text_config") or config
    missing = [k for k in FIELDS if not isinstance(text.get(k), (int, list))]
    if missing:
        raise ValueError(f"DeepSeek-V4 DSpark config: {', '.join(missing)} missing")
    taps, block = text["dspark_target_layer_ids"], text["dspark_block_size"]
    if not all(isinstance(t, int) and 0 <= t < text["num_hidden_layers"] for t in taps):
        raise ValueError(f"DeepSeek-V4 DSpark config: dspark_target_layer_ids {taps} must be "
                         f"layers 0..{text['num_hidden_layers'] - 1}")
    if not isinstance(block, int) or block < 1 or text["num_nextn_predict_layers"] < 1:
        raise ValueError("DeepSeek-V4 DSpark config: dspark_block_size and "
                         "num_nextn_predict_layers must be >= 1")
    return BlockSpec(kind=KIND, hidden_size=text["hidden_size"], vocab_size=text["vocab_size"],
                     target_layer_ids=tuple(taps), block_size=block + 1,
                     mask_token_id=text["dspark_noise_token_id"],
                     num_target_layers=text["num_hidden_layers"])


class DSparkStage(nn.Module):
    """One stage: a V4 block (``block``: released ``attn``/``ffn``/``hc_*`` names); stage 0
    also ``main_proj``/``main_norm``, the last ``hc_head``/``norm``."""

    def __init__(self, args: ModelArgs, n_taps: int, first: bool, last: bool):
        super().__init__()
        H = args.hidden_size
        self.block = Block(args, "sliding_attention", hashed=False)
        if first:
            self.main_proj = nn.Linear(n_taps * H, H, bias=False)
            self.main_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if last:
            self.hc_head = HyperHead(args)
            self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def add_context(self, ctx: mx.array, cache: ContextCache, freqs: mx.array):
        positions = (cache.offset[:, None] + mx.arange(ctx.shape[1]))[:, None]
        kv = self.block.attn.keys_values(ctx, positions, freqs)
        cache.update_and_fetch(kv, kv[..., :0])  # the key is the value: stored once

    def __call__(self, streams: mx.array, cache: ContextCache, freqs: mx.array) -> mx.array:
        b = self.block
        streams = hc_block(streams, b.hc_attn_fn, b.hc_attn_base, b.hc_attn_scale, b.args,
                           lambda x: self.attend(b.attn_norm(x), cache, freqs))
        return hc_block(streams, b.hc_ffn_fn, b.hc_ffn_base, b.hc_ffn_scale, b.args,
                        lambda x: b.ffn(b.ffn_norm(x), None))

    def attend(self, x: mx.array, cache: ContextCache, freqs: mx.array) -> mx.array:
        """The block's queries over [context, block], the block right after its row's
        context, with the attention's sinks; no mask inside the block."""
        attn = self.block.attn
        positions = (cache.positions()[:, None] + mx.arange(x.shape[1]))[:, None]
        q, _ = attn.queries(x, positions, freqs)
        kv = attn.keys_values(x, positions, freqs)
        keys, _, seen = cache.attend(kv, kv[..., :0], causal=False, window=attn.window)
        return attn.output(attn.attend(q, keys, mx.where(seen, 0.0, -mx.inf)), positions, freqs)


class DeepseekV4DSpark(BlockDraftModel):
    """The stages as a ``BlockDraftModel`` (module doc); the target's embedding and head."""

    def __init__(self, args: ModelArgs, spec: BlockSpec, markov_rank: int):
        super().__init__()
        self.spec, self.hc_mult, self.n_experts = spec, args.hc_mult, args.n_routed_experts
        n, taps = args.num_nextn_predict_layers, len(spec.target_layer_ids)
        self.stages = [DSparkStage(args, taps, i == 0, i == n - 1) for i in range(n)]
        self.markov_head = MarkovHead(args.vocab_size, args.vocab_size, markov_rank)
        self._freqs = inv_freq(args.rope_head_dim, args.rope_parameters["main"])
        mx.eval(self._freqs)
        self._embed = self._head = None

    def bind(self, embed, head):
        self._embed, self._head = embed, head
        return self

    def make_cache(self) -> list:
        return [ContextCache.empty(1) for _ in self.stages]

    @property
    def num_caches(self) -> int:
        return len(self.stages)

    def add_context(self, taps: Sequence[mx.array], cache: list, tokens=None, lengths=None):
        first = self.stages[0]
        ctx = first.main_norm(first.main_proj(mx.concatenate(list(taps), axis=-1)))
        prepare_chunk(cache, ctx.shape[1], lengths)
        for stage, c in zip(self.stages, cache):
            stage.add_context(ctx, c, self._freqs)

    def block_logits(self, anchor: mx.array, cache: list, n: int) -> mx.array:
        """Logits (B, n, V) of the block ``[anchor, noise x (n-1)]``, before the Markov bias."""
        if not 0 < n <= self.spec.max_draft:
            raise ValueError(f"{KIND}: {n} drafts asked of a pass that proposes "
                             f"1..{self.spec.max_draft}")
        noise = mx.full((anchor.shape[0], n - 1), self.spec.mask_token_id, anchor.dtype)
        h = stream_input(self._embed(mx.concatenate([anchor[:, None], noise], axis=1)),
                         self.hc_mult)
        for stage, c in zip(self.stages, cache):
            h = stage(h, c, self._freqs)
        last = self.stages[-1]
        return self._head(last.norm(last.hc_head(h)))

    def propose(self, anchor: mx.array, cache: list, n: int, draw: Draw):
        logits = self.block_logits(anchor, cache, n)
        prev, picks, log_qs = anchor, [], []
        for j in range(n):
            prev, log_q = draw(logits[:, j] + self.markov_head(prev), j)
            picks.append(prev)
            log_qs.append(log_q)
        return mx.stack(picks, axis=1), log_qs

    def sanitize(self, weights: dict) -> dict:
        """Released ``mtp.<stage>.*`` names -> ``stages.<stage>.*`` (through the V4 family's
        naming: ``attn``/``ffn``/``hc_*`` into the block, experts stacked; the key/value
        norm as ``attn.kv_norm``, DeepSeek's name, or ``attn.norm``); the Markov head is
        model-level wherever a stage carries it."""
        markov = {re.sub(r"^(mtp\.\d+\.)?", "", k): v for k, v in weights.items()
                  if re.match(r"^(mtp\.\d+\.)?markov_head\.", k)}
        stages = {k: v for k, v in weights.items() if re.match(r"^mtp\.\d+\.", k)
                  and not re.match(r"^mtp\.\d+\.(markov_head|confidence_head)\.", k)}
        stages = {k.replace(".attn.kv_norm.", ".attn.norm."): v for k, v in stages.items()}
        ours = V4Model.stack_experts({V4Model.our_name(k): v for k, v in stages.items()},
                                     self.n_experts)
        out = {re.sub(r"^mtp\.layers\.", "stages.", k): v for k, v in ours.items()}
        return {**out, **markov}


def stage_weights(path: Path) -> dict:
    """The ``mtp.*`` and ``markov_head.*`` tensors of the checkpoint at ``path``."""
    return {k: v for f in weight_files(path) for k, v in load_safetensors(f).items()
            if k.startswith(("mtp.", "markov_head."))}


def check_layout(weights: dict):
    """Refuse a checkpoint whose ``mtp.*`` mixes an MTP head with the DSpark stages: the
    released V4 DSpark layout has the stages only (the reference reads it so too)."""
    head = sorted(k for k in weights if re.match(r"^mtp\.\d+\.(e_proj|h_proj|enorm|hnorm)\.", k))
    if head:
        raise ValueError(f"{head[0]}: an MTP head beside DSpark stages under mtp.* is not a "
                         "released DeepSeek-V4 layout (the stages replace the head)")


def load_stages(path: Path, config: dict) -> DeepseekV4DSpark:
    """The drafter the V4 checkpoint at ``path`` (its ``config``) carries under ``mtp.*``."""
    text = config.get("text_config") or config
    spec = stage_spec(config)
    weights = stage_weights(path)
    check_layout(weights)
    drafter = DeepseekV4DSpark(ModelArgs.from_dict(text), spec,
                               int(text["dspark_markov_rank"]))
    weights = drafter.sanitize(weights)
    drafter.load_weights(list(weights.items()))
    return drafter

