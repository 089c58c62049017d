"""``mlx-mtp bench``: what MTP speculative decoding buys, in-process or against a server.

In-process (default): plain decoding, each fixed K and adaptive K on the same
prompts, interleaved; reports tok/s, speedup, acceptance per position, pass
costs, the ideal speedup they imply and the efficiency reached.

Server mode (``--server URL``): streaming requests to any OpenAI-compatible
server at several concurrency levels; TTFT, ITL/TPOT/E2E percentiles,
throughput, errors and the server's speculative statistics; ``--compare URL2``
runs a second server side by side.

Results: a table on the terminal, JSON/CSV files, PNG plots and a Markdown
snippet for the README in ``--output-dir``.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

DEFAULT_OUTPUT_DIR = "bench_out"


def add_arguments(p: argparse.ArgumentParser):
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = "\n\n".join(__doc__.strip().split("\n\n")[:4])
    p.epilog = (
        "examples:\n"
        "  mlx-mtp bench --model PATH --num-draft-tokens 0,1,2,3 --max-tokens 128 --repeats 3\n"
        "  mlx-mtp bench --model PATH --long-context 8k,32k --compare-mlx-lm --kv-bits 4\n"
        "  mlx-mtp bench --server http://127.0.0.1:8080 --concurrency 1,4,8,16 --rounds 2\n"
        "  mlx-mtp bench --server http://127.0.0.1:8080 --compare http://127.0.0.1:8081\n"
        "  mlx-mtp bench --server URL --compare URL --compare-extra-body "
        "'{\"num_draft_tokens\": 0}'   # MTP vs plain, one mlx-mtp server\n"
    )
    _add_common(p)
    _add_inprocess(p)
    _add_server(p)


def _add_common(p: argparse.ArgumentParser):
    from ..options import add_sampling_arguments

    g = p.add_argument_group("common")
    g.add_argument("--model", default=None,
                   help="In-process: local model directory (default: the embedded demo model). "
                        "Server mode: model id to request (default: first id from /v1/models)")
    g.add_argument("--prompts", default="builtin",
                   help="builtin (one prompt per kind: code, prose, qa, long), builtin:all, "
                        "builtin:code,qa, or a .txt/.json/.jsonl file")
    g.add_argument("--max-tokens", "-m", type=int, default=128, help="Tokens per request (128)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="Keep generating after EOS (fixed lengths; server: sends ignore_eos)")
    add_sampling_arguments(p)
    g.add_argument("--output-dir", "-o", default=DEFAULT_OUTPUT_DIR,
                   help=f"Where JSON, CSV, PNG and README_snippet.md go ({DEFAULT_OUTPUT_DIR}/)")
    g.add_argument("--no-plots", action="store_true", help="Skip the PNG plots")
    g.add_argument("--quiet", "-q", action="store_true", help="No progress bar")


def _add_inprocess(p: argparse.ArgumentParser):
    from ..options import (add_dtype_argument, add_kv_cache_arguments, add_lookup_arguments,
                           add_speed_arguments)

    g = p.add_argument_group("in-process")
    g.add_argument("--num-draft-tokens", "--spec-draft-n-max", default="0,1,2,3",
                   dest="num_draft_tokens",
                   help="Comma-separated K values; 0 is plain decoding (always run as baseline)")
    g.add_argument("--repeats", "-r", type=int, default=3,
                   help="Passes over all prompts and settings (3)")
    g.add_argument("--no-auto", action="store_true",
                   help="Skip the 'auto' row (adaptive K up to the largest K)")
    g.add_argument("--cost-reps", type=int, default=7,
                   help="Timed repetitions per pass-cost measurement (7, median)")
    g.add_argument("--draft-source", default="mtp", metavar="LIST",
                   help="Draft sources to compare, comma-separated from mtp (plain, each K, "
                        "auto), lookup (drafts copied from the context, no head), both "
                        "(per row and step, adaptive), block and block+mtp (the block "
                        "drafter --draft-model names, adaptive): e.g. mtp,lookup,both "
                        "(default mtp)")
    g.add_argument("--mtp-model", "--draft-model", dest="mtp_model", default=None,
                   metavar="PATH|ID",
                   help="A drafter for --model: a split MTP drafter or a block drafter "
                        "(DFlash, DFlash2, DSpark, EAGLE-3), as for generate")
    g.add_argument("--draft-kind", default=None, metavar="KIND",
                   help="What --draft-model is where its config does not say: mtp or a block "
                        "drafter kind (dflash, dflash2, dspark, eagle3)")
    add_lookup_arguments(g)
    g.add_argument("--warmup-tokens", type=int, default=16)
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="Feed prompts as raw text, without the chat template")
    g.add_argument("--chat-template-args", default=None,
                   help='JSON for the chat template, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--mtp-hidden", choices=["post_norm", "pre_norm"], default=None)
    add_dtype_argument(g)
    add_speed_arguments(g)
    add_kv_cache_arguments(g)
    g.add_argument("--prefill-step-size", type=int, default=2048)
    g.add_argument("--long-context", default=None, metavar="LENGTHS",
                   help="The long-context workload instead of --prompts: prompts of exactly these "
                        "token counts (e.g. 8k,32k,128k; 'speed': 1k-32k, doubling) from this "
                        "package's sources and a question; plain vs MTP at the largest K per "
                        "length: prefill and decode tok/s, acceptance per depth, peak memory")
    g.add_argument("--compare-mlx-lm", action="store_true",
                   help="With --long-context: also run mlx-lm's stream_generate on the same "
                        "checkpoint and prompts (with the same --kv-bits)")


def _add_server(p: argparse.ArgumentParser):
    g = p.add_argument_group("server mode")
    g.add_argument("--server", default=None, metavar="URL",
                   help="Benchmark an OpenAI-compatible server instead (e.g. http://127.0.0.1:8080)")
    g.add_argument("--compare", default=None, metavar="URL2", help="A second server for A/B")
    g.add_argument("--compare-model", default=None,
                   help="Model id for --compare (default: discovered)")
    g.add_argument("--extra-body", default=None, metavar="JSON",
                   help='Extra request fields for --server, e.g. \'{"num_draft_tokens": 3}\'')
    g.add_argument("--compare-extra-body", default=None, metavar="JSON",
                   help="Extra request fields for --compare (--compare may repeat --server's "
                        'URL: --compare-extra-body \'{"num_draft_tokens": 0}\' A/Bs MTP on one server)')
    g.add_argument("--label", default=None, help="Name of --server in tables")
    g.add_argument("--compare-label", default=None, help="Name of --compare in tables")
    g.add_argument("--concurrency", "-c", default="1,4,8,16",
                   help="Comma-separated concurrency levels (1,4,8,16)")
    g.add_argument("--rounds", type=int, default=2,
                   help="Requests per concurrent client at each level (2)")
    g.add_argument("--passes", type=int, default=1,
                   help="With --compare: run each level this many times per server, in "
                        "A B B A order, to average out drift; ratios get a per-pass spread (1)")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=300.0, help="Per-request timeout (s)")
    g.add_argument("--wait", type=float, default=0.0,
                   help="Wait up to this many seconds for the server to come up")
    g.add_argument("--no-warmup", action="store_true", help="Skip the warm-up request")


def command_line(args) -> str:
    """The ``mlx-mtp bench`` command that reproduces ``args`` (non-default flags only)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    defaults = vars(p.parse_args([]))
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    for a in p._actions:  # prefer the long name
        longs = [o for o in a.option_strings if o.startswith("--")]
        if longs:
            flags[a.dest] = longs[0]
    # The flags that define a run are always spelled out, even at their defaults.
    always = ({"server", "compare", "model", "concurrency", "rounds", "max_tokens"}
              if getattr(args, "server", None) else
              {"model", "num_draft_tokens", "max_tokens", "repeats"})
    first = ["server", "compare", "model", "num_draft_tokens", "concurrency", "rounds",
             "max_tokens", "repeats"]
    items = sorted(vars(args).items(), key=lambda kv: first.index(kv[0]) if kv[0] in first
                   else len(first))
    parts = ["mlx-mtp", "bench"]
    for dest, value in items:
        if dest not in defaults or dest in ("api_key", "quiet"):
            continue
        if value == defaults[dest] and not (dest in always and value is not None):
            continue
        if value is True:
            parts.append(flags[dest])
        elif value not in (False, None):
            parts += [flags[dest], str(value)]
    return shlex.join(parts)


def run(args) -> int:
    from ..options import UserError
    from .prompts import load_prompts

    if args.max_tokens < 2:
        raise UserError(f"--max-tokens must be >= 2 to time generation (got {args.max_tokens})")
    try:
        prompts = load_prompts(args.prompts)
    except (ValueError, OSError) as e:
        raise UserError(str(e))
    out_dir = Path(args.output_dir)
    if args.server:
        from . import server_cli

        return server_cli.run(args, prompts, out_dir, command_line(args))
    if args.compare:
        raise UserError("--compare needs --server (A/B of two servers)")
    if args.long_context or args.compare_mlx_lm:
        from . import long_context

        return long_context.run_cli(args, out_dir, command_line(args))
    from . import inprocess_cli

    return inprocess_cli.run(args, prompts, out_dir, command_line(args))
