"""MiMo-V2-Flash drafts depth j with its own trained MTP layer j: the statistics and the
adaptive policy count acceptance per depth, so a weak layer shows (and is avoided) at its
own depth, not averaged into the others."""

import pytest

from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_special import make_tiny_mimo_v2_flash

PROMPT = [3, 17, 40, 9, 88, 21, 5, 60, 33, 12, 101, 7, 45, 2]


@pytest.mark.parametrize("broken,want", [((1,), [1.0, 0.0, 0.0]), ((2,), [1.0, 1.0, 0.0])])
def test_stats_and_policy_see_each_layers_acceptance_at_its_depth(tmp_path, broken, want):
    model = load_model(make_tiny_mimo_v2_flash(tmp_path, "oracle", broken=broken))[0]
    assert model.num_mtp_layers == 3
    dec = MTPDecoder(model, 3, adaptive=False)
    list(generate_step(PROMPT, model, decoder=dec, max_tokens=24))
    assert dec.stats.acceptance_per_pos == want  # cumulative, per depth = per layer
    stats = dec.stats.to_dict()
    assert stats["drafted_per_pos"] == [dec.stats.num_drafts] * 3
    # The adaptive policy keeps one acceptance estimate per depth: the broken layer's depth
    # is learnt as failing (below the 0.7 prior it starts from; the policy soon stops drafting
    # that deep, so few trials) while the layers before it stay trusted.
    adaptive = MTPDecoder(model, 3, adaptive=True)
    list(generate_step(PROMPT, model, decoder=adaptive, max_tokens=32))
    alpha = adaptive.policy.acceptance.alpha
    depth = broken[0]
    assert all(a > 0.8 for a in alpha[:depth]), alpha
    assert alpha[depth] < 0.6, alpha
