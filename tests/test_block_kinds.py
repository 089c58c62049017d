"""Block drafter kinds (DFlash2, DSpark, EAGLE-3) against their reference implementations, and
every published packaging's config.

The parity fixtures in ``tests/fixtures/block_drafters/`` are random fp32 drafters in their
published layouts (hidden 64, vocab 256, 2 layers, taps [1, 3, 5] of an 8-layer target) with
what the reference drafted from seeded taps over two rounds on one context cache (11 rows,
then 3 more): z-lab ``dflash==0.1.0`` for DFlash2, ``mlx-dspark==0.20.3`` for DSpark (DeepSpec
and speculators layouts, the latter with a reduced vocabulary and a pure anchor slot), and
``mlx-vlm==0.7.10``'s EAGLE-3 drafter (legacy ``midlayer.*`` names, reduced vocabulary; and
two layers under ``layers.*`` names, the full vocabulary, ``norm_before_residual``). They
were recorded once by ``tests/fixtures/block_drafters/make_references.py`` (its docstring says
how to rerun it); the references are not imported here.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.drafters.block import KINDS, BlockSpec
from mlx_mtp.drafters.block.config import fit_to_tensors, parse_block_config

FIXTURES = Path(__file__).parent / "fixtures" / "block_drafters"
ATOL = 1e-4


def load(name, drop=()):
    """The fixture's drafter as a loader builds it (config, then what the tensors settle),
    bound to the fixture's target embedding and head; ``drop``: tensors left out."""
    weights = mx.load(str(FIXTURES / name / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if k not in drop}
    config = parse_block_config(json.loads((FIXTURES / name / "config.json").read_text()))
    model = KINDS[config.kind](fit_to_tensors(config, weights))
    model.load_weights(list(model.sanitize(weights).items()))  # strict: every name matches
    ref = mx.load(str(FIXTURES / name / "reference.safetensors"))
    model.bind(lambda t: ref["target_embed"][t], lambda h: h @ ref["target_head"].T)
    return model, ref


def greedy(seen=None):
    """The engine's greedy draw: argmax and a one-hot q; ``seen`` collects the logits."""
    def draw(logits, j):
        if seen is not None:
            seen.append(logits)
        pick = mx.argmax(logits, axis=-1)
        one_hot = mx.arange(logits.shape[-1])[None] == pick[:, None]
        return pick, mx.where(one_hot, 0.0, -mx.inf)
    return draw


def sampled(temperature=1.0):
    def draw(logits, j):
        scaled = logits / temperature
        log_q = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        return mx.random.categorical(log_q), log_q
    return draw


def taps(ref, r):
    return [ref[f"taps{r}"][i] for i in range(ref[f"taps{r}"].shape[0])]


@pytest.mark.parametrize("name", ["dflash2", "dflash2_sliding", "dspark_deepspec",
                                  "dspark_causal", "dspark_qwen35", "dspark_speculators"])
def test_block_kinds_match_their_reference_over_two_rounds(name):
    """Round 2 appends 3 rows to the same context cache: RoPE offsets and the append must
    line up with the reference's, and a pass leaves the cache holding the context only."""
    model, ref = load(name)
    cache = model.make_cache()
    rows = 0
    for r in (1, 2):
        model.add_context(taps(ref, r), cache)
        rows += ref[f"taps{r}"].shape[2]
        n = ref[f"logits{r}"].shape[1]
        hidden, logits = model.block_logits(ref[f"anchor{r}"], cache, n)
        assert mx.allclose(logits, ref[f"logits{r}"], atol=ATOL).item(), (
            name, r, mx.abs(logits - ref[f"logits{r}"]).max().item())
        drafts, log_qs = model.propose(ref[f"anchor{r}"], cache, n, greedy())
        assert drafts.tolist() == ref[f"drafts{r}"].tolist(), (name, r)
        assert len(log_qs) == n and log_qs[0].shape == (1, model.spec.vocab_size)
        assert all(c.lengths() == [rows] for c in cache)
        if name.startswith("dspark"):  # the confidence head is read and matches too
            prev = mx.concatenate([ref[f"anchor{r}"][None], drafts[:, :-1]], axis=1)
            conf = model.confidence(hidden, prev)
            assert mx.allclose(conf, ref[f"confidence{r}"], atol=ATOL).item()


def test_a_dspark_head_without_its_own_embedding_and_head_uses_the_targets():
    """A head that ships neither (Muse-Glimmer's DSpark) embeds and scores with the bound
    target's: bound to the tensors it left out, it drafts what the reference drafted."""
    own = mx.load(str(FIXTURES / "dspark_deepspec" / "model.safetensors"))
    model, ref = load("dspark_deepspec", drop=("embed_tokens.weight", "lm_head.weight"))
    assert "embed_tokens" not in model and "lm_head" not in model
    model.bind(lambda t: own["embed_tokens.weight"][t], lambda h: h @ own["lm_head.weight"].T)
    cache = model.make_cache()
    model.add_context(taps(ref, 1), cache)
    drafts, _ = model.propose(ref["anchor1"], cache, 7, greedy())
    assert drafts.tolist() == ref["drafts1"].tolist()


def test_what_a_checkpoint_lacks_settles_the_config():
    config = parse_block_config(_fixture_config("dspark_speculators"))
    fitted = fit_to_tensors(config, ["lm_head.weight", "d2t", "embed_tokens.weight"])
    assert fitted.settings.own_embed and not fitted.settings.confidence_head
    with pytest.raises(ValueError, match="needs the drafter's own lm_head.weight"):
        fit_to_tensors(config, ["d2t"])
    with pytest.raises(ValueError, match="needs the d2t table"):
        fit_to_tensors(config, ["lm_head.weight"])
    eagle = parse_block_config(_fixture_config("eagle3"))  # a frozen embedding: the target's
    assert not fit_to_tensors(eagle, ["embed_tokens.weight", "lm_head.weight", "d2t"]
                              ).settings.own_embed


@pytest.mark.parametrize("name", ["eagle3", "eagle3_two_layers"])
def test_eagle3_matches_mlx_vlm_over_two_rounds(name):
    """Round 1 drafts 4 tokens one pass each (their entries never enter the cache); the
    verify ran [anchor, d1..d4] and kept some drafts (2; none for the two-layer fixture):
    its 5 rows enter the context as in a step (the rejected ones with taps of their own)
    and ``accept`` keeps the anchor's and the kept drafts' and moves the pending tap to the
    last kept row's. Round 2 drafts from that cache what mlx-vlm drafted after trimming
    its cache and re-feeding the verified rows."""
    model, ref = load(name)
    vocab = model.settings.draft_vocab_size
    to_target = mx.arange(vocab) + model.d2t if vocab else mx.arange(256)
    kept = ref["tokens2"].shape[1] - 1
    rejected = mx.random.normal((3, 1, 4 - kept, 64), key=mx.random.key(5))
    verified = [mx.concatenate([t, r], axis=1) for t, r in zip(taps(ref, 2), rejected)]
    verify_tokens = mx.concatenate([ref["anchor1"][None], ref["drafts1"]], axis=1)
    assert verify_tokens[:, : kept + 1].tolist() == ref["tokens2"].tolist()
    cache = model.make_cache()
    for r, (rows, tokens) in enumerate(((taps(ref, 1), ref["tokens1"]),
                                        (verified, verify_tokens)), 1):
        model.add_context(rows, cache, tokens)
        if r == 2:
            for c in cache:
                c.accept([kept + 1])
        seen = []
        drafts, _ = model.propose(ref[f"anchor{r}"], cache, 4, greedy(seen))
        assert drafts.tolist() == ref[f"drafts{r}"].tolist(), r
        logits = mx.stack(seen, axis=1)
        assert mx.allclose(logits[..., to_target], ref[f"logits{r}"], atol=ATOL).item(), r
        assert mx.isinf(logits).sum().item() == 4 * (256 - len(to_target))  # q = 0 off it
        # (tap t, token t+1) pairs; the last row's tap waits
        assert all(c.lengths() == ([10] if r == 1 else [10 + kept + 1]) for c in cache)


@pytest.mark.parametrize("name", ["dflash2", "dspark_speculators", "eagle3"])
def test_sampled_drafts_come_from_the_q_they_return(name):
    """q is a distribution over what the kind can propose: DFlash2's k candidates, a reduced
    head's draft vocabulary; every pick has q > 0."""
    mx.random.seed(3)
    model, ref = load(name)
    cache = model.make_cache()
    model.add_context(taps(ref, 1), cache, ref["tokens1"])
    drafts, log_qs = model.propose(ref["anchor1"], cache, 3, sampled())
    for j, log_q in enumerate(log_qs):
        q = mx.exp(log_q)
        assert abs(q.sum().item() - 1) < 1e-5
        assert q[0, drafts[0, j]].item() > 0
        support = (q > 0).sum().item()
        assert support == (model.settings.selector_top_k or model.settings.draft_vocab_size)
    if name == "eagle3":  # a pass's entries are not stored
        assert cache[0].lengths() == [10]


def _right_aligned(rows, S):
    """Each row's taps (one list per row) as one right-aligned (B, S, H) chunk per tap."""
    pad = [[mx.concatenate([mx.zeros((1, S - t.shape[1], t.shape[2])), t], axis=1) for t in r]
           for r in rows]
    return [mx.concatenate([r[i] for r in pad]) for i in range(len(pad[0]))]


@pytest.mark.parametrize("name", ["dflash2", "dflash2_sliding", "dspark_deepspec"])
def test_a_batch_keeps_each_rows_own_context(name):
    """Two rows whose contexts differ in length share batch caches (``merge``): each drafts
    what it drafts alone (its block at its own position, the other row's padding unseen,
    its own window)."""
    model, ref = load(name)
    n = ref["logits1"].shape[1]
    rounds = [([taps(ref, 1), [t[:, 3:] for t in taps(ref, 1)]], mx.array([42, 17])),
              ([taps(ref, 2), [t[:, :1] for t in taps(ref, 2)]], mx.array([199, 88]))]
    alone = [model.make_cache(), model.make_cache()]
    batch = [a.merge([a, b]) for a, b in zip(model.make_cache(), model.make_cache())]
    for rows, anchors in rounds:
        lengths = [r[0].shape[1] for r in rows]
        model.add_context(_right_aligned(rows, max(lengths)), batch, lengths=lengths)
        _, logits = model.block_logits(anchors, batch, n)
        drafts, _ = model.propose(anchors, batch, n, greedy())
        for b, (row, cache) in enumerate(zip(rows, alone)):
            model.add_context(row, cache)
            _, row_logits = model.block_logits(anchors[b:b + 1], cache, n)
            assert mx.allclose(logits[b:b + 1], row_logits, atol=ATOL).item(), b
            row_drafts, _ = model.propose(anchors[b:b + 1], cache, n, greedy())
            assert drafts[b].tolist() == row_drafts[0].tolist(), b
    assert batch[0].lengths() == [14, 9]


def test_a_pass_refuses_more_drafts_than_its_block_holds():
    model, ref = load("dspark_speculators")
    cache = model.make_cache()
    model.add_context(taps(ref, 1), cache)
    with pytest.raises(ValueError, match="6 drafts asked of a pass that proposes 1..5"):
        model.propose(ref["anchor1"], cache, 6, greedy())


def test_eagle3_reads_taps_of_a_wider_trunk():
    """``target_hidden_size``: the trunk's width (fc reads three taps of it), not the
    drafter's; null means the drafter's."""
    config = _with(_fixture_config("eagle3"), "target_hidden_size", 96)
    parsed = parse_block_config(config)
    assert parsed.spec.hidden_size == 96 and parsed.args.hidden_size == 64
    assert KINDS["eagle3"](parsed).fc.weight.shape == (64, 3 * 96)
    config["target_hidden_size"] = None
    assert parse_block_config(config).spec.hidden_size == 64


def test_the_published_dflash2_layout_loads_by_name_and_shape():
    """The real Muse-Glimmer DFlash2 (z-lab's test fixture: config and safetensors header):
    its config parses, and the model it builds (lazily: nothing is evaluated) has exactly
    the published tensors, by name and shape, once ``sanitize`` names the codebooks."""
    real = json.loads((FIXTURES / "real_shapes" / "dflash2_muse_glimmer.json").read_text())
    parsed = parse_block_config(real["config"])
    assert parsed.spec == BlockSpec(kind="dflash2", hidden_size=6656, vocab_size=202048,
                                    target_layer_ids=(1, 13, 25, 37, 49), block_size=16,
                                    mask_token_id=201818, num_target_layers=52)
    model = KINDS["dflash2"](parsed)
    params = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    assert params == {k: tuple(s) for k, s in model.sanitize(real["tensors"]).items()}
    # sliding layers, but is_causal: false keeps their blocks bidirectional
    assert [(layer.window, layer.self_attn.causal) for layer in model.layers] == [(2048, False)] * 5


def test_eagle3_drafts_a_batch_row_by_row_alike():
    """Two rows with contexts of the same length in one batch draft what each drafts alone."""
    model, ref = load("eagle3")
    other = [t[:, ::-1] for t in taps(ref, 1)]
    tokens = mx.concatenate([ref["tokens1"], ref["tokens1"][:, ::-1]])
    anchors = mx.array([42, 7])
    batch = model.make_cache()
    model.add_context([mx.concatenate([a, b]) for a, b in zip(taps(ref, 1), other)], batch,
                      tokens)
    drafts, _ = model.propose(anchors, batch, 4, greedy())
    for b, row in enumerate((taps(ref, 1), other)):
        cache = model.make_cache()
        model.add_context(row, cache, tokens[b:b + 1])
        alone, _ = model.propose(anchors[b:b + 1], cache, 4, greedy())
        assert drafts[b].tolist() == alone[0].tolist(), b
    assert drafts[0].tolist() == ref["drafts1"][0].tolist()


def test_eagle3_keeps_each_rows_own_context_in_a_padded_batch():
    """Rows whose contexts differ in length share batch caches (``merge``; right-aligned
    chunks with per-row ``lengths``): each row's pending tap pairs with its own first
    token, and each drafts what it drafts alone, over two rounds."""
    model, ref = load("eagle3")
    t1, t2 = taps(ref, 1), taps(ref, 2)
    rounds = [([t1, [t[:, 3:] for t in t1]], [ref["tokens1"], ref["tokens1"][:, 3:]],
               mx.array([42, 17])),
              ([t2, [t[:, :1] for t in t2]], [ref["tokens2"], ref["tokens2"][:, :1]],
               mx.array([199, 88]))]
    alone = [model.make_cache(), model.make_cache()]
    batch = [type(a).merge([a, b]) for a, b in zip(model.make_cache(), model.make_cache())]
    for rows, tokens, anchors in rounds:
        lengths = [r[0].shape[1] for r in rows]
        S = max(lengths)
        padded = mx.concatenate([mx.concatenate([mx.zeros((1, S - t.shape[1]), t.dtype), t],
                                                axis=1) for t in tokens])
        model.add_context(_right_aligned(rows, S), batch, padded, lengths)
        drafts, _ = model.propose(anchors, batch, 4, greedy())
        for b, (row, cache) in enumerate(zip(rows, alone)):
            model.add_context(row, cache, tokens[b])
            row_drafts, _ = model.propose(anchors[b:b + 1], cache, 4, greedy())
            assert drafts[b].tolist() == row_drafts[0].tolist(), b
    assert batch[0].lengths() == [10 + 3, 7 + 1]


ZLAB_DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
               "vocab_size": 256, "max_position_embeddings": 4096, "rope_theta": 1e7,
               "tie_word_embeddings": True, "num_target_layers": 8, "block_size": 8,
               "dflash_config": {"mask_token_id": 255, "target_layer_ids": [1, 3, 5]}}
