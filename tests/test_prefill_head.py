"""``Sequence.prefill(run_head=False)``: the MTP head skips a prompt chunk that the batch the
sequence joins will not draft over (the server pauses drafting); output stays exact."""

from pathlib import Path

import numpy as np

from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.sequence import Sequence
from mlx_mtp.decode.speculative import generate_step
from mlx_mtp.models.io.loader import load_model

PROMPT = [int(x) for x in np.random.default_rng(1).integers(0, 512, 20)]
N = 12


def test_a_chunk_without_the_head_pass_decodes_the_same(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    ref = [t for t, _, _ in generate_step(PROMPT, model, num_draft_tokens=0, max_tokens=N)]
    for run_head in (True, False):
        dec = Sequence(model, 2, SamplingParams(), adaptive=False)
        dec.prefill(PROMPT[:9], run_head=run_head)
        # The head's cache holds the first chunk only when the head read it.
        assert (dec.mtp_cache[0].offset > 0) == run_head
        dec.prefill(PROMPT)  # the rest with the head, as when drafting resumes
        batch = BatchDecoder(model, 2, adaptive=False)
        batch.add("r", dec)
        got = []
        while len(got) < N:
            got += batch.step()["r"].tokens
        assert got[:N] == ref, run_head
