"""MTP over mx.distributed: two local ranks over the ring backend, launched with mlx.launch.

Each launch runs many decodes (families x modes x K) in one pair of processes: starting
ranks costs more than the tiny decodes. Every distributed output is compared with the
same decode in this (single) process.
"""

import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

from engine_batch import assert_served_as_one_process, served_alone
from mlx_mtp.convert.main import convert
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.distributed import DistributedError, choose_mode
from mlx_mtp.models.split_plan import split_layers
from mlx_mtp.models.blocks.hybrid import HybridArgs
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from rank_jobs import RankJobs, free_port_base, yield_cores

RANK_SCRIPT = Path(__file__).parent / "distributed_rank.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"
TIMEOUT = 420  # two cold Python+MLX starts on a shared, loaded 2-core machine
PROMPT = [5, 17, 301, 44, 9, 120, 77, 3, 250, 61, 18]
MAX_TOKENS = 10
KS = [0, 1, 2, 3]
FAMILIES = ("dense", "moe", "next", "q8", "tied",  # q8: MLX layout, 8-bit
            "dense-oracle", "moe-oracle", "next-oracle")  # every draft accepted
# A batch of 4 served by the engine over the ranks (the MoE one is served over HTTP:
# test_distributed_serve.py): a noisy head on a trunk whose layers matter.
SERVED = ("dense-serve", "next-serve")
SERVE_K = 2
MEMORY_MODEL_BYTES_FRACTION = 0.7  # per-rank cap, as a fraction of the whole model