BODY = {k: ZLAB_DFLASH[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                     "vocab_size")}


def spec(kind, block, anchor=False, mask=255, layers=None):
    return BlockSpec(kind=kind, hidden_size=64, vocab_size=256, target_layer_ids=(1, 3, 5),
                     block_size=block, mask_token_id=mask, anchor_predicts=anchor,
                     num_target_layers=layers, autoregressive=kind == "eagle3")


def test_every_packaging_parses_to_its_block_spec():
    """Ids in speculators configs count the embedding output as layer 0: [2, 4, 6] there is
    [1, 3, 5] (0-based, "the residual after layer i") everywhere else."""
    newer = dict(ZLAB_DFLASH, block_size=None, dflash_config={
        **ZLAB_DFLASH["dflash_config"], "block_size": 16})
    specforge = {"model_type": "qwen3", **BODY, "dflash_config": {
        "projector_type": "dspark", "block_size": 7, "mask_token_id": 255,
        "target_layer_ids": [1, 3, 5], "markov_rank": 8}}
    liquid = {"architectures": ["Lfm2DSparkDraftModel"], "model_type": "qwen3", **BODY,
              "block_size": 9, "dflash_config": {"mask_token_id": 255,
                                                 "target_layer_ids": [1, 3, 5],
                                                 "num_target_layers": 8}}
    anchored = json.loads((FIXTURES / "dspark_speculators" / "config.json").read_text())
    anchored.pop("speculators_config")
    anchored["sample_from_anchor"] = True
    cases = {
        "dflash2": spec("dflash2", 8, layers=8),
        "dflash2_sliding": spec("dflash2", 8, layers=8),
        "dspark_deepspec": spec("dspark", 7, anchor=True, layers=8),
        "dspark_causal": spec("dspark", 7, anchor=True, layers=8),
        "dspark_qwen35": spec("dspark", 7, anchor=True, layers=8),
        "dspark_speculators": spec("dspark", 6),
        "eagle3": spec("eagle3", 5, mask=None),
    }
    for name, expected in cases.items():
        parsed = parse_block_config(json.loads((FIXTURES / name / "config.json").read_text()))
        assert parsed.spec == expected, name
    assert parse_block_config(ZLAB_DFLASH).spec == spec("dflash", 8, layers=8)
    assert parse_block_config(newer).spec == spec("dflash", 16, layers=8)
    assert parse_block_config(specforge).spec == spec("dspark", 7, anchor=True)
    assert parse_block_config(liquid).spec == spec("dspark", 9, anchor=True, layers=8)
    assert parse_block_config(anchored).spec == spec("dspark", 6, anchor=True)
    assert parse_block_config(anchored).settings.draft_vocab_size == 64
    assert parse_block_config(anchored).spec.max_draft == 6
    no_arch = {k: v for k, v in ZLAB_DFLASH.items() if k != "architectures"}
    assert parse_block_config(no_arch, kind="dflash").spec == spec("dflash", 8, layers=8)


