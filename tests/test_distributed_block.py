"""Block drafters over a model split across two local ranks (``mlx.launch -n 2 --backend
ring``). Tensor and expert: every rank has the whole residual stream, so each runs the
drafter whole (replicated) on its own taps. Pipeline: the drafter runs on rank 0 (the
output's), and the first stage's taps reach it with the hidden it sends (one array); the
other rank holds a stand-in. Either way rank 0's drafts are the ones every rank verifies
(the step's one draft message) and acceptance is decided once. Greedy output, which ids
came from accepted drafts, the drafts made and accepted from the drafter and from the head,
and every drafter pass's proposals (rank 0's, in a pipeline) equal one process's (``distributed_block_rank.single_process``) on the Qwen3.5 hybrid
(dense, tensor and pipeline; MoE, expert), on random trunks with random drafters (drafts
rejected, varied ids) and on oracle trunks with oracle drafters (drafts accepted), at block
widths 1..3 and with the head chained past the block: DFlash and DSpark in every split;
over the pipeline (rank 0: layer 3, rank 1: layers 0-2) also taps on both stages (DFlash
tapping 1 and 3) and EAGLE-3 (0, 2, 3; random, and ``block_checks.write_eagle3_oracle``'s
oracle), the other drafters tapping the first stage only (0, 2); and the stream families
GLM-5.3-Flash and Qwen4-Exp with a random DFlash tapping both stages."""

import shutil

import pytest

from block_checks import write_eagle3_oracle
from distributed_block_rank import single_process
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block
from rank_jobs import RankJobs
from test_distributed_streams import FIXTURES, byte_tokenizer

pytestmark = pytest.mark.slow

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
RUNS = [["block", 1], ["block", 2], ["block", 3], ["block+mtp", 4]]
KINDS = ("dflash", "dspark")
# (trunk family, its split, head): the dense trunk split by heads, the MoE one by experts
TRUNKS = [(fam, mode, head) for fam, mode in (("qwen3_5", "tensor"), ("qwen3_5_moe", "expert"),
                                               ("qwen3_5", "pipeline"))
          for head in ("random", "oracle")]
# Over the pipeline only: (name, kind, taps, head); taps on both stages.
PIPELINE_ONLY = [("dflash-both-stages-pipeline-random", "dflash", [1, 3], "random"),
                 ("dflash-both-stages-pipeline-oracle", "dflash", [1, 3], "oracle"),
                 ("eagle3-pipeline-random", "eagle3", [0, 2, 3], "random"),
                 ("eagle3-pipeline-oracle", "eagle3", [0, 2, 3], "oracle")]
# Stream families over the pipeline, a random DFlash tapping both stages on their own
# fixtures: (family, taps, the stages' layers). A Qwen4-Exp tap is its stream mixer's
# output: the first stage holds the mixer too (``tap_modules``).
STREAMS = [("glm5_next", [1, 3], [[3, 5], [0, 3]]), ("qwen4_exp", [1, 5], [[4, 8], [0, 4]])]
NAMES = ([f"{kind}-{mode}-{head}" for kind in KINDS for _, mode, head in TRUNKS]
         + [name for name, *_ in PIPELINE_ONLY]
         + [f"dflash-{fam}-pipeline" for fam, *_ in STREAMS])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_block")
    trunks = {(fam, head): make_tiny(root / f"{fam}-{head}", fam, head, seed=1)
              for fam, _, head in TRUNKS}
    out = []
    for kind in KINDS:
        drafter = make_tiny_block(root / kind, kind, 64, 512, [0, 2], 4, own_embed_head=False,
                                  block_size=4, num_key_value_heads=4)
        for fam, mode, head in TRUNKS:
            out.append({"name": f"{kind}-{mode}-{head}", "model": str(trunks[(fam, head)]),
                        "mode": mode, "oracle": head == "oracle", "drafter": str(drafter)})
    for name, kind, taps, head in PIPELINE_ONLY:
        trunk = trunks[("qwen3_5", head)]
        if kind == "eagle3" and head == "oracle":  # its oracle is written, not made per rank
            drafter = write_eagle3_oracle(trunk, root / name)
        else:
            drafter = make_tiny_block(root / name, kind, 64, 512, taps, 4, own_embed_head=False,
                                      block_size=4, **({} if kind == "eagle3" else
                                                       {"num_key_value_heads": 4}))
        out.append({"name": name, "model": str(trunk), "mode": "pipeline",
                    "oracle": head == "oracle" and kind != "eagle3", "drafter": str(drafter),
                    "accepts": head == "oracle"})
    for fam, taps, stages in STREAMS:
        trunk = root / fam
        shutil.copytree(FIXTURES / fam / "checkpoint", trunk)
        byte_tokenizer(trunk)
        drafter = make_tiny_block(root / f"{fam}-dflash", "dflash", 32, 256, taps,
                                  stages[0][1], own_embed_head=False, block_size=4)
        out.append({"name": f"dflash-{fam}-pipeline", "model": str(trunk), "mode": "pipeline",
                    "oracle": False, "drafter": str(drafter), "stages": stages})
    for j in out:
        j.update(runs=RUNS, prompt=PROMPT, max_tokens=12)
    return out


