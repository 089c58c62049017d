"""Benchmark output: rich tables, JSON, CSV, PNG plots and a README snippet."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from ..plots import pyplot
from .stats import nan_to_none


# --- formatting ---------------------------------------------------------------------------
def console():
    """A rich console for stdout; wide when not a terminal, so tables do not wrap."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=220)


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def fmt_pos(values: Optional[Sequence[float]]) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


# --- in-process ---------------------------------------------------------------------------
INPROCESS_COLUMNS = [
    # (header, function row -> str)
    ("setting", lambda r: r["setting"]),
    ("gen tok/s", lambda r: f"{r['gen_tps_median']:.1f} ± {(r['gen_tps_max'] - r['gen_tps_min']) / 2:.1f}"),
    ("speedup", lambda r: fmt(r["speedup"], ".2f") + ("×" if r["speedup"] is not None else "")),
    ("prompt tok/s", lambda r: fmt(r["prompt_tps_median"], ".0f")),
    ("accept/pos", lambda r: fmt_pos(r["acceptance_per_pos"])),
    ("mean acc len", lambda r: fmt(r["mean_acceptance_length"], ".2f")),
    ("c_verify", lambda r: fmt(r["c_verify"], ".2f")),
    ("c_draft", lambda r: fmt(r["c_draft"], ".2f") if r["k"] else "-"),
    ("ideal", lambda r: fmt(r["ideal_speedup"], ".2f")),
    ("realised/ideal", lambda r: fmt(r["efficiency"] * 100 if r["efficiency"] else None, ".0f") +
     ("%" if r["efficiency"] else "")),
    ("nodes/step (own)", lambda r: f"{r['nodes_per_step']:.0f} ({r['own_nodes_per_step']:.0f})"
     if r.get("nodes_per_step") is not None else "-"),
    ("state KB/step", lambda r: fmt(r["state_bytes_per_step"] / 1e3
                                    if r.get("state_bytes_per_step") is not None else None, ".0f")),
    ("syncs/step", lambda r: fmt(r.get("host_syncs_per_step"), ".2f")),
    ("peak mem", lambda r: f"{r['peak_memory_gb'] * 1e3:.0f} MB" if r["peak_memory_gb"] < 1
     else f"{r['peak_memory_gb']:.2f} GB"),
    ("lossless", lambda r: {True: "yes", False: f"NO ({r.get('mismatched_runs')})"}.get(
        r.get("outputs_match_plain"), "-")),
]


