"""One goodness-of-fit check for the distribution tests: observed outcomes against exact
probabilities (Pearson's chi-square; cells expected < 5 times are pooled into one), and the
exact joint distribution of two tokens they compare with."""

from collections import Counter

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
    p1 = target([])
    joint = {}
    for a in np.nonzero(p1 > 0)[0]:
        p2 = target([int(a)])
        for b in np.nonzero(p2 > 0)[0]:
            joint[(int(a), int(b))] = p1[a] * p2[b]
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
