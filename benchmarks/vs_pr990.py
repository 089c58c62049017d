"""Decode speed: mlx-mtp vs mlx-lm PR #990 ("Native MTP speculative decoding").

Both tools run as separate processes from their own virtualenvs; nothing from the
PR is imported here or into mlx_mtp. The PR (and, optionally, its fork's
``feat/mtp-depth`` branch) is installed in throwaway venvs, e.g.::

    git --git-dir=<mirror of ml-explore/mlx-lm> archive refs/pull/990/head | tar -x -C /tmp/pr990
    python3 -m venv /tmp/venv990
    /tmp/venv990/bin/pip install "mlx[cpu]==0.32.4" transformers sentencepiece protobuf pyyaml jinja2
    /tmp/venv990/bin/pip install --no-deps -e /tmp/pr990
    echo <commit> > /tmp/pr990/COMMIT        # optional: recorded in the results

mlx-mtp itself is best measured from a pinned snapshot too (the repo's editable .venv
changes under a long run whenever the working tree does)::

    git archive HEAD | tar -x -C /tmp/ours_snap
    python3 -m venv /tmp/venv_ours && /tmp/venv_ours/bin/pip install -r <(.venv/bin/pip freeze | grep -v mlx-mtp)
    /tmp/venv_ours/bin/pip install --no-deps /tmp/ours_snap
    git rev-parse HEAD > /tmp/venv_ours/COMMIT

Then::

    python benchmarks/vs_pr990.py --pr-venv /tmp/venv990 [--pr-depth-venv /tmp/venv990depth] \
        [--ours-venv .venv] [--rounds 5] [--tokens 128] [--out results.json]
    python benchmarks/vs_pr990.py --summarize results1.json [results2.json ...]   # pool rounds

Checkpoints: tiny Qwen3.5 models in the raw Hugging Face layout (nested text_config,
top-level ``mtp.*``) built by ``mlx_mtp.testing.tiny.make_tiny`` in our venv, with an
"oracle" head (every draft accepted) and a "random" head (~0% accepted), float32
and bfloat16.

Each run is one CLI invocation (greedy, raw prompt without chat template); the
reported figure is the tool's own ``Generation: N tokens, X tokens-per-sec`` line.
Runs are interleaved (round -> model -> config, config order rotated each round)
so that drift in machine load spreads over all configurations.

The two tools count generation speed slightly differently:
  * mlx-lm (PR): tokens 1..N yielded, clock started when token 1 is yielded,
    reports N / t  (counts one token more than it times).
  * mlx-mtp: clock started after the first decode step, which may emit 1+k tokens
    (the first verify pass), reports (N-1) / t.
So the script also derives an end-to-end rate that means the same for both:
N / (prompt_time + generation_time), i.e. tokens per second from the start of
prompt processing to the N-th token, with prompt_time = P / prompt_tps and
generation_time = counted / generation_tps (counted = N for mlx-lm, N-1 for mlx-mtp).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = "def fibonacci(n):"
MODELS = [("oracle", "f32"), ("oracle", "bf16"), ("random", "f32"), ("random", "bf16")]

BUILD = """
import sys, mlx.core as mx
from mlx_mtp.testing.tiny import make_tiny
head, dt, path = sys.argv[1:4]
make_tiny(path, "qwen3_5", head, vocab_size=4096, hidden=512, num_layers=8,
          trunk_scale=0.1, dtype={"f32": mx.float32, "bf16": mx.bfloat16}[dt])
"""

# Runs inside a PR venv (separate process): counts tokens that came from drafts.
PR_ACCEPT = """
import sys
from mlx_lm import load
from mlx_lm.generate import stream_generate
model, tok = load(sys.argv[1])
kw = {"mtp": True}
if int(sys.argv[3]) > 0:
    kw["mtp_depth"] = int(sys.argv[3])
n = d = 0
for r in stream_generate(model, tok, tok.encode(sys.argv[4]), max_tokens=int(sys.argv[2]), **kw):
    n += 1
    d += bool(r.from_draft)
print(n, d)
"""

DEPTH_BASE_SHIM = """
import importlib, sys
g = importlib.import_module("mlx_lm.generate")
_generate_step = g.generate_step
def generate_step(*args, mtp_depth=None, **kwargs):
    return _generate_step(*args, **kwargs)
g.generate_step = generate_step
sys.argv[0] = "mlx_lm.generate"
g.main()
"""

# Runs inside each venv: versions and the source commit (a COMMIT file next to the
# package source or in the venv, else git).
VERSIONS = """
import os, subprocess, sys, importlib
import mlx.core as mx, mlx_lm
pkg = importlib.import_module(sys.argv[1])
src = os.path.dirname(os.path.dirname(pkg.__file__))
commit = "?"
for f in (os.path.join(src, "COMMIT"), os.path.join(sys.prefix, "COMMIT")):
    if os.path.exists(f):
        commit = open(f).read().strip()
        break
