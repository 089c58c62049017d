"""Distributed MTP vs one process: tokens/s, bytes sent and host syncs per step, MTP on/off.

    python benchmarks/distributed.py                 # builds a tiny model, runs everything
    python benchmarks/distributed.py --model PATH --ranks 2 --tokens 128
    python benchmarks/distributed.py --serve         # mlx-mtp serve: one process vs ranks
    python benchmarks/distributed.py --moe           # expert vs tensor split, a tiny MoE

The driver runs the single-process decode itself and each mode under
``mlx.launch -n RANKS --backend ring``; every run decodes the same prompt greedily with
a fixed K (K = 0 is MTP off). Rank 0 counts its host syncs (reads of a step, ``mx.eval``
and ``mx.synchronize`` calls while decoding); bytes and messages are summed over ranks
(the model's own count: hidden states sent down the pipeline, every rank's part of each of
its all_sums; the all_sums inside tensor-parallel layers are not in it). ``all_sums/step`` counts every
collective sum rank 0 issues per step, the layers' included (tensor: two per layer; expert:
one per MoE block; plus the step's shares), and ``weights per rank`` what each rank holds.
``send B/step`` and ``all_sum B/step`` are counted where every collective is issued: the bytes
of each array passed to ``mx.distributed.send`` / ``all_sum`` (summed over ranks, the
layers' all_sums included). ``tap B/step`` is what a block drafter's taps add to a step's
messages, computed from shapes (``--taps``, default five layers spread as z-lab's DFlash):
none where every rank runs every layer (the drafter runs on each rank's own taps), and in a
pipeline B x (K+1) x H per tap per boundary, for the taps on the sending stage and the stages
before it (they ride with the hidden to rank 0, ``models/distributed.py`` ``_stage``);
``tap B counted`` is measured: each K > 0 decoded again with a block drafter (``--drafter``,
by default a random DFlash tapping ``--taps`` on the tiny model), its sends less the
head-only run's.

``--moe`` runs the same on a tiny DeepSeek-V3 with 32 routed experts per MoE layer (MLA,
a shared expert, the first layer dense, an always-accepted head), in the modes single,
tensor and expert by default: the fixture on which expert and tensor splits are compared.

``--serve`` starts ``mlx-mtp serve`` in one process and under ``mlx.launch`` in each mode
(all at once; idle servers only exchange a heartbeat a second), then sends the same
``--concurrency`` greedy chat requests to them in turn, in the order single, pipeline,
tensor, tensor, pipeline, single (``--repeats`` times), and prints each server's median
aggregate tokens/s (K = the last of ``--ks``, fixed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.train.dflash import default_taps

PROMPT = list(range(3, 40))


class SyncCounter:
    """Counts host syncs while decoding: step reads, mx.eval, mx.synchronize; and, at the one
    call site every collective goes through (``mx.distributed``), the all_sums issued and the
    bytes of the arrays passed to ``send`` and ``all_sum`` (the layers' all_sums included)."""

    def __init__(self):
        from mlx_mtp.decode import step

        self.count = 0
        self.all_sums = 0  # collective sums issued (counted apart: not host syncs)
        self.send_bytes = 0  # arrays passed to mx.distributed.send (a pipeline's hiddens, taps)
        self.all_sum_bytes = 0  # arrays passed to mx.distributed.all_sum (this rank's part)
        self._patched = [(step.DecodeBatch, "finish"), (mx, "eval"), (mx, "synchronize")]
        self._orig = [getattr(o, n) for o, n in self._patched]
        for (owner, name), orig in zip(self._patched, self._orig):
            setattr(owner, name, self._counting(orig, "count"))
        mx.distributed.all_sum = self._counting(mx.distributed.all_sum, "all_sums",
                                                "all_sum_bytes")
        mx.distributed.send = self._counting(mx.distributed.send, None, "send_bytes")

    def _counting(self, fn, counter, payload=None):
        def wrapped(*a, **k):
            if counter:
                setattr(self, counter, getattr(self, counter) + 1)
            if payload:  # the array sent is the first argument
                setattr(self, payload, getattr(self, payload) + a[0].nbytes)
            return fn(*a, **k)
        return wrapped


def decode(model, k: int, tokens: int, counter: SyncCounter, source: str = "mtp") -> dict:
    """``tokens`` decoded at K = ``k``, drafts from ``source`` (the head, or ``block``: the
    model's block drafter); per-step figures of this rank."""
    from mlx_mtp.decode.draft_source import DraftSources
    from mlx_mtp.decode.speculative import MTPDecoder

    k, drafter = DraftSources(source, adaptive=False).for_row(k) if k else (0, None)
    dec = MTPDecoder(model, k, adaptive=False, drafter=drafter)
    dec.prefill(PROMPT)
    dec.step()  # warm-up: the first step also writes the prompt's MTP pairs
    dec.finish_pending()
    sent0, msgs0 = getattr(model, "bytes_sent", 0), getattr(model, "messages", 0)
    syncs0, sums0, steps, n = counter.count, counter.all_sums, 0, 0
    send0, sum_bytes0 = counter.send_bytes, counter.all_sum_bytes
    tic = time.perf_counter()
    while n < tokens:
        n += len(dec.step().tokens)
        steps += 1
    dec.finish_pending()
    seconds = time.perf_counter() - tic
    return {"k": k, "tokens_per_s": n / seconds, "steps": steps,
            "tokens_per_step": n / steps,
            "bytes_sent_per_step": (getattr(model, "bytes_sent", 0) - sent0) / steps,
            "messages_per_step": (getattr(model, "messages", 0) - msgs0) / steps,
            "host_syncs_per_step": (counter.count - syncs0) / steps,
            "all_sums_per_step": (counter.all_sums - sums0) / steps,
            "send_bytes_per_step": (counter.send_bytes - send0) / steps,
            "all_sum_bytes_per_step": (counter.all_sum_bytes - sum_bytes0) / steps}


def measured(model, k: int, args, counter: SyncCounter, group, source: str = "mtp") -> dict:
    """The medians of ``args.repeats`` decodes at K = ``k``; bytes and messages summed over
    the ranks (what all ranks sent, not rank 0's share only)."""
    runs = [decode(model, k, args.tokens, counter, source) for _ in range(args.repeats)]
    row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    if group is not None:
        for key in ("bytes_sent_per_step", "messages_per_step", "send_bytes_per_step",
                    "all_sum_bytes_per_step"):
            row[key] = mx.distributed.all_sum(mx.array(row[key]), group=group).item()
    return row


def tap_bytes_per_step(taps, stage_ends, rows: int, positions: int, hidden_size: int,
                       itemsize: int) -> int:
    """The bytes a pipeline block drafter's taps add to one pass's messages. ``stage_ends``:
    each rank's stage end (exclusive layer id), in rank order; rank 0 runs the last stage and
    sends nothing, every other rank sends its hidden with the taps of the layers before its
    end, ``rows`` x ``positions`` x ``hidden_size`` values each."""
    per_tap = rows * positions * hidden_size * itemsize
    return sum(per_tap * sum(t < end for t in taps) for end in stage_ends[1:])


def run_rank(args):
    """Inside a launch (or alone): decode with each K, repeat, print rank 0's medians."""
    from mlx_mtp.models.io.loader import load_model

    group = mx.distributed.init() if args.mode != "single" else None
    if group is None:
        model, _ = load_model(Path(args.model))
    else:
        from mlx_mtp.models.distributed import load_distributed

        model, _ = load_distributed(args.model, args.mode, group)
    held = [sum(v.nbytes for _, v in tree_flatten(model.text.parameters()))]
    if group is not None:  # every rank's, in rank order (MiB and the rest: int32 words)
        mine = mx.zeros((group.size(), 2), mx.int32).at[group.rank()].add(
            mx.array(divmod(held[0], 1 << 20), mx.int32))
        held = [(mib << 20) + rest for mib, rest in
                mx.distributed.all_sum(mine, group=group).tolist()]
    shapes = {}
    if args.mode == "pipeline":  # each stage's end, in rank order: where the taps cross
        ends = mx.zeros((group.size(),), mx.int32).at[group.rank()].add(model.layer_range[1])
        shapes = {"stage_ends": mx.distributed.all_sum(ends, group=group).tolist(),
                  "hidden_size": model.text.args.hidden_size,
                  "hidden_itemsize": model.hidden_dtype.size}
    counter = SyncCounter()
    rows = [measured(model, k, args, counter, group) for k in args.ks]
    if args.drafter:  # the same with the block drafter's drafts: its taps ride the sends
        from mlx_mtp.drafters.block.load import attach_block_drafter

        attach_block_drafter(model, args.drafter)
        for row in (r for r in rows if r["k"] > 0):  # K = 0: nothing drafts, no taps
            block = measured(model, row["k"], args, counter, group, "block")
            row["tap_bytes_counted"] = (block["send_bytes_per_step"]
                                        - row["send_bytes_per_step"])
    if group is None or group.rank() == 0:
        print(json.dumps({"mode": args.mode, "rows": rows, "weight_bytes": held, **shapes}))


def _tiny_model(directory) -> str:
    from mlx_mtp.testing.tiny import make_tiny

    return str(make_tiny(Path(directory) / "bench", "qwen3_5", head="noisy", trunk_scale=0.1,
                         hidden=256, num_layers=8, vocab_size=4096))


def _tiny_moe(directory) -> str:
    from mlx_mtp.testing.tiny_attention import tiny_config, to_hf, write_tiny

    def config(**c):
        return dict(tiny_config("deepseek_v3", **c), n_routed_experts=32, n_group=4,
                    topk_group=2)

    return str(write_tiny(Path(directory) / "bench-moe", config, to_hf, "oracle",
                          hidden=128, num_layers=8, vocab_size=1024))


def _tiny_drafter(directory, model: str, taps) -> str:
    """A random DFlash for the tiny dense model, tapping ``taps`` (drafts rejected: the bytes
    per step do not depend on acceptance)."""
    from mlx_mtp.testing.tiny_block import make_tiny_block

    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    layers = text["num_hidden_layers"]
    return str(make_tiny_block(Path(directory) / "dflash", "dflash", text["hidden_size"],
                               text["vocab_size"], taps or default_taps(layers, 5), layers,
                               own_embed_head=False, block_size=4))


def drive(args):
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = (_tiny_moe if args.moe else _tiny_model)(tmp.name)
        if not args.moe:
            args.drafter = args.drafter or _tiny_drafter(tmp.name, args.model, args.taps)
    modes = args.modes or (["single", "tensor", "expert"] if args.moe
                           else ["single", "pipeline", "tensor"])
    common = ["--model", args.model, "--tokens", str(args.tokens), "--repeats",
              str(args.repeats), "--ks", *map(str, args.ks)]
    common += ["--drafter", args.drafter] if args.drafter else []
    launch = Path(sys.executable).parent / "mlx.launch"
    results = []
    for mode in modes:
        cmd = [sys.executable, __file__, "--rank", "--mode", mode, *common]
        if mode != "single":
            cmd = [str(launch), "-n", str(args.ranks), "--backend", "ring", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-2000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':9} {'K':>2} {'tok/s':>8} {'tok/step':>8} {'bytes sent/step':>15} "
          f"{'send B/step':>11} {'all_sum B/step':>14} {'tap B/step':>10} "
          f"{'tap B counted':>13} {'messages/step':>13} {'host syncs/step':>15} "
          f"{'all_sums/step':>13}  MTP speedup  weights per rank")
    for res in results:
        base = res["rows"][0]["tokens_per_s"] if res["rows"][0]["k"] == 0 else None
        weights = " / ".join(f"{b:,}" for b in res["weight_bytes"])
        for r in res["rows"]:
            speedup = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
            counted = r.get("tap_bytes_counted")
            print(f"{res['mode']:9} {r['k']:>2} {r['tokens_per_s']:8.1f} "
                  f"{r['tokens_per_step']:8.2f} {r['bytes_sent_per_step']:15,.0f} "
                  f"{r['send_bytes_per_step']:11,.0f} {r['all_sum_bytes_per_step']:14,.0f} "
                  f"{_tap_bytes(res, r['k'], args.taps):10,} "
                  f"{'-' if counted is None else f'{counted:,.0f}':>13} "
                  f"{r['messages_per_step']:13.1f} {r['host_syncs_per_step']:15.2f} "
                  f"{r['all_sums_per_step']:13.1f}  {speedup:11}  {weights}")


def _tap_bytes(res: dict, k: int, taps) -> int:
    """A run's tap bytes per step at K (one sequence, a verify pass of K+1 positions)."""
    if "stage_ends" not in res:
        return 0  # one process, or every rank runs every layer: no message
    taps = taps or default_taps(res["stage_ends"][0], 5)  # rank 0's stage ends the trunk
    return tap_bytes_per_step(taps, res["stage_ends"], 1, k + 1, res["hidden_size"],
                              res["hidden_itemsize"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_bench(args):
    import httpx

    k = args.ks[-1]
    launch = Path(sys.executable).parent / "mlx.launch"
    modes = ["single", "pipeline", "tensor"]
    servers = {}
    try:
        for i, mode in enumerate(modes):
            port = _free_port()
            cmd = [sys.executable, "-m", "mlx_mtp.cli", "serve", "--model", args.model,
                   "--port", str(port), "--temp", "0", "--num-draft-tokens", str(k),
                   "--fixed-k", "--log-level", "WARNING"]
            if mode != "single":
                cmd = [str(launch), "-n", str(args.ranks), "--backend", "ring",
                       "--starting-port", str(_free_port()), "--", *cmd,
                       "--distributed", mode]
            servers[mode] = (f"http://127.0.0.1:{port}",
                             subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL,
                                              start_new_session=True))
        body = lambda j: {"messages": [{"role": "user", "content": f"request {j}: def f("}],
                          "max_tokens": args.tokens}
        for mode, (url, proc) in servers.items():
            deadline = time.time() + 600
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.time() > deadline:
                    sys.exit(f"{mode} server did not start")
                time.sleep(0.5)
            httpx.post(url + "/v1/chat/completions", json=body(0), timeout=600)  # warm-up

        def round_(url) -> float:
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                tic = time.perf_counter()
                rs = list(pool.map(lambda j: httpx.post(url + "/v1/chat/completions",
                                                        json=body(j), timeout=600),
                                   range(args.concurrency)))
                seconds = time.perf_counter() - tic
            return sum(r.json()["usage"]["completion_tokens"] for r in rs) / seconds

        results = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes + modes[::-1]:
                results[mode].append(round_(servers[mode][0]))
        print(f"serve, {args.concurrency} concurrent requests of {args.tokens} tokens, K={k} "
              f"fixed, load {os.getloadavg()[0]:.1f}")
        for mode in modes:
            print(f"{mode:9} {statistics.median(results[mode]):8.1f} tok/s (aggregate; runs "
                  f"{', '.join(f'{x:.1f}' for x in results[mode])})")
    finally:
        for _, proc in servers.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for _, proc in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a tiny one is built)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    p.add_argument("--mode", default="single",
                   choices=["single", "pipeline", "tensor", "expert"])
    p.add_argument("--modes", nargs="+", default=None,
                   choices=["single", "pipeline", "tensor", "expert"],
                   help="The runs to compare (default: single, pipeline, tensor; with --moe "
                        "single, tensor, expert)")
    p.add_argument("--taps", type=int, nargs="+", default=None,
                   help="A block drafter's tapped layers, for the pipeline's tap bytes per step "
                        "(default: five spread as z-lab's DFlash)")
    p.add_argument("--drafter", default=None,
                   help="A block drafter for the model: each K > 0 is also decoded with its "
                        "drafts, and the bytes its taps add to the sends counted (default: a "
                        "random DFlash tapping --taps when the tiny dense model is built)")
    p.add_argument("--moe", action="store_true",
                   help="Build a tiny MoE (DeepSeek-V3, 32 experts) instead of the dense one")
    p.add_argument("--serve", action="store_true",
                   help="Benchmark mlx-mtp serve (one process vs each mode) instead")
    p.add_argument("--concurrency", type=int, default=4, help="--serve: requests at once")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        run_rank(args)
    elif args.serve:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = args.model or _tiny_model(tmp)
            serve_bench(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
