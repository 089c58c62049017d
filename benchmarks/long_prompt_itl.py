"""Inter-token latency of running streams while long prompts arrive, A/B over checkouts.

The scheduler in-process (no HTTP, so only scheduling shows): ``--streams`` requests decode,
then the ``--prompt-tokens`` prompts arrive (comma-separated lengths, ``--prompt-delay-s``
apart; each its own text), then a short request. Reported per run: the gaps between
successive token events of the running streams before the first long prompt (baseline) and
during the union of the prefills, from the first arrival to the last long prompt's first
token (p50 / p99 / max), and after it (``after_p99_ms``: the streams alone again, their
contexts as long as at the end; ``after_step_p50_ms`` their step there; ``itl_p99_vs_after``
the p99 gap during the prefills against it: the solo p99 is taken at short contexts, so
``itl_p99_vs_solo`` includes the steps' growth with context); per long prompt its time to
first token and prefill rate; the short request's time to first token. ``--trace FILE``: every scheduler iteration of each
run, part by part (``server/iteration_trace.py``), and its longest ones printed. Each ``--trees`` entry is a checkout (its ``mlx_mtp`` is
imported from there); the runs are interleaved A B B A ... and the table shows medians over
passes.

Fair share (issues 25, 43): the streams' p99 gap during the prefills against their p99
before (target <= 2.5x), and the prompts' prefill rate against the same prompts alone
(``--solo`` adds a run without streams per tree and pass; target >= 40 %), in total and per
prompt. Per run, the scheduler's own accounting while prompts are processed
(``FairShare.prefill_ran`` / ``decode_ran``): the prompts' part of the timed time, how much
of the wall time is timed at all, the chunks' sizes and cost per token (alone: the same
prompts'), the decode steps' median, and per prompt its part of the prompts' time.

    python benchmarks/long_prompt_itl.py --trees /work/before . --passes 2 --solo
    python benchmarks/long_prompt_itl.py --passes 1 --solo --prompt-tokens 8000,30000
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time

FAIR_KEYS = ["prompt_share", "timed_of_wall", "chunks", "chunk_p50_tokens", "chunks_under_8",
             "prompt_ms_per_token", "solo_prompt_ms_per_token", "decode_step_p50_ms",
             "after_step_p50_ms"]
STREAM_PROMPT = "Write a long story about a lighthouse keeper number {i}."
LONG_TEXT = "def f(x):\n    return x + 1\n\n"


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def worker(args) -> dict:
    """One run in this process, with the mlx_mtp found on sys.path."""
    try:
        from mlx_mtp.models.io.loader import load
    except ImportError:  # the flat layout of older checkouts
        from mlx_mtp.loader import load
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.events import Delta, Done, EngineRequest, Failed

    model, tok = load(args.model)
    wanted = dict(num_draft_tokens=args.k, max_concurrency=16, log_interval=0,
                  prefill_step_size=args.prefill_step_size, calibrate=False,
                  max_batched_tokens=args.max_batched_tokens)
    accepted = inspect.signature(Engine.__init__).parameters
    engine = Engine(model, tok, **{k: v for k, v in wanted.items() if k in accepted})
    record = _record_fair_share(engine)
    trace = _attach_trace(engine, args.trace)
    engine.start()

    lock = threading.Lock()
    stamps = [[] for _ in range(args.streams)]  # per stream: times of token events
    firsts = {}

    def recorder(i):
        def on_event(ev):
            if isinstance(ev, Delta) and ev.token_ids:
                with lock:
                    stamps[i].append(time.perf_counter())
        return on_event

    def first_token(name, done_event):
        def on_event(ev):
            if isinstance(ev, Delta) and ev.token_ids and name not in firsts:
                firsts[name] = time.perf_counter()
            if isinstance(ev, (Done, Failed)):  # the end (Admitted comes first)
                done_event.set()
        return on_event

    # Warm-up: MLX's CPU backend compiles kernels on first use (seconds each); a running
    # server has long done so, so the measured runs must not include it.
    warm = threading.Event()
    warm_ids = tok.encode(LONG_TEXT * 200, add_special_tokens=False)[:1200]
    engine.submit(EngineRequest(prompt=warm_ids, max_tokens=8,
                                on_event=first_token("warm-up", warm)))
    warm.wait(600)

    streams = []
    for i in range(args.streams):
        ids = tok.encode(STREAM_PROMPT.format(i=i), add_special_tokens=False)
        streams.append(EngineRequest(prompt=ids, max_tokens=10 ** 6, on_event=recorder(i)))
        engine.submit(streams[-1])
    deadline = time.time() + 300
    while not all(len(s) > 5 for s in stamps):
        if time.time() > deadline:
            raise RuntimeError("streams did not start")
        time.sleep(0.05)
    t_base = time.perf_counter()
    time.sleep(args.baseline_s)

    longs = _submit_long_prompts(engine, tok, args, first_token)
    t_first = longs[0]["arrival"]
    time.sleep(args.short_delay_s)
    t_short = time.perf_counter()
    short_done = threading.Event()
    engine.submit(EngineRequest(prompt=tok.encode("Say hi.", add_special_tokens=False),
                                max_tokens=4, on_event=first_token("short", short_done)))
    cap = time.perf_counter() + args.time_cap_s
    for p in longs:
        p["done"].wait(max(0.0, cap - time.perf_counter()))
    short_done.wait(max(0.0, min(600, cap - time.perf_counter())))
    t_end = time.perf_counter()
    time.sleep(args.baseline_s if streams else 0.0)  # the streams alone again, longer now
    t_after = time.perf_counter()
    for r in streams:
        engine.cancel(r)
    engine.shutdown()
    if trace is not None:
        trace.close()

    def gaps(t0, t1):
        return [(b - a) * 1e3 for s in stamps for a, b in zip(s, s[1:]) if t0 <= a and b <= t1]

    # The union of the prefills: from the first arrival to the last prompt's first token.
    t_last = max(firsts.get(p["name"], t_end) for p in longs)
    base, during = gaps(t_base, t_first), gaps(t_first, t_last)
    after = gaps(t_end, t_after)
    prompts = [{"tokens": p["tokens"], "arrival_s": p["arrival"] - t_first,
                "ttft_s": firsts.get(p["name"], float("nan")) - p["arrival"],
                "prefill_tok_s": p["tokens"] / (firsts.get(p["name"], float("nan"))
                                                - p["arrival"])} for p in longs]
    total = sum(p["tokens"] for p in longs)
    return {
        "baseline_p50_ms": percentile(base, 0.5), "baseline_p99_ms": percentile(base, 0.99),
        "after_p50_ms": percentile(after, 0.5), "after_p99_ms": percentile(after, 0.99),
        # the streams' own step at the contexts they grew to: part of a gap is that growth
        "after_step_p50_ms": percentile([r[2] * 1e3 for r in record if r[0] == "decode"
                                         and t_end <= r[1] <= t_after], 0.5),
        "finished": sum(p["name"] in firsts for p in longs),
        "during_p50_ms": percentile(during, 0.5), "during_p99_ms": percentile(during, 0.99),
        "during_max_ms": max(during, default=float("nan")), "during_gaps": len(during),
        "long_ttft_s": t_last - t_first, "prefill_tok_s": total / (t_last - t_first),
        "short_ttft_s": firsts.get("short", float("nan")) - t_short,
        "prompt_tokens": total, "prompts": prompts,
        # the trace's iterations over the same union of the prefills (its clock from attach)
        "trace_window_s": trace and [t_first - trace.t0, t_last - trace.t0],
        **_fair_share_figures(record, t_first, t_last,
                              {p["request_id"]: i for i, p in enumerate(longs)}),
    }


def _submit_long_prompts(engine, tok, args, first_token) -> list:
    """Submit each ``--prompt-tokens`` prompt, ``--prompt-delay-s`` apart; each its own
    text (no shared prefix to restore)."""
    from mlx_mtp.server.events import EngineRequest

    longs = []
    for i, n in enumerate(args.prompt_tokens):
        if i:
            time.sleep(args.prompt_delay_s)
        ids = tok.encode(f"# file {i}\n" + LONG_TEXT * (n // 8 + 1),
                         add_special_tokens=False)[:n]
        done, name = threading.Event(), f"long{i}"
        req = EngineRequest(prompt=ids, max_tokens=1, on_event=first_token(name, done))
        longs.append({"name": name, "tokens": len(ids), "done": done,
                      "request_id": req.request_id, "arrival": time.perf_counter()})
        engine.submit(req)
    return longs


def _attach_trace(engine, path):
    """``--trace``: one JSON line per scheduler iteration (``server/iteration_trace.py``);
    None for checkouts without it."""
    if not path:
        return None
    try:
        from mlx_mtp.server.iteration_trace import IterationTrace
    except ImportError:
        return None
    return IterationTrace.attach(engine, path)


def _record_fair_share(engine) -> list:
    """The scheduler's own accounting, per call: (kind, end time, seconds, tokens,
    competing, prompt key); empty for checkouts without ``engine.fair``."""
    record, fair = [], getattr(engine, "fair", None)
    if fair is None:
        return record
    prefill_ran, decode_ran = fair.prefill_ran, fair.decode_ran

    def on_prefill(seconds, tokens, competing, *prompt):  # older checkouts: no prompt
        record.append(("prefill", time.perf_counter(), seconds, tokens, competing,
                       prompt[0] if prompt else None))
        prefill_ran(seconds, tokens, competing, *prompt)

    def on_decode(seconds, competing):
        record.append(("decode", time.perf_counter(), seconds, 0, competing, None))
        decode_ran(seconds, competing)

    fair.prefill_ran, fair.decode_ran = on_prefill, on_decode
    return record


def _fair_share_figures(record: list, t0: float, t1: float, names: dict) -> dict:
    """From the record between the first long prompt's arrival and the last one's first
    token: the prompts' part of the timed time, the part of the wall time timed at all, the
    chunks' sizes and their cost per token, the decode steps' median; per long prompt
    (``names``: request id -> index), its part of the prompts' time, chunks, cost a token."""
    inside = [r for r in record if t0 <= r[1] <= t1]
    chunks = [r for r in inside if r[0] == "prefill" and r[3]]
    steps = [r[2] for r in inside if r[0] == "decode"]
    prompt_s, decode_s = sum(r[2] for r in chunks), sum(steps)
    if not chunks:
        return {}
    sizes = sorted(r[3] for r in chunks)
    iterations, tokens, seconds = [], 0, 0.0  # per decode step: [tokens, prompt ms, step ms]
    for kind, _, s, n, _, _ in inside:
        if kind == "prefill":
            tokens, seconds = tokens + n, seconds + s
        else:
            iterations.append([tokens, round(seconds * 1e3, 2), round(s * 1e3, 2)])
            tokens, seconds = 0, 0.0
    return {
        "prompt_share": prompt_s / (prompt_s + decode_s),
        "timed_of_wall": (prompt_s + decode_s) / (t1 - t0),
        "chunks": len(chunks), "chunk_p50_tokens": sizes[len(sizes) // 2],
        "chunks_under_8": sum(n < 8 for n in sizes),
        "prompt_ms_per_token": prompt_s * 1e3 / sum(sizes),
        "decode_step_p50_ms": percentile(steps, 0.5) * 1e3 if steps else float("nan"),
        "per_prompt": [_prompt_figures([r for r in chunks if names.get(r[5]) == i], prompt_s)
                       for i in sorted(set(names.values()))],
        "iterations": iterations,
        # Context grows along the prompt, so sizes used late look dearer; still the best
        # hint of what a call's size costs (chunks of 10-63 tokens run the recurrence's
        # per-position op loop, 8-9 its compiled graph: models/hybrid.py).
        "ms_per_token_by_size": {n: round(statistics.median(
            r[2] * 1e3 / n for r in chunks if r[3] == n), 2) for n in set(sizes)},
    }


def _prompt_figures(chunks: list, prompt_s: float) -> dict:
    """One long prompt's chunks (empty on checkouts that do not name the prompt)."""
    seconds, tokens = sum(r[2] for r in chunks), sum(r[3] for r in chunks)
    return {"share_of_prompt_time": seconds / prompt_s if prompt_s else float("nan"),
            "chunks": len(chunks),
            "ms_per_token": seconds * 1e3 / tokens if tokens else float("nan")}


def run_tree(tree: str, args, streams: int, trace: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--prompt-tokens",
           ",".join(map(str, args.prompt_tokens)), "--prompt-delay-s",
           str(args.prompt_delay_s), "--streams", str(streams), "--k", str(args.k),
           "--prefill-step-size", str(args.prefill_step_size), "--max-batched-tokens",
           str(args.max_batched_tokens), "--baseline-s", str(args.baseline_s),
           "--short-delay-s", str(args.short_delay_s), "--time-cap-s", str(args.time_cap_s)]
    if trace:
        cmd += ["--trace", os.path.abspath(trace)]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    if out.returncode:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(path: str, window=None, top: int = 12) -> str:
    """A trace's long iterations (``--trace``) inside ``window`` (seconds on the trace's
    clock; None: all): the p50/p99 of their wall time, what the ones at or over the p99
    held, and the longest ``top`` part by part."""
    with open(path) as f:
        its = [json.loads(line) for line in f]
    if window:
        its = [it for it in its if window[0] <= it["t"] <= window[1]]
    if not its:
        return f"{path}: no iterations"
    walls = [it["wall_ms"] for it in its]
    p50, p99 = percentile(walls, 0.5), percentile(walls, 0.99)
    steps = [it["decode"]["ms"] for it in its if it["decode"]]
    step50 = percentile(steps, 0.5)
    tail = [it for it in its if it["wall_ms"] >= p99]
    why = {"a join": lambda it: any(c["joined"] for c in it["chunks"]),
           "a prefix store": lambda it: any(c["store_ms"] for c in it["chunks"]),
           "a row leaving": lambda it: it["remove_ms"] > 1,
           "GC >= 10 ms": lambda it: it["gc_ms"] >= 10,
           "a step > 2x the median": lambda it: (it["decode"] or {}).get("ms", 0) > 2 * step50,
           "a chunk > 1.5x its estimate": lambda it: any(
               c.get("est_ms") and c["ms"] > 1.5 * c["est_ms"] for c in it["chunks"]),
           "chunks > 1.5 median steps": lambda it: sum(c["ms"] for c in it["chunks"])
           > 1.5 * step50}
    lines = [f"{path}: {len(its)} iterations, wall p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
             f"max {max(walls):.0f} ms; decode step p50 {step50:.0f} ms; of the "
             f"{len(tail)} at or over the p99: " + ", ".join(
                 f"{sum(map(test, tail))} {name}" for name, test in why.items())]
    for it in sorted(its, key=lambda it: -it["wall_ms"])[:top]:
        d = it["decode"] or {}
        chunks = " ".join(f"{c['tokens']}@{c['offset']}:{c['ms']:.0f}/{c.get('est_ms')}"
                          + ("+head" if c.get("run_head") else "")
                          + (f"+join {c['join_ms']:.0f}" if c["joined"] else "")
                          + (f"+store {c['store_ms']:.0f}" if c["store_ms"] else "")
                          for c in it["chunks"])
        lines.append(
            f"  #{it['i']} t={it['t']:.1f}s wall {it['wall_ms']:.0f}: chunks [{chunks}] "
            f"step {d.get('ms', 0):.0f} ({d.get('rows', 0)} rows, ks {d.get('ks')}, "
            f"{d.get('tokens')} tokens, contexts {d.get('contexts')}, {d.get('cache_mb')} MB) "
            f"remove {it['remove_ms']:.0f} gc {it['gc_ms']:.0f} admit {it['admit_ms']:.0f} "
            f"other {it['other_ms']:.0f}")
    return "\n".join(lines)


def token_counts(text: str) -> list:
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of counts: {text!r}")
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive: {text!r}")
    return counts


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare")
    ap.add_argument("--passes", type=int, default=2, help="A B, then B A, ... (default 2)")
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--prompt-tokens", type=token_counts, default=[30000],
                    help="long prompts' lengths, comma-separated (e.g. 8000,30000)")
    ap.add_argument("--prompt-delay-s", type=float, default=0.0,
                    help="seconds between the long prompts' arrivals (default 0: together)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--k", type=int, default=3, help="MTP draft tokens (0: plain)")
    ap.add_argument("--prefill-step-size", type=int, default=512)
    ap.add_argument("--max-batched-tokens", type=int, default=128)
    ap.add_argument("--baseline-s", type=float, default=3.0)
    ap.add_argument("--short-delay-s", type=float, default=0.5)
    ap.add_argument("--solo", action="store_true",
                    help="also time the prompts alone: their prefill rates with streams / alone")
    ap.add_argument("--json", default=None, help="write every run to this file")
    ap.add_argument("--time-cap-s", type=float, default=3600.0,
                    help="stop waiting for the long prompts after this many seconds")
    ap.add_argument("--trace", default=None,
                    help="write each run's scheduler iterations to FILE-<tree>-<pass>[-solo]"
                         ".jsonl (server/iteration_trace.py) and print the longest ones")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def measure(tree: str, args, label: str) -> dict:
    """One run with the streams (and with ``--solo`` one without), compared; ``label``
    names its traces."""
    trace = f"{args.trace}-{label}" if args.trace else ""
    r = run_tree(tree, args, args.streams, trace and trace + ".jsonl")
    if trace:
        print(summarize(trace + ".jsonl", r.get("trace_window_s")), flush=True)
    r["itl_p99_vs_solo"] = r["during_p99_ms"] / r["baseline_p99_ms"]
    r["itl_p99_vs_after"] = r["during_p99_ms"] / r["after_p99_ms"]  # at the same contexts
    if args.solo:
        alone = run_tree(tree, args, 0, trace and trace + "-solo.jsonl")
        r["solo_prefill_tok_s"] = alone["prefill_tok_s"]
        if "prompt_ms_per_token" in alone:
            r["solo_prompt_ms_per_token"] = alone["prompt_ms_per_token"]
        r["prefill_vs_solo"] = r["prefill_tok_s"] / alone["prefill_tok_s"]
        for p, q in zip(r["prompts"], alone["prompts"]):
            p["solo_prefill_tok_s"] = q["prefill_tok_s"]
            p["prefill_vs_solo"] = p["prefill_tok_s"] / q["prefill_tok_s"]
    return r


