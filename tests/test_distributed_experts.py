"""Expert parallelism (``--distributed expert``) over two local ranks (mlx.launch, ring
backend): each MoE block's routed experts placed whole on ranks, the rest replicated, one
all_sum per MoE block.

For every family with routed experts (DeepSeek-V3 and V3.2, GLM-4.x, GLM-4.7-Flash, GLM-5,
LongCat-Flash with its identity experts, Step-3.5 / 3.7, MiMo-V2-Flash, Nemotron-H, Mellum,
Bailing, Qwen3.5-MoE, Qwen3-Next, and an 8-bit Qwen3.5-MoE): greedy output of both ranks
equals the single-process decode at K = 0..3 with an oracle head (every draft accepted) and a
noisy one (rejections: every rank rolls back its own caches); on random weights, where every
expert changes the output, the trunk's and the MTP head's logits equal one process's
(float32, up to the order of the sum). Each rank holds what ``rank_shares`` planned (its
experts only; the shared experts on rank 0). One launch runs every job; the reference is the
same decode in this process (itself checked against mlx-lm by each family's own tests). A
batch of 4 served over two expert ranks equals one server's answers.
"""

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.convert.main import convert
from mlx_mtp.models.blocks.expert_split import expert_range
from mlx_mtp.models.distributed import DistributedError, choose_mode
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.split_plan import open_lazily, rank_shares
from mlx_mtp.testing.tiny import make_tiny
from rank_jobs import RankJobs
from test_distributed import RANK_SCRIPT
from test_distributed_families import (BUILDERS, DENSE, KS, MAX_TOKENS, PROMPT, checkpoint,
                                       single_process)

pytestmark = pytest.mark.slow


def qwen(family):
    return lambda p, head, **kw: make_tiny(p, family, head=head, trunk_scale=0.2, **kw)


MOE = {fam: build for fam, build in BUILDERS.items() if fam not in DENSE}
MOE.update(qwen3_5_moe=qwen("qwen3_5_moe"), qwen3_next=qwen("qwen3_next"))
HEADS = ("oracle", "noisy", "random")  # random: the logits check


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("experts")
    out = {(fam, head): checkpoint(tmp_path_factory, fam, head, build)
           for fam, build in MOE.items() for head in HEADS
           if head == "random" or fam in DECODED or fam == "qwen3_5_moe"}
    for head in HEADS:  # MLX layout, 8-bit experts (QuantizedSwitchLinear)
        out[("q8", head)] = root / f"q8_{head}"
        convert(out[("qwen3_5_moe", head)], out[("q8", head)], quantize=True, q_bits=8,
                q_group_size=32, verbose=False)
    return out


# Every family's split is pinned by its logits on random weights (trunk and head); the
# speculative decode over ranks is family-agnostic once those are equal, so greedy decoding
# at K = 0..3 runs on one family of each MoE shape: MLA + shared experts with mlx-lm's
# sharding group, the Qwen hybrid, windows with our own block, identity experts, quantized.
DECODED = ("deepseek_v3", "qwen3_5_moe", "mimo_v2_flash", "longcat_flash", "q8")
JOBS = [(fam, head) for fam in list(MOE) + ["q8"] for head in HEADS
        if head == "random" or fam in DECODED]


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """One run of two ranks: every family x head, expert split; {(family, head): (rank 0,
    rank 1)}. The single-process references are decoded while the ranks run."""
    jobs = [{"name": "-".join(j), "model": str(models[j]), "mode": "expert",
             "ks": [0, 1] if j[1] == "random" else KS, "logits": j[1] == "random",
             "prompt": PROMPT, "max_tokens": MAX_TOKENS} for j in JOBS]
    with RankJobs(RANK_SCRIPT, jobs, tmp_path_factory.mktemp("expert_runs")) as ranks:
        for j in JOBS:
            if j[1] == "random":
                single_logits(models[j])
            else:
                single_process(models[j])
        results = ranks.results()
    return {j: results["-".join(j)] for j in JOBS}


GREEDY = [j for j in JOBS if j[1] != "random"]


@pytest.mark.parametrize("job", GREEDY, ids="-".join)
def test_greedy_equals_single_process(runs, models, job):
    r0, r1 = runs[job]
    assert r0["mode"] == r1["mode"] == "expert"
    expected = single_process(models[job])
    assert r0["tokens"] == expected  # each K: the plain greedy output
    assert r1["tokens"] == r0["tokens"]
    if job[1] == "oracle":  # the head drafts on every rank as in one process
        assert all(r0["accepted"][str(k)] > 0 for k in KS[1:])


@cache
def single_logits(path) -> list:
    from distributed_rank import prompt_logits

    model, _ = load_model(Path(path))
    return prompt_logits(model, PROMPT)


@pytest.mark.parametrize("family", list(MOE) + ["q8"])
def test_logits_equal_single_process_on_random_weights(runs, models, family):
    """Random experts: an expert a rank computed wrongly (or twice, or not at all) moves
    the logits far beyond the float32 difference of summing in another order."""
    expected = [np.array(x) for x in single_logits(models[(family, "random")])]
    for r in runs[(family, "random")]:
        got = [np.array(x) for x in r["logits"]]
        assert len(got) == len(expected) == 2  # trunk and MTP head
        for g, e in zip(got, expected):
            assert np.allclose(g, e, rtol=1e-4, atol=1e-4 * np.abs(e).max()), \
                np.abs(g - e).max()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe", "longcat_flash", "q8"])
