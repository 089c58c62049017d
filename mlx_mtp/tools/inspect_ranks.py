"""``mlx-mtp inspect MODEL --ranks N [--distributed pipeline|tensor|expert]``: the memory each rank
of a split run would hold, from config.json and the safetensors headers only.

The model is built and its checkpoint opened lazily, and the split is the one
``load_distributed`` makes (``models/split_plan.py``): the same layers per rank, the same
weight bytes. Cache figures are ``inspect``'s own estimate (16-bit K/V, float32 recurrent
states) divided as the layers are: by rank for a pipeline, by heads for tensor, whole on
every rank for expert (attention is replicated).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from ..models.blocks.hybrid import HybridArgs
from ..models.blocks.expert_split import expert_split_problem
from ..models.distributed import MODES, choose_mode, tensor_split_problem
from ..models.io.layout import CheckpointError, args_dict, text_config
from ..models.split_plan import DistributedError, open_lazily, rank_shares


def linear_layers(config: dict) -> List[bool]:
    """Which trunk layers keep a recurrent state instead of K/V (Qwen hybrids' DeltaNet);
    empty when the config does not say (every layer is then counted as attention)."""
    text = text_config(config)
    if not any(k in text for k in ("layer_types", "full_attention_interval",
                                   "linear_num_value_heads")):
        return []
    try:
        args = HybridArgs.from_dict(args_dict(config))
    except (CheckpointError, ValueError, TypeError, KeyError, ZeroDivisionError):
        return []
    return [args.is_linear(i) for i in range(args.num_hidden_layers)]


def _cache_shares(config: dict, memory: dict, layers: List[tuple], mtp_layers: int,
                  mode: str) -> List[tuple]:
    """(KV bytes per 1k tokens, state bytes per sequence) per rank: the whole model's
    divided by heads (tensor), whole (expert), or by the attention / recurrent layers each
    rank holds, the MTP layers' K/V on rank 0 (pipeline)."""
    kv, state = memory["kv_bytes_per_1k_tokens"], memory["state_bytes_per_sequence"]
    if mode != "pipeline":
        n = len(layers)
        div = n if mode == "tensor" else 1
        return [(None if kv is None else kv // div, None if not state else state // div)] * n
    linear = linear_layers(config) or [False] * layers[0][1]  # rank 0 ends at the last
    attention = linear.count(False) + mtp_layers
    # State per sequence: the recurrent layers', else every layer's (DeepSeek-V4's windows).
    stateful = linear if any(linear) else [True] * len(linear)
    out = []
    for rank, (start, end) in enumerate(layers):
        own = linear[start:end]
        n_attention = own.count(False) + (mtp_layers if rank == 0 else 0)
        out.append((None if kv is None else kv * n_attention // attention,
                    None if not state else
                    state * stateful[start:end].count(True) // stateful.count(True)))
    return out


def rank_plan(path: Path, config: dict, memory: dict, ranks: int,
              mode: Optional[str] = None, mtp: bool = True) -> dict:
    """Every rank's layers, weight bytes and cache bytes under ``mode`` (None: the default
    ``--distributed`` picks), and why a split kind is not available for this model."""
    if ranks < 1:
        raise DistributedError("--ranks must be at least 1")
    model, _ = open_lazily(path, mtp)
    kinds = model.capabilities.splits
    args = model.text.args
    unavailable = {}
    for kind in MODES:
        if kind not in kinds:
            unavailable[kind] = f"{model.model_type} has no {kind} split"
        elif kind == "tensor" and (why := tensor_split_problem(args, ranks)):
            unavailable[kind] = why
        elif kind == "expert" and (why := expert_split_problem(model.text, ranks)):
            unavailable[kind] = why
    if not kinds:
        raise DistributedError(f"--ranks: {model.model_type} models cannot be split yet")
    mode = choose_mode(mode, args, ranks, kinds, model.model_type, model.text)
    shares = rank_shares(model, mode, ranks)
    caches = _cache_shares(config, memory, [s.layers for s in shares],
                           model.text.num_mtp_layers, mode)
    return {"ranks": ranks, "mode": mode, "unavailable": unavailable,
            "mtp_head_ranks": [s.rank for s in shares if s.holds_head and mtp],
            "per_rank": [{"rank": s.rank, "layers": list(s.layers),
                          "weights_bytes": s.weight_bytes,
                          "kv_bytes_per_1k_tokens": kv, "state_bytes_per_sequence": st}
                         for s, (kv, st) in zip(shares, caches)]}


def render_plan(plan: dict, size) -> List[tuple]:
    """Rows for ``inspect``'s report (``size``: its byte formatter)."""
    heads = plan["mtp_head_ranks"]
    where = ("MTP head on every rank" if len(heads) > 1 else
             f"MTP head on rank {heads[0]}" if heads else "no MTP head")
    rows = [("split", f"{plan['mode']} over {plan['ranks']} ranks; {where}")]
    for kind, why in plan["unavailable"].items():
        rows.append((f"no {kind}", why))
    for r in plan["per_rank"]:
        start, end = r["layers"]
        line = (f"layers {start}-{end - 1}, weights {size(r['weights_bytes'])}; "
                f"KV {size(r['kv_bytes_per_1k_tokens'])} per 1k tokens")
        if r["state_bytes_per_sequence"]:
            line += f"; state {size(r['state_bytes_per_sequence'])} per sequence"
        rows.append((f"rank {r['rank']}", line))
    return rows
