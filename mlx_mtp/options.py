"""Command-line options shared by several verbs, defined once, and the user-error type.

Nothing here imports MLX: the CLI builds parsers before the platform is set up.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Optional

from .decode import DRAFT_SOURCES, MAX_DRAFT_TOKENS, check_num_draft_tokens
from .drafters.lookup import LookupSettings
from .drafters.registry import SOURCES


class UserError(Exception):
    """A problem with the user's input: the CLI prints the message and exits with code 2."""


def add_model_arguments(p: argparse.ArgumentParser, server: bool = False):
    p.add_argument("--model", default=None,
                   help="Local model directory or Hugging Face id org/name[@revision], "
                        "downloaded to the Hugging Face cache (default: the embedded demo "
                        "model)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--num-draft-tokens", "--spec-draft-n-max", type=int, default=3,
                   dest="num_draft_tokens",
                   help=f"MTP draft tokens per step, 1-{MAX_DRAFT_TOKENS} (default 3); 0: no "
                        "drafts from any source (plain decoding, the head is not loaded)")
    g.add_argument("--no-mtp", action="store_true", help="Plain decoding; MTP head not loaded")
    p.add_argument("--fixed-k", action="store_true",
                   help="Always draft K tokens (default: adapt K to measured acceptance/cost)")
    # llama-server's speculative flags, so its command lines work unchanged.
    p.add_argument("--spec-type", default=None, metavar="TYPE",
                   help="llama-server compatibility: draft-mtp (the default) or none (= --no-mtp)")
    p.add_argument("--spec-draft-n-min", type=int, default=None, metavar="N",
                   help="llama-server compatibility: 0 (K adapts, drafting may pause) or the "
                        "value of --spec-draft-n-max (= --fixed-k)")
    p.add_argument("--spec-draft-p-min", type=float, default=None, metavar="P",
                   help="llama-server compatibility: accepted and not used (K adapts to the "
                        "measured acceptance instead of a per-token confidence cut-off)")
    add_draft_source_arguments(p)
    # mlx-vlm's spelling: --draft-model DIR --draft-kind mtp.
    p.add_argument("--mtp-model", "--draft-model", dest="mtp_model", default=None,
                   metavar="PATH|ID",
                   help="A drafter for --model (a directory or hub id), checked to fit it: a "
                        "split MTP drafter (mlx-vlm's layout, e.g. an mlx-community "
                        "...-MTP-4bit repo, or one written by `convert --split-mtp`) or a block "
                        "drafter reading the trunk's hidden states (z-lab DFlash or DFlash2, "
                        "DSpark)")
    p.add_argument("--draft-kind", default=None, metavar="KIND",
                   help="What --draft-model is where its config does not say: mtp or a block "
                        "drafter kind (dflash, dflash2, dspark, eagle3)")
    p.add_argument("--mtp-hidden", choices=["post_norm", "pre_norm"], default=None,
                   help="Trunk hidden state fed to the MTP head (default post_norm)")
    add_dtype_argument(p)
    add_speed_arguments(p)
    add_kv_cache_arguments(p)
    add_vision_arguments(p, server)
    p.add_argument("--distributed", choices=["pipeline", "tensor", "expert"], default=None,
                   help="Split the model over the ranks of `mlx.launch` (on by itself when "
                        "launched with more than one rank): pipeline (layers), tensor "
                        "(heads; the families mlx-lm can shard) or expert (routed experts "
                        "placed whole on ranks; MoE models). Default: tensor when the model has "
                        "it, the heads divide evenly and all ranks are on this machine, else "
                        "pipeline")


def add_vision_arguments(p, server: bool):
    # Images (issue 42): the tower of a checkpoint that has one is read at its first image.
    p.add_argument("--vision", action="store_true",
                   help="Load the vision tower at start (default: at the first image); "
                        "refused for checkpoints without one")
    if server:  # where a request's image may come from besides a data URL
        p.add_argument("--allow-image-files", action="store_true",
                       help="Let requests name local image files (file:// URLs or paths); "
                            "off by default: a request could read any image this process can")
        p.add_argument("--allow-image-urls", action="store_true",
                       help="Let requests name remote image URLs, fetched by the server; off "
                            "by default (send data URLs)")


def add_draft_source_arguments(p):
    p.add_argument("--draft-source", choices=DRAFT_SOURCES, default=None,
                   help="Where drafts come from: the MTP head (mtp), the context, copying the "
                        "continuation of the longest recent match in the prompt and output "
                        "(lookup: no head needed, it is not loaded), or per row and step "
                        "whichever the measured acceptance and step cost favour, a context run "
                        "extended by the head (both); the block drafter --draft-model names "
                        "(block), extended by the head past its block (block+mtp). Lossless "
                        "either way. Default: block+mtp with a block drafter, else both, or "
                        "plain decoding with --no-mtp")
    add_lookup_arguments(p)