else:
    r = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True)
    commit = r.stdout.strip() or "?"
print(mx.__version__, mlx_lm.__version__, getattr(pkg, "__version__", "?"), commit)
"""


def py(venv: Path) -> str:
    return str(venv / "bin" / "python")


def configs(args):
    common = ["--model", "{model}", "--prompt", PROMPT, "--max-tokens", str(args.tokens), "--temp", "0",
              "--ignore-chat-template"]
    out = []
    if args.pr_venv:
        lm = [str(args.pr_venv / "bin" / "mlx_lm.generate")]
        out += [("pr990 base", "lm", lm + common),
                ("pr990 --mtp", "lm", lm + common + ["--mtp"])]
    if args.pr_depth_venv:
        lm = [str(args.pr_depth_venv / "bin" / "mlx_lm.generate")]
        # The branch's CLI passes mtp_depth to generate_step even without --mtp (TypeError),
        # so its baseline runs the same CLI main() with that one keyword dropped.
        out += [("pr990-depth base", "lm", [py(args.pr_depth_venv), "-c", DEPTH_BASE_SHIM] + common)]
        out += [(f"pr990-depth --mtp-depth {d}", "lm", lm + common + ["--mtp", "--mtp-depth", str(d)])
                for d in (1, 2, 3)]
    ours = [str(args.ours_venv / "bin" / "mlx-mtp"), "generate"] + common
    out += [("ours --no-mtp", "ours", ours + ["--no-mtp"])]
    out += [(f"ours K={k} fixed", "ours", ours + ["--num-draft-tokens", str(k), "--fixed-k"])
            for k in (1, 2, 3)]
    out += [("ours adaptive (K<=3)", "ours", ours)]
    return out


STATS = re.compile(r"Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec\s*\n"
                   r"Generation: (\d+) tokens, ([\d.]+) tokens-per-sec")
ACC = re.compile(r"MTP: accepted (\d+)/(\d+)")


def run_one(cmd, model, kind, env):
    cmd = [str(model) if a == "{model}" else a for a in cmd]
    p = subprocess.run(cmd, capture_output=True,
                       text=True, env=env, cwd="/tmp", timeout=900)
    out = p.stdout
    m = STATS.search(out)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-2000:]}\n{p.stderr[-2000:]}")
    P, ptps, N, gtps = int(m[1]), float(m[2]), int(m[3]), float(m[4])
    counted = N if kind == "lm" else N - 1
    e2e = N / (P / ptps + counted / gtps)
    parts = out.split("==========\n")
    text = parts[1].rsplit("\n", 1)[0] if len(parts) > 2 else None
    acc = ACC.search(out)
    return {"prompt_tokens": P, "prompt_tps": ptps, "gen_tokens": N, "gen_tps": gtps,
            "e2e_tps": e2e, "text": text, "accepted": acc.group(0) if acc else None}


def med_range(xs):
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pr-venv", type=Path, default=Path("/tmp/venv990"))
    ap.add_argument("--pr-depth-venv", type=Path, default=None,
                    help="venv with the fork's feat/mtp-depth branch (optional)")
    ap.add_argument("--ours-venv", type=Path, default=HERE.parent / ".venv")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/vs990_models"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("/tmp/vs_pr990_results.json"))
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    models = {}
    for head, dt in MODELS:
        path = args.models_dir / f"{head}_{dt}"
        if not (path / "config.json").exists():
            subprocess.run([py(args.ours_venv), "-c", BUILD, head, dt, str(path)], check=True, env=env)
        models[f"{head} {dt}"] = path

    meta = {"prompt": PROMPT, "tokens": args.tokens, "rounds": args.rounds,
            "cpu_count": os.cpu_count(), "versions": {}, "pr_acceptance": {}}
    for name, venv, pkg in (("pr990", args.pr_venv, "mlx_lm"),
                            ("pr990-depth", args.pr_depth_venv, "mlx_lm"),
                            ("ours", args.ours_venv, "mlx_mtp")):
        if venv:
            v = subprocess.run([py(venv), "-c", VERSIONS, pkg], capture_output=True, text=True,
                               env=env, cwd="/tmp").stdout.split()
            meta["versions"][name] = dict(zip(("mlx", "mlx_lm", pkg, "commit"), v))
            print(name, meta["versions"][name], flush=True)

    # Acceptance of the PR's MTP on each checkpoint (untimed; the PR CLI does not print it).
    for mname, path in models.items():
        for vname, venv, depths in (("pr990", args.pr_venv, [0]),
                                    ("pr990-depth", args.pr_depth_venv, [1, 2, 3])):
            if not venv:
                continue
            for d in depths:
                r = subprocess.run([py(venv), "-c", PR_ACCEPT, str(path), str(args.tokens), str(d),
                                    PROMPT], capture_output=True, text=True, env=env, cwd="/tmp")
                n, k = map(int, r.stdout.split()[-2:])
                key = f"{vname} depth {max(d, 1)} / {mname}"
                meta["pr_acceptance"][key] = f"{k}/{n} tokens from drafts"
                print("acceptance", key, meta["pr_acceptance"][key], flush=True)

    cfgs = configs(args)
    runs = []
    t0 = time.time()
    for r in range(args.rounds):
        for mi, (mname, path) in enumerate(models.items()):
            shift = (r + mi) % len(cfgs)
            for name, kind, cmd in cfgs[shift:] + cfgs[:shift]:
                res = run_one(cmd, path, kind, env)
                res.update(round=r, model=mname, config=name, load1=os.getloadavg()[0],
                           cmd=" ".join([Path(cmd[0]).name] + [
                               str(path) if a == "{model}" else "<DEPTH_BASE_SHIM>"
                               if a == DEPTH_BASE_SHIM else repr(a) if " " in a else a
                               for a in cmd[1:]]))
                runs.append(res)
                print(f"[{time.time() - t0:6.0f}s r{r}] {mname:12s} {name:28s} "
                      f"gen {res['gen_tps']:7.2f}  e2e {res['e2e_tps']:7.2f}  load {res['load1']:.2f}"
                      + (f"  {res['accepted']}" if res["accepted"] else ""), flush=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))

    print()
    summarize([{"meta": meta, "runs": runs}])
    print(f"raw results: {args.out}")


def summarize(results):
    """Markdown tables from one or more result files (their rounds are pooled)."""
    runs, offset = [], 0
    for res in results:
        for x in res["runs"]:
            runs.append(dict(x, round=x["round"] + offset))
        offset += res["meta"]["rounds"]
    models = list(dict.fromkeys(x["model"] for x in runs))
    cfgs = list(dict.fromkeys(x["config"] for x in runs))
    by = {(x["model"], x["config"], x["round"]): x for x in runs}
    loads = [x["load1"] for x in runs]
    print(f"{len(runs)} runs in {offset} rounds; 1-min load average during runs: median "
          f"{statistics.median(loads):.2f} (range {min(loads):.2f}–{max(loads):.2f}) on "
          f"{os.cpu_count()} cores\n")

    def own_base(name):
        if name.startswith("ours"):
            return "ours --no-mtp"
        if name.startswith("pr990-depth") and any(x["config"] == "pr990-depth base" for x in runs):
            return "pr990-depth base"
        return "pr990 base"

    def paired(m, name, ref):
        rs = [by[m, name, r]["e2e_tps"] / by[m, ref, r]["e2e_tps"] for r in range(offset)
              if (m, name, r) in by and (m, ref, r) in by]
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})" if rs else "–"

    for m in models:
        print(f"### {m}\n")
        print("| config | Generation tok/s (own line) | end-to-end tok/s | × own baseline | "
              "× PR #990 --mtp | output = own baseline |")
        print("|---|---|---|---|---|---|")
        for name in cfgs:
            xs = [x for x in runs if x["model"] == m and x["config"] == name]
            base = [x for x in runs if x["model"] == m and x["config"] == own_base(name)]
            same = all(x["text"] == base[0]["text"] for x in xs) if base else None
            acc = xs[-1]["accepted"] or ""
            print(f"| {name} | {med_range([x['gen_tps'] for x in xs])} | "
                  f"{med_range([x['e2e_tps'] for x in xs])} | {paired(m, name, own_base(name))} | "
                  f"{paired(m, name, 'pr990 --mtp')} | "
                  f"{'–' if same is None else 'yes' if same else 'NO'}{' (' + acc + ')' if acc else ''} |")
        a = [x for x in runs if x["model"] == m and x["config"] == "pr990 base"]
        b = [x for x in runs if x["model"] == m and x["config"] == "ours --no-mtp"]
        if a and b:
            print(f"\nPR #990 baseline output == ours --no-mtp output: "
                  f"{'yes' if a[0]['text'] == b[0]['text'] else 'no'}")
        print()
    print("tok/s: median (min–max) over rounds. Ratios: median (min–max) over rounds of the "
          "end-to-end rate divided by the reference run of the same round and model.")


def main_entry():
    if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
        summarize([json.loads(Path(f).read_text()) for f in sys.argv[2:]])
        return 0
    return main()


if __name__ == "__main__":
    sys.exit(main_entry())