def report(runs: dict, args):
    print(f"\nload average {os.getloadavg()[0]:.1f}; medians over {args.passes} passes; "
          f"{args.streams} streams, prompts of {args.prompt_tokens} tokens "
          f"{args.prompt_delay_s} s apart; gaps during the union of their prefills")
    keys = ["baseline_p50_ms", "baseline_p99_ms", "after_p99_ms", "during_p50_ms", "during_p99_ms",
            "during_max_ms", "long_ttft_s", "short_ttft_s", "prefill_tok_s", "itl_p99_vs_solo",
            "itl_p99_vs_after"]
    keys += ["prefill_vs_solo"] if args.solo else []
    print("| tree | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for tree, rs in runs.items():
        print(f"| {tree} | " + " | ".join(
            f"{statistics.median(r.get(k, float('nan')) for r in rs):.3g}" for k in keys) + " |")
        for r in rs:  # the scheduler's accounting, per run (with streams, then alone)
            print(f"  {tree}: " + ", ".join(f"{k} {r[k]:.3g}" for k in FAIR_KEYS if k in r))
            print(f"  ms per prompt token by chunk size: {r.get('ms_per_token_by_size')}")
            for p, acct in zip(r["prompts"], r.get("per_prompt") or [{}] * len(r["prompts"])):
                print(f"  prompt of {p['tokens']} tokens: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in {**p, **acct}.items() if k != "tokens"))


def main():
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = {t: [] for t in args.trees}
    for p in range(args.passes):
        for tree in (args.trees if p % 2 == 0 else args.trees[::-1]):
            runs[tree].append(measure(tree, args, f"{args.trees.index(tree)}-{p + 1}"))
            print(f"pass {p + 1} {tree}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in runs[tree][-1].items() if isinstance(v, float)),
                flush=True)
    report(runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
