"""The long-context workload of ``mlx-mtp bench`` (``--long-context 8k,32k,128k``).

Each prompt is exactly the asked number of tokens: this package's own Python sources
(sorted by path, repeated if short: deterministic, no download), cut to length, then a
question about them. Per length, plain decoding and MTP at K run on the same prompt
(greedy, EOS ignored, so both emit ``max_tokens`` tokens), each with the peak memory
reset before it; with ``mlx_lm`` given, mlx-lm's own ``stream_generate`` runs the same
checkpoint and prompt with the same ``--kv-bits``. ``summary.summarize_setting`` makes
every row, so the statistics are the in-process benchmark's.

``speed`` names a throughput split like SPEED-Bench's: 1k to 32k tokens, doubling.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from ..decode.sampling import SamplingParams
from .inprocess import make_settings, run_once
from .summary import summarize_setting

SPEED_SPLIT = (1024, 2048, 4096, 8192, 16384, 32768)
QUESTION = ("\n\nQuestion: in the code above, what decides how many tokens are drafted per "
            "step, and from which measurements? Answer in two sentences.\nAnswer:")


def parse_lengths(text: str) -> List[int]:
    """``8k,32k,128k``, ``1000,512`` or ``speed``: token counts (ValueError if malformed)."""
    if text.strip() == "speed":
        return list(SPEED_SPLIT)
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        scale = 1024 if part.endswith("k") else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) * scale < 1:
            raise ValueError(f"--long-context takes token counts such as 8k,32k,128k or "
                             f"'speed' (got {text!r})")
        out.append(int(digits) * scale)
    if not out:
        raise ValueError(f"--long-context takes at least one length (got {text!r})")
    return out


def source_tokens(tokenizer, n: int) -> List[int]:
    """The first ``n`` tokens of the package's Python sources in path order (~1.3 MB of
    text; tiled past its end), each file encoded alone so only what is needed is."""
    root = Path(__file__).resolve().parent.parent
    files = sorted(root.rglob("*.py"))
    out: List[int] = []
    for i in range(len(files) * (n + 1)):  # bounded: every file adds tokens
        if len(out) >= n:
            break
        path = files[i % len(files)]
        out += tokenizer.encode(f"# {path.relative_to(root).as_posix()}\n{path.read_text()}\n\n",
                                add_special_tokens=False)
    return out[:n]


def long_prompts(tokenizer, lengths: Sequence[int]) -> List[List[int]]:
    """One prompt per length, exactly that many tokens (no special ones): the sources
    followed by ``QUESTION``."""
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    if min(lengths) <= len(question):
        raise ValueError(f"--long-context lengths must exceed the question's "
                         f"{len(question)} tokens (got {min(lengths)})")
    body = source_tokens(tokenizer, max(lengths) - len(question))
    return [body[:n - len(question)] + question for n in lengths]


@dataclass
class LongContextConfig:
    lengths: List[int]
    k: int = 3
    max_tokens: int = 64
    repeats: int = 1
    prefill_step_size: int = 2048
    kv: Optional[object] = None  # models.cache.quantized.KVQuantization, for mlx-lm's flags


def run_long_context(model, prompts: List[List[int]], cfg: LongContextConfig, mlx_lm=None,
                     progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Rows (``summarize_setting``'s, plus ``context_tokens``): plain, then ``K=k`` per
    length; ``mlx_lm``: (model, tokenizer) of mlx-lm on the same checkpoint, one more row."""
    settings = make_settings([cfg.k], auto=False)
    tick = progress or (lambda _: None)
    rows = []
    for n, ids in zip(cfg.lengths, prompts):
        runs = {s.name: [] for s in settings}
        lm_runs = []
        for rep in range(cfg.repeats):
            for s in settings:
                runs[s.name].append(run_once(model, ids, s, SamplingParams(), cfg.max_tokens,
                                             prefill_step_size=cfg.prefill_step_size,
                                             label=f"{n}", category="long", repeat=rep))
                tick(f"{n} tokens {s.name}")
            if mlx_lm is not None:
                lm_runs.append(mlx_lm_run(*mlx_lm, ids, cfg))
                tick(f"{n} tokens mlx-lm")
        plain = {(r.repeat, r.prompt): r for r in runs["plain"]}
        for s in settings:
            row = summarize_setting(s, runs[s.name], plain, {})
            mism = sum(r.tokens != plain[(r.repeat, r.prompt)].tokens for r in runs[s.name])
            row.update(context_tokens=n, prompt_tokens=len(ids),
                       total_tokens=sum(r.total_tokens for r in runs[s.name]),
                       outputs_match_plain=mism == 0, mismatched_runs=mism)
            rows.append(row)
        if lm_runs:
            rows.append(_mlx_lm_row(n, lm_runs, runs["plain"]))
    return rows


