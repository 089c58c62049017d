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
import datetime as _dt
import os
import platform
import shlex
from pathlib import Path
from typing import List

from ..decode.lookup import LookupSettings

DEFAULT_OUTPUT_DIR = "bench_out"


def _int_list(flag: str, value: str, lo: int, hi: int = 1 << 30) -> List[int]:
    from ..options import UserError

    try:
        out = [int(x) for x in str(value).split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, e.g. 0,1,2,3 (got {value!r})")
    if not out:
        raise UserError(f"{flag} is empty")
    bad = [x for x in out if not lo <= x <= hi]
    if bad:
        raise UserError(f"{flag}: values must be between {lo} and {hi} (got {bad})")
    return list(dict.fromkeys(out))


def add_arguments(p: argparse.ArgumentParser):
    from ..options import add_dtype_argument, add_speed_arguments, add_sampling_arguments

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = "\n\n".join(__doc__.strip().split("\n\n")[:4])
    p.epilog = (
        "examples:\n"
        "  mlx-mtp bench --model PATH --num-draft-tokens 0,1,2,3 --max-tokens 128 --repeats 3\n"
        "  mlx-mtp bench --server http://127.0.0.1:8080 --concurrency 1,4,8,16 --rounds 2\n"
        "  mlx-mtp bench --server http://127.0.0.1:8080 --compare http://127.0.0.1:8081\n"
        "  mlx-mtp bench --server URL --compare URL --compare-extra-body "
        "'{\"num_draft_tokens\": 0}'   # MTP vs plain, one mlx-mtp server\n"
    )
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
                        "(per row and step, adaptive): e.g. mtp,lookup,both (default mtp)")
    lookup = LookupSettings()  # the defaults, measured (docs/lookup.md)
    g.add_argument("--lookup-max-draft", type=int, default=lookup.max_draft, metavar="N",
                   help=f"Context tokens verified per step at most, 1-32 "
                        f"(default {lookup.max_draft})")
    g.add_argument("--lookup-min-match", type=int, default=lookup.min_match, metavar="N",
                   help=f"Shortest repeated tail that proposes a copy (default {lookup.min_match})")
    g.add_argument("--warmup-tokens", type=int, default=16)
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="Feed prompts as raw text, without the chat template")
    g.add_argument("--chat-template-args", default=None,
                   help='JSON for the chat template, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--mtp-hidden", choices=["post_norm", "pre_norm"], default=None)
    add_dtype_argument(g)
    add_speed_arguments(g)
    g.add_argument("--prefill-step-size", type=int, default=2048)

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


def machine_info() -> dict:
    import mlx.core as mx

    from .. import __version__

    info = {"platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "mlx": getattr(mx, "__version__", "?"), "device": _device_name(mx.default_device()),
            "mlx_mtp": __version__, "date": _dt.datetime.now().isoformat(timespec="seconds")}
    try:
        import mlx_lm

        info["mlx_lm"] = mlx_lm.__version__
    except Exception:  # pragma: no cover - mlx-lm is a dependency
        pass
    from ..platform.blas import describe

    info["blas"] = describe()  # in-process runs: which BLAS ran the CPU matmuls
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other work sharing the CPU
    return info


def _device_name(device) -> str:
    kind = getattr(getattr(device, "type", None), "name", None)
    return kind or str(device)


def _progress(quiet: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True, disable=quiet)


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
        return _run_server(args, prompts, out_dir)
    if args.compare:
        raise UserError("--compare needs --server (A/B of two servers)")
    return _run_inprocess(args, prompts, out_dir)


# --- in-process ---------------------------------------------------------------------------
def _plots_on(args, console) -> bool:
    """Whether to draw the PNG plots: asked for and matplotlib importable (else say how)."""
    from .. import plots

    if args.no_plots:
        return False
    if plots.pyplot() is None:
        console.print(plots.missing_note("PNG plots"), highlight=False, markup=False)
        return False
    return True


def _run_inprocess(args, prompts, out_dir: Path) -> int:
    from rich.markup import escape

    from ..decode import MAX_DRAFT_TOKENS
    from ..decode.prompt import build_prompt, encode_prompt
    from ..models.loader import generation_defaults, load, parameter_count, resolve_model_path
    from ..options import (UserError, apply_model_options, mtp_model_from_args, parse_json_arg,
                           sampling_from_args)
    from . import report
    from .inprocess import BenchConfig, make_settings, run_inprocess, work_units

    ks = _int_list("--num-draft-tokens", args.num_draft_tokens, 0, MAX_DRAFT_TOKENS)
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1 (got {args.repeats})")
    if args.cost_reps < 1:
        raise UserError(f"--cost-reps must be >= 1 (got {args.cost_reps})")
    sampling = sampling_from_args(args, generation_defaults(args.model))
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    model_path = resolve_model_path(args.model)
    console = report.console()
    console.print(f"[bold]mlx-mtp bench[/bold]: loading {escape(str(model_path))}",
                  highlight=False)
    model, tokenizer = load(args.model, mtp=max(ks) > 0, mtp_hidden=args.mtp_hidden,
                            dtype=args.dtype, mtp_model=mtp_model_from_args(args))
    apply_model_options(model, args)
    encoded = []
    for p in prompts:
        text = build_prompt(tokenizer, p.text, None, template_args, args.ignore_chat_template)
        try:
            encoded.append(encode_prompt(tokenizer, text))
        except ValueError as e:
            raise UserError(f"prompt {p.name}: {e}")
    sources, lookup = _draft_sources(args)
    cfg = BenchConfig(ks=ks, max_tokens=args.max_tokens, repeats=args.repeats, sampling=sampling,
                      auto=not args.no_auto, ignore_eos=args.ignore_eos, cost_reps=args.cost_reps,
                      warmup_tokens=args.warmup_tokens, prefill_step_size=args.prefill_step_size,
                      draft_sources=sources, lookup=lookup)
    settings = make_settings(ks, cfg.auto, sources)
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    with _progress(args.quiet) as prog:
        task = prog.add_task("starting", total=work_units(len(settings), len(prompts),
                                                            args.repeats))
        result = run_inprocess(model, prompts, encoded, cfg, eos,
                               progress=lambda d: prog.update(task, advance=1, description=d))
    rows = result["settings"]

    n_params = parameter_count(model)
    meta = {
        "mode": "inprocess", "command": command_line(args), "machine": machine_info(),
        "model": str(model_path), "model_type": getattr(model, "model_type", None),
        "parameters": n_params, "dtype": str(model.text.model.norm.weight.dtype),
        "prompts": [{"name": p.name, "category": p.category, "tokens": len(ids)}
                    for p, ids in zip(prompts, encoded)],
        "config": {"num_draft_tokens": ks, "max_tokens": args.max_tokens,
                   "repeats": args.repeats, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
                   "seed": sampling.seed, "ignore_eos": args.ignore_eos, "auto": cfg.auto,
                   "chat_template": not args.ignore_chat_template,
                   "draft_head_bits": args.draft_head_bits,
                   "draft_vocab": (None if model.text.draft_head is None
                                   else model.text.draft_head.size),
                   "compile_steps": args.compile_steps, "draft_sources": list(sources),
                   "lookup_min_match": lookup.min_match, "lookup_max_draft": lookup.max_draft,
                   # A penalty over prompt tokens discourages copying them (lookup drafts).
                   "repetition_penalty": sampling.repetition_penalty,
                   "presence_penalty": sampling.presence_penalty,
                   "frequency_penalty": sampling.frequency_penalty},
    }
    title = (f"{model_path.name}: {n_params / 1e6:.1f}M params, {len(prompts)} prompts x "
             f"{args.repeats} repeats, {args.max_tokens} tokens, "
             f"{'greedy' if sampling.greedy else f'temp {sampling.temperature}'}")
    console.print(report.inprocess_table(rows, title))
    for r in rows:
        if r.get("draft_source", "mtp") != "mtp":
            console.print(_source_line(r), highlight=False, markup=False)
    costs = result["costs"]
    console.print(
        f"plain step {costs.get('plain_step_ms', float('nan')):.2f} ms; c_verify(K) = trunk "
        "over K+1 tokens / plain step, c_draft = one MTP call / plain step; ideal = E[tokens/"
        "step] / (c_verify + K*c_draft); realised/ideal = speedup / ideal; nodes/step: graph "
        "primitives one step launches (own: without the recurrence call's), state KB/step: "
        "recurrent state written, both expected over the measured rejections", highlight=False,
        markup=False)
    console.print(report.graph_markdown(result["graphs"]), highlight=False, markup=False)
    if result["predictions"]:
        from .cost_model import markdown as cost_markdown

        console.print("cost model, this run's acceptance: predicted speedup (c_verify(K))",
                      highlight=False, markup=False)
        console.print(cost_markdown(result["predictions"]), highlight=False, markup=False)

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out_dir / "inprocess.json", {
            **meta, "settings": rows,
            "costs": {**costs, "c_verify": {str(k): v for k, v in costs.get("c_verify", {}).items()},
                      "per_prompt": [{**c, "verify_s": {str(k): v for k, v in c["verify_s"].items()}}
                                     for c in costs.get("per_prompt", [])]},
            "graphs": result["graphs"], "predictions": result["predictions"],
            "runs": [r.to_dict() for r in result["runs"]]}),
        report.write_csv(out_dir / "inprocess.csv", rows, report.INPROCESS_CSV),
        report.write_csv(out_dir / "inprocess_runs.csv", [r.to_dict() for r in result["runs"]]),
    ]
    with_plots = _plots_on(args, console)
    if with_plots:
        written += report.plot_inprocess(rows, out_dir, title=f"{model_path.name}: tok/s vs K")
    snippet = out_dir / "README_snippet.md"
    snippet.write_text(readme_snippet(meta, rows, costs,
                                      plots_dir=out_dir if with_plots else None,
                                      graphs=result["graphs"],
                                      predictions=result["predictions"]))
    written.append(snippet)
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False, markup=False)
    bad = [r["setting"] for r in rows if r.get("outputs_match_plain") is False]
    if bad:
        console.print(f"[bold red]warning[/bold red]: greedy output differs from plain decoding "
                      f"for {', '.join(bad)}", highlight=False)
    return 0


