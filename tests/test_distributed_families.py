"""Every non-Qwen family split over two local ranks (mlx.launch, ring backend): greedy output
of both ranks equals the single-process decode at K = 0..3, with an oracle head (every
draft accepted, so verify rows and the accept cross ranks) and a noisy one (rejections, so
every rank rolls its own caches back: KV, MLA latents, windows, DSA indexer keys, Mamba
states, MTP chains), pipeline for every family and tensor for those mlx-lm can ``shard()``.

One launch runs every job (starting ranks costs more than the tiny decodes); the reference is
the same decode in this single process (itself checked against mlx-lm's plain decoding by
each family's own tests). Two attention-trunk families are also served over two ranks: a
batch of 4 equals one server's answers, and a follower that hangs fails the request with a
503 within the watchdog's bound, as for Qwen (``test_distributed_serve.py``).
"""

import os
import signal
import time
from functools import cache

import httpx
import pytest

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.distributed import DistributedError, choose_mode
from mlx_mtp.models.io.loader import load_model
from engine_batch import assert_served_as_one_process, served_alone
from mlx_mtp.testing.tiny_attention import make_tiny
from mlx_mtp.testing.tiny_attention import write_tiny
from mlx_mtp.testing.tiny_bailing import make_tiny_bailing_hybrid
from mlx_mtp.testing.tiny_next import make_tiny_mellum, make_tiny_step3p7
from mlx_mtp.testing.tiny_special import (chained_oracle, make_tiny_dsa, make_tiny_longcat_flash,
                                          make_tiny_mimo_v2_flash, make_tiny_nemotron_h,
                                          step3p5_config, step3p5_to_hf)
from rank_jobs import RankJobs
from test_distributed import RANK_SCRIPT

pytestmark = pytest.mark.slow

PROMPT = [1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18]  # past the windows (8) and DSA top-k (6)
MAX_TOKENS = 10
KS = [0, 1, 2, 3]
HEADS = ("oracle", "noisy")


def step3p5_two_kv_groups(**kw):
    """The tiny Step-3.5 with two key/value groups in its sliding layers too (the default
    has one, which two ranks cannot split by heads)."""
    return dict(step3p5_config(**kw),
                attention_other_setting={"num_attention_heads": 4, "num_attention_groups": 2})


BUILDERS = {
    "glm4_moe": lambda p, head, **kw: make_tiny(p, "glm4_moe", head, **kw),
    "glm4_moe_lite": lambda p, head, **kw: make_tiny(p, "glm4_moe_lite", head, **kw),
    "deepseek_v3": lambda p, head, **kw: make_tiny(p, "deepseek_v3", head, **kw),
    "mimo": lambda p, head, **kw: make_tiny(p, "mimo", head, **kw),
    "deepseek_v32": lambda p, head, **kw: make_tiny_dsa(p, "deepseek_v32", head, **kw),
    "glm_moe_dsa": lambda p, head, **kw: make_tiny_dsa(p, "glm_moe_dsa", head, **kw),
    "longcat_flash": make_tiny_longcat_flash,
    "step3p5": lambda p, head, **kw: write_tiny(p, step3p5_two_kv_groups, step3p5_to_hf, head,
                                                oracle=chained_oracle(), **kw),
    "mimo_v2_flash": make_tiny_mimo_v2_flash,
    "nemotron_h": make_tiny_nemotron_h,
    "step3p7": make_tiny_step3p7,
    "mellum": make_tiny_mellum,
    "bailing_hybrid": make_tiny_bailing_hybrid,
}
# The families mlx-lm 0.32.2 can shard(); the others split by layers only.
TENSOR = ("glm4_moe", "glm4_moe_lite", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
          "longcat_flash", "step3p5", "step3p7")


def modes(family):
    return ("pipeline", "tensor") if family in TENSOR else ("pipeline",)


# The families with routed experts also split by experts (test_distributed_experts.py).
DENSE = ("mimo",)


JOBS = [(fam, head, mode) for fam in BUILDERS for head in HEADS for mode in modes(fam)]
# A batch of 4 served by the engine over the same ranks, every family in each of its modes: a
# noisy head on a trunk whose sub-layers count (``trunk_scale``), so rows accept different
# numbers of drafts and a cache rolled back wrongly changes the answer.
SERVED = [(fam, "serve", mode) for fam in BUILDERS for mode in modes(fam)]
SERVE_K = 2


