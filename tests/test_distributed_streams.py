"""The stream families split over two local ranks (ring backend, started as mlx.launch starts them: tests/rank_jobs.py): Qwen4-Exp
(``qwen4_exp``), GLM-5.3-Flash (``glm5_next``) and DeepSeek-V4 (``deepseek_v4``), each by
layers (pipeline: the streams cross the stage boundary, with the token ids beside them for
PLE and hash routing), by tensors (attention / KDA heads and expert columns; the stream
mixers, indexers and compressors whole on every rank) and by experts.

Checkpoints are the families' own fixtures, written by transformers 5.24 (or recorded against
it) and checked there by ``test_family_*.py``: their heads are random ("noisy": drafts are
rejected, so every rank rolls back its KDA / DeltaNet states, latents, indexer keys, PLE
windows and DeepSeek-V4's compressed windows with the same accept), and a "partial" head:
an oracle head (Qwen4-Exp's and GLM-5.3-Flash's from their tests, DeepSeek-V4's below) with
noise on its input projection, right about half the time, so steps accept all, some or none
of their drafts; and that oracle head without the noise (every draft accepted). Qwen4-Exp's one
key/value head is duplicated into two (the same model: both query heads read a copy), so its
heads split over two ranks. Each job is checked against the same decode in this process:
greedy ids at K = 0..3 on both ranks, and the trunk's and the MTP head's logits at the
prompt's last row (float32, up to the order of the ranks' sums); and, by pipeline and by
tensors, a batch of 4 served by the engine on the partial head (``engine_batch.py``) equal to
one process's. One launch runs every job.
"""

import json
import shutil
from functools import cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from engine_batch import assert_served_as_one_process, served_alone
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.distributed import choose_mode
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.split_plan import open_lazily, rank_shares
from mlx_mtp.testing.tiny import TOKENIZER_DIR
from mlx_mtp.testing.tiny_streams import deepseek_v4_oracle
from rank_jobs import RankJobs
from test_distributed import RANK_SCRIPT

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures"
# Past DeepSeek-V4's window (8) and its compressed windows (4, 8), GLM's pools (4) and
# Qwen4-Exp's indexer blocks (2), so the sparse selections choose.
PROMPT = [3, 5, 9, 22, 7, 13, 100, 20, 42, 17, 18, 30, 31, 2, 64, 250, 77, 8, 140, 11]
MAX_TOKENS = 10
KS = [0, 1, 2, 3]
MODES = ("pipeline", "tensor", "expert")


