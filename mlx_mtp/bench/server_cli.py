"""The server half of ``mlx-mtp bench`` (``--server URL``, ``--compare URL2``): streaming
requests at each concurrency level (``server.run_server_bench``), then the tables and
JSON, CSV, plots and a README snippet."""

from __future__ import annotations

from pathlib import Path
from typing import List

from .cli_common import int_list, machine_info, plots_on, progress, wrote


def run(args, prompts, out_dir: Path, command: str) -> int:
    """``command``: the ``mlx-mtp bench`` line that reproduces this run. Exit code 1 when
    every request failed."""
    from . import report

    levels = _checked_levels(args)
    targets = _targets(args)
    console = report.console()
    notes = _resolve(targets, args.wait, console)
    temp = args.temp if args.temp is not None else 0.0
    result = _measure(args, targets, prompts, levels, temp)
    rows = result["levels"]
    ab = _print_results(args, console, rows, len(prompts), temp)
    meta = {"mode": "server", "command": command, "machine": machine_info(),
            "targets": [{"label": t.label, "url": t.url, "model": t.model,
                         "extra_body": t.extra_body} for t in targets],
            "notes": notes,
            "config": {"concurrency": levels, "rounds": args.rounds, "passes": args.passes,
                       "max_tokens": args.max_tokens, "temperature": temp,
                       "endpoint": args.endpoint, "ignore_eos": args.ignore_eos,
                       "prompts": [p.name for p in prompts]}}
    _write_results(args, out_dir, console, meta, result, ab)
    total_err = sum(r["errors"] for r in rows)
    return 1 if total_err and total_err == sum(r["requests"] for r in rows) else 0


def _checked_levels(args) -> List[int]:
    from ..options import UserError

    levels = int_list("--concurrency", args.concurrency, 1, 1024)
    if args.rounds < 1:
        raise UserError(f"--rounds must be >= 1 (got {args.rounds})")
    if args.passes < 1:
        raise UserError(f"--passes must be >= 1 (got {args.passes})")
    return levels


def _targets(args) -> list:
    """``--server`` and, for an A/B, ``--compare`` (labels kept apart)."""
    from ..options import UserError, parse_json_arg
    from .server import Target

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
    return targets


def _resolve(targets, wait: float, console) -> List[str]:
    """Reach each server and fill in its model id; the notes to show."""
    from rich.markup import escape

    from ..options import UserError
    from .server import ServerError, resolve_targets

    try:
        notes = resolve_targets(targets, wait=wait)
    except ServerError as e:
        raise UserError(str(e))
    for n in notes:
        console.print(f"[yellow]note[/yellow]: {escape(n)}", highlight=False)
    for t in targets:
        console.print(f"[bold]{escape(t.label)}[/bold]: {escape(t.url)} "
                      f"model={escape(t.model or '(server default)')}", highlight=False)
    return notes


def _request_fields(args, temp: float) -> dict:
    """Keyword arguments for every request. Sampling flags go to the server as request
    fields (mlx-mtp's names; vLLM and llama-server take the same ones); unset ones leave
    the server's defaults."""
    kw = dict(temperature=temp, endpoint=args.endpoint, timeout=args.timeout,
              ignore_eos=args.ignore_eos)
    extra = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k),
                               ("min_p", args.min_p), ("seed", args.seed),
                               ("repetition_penalty", args.repetition_penalty),
                               ("presence_penalty", args.presence_penalty),
                               ("frequency_penalty", args.frequency_penalty),
                               ("mtp_coupled", args.coupled)) if v is not None}
    if extra:
        kw["extra_body"] = extra
    return kw


def _measure(args, targets, prompts, levels: List[int], temp: float) -> dict:
    from ..options import UserError
    from .server import ServerError, request_units, run_server_bench

    with progress(args.quiet) as prog:
        task = prog.add_task("requests", total=args.passes * request_units(
            levels, args.rounds, len(targets)))
        try:
            return run_server_bench(targets, prompts, levels, args.rounds, args.max_tokens,
                                    warmup=not args.no_warmup, passes=args.passes,
                                    tick=lambda: prog.update(task, advance=1),
                                    **_request_fields(args, temp))
        except ServerError as e:
            raise UserError(str(e))


def _print_results(args, console, rows: List[dict], n_prompts: int, temp: float) -> List[dict]:
    """The level table, the A/B table (returned) and sample errors."""
    from rich.markup import escape

    from . import report

    console.print(report.server_table(
        rows, f"{n_prompts} prompts, {args.max_tokens} max tokens, {args.rounds} requests per "
              f"client per level x {args.passes} pass(es), temp {temp}"))
    ab = report.compare_rows(rows) if args.compare else []
    if ab:
        console.print(report.compare_table(ab))
    for r in rows:
        for e in r["error_samples"]:
            console.print(f"[red]error[/red] {escape(r['server'])} c={r['concurrency']}: "
                          f"{escape(e)}", highlight=False)
    return ab


def _write_results(args, out_dir: Path, console, meta: dict, result: dict, ab: List[dict]):
    """server.json, the CSVs, the plots and README_snippet_server.md in ``out_dir``."""
    from . import report

    rows = result["levels"]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        report.write_json(out_dir / "server.json", {**meta, "levels": rows, "compare": ab,
                                                    "requests": result["requests"]}),
        report.write_csv(out_dir / "server.csv", rows, report.SERVER_CSV),
        report.write_csv(out_dir / "server_requests.csv", result["requests"]),
    ]
    if plots_on(args, console):
        written += report.plot_server(rows, out_dir)
    snippet = out_dir / "README_snippet_server.md"
    snippet.write_text("\n".join([
        "## Server benchmark", "", f"Generated by `mlx-mtp bench` on {meta['machine']['date'][:10]}:",
        "", "```sh", meta["command"], "```", "", report.server_markdown(rows), "",
        "TTFT: time to the first streamed content; ITL: gaps between content chunks; TPOT: "
        "(E2E − TTFT) / (tokens − 1); agg tok/s: all completion tokens / wall time of the level.",
    ]) + "\n")
    wrote(console, written + [snippet])