def add_lookup_arguments(p):
    """How context drafts are found (``drafters/lookup.py``); defaults measured (docs/lookup.md)."""
    lookup = LookupSettings()
    p.add_argument("--lookup-max-draft", type=int, default=lookup.max_draft, metavar="N",
                   help=f"Context tokens verified per step at most, 1-32 "
                        f"(default {lookup.max_draft})")
    p.add_argument("--lookup-min-match", type=int, default=lookup.min_match, metavar="N",
                   help=f"Shortest repeated tail, in tokens, that proposes a copy "
                        f"(default {lookup.min_match})")


@dataclass(frozen=True)
class Drafting:
    """What the flags ask of drafting (``drafting_from_args``)."""

    k: int  # head drafts per step at most; 0: the head is not loaded
    adaptive: bool  # K adapts to the measured acceptance and step cost (not --fixed-k)
    sources: Optional[object]  # decode.draft_source.DraftSources; None: no context drafts


def drafting_from_args(args, distributed: bool = False) -> Drafting:
    """K, whether it adapts, and the draft source, from the flags (llama-server's map onto
    ours). ``distributed``: the model is split across processes, every rank drafts alike:
    from the head or the block drafter (rank 0's drafts, shared), never from the context."""
    k = _num_draft_tokens(args)
    n_min = getattr(args, "spec_draft_n_min", None)
    adaptive = not (getattr(args, "fixed_k", False) or (k and n_min == k))
    source = _draft_source(args, k)
    reads_taps = SOURCES[source].drafter is not None and SOURCES[source].drafter.needs_taps
    if distributed and source != "mtp" and not reads_taps:  # the block drafter: rank 0's
        if getattr(args, "draft_source", None) is not None:
            raise UserError("--draft-source lookup/both is not available on a model split "
                            "across processes; use --draft-source mtp")
        source = "mtp"
    if SOURCES[source].drafter is None:
        return Drafting(k, adaptive, None)
    from .decode.draft_source import DraftSources

    try:
        default = LookupSettings()
        min_match = getattr(args, "lookup_min_match", default.min_match)
        settings = LookupSettings(min_match=min_match,
                                  max_match=max(default.max_match, min_match),
                                  max_draft=getattr(args, "lookup_max_draft", default.max_draft))
    except ValueError as e:
        raise UserError(str(e).replace("lookup max_draft", "--lookup-max-draft")
                        .replace("lookup min_match", "--lookup-min-match"))
    # Context drafts alone need no head: it is not loaded.
    return Drafting(k if SOURCES[source].capped_by_k else 0, adaptive,
                    DraftSources(source, settings, adaptive=adaptive))


def _draft_source(args, k: int) -> str:
    """``--draft-source``, or the default: both, or none at all (mtp with K=0) without the
    head; --num-draft-tokens 0 turns drafting off, from every source."""
    from .drafters.block.load import own_drafter

    source = getattr(args, "draft_source", None)
    own = own_drafter(getattr(args, "model", None))  # its mtp.* holds a drafter, not a head
    if source is None:
        if k > 0 and (own or block_drafter_from_args(args)) is not None:
            return "block+mtp"  # the block drafter --draft-model names (or the model's own)
        return "both" if k > 0 else "mtp"
    if k > 0 and own is not None and SOURCES[source].head and SOURCES[source].drafter in (
            None, SOURCES["lookup"].drafter):
        raise UserError(f"--draft-source {source} needs an MTP head; {args.model} has none (its "
                        "mtp.* holds DeepSeek-V4 DSpark stages): use --draft-source block")
    no_head = getattr(args, "no_mtp", False) or getattr(args, "spec_type", None) == "none"
    if k == 0 and no_head and SOURCES[source].head:
        raise UserError(f"--draft-source {source} needs the MTP head, which --no-mtp leaves "
                        "out; use --draft-source lookup to draft from the context alone")
    if k == 0 and not no_head and SOURCES[source].drafter is not None:
        raise UserError(f"--num-draft-tokens 0 turns drafting off, --draft-source {source} "
                        "asks for context drafts: leave out one of the two (--no-mtp "
                        "--draft-source lookup drafts from the context alone)")
    return source