def with_tokenizer(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in TOKENIZER_DIR.iterdir():
        if not (dst / f.name).exists():
            shutil.copy(f, dst / f.name)
    return dst


def qwen4_two_kv_heads(dst: Path) -> Path:
    """The Qwen4-Exp fixture with its key/value head written twice (rows of k_proj and
    v_proj repeated): two query heads over two identical key/value heads."""
    path = with_tokenizer(FIXTURES / "qwen4_exp" / "checkpoint", dst)
    weights = load_file(path / "model.safetensors")
    for k, v in weights.items():
        if k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            weights[k] = np.concatenate([v, v])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["num_key_value_heads"] = 2
    (path / "config.json").write_text(json.dumps(config))
    return path


def with_partial_head(src: Path, dst: Path, oracle, projection: str, noise: float) -> Path:
    """``src`` with the weights ``oracle(model)`` makes and ``noise`` (times its largest
    weight) on the head's input ``projection``, written in our layout."""
    weights = dict(tree_flatten(oracle(load_model(src)[0]).parameters()))
    w = weights[projection]
    normal = np.random.default_rng(0).standard_normal(w.shape).astype(np.float32)
    weights[projection] = w + noise * mx.abs(w).max() * mx.array(normal)
    path = with_tokenizer(src, dst)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from test_family_glm5_next import oracle as glm5_oracle
    from test_family_qwen4_exp import oracle as qwen4_oracle

    root = tmp_path_factory.mktemp("streams")
    qwen4 = qwen4_two_kv_heads(root / "qwen4_exp")
    glm5 = with_tokenizer(FIXTURES / "glm5_next" / "checkpoint", root / "glm5_next")
    out = {("qwen4_exp", "noisy"): qwen4, ("glm5_next", "noisy"): glm5,
           ("deepseek_v4", "noisy"): FIXTURES / "deepseek_v4"}
    # (oracle, the head's input projection, the partial head's noise on it); the oracle
    # itself (no noise) accepts every draft
    heads = {"qwen4_exp": (qwen4_oracle, "mtp.fc_embedding.weight", 0.15),
             "glm5_next": (glm5_oracle, "mtp.layers.0.eh_proj.weight", 0.06),
             "deepseek_v4": (deepseek_v4_oracle, "mtp.layers.0.e_proj.weight", 0.06)}
    for fam, (oracle, projection, noise) in heads.items():
        for head, scale in (("partial", noise), ("oracle", 0.0)):
            out[(fam, head)] = with_partial_head(out[(fam, "noisy")], root / f"{fam}_{head}",
                                                 oracle, projection, scale)
    return out


JOBS = [(fam, head, mode) for fam in ("qwen4_exp", "glm5_next", "deepseek_v4")
        for head in ("noisy", "partial", "oracle") for mode in MODES]
# A batch of 4 served by the engine over the same ranks (``engine_batch.py``), the partial
# head: rows accept different numbers of drafts. (One HTTP server per family: SERVE below.)
SERVED = [(fam, "partial", mode) for fam in ("qwen4_exp", "glm5_next", "deepseek_v4")
          for mode in ("pipeline", "tensor")]
SERVE_K = 2


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """One pair of ranks: every family x head x mode; {(family, head, mode): (rank 0, rank 1)}."""
    jobs = [{"name": "-".join(j), "model": str(models[j[:2]]), "mode": j[2], "ks": KS,
             "prompt": PROMPT, "max_tokens": MAX_TOKENS, "logits": j[1] == "noisy"}
            for j in JOBS]
    jobs += [{"name": "served-" + "-".join(j), "model": str(models[j[:2]]), "mode": j[2],
              "ks": [SERVE_K], "serve": SERVE_K} for j in SERVED]
    with RankJobs(RANK_SCRIPT, jobs, tmp_path_factory.mktemp("stream_runs")) as ranks:
        for j in SERVED:
            served_alone(models[j[:2]], SERVE_K)
        got = ranks.results()
    return {**{j: got["-".join(j)] for j in JOBS},
            **{("served",) + j: got["served-" + "-".join(j)] for j in SERVED}}


@cache
def single_process(path: Path) -> tuple:
    """(ids per K, accepted drafts per K, the prompt's trunk and head logits) in one process."""
    from distributed_rank import prompt_logits

    model, _ = load_model(path)
    tokens, accepted = {}, {}
    for k in KS:
        out = list(generate_step(PROMPT, model, num_draft_tokens=k,
                                 sampling=SamplingParams(temperature=0.0),
                                 max_tokens=MAX_TOKENS, adaptive=False))
        tokens[str(k)] = [t for t, _, _ in out]
        accepted[str(k)] = sum(drafted for _, _, drafted in out)
    return tokens, accepted, prompt_logits(model, PROMPT)


@pytest.mark.parametrize("job", JOBS, ids="-".join)
def test_greedy_and_logits_equal_single_process(runs, models, job):
    r0, r1 = runs[job]
    assert r0["mode"] == r1["mode"] == job[2]
    tokens, accepted, logits = single_process(models[job[:2]])
    assert len(set(tokens["0"])) > 2  # not one token repeated
    assert r0["tokens"] == tokens  # each K: the plain greedy output
    assert r1["tokens"] == r0["tokens"]  # every rank holds the same tokens
    if job[1] == "partial":  # drafts accepted and rejected (K = 1: fewer than one a step)
        assert all(r0["accepted"][str(k)] > 0 for k in KS[1:])
        assert r0["accepted"]["1"] < MAX_TOKENS // 2
    if job[1] == "oracle":  # every draft accepted (K = 1: one a step)
        assert r0["accepted"]["1"] == MAX_TOKENS // 2
    if job[2] == "pipeline":  # rank 1 runs the first layers, rank 0 the rest and the head
        assert r1["layer_range"][0] == 0 and r1["layer_range"][1] == r0["layer_range"][0]
        assert r0["accepted"] == accepted  # the same head on the same hiddens
    if r0["logits"] is None:
        return
    for r in (r0,) if job[2] == "pipeline" else (r0, r1):  # pipeline: rank 0 holds the head
        got, want = [np.array(x) for x in r["logits"]], [np.array(x) for x in logits]
        assert len(got) == len(want) == 2  # trunk and MTP head
        for g, e in zip(got, want):
            assert np.allclose(g, e, rtol=1e-4, atol=1e-4 * np.abs(e).max()), \
                np.abs(g - e).max()


@pytest.mark.parametrize("job", SERVED, ids="-".join)
def test_batch_of_4_served_equals_single_process(runs, models, job):
    """The engine over two ranks (rank 0 schedules, rank 1 follows): rows joining at
    different steps answer as one process's engine, token for token."""
    assert_served_as_one_process(*runs[("served",) + job], job[2], models[job[:2]], SERVE_K)


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next", "deepseek_v4"])
def test_each_pipeline_rank_holds_its_planned_share(runs, models, family):
    """Each stage read only its layers (rank 0 also the output side: Qwen4-Exp's stream
    mixer, DeepSeek-V4's ``hc_head`` and norm, the head; the last rank the embedding): what it
    holds after loading is what ``rank_shares`` planned from the headers."""
    model, _ = open_lazily(Path(models[(family, "noisy")]))
    whole = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    for share, r in zip(rank_shares(model, "pipeline", 2), runs[(family, "noisy", "pipeline")]):
        assert share.weight_bytes < whole
        assert abs(r["loaded"]["active"] - share.weight_bytes) <= 0.05 * share.weight_bytes, \
            (r["loaded"], share)


def test_every_kind_is_declared_and_planned(models):
    """Each family offers all three kinds and ``inspect --ranks`` plans each; a pipeline
    never starts a stage at a GLM layer that reuses the indexer selection of the layer
    before it."""
    from mlx_mtp.models.io.loader import load_config
    from mlx_mtp.tools.inspect_ranks import rank_plan

    for (fam, head), path in models.items():
        model, _ = open_lazily(Path(path))
        assert model.capabilities.splits == MODES, fam
        for mode in MODES:
            assert choose_mode(mode, model.text.args, 2, MODES, fam, model.text) == mode
            plan = rank_plan(Path(path), load_config(Path(path)), {
                "kv_bytes_per_1k_tokens": 1000, "state_bytes_per_sequence": 1000}, 2, mode)
            assert [r["layers"] for r in plan["per_rank"]] == \
                [list(s.layers) for s in rank_shares(model, mode, 2)]
        starts = [s.layers[0] for s in rank_shares(model, "pipeline", 2)]
        assert all(model.text.stage_may_start(i) for i in starts)
    glm5, _ = open_lazily(Path(models[("glm5_next", "noisy")]))
    assert not glm5.text.stage_may_start(2)  # the fixture's shared layer


# Served over two ranks, one launch per family in one of its modes (K = 2 fixed: every step
# drafts and rolls back): a batch of 4 concurrent greedy chats (rows joining at different
# steps) equals one server's answers, token for token. The fixtures' vocabulary (256) takes a
# byte-level tokenizer that fits it (``byte_tokenizer``).
SERVE = [("qwen4_exp", "pipeline"), ("glm5_next", "tensor"), ("deepseek_v4", "expert")]
SERVE_PROMPTS = ["hello there, how are you?", "def fibonacci(n):\n    return",
                 "import os\nimport sys\nimport re\n", "1, 2, 3, 5, 8, 13, 21,"]


def byte_tokenizer(dst: Path) -> Path:
    """``dst`` with a byte-level tokenizer whose ids fit a 256-row vocabulary: three specials
    (ids 0-2; ``<|endoftext|>``, id 1, is the fixtures' eos) and every byte but three that
    text prompts never hold (0x9f, 0xa0, 0xad: the alphabet's last), ids 3-255, no merges;
    a chat template that joins the messages. Qwen's tokenizer class (which transformers uses
    for ``qwen4_exp`` whatever the config says) reads it as the generic one does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)[:-3]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return dst


def answer(url: str, prompt: str) -> tuple:
    """A greedy chat answer: its text and each token's bytes (which the text hides where a
    lone byte decodes to U+FFFD)."""
    from test_distributed_serve import chat

    r = chat(url, prompt, 180.0, logprobs=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["mtp"]["num_draft_tokens"] > 0  # MTP ran
    return choice["message"]["content"], [t["bytes"] for t in choice["logprobs"]["content"]]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{family: (its single-process server, its cluster)}, all started at once."""
    from test_distributed_serve import served_together

    root = tmp_path_factory.mktemp("stream_serve")
    ckpts = {}
    for family, _ in SERVE:
        src = FIXTURES / family
        ckpts[family] = root / "ckpt" / family
        shutil.copytree(src / "checkpoint" if (src / "checkpoint").is_dir() else src,
                        ckpts[family])
        byte_tokenizer(ckpts[family])
    flags = ("--num-draft-tokens", "2", "--fixed-k")
    with served_together({fam: (ckpts[fam], mode, flags) for fam, mode in SERVE}, root) as out:
        yield out


@pytest.mark.parametrize("family,mode", SERVE)
def test_serve_batch_of_4_equals_single_process(served, family, mode):
    from concurrent.futures import ThreadPoolExecutor

    server, cluster = served[family]
    try:
        cluster.wait()
        server.wait()
        expected = {p: answer(server.url, p) for p in SERVE_PROMPTS}
        server.stop()
        assert len(set(str(a) for a in expected.values())) > 1  # answers tell prompts apart
        with ThreadPoolExecutor(4) as pool:  # one batch
            got = {p: pool.submit(answer, cluster.url, p) for p in SERVE_PROMPTS}
            assert {p: a.result() for p, a in got.items()} == expected
    finally:
        server.stop()
        cluster.kill()
