"""The in-process half of ``mlx-mtp bench``: load the model, run plain decoding, each
fixed K and the adaptive setting on the same prompts (``inprocess.run_inprocess``), print
the tables and write JSON, CSV, plots and a README snippet."""

from __future__ import annotations

from pathlib import Path
from typing import List

from .cli_common import int_list, machine_info, plots_on, progress, wrote


def run(args, prompts, out_dir: Path, command: str) -> int:
    """``command``: the ``mlx-mtp bench`` line that reproduces this run."""
    from . import report

    ks, sources, lookup = _checked_args(args)
    console = report.console()
    model, model_path, encoded, sampling, eos = _load(args, prompts, ks, console)
    cfg = _bench_config(args, ks, sampling, sources, lookup)
    result = _measure(args, model, prompts, encoded, cfg, eos)
    meta = _meta(args, command, model, model_path, prompts, encoded, cfg)
    title = (f"{model_path.name}: {meta['parameters'] / 1e6:.1f}M params, {len(prompts)} "
             f"prompts x {args.repeats} repeats, {args.max_tokens} tokens, "
             f"{'greedy' if sampling.greedy else f'temp {sampling.temperature}'}")
    _print_results(console, result, title)
    _write_results(args, out_dir, console, meta, result, model_path)
    bad = [r["setting"] for r in result["settings"] if r.get("outputs_match_plain") is False]
    if bad:
        console.print(f"[bold red]warning[/bold red]: greedy output differs from plain decoding "
                      f"for {', '.join(bad)}", highlight=False)
    return 0


def _checked_args(args):
    """K values, draft sources and lookup settings; bad flags are a UserError before any
    model is loaded."""
    from ..decode import MAX_DRAFT_TOKENS
    from ..options import UserError

    ks = int_list("--num-draft-tokens", args.num_draft_tokens, 0, MAX_DRAFT_TOKENS)
    if args.repeats < 1:
        raise UserError(f"--repeats must be >= 1 (got {args.repeats})")
    if args.cost_reps < 1:
        raise UserError(f"--cost-reps must be >= 1 (got {args.cost_reps})")
    return (ks, *_draft_sources(args))


def _load(args, prompts, ks: List[int], console):
    """The model (with the speed options), its path, the prompts as token ids, the
    sampling parameters and the EOS ids."""
    from rich.markup import escape

    from ..decode.prompt import build_prompt, encode_prompt
    from ..models.io.loader import generation_defaults, resolve_model_path
    from ..options import UserError, load_from_args, parse_json_arg, sampling_from_args

    sampling = sampling_from_args(args, generation_defaults(args.model))
    template_args = parse_json_arg(args.chat_template_args, "--chat-template-args")
    model_path = resolve_model_path(args.model)
    console.print(f"[bold]mlx-mtp bench[/bold]: loading {escape(str(model_path))}",
                  highlight=False)
    model, tokenizer = load_from_args(args, mtp=max(ks) > 0)
    encoded = []
    for p in prompts:
        text = build_prompt(tokenizer, p.text, None, template_args, args.ignore_chat_template)
        try:
            encoded.append(encode_prompt(tokenizer, text))
        except ValueError as e:
            raise UserError(f"prompt {p.name}: {e}")
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    return model, model_path, encoded, sampling, eos


def _bench_config(args, ks, sampling, sources, lookup):
    from .inprocess import BenchConfig

    return BenchConfig(ks=ks, max_tokens=args.max_tokens, repeats=args.repeats,
                       sampling=sampling, auto=not args.no_auto, ignore_eos=args.ignore_eos,
                       cost_reps=args.cost_reps, warmup_tokens=args.warmup_tokens,
                       prefill_step_size=args.prefill_step_size, draft_sources=sources,
                       lookup=lookup)


def _measure(args, model, prompts, encoded, cfg, eos) -> dict:
    """Every setting on every prompt, interleaved, under a progress bar."""
    from .inprocess import make_settings, run_inprocess, work_units

    settings = make_settings(cfg.ks, cfg.auto, cfg.draft_sources)
    with progress(args.quiet) as prog:
        task = prog.add_task("starting", total=work_units(len(settings), len(prompts),
                                                            args.repeats))
        return run_inprocess(model, prompts, encoded, cfg, eos,
                             progress=lambda d: prog.update(task, advance=1, description=d))