def test_each_rank_holds_its_planned_share(runs, models, family):
    """Each rank read its own experts only (the shared ones on rank 0): what it holds after
    loading is what ``rank_shares`` planned from the headers, under the whole model."""
    path = models[(family, "noisy")]
    model, _ = open_lazily(Path(path))
    whole = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    shares = rank_shares(model, "expert", 2)
    assert shares[0].weight_bytes >= shares[1].weight_bytes  # the shared experts, if any
    for share, r in zip(shares, runs[(family, "noisy")]):
        assert share.weight_bytes < whole
        assert abs(r["loaded"]["active"] - share.weight_bytes) <= 0.05 * share.weight_bytes, \
            (r["loaded"], share)


def test_expert_ranges_cover_every_expert_once():
    for n_experts, size in [(4, 2), (6, 4), (256, 8), (5, 3)]:
        ranges = [expert_range(r, size, n_experts) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n_experts
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))


def test_expert_split_refused_clearly(models, tmp_path):
    moe, _ = load_model(models[("deepseek_v3", "noisy")])
    kinds = moe.capabilities.splits
    with pytest.raises(DistributedError, match="4 experts per layer cannot be placed on 8"):
        choose_mode("expert", moe.text.args, 8, kinds, moe.model_type, moe.text)
    assert choose_mode(None, moe.text.args, 2, kinds, moe.model_type, moe.text) == "tensor"
    dense, _ = load_model(BUILDERS["mimo"](tmp_path / "mimo", "random"))
    assert "expert" not in dense.capabilities.splits
    with pytest.raises(DistributedError, match="mimo has no routed experts"):
        choose_mode("expert", dense.text.args, 2, dense.capabilities.splits, dense.model_type,
                    dense.text)


def test_serve_batch_of_4_equals_single_process_and_a_lost_rank_gives_503(tmp_path):
    """DeepSeek-V3 served over two expert ranks: 4 concurrent requests (rows joining at
    different steps, K = 2 fixed so every step drafts and rolls back) answer as one server.
    Then a follower hangs mid-request (its MoE all_sums block rank 0): the watchdog fails the
    request with a 503 in the API's error shape within the bound the other modes have, new
    requests and ``/health`` get 503s, and SIGTERM ends rank 0 though its engine thread sits
    in the blocked collective (as ``test_distributed_serve.py`` checks for a pipeline)."""
    import os
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from server_process import ServerProcess
    from test_distributed_families import SERVE_PROMPTS
    from server_process import metric
    from test_distributed_serve import (EXIT_TIMEOUT, GENERATED, WATCHDOG, Cluster, chat,
                                        decoding, eos_ids)

    # the tokenizer's whole vocabulary; answers that depend on the prompt
    path = BUILDERS["deepseek_v3"](tmp_path / "m", "noisy", vocab_size=4096, trunk_scale=4.0)
    flags = ("--num-draft-tokens", "2", "--fixed-k")
    server = ServerProcess(path, tmp_path, "--temp", "0", *flags, wait=False)
    cluster = None
    try:
        cluster = Cluster(path, tmp_path, "expert", *flags)  # while the server starts
        server.wait()
        expected = {p: chat(server.url, p).json()["choices"][0]["message"]["content"]
                    for p in SERVE_PROMPTS}
        server.stop()
        assert len(set(expected.values())) > 1  # answers tell prompts apart
        with ThreadPoolExecutor(4) as pool:
            jobs = [(p, pool.submit(chat, cluster.url, p)) for p in SERVE_PROMPTS]
            for p, job in jobs:
                r = job.result()
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == expected[p]
                assert r.json()["mtp"]["num_draft_tokens"] > 0  # MTP ran in the batch
        long = {"max_tokens": 3000, "logit_bias": {str(t): -100 for t in eos_ids(path)}}
        with ThreadPoolExecutor(1) as pool:
            before = metric(cluster.url, GENERATED)
            inflight = pool.submit(chat, cluster.url, SERVE_PROMPTS[0], 180.0, **long)
            decoding(cluster.url, before)  # the request decodes
            lost = time.time()
            os.kill(cluster.ranks[1], signal.SIGSTOP)
            r = inflight.result()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "distributed_rank_lost"
        assert time.time() - lost < WATCHDOG + 60
        assert httpx.get(cluster.url + "/health", timeout=5).status_code == 503
        again = chat(cluster.url, SERVE_PROMPTS[1], 30.0)
        assert again.status_code == 503
        assert again.json()["error"]["code"] == "distributed_rank_lost"
        os.kill(cluster.ranks[0], signal.SIGTERM)
        deadline = time.time() + EXIT_TIMEOUT
        while not exited(cluster.ranks[0]):
            assert time.time() < deadline, "rank 0 ignored SIGTERM"
            time.sleep(0.5)
        os.kill(cluster.ranks[1], signal.SIGKILL)  # stopped: it cannot exit by itself
        cluster.wait_exit()
    finally:
        server.stop()
        if cluster is not None:
            cluster.kill()


def exited(pid: int) -> bool:
    """The process is gone or a zombie (exited; its parent has not reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_cli_refuses_an_expert_split_of_a_dense_model_in_one_line(tmp_path, capsys):
    from mlx_mtp.cli import main

    dense = make_tiny(tmp_path / "dense", "qwen3_5", head="noisy", vocab_size=4096)
    code = main(["generate", "--model", str(dense), "--prompt", "hi", "-m", "2",
                 "--distributed", "expert"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "qwen3_5 has no routed experts to place" in err
