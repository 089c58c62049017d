"""A one-token prompt runs no trunk pass before it decodes (prefill stops before the last
token), so every cache of its row is as made when it joins a batch. In every family with an
MTP head, such a row joining a batch of two (MTP on, K = 1..3, a noisy head: drafts
rejected and rolled back around it), or starting one that two rows then join (K = 2),
decodes what it decodes alone, and so do the rows beside it. Qwen4-Exp's PLE windows once
refused to join (``test_family_qwen4_exp.py`` also checks it through the server engine), and
at K = 1 DeepSeek-V4's head window, still empty, refused the step's trim of no positions;
the three newest trunks are checked on their reference fixtures, the others on tiny
checkpoints in their released layouts. MiniMax-M3 decodes plainly (no head) and is left
out."""

from pathlib import Path

import pytest

import family_checks as fc
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from test_distributed_families import BUILDERS

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE_FIXTURES = {"qwen4_exp": FIXTURES / "qwen4_exp" / "checkpoint",
                      "deepseek_v4": FIXTURES / "deepseek_v4",
                      "glm5_next": FIXTURES / "glm5_next" / "checkpoint"}
QWEN = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
FAMILIES = list(REFERENCE_FIXTURES) + list(BUILDERS) + list(QWEN)
PROMPTS = [[1, 5, 9, 22, 7, 3, 100, 20, 42, 17, 18], [4, 8, 15, 16, 23, 42], [11]]


def checkpoint(tmp_path, family: str) -> Path:
    if family in REFERENCE_FIXTURES:
        return REFERENCE_FIXTURES[family]
    if family in QWEN:
        return make_tiny(tmp_path, family, "noisy")
    return BUILDERS[family](tmp_path, "noisy")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_one_token_prompt_joins_a_batch(tmp_path, family):
    model = load_model(checkpoint(tmp_path, family))[0]
    assert model.num_mtp_layers > 0
    want = [fc.mtp_tokens(model, p, 0, n=8)[0] for p in PROMPTS]
    for k in (1, 2, 3):
        assert fc.run_batch(model, k, PROMPTS, n=8)[0] == want, f"K={k}"
    assert fc.run_batch(model, 2, PROMPTS[::-1], n=8)[0] == want[::-1]
