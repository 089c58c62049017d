"""DFlash2 and DSpark drafting in the one step, as DFlash does (``test_block_drafter_decode``):
greedy output identical to plain decoding on the Qwen3.5 hybrid at every width, alone and in
a batch of four mixing sources; sampled output follows the target's exact distribution
(rejection sampling with the kind's own q: DFlash2's selector softmax over its candidates,
DSpark's Markov-corrected softmax), checked by chi-square.

Drafters are random-weight ones in their published layouts (``testing/tiny_block``). For the
chi-square test an "oracle" body (every slot's output is the anchor's embedding;
``block_checks.make_oracle``) drafts on the identity trunk, and each kind's own
part stays random (DFlash2's selector scores, DSpark's Markov bias), so q differs from the
plain softmax of the block's logits and both accepts and rejects happen."""

import json
from pathlib import Path

import pytest

from block_checks import assert_block_samples_follow_target, decode, decode_batch, make_oracle
from mlx_mtp.drafters.block.load import attach_block_drafter, describe
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
PROMPTS = [[3, 9, 27], [100, 4, 8, 15, 16, 23, 42], [7], [50, 51, 52, 53, 54]]
N = 12
BLOCK = 4
FIXTURES = Path(__file__).parent / "fixtures" / "block_drafters"
# kind, whether a DSpark drafter ships its own embedding and head
KINDS = [("dflash2", False), ("dspark", True), ("dspark", False)]
IDS = ["dflash2", "dspark_own_head", "dspark_target_head"]


def _with_drafter(tmp, head: str, kind: str, own: bool, oracle: bool = False):
    model = load_model(make_tiny(tmp / f"trunk_{head}", "qwen3_5", head))[0]
    args = model.text.args
    extra = {"num_key_value_heads": 4} if oracle else {}
    drafter = make_tiny_block(tmp / f"{kind}{own}{oracle}", kind, args.hidden_size,
                              args.vocab_size, [0, 2], args.num_hidden_layers,
                              own_embed_head=own, block_size=BLOCK, **extra)
    attach_block_drafter(model, str(drafter))
    assert model.block_drafter.spec.kind == kind
    if oracle:
        make_oracle(model)
    return model


@pytest.mark.parametrize("kind,own", KINDS, ids=IDS)
def test_greedy_identical_at_every_width(tmp_path, kind, own):
    model = _with_drafter(tmp_path, "random", kind, own)
    plain, _ = decode(model, PROMPT, 0)
    for k in range(1, model.block_drafter.spec.max_draft + 1):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"{kind} width {k}"
        assert dec.stats.block_draft_tokens == dec.stats.num_draft_tokens > 0
    got, dec = decode(model, PROMPT, BLOCK + 1, "block+mtp")
    assert got == plain and dec.stats.head_draft_tokens > 0 < dec.stats.block_draft_tokens


@pytest.mark.parametrize("kind,own", KINDS[:2], ids=IDS[:2])
def test_a_batch_of_four_mixing_sources_decodes_each_rows_plain_tokens(tmp_path, kind, own):
    """Rows join one per step (different context lengths): the drafter, the head, the
    drafter chained with the head, lookup with the head."""
    model = _with_drafter(tmp_path, "random", kind, own)
    sources = ["block", "mtp", "block+mtp", "both"]
    want = [decode(model, p, 0, n=N)[0] for p in PROMPTS]
    got, decs = decode_batch(model, PROMPTS, sources, 3, N)
    assert got == want
    assert [d.stats.block_draft_tokens > 0 for d in decs] == [True, False, True, False]


@pytest.mark.parametrize("kind,own", [KINDS[0], KINDS[2]], ids=[IDS[0], IDS[2]])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, kind, own):
    """Two drafts from the kind's own q, many seeds: the next two tokens follow the target's
    exact joint distribution (temperature 40 and top-3 spread the oracle trunk's peaked
    logits over a few tokens), drafts accepted and rejected."""
    model = _with_drafter(tmp_path, "oracle", kind, own, oracle=True)
    accepted = assert_block_samples_follow_target(model, PROMPT[:4])
    assert 50 < accepted < 2 * 400


@pytest.mark.parametrize("name,kind,taps,block", [
    ("dflash2", "dflash2", [1, 3, 5], 8), ("dspark_speculators", "dspark", [1, 3, 5], 6),
    ("eagle3", "eagle3", [1, 3, 5], 5)])  # 4 speculative tokens after the anchor
def test_inspect_describes_every_kind_from_its_config(name, kind, taps, block):
    """``inspect`` reads a drafter through the one parser (speculators ids shifted to 0-based)."""
    config = json.loads((FIXTURES / name / "config.json").read_text())
    described = describe(config)
    assert (described["kind"], described["taps"], described["block_size"]) == (kind, taps, block)