def _draft_sources(args):
    """``--draft-source`` as a list, and the lookup settings; bad values are a UserError."""
    from ..options import UserError

    sources = [s.strip() for s in args.draft_source.split(",") if s.strip()]
    bad = [s for s in sources if s not in ("mtp", "lookup", "both")]
    if bad or not sources:
        raise UserError(f"--draft-source takes a comma-separated list of mtp, lookup, both "
                        f"(got {args.draft_source!r})")
    try:
        lookup = LookupSettings(min_match=args.lookup_min_match,
                                max_match=max(8, args.lookup_min_match),
                                max_draft=args.lookup_max_draft)
    except ValueError as e:
        raise UserError(str(e).replace("lookup max_draft", "--lookup-max-draft")
                        .replace("lookup min_match", "--lookup-min-match"))
    return sources, lookup


def _source_line(r: dict) -> str:
    """Acceptance by source of a context-drafting setting, and what it drafted per step."""
    def rate(v):
        return "-" if v is None else f"{100 * v:.0f}%"
    mal = r.get("mean_acceptance_length")
    return (f"{r['setting']}: context drafts accepted {r['lookup_accepted_tokens']}/"
            f"{r['lookup_draft_tokens']} ({rate(r['lookup_acceptance_rate'])}), head "
            f"{rate(r['mtp_acceptance_rate'])}; mean accepted length "
            f"{'-' if mal is None else f'{mal:.2f}'}; steps by drafted length "
            f"{r['steps_by_k']}")