def mlx_lm_run(lm_model, lm_tokenizer, ids: List[int], cfg: LongContextConfig) -> dict:
    """mlx-lm's ``stream_generate`` (greedy) on ``ids``: its own prefill and decode tok/s,
    peak memory and tokens."""
    from mlx_lm.generate import stream_generate

    kv = {} if cfg.kv is None else dict(kv_bits=cfg.kv.bits, kv_group_size=cfg.kv.group_size,
                                        quantized_kv_start=cfg.kv.start)
    mx.reset_peak_memory()
    tokens, last = [], None
    for last in stream_generate(lm_model, lm_tokenizer, mx.array(ids), max_tokens=cfg.max_tokens,
                                prefill_step_size=cfg.prefill_step_size, **kv):
        tokens.append(last.token)
    return {"prompt_tps": last.prompt_tps, "gen_tps": last.generation_tps,
            "peak_memory_gb": mx.get_peak_memory() / 1e9, "tokens": tokens}


def _mlx_lm_row(n: int, lm_runs: List[dict], plain_runs) -> dict:
    """mlx-lm's row, in the fields the table reads (medians over repeats)."""
    from . import stats as st

    tps = [r["gen_tps"] for r in lm_runs]
    mism = sum(r["tokens"] != p.tokens for r, p in zip(lm_runs, plain_runs))
    plain_tps = st.median(p.gen_tps for p in plain_runs)
    return {"setting": "mlx-lm", "k": 0, "context_tokens": n, "runs": len(lm_runs),
            "prompt_tps_median": st.median(r["prompt_tps"] for r in lm_runs),
            "gen_tps_median": st.median(tps), "gen_tps_min": min(tps), "gen_tps_max": max(tps),
            "speedup": st.median(tps) / plain_tps if plain_tps else None,
            "acceptance_per_pos_conditional": None,
            "peak_memory_gb": max(r["peak_memory_gb"] for r in lm_runs),
            "outputs_match_plain": mism == 0, "mismatched_runs": mism}


def run_cli(args, out_dir: Path, command: str) -> int:
    """``mlx-mtp bench --long-context LENGTHS``: the table on the terminal, JSON and CSV in
    ``out_dir``."""
    from ..decode import MAX_DRAFT_TOKENS
    from ..models.io.loader import resolve_model_path
    from ..options import UserError, load_from_args
    from . import report
    from .cli_common import int_list, machine_info, progress, wrote

    if not args.long_context:
        raise UserError("--compare-mlx-lm needs --long-context")
    try:
        lengths = parse_lengths(args.long_context)
    except ValueError as e:
        raise UserError(str(e))
    k = max(int_list("--num-draft-tokens", args.num_draft_tokens, 0, MAX_DRAFT_TOKENS))
    model, tokenizer = load_from_args(args, mtp=k > 0)
    try:
        prompts = long_prompts(tokenizer, lengths)
    except ValueError as e:
        raise UserError(str(e))
    kv = None
    if args.kv_bits is not None:
        from ..models.cache.quantized import KVQuantization

        kv = KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
    mlx_lm = None
    if args.compare_mlx_lm:
        from mlx_lm.utils import load as lm_load

        mlx_lm = lm_load(str(resolve_model_path(args.model)))
    cfg = LongContextConfig(lengths, k, args.max_tokens, args.repeats, args.prefill_step_size, kv)
    with progress(args.quiet) as prog:
        task = prog.add_task("starting", total=len(lengths) * args.repeats
                             * (2 + (mlx_lm is not None) - (k == 0)))
        rows = run_long_context(model, prompts, cfg, mlx_lm,
                                lambda d: prog.update(task, advance=1, description=d))
    console = report.console()
    console.print(report.long_context_table(
        rows, f"long context: K={k}, {args.max_tokens} tokens, {args.repeats} repeats, greedy"
              + (f", --kv-bits {args.kv_bits}" if kv else "")))
    meta = {"command": command, "machine": machine_info(), "model": str(args.model),
            "model_type": model.model_type,
            "config": {"lengths": lengths, "k": k, "max_tokens": args.max_tokens,
                       "repeats": args.repeats, "kv_bits": args.kv_bits,
                       "kv_group_size": args.kv_group_size,
                       "quantized_kv_start": args.quantized_kv_start,
                       "prefill_step_size": args.prefill_step_size,
                       "compare_mlx_lm": args.compare_mlx_lm}}
    wrote(console, [report.write_json(out_dir / "long_context.json", {"meta": meta, "rows": rows}),
                    report.write_csv(out_dir / "long_context.csv", rows, report.LONG_CONTEXT_CSV)])
    return 0