@pytest.fixture(scope="module")
def runs(jobs, tmp_path_factory):
    """{job name: (job, one process's runs, rank 0's result, rank 1's)}: one run of two
    ranks, the single-process references decoded while the ranks run."""
    script = __import__("distributed_block_rank").__file__
    with RankJobs(script, jobs, tmp_path_factory.mktemp("runs")) as ranks:
        want = [single_process(job) for job in jobs]
        results = ranks.results()
    return {job["name"]: (job, w, *results[job["name"]]) for job, w in zip(jobs, want)}


@pytest.mark.parametrize("name", NAMES)
def test_split_runs_equal_one_process(runs, name):
    job, want, *ranks = runs[name]
    for rank, got in enumerate(ranks):
        assert got["mode"] == job["mode"]
        if job["mode"] == "pipeline" and rank > 0:  # a stand-in drafter: rank 0's drafts
            assert all(r.pop("proposed") is None for r in got["runs"])
            want = [{k: v for k, v in r.items() if k != "proposed"} for r in want]
        assert got["runs"] == want, rank
    if job["mode"] == "pipeline":  # the stages the taps were placed for
        assert [r["stage"] for r in ranks] == job.get("stages", [[3, 4], [0, 3]])
    drafted, accepted = (sum(r["block"][i] for r in want) for i in (0, 1))
    assert 0 < accepted if job.get("accepts", job["oracle"]) else accepted < drafted
    assert all(r["block"][0] > 0 for r in want)


def weight_data_bytes(drafter) -> int:
    """The tensor data of a drafter's safetensors files (each file less its header)."""
    import struct
    from pathlib import Path

    total = 0
    for f in Path(drafter).glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += f.stat().st_size - 8 - struct.unpack("<Q", fh.read(8))[0]
    return total


@pytest.mark.parametrize("name", NAMES)
def test_only_ranks_running_the_drafter_read_its_weights(runs, name):
    """A pipeline rank without the output holds a stand-in: it reads the drafter's config and
    headers, never its tensors (a few KB against the whole data); every rank that runs the
    drafter (rank 0; every rank of a tensor or expert split) reads what it holds."""
    job, _, *ranks = runs[name]
    data = weight_data_bytes(job["drafter"])
    for rank, got in enumerate(ranks):
        if job["mode"] == "pipeline" and rank > 0:
            assert got["drafter_held"] == 0
            assert got["drafter_read"] < data / 4, (got["drafter_read"], data)
        else:  # the weights it holds were read from the file
            assert got["drafter_held"] > data / 4, (got["drafter_held"], data)
            assert got["drafter_read"] >= got["drafter_held"], (rank, got, data)