def block_drafter_from_args(args):
    """(path, kind) of the block drafter ``--draft-model`` names (``drafters/block``); None
    when it names a split MTP drafter (its config says which, else ``--draft-kind``) or
    nothing."""
    path, kind = getattr(args, "mtp_model", None), getattr(args, "draft_kind", None)
    if path is None:
        if kind not in (None, "mtp"):
            raise UserError(f"--draft-kind {kind} needs --draft-model naming the drafter")
        return None
    if kind == "mtp":
        return None
    from .drafters.block import KINDS
    from .drafters.block.load import kind_for

    if kind is not None and kind not in KINDS:
        raise UserError(f"--draft-kind {kind} is not supported: mtp or one of {sorted(KINDS)}")
    kind = kind_for(path, kind)
    if kind is None:
        return None
    return path, kind


def mtp_model_from_args(args):
    """The split drafter ``--mtp-model`` names (None: the model's own head)."""
    path = getattr(args, "mtp_model", None)
    if path is not None and (getattr(args, "no_mtp", False)
                             or getattr(args, "spec_type", None) == "none"):
        raise UserError("--mtp-model names a drafter, which --no-mtp leaves unused: drop one "
                        "of the two")
    return path


def add_dtype_argument(p):
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   default="auto",
                   help="Float weights at load. auto (default): on the CPU, bf16/fp16 "
                        "checkpoints are upcast to float32 (which MLX's CPU backend multiplies "
                        "with BLAS) when this machine's measured matmul costs say it pays and "
                        "the float32 copy fits a quarter of the memory: measured once per "
                        "machine and model width (well under a second), stored beside the step "
                        "costs, shown by `mlx-mtp doctor --model M`; as stored on GPUs and for "
                        "quantized checkpoints. Quantized layers are never changed")


def add_speed_arguments(p):
    """Options that change speed, never output (``apply_model_options`` applies them)."""
    p.add_argument("--draft-head-bits", type=int, choices=[4, 8], default=None,
                   help="Draft from a 4- or 8-bit copy of the output layer (lossless: output "
                        "is unchanged, only acceptance may drop). Off by default: on MLX's CPU "
                        "backend a quantized matmul with bf16 activations measured ~8x slower "
                        "than the dense one; on Apple GPUs, where drafting reads the whole "
                        "output layer per draft token, it is expected to pay")
    p.add_argument("--draft-vocab", default="auto", metavar="N|auto",
                   help="Draft only among the N most frequent tokens (the ranking in the "
                        "model's draft_vocab.json, made by `mlx-mtp draft-vocab`): drafts read "
                        "N rows of the output layer instead of all. Lossless: output is "
                        "unchanged, only acceptance may drop. auto (default): the size the "
                        "ranking file recommends; without a file, for Qwen3.5/3.6 tokenizers, "
                        "the shipped ranking at the size the cost model picks, re-sized from "
                        "the tokens generated; else off. 0 = off")
    p.add_argument("--compile-steps", action="store_true",
                   help="Run the Gated DeltaNet layers of decode and verify steps as "
                        "mx.compile'd graphs, traced at load for every K up to "
                        "--num-draft-tokens. Off by default: on MLX's CPU backend it measured "
                        "0.85-1.13x on a 1024-wide bf16 model and, on the demo model, faster at "
                        "fixed K=3 but slower with adaptive K (docs/verify-cost.md)")


def add_kv_cache_arguments(p):
    """Quantized attention caches, as mlx-lm's flags (``apply_kv_cache_options`` applies them)."""
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="Store the trunk's attention keys and values quantized to 4 or 8 bits "
                        "(mlx-lm's --kv-bits; ~0.28x / 0.53x of 16-bit at group size 64). "
                        "Decoding stays exact against plain decoding with the same cache; "
                        "recurrent states (DeltaNet, Mamba-2) and sliding windows keep their "
                        "precision; DSA indexer keys are quantized too (docs/quantized-kv.md). "
                        "Off by default")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="Values per quantization scale of --kv-bits (default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=0, metavar="N",
                   help="With --kv-bits: keep a sequence's cache in full precision until it "
                        "holds N tokens (mlx-lm's flag; one sequence only: the server's batches "
                        "are quantized from the first token). Default 0")


def apply_kv_cache_options(model, args):
    """``--kv-bits`` & co. on a loaded model (its ``use_kv_quantization``)."""
    bits = getattr(args, "kv_bits", None)
    if bits is None:
        return
    from .models.cache.quantized import KVQuantization

    try:
        model.use_kv_quantization(KVQuantization(bits, args.kv_group_size,
                                                 args.quantized_kv_start))
    except ValueError as e:
        raise UserError(str(e)) from None