def readme_snippet(meta: dict, rows: List[dict], costs: dict,
                   plots_dir: Path = None, graphs: dict = None, predictions: list = None) -> str:
    from . import report

    m = meta["machine"]
    prompts = ", ".join(f"{p['name']} ({p['tokens']} tok)" for p in meta["prompts"])
    cfg = meta["config"]
    lines = [
        "## Benchmark",
        "",
        f"Generated by `mlx-mtp bench` on {m['date'][:10]} "
        f"({m['machine']}, {m['cpu_count']} cores, {m['device']}, mlx {m['mlx']}):",
        "",
        "```sh",
        meta["command"],
        "```",
        "",
        f"Model `{Path(meta['model']).name}` ({meta['parameters'] / 1e6:.1f}M parameters, "
        f"{meta['dtype'].replace('mlx.core.', '')}); prompts: {prompts}; "
        f"{cfg['max_tokens']} new tokens, {cfg['repeats']} repeats, "
        f"{'greedy' if cfg['temperature'] == 0 else 'temperature ' + str(cfg['temperature'])}. "
        "Settings run interleaved (every setting on each prompt in turn), so drift cancels.",
        "",
        report.inprocess_markdown(rows),
        "",
        *_category_table(rows),
        "- **gen tok/s**: all prompts' generated tokens / their decode time, median over "
        "repeats ± half the range; the first token (prompt processing) is excluded. **speedup**: the same ratio to plain decoding, "
        "median over repeats (every repeat runs all settings on all prompts).",
        "- **accept/pos**: share of drafts accepted at each position; **mean acc len** = "
        "1 + accepted / drafts (tokens per verify step).",
        f"- **c_verify**, **c_draft**: one trunk pass over K+1 tokens and one MTP draft call, "
        f"relative to a plain decoding step ({costs.get('plain_step_ms', float('nan')):.2f} ms "
        "here). **ideal** = E[tokens/step] / (c_verify + K·c_draft); **realised/ideal** = "
        "speedup / ideal. **auto**: adaptive K up to the largest K.",
        "- **nodes/step**: graph primitives one step launches, counted with `mx.export_to_dot` "
        "on its lazy outputs (own: without the nodes of the Gated DeltaNet recurrence call, one "
        "fused kernel on Apple GPUs); **state KB/step**: recurrent state written (verify, plus "
        "the replay after a rejection), both expected over the measured rejections; "
        "**syncs/step**: host waits per decode step.",
        "- **lossless**: greedy outputs identical to plain decoding in every run.",
    ]
    load = m.get("load_avg_1m")
    if load is not None and m.get("cpu_count") and load > 0.5 * m["cpu_count"]:
        lines.append(f"- The 1-minute load average was {load} on {m['cpu_count']} cores when the "
                     "run ended: other processes shared the CPU, so timings are noisy.")
    if graphs:
        from . import report as _report

        lines += ["", "Per step part:", "", _report.graph_markdown(graphs)]
    if predictions:
        from .cost_model import markdown as cost_markdown

        lines += ["", "Cost model (`mlx_mtp/bench/cost_model.py`) on this run's acceptance: "
                  "predicted speedup = E_K / (c_verify(K) + K·c_draft), c_verify(K) in brackets:",
                  "", cost_markdown(predictions)]
    if plots_dir is not None:
        lines += ["", f"![tok/s vs K]({(plots_dir / 'tok_s_vs_k.png').as_posix()})",
                  f"![acceptance per position]({(plots_dir / 'acceptance_per_pos.png').as_posix()})"]
    return "\n".join(lines) + "\n"