# (family, head) -> its tiny checkpoint, built once per session: test_distributed_experts
# decodes the same builders' checkpoints.
BUILT = {}


def checkpoint(tmp_path_factory, family, head, build=None):
    if (family, head) not in BUILT:
        build = build or BUILDERS[family]
        BUILT[(family, head)] = build(tmp_path_factory.mktemp(f"{family}_{head}"), head)
    return BUILT[(family, head)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {(fam, head): checkpoint(tmp_path_factory, fam, head)
           for fam in BUILDERS for head in HEADS}
    for fam in BUILDERS:
        out[(fam, "serve")] = checkpoint(tmp_path_factory, fam, "serve",
                                         lambda p, _, b=BUILDERS[fam]: b(p, "noisy",
                                                                         trunk_scale=4.0))
    return out


@cache  # per checkpoint: the pipeline and tensor jobs, and the expert split's, share it
def single_process(path) -> dict:
    model, _ = load_model(path)
    return {str(k): [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=k,
                                                    sampling=SamplingParams(temperature=0.0),
                                                    max_tokens=MAX_TOKENS, adaptive=False)]
            for k in KS}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """One run of two ranks: every family x head x mode; {(family, head, mode): (rank 0,
    rank 1)}. The single-process references are decoded while the ranks run."""
    jobs = [{"name": "-".join(j), "model": str(models[j[:2]]), "mode": j[2], "ks": KS,
             "prompt": PROMPT, "max_tokens": MAX_TOKENS} for j in JOBS]
    jobs += [{"name": "-".join(j), "model": str(models[j[:2]]), "mode": j[2], "ks": [SERVE_K],
              "serve": SERVE_K} for j in SERVED]
    with RankJobs(RANK_SCRIPT, jobs, tmp_path_factory.mktemp("family_runs")) as ranks:
        for (fam, head), path in models.items():
            if head == "serve":
                served_alone(path, SERVE_K)
            else:
                single_process(path)
        results = ranks.results()
    return {j: results["-".join(j)] for j in JOBS + SERVED}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_split_kinds_are_declared(models, family):
    model, _ = load_model(models[(family, "noisy")])
    expert = () if family in DENSE else ("expert",)
    assert model.capabilities.splits == modes(family) + expert


@pytest.mark.parametrize("job", JOBS, ids="-".join)
def test_greedy_equals_single_process(runs, models, job):
    r0, r1 = runs[job]
    assert r0["mode"] == r1["mode"] == job[2]
    if job[2] == "pipeline":  # rank 1 runs the first layers, rank 0 the rest
        assert r1["layer_range"][0] == 0 and r1["layer_range"][1] == r0["layer_range"][0]
    assert r0["tokens"] == single_process(models[job[:2]])  # each K: the plain greedy output
    assert r1["tokens"] == r0["tokens"]  # every rank holds the same tokens


@pytest.mark.parametrize("job", SERVED, ids="-".join)
def test_batch_of_4_served_equals_single_process(runs, models, job):
    """The engine over two ranks (rank 0 schedules, rank 1 follows): rows joining at
    different steps answer as one process's engine, token for token."""
    assert_served_as_one_process(*runs[job], job[2], models[job[:2]], SERVE_K)


@pytest.mark.parametrize("family", [f for f in BUILDERS if "tensor" not in modes(f)])
def test_tensor_refused_for_a_family_mlx_lm_cannot_shard(models, family):
    model, _ = load_model(models[(family, "noisy")])
    args, kinds = model.text.args, model.capabilities.splits
    with pytest.raises(DistributedError) as refused:
        choose_mode("tensor", args, 2, kinds, model.model_type)
    assert str(refused.value) == (f"--distributed tensor: {family} has no tensor split "
                                  "(mlx-lm has no shard() for it); use --distributed pipeline")
    assert choose_mode(None, args, 2, kinds, model.model_type) == "pipeline"