@pytest.fixture(scope="module")
def generate_args(tmp_path_factory):
    """``generate --draft-model DRAFTER`` (the flags' path: the default source block+mtp, K
    fixed), and what one process prints for it (decoded once for every split)."""
    import subprocess
    import sys

    from test_distributed import TIMEOUT

    root = tmp_path_factory.mktemp("generate")
    trunk = make_tiny(root / "trunk", "qwen3_5", "noisy", trunk_scale=0.2, vocab_size=4096)
    dspark = make_tiny_block(root / "dspark", "dspark", 64, 4096, [0, 2], 4)
    args = ["-m", "mlx_mtp.cli", "generate", "--model", str(trunk), "--prompt", "hello there",
            "--temp", "0", "-m", "8", "--draft-model", str(dspark), "--fixed-k",
            "--num-draft-tokens", "3"]
    single = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=TIMEOUT)
    assert single.returncode == 0, single.stderr
    return args, single.stdout


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_cli_generate_split_with_a_block_drafter(generate_args, tmp_path, mode):
    """``generate --distributed MODE --draft-model DRAFTER`` prints what one process prints,
    with the drafter's drafts (the ranks started as mlx.launch starts them: ``generate``
    under mlx.launch itself is test_distributed.py's)."""
    import sys

    from rank_jobs import run_ranks
    from test_distributed import TIMEOUT

    args, single = generate_args
    dist = run_ranks([sys.executable, *args, "--distributed", mode], tmp_path, TIMEOUT)
    assert dist.returncode == 0, dist.stderr[-3000:]
    def text_and_drafts(out):  # the generated text, and the drafts accepted per source
        return out.split("==========")[1], [x for x in out.splitlines() if x.startswith("MTP:")]

    text, drafts = text_and_drafts(single)
    assert text.strip() and ", block 0/24" in drafts[0], single  # 8 steps of 3
    assert text_and_drafts(dist.stdout) == (text, drafts), dist.stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{drafter: (one server, a pipeline cluster)}, both pairs started at once: a random DFlash
    tapping both stages on a trunk whose answers tell the prompts apart (drafts rejected), and
    EAGLE-3's oracle on the oracle trunk (every draft accepted)."""
    from test_distributed_serve import served_together

    root = tmp_path_factory.mktemp("block_serve")
    noisy = make_tiny(root / "trunk", "qwen3_5", "noisy", trunk_scale=4.0, seed=5,
                      vocab_size=4096)
    oracle = make_tiny(root / "oracle-trunk", "qwen3_5", "oracle", vocab_size=4096)
    drafters = {"dflash": (noisy, make_tiny_block(root / "dflash", "dflash", 64, 4096, [1, 3],
                                                  4, block_size=4, num_key_value_heads=4)),
                "eagle3-oracle": (oracle, write_eagle3_oracle(oracle, root / "eagle3"))}
    with served_together({name: (trunk, "pipeline", ("--draft-model", str(path),
                                                     "--num-draft-tokens", "3", "--fixed-k"))
                          for name, (trunk, path) in drafters.items()}, root) as out:
        yield out


@pytest.mark.parametrize("drafter", ["dflash", "eagle3-oracle"])
def test_serve_pipeline_batch_of_4_with_a_block_drafter(served, drafter):
    """``serve --distributed pipeline --draft-model DRAFTER``: 4 concurrent greedy chats (one
    batch, rows joining at different steps) equal one server's answers, with the drafter's
    drafts counted alike."""
    from concurrent.futures import ThreadPoolExecutor

    from test_distributed_families import SERVE_PROMPTS
    from test_distributed_serve import chat

    def answer(url, prompt):
        r = chat(url, prompt)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]

    server, cluster = served[drafter]
    try:
        cluster.wait()
        server.wait()
        expected = {p: answer(server.url, p) for p in SERVE_PROMPTS}
        server.stop()
        block = [u["draft_tokens_by_source"]["block"] for _, u in expected.values()]
        assert all(b["drafted"] > 0 for b in block)
        if drafter == "dflash":
            assert len({text for text, _ in expected.values()}) == len(SERVE_PROMPTS)
        else:
            assert all(b["accepted"] == b["drafted"] for b in block)
        with ThreadPoolExecutor(4) as pool:
            got = {p: pool.submit(answer, cluster.url, p) for p in SERVE_PROMPTS}
            assert {p: a.result() for p, a in got.items()} == expected
    finally:
        server.stop()
        cluster.kill()
