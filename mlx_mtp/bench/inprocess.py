"""In-process A/B benchmark: plain decoding vs MTP at fixed K (and adaptive K).

Every setting decodes the same prompts in one process. For each repeat and each
prompt, all settings run back to back (in a rotating order), so slow drift of
the machine (thermal state, other load) hits every setting alike; speedups are
medians of the per-(repeat, prompt) ratios to plain decoding.

Pass costs are measured separately, on the caches left by each prompt's
prefill: a plain step (trunk over 1 token + lm_head), a verify pass (trunk over
K+1 tokens with state capture + lm_head on K+1 rows) and one MTP draft call
(head + lm_head). With per-position acceptance they give the ideal speedup
``E[tokens/step] / (c_verify(K) + K * c_draft)``; measured / ideal is the
efficiency (what Python, sampling, rollback and the host sync leave over).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ..models.cache.kv import cache_state_arrays, restore_caches, snapshot_caches
from ..decode.draft_source import DraftSources
from ..drafters.lookup import LookupSettings
from ..decode.policy import DraftPolicy
from ..decode.sampling import SamplingParams, log_softmax
from ..decode.speculative import MTPDecoder, SpecStats
from . import stats as st
from .graph import count_host_syncs, step_graphs
from .prompts import Prompt
from .summary import summarize_setting


@dataclass
class Setting:
    name: str  # "plain", "K=2", "auto", "lookup", "both"
    k: int  # draft tokens (max K for "auto")
    adaptive: bool = False
    draft_source: str = "mtp"  # decode/draft_source.py


def make_settings(ks: Sequence[int], auto: bool = True,
                  sources: Sequence[str] = ("mtp",)) -> List[Setting]:
    """Plain decoding first (the baseline), each fixed K, then adaptive at max K (MTP
    alone), then each other draft source (adaptive; ``both`` at max K)."""
    ks = sorted(set(ks) | {0})
    out = [Setting("plain" if k == 0 else f"K={k}", k) for k in ks] if "mtp" in sources \
        else [Setting("plain", 0)]
    if auto and max(ks) > 0 and "mtp" in sources:
        out.append(Setting("auto", max(ks), adaptive=True))
    if "lookup" in sources:
        out.append(Setting("lookup", 0, adaptive=True, draft_source="lookup"))
    if "both" in sources and max(ks) > 0:
        out.append(Setting("both", max(ks), adaptive=True, draft_source="both"))
    for block in ("block", "block+mtp"):
        if block in sources and max(ks) > 0:
            out.append(Setting(block, max(ks), adaptive=True, draft_source=block))
    return out


@dataclass
class RunResult:
    setting: str
    prompt: str
    category: str
    repeat: int
    prompt_tokens: int
    prompt_time: float  # prefill + the first step (TTFT)
    gen_tokens: int  # tokens after the first step
    gen_time: float
    total_tokens: int
    steps: int  # decode steps after the first
    steps_by_k: Dict[int, int]  # every step, the first included
    peak_memory_gb: float
    spec: SpecStats
    tokens: List[int] = field(repr=False, default_factory=list)
    own_drafted: int = 0  # drafts and acceptances counted from StepOutput
    own_accepted: int = 0
    host_syncs: Optional[int] = None  # during the steps after the first (count_syncs)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_time if self.gen_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "setting": self.setting, "prompt": self.prompt, "category": self.category,
            "repeat": self.repeat, "prompt_tokens": self.prompt_tokens,
            "prompt_time_s": self.prompt_time, "prompt_tps": self.prompt_tps,
            "gen_tokens": self.gen_tokens, "gen_time_s": self.gen_time, "gen_tps": self.gen_tps,
            "total_tokens": self.total_tokens, "steps": self.steps,
            "steps_by_k": {str(k): v for k, v in sorted(self.steps_by_k.items())},
            "peak_memory_gb": self.peak_memory_gb, **{f"spec_{k}": v for k, v in
                                                      self.spec.to_dict().items()},
        }


def run_once(model, ids: Sequence[int], setting: Setting, sampling: SamplingParams,
             max_tokens: int, eos: set = frozenset(), prefill_step_size: int = 2048,
             label: str = "", category: str = "", repeat: int = 0,
             policy: Optional[DraftPolicy] = None, count_syncs: bool = False,
             sources: Optional[DraftSources] = None) -> RunResult:
    """Decode ``max_tokens`` tokens (fewer on EOS) with one setting, timing each phase.
    ``policy``: the adaptive setting's draft policy, kept across its runs (``sources``:
    its context-draft settings and step costs, likewise);
    ``count_syncs``: count host syncs in the decode loop (not for timed runs)."""
    mx.reset_peak_memory()
    k, drafter = (setting.k, None) if sources is None else sources.for_row(setting.k)
    dec = MTPDecoder(model, k, sampling, adaptive=setting.adaptive,
                     prefill_step_size=prefill_step_size, policy=policy, drafter=drafter)
    tokens: List[int] = []
    steps_by_k: Counter = Counter()
    drafted = accepted = 0
    done = False

    def take(out):
        nonlocal done, drafted, accepted
        steps_by_k[out.num_drafted] += 1
        drafted += out.num_drafted
        accepted += out.num_accepted
        for t in out.tokens:
            if done:
                break
            tokens.append(t)
            done = t in eos or len(tokens) >= max_tokens

    t0 = time.perf_counter()
    dec.prefill(ids)
    take(dec.step())
    t1 = time.perf_counter()
    n_first = len(tokens)
    steps = 0
    with count_host_syncs() if count_syncs else contextlib.nullcontext([None]) as syncs:
        while not done:
            take(dec.step())
            steps += 1
    t2 = time.perf_counter()
    mx.synchronize()  # a plain decoder may have launched one more step: let it finish here
    return RunResult(
        setting=setting.name, prompt=label, category=category, repeat=repeat,
        prompt_tokens=len(ids), prompt_time=t1 - t0, gen_tokens=len(tokens) - n_first,
        gen_time=t2 - t1, total_tokens=len(tokens), steps=steps, steps_by_k=dict(steps_by_k),
        peak_memory_gb=mx.get_peak_memory() / 1e9, spec=dec.stats, tokens=tokens,
        own_drafted=drafted, own_accepted=accepted, host_syncs=syncs[0],
    )


# --- pass costs ---------------------------------------------------------------------
def measure_costs(model, ids: Sequence[int], ks: Sequence[int], reps: int = 7,
                  prefill_step_size: int = 2048, verify_lengths: Sequence[int] = ()) -> dict:
    """Seconds for a plain step, a verify pass per K and a draft call, after ``ids``.

    Each pass runs on the caches left by the prompt and is undone afterwards
    (recurrent states restored, KV offsets reset), so every repetition sees the
    same context. Passes run round-robin, ``reps`` times after one warm-up
    round; the median of each is kept. ``verify_lengths``: more drafts per verify pass
    to time (context drafts run 8-32 deep).
    """
    kmax = max(ks) if ks else 0
    has_mtp = model.num_mtp_layers > 0 and kmax > 0
    dec = MTPDecoder(model, kmax if has_mtp else 0, SamplingParams(), adaptive=False,
                     prefill_step_size=prefill_step_size)
    dec.prefill(ids)
    dec.sync_mtp_cache()
    y = dec.y[:, None]  # (1, 1)

    def trunk_pass(tokens, capture):
        def fn():
            h, _ = model.trunk(tokens, dec.cache, capture=capture)
            lp = log_softmax(model.logits(h))
            return [mx.argmax(lp, axis=-1), *cache_state_arrays(dec.cache)]
        return fn

    lengths = [k for k in sorted(set(ks) | set(verify_lengths)) if k > 0]
    drafts = greedy_continuation(model, dec.cache, y, max(lengths, default=0))

    def verify_inputs(k):
        """(1, k+1): y, then the model's own next k tokens, as an always-right head drafts.
        Real drafts differ from each other: k+1 copies of y would route every position of
        an MoE to the same experts and time a verify pass too cheap (2.0 vs 1.9 plain steps
        at K=3 on the glm4_moe fixture)."""
        return mx.concatenate([y, drafts[:, :k]], axis=1)

    passes = {"plain": (trunk_pass(y, False), dec.cache)}
    for k in lengths:
        passes[k] = (trunk_pass(verify_inputs(k), True), dec.cache)
    if has_mtp:
        saved = snapshot_caches(dec.cache)
        _, hidden = model.trunk(y, dec.cache)  # a real trunk hidden for the head
        mx.eval(hidden)
        restore_caches(saved)

        def draft():
            h = model.mtp_forward(hidden, y, dec.mtp_cache)  # the head drafts from draft_logits
            return [mx.argmax(log_softmax(model.draft_logits(h[:, -1])), axis=-1),
                    *cache_state_arrays(dec.mtp_cache)]
        passes["draft"] = (draft, dec.mtp_cache)
    base = {name: snapshot_caches(caches) for name, (_, caches) in passes.items()}
    times: Dict[object, List[float]] = {name: [] for name in passes}
    for i in range(reps + 1):  # round 0 warms up (and grows the KV buffers)
        for name, (fn, caches) in passes.items():
            tic = time.perf_counter()
            mx.eval(fn())
            dt = time.perf_counter() - tic
            restore_caches(base[name])
            if i:
                times[name].append(dt)
    out = {"context_tokens": len(ids), "plain_s": st.median(times["plain"]),
           "verify_s": {k: st.median(v) for k, v in times.items() if isinstance(k, int)}}
    if has_mtp:
        out["draft_s"] = st.median(times["draft"])
    return out


def greedy_continuation(model, cache, y: mx.array, n: int) -> mx.array:
    """(1, n): the tokens plain greedy decoding emits after ``y``; ``cache`` is left as it was."""
    saved = snapshot_caches(cache)
    out = [y]
    for _ in range(n):
        h, _ = model.trunk(out[-1], cache)
        out.append(mx.argmax(model.logits(h[:, -1:]), axis=-1).astype(y.dtype))
        mx.eval(out[-1])
    restore_caches(saved)
    return mx.concatenate(out[1:], axis=1) if n else y[:, :0]


def combine_costs(per_prompt: List[dict]) -> dict:
    """Median over prompts of each cost relative to that prompt's plain step."""
    if not per_prompt:
        return {}
    rel_verify = {}
    for k in per_prompt[0]["verify_s"]:
        rel_verify[k] = st.median(c["verify_s"][k] / c["plain_s"] for c in per_prompt)
    out = {"plain_step_ms": st.median(c["plain_s"] for c in per_prompt) * 1e3,
           "c_verify": rel_verify}
    if "draft_s" in per_prompt[0]:
        out["c_draft"] = st.median(c["draft_s"] / c["plain_s"] for c in per_prompt)
    out["per_prompt"] = per_prompt
    return out