def _table(rows: List[dict], columns, title: str, left=(), escape_cells: bool = False):
    """A rich table of ``columns`` ((heading, cell function) pairs); the first column and
    those named in ``left`` align left."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title) or None, title_justify="left")
    for i, (h, _) in enumerate(columns):
        t.add_column(h, justify="left" if i == 0 or h in left else "right", no_wrap=True)
    for r in rows:
        cells = [f(r) for _, f in columns]
        t.add_row(*([escape(c) for c in cells] if escape_cells else cells))
    return t


def _markdown(rows: List[dict], columns) -> str:
    heads = [h for h, _ in columns]
    lines = ["| " + " | ".join(heads) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(heads) - 1)) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(f(r) for _, f in columns) + " |")
    return "\n".join(lines)


def inprocess_table(rows: List[dict], title: str = ""):
    return _table(rows, INPROCESS_COLUMNS, title, left=("accept/pos",))


def inprocess_markdown(rows: List[dict]) -> str:
    return _markdown(rows, INPROCESS_COLUMNS)


INPROCESS_CSV = [
    "setting", "k", "adaptive", "runs", "gen_tps_median", "gen_tps_min", "gen_tps_max",
    "gen_tps_stdev", "gen_tps_aggregate", "gen_tps_run_median", "gen_tps_run_p25",
    "gen_tps_run_p75", "speedup", "speedup_min", "speedup_max",
    "speedup_per_prompt_median", "speedup_per_prompt_p25", "speedup_per_prompt_p75",
    "speedup_geomean", "speedup_by_category", "prompt_tps_median", "ttft_ms_median", "gen_tokens",
    "steps", "step_ms", "tokens_per_step", "step_cost_measured", "acceptance_rate",
    "mean_acceptance_length", "acceptance_per_pos", "acceptance_per_pos_conditional",
    "num_drafts", "num_draft_tokens", "num_accepted_tokens", "c_verify", "c_draft",
    "step_cost_model", "ideal_speedup", "efficiency", "peak_memory_gb", "outputs_match_plain",
    "nodes_draft", "nodes_verify", "nodes_replay", "nodes_per_step", "own_nodes_per_step",
    "state_bytes_per_step", "host_syncs_per_step",
]


# --- real shape (benchmarks/real_shape.py) ---------------------------------------------------
REAL_SHAPE_COLUMNS = [
    *[c for c in INPROCESS_COLUMNS if c[0] in ("setting", "gen tok/s", "speedup")],
    ("vs mlx-lm", lambda r: fmt(r.get("vs_mlx_lm"), ".2f") + ("×" if r.get("vs_mlx_lm") else "")),
    *[c for c in INPROCESS_COLUMNS if c[0] in ("accept/pos", "mean acc len", "c_verify",
                                               "c_draft", "ideal", "realised/ideal")],
    ("steps by K", lambda r: " ".join(f"{k}:{n}" for k, n in r["steps_by_k"].items()) or "-"),
    ("draft vocab", lambda r: fmt(r.get("draft_vocab"), "d")),
    ("lost to vocab", lambda r: fmt(r.get("draft_vocab_lost"), "d")),
    *[c for c in INPROCESS_COLUMNS if c[0] == "lossless"],
]


def real_shape_table(rows: List[dict], title: str = ""):
    return _table(rows, REAL_SHAPE_COLUMNS, title, left=("accept/pos", "steps by K"))


def real_shape_markdown(rows: List[dict]) -> str:
    return _markdown(rows, REAL_SHAPE_COLUMNS)


# --- long context (bench/long_context.py) ---------------------------------------------------
LONG_CONTEXT_COLUMNS = [
    ("context", lambda r: f"{r['context_tokens']:,}"),
    ("setting", lambda r: r["setting"]),
    ("prefill tok/s", lambda r: fmt(r["prompt_tps_median"], ".0f")),
    *[c for c in INPROCESS_COLUMNS if c[0] in ("gen tok/s", "speedup")],
    ("accept/depth", lambda r: fmt_pos(r["acceptance_per_pos_conditional"])),
    *[c for c in INPROCESS_COLUMNS if c[0] in ("peak mem", "lossless")],
]


def long_context_table(rows: List[dict], title: str = ""):
    return _table(rows, LONG_CONTEXT_COLUMNS, title, left=("setting",))


def long_context_markdown(rows: List[dict]) -> str:
    return _markdown(rows, LONG_CONTEXT_COLUMNS)


LONG_CONTEXT_CSV = [
    "context_tokens", "setting", "k", "runs", "prompt_tokens", "total_tokens",
    "prompt_tps_median", "gen_tps_median", "gen_tps_min", "gen_tps_max", "speedup",
    "acceptance_per_pos_conditional", "acceptance_per_pos", "acceptance_rate",
    "mean_acceptance_length", "num_draft_tokens", "num_accepted_tokens", "peak_memory_gb",
    "outputs_match_plain",
]


def graph_markdown(graphs: dict) -> str:
    """Graph nodes of each part of a step (recurrence-call nodes apart) and state writes."""
    lines = ["| step part | nodes | own nodes | recurrence calls (nodes) | state written |",
             "|---|---:|---:|---:|---:|"]

    def line(name, g, state=None):
        lines.append(f"| {name} | {g['nodes']:.0f} | {g['own_nodes']:.0f} | "
                     f"{g['recurrence_calls']:.0f} ({g['recurrence_nodes']:.0f}) | "
                     + (f"{state / 1e3:.1f} KB" if state is not None else "-") + " |")

    if "plain" in graphs:
        line("plain step", graphs["plain"], graphs["plain"]["state_bytes"])
    for k in sorted(k for k in graphs if k != "plain"):
        g = graphs[k]
        line(f"K={k} draft (K head calls)", g["draft"])
        line(f"K={k} verify (K+1 tokens)", g["verify"], g["state_bytes_verify"])
        line(f"K={k} replay (on rejection)", g["replay"], g["state_bytes_replay"])
    return "\n".join(lines)


# --- server ---------------------------------------------------------------------------------
def _ms(x, spec=".0f"):
    return fmt(x, spec)


SERVER_COLUMNS = [
    ("server", lambda r: r["server"]),
    ("conc", lambda r: str(r["concurrency"])),
    ("reqs", lambda r: str(r["requests"])),
    ("err", lambda r: str(r["errors"])),
    ("agg tok/s", lambda r: fmt(r["aggregate_tps"], ".1f")),
    ("req tok/s", lambda r: fmt(r["request_tps_mean"], ".1f")),
    ("TTFT p50/p95 ms", lambda r: f"{_ms(r['ttft_p50_ms'])} / {_ms(r['ttft_p95_ms'])}"),
    ("ITL p50/p95/p99 ms", lambda r: f"{_ms(r['itl_p50_ms'], '.1f')} / {_ms(r['itl_p95_ms'], '.1f')}"
     f" / {_ms(r['itl_p99_ms'], '.1f')}"),
    ("TPOT ms", lambda r: _ms(r["tpot_mean_ms"], ".1f")),
    ("E2E p50/p95 ms", lambda r: f"{_ms(r['e2e_p50_ms'])} / {_ms(r['e2e_p95_ms'])}"),
    ("tok/chunk", lambda r: fmt(r["tokens_per_chunk"], ".2f")),
    ("accept", lambda r: fmt(r["acceptance_rate"] * 100 if r["acceptance_rate"] is not None
                             else None, ".1f") + ("%" if r["acceptance_rate"] is not None else "")),
    ("mean acc len", lambda r: fmt(r["mtp_mean_acceptance_length"], ".2f")),
]


def server_table(rows: List[dict], title: str = ""):
    return _table(rows, SERVER_COLUMNS, title, escape_cells=True)


def server_markdown(rows: List[dict]) -> str:
    return _markdown(rows, SERVER_COLUMNS)


def compare_rows(rows: List[dict]) -> List[dict]:
    """For two servers: per concurrency, A/B ratios of throughput and latencies."""
    labels = list(dict.fromkeys(r["server"] for r in rows))
    if len(labels) != 2:
        return []
    a, b = labels
    by = {(r["server"], r["concurrency"]): r for r in rows}
    out = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        ra, rb = by.get((a, c)), by.get((b, c))
        if not ra or not rb:
            continue

        def ratio(key):
            x, y = ra.get(key), rb.get(key)
            return x / y if x and y else None

        pa, pb = ra.get("pass_aggregate_tps") or [], rb.get("pass_aggregate_tps") or []
        per_pass = [x / y for x, y in zip(pa, pb) if y] if len(pa) > 1 else []
        out.append({"concurrency": c, "a": a, "b": b,
                    "aggregate_tps_ratio": ratio("aggregate_tps"),
                    "pass_ratio_min": min(per_pass) if per_pass else None,
                    "pass_ratio_max": max(per_pass) if per_pass else None,
                    "request_tps_ratio": ratio("request_tps_mean"),
                    "ttft_p50_ratio": ratio("ttft_p50_ms"), "tpot_ratio": ratio("tpot_mean_ms"),
                    "e2e_p50_ratio": ratio("e2e_p50_ms")})
    return out


def compare_table(rows: List[dict]):
    from rich.table import Table

    if not rows:
        return None
    from rich.markup import escape

    t = Table(title=escape(f"A/B: {rows[0]['a']} vs {rows[0]['b']} (ratio A/B)"),
              title_justify="left")
    spread = any(r.get("pass_ratio_min") for r in rows)
    heads = ["conc", "agg tok/s"] + (["per pass"] if spread else []) + [
        "req tok/s", "TTFT p50", "TPOT", "E2E p50"]
    for h in heads:
        t.add_column(h, justify="right")
    for r in rows:
        cells = [fmt(r[k], ".2f") + "×" if r[k] else "-" for k in (
            "aggregate_tps_ratio", "request_tps_ratio", "ttft_p50_ratio", "tpot_ratio",
            "e2e_p50_ratio")]
        if spread:
            lo, hi = r.get("pass_ratio_min"), r.get("pass_ratio_max")
            cells.insert(1, f"{lo:.2f}–{hi:.2f}" if lo else "-")
        t.add_row(str(r["concurrency"]), *cells)
    return t


SERVER_CSV = [
    "server", "url", "model", "concurrency", "requests", "errors", "wall_s", "completion_tokens",
    "aggregate_tps", "pass_aggregate_tps", "request_tps_mean", "request_tps_p50", "request_tps_min",
    *[f"{m}_{k}_ms" for m in ("ttft", "itl", "tpot", "e2e")
      for k in ("mean", "p50", "p95", "p99", "min", "max")],
    "chunks", "tokens_per_chunk", "tokens_from_usage", "acceptance_rate", "draft_n",
    "draft_n_accepted", "mtp_num_drafts", "mtp_num_draft_tokens", "mtp_num_accepted_tokens",
    "mtp_mean_acceptance_length", "mtp_accepted_per_pos", "mtp_acceptance_per_pos",
]


# --- files ------------------------------------------------------------------------------------
def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nan_to_none(obj), indent=2, default=str) + "\n")
    return path


def _cell(v):
    if isinstance(v, float):
        return "" if not math.isfinite(v) else f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return " ".join(str(_cell(x)) for x in v)
    if isinstance(v, dict):
        return json.dumps(v)
    return "" if v is None else v


def write_csv(path: Path, rows: Iterable[dict], columns: Optional[List[str]] = None) -> Path:
    rows = list(rows)
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_cell(r.get(c)) for c in columns])
    return path


# --- plots --------------------------------------------------------------------------------------
def plot_inprocess(rows: List[dict], out_dir: Path, title: str = "") -> List[Path]:
    plt = pyplot()
    paths = []
    fixed = [r for r in rows if not r["adaptive"]]
    auto = [r for r in rows if r["adaptive"]]

    fig, ax = plt.subplots(figsize=(6, 4))
    ks = [r["k"] for r in fixed]
    med = [r["gen_tps_median"] for r in fixed]
    lo = [r["gen_tps_median"] - r["gen_tps_min"] for r in fixed]
    hi = [r["gen_tps_max"] - r["gen_tps_median"] for r in fixed]
    ax.errorbar(ks, med, yerr=[lo, hi], marker="o", capsize=4,
                label="fixed K (median, min-max over repeats)")
    base = fixed[0]["gen_tps_median"] if fixed and fixed[0]["k"] == 0 else None
    if base:
        ideal = [base * r["ideal_speedup"] if r["ideal_speedup"] else None for r in fixed]
        pts = [(k, v) for k, v in zip(ks, ideal) if v is not None]
        if pts:
            ax.plot(*zip(*pts), "--", color="gray", label="ideal (from pass costs)")
    for r in auto:
        ax.axhline(r["gen_tps_median"], color="tab:green", linestyle=":",
                   label=f"auto (max K={r['k']})")
    ax.set_xlabel("draft tokens K (0 = plain)")
    ax.set_ylabel("generation tok/s")
    ax.set_xticks(ks)
    ax.set_title(title or "Generation speed vs K")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "tok_s_vs_k.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    spec_rows = [r for r in rows if r["acceptance_per_pos"]]
    if spec_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in spec_rows:
            pos = list(range(1, len(r["acceptance_per_pos"]) + 1))
            ax.plot(pos, r["acceptance_per_pos"], marker="o", label=r["setting"])
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance (share of drafts)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xticks(range(1, max(len(r["acceptance_per_pos"]) for r in spec_rows) + 1))
        ax.set_title("Acceptance per position")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
        fig.tight_layout()
        paths.append(out_dir / "acceptance_per_pos.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def plot_server(rows: List[dict], out_dir: Path) -> List[Path]:
    plt = pyplot()
    servers = list(dict.fromkeys(r["server"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    styles = {"p50": "-", "p95": "--", "p99": ":"}
    for si, s in enumerate(servers):
        rs = [r for r in rows if r["server"] == s]
        conc = [r["concurrency"] for r in rs]
        color = f"C{si}"
        for metric, ax in (("ttft", axes[0]), ("itl", axes[1])):
            for p, ls in styles.items():
                vals = [r[f"{metric}_{p}_ms"] for r in rs]
                if any(v is not None for v in vals):
                    ax.plot(conc, [v if v is not None else float("nan") for v in vals], ls,
                            marker="o", color=color, label=f"{s} {p}")
        axes[2].plot(conc, [r["aggregate_tps"] for r in rs], "-", marker="o", color=color,
                     label=f"{s} aggregate")
        axes[2].plot(conc, [r["request_tps_mean"] or float("nan") for r in rs], "--",
                     marker="s", color=color, label=f"{s} per request")
    for ax, title, ylabel in ((axes[0], "TTFT", "ms"), (axes[1], "Inter-token latency", "ms"),
                              (axes[2], "Throughput", "tok/s")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "latency_vs_concurrency.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