def _category_table(rows: List[dict]) -> List[str]:
    """Markdown lines: speedup per prompt kind (median of per-prompt ratios to plain)."""
    cats = list(dict.fromkeys(c for r in rows for c in r.get("speedup_by_category") or {}))
    spec_rows = [r for r in rows if r["k"] > 0]
    if not cats or not spec_rows:
        return []
    lines = ["Speedup by prompt kind:", "", "| setting | " + " | ".join(cats) + " |",
             "|---|" + "---:|" * len(cats)]
    for r in spec_rows:
        by = r["speedup_by_category"]
        lines.append(f"| {r['setting']} | " + " | ".join(
            f"{by[c]:.2f}×" if c in by else "-" for c in cats) + " |")
    return lines + [""]


# --- server ---------------------------------------------------------------------------------
def _run_server(args, prompts, out_dir: Path) -> int:
    from rich.markup import escape


    from ..options import UserError, parse_json_arg
    from . import report
    from .server import (ServerError, Target, request_units, resolve_targets,
                         run_server_bench)

    levels = _int_list("--concurrency", args.concurrency, 1, 1024)
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1 (got {args.rounds})")
    if args.passes < 1:
        raise UserError(f"--passes must be >= 1 (got {args.passes})")
    targets = [Target(args.server, args.model, args.label or "", args.api_key,
                      parse_json_arg(args.extra_body, "--extra-body"))]
    if args.compare:
        targets.append(Target(args.compare, args.compare_model, args.compare_label or "",
                              args.api_key,
                              parse_json_arg(args.compare_extra_body, "--compare-extra-body")))
        if targets[0].label == targets[1].label:
            targets[1].label += " (B)"
    elif args.compare_extra_body or args.compare_model or args.compare_label:
        raise UserError("--compare-model/--compare-label/--compare-extra-body need --compare URL2")
    console = report.console()
    try:
        notes = resolve_targets(targets, wait=args.wait)
    except ServerError as e:
        raise UserError(str(e))
    for n in notes:
        console.print(f"[yellow]note[/yellow]: {escape(n)}", highlight=False)
    for t in targets:
        console.print(f"[bold]{escape(t.label)}[/bold]: {escape(t.url)} "
                      f"model={escape(t.model or '(server default)')}", highlight=False)
    temp = args.temp if args.temp is not None else 0.0
    req_kw = dict(temperature=temp, endpoint=args.endpoint, timeout=args.timeout,
                  ignore_eos=args.ignore_eos)
    # Sampling flags go to the server as request fields (mlx-mtp's names; vLLM and
    # llama-server take the same ones); unset ones leave the server's defaults.
    extra = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k),
                               ("min_p", args.min_p), ("seed", args.seed),
                               ("repetition_penalty", args.repetition_penalty),
                               ("presence_penalty", args.presence_penalty),
                               ("frequency_penalty", args.frequency_penalty),
                               ("mtp_coupled", args.coupled)) if v is not None}
    if extra:
        req_kw["extra_body"] = extra
    with _progress(args.quiet) as prog:
        task = prog.add_task("requests", total=args.passes * request_units(
            levels, args.rounds, len(targets)))
        try:
            result = run_server_bench(targets, prompts, levels, args.rounds, args.max_tokens,
                                      warmup=not args.no_warmup, passes=args.passes,
                                      tick=lambda: prog.update(task, advance=1), **req_kw)
        except ServerError as e:
            raise UserError(str(e))
    rows = result["levels"]
    console.print(report.server_table(
        rows, f"{len(prompts)} prompts, {args.max_tokens} max tokens, {args.rounds} requests per "
              f"client per level x {args.passes} pass(es), temp {temp}"))
    ab = report.compare_rows(rows) if args.compare else []
    if ab:
        console.print(report.compare_table(ab))
    for r in rows:
        for e in r["error_samples"]:
            console.print(f"[red]error[/red] {escape(r['server'])} c={r['concurrency']}: "
                          f"{escape(e)}", highlight=False)
    meta = {"mode": "server", "command": command_line(args), "machine": machine_info(),
            "targets": [{"label": t.label, "url": t.url, "model": t.model,
                         "extra_body": t.extra_body} for t in targets],
            "notes": notes,
            "config": {"concurrency": levels, "rounds": args.rounds, "passes": args.passes,
                       "max_tokens": args.max_tokens, "temperature": temp,
                       "endpoint": args.endpoint, "ignore_eos": args.ignore_eos,
                       "prompts": [p.name for p in prompts]}}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out_dir / "server.json", {**meta, "levels": rows, "compare": ab,
                                                    "requests": result["requests"]}),
        report.write_csv(out_dir / "server.csv", rows, report.SERVER_CSV),
        report.write_csv(out_dir / "server_requests.csv", result["requests"]),
    ]
    if _plots_on(args, console):
        written += report.plot_server(rows, out_dir)
    snippet = out_dir / "README_snippet_server.md"
    snippet.write_text("\n".join([
        "## Server benchmark", "", f"Generated by `mlx-mtp bench` on {meta['machine']['date'][:10]}:",
        "", "```sh", meta["command"], "```", "", report.server_markdown(rows), "",
        "TTFT: time to the first streamed content; ITL: gaps between content chunks; TPOT: "
        "(E2E − TTFT) / (tokens − 1); agg tok/s: all completion tokens / wall time of the level.",
    ]) + "\n")
    written.append(snippet)
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False, markup=False)
    total_err = sum(r["errors"] for r in rows)
    return 1 if total_err and total_err == sum(r["requests"] for r in rows) else 0
