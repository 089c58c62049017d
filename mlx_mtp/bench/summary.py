"""The in-process benchmark's result rows: one per setting, speedups against plain decoding
from per-(repeat, prompt) pairs, the cost model's columns (bench/inprocess.py runs them)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Dict, List

from ..decode.stats import SpecStats
from . import stats as st

if TYPE_CHECKING:  # the runner's types; it imports this module
    from .inprocess import RunResult, Setting


def summarize_setting(setting: Setting, runs: List[RunResult], plain_runs: Dict[tuple, RunResult],
                      costs: dict) -> dict:
    """One row of the result table (JSON-ready)."""
    tps = [r.gen_tps for r in runs]
    spec = SpecStats()
    for r in runs:
        spec.merge(r.spec)
    pairs = [(r, plain_runs.get((r.repeat, r.prompt))) for r in runs]
    ratios = [r.gen_tps / p.gen_tps for r, p in pairs if p is not None and p.gen_tps > 0]
    rep_tps, rep_ratios = _per_repeat(pairs)
    gen_tokens = sum(r.gen_tokens for r in runs)
    gen_time = sum(r.gen_time for r in runs)
    steps = sum(r.steps for r in runs)
    steps_by_k: Counter = Counter()
    for r in runs:
        steps_by_k.update(r.steps_by_k)
    cum = spec.acceptance_per_pos
    cond = st.conditional_acceptance(cum)
    row = {
        "setting": setting.name, "k": setting.k, "adaptive": setting.adaptive, "runs": len(runs),
        "gen_tps_median": st.median(rep_tps), "gen_tps_min": min(rep_tps),
        "gen_tps_max": max(rep_tps), "gen_tps_stdev": st.stdev(rep_tps),
        "gen_tps_per_repeat": rep_tps,
        "gen_tps_aggregate": gen_tokens / gen_time if gen_time > 0 else 0.0,
        "gen_tps_run_median": st.median(tps), "gen_tps_run_p25": st.percentile(tps, 25),
        "gen_tps_run_p75": st.percentile(tps, 75),
        "speedup": st.median(rep_ratios) if rep_ratios else None,
        "speedup_min": min(rep_ratios) if rep_ratios else None,
        "speedup_max": max(rep_ratios) if rep_ratios else None,
        "speedup_per_repeat": rep_ratios,
        "speedup_per_prompt_median": st.median(ratios) if ratios else None,
        "speedup_per_prompt_p25": st.percentile(ratios, 25) if ratios else None,
        "speedup_per_prompt_p75": st.percentile(ratios, 75) if ratios else None,
        "speedup_geomean": st.geomean(ratios) if ratios else None,
        "speedup_by_category": _speedup_by_category(pairs),
        "gen_tps_by_category": {c: st.median(r.gen_tps for r in runs if r.category == c)
                                for c in dict.fromkeys(r.category for r in runs)},
        "prompt_tps_median": st.median(r.prompt_tps for r in runs),
        "ttft_ms_median": st.median(r.prompt_time for r in runs) * 1e3,
        "gen_tokens": gen_tokens, "steps": steps,
        "step_ms": gen_time / steps * 1e3 if steps else None,
        "tokens_per_step": gen_tokens / steps if steps else None,
        "steps_by_k": {str(k): v for k, v in sorted(steps_by_k.items())},
        "acceptance_per_pos_conditional": cond,
        **spec.to_dict(missing=None),  # counts, rates (overall, by source), per position
        "draft_source": setting.draft_source,
        "peak_memory_gb": max(r.peak_memory_gb for r in runs),
        "step_cost_measured": None,
        "c_verify": None, "c_draft": costs.get("c_draft"), "step_cost_model": None,
        "ideal_speedup": None, "efficiency": None,
    }
    _add_cost_columns(row, setting, pairs, costs, cond, steps_by_k)
    return row


def _per_repeat(pairs):
    """Per repeat: all prompts' tokens over all prompts' time (spread = run-to-run noise),
    and the speedup: the same prompts' aggregate tok/s, this setting over plain."""
    by_rep: Dict[int, List[float]] = {}
    plain_by_rep: Dict[int, List[float]] = {}
    for r, p in pairs:
        tok_time = by_rep.setdefault(r.repeat, [0, 0.0])
        tok_time[0] += r.gen_tokens
        tok_time[1] += r.gen_time
        if p is not None:
            tok_time = plain_by_rep.setdefault(r.repeat, [0, 0.0])
            tok_time[0] += p.gen_tokens
            tok_time[1] += p.gen_time
    rep_tps = [n / t for n, t in by_rep.values() if t > 0] or [0.0]
    rep_ratios = [(by_rep[k][0] / by_rep[k][1]) / (n / t)
                  for k, (n, t) in plain_by_rep.items() if n and t > 0 and by_rep[k][1] > 0]
    return rep_tps, rep_ratios


def _add_cost_columns(row: dict, setting: Setting, pairs, costs: dict, cond, steps_by_k):
    """Measured step cost against plain, the cost model's, and the ideal speedup."""
    runs = [r for r, _ in pairs]
    plain_step = st.median(
        [p.gen_time / p.steps for _, p in pairs if p is not None and p.steps]) if pairs else None
    if row["step_ms"] is not None and plain_step:
        row["step_cost_measured"] = row["step_ms"] / 1e3 / plain_step
    c_verify = costs.get("c_verify", {})
    c_draft = costs.get("c_draft")
    if setting.k == 0:
        row.update(c_verify=1.0, step_cost_model=1.0, ideal_speedup=1.0)
    elif c_draft is not None and setting.k in c_verify:
        if not setting.adaptive:
            row["c_verify"] = c_verify[setting.k]
            row["step_cost_model"] = st.step_cost(setting.k, c_verify, c_draft)
            row["ideal_speedup"] = st.ideal_speedup(cond, c_verify[setting.k], c_draft)
        else:
            row["ideal_speedup"] = st.ideal_speedup_mixed(
                steps_by_k, sum(r.total_tokens for r in runs), c_verify, c_draft)
    if row["ideal_speedup"] and row["speedup"] is not None:
        row["efficiency"] = row["speedup"] / row["ideal_speedup"]


def _speedup_by_category(pairs) -> Dict[str, float]:
    out: Dict[str, List[float]] = {}
    for r, p in pairs:
        if p is not None and p.gen_tps > 0:
            out.setdefault(r.category, []).append(r.gen_tps / p.gen_tps)
    return {c: st.median(v) for c, v in out.items()}