def apply_model_options(model, args):
    """Settings applied to a loaded model: ``--draft-head-bits`` and ``--draft-vocab`` (MTP
    models only), ``--compile-steps``."""
    bits = getattr(args, "draft_head_bits", None)
    vocab = draft_vocab_from_args(model, args)
    if (bits is not None or vocab is not None) and model.num_mtp_layers > 0:
        model.set_draft_head(bits, vocab=vocab)
    if vocab is None and _shipped_vocab_applies(model, args):
        from .models.draft import vocab_auto as draft_vocab_auto
        from .models.io.loader import resolve_model_path

        draft_vocab_auto.install(model, resolve_model_path(args.model), bits)
    else:
        model.use_draft_vocab_tuner(None)  # a size given or off: never re-sized
    if getattr(args, "compile_steps", False):
        if model.capabilities.distributed:
            raise UserError("--compile-steps is not available for this model (distributed)")
        k = 0 if getattr(args, "no_mtp", False) else getattr(args, "num_draft_tokens", 0)
        k = max(k, default=0) if isinstance(k, (list, tuple)) else k if isinstance(k, int) else 0
        if model.capabilities.compilable:
            model.set_compiled(True, k)  # traced here for every K up to k


def load_from_args(args, mtp: bool, group=None):
    """The model and tokenizer the flags name, ``apply_model_options`` applied: in this
    process, or this rank's part of a model split over ``group`` (``--distributed``)."""
    mtp = mtp and not getattr(args, "no_mtp", False)  # K > 0 with --no-mtp: a block drafter's
    block = block_drafter_from_args(args)
    if group is None:
        from .models.io.loader import load

        model, tokenizer = load(args.model, mtp=mtp, mtp_hidden=args.mtp_hidden,
                                dtype=args.dtype,
                                mtp_model=None if block else mtp_model_from_args(args),
                                vision=getattr(args, "vision", False))
    else:
        from .models.distributed import load_distributed

        model, tokenizer = load_distributed(args.model, args.distributed, group, mtp=mtp,
                                            mtp_hidden=args.mtp_hidden, dtype=args.dtype,
                                            mtp_model=None if block else mtp_model_from_args(args))
    if block is None:  # a checkpoint may carry its own (DeepSeek-V4's DSpark stages)
        from .drafters.block.load import own_drafter

        block = own_drafter(args.model)
    if block is not None:  # split: see DistributedModel.use_block_drafter
        from .drafters.block.load import attach_block_drafter

        attach_block_drafter(model, *block)
    if mtp and model.num_mtp_layers == 0 and model.block_drafter is None:
        raise UserError(f"{args.model or 'the model'}: its config declares no MTP layers, so "
                        "there is no head to draft with; run it with --no-mtp (--draft-source "
                        "lookup drafts from the context without a head), or graft one with "
                        "`mlx-mtp add-mtp`")
    apply_model_options(model, args)
    apply_kv_cache_options(model, args)
    return model, tokenizer


def describe_choices(model) -> str:
    """What ``--dtype auto`` and ``--draft-vocab`` chose for ``model`` (one stats line)."""
    dtype = model.dtype_choice or "as stored"
    tuner = model.draft_vocab_tuner
    head = model.text.draft_head if model.num_mtp_layers else None
    if tuner is not None:
        vocab = tuner.describe()
    elif head is not None and head.restricted:
        vocab = f"{head.size} tokens (draft_vocab.json)"
    else:
        vocab = "whole vocabulary"
    kv = model.kv_quantization
    kv = "" if kv is None else (f"; KV cache: {kv.bits}-bit, groups of {kv.group_size}"
                                + (f", from token {kv.start}" if kv.start else ""))
    return f"Weights: {dtype}; draft vocabulary: {vocab}{kv}"


def _shipped_vocab_applies(model, args) -> bool:
    """``--draft-vocab auto`` without a ranking file: the shipped ranking, if it matches."""
    from .models.draft import vocab as draft_vocab
    from .models.io.loader import resolve_model_path

    # Not over a distributed group: ranks holding different parts of the model would size
    # the subset differently.
    return (getattr(args, "draft_vocab", None) == "auto" and model.num_mtp_layers > 0
            and model.capabilities.draft_vocab
            and not (resolve_model_path(args.model) / draft_vocab.FILE).exists())


