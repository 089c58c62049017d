"""What a step does on the host after its one sync, before the next graph is launched.

For each step kind (plain; K = 1, 2, 3 fixed; batch 1 and 4; greedy) on the demo model
(Qwen3.5 hybrid) and a tiny attention-trunk fixture (glm4_moe, noisy head), with the
recurrent rollback built before the sync (``step.ROLLBACK_BEFORE_SYNC``, the default) and
after it: from the sync returning (the step's outputs read) to the next ``mx.async_eval``,
the host's wall time and this thread's CPU time (``time.thread_time``: MLX evaluates on
its own threads, so it is the graph building and bookkeeping alone, little moved by
load); the CPU time until the next verify is queued (the device then has the step's
work) and until the next launch ends; and the graph nodes (primitives) built after the
sync, counted with ``mx.export_to_dot`` as those not in the graph alive at the sync (a
count does not depend on the load): in ``finish`` (the rollback: cache accept and trim,
owed pairs), until the verify is queued, until the launch ends. A plain step launched
ahead (``overlap``) was already running when its predecessor was read: ``hidden``.

    python benchmarks/after_sync.py [--steps 24] [--models demo,attention,PATH]
        [--rollback before,after]
    python benchmarks/after_sync.py --tokens 64 --rounds 4 [--models demo,PATH]

Counts are exact on any load; times are medians (run idle to compare them). With
``--tokens`` it decodes instead, the two rollbacks interleaved (A B B A), and reports
tok/s of each (outputs checked equal): the end-to-end check, to run idle.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads the OpenBLAS shim before MLX, as the CLI does)
import mlx.core as mx

from mlx_mtp.decode import step as step_module
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.policy import DraftPolicy
from mlx_mtp.decode.sequence import Sequence
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.io.loader import load
from mlx_mtp.testing import tiny_attention

DEMO = Path(__file__).resolve().parents[1] / "mlx_mtp" / "assets" / "demo-model"
PROMPT = "def fibonacci(n):\n    "
_DOT = tempfile.mktemp(suffix=".dot")


def node_ids(arrays) -> set:
    """The primitives of the unevaluated graph behind ``arrays`` (their ids while alive)."""
    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return set()
    mx.export_to_dot(_DOT, *arrays)
    with open(_DOT) as f:
        return {ln.split()[1] for ln in f if "shape=rectangle" in ln}


def alive(batch: BatchDecoder, extra=()) -> list:
    """Every array the batch keeps between steps (caches, rows' last tokens, owed pairs)."""
    arrays = cache_state_arrays(batch.cache + (batch.mtp_cache or [])) + list(extra)
    for r in batch.rows:
        arrays.append(r.y)
        if r.owed is not None:
            arrays += r.owed.hidden + r.owed.tokens
    return arrays


class Probe:
    """Wraps ``DecodeBatch.finish`` and ``mx.async_eval`` to time and count the interval."""

    def __init__(self, batch: BatchDecoder):
        self.batch, self.records, self.mark = batch, [], None
        self._finish, self._launch = batch.core.finish, batch.core.launch
        self._async_eval = mx.async_eval

    def __enter__(self):
        self.batch.core.finish, self.batch.core.launch = self.finish, self.launch
        step_module.mx.async_eval = self.async_eval
        return self

    def __exit__(self, *exc):
        del self.batch.core.finish, self.batch.core.launch
        step_module.mx.async_eval = self._async_eval

    def probe_nodes(self) -> set:
        """Nodes ``alive`` makes itself (a batch cache's ``state`` slices its buffers)."""
        first = alive(self.batch)
        return node_ids(alive(self.batch)) - node_ids(first)

    def finish(self, p):
        outputs = [a for a in (p.tokens, p.n_accepted, p.drafts) if a is not None]
        mx.eval(*outputs)  # the sync, taken here so the clock starts when it returns
        hidden = self.batch._ahead is not None  # the next step already runs
        before = node_ids(alive(self.batch, [p.logprobs, p.h_mtp]))
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = self._finish(p)
        t1, c1 = time.perf_counter(), time.thread_time()
        rollback = node_ids(alive(self.batch)) - before - self.probe_nodes()
        t2, c2 = time.perf_counter(), time.thread_time()  # the probe's own time, left out
        self.mark = dict(keep=p, before=before, hidden=hidden, t0=t0 + t2 - t1,
                         c0=c0 + c2 - c1, cpu_rollback=c1 - c0, rollback=rollback)
        return outs

    def async_eval(self, *arrays):
        """The first call after the sync starts the clock's stop; later calls of the same
        launch wait for its end, so every node it builds is still in the graph there."""
        t, c = time.perf_counter(), time.thread_time()
        m = self.mark
        if m is None:
            return self._async_eval(*arrays)
        if "wall" not in m:  # the first launch after the sync
            m.update(wall=t - m["t0"], cpu=c - m["c0"], deferred=[])
        m["deferred"].append((c - m["c0"], arrays))

    def launch(self, *args):
        pending = self._launch(*args)
        c = time.thread_time()
        m, self.mark = self.mark, None
        if m is not None and "wall" in m:  # ids are addresses: ``keep`` held the old graph
            groups = [g for _, g in m["deferred"]]
            # the verify queued: the first launch holding the target's log-probs
            i = next(i for i, g in enumerate(groups) if any(a is pending.logprobs for a in g))
            to_verify = node_ids([a for g in groups[: i + 1] for a in g]) - m["before"]
            built = node_ids([a for g in groups for a in g] + [pending.h_mtp]
                             + alive(self.batch)) - m["before"] - self.probe_nodes()
            self.records.append(dict(hidden=m["hidden"], wall=m["wall"], cpu=m["cpu"],
                                     cpu_rollback=m["cpu_rollback"], cpu_step=c - m["c0"],
                                     cpu_verify=m["deferred"][i][0], rollback=len(m["rollback"]),
                                     to_verify=len(to_verify | m["rollback"]), built=len(built)))
            for group in groups:
                self._async_eval(*group)
        return pending


def batch_of(model, ids, k: int, B: int) -> BatchDecoder:
    """B greedy rows at fixed K on prompts of different lengths, as a server's."""
    batch = BatchDecoder(model, policy=DraftPolicy(adaptive=False), overlap=True)
    for i in range(B):
        seq = Sequence(model, k, adaptive=False)
        seq.prefill(ids[: len(ids) - i])
        batch.add(i, seq)
    return batch


def run(model, ids, k: int, B: int, steps: int) -> dict:
    batch = batch_of(model, ids, k, B)
    for _ in range(3):  # warm-up: compile and first-shape costs
        batch.step()
    with Probe(batch) as probe:
        for _ in range(steps):
            batch.step()
    batch.finish_pending()
    rec = probe.records[1:]  # the first was launched before the probe
    med = {key: statistics.median(r[key] for r in rec) for key in
           ("wall", "cpu", "cpu_rollback", "cpu_verify", "cpu_step", "rollback", "to_verify",
            "built")}
    med["hidden"] = sum(r["hidden"] for r in rec) / len(rec)
    return med


def decode(model, ids, k: int, B: int, tokens: int):
    """Tokens per second of B rows decoding ``tokens`` each, and the rows' tokens."""
    batch = batch_of(model, ids, k, B)
    out = {i: list(o.tokens) for i, o in batch.step().items()}  # the prompt's step
    tic = time.perf_counter()
    while min(len(t) for t in out.values()) < tokens + 1:
        for i, o in batch.step().items():
            out[i] += o.tokens
    batch.finish_pending()
    n = sum(len(t) - 1 for t in out.values())
    return n / (time.perf_counter() - tic), [t[: tokens + 1] for t in out.values()]


def compare(name, model, ids, B: int, k: int, tokens: int, rounds: int):
    """Interleaved A B B A rounds of the two rollbacks: median tok/s, outputs equal."""
    tps, outputs = {True: [], False: []}, []
    for r in range(rounds):
        for before in ((True, False) if r % 2 == 0 else (False, True)):
            step_module.ROLLBACK_BEFORE_SYNC = before
            rate, toks = decode(model, ids, k, B, tokens)
            tps[before].append(rate)
            outputs.append(toks)
    step_module.ROLLBACK_BEFORE_SYNC = True
    assert all(o == outputs[0] for o in outputs), "the two rollbacks' outputs differ"
    a, b = statistics.median(tps[True]), statistics.median(tps[False])
    print(f"{name:26s} K={k} {B:2d} {a:9.2f} {b:9.2f} {a / b:6.3f}", flush=True)


def models(names):
    if "demo" in names:
        model, tok = load(str(DEMO))
        yield "demo (hybrid)", model, tok.encode(PROMPT)
    if "attention" in names:
        with tempfile.TemporaryDirectory() as d:
            path = tiny_attention.make_tiny(os.path.join(d, "m"), "glm4_moe", "noisy",
                                            vocab_size=4096, hidden=64, num_layers=4)
            model, tok = load(str(path))
            yield "glm4_moe tiny (attention)", model, tok.encode(PROMPT)
    for path in (n for n in names if n not in ("demo", "attention")):
        model, tok = load(path)
        yield Path(path).name, model, tok.encode(PROMPT)


def counts(name, model, ids, steps: int, modes):
    for before in modes:
        step_module.ROLLBACK_BEFORE_SYNC = before
        for B in (1, 4):
            for k in (0, 1, 2, 3):
                if k == 0 and not before:
                    continue  # a plain step has no rollback
                m = run(model, ids, k, B, steps)
                print(f"{name:26s} {'plain' if k == 0 else f'K={k}':5s} {B:2d} "
                      f"{'before' if before else 'after':6s} "
                      f"{1e3 * m['wall']:6.2f} {1e3 * m['cpu']:6.2f} "
                      f"{1e3 * m['cpu_rollback']:6.2f} {1e3 * m['cpu_verify']:6.2f} "
                      f"{1e3 * m['cpu_step']:6.2f} {m['rollback']:5.0f} {m['to_verify']:6.0f} "
                      f"{m['built']:6.0f} {m['hidden']:4.0%}", flush=True)
    step_module.ROLLBACK_BEFORE_SYNC = True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--models", default="demo,attention",
                    help="demo, attention and/or checkpoint paths, comma-separated")
    ap.add_argument("--rollback", default="before,after",
                    help="where the replay is built: before and/or after the sync")
    ap.add_argument("--tokens", type=int, default=0,
                    help="instead of counting: decode this many tokens per row with each "
                         "rollback, interleaved, and report tok/s (run idle)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    modes = [m == "before" for m in args.rollback.split(",")]
    if args.tokens:
        print(f"{'model':26s} K   B  tok/s before  after  ratio")
    else:
        print("After the sync, host time (ms) and this thread's CPU time (ms) to the next "
              "async_eval, of it the rollback's CPU time, CPU time until the next verify is "
              "queued and until the next launch ends; graph nodes built in the rollback, until "
              "the verify is queued, until the launch ends. hidden: the next step was already "
              "running. rollback: its replay built before or after the sync.")
        print(f"{'model':26s} {'step':5s} {'B':>2s} {'rollbk':6s} {'host':>6s} {'cpu':>6s} "
              f"{'rb':>6s} {'verify':>6s} {'end':>6s} {'n rb':>5s} {'n vfy':>6s} {'n end':>6s} "
              "hidden")
    for name, model, ids in models(args.models.split(",")):
        if not args.tokens:
            counts(name, model, ids, args.steps, modes)
            continue
        for B in (1, 4):
            for k in (1, 2, 3):
                compare(name, model, ids, B, k, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
