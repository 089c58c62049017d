"""Seeded requests reproduce: alone or batched, whatever K the policy picks.

Noise is keyed by (seed, output position). Coupled rows emit the plain sample of
every position (so any K, any batch, equal to --no-mtp); seeded rows with
independent drafts take K from their own schedule, so a batch mate or a timing
never changes their output.
"""

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.io.loader import load_model

PROMPT = [3, 1, 4, 1, 5, 2, 6, 5]
N = 20


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    # 8 tokens, random weights: spread-out distributions, about half the drafts accepted
    return load_model(Path(tiny_ckpt("qwen3_5", "random", vocab_size=8)))[0]


def alone(model, params, k, adaptive=True, prompt=PROMPT, n=N):
    dec = MTPDecoder(model, k, params, adaptive=adaptive)
    dec.prefill(prompt)
    out = []
    while len(out) < n:
        out += dec.step().tokens
    return out[:n], dec.stats


def batched(model, requests, n=N):
    """Rows join one per step (each with its own K and sampling); adaptive batch K."""
    bd = BatchDecoder(model, adaptive=True)
    outs = {}
    for i, (prompt, params, k) in enumerate(requests):
        dec = MTPDecoder(model, k, params)
        dec.prefill(prompt)
        bd.add(i, dec)
        outs[i] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while any(len(t) < n for t in outs.values()):
        for key, o in bd.step().items():
            outs[key] += o.tokens
    return {i: t[:n] for i, t in outs.items()}


MATES = [([7, 7, 1], SamplingParams(), 3),  # greedy, drafts as the policy says
         ([0, 2], SamplingParams(temperature=1.0), 1),  # unseeded sampling
         ([5, 6, 7, 1, 2], SamplingParams(temperature=0.7, top_k=5, seed=99), 2)]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=7, coupled=True),
                                    SamplingParams(temperature=1.0, top_p=0.9, seed=3,
                                                   coupled=True)])
def test_coupled_seeded_output_equals_plain_seeded_output_at_any_k(model, params):
    plain, _ = alone(model, params, 0)
    accepted = 0
    for k in (1, 2, 3):
        for adaptive in (False, True):
            got, stats = alone(model, params, k, adaptive)
            assert got == plain, (k, adaptive)
            accepted += stats.num_accepted_tokens
    assert accepted > 0  # drafts were accepted: the equality is not plain decoding's
    got = batched(model, [MATES[0], (PROMPT, params, 3), MATES[1], MATES[2]])
    assert got[1] == plain


@pytest.mark.parametrize("k", [1, 2, 3])
def test_seeded_output_is_the_same_alone_and_in_any_batch(model, k):
    params = SamplingParams(temperature=0.9, seed=11)
    solo, stats = alone(model, params, k)
    assert stats.num_drafts > 0
    assert alone(model, params, k)[0] == solo  # repeatable
    for mates in (MATES, MATES[::-1]):
        got = batched(model, [mates[0], (PROMPT, params, k), *mates[1:]])
        assert got[1] == solo, mates


def test_seeded_fixed_k_output_is_the_same_alone_and_batched(model):
    params = SamplingParams(temperature=0.9, seed=5)
    solo, _ = alone(model, params, 2, adaptive=False)
    bd = BatchDecoder(model, adaptive=False)  # a mate drafts 3, the row asked for 2
    rows = [(PROMPT, params, 2), MATES[0]]
    outs = {}
    for i, (prompt, p, k) in enumerate(rows):
        dec = MTPDecoder(model, k, p, adaptive=False)
        dec.prefill(prompt)
        bd.add(i, dec)
        outs[i] = []
    while len(outs[0]) < N:
        for key, o in bd.step().items():
            outs[key] += o.tokens
            if key == 0:
                assert o.num_drafted == 2
    assert outs[0][:N] == solo


def test_different_seeds_give_different_samples(model):
    """The model's distributions are spread out, so the equalities above say something."""
    outs = {tuple(alone(model, SamplingParams(temperature=0.9, seed=s), 2)[0]) for s in range(4)}
    assert len(outs) == 4


def test_unseeded_sampling_at_fixed_k_repeats_after_mx_random_seed(model):
    """As in mlx-lm; an unseeded row's K follows timings unless fixed."""
    params = SamplingParams(temperature=1.0)
    outs = []
    for _ in range(2):
        mx.random.seed(1234)
        outs.append(alone(model, params, 2, adaptive=False)[0])
    assert outs[0] == outs[1]
    mx.random.seed(4321)
    assert alone(model, params, 2, adaptive=False)[0] != outs[0]


def test_identical_seeded_requests_to_the_server_engine_agree(tiny_ckpt):
    """Issue 12.11: identical seeded requests, sent together with other traffic and
    decoded in one batch under the adaptive policy, all return the same tokens as the
    same request sent alone."""
    from mlx_mtp.models.io.loader import load_tokenizer
    from mlx_mtp.server.engine import Engine
    from mlx_mtp.server.events import Done, EngineRequest

    # 8 embedding rows, a 4096-token tokenizer: load() refuses the pair, so the parts are
    # loaded apart; the requests hold ids in range and the tokenizer only decodes.
    path = Path(tiny_ckpt("qwen3_5", "random", vocab_size=8))
    model, config = load_model(path)
    tok = load_tokenizer(path, config)
    params = SamplingParams(temperature=0.9, seed=42)

    def submit(engine, prompt, sampling):
        events = []
        engine.submit(EngineRequest(prompt=list(prompt), max_tokens=N, on_event=events.append,
                                    sampling=sampling))
        return events

    def drive(engine, sinks):
        for _ in range(2000):
            if all(any(isinstance(e, Done) for e in s) for s in sinks):
                return [[t for e in s if hasattr(e, "token_ids") for t in e.token_ids]
                        for s in sinks]
            engine.step()
        raise AssertionError("requests did not finish")

    solo_engine = Engine(model, tok, num_draft_tokens=3, log_interval=0)
    solo = drive(solo_engine, [submit(solo_engine, PROMPT, params)])[0]
    engine = Engine(model, tok, num_draft_tokens=3, log_interval=0, max_concurrency=8)
    sinks = []
    for i in range(6):
        sinks.append(submit(engine, PROMPT, params))
        sinks.append(submit(engine, [i % 8, 3], SamplingParams(temperature=1.0)))
    outs = drive(engine, sinks)
    assert len(solo) == N and all(o == solo for o in outs[0::2])