def _meta(args, command: str, model, model_path: Path, prompts, encoded, cfg) -> dict:
    """What the results were measured on: machine, model, prompts and settings."""
    import mlx.core as mx

    from ..models.io.loader import parameter_count

    sampling, lookup = cfg.sampling, cfg.lookup
    return {
        "mode": "inprocess", "command": command, "machine": machine_info(),
        "model": str(model_path), "model_type": model.model_type,
        # The embedding's dtype: every family has one (not every one a final norm).
        "parameters": parameter_count(model),
        "dtype": str(model.text.embed(mx.zeros((1, 1), mx.int32)).dtype),
        "prompts": [{"name": p.name, "category": p.category, "tokens": len(ids)}
                    for p, ids in zip(prompts, encoded)],
        "config": {"num_draft_tokens": cfg.ks, "max_tokens": args.max_tokens,
                   "repeats": args.repeats, "temperature": sampling.temperature,
                   "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p,
                   "seed": sampling.seed, "ignore_eos": args.ignore_eos, "auto": cfg.auto,
                   "chat_template": not args.ignore_chat_template,
                   "draft_head_bits": args.draft_head_bits,
                   "draft_vocab": (None if model.text.draft_head is None
                                   else model.text.draft_head.size),
                   "compile_steps": args.compile_steps, "draft_sources": list(cfg.draft_sources),
                   "lookup_min_match": lookup.min_match, "lookup_max_draft": lookup.max_draft,
                   # A penalty over prompt tokens discourages copying them (lookup drafts).
                   "repetition_penalty": sampling.repetition_penalty,
                   "presence_penalty": sampling.presence_penalty,
                   "frequency_penalty": sampling.frequency_penalty},
    }


def _print_results(console, result: dict, title: str):
    from . import report

    rows, costs = result["settings"], result["costs"]
    console.print(report.inprocess_table(rows, title))
    for r in rows:
        if r.get("draft_source", "mtp") != "mtp":
            console.print(_source_line(r), highlight=False, markup=False)
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


def _write_results(args, out_dir: Path, console, meta: dict, result: dict, model_path: Path):
    """inprocess.json, the CSVs, the plots and README_snippet.md in ``out_dir``."""
    from . import report

    rows, costs, runs = result["settings"], result["costs"], result["runs"]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out_dir / "inprocess.json", {
            **meta, "settings": rows, "costs": _json_costs(costs),
            "graphs": result["graphs"], "predictions": result["predictions"],
            "runs": [r.to_dict() for r in runs]}),
        report.write_csv(out_dir / "inprocess.csv", rows, report.INPROCESS_CSV),
        report.write_csv(out_dir / "inprocess_runs.csv", [r.to_dict() for r in runs]),
    ]
    with_plots = plots_on(args, console)
    if with_plots:
        written += report.plot_inprocess(rows, out_dir, title=f"{model_path.name}: tok/s vs K")
    snippet = out_dir / "README_snippet.md"
    snippet.write_text(readme_snippet(meta, rows, costs,
                                      plots_dir=out_dir if with_plots else None,
                                      graphs=result["graphs"],
                                      predictions=result["predictions"]))
    wrote(console, written + [snippet])


def _json_costs(costs: dict) -> dict:
    """Pass costs with string keys (K) for JSON."""
    return {**costs, "c_verify": {str(k): v for k, v in costs.get("c_verify", {}).items()},
            "per_prompt": [{**c, "verify_s": {str(k): v for k, v in c["verify_s"].items()}}
                           for c in costs.get("per_prompt", [])]}


def _draft_sources(args):
    """``--draft-source`` as a list, and the lookup settings; bad values are a UserError."""
    from ..decode import DRAFT_SOURCES
    from ..drafters.lookup import LookupSettings
    from ..options import UserError

    sources = [s.strip() for s in args.draft_source.split(",") if s.strip()]
    bad = [s for s in sources if s not in DRAFT_SOURCES]
    if bad or not sources:
        raise UserError(f"--draft-source takes a comma-separated list of "
                        f"{', '.join(DRAFT_SOURCES)} (got {args.draft_source!r})")
    try:
        lookup = LookupSettings(min_match=args.lookup_min_match,
                                max_match=max(LookupSettings().max_match, args.lookup_min_match),
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
        lines += ["", "Per step part:", "", report.graph_markdown(graphs)]
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
