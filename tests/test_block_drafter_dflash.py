"""DFlash parity with z-lab's own MLX code (``dflash==0.1.0``, ``dflash/model_mlx.py``).

The reference is recorded once into ``tests/fixtures/dflash_reference/`` by
``tests/fixtures/make_dflash_reference.py`` (z-lab's wheel is not a test dependency: it
pins torch and datasets); its docstring says how to rerun it.
"""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_mtp.drafters.block import KINDS
from mlx_mtp.drafters.block.config import parse_block_config
from mlx_mtp.drafters.block.dflash import DFlash
from mlx_mtp.drafters.block.layers import layer_attention

FIXTURE = Path(__file__).parent / "fixtures" / "dflash_reference"
# its first layer a sliding-window one (window 8: round 1's 11 rows overflow it)
SLIDING = Path(__file__).parent / "fixtures" / "dflash_sliding_reference"


def _fixture_drafter(fixture=FIXTURE):
    """The fixture's drafter (the sliding one shares the full one's weights)."""
    cfg = json.loads((fixture / "config.json").read_text())
    draft = DFlash(parse_block_config(cfg))
    draft.load_weights(list(mx.load(str(FIXTURE / "model.safetensors")).items()))
    target = mx.load(str(FIXTURE / "target.safetensors"))
    draft.bind(lambda t: target["embed_tokens"][t], lambda h: h @ target["lm_head"].T)
    return draft


def _greedy(logits, j):
    return mx.argmax(logits, axis=-1), logits


def test_parse_config_reads_the_z_lab_layout():
    cfg = json.loads((FIXTURE / "config.json").read_text())
    spec = parse_block_config(cfg).spec
    assert KINDS["dflash"] is DFlash
    assert (spec.kind, spec.target_layer_ids, spec.block_size, spec.mask_token_id) == \
        ("dflash", (1, 3, 5), 8, 255)
    assert spec.max_draft == 7 and spec.num_target_layers == 8
    # newer checkpoints keep block_size inside dflash_config
    newer = dict(cfg, dflash_config=dict(cfg["dflash_config"], block_size=16))
    del newer["block_size"]
    assert parse_block_config(newer).spec.block_size == 16
    sliding = parse_block_config(dict(cfg, layer_types=["sliding_attention", "full_attention"],
                                      sliding_window=4))
    assert layer_attention(sliding, 0) == (True, 4)  # z-lab: sliding layers causal
    assert layer_attention(sliding, 1) == (False, None)
    with pytest.raises(ValueError, match="sliding_window"):
        parse_block_config(dict(cfg, layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="target_layer_ids"):
        parse_block_config(dict(cfg, dflash_config={"mask_token_id": 1}))


@pytest.mark.parametrize("fixture", [FIXTURE, SLIDING], ids=["full", "sliding"])
def test_block_logits_match_z_lab_over_two_rounds_on_one_cache(fixture):
    draft = _fixture_drafter(fixture)
    ref = mx.load(str(fixture / "reference.safetensors"))
    cache = draft.make_cache()
    for r in (1, 2):
        taps = mx.split(ref[f"taps{r}"], 3, axis=-1)  # one (1, S, H) per tapped layer
        draft.add_context(taps, cache)
        logits = draft.block_logits(ref[f"anchor{r}"], cache)
        assert mx.abs(logits - ref[f"logits{r}"]).max().item() < 1e-4
        drafts, log_qs = draft.propose(ref[f"anchor{r}"], cache, 7, _greedy)
        assert drafts.tolist() == ref[f"tokens{r}"].tolist()
        assert len(log_qs) == 7
    assert cache[0].lengths() == [14]  # the blocks left nothing behind


def test_a_batch_of_rows_with_their_own_contexts_drafts_as_each_row_alone():
    """Rows of different context lengths, merged into one context cache, draft what each
    drafts alone (padding holes are masked, RoPE positions are per row)."""
    draft = _fixture_drafter()
    ref = mx.load(str(FIXTURE / "reference.safetensors"))
    taps = mx.split(ref["taps1"], 3, axis=-1)
    anchors = [ref["anchor1"], ref["anchor2"]]
    alone, singles = [], []
    for n, anchor in zip((11, 5), anchors):
        cache = draft.make_cache()
        draft.add_context([t[:, :n] for t in taps], cache)
        alone.append(draft.block_logits(anchor, cache))
        singles.append(cache)
    merged = [type(a).merge([a, b]) for a, b in zip(*singles)]
    batch = draft.block_logits(mx.concatenate(anchors), merged)
    assert mx.abs(batch - mx.concatenate(alone)).max().item() < 1e-4
    for c in merged:
        c.filter([1])
    assert mx.abs(draft.block_logits(anchors[1], merged) - alone[1]).max().item() < 1e-4


def test_the_context_cache_speaks_the_cache_protocol():
    """What the session store and the batch do with it: state round trip under its kind,
    extract of one row, copy; each drafts as the original does."""
    from mlx_mtp.models.cache.kv import CACHE_KINDS

    draft = _fixture_drafter()
    ref = mx.load(str(FIXTURE / "reference.safetensors"))
    taps = mx.split(ref["taps1"], 3, axis=-1)
    rows = []
    for n in (11, 4):
        cache = draft.make_cache()
        draft.add_context([t[:, :n] for t in taps], cache)
        rows.append(cache)
    merged = [type(a).merge([a, b]) for a, b in zip(*rows)]
    anchors = mx.concatenate([ref["anchor1"], ref["anchor2"]])
    want = draft.block_logits(anchors, merged)
    kinds = {c.kind for c in merged}
    assert kinds == {"block_context"} and CACHE_KINDS["block_context"] is type(merged[0])
    saved = [CACHE_KINDS[c.kind].from_state(c.state, c.meta_state) for c in merged]
    assert mx.array_equal(draft.block_logits(anchors, saved), want).item()
    copies = [c.copy() for c in merged]
    assert mx.array_equal(draft.block_logits(anchors, copies), want).item()
    one = [c.extract(1) for c in merged]
    assert one[0].lengths() == [4] and merged[0].lengths() == [11, 4]
    assert mx.allclose(draft.block_logits(anchors[1:], one), want[1:], atol=1e-5).item()
    for c, r in zip(merged, rows[1]):
        c.check_joins(r)  # a one-row context joins a batch of them