def test_tensor_refused_when_a_layer_kind_has_too_few_heads(tmp_path):
    """Step-3.5's sliding layers have their own head counts: one key/value group there
    cannot be split over two ranks."""
    path = write_tiny(tmp_path / "step", step3p5_config, step3p5_to_hf, "random")
    model, _ = load_model(path)
    with pytest.raises(DistributedError, match="num_attention_groups=1 not divisible by 2"):
        choose_mode("tensor", model.text.args, 2, model.capabilities.splits)
    assert choose_mode(None, model.text.args, 2, model.capabilities.splits) == "pipeline"


# serve over two ranks: a batch of 4 concurrent requests (rows joining at different steps),
# K = 2 fixed so every step drafts and rolls back.
SERVE = [("deepseek_v32", "pipeline"), ("glm4_moe_lite", "tensor")]
SERVE_PROMPTS = ["hello there", "def fibonacci(n):", "import os\nimport sys\n", "1, 2, 3,"]


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    """The tokenizer's whole vocabulary, so text prompts stay in range; a trunk whose
    answers depend on the prompt, not only on the chat template's last tokens."""
    root = tmp_path_factory.mktemp("dist_serve")
    return {fam: BUILDERS[fam](root / fam, "noisy", vocab_size=4096, trunk_scale=4.0)
            for fam in {f for f, _ in SERVE}}


@pytest.fixture(scope="module")
def served(text_models, tmp_path_factory):
    """{family: its serve run (``serve_then_hang_a_follower``, a future)}: every family's
    server and cluster started at once and driven in threads, so that a family's wait for the
    watchdog overlaps the others'."""
    from concurrent.futures import ThreadPoolExecutor

    from test_distributed_serve import served_together

    flags = ("--num-draft-tokens", "2", "--fixed-k")
    with served_together({fam: (text_models[fam], mode, flags) for fam, mode in SERVE},
                         tmp_path_factory.mktemp("serve")) as out, \
            ThreadPoolExecutor(len(out)) as pool:
        yield {fam: pool.submit(serve_then_hang_a_follower, server, cluster, text_models[fam])
               for fam, (server, cluster) in out.items()}


def serve_then_hang_a_follower(server, cluster, ckpt) -> dict:
    """The one-process server's answers, the cluster's to the same 4 concurrent requests,
    then a follower that hangs mid-request (SIGSTOP once it decodes; the ring blocks): the
    long request's answer, the seconds from the hang to it, and ``/health`` after."""
    from concurrent.futures import ThreadPoolExecutor

    from server_process import metric
    from test_distributed_serve import GENERATED, chat, decoding, eos_ids

    try:
        cluster.wait()
        server.wait()
        expected = {p: chat(server.url, p).json()["choices"][0]["message"]["content"]
                    for p in SERVE_PROMPTS}
        server.stop()
        with ThreadPoolExecutor(4) as pool:
            jobs = [(p, pool.submit(chat, cluster.url, p)) for p in SERVE_PROMPTS]
            batch = [(p, job.result()) for p, job in jobs]
        long = {"max_tokens": 3000, "logit_bias": {str(t): -100 for t in eos_ids(ckpt)}}
        with ThreadPoolExecutor(1) as pool:
            before = metric(cluster.url, GENERATED)
            inflight = pool.submit(chat, cluster.url, SERVE_PROMPTS[0], 180.0, **long)
            decoding(cluster.url, before)
            lost = time.time()
            os.kill(cluster.ranks[1], signal.SIGSTOP)
            answer = inflight.result()
            seconds = time.time() - lost
        health = httpx.get(cluster.url + "/health", timeout=5).status_code
    finally:
        server.stop()
        cluster.kill()
    return {"expected": expected, "batch": batch, "lost": answer, "seconds": seconds,
            "health": health}


@pytest.mark.parametrize("family,mode", SERVE)
def test_serve_batch_of_4_equals_single_process_and_a_lost_rank_gives_503(served, family, mode):
    from test_distributed_serve import WATCHDOG

    run = served[family].result()
    expected = run["expected"]
    assert len(set(expected.values())) > 1  # answers tell prompts apart
    for p, r in run["batch"]:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected[p]
        assert r.json()["mtp"]["num_draft_tokens"] > 0  # MTP ran in the batch
    # A follower that hangs mid-request: rank 0's watchdog fails the request with a 503 in
    # the API's error shape within the bound Qwen has.
    r = run["lost"]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "distributed_rank_lost"
    assert run["seconds"] < WATCHDOG + 60
    assert run["health"] == 503
