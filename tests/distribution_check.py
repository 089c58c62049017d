"""One goodness-of-fit check for the distribution tests: observed outcomes against exact
probabilities (Pearson's chi-square; cells expected < 5 times are pooled into one), and the
exact joint distribution of two tokens they compare with."""

from collections import Counter
from dataclasses import replace

import numpy as np

from scipy.stats import chi2 as chi2_dist

P_MIN = 1e-3  # a correct sampler fails one run in a thousand


def assert_follows(seen, joint, n_samples: int):
    """``seen``: outcome -> count over ``n_samples`` draws; ``joint``: outcome -> probability."""
    assert set(seen) <= set(joint), set(seen) - set(joint)
    cells = [c for c in joint if joint[c] * n_samples >= 5]
    rest = 1 - sum(joint[c] for c in cells)
    obs = [seen[c] for c in cells] + [n_samples - sum(seen[c] for c in cells)]
    exp = [joint[c] * n_samples for c in cells] + [rest * n_samples]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert chi2_dist.sf(chi2, len(obs) - 1) > P_MIN, (chi2, obs, exp)


def two_token_joint(target):
    """``target(prefix)``: next-token probabilities (numpy, V) after ``prefix`` (a list of
    ids). Returns (first, second) -> probability over every pair with nonzero mass."""
    return two_token_joint_of(lambda prefixes: [target(p) for p in prefixes])


def two_token_joint_of(targets):
    """``two_token_joint`` from ``targets(prefixes)``: the next-token probabilities after
    each prefix at once (e.g. one batched forward; rows of numpy, V)."""
    p1 = targets([[]])[0]
    firsts = [int(a) for a in np.nonzero(p1 > 0)[0]]
    joint = {}
    for a, p2 in zip(firsts, targets([[a] for a in firsts])):
        for b in np.nonzero(p2 > 0)[0]:
            joint[(a, int(b))] = p1[a] * p2[b]
    return joint


def sample_outcomes(draw, n_samples: int):
    """``draw(seed)`` -> (tokens, decoder). Returns outcome -> count over seeds
    0..n_samples-1 and the drafts accepted in all."""
    seen, accepted = Counter(), 0
    for s in range(n_samples):
        got, dec = draw(s)
        seen[tuple(got)] += 1
        accepted += dec.stats.num_accepted_tokens
    return seen, accepted


def sample_rows(model, prompt, k: int, n_samples: int, n: int = 2, rows: int = 25,
                sampling=None, grammar=None):
    """The first ``n`` tokens sampled with ``sampling`` (default: temperature 1) and K = ``k``
    (each row under its own state of ``grammar``, a compiled grammar, if given) for seeds
    0..n_samples-1, ``rows`` seeds at a time as the rows of one batch. A seeded
    row's tokens do not depend on its batch
    (``decode/noise.py``), so the outcomes are those of one decode per seed, a few times
    faster; the prompt runs once and every row restores its state, as a server's prefix cache
    does; the first seeds are checked against one decoder each (its own prefill). Returns
    outcome -> count, the drafts accepted in all, and each seed's outcome."""
    from mlx_mtp.decode.batch import BatchDecoder
    from mlx_mtp.decode.sampling import SamplingParams
    from mlx_mtp.decode.sequence import Sequence
    from mlx_mtp.decode.speculative import MTPDecoder, generate_step

    def params(seed):
        return replace(sampling or SamplingParams(temperature=1.0), seed=seed)

    prompt_run = Sequence(model, k, params(0), adaptive=False)
    prompt_run.prefill(prompt, snapshot_at=len(prompt) - 1)
    got, accepted = {}, 0
    for first in range(0, n_samples, rows):
        batch = BatchDecoder(model, k > 0, adaptive=False)
        for seed in range(first, min(first + rows, n_samples)):
            seq = Sequence(model, k, params(seed), adaptive=False, grammar=start(grammar))
            seq.restore(prompt_run.snapshot_state)
            seq.prefill(prompt)
            batch.add(seed, seq)
            got[seed] = []
        while len(batch):
            for seed, out in batch.step().items():
                got[seed] += out.tokens
                accepted += out.num_accepted
                if len(got[seed]) >= n:
                    batch.remove(seed)
    outcomes = {seed: tuple(t[:n]) for seed, t in got.items()}
    for seed in range(min(3, n_samples)):
        dec = MTPDecoder(model, k, params(seed), adaptive=False, grammar=start(grammar))
        alone = tuple(t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n))
        assert alone == outcomes[seed], (seed, alone, outcomes[seed])
    return Counter(outcomes.values()), accepted, outcomes


def start(grammar):
    return None if grammar is None else grammar.start()
