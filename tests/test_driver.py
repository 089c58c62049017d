"""The one driver (decode/batch.py::BatchDecoder) around sequences (decode/sequence.py):
K passed in, plain steps launched ahead while rows join and leave, a batch of one."""

import pytest

from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.costs import StepCosts
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.sequence import Sequence
from mlx_mtp.decode.speculative import MTPDecoder, generate_step

PROMPTS = [[5, 9, 200, 31, 7], [11, 400, 12], [1]]
N = 12


def plain(model, prompt, n=N):
    return [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=0, max_tokens=n)]


def joined(model, batch, key, prompt, k, sampling=SamplingParams()):
    seq = Sequence(model, k, sampling, adaptive=False)
    seq.prefill(prompt)
    batch.add(key, seq)
    return seq


def drain(batch, outs, n=N, **step_kw):
    while any(len(v) < n for v in outs.values()):
        for key, o in batch.step(**step_kw).items():
            outs[key] += o.tokens


class NoPolicy:
    """A follower's batch: it must never choose K itself."""

    costs = StepCosts()  # the step-cost table the driver hands each step

    def row_ks(self, *a, **k):
        raise AssertionError("the driver consulted its policy though ks were passed in")

    def record_step(self, *a, **k):
        pass


def test_ks_passed_in_are_run_as_given(tiny_model):
    batch = BatchDecoder(tiny_model, adaptive=True, policy=NoPolicy())
    outs = {}
    for i, p in enumerate(PROMPTS):
        joined(tiny_model, batch, i, p, 2)
        outs[i] = []
    script = [[2, 1, 0], [0, 0, 0], [1, 2, 2], [2, 0, 1]]  # row 2 (one token) owes no pair yet
    step = 0
    while any(len(v) < N for v in outs.values()):
        ks = script[step % len(script)]
        got = batch.step(ks=ks)
        assert [got[i].num_drafted for i in range(3)] == ks
        for key, o in got.items():
            outs[key] += o.tokens
        step += 1
    for i, p in enumerate(PROMPTS):
        assert outs[i][:N] == plain(tiny_model, p)


def test_rows_join_and_leave_while_plain_steps_run_ahead(tiny_model):
    batch = BatchDecoder(tiny_model, mtp=False, overlap=True)
    outs = {0: [], 1: []}
    joined(tiny_model, batch, 0, PROMPTS[0], 0)
    joined(tiny_model, batch, 1, PROMPTS[1], 0)
    for _ in range(3):
        for key, o in batch.step().items():
            outs[key] += o.tokens
    assert batch._ahead is not None  # the next step is already launched
    batch.remove(1)  # undoes it: row 0 must not skip a token
    joined(tiny_model, batch, 2, PROMPTS[2], 0)
    outs[2] = []
    del outs[1]
    drain(batch, outs)
    assert outs[0][:N] == plain(tiny_model, PROMPTS[0])
    assert outs[2][:N] == plain(tiny_model, PROMPTS[2])


@pytest.mark.parametrize("k", [0, 2])
def test_a_joined_sequence_decodes_as_the_decoder_of_one(tiny_model, k):
    """The server's path (a Sequence joining a batch) and generate's (MTPDecoder) are
    the same driver: a seeded sampled row gives the same tokens either way."""
    sampling = SamplingParams(temperature=1.0, seed=7)
    dec = MTPDecoder(tiny_model, k, sampling, adaptive=False)
    alone = [t for t, _, _ in generate_step(PROMPTS[0], tiny_model, decoder=dec, max_tokens=N)]
    batch = BatchDecoder(tiny_model, k > 0, adaptive=False)
    outs = {"r": []}
    joined(tiny_model, batch, "r", PROMPTS[0], k, sampling)
    drain(batch, outs)
    assert outs["r"][:N] == alone