def launch(*argv, timeout=TIMEOUT, progress=None) -> subprocess.CompletedProcess:
    """``mlx.launch -n 2 --backend ring -- python argv...``, as users run it (cases run in
    bulk: ``rank_jobs.RankJobs``)."""
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port",
           str(free_port_base()), "--", sys.executable, *map(str, argv)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        yield_cores(proc)
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        logs = {p.name: p.read_text()[-300:] for p in progress or [] if p.exists()}
        pytest.fail(f"mlx.launch did not finish in {timeout}s; ranks' progress: {logs}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def single_process(path, ks, temp=0.0, seed=None, mtp_model=None, accepted=False) -> dict:
    """The ids per K decoded in this process (``accepted``: also the accepted drafts)."""
    tokens, drafts = decoded(str(path), tuple(ks), temp, seed, mtp_model)
    return (tokens, drafts) if accepted else tokens


@cache  # per decode: a checkpoint's pipeline and tensor jobs compare with the same one
def decoded(path, ks, temp, seed, mtp_model) -> tuple:
    model, _ = load_model(Path(path), mtp=max(ks) > 0, mtp_model=mtp_model)
    sampling = SamplingParams(temperature=temp, seed=seed)
    out = {str(k): list(generate_step(PROMPT, model, num_draft_tokens=k, sampling=sampling,
                                      max_tokens=MAX_TOKENS, adaptive=False))
           for k in ks}
    return ({k: [t for t, _, _ in o] for k, o in out.items()},
            {k: sum(d for _, _, d in o) for k, o in out.items()})


@cache
def model_bytes(path) -> int:
    model, _ = load_model(Path(path))
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    out = {
        "dense": make_tiny(root / "dense", "qwen3_5", head="random", seed=1),
        "moe": make_tiny(root / "moe", "qwen3_5_moe", head="noisy", trunk_scale=0.2, seed=2),
        "next": make_tiny(root / "next", "qwen3_next", head="noisy", trunk_scale=0.2, seed=3),
        # many layers, so that half of them is well under the whole; sharded with an index
        "deep": make_tiny(root / "deep", "qwen3_5", head="random", seed=4, num_layers=12,
                          shards=3),
        # tied output projection: rank 0 keeps the embedding for it and for the MTP head
        "tied": make_tiny(root / "tied", "qwen3_5", head="noisy", trunk_scale=0.2, seed=6,
                          tie=True),
        # the tokenizer's whole vocabulary: text prompts stay in range
        "text": make_tiny(root / "text", "qwen3_5_moe", head="noisy", trunk_scale=0.2,
                          seed=5, vocab_size=4096),
    }
    for fam, family in (("dense", "qwen3_5"), ("moe", "qwen3_5_moe"), ("next", "qwen3_next")):
        out[f"{fam}-oracle"] = make_tiny(root / f"{fam}-oracle", family, head="oracle",
                                         trunk_scale=0.2, seed=8)
        out[f"{fam}-serve"] = make_tiny(root / f"{fam}-serve", family, head="noisy",
                                        trunk_scale=4.0, seed=9)
    out["q8"] = root / "q8"  # MLX layout, quantized
    convert(out["dense"], out["q8"], quantize=True, q_bits=8, q_group_size=32, verbose=False)
    # a trunk and its split MTP drafter (mlx-vlm's layout), 8-bit like q8
    source = make_tiny(root / "pair-src", "qwen3_5", head="noisy", trunk_scale=0.2, seed=7)
    out["pair"], out["pair-mtp"] = root / "pair", root / "pair-MTP"
    convert(source, out["pair"], split_mtp=out["pair-mtp"], quantize=True, q_bits=8,
            q_group_size=32, mtp_bits=8, verbose=False)
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """One run of two ranks: every distributed job; {name: (job, rank 0 result, rank 1
    result)}. The single-process references are decoded while the ranks run."""
    jobs = [{"name": f"{fam}-{mode}", "model": str(models[fam]), "mode": mode, "ks": KS}
            for fam in FAMILIES for mode in ("pipeline", "tensor")]
    jobs += [{"name": f"seeded-{mode}", "model": str(models["moe"]), "mode": mode,
              "ks": [0, 2], "temp": 1.0, "seed": 11} for mode in ("pipeline", "tensor")]
    cap = int(MEMORY_MODEL_BYTES_FRACTION * model_bytes(models["deep"]))
    jobs += [{"name": f"memory-cap-{mode}", "model": str(models["deep"]), "mode": mode,
              "ks": [0, 2], "memory_limit": cap} for mode in ("pipeline", "tensor")]
    jobs += [{"name": f"split-drafter-{mode}", "model": str(models["pair"]), "mode": mode,
              "ks": KS, "mtp_model": str(models["pair-mtp"])} for mode in ("pipeline", "tensor")]
    for j in jobs:
        j.update(prompt=PROMPT, max_tokens=MAX_TOKENS)
    jobs += [{"name": f"{fam}-{mode}", "model": str(models[fam]), "mode": mode,
              "ks": [SERVE_K], "serve": SERVE_K}
             for fam in SERVED for mode in ("pipeline", "tensor")]
    with RankJobs(RANK_SCRIPT, jobs, tmp_path_factory.mktemp("runs")) as ranks:
        for fam in SERVED:
            served_alone(models[fam], SERVE_K)
        for j in (j for j in jobs if "serve" not in j):  # the tests' single_process calls
            single_process(j["model"], j["ks"], j.get("temp", 0.0), j.get("seed"),
                           j.get("mtp_model"))
        single_process(models["pair"], [0])
        results = ranks.results()
    return {j["name"]: (j, *results[j["name"]]) for j in jobs}


GREEDY = [f"{fam}-{mode}" for fam in FAMILIES for mode in ("pipeline", "tensor")]


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_equals_single_process(runs, name):
    job, r0, r1 = runs[name]
    assert r0["mode"] == r1["mode"] == job["mode"]
    expected = single_process(job["model"], KS)
    assert r0["tokens"] == expected  # K = 0..3, each the plain greedy output
    assert r1["tokens"] == r0["tokens"]  # every rank holds the same tokens
    if "oracle" in name:  # the head drafts, and verify rows cross the ranks accepted
        assert all(r0["accepted"][str(k)] > 0 for k in KS[1:])


@pytest.mark.parametrize("name", [f"{fam}-{mode}" for fam in SERVED
                                  for mode in ("pipeline", "tensor")])
def test_batch_of_4_served_equals_single_process(runs, name):
    """The engine over two ranks (rank 0 schedules, rank 1 follows, ``engine_batch.py``):
    rows joining at different steps answer as one process's engine, token for token."""
    job, r0, r1 = runs[name]
    assert_served_as_one_process(r0, r1, job["mode"], job["model"], SERVE_K)


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_seeded_sampling_equals_single_process(runs, mode):
    job, r0, r1 = runs[f"seeded-{mode}"]
    expected = single_process(job["model"], job["ks"], temp=job["temp"], seed=job["seed"])
    assert r0["tokens"] == expected and r1["tokens"] == r0["tokens"]


def test_pipeline_splits_layers_and_keeps_the_head_on_rank_0(runs):
    job, r0, r1 = runs["dense-pipeline"]
    (s0, e0), (s1, e1) = r0["layer_range"], r1["layer_range"]
    assert s1 == 0 and e1 == s0 and e0 == 4  # rank 1 runs the first layers, rank 0 the rest
    # per speculative step rank 1 sends one hidden and its two zero contributions
    assert r1["messages"] > 0 and r0["bytes_sent"] < r1["bytes_sent"]


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_model_over_a_per_rank_memory_cap_runs_split(runs, models, mode):
    job, r0, r1 = runs[f"memory-cap-{mode}"]
    assert r0["tokens"] == single_process(job["model"], job["ks"])
    whole = model_bytes(models["deep"])
    assert job["memory_limit"] < whole  # the whole model does not fit one rank's cap
    for r in (r0, r1):
        # each rank materialised its own part only (never the other rank's tensors)
        assert r["loaded"]["active"] <= job["memory_limit"], (r["loaded"], whole)
        assert r["loaded"]["peak"] <= job["memory_limit"], (r["loaded"], whole)


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_split_drafter_drafts_on_the_head_rank(runs, mode):
    """--mtp-model with --distributed: the drafter's head is loaded where the model's own
    would be (pipeline: rank 0; tensor: split by heads on every rank)."""
    job, r0, r1 = runs[f"split-drafter-{mode}"]
    tokens, accepted = single_process(job["model"], KS, mtp_model=job["mtp_model"],
                                      accepted=True)
    assert r0["tokens"] == tokens and r1["tokens"] == tokens  # K = 0..3, the plain output
    assert tokens["0"] == single_process(job["model"], [0])["0"]
    assert all(r0["accepted"][str(k)] > 0 for k in KS[1:])  # the drafter's head drafts
    if mode == "pipeline":  # rank 0 runs the head as one process does
        assert r0["accepted"] == accepted


def test_cli_generate_distributed(models):
    args = ["-m", "mlx_mtp.cli", "generate", "--model", str(models["text"]), "--prompt",
            "hello there", "--temp", "0", "-m", "8", "--verbose", "F"]
    single = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # runs beside the ranks
    try:
        dist = launch(*args, "--distributed", "pipeline")
        out, err = single.communicate(timeout=TIMEOUT)
    finally:
        single.kill()
        single.wait()
    assert single.returncode == 0, err
    assert dist.returncode == 0, dist.stderr[-3000:]
    assert dist.stdout == out  # rank 0 prints, the other rank prints nothing


def test_split_layers_balances_bytes_and_gives_rank0_the_head():
    assert split_layers([10] * 8, 0, 2) == [(4, 8), (0, 4)]
    # the head's bytes count on rank 0: it takes fewer layers
    assert split_layers([10] * 8, 40, 2) == [(6, 8), (0, 6)]
    ranges = split_layers([10] * 3, 1000, 3)
    assert ranges == [(2, 3), (1, 2), (0, 1)]  # every rank keeps at least one layer
    with pytest.raises(DistributedError):
        split_layers([10], 0, 2)


def test_choose_mode(monkeypatch):
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    args = HybridArgs(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                      linear_num_value_heads=4, intermediate_size=128)
    assert choose_mode(None, args, 2) == "tensor"
    assert choose_mode(None, args, 3) == "pipeline"  # heads do not divide by 3
    assert choose_mode("pipeline", args, 2) == "pipeline"
    with pytest.raises(DistributedError, match="num_attention_heads=4"):
        choose_mode("tensor", args, 3)


def test_serve_rejects_a_bad_distributed_timeout_clearly(capsys):
    # distributed serve itself: tests/test_distributed_serve.py; in this process (refused
    # before any group or model)
    from test_server_hardening import cli_exit

    code, err = cli_exit(["serve", "--distributed", "pipeline", "--distributed-timeout", "0",
                          "--port", str(free_port_base(1))], capsys)
    assert code == 2
    assert "--distributed-timeout must be > 0" in err and err.count("\n") == 1
    assert "Traceback" not in err

