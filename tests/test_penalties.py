"""Penalties and logit bias under MTP: greedy identity with plain decoding and with
mlx-lm's own processors, sampling distributed exactly as the penalised target."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from distribution_check import assert_follows, sample_rows, two_token_joint

PROMPT = [1, 5, 9, 22, 7, 3, 100, 200, 42, 17, 18]
REPEATING = [1, 5, 9, 22, 7, 3, 100, 20, 21, 19, 20, 21, 18]  # upcoming tokens in the prompt
N_TOKENS = 20
WHOLE = 10**6  # mlx-lm's context window, wide enough to cover every token


def mtp_tokens(model, prompt, n, k, sampling):
    dec = MTPDecoder(model, k, sampling, adaptive=False)
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


def mlx_lm_tokens(path, prompt, n, processors):
    model, _ = mlx_lm_load_model(Path(path))
    gen = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n,
                               logits_processors=processors)
    return [int(t) for t, _ in gen]


def output_penalties(n_prompt, presence, frequency):
    """OpenAI/vLLM presence and frequency penalties over output tokens, for mlx-lm."""
    def processor(tokens, logits):
        out = np.array(tokens[n_prompt:].tolist(), dtype=np.int64)
        counts = np.bincount(out, minlength=logits.shape[-1]).astype(np.float32)
        return logits - mx.array(frequency * counts + presence * (counts > 0))
    return processor


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_with_repetition_penalty_and_bias_equals_mlx_lm(tiny_ckpt, family):
    path = tiny_ckpt(family, "noisy", trunk_scale=0.1)
    bias = {3: 2.5, 200: -4.0}
    ref = mlx_lm_tokens(path, REPEATING, N_TOKENS, make_logits_processors(
        logit_bias=bias, repetition_penalty=3.0, repetition_context_size=WHOLE))
    unpenalised = mlx_lm_tokens(path, REPEATING, N_TOKENS, None)
    assert ref != unpenalised  # the penalty changes the output
    model, _ = load_model(Path(path))
    params = SamplingParams(repetition_penalty=3.0, logit_bias=bias)
    for k in (0, 1, 2, 3):
        got, dec = mtp_tokens(model, REPEATING, N_TOKENS, k, params)
        assert got == ref, f"K={k}"
        if k:
            assert dec.stats.num_accepted_tokens > 0  # drafts were accepted and penalised


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_greedy_with_presence_and_frequency_equals_plain(tiny_ckpt, family):
    # A random model repeats itself (the oracle never does), so the penalties bite.
    path = tiny_ckpt(family, "random")
    n = 48
    ref = mlx_lm_tokens(path, PROMPT, n, [output_penalties(len(PROMPT), 0.7, 0.9)])
    assert ref != mlx_lm_tokens(path, PROMPT, n, None)
    model, _ = load_model(Path(path))
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)
    for k in (0, 1, 2, 3):
        assert mtp_tokens(model, PROMPT, n, k, params)[0] == ref, f"K={k}"


def test_logit_bias_forces_and_bans(tiny_ckpt):
    # Random weights: logits within +-100 of each other, as in real models.
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "random")))
    forced, _ = mtp_tokens(model, PROMPT, 8, 2, SamplingParams(logit_bias={77: 100}))
    assert forced == [77] * 8
    free, _ = mtp_tokens(model, PROMPT, 12, 2, SamplingParams())
    banned = set(free[:3])
    got, dec = mtp_tokens(model, PROMPT, 12, 2,
                          SamplingParams(logit_bias={t: -100 for t in banned}))
    assert not banned & set(got)
    # Sampling too: a banned token never comes out.
    got, _ = mtp_tokens(model, PROMPT, 12, 2, SamplingParams(
        temperature=1.0, seed=3, logit_bias={t: -100 for t in banned}))
    assert not banned & set(got)


def penalised_logprobs(logits, prompt, output, params):
    """Reference: the penalised, filtered target distribution in numpy terms."""
    x = np.array(logits, dtype=np.float32)
    for t, v in params.logit_bias or ():
        x[t] += v
    seen = sorted(set(prompt) | set(output))
    x[seen] = np.where(x[seen] > 0, x[seen] / params.repetition_penalty,
                       x[seen] * params.repetition_penalty)
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(x))
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    lp = x - np.log(np.exp(x - x.max()).sum()) - x.max()
    return np.array(filtered_logprobs(mx.array(lp), params))


def test_sampling_with_penalties_is_exact(tiny_ckpt):
    """The first two tokens of a K=2 step (the second verified with the first draft
    counted) follow the exact joint distribution of the penalised target."""
    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)
    model, _ = load_model(Path(path))
    ref_model, _ = mlx_lm_load_model(Path(path))
    # The oracle-like head is confident (logits ~100 apart): a high temperature and
    # a bias make repeating the first token a live option the penalties act on.
    params = SamplingParams(temperature=40.0, top_k=3, frequency_penalty=2.0,
                            repetition_penalty=1.3, logit_bias={19: 60, 155: 60})

    def target(prefix):
        logits = ref_model(mx.array(PROMPT + prefix)[None])[0, -1]
        return np.exp(penalised_logprobs(logits.tolist(), PROMPT, prefix, params))

    joint = two_token_joint(target)

    repeat = sum(v for (a, b), v in joint.items() if a == b)
    assert 0.01 < repeat < 0.99, joint  # the draft's own count matters at position 2
    n_samples = 600
    seen, accepted, _ = sample_rows(model, PROMPT, 2, n_samples, sampling=params)
    assert accepted > n_samples // 10  # the second token often came from a draft
    assert_follows(seen, joint, n_samples)


def test_batched_rows_with_different_penalties_equal_solo(tiny_ckpt):
    """Rows with and without penalties share a batch (staggered joins, leaves); each
    row's greedy and seeded output equals its own solo decode."""
    from test_batch import run_batch

    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    prompts = [REPEATING, PROMPT, PROMPT[:5], REPEATING[3:]]
    params = [SamplingParams(repetition_penalty=3.0, logit_bias={3: 2.5}),
              SamplingParams(),
              SamplingParams(temperature=1.5, seed=7, frequency_penalty=2.0,
                             repetition_penalty=1.3),
              SamplingParams(presence_penalty=1.5, frequency_penalty=2.0)]
    outs, bd = run_batch(model, 3, prompts, params, n=12)
    for i, (pr, sp) in enumerate(zip(prompts, params)):
        # greedy: plain decoding; seeded sampling: the same row decoded alone (same K)
        assert outs[i] == mtp_tokens(model, pr, 12, 0 if sp.greedy else 3, sp)[0], i