def _with(config, path, value):
    """A copy of ``config`` with the dotted ``path`` set (``None``: removed)."""
    out = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    node = out
    for p in parents:
        node = node[p]
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return out


def _fixture_config(name):
    return json.loads((FIXTURES / name / "config.json").read_text())


@pytest.mark.parametrize("config, kind, message", [
    (_with(ZLAB_DFLASH, "dflash_config.target_layer_ids", None), None,
     "dflash_config.target_layer_ids is missing"),
    (_with(ZLAB_DFLASH, "block_size", None), None, "block_size"),
    (_with(ZLAB_DFLASH, "dflash_config.mask_token_id", 256), None, "mask_token_id 256"),
    (_with(ZLAB_DFLASH, "dflash_config.target_layer_ids", [1, 3, 9]), None, "8 layers"),
    (_with(ZLAB_DFLASH, "layer_types", ["sliding_attention"] * 2), None,
     "sliding_window None must be an integer"),
    (_with(ZLAB_DFLASH, "layer_types", ["full_attention"]), None,
     "must name full_attention or sliding_attention for each of the 2 layers"),
    (_with(ZLAB_DFLASH, "architectures", None), None, "--draft-kind"),
    (ZLAB_DFLASH, "dspark", "contradicts"),
    (ZLAB_DFLASH, "medusa", "--draft-kind 'medusa'"),
    (_with(_fixture_config("dflash2"), "dflash_config.conv_group_size", 24), None,
     "conv_group_size 24 must divide"),
    (_with(_fixture_config("dspark_speculators"), "aux_hidden_state_layer_ids", [0, 3, 5]),
     None, "aux_hidden_state_layer_ids [0, 3, 5] taps the embedding output (id 0"),
    (_with(_fixture_config("dspark_deepspec"), "target_layer_ids", [-1, 3, 5]), None,
     "target_layer_ids [-1, 3, 5] taps the embedding output (id -1"),
    (_with(_fixture_config("dspark_speculators"), "speculators_config.proposal_methods",
           [{"speculative_tokens": 3}]), None, "speculative_tokens 3"),
    (_with(_fixture_config("dspark_speculators"), "draft_vocab_size", 300), None,
     "draft_vocab_size 300"),
    (_with(_fixture_config("dspark_speculators"), "transformer_layer_config", None), None,
     "transformer_layer_config is missing"),
    (_with(_fixture_config("eagle3"), "speculators_model_type", "medusa"), None,
     "speculators_model_type 'medusa'"),
    (_with(_fixture_config("eagle3"), "eagle_aux_hidden_state_layer_ids", [2, 4]), None,
     "must name 3 layers"),
    (_with(_fixture_config("dspark_deepspec"), "model_type", "gemma4_text"), None,
     "model_type 'gemma4_text'"),
    (_with(_fixture_config("dspark_deepspec"), "enable_qwen35_gated_q_proj", True), None,
     "enable_qwen35_gated_q_proj"),
    ({"model_type": "deepseek_v4", "dspark_block_size": 2, "dspark_target_layer_ids": [1]},
     None, "DeepSeek-V4"),
])
def test_bad_configs_say_which_field_and_what_is_expected(config, kind, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_block_config(config, kind=kind)