def draft_vocab_from_args(model, args):
    """The token ids ``--draft-vocab`` restricts drafts to (None: the whole vocabulary)."""
    value = getattr(args, "draft_vocab", None)
    if value is None or value == "0" or model.num_mtp_layers == 0:
        return None
    from .models.draft import vocab as draft_vocab
    from .models.io.loader import resolve_model_path

    try:
        return draft_vocab.select(resolve_model_path(args.model), draft_vocab.parse_size(value),
                                  model.text.args.vocab_size)
    except draft_vocab.DraftVocabError as e:
        raise UserError(str(e))


def add_sampling_arguments(p: argparse.ArgumentParser):
    p.add_argument("--temp", type=float, default=None,
                   help="Sampling temperature, 0 = greedy (default: the model's "
                        "generation_config.json, else 0)")
    from_config = "(default: the model's generation_config.json, else off)"
    p.add_argument("--top-p", type=float, default=None,
                   help=f"Keep the smallest set of tokens whose probability reaches P {from_config}")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"Keep the K most probable tokens {from_config}")
    p.add_argument("--min-p", type=float, default=None,
                   help="Drop tokens below P times the top token's probability "
                        f"{from_config}")
    p.add_argument("--seed", type=int, default=None,
                   help="Random seed; a seeded output is reproducible (default: none, random)")
    p.add_argument("--coupled", action="store_true", default=None,
                   help="Sampled drafts share the target's per-position noise: with --seed the "
                        "output equals --no-mtp's token for token at any K, for some "
                        "acceptance (serve: the default of requests' mtp_coupled)")
    # Exact under MTP (decode/logits.py); serve: defaults for requests that do not set them.
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="Divide positive / multiply negative logits of tokens in the prompt "
                        "or the output so far (1 = off)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="Subtract from the logits of tokens already in the output (-2..2)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="Subtract this times each token's count in the output (-2..2)")


def _num_draft_tokens(args) -> int:
    """K from the flags (0: plain decoding)."""
    spec_type = getattr(args, "spec_type", None)
    if spec_type not in (None, "draft-mtp", "none"):
        raise UserError(f"--spec-type {spec_type} is not supported: mlx-mtp drafts with the "
                        "model's own MTP head (--spec-type draft-mtp) or not at all "
                        "(--spec-type none)")
    if spec_type == "none" or getattr(args, "no_mtp", False) and (
            getattr(args, "mtp_model", None) is None or block_drafter_from_args(args) is None):
        return 0  # --no-mtp leaves the head out; a block drafter still drafts
    k = args.num_draft_tokens
    try:
        check_num_draft_tokens(k, "--num-draft-tokens")
    except ValueError as e:
        raise UserError(f"{e}; 0 (or --no-mtp) is plain decoding.")
    n_min = getattr(args, "spec_draft_n_min", None)
    if k and n_min is not None and n_min not in (0, k):
        raise UserError(f"--spec-draft-n-min {n_min} is not supported: use 0 (K adapts between "
                        f"0 and {k} to the measured acceptance and step cost) or {k}, the value "
                        "of --spec-draft-n-max (always draft K tokens, as --fixed-k)")
    p_min = getattr(args, "spec_draft_p_min", None)
    if p_min is not None:
        if not 0.0 <= p_min <= 1.0:
            raise UserError(f"--spec-draft-p-min must be between 0 and 1 (got {p_min})")
        print("mlx-mtp: note: --spec-draft-p-min has no effect: K adapts to the measured "
              "acceptance instead of stopping drafts at a confidence threshold.",
              file=sys.stderr)
    return k


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_defaults(args, model_defaults: dict) -> dict:
    """Flags over the model's generation_config.json (keys temp, top_p, top_k, min_p)."""
    out = dict(model_defaults)
    for name in ("temp", "top_p", "top_k", "min_p", "coupled") + PENALTIES:
        v = getattr(args, name, None)
        if v is not None:
            out[name] = v
    return out


def sampling_from_args(args, model_defaults: dict):
    """SamplingParams from flags and the model's defaults; bad values are a UserError."""
    from .decode.sampling import SamplingParams

    d = sampling_defaults(args, model_defaults)
    try:
        return SamplingParams(temperature=d.get("temp", 0.0), top_p=d.get("top_p", 1.0),
                              top_k=d.get("top_k", 0), min_p=d.get("min_p", 0.0),
                              seed=getattr(args, "seed", None),
                              coupled=bool(d.get("coupled", False)),
                              **{name: d[name] for name in PENALTIES if name in d})
    except ValueError as e:
        raise UserError(str(e))


def parse_json_arg(value: Optional[str], flag: str) -> dict:
    if value is None:
        return {}
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} is not valid JSON ({e}); example: '{{\"enable_thinking\": false}}'")
    if not isinstance(out, dict):
        raise UserError(f"{flag} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return out