# --- server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def penalty_server(tiny_ckpt, tmp_path_factory):
    import signal

    from server_process import ServerProcess

    path = tiny_ckpt("qwen3_5", "random", vocab_size=4096)  # the tokenizer's vocabulary
    srv = ServerProcess(path, tmp_path_factory.mktemp("penalties"), "--fixed-k")
    srv.path = path
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.logs()


def completion_ids(srv, **body):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1, **body}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_applies_penalties_and_bias_exactly(penalty_server):
    """The API's penalties and bias give plain decoding's output with the same settings."""
    from tokenizers import Tokenizer

    srv = penalty_server
    model, _ = load_model(Path(srv.path))
    decode = Tokenizer.from_file(str(Path(srv.path) / "tokenizer.json")).decode
    for fields, params in (
        (dict(presence_penalty=0.7, frequency_penalty=0.9),
         SamplingParams(presence_penalty=0.7, frequency_penalty=0.9)),
        (dict(repetition_penalty=1.5, logit_bias={"7": 5.0, "82": -100}),
         SamplingParams(repetition_penalty=1.5, logit_bias={7: 5.0, 82: -100})),
    ):
        want, _ = mtp_tokens(model, PROMPT, 16, 0, params)
        got = completion_ids(srv, **fields)
        assert got["choices"][0]["text"] == decode(want), fields
    plain = completion_ids(srv)["choices"][0]["text"]
    # The fields act: (this 4096-token model repeats no token within 16, so presence and
    # frequency leave its greedy text alone; the bias and the repetition penalty do not)
    assert plain != completion_ids(srv, repetition_penalty=1.5, logit_bias={"7": 5.0})[
        "choices"][0]["text"]


def test_server_n_choices(penalty_server):
    """n=2: two rows of the batch; choice 0 is the n=1 answer with the same seed, choice
    1 another seed's answer; usage counts the prompt once and sums the completions."""
    srv = penalty_server
    sampled = dict(temperature=1.0, seed=11, max_tokens=12)
    one = completion_ids(srv, **sampled)
    two = completion_ids(srv, n=2, **sampled)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["text"] == one["choices"][0]["text"]
    assert two["choices"][1]["text"] != two["choices"][0]["text"]
    assert two["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert two["usage"]["completion_tokens"] == 24
    assert two["usage"]["total_tokens"] == one["usage"]["prompt_tokens"] + 24
    import httpx

    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 5,
        "temperature": 0}).json()
    texts = [c["message"]["content"] for c in chat["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy: three equal choices


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", 17),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("logit_bias", {"5": 101}), ("logit_bias", {"999999": 1}), ("logit_bias", {"x": 1}),
    ("logit_bias", [1, 2]),
])
def test_server_rejects_out_of_range_values(penalty_server, field, value):
    import httpx

    r = httpx.post(penalty_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_generation_config_repetition_penalty_is_the_cli_default(tiny_ckpt, tmp_path, cli):
    """generate reads repetition_penalty from generation_config.json, as vLLM does (the
    demo model ships 1.3 against greedy loops); a flag overrides it. (The CLI runs in this
    process: the ``cli`` fixture.)"""
    import json
    import shutil

    from mlx_mtp.models.io.loader import load_tokenizer

    src = Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1, vocab_size=4096))
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    gen = path / "generation_config.json"
    config = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps(dict(config, repetition_penalty=3.0)))
    tok = load_tokenizer(path, json.loads((path / "config.json").read_text()))
    # This model mostly continues with the next token id: 1500.. are in the prompt.
    ids = [1500, 1501, 1502, 1503, 1600, 1601, 1499]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids

    def generate(*flags):
        code, out, err = cli("generate", "--model", path, "--prompt", text,
                             "--ignore-chat-template", "-m", "16", "--verbose", "False",
                             "--num-draft-tokens", "2", "--fixed-k", *flags)
        assert code == 0, err
        return out[:-1]  # the trailing newline

    penalised = mlx_lm_tokens(path, ids, 16, make_logits_processors(
        repetition_penalty=3.0, repetition_context_size=WHOLE))
    plain = mlx_lm_tokens(path, ids, 16, None)
    assert penalised != plain
    assert generate() == tok.decode(penalised)
    assert generate("--repetition-penalty", "1") == tok.decode(plain)