# --- driver ---------------------------------------------------------------------------
@dataclass
class BenchConfig:
    ks: List[int]
    max_tokens: int = 128
    repeats: int = 3
    sampling: SamplingParams = field(default_factory=SamplingParams)
    auto: bool = True
    ignore_eos: bool = False
    cost_reps: int = 7
    warmup_tokens: int = 16
    prefill_step_size: int = 2048
    draft_sources: Sequence[str] = ("mtp",)
    lookup: LookupSettings = field(default_factory=LookupSettings)


def run_inprocess(model, prompts: List[Prompt], encoded: List[List[int]], cfg: BenchConfig,
                  eos: set = frozenset(), progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the interleaved A/B. Returns {"settings": rows, "runs": [...], "costs": {...}}.

    ``progress(description)`` is called once per unit of work (cost measurement,
    warmup, each run) with a short label.
    """
    if model.num_mtp_layers == 0 and max(cfg.ks) > 0:
        raise ValueError("the model has no MTP head; only --num-draft-tokens 0 can run")
    settings = make_settings(cfg.ks, cfg.auto, cfg.draft_sources)
    eos = frozenset() if cfg.ignore_eos else frozenset(eos)
    tick = progress or (lambda _: None)

    # An adaptive setting keeps one policy over its runs, as a server keeps one: step
    # costs measured once carry over instead of being explored on every prompt.
    policies = {s.name: DraftPolicy(adaptive=True) for s in settings if s.adaptive}
    sources = {s.name: DraftSources(s.draft_source, cfg.lookup) for s in settings
               if s.draft_source != "mtp"}

    def go(s, ids, n, **kw):
        return run_once(model, ids, s, cfg.sampling, n, eos, cfg.prefill_step_size,
                        policy=policies.get(s.name), sources=sources.get(s.name), **kw)

    # Warm up every setting once on a short prompt (allocations, first-call costs),
    # counting host syncs per step while at it (the timed runs are not instrumented).
    short = min(encoded, key=len)
    graphs = measure_graphs(model, short, cfg.ks, cfg.prefill_step_size)
    syncs = {}
    for s in settings:
        w = go(s, short, cfg.warmup_tokens, count_syncs=True)
        syncs[s.name] = w.host_syncs / w.steps if w.steps else None
        tick(f"warmup {s.name}")
    # Pass costs, on each prompt's context.
    per_prompt = []
    for p, ids in zip(prompts, encoded):
        c = measure_costs(model, ids, cfg.ks, cfg.cost_reps, cfg.prefill_step_size,
                          verify_lengths=(8, 16, 32) if sources else ())
        c["prompt"] = p.name
        per_prompt.append(c)
        tick(f"costs {p.name}")
    costs = combine_costs(per_prompt)

    runs: List[RunResult] = []
    turn = 0
    for rep in range(cfg.repeats):
        for p, ids in zip(prompts, encoded):
            order = settings[turn % len(settings):] + settings[:turn % len(settings)]
            turn += 1
            for s in order:
                runs.append(go(s, ids, cfg.max_tokens, label=p.name, category=p.category,
                               repeat=rep))
                tick(f"r{rep + 1} {p.name} {s.name}")

    plain = {(r.repeat, r.prompt): r for r in runs if r.setting == "plain"}
    rows = [summarize_setting(s, [r for r in runs if r.setting == s.name], plain, costs)
            for s in settings]
    for s, row in zip(settings, rows):
        row.update(step_figures(row, graphs, syncs.get(s.name)))
    # Lossless check: with greedy decoding every setting must emit plain's tokens.
    if cfg.sampling.greedy:
        for row in rows:
            mism = sum(r.tokens != plain[(r.repeat, r.prompt)].tokens
                       for r in runs if r.setting == row["setting"])
            row["outputs_match_plain"] = mism == 0
            row["mismatched_runs"] = mism
    return {"settings": rows, "runs": runs, "costs": costs, "graphs": graphs,
            "predictions": predictions(rows, costs)}


def measure_graphs(model, ids: Sequence[int], ks: Sequence[int],
                   prefill_step_size: int = 2048) -> dict:
    """``graph.step_graphs`` on the caches left by ``ids`` (one owed MTP pair, as in
    steady decoding)."""
    kmax = max(ks) if model.num_mtp_layers > 0 and ks else 0
    dec = MTPDecoder(model, kmax, SamplingParams(), adaptive=False,
                     prefill_step_size=prefill_step_size)
    dec.prefill(ids)
    dec.sync_mtp_cache()
    return step_graphs(dec, [k for k in ks if k > 0] if kmax else [])


def step_figures(row: dict, graphs: dict, syncs_per_step: Optional[float]) -> dict:
    """Per-step graph nodes and state writes of a setting (expected over its measured
    rejections: a step replays the recurrence when a draft is rejected)."""
    out = {"host_syncs_per_step": syncs_per_step, "realised_over_ideal": row["efficiency"],
           "nodes_per_step": None, "own_nodes_per_step": None, "state_bytes_per_step": None,
           "nodes_draft": None, "nodes_verify": None, "nodes_replay": None}
    k = row["k"]
    if k == 0 and "plain" in graphs:
        g = graphs["plain"]
        out.update(nodes_per_step=g["nodes"], own_nodes_per_step=g["own_nodes"],
                   state_bytes_per_step=g["state_bytes"])
    elif not row["adaptive"] and k in graphs:
        g = graphs[k]
        cum = row["acceptance_per_pos"]
        p_replay = 1.0 - cum[-1] if len(cum) == k else 1.0
        parts = ("draft", "verify", "replay")
        weight = {"draft": 1.0, "verify": 1.0, "replay": p_replay}
        out.update(
            nodes_draft=g["draft"]["nodes"], nodes_verify=g["verify"]["nodes"],
            nodes_replay=g["replay"]["nodes"],
            nodes_per_step=sum(weight[p] * g[p]["nodes"] for p in parts),
            own_nodes_per_step=sum(weight[p] * g[p]["own_nodes"] for p in parts),
            state_bytes_per_step=g["state_bytes_verify"] + p_replay * g["state_bytes_replay"])
    return out


def predictions(rows: List[dict], costs: dict) -> List[dict]:
    """The cost model on this run's acceptance: measured costs and hypothetical ones."""
    from .cost_model import HYPOTHETICAL, MeasuredProfile, prediction_rows

    acc = {r["k"]: r["acceptance_per_pos_conditional"] for r in rows
           if r["k"] > 0 and not r["adaptive"] and len(r["acceptance_per_pos_conditional"]) == r["k"]}
    if not acc or "c_draft" not in costs:
        return []
    measured = MeasuredProfile("this machine (measured)", costs["c_verify"], costs["c_draft"])
    return prediction_rows(acc, [measured, *HYPOTHETICAL])


def work_units(n_settings: int, n_prompts: int, repeats: int) -> int:
    """How many progress ticks ``run_inprocess`` makes."""
    return n_settings + n_prompts + repeats * n_prompts * n_settings


def decode_tps(model, ids: Sequence[int], n: int, k: int, adaptive: bool = True):
    """Generation tok/s of an ``MTPDecoder`` (K = ``k``, or adaptive K <= ``k``) over at least
    ``n`` tokens after the prompt ``ids``, and the decoder (its stats). The first token
    belongs to the prompt, as in mlx-lm's own figures."""
    dec = MTPDecoder(model, k, adaptive=adaptive)
    dec.prefill(ids)
    dec.step()
    got, tic = 0, time.perf_counter()
    while got < n:
        got += len(dec.step().tokens)
    return got / (time.perf_counter() - tic), dec
