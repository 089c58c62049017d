"""Restoring a long prompt's state from ``--prompt-cache-dir`` vs recomputing it.

One process, one model (default: the embedded demo model), MTP on (the head's pass over the
prompt is part of the prefill, as in ``serve``). Per pass, interleaved A B B A:

* recompute: ``MTPDecoder.prefill`` of a ``--prompt-tokens`` prompt in ``--prefill-step-size``
  chunks (what a cold server does), evaluated;
* restore: what a restarted server does on its first request: a new ``SessionStore`` scans
  the directory, finds the entry, reads and rebuilds it, and the decoder restores it
  (evaluated). The file was written by this process, so it is read from the page cache.

Also reported: the entry's size, the background write time (write + fsync + rename), and
that the restored state equals the computed one array for array.

    python benchmarks/session_restore.py [--model DIR] [--prompt-tokens 16384] [--passes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import mlx_mtp  # noqa: F401  (before MLX: it routes CPU matmuls to OpenBLAS)
import mlx.core as mx

from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.session_store import SessionStore, model_fingerprint


def state_arrays(state):
    out = cache_state_arrays(state.cache) + cache_state_arrays(state.mtp_cache or [])
    out += state.owed.hidden + state.owed.tokens
    return out + ([state.last_hidden] if state.last_hidden is not None else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--passes", type=int, default=2, help="A B B A rounds")
    p.add_argument("--dir", default=None, help="cache directory (default: a temporary one)")
    p.add_argument("-o", "--output", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)

    model, tok = load(args.model)
    # Any ids below 4000 (every supported vocabulary is larger); the key is the whole
    # prompt, its state holds all but the last token (which becomes the pending input).
    prompt = [(7919 * i) % 3990 + 8 for i in range(args.prompt_tokens)]
    key = prompt
    fp = model_fingerprint(model)
    directory = args.dir or tempfile.mkdtemp(prefix="session-restore-")

    def recompute():
        dec = MTPDecoder(model, args.num_draft_tokens, prefill_step_size=args.prefill_step_size)
        t = time.perf_counter()
        dec.prefill(prompt)  # evaluates every chunk
        seconds = time.perf_counter() - t
        return seconds, dec

    def restore():
        dec = MTPDecoder(model, args.num_draft_tokens, prefill_step_size=args.prefill_step_size)
        t = time.perf_counter()
        store = SessionStore(directory, fp, max_bytes=1 << 40, min_tokens=1)
        found = store.lookup(key + [1], need_mtp=True)
        assert found is not None, "entry not found"
        dec.restore(found[1])
        dec.prefill(key)  # nothing left to run: sets the pending token, as serve does
        mx.eval(state_arrays(dec.snapshot()))
        return time.perf_counter() - t, dec, found[1]

    seconds, dec = recompute()  # warm-up, and the entry to restore
    state = dec.snapshot()
    writer = SessionStore(directory, fp, max_bytes=1 << 40, min_tokens=1)
    t = time.perf_counter()
    writer.put(key, state, has_mtp=True)
    t_queue = time.perf_counter() - t
    writer.flush(timeout=600)
    t_write = time.perf_counter() - t
    size = os.path.getsize(writer.file_for(key))

    _, _, restored = restore()
    equal = all(a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
                for a, b in zip(state_arrays(restored), state_arrays(state)))
    times = {"recompute": [], "restore": []}
    for _ in range(args.passes):
        for arm in ("recompute", "restore", "restore", "recompute"):
            times[arm].append((recompute if arm == "recompute" else restore)()[0])
    load_avg = os.getloadavg()
    result = {
        "model": args.model or "demo", "prompt_tokens": args.prompt_tokens,
        "num_draft_tokens": args.num_draft_tokens, "prefill_step_size": args.prefill_step_size,
        "entry_bytes": size, "engine_thread_seconds_to_queue": round(t_queue, 4),
        "background_write_seconds": round(t_write, 3),
        "recompute_seconds": [round(x, 3) for x in times["recompute"]],
        "restore_seconds": [round(x, 4) for x in times["restore"]],
        "median_recompute_seconds": round(statistics.median(times["recompute"]), 3),
        "median_restore_seconds": round(statistics.median(times["restore"]), 4),
        "restored_equals_computed": equal, "load_average": [round(x, 2) for x in load_avg],
    }
    result["speedup"] = round(result["median_recompute_seconds"]
                              / result["median_restore_seconds"], 1)
    print(json.dumps(result, indent=1))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
