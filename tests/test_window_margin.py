"""The window caches' rollback margin covers the longest draft the engine can verify (a
lookup proposal of MAX_DRAFTER_TOKENS extended by MAX_DRAFT_TOKENS head drafts): such drafts,
rejected on a window that has long wrapped, roll back to exactly plain decoding's output; a
margin shorter than the drafts is refused, never silently wrong."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step

import family_checks as fc
from mlx_mtp.decode import MAX_DRAFT_TOKENS
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.drafters.base import MAX_DRAFTER_TOKENS
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.cache.window import ROLLBACK_MARGIN, WindowKVCache
from mlx_mtp.testing.tiny_special import make_tiny_mimo_v2_flash, make_tiny_step3p5

# The oracle trunk predicts t+1 on the cycle: restarting the stretch makes the answer a
# copy of the context (long lookup drafts), which breaks where the context's stray 7, 8 do.
CYCLE = list(range(100, 160))
PROMPT = CYCLE + [7, 8] + CYCLE[:6]
N_TOKENS = 72
BUILDERS = {"mimo_v2_flash": make_tiny_mimo_v2_flash, "step3p5": make_tiny_step3p5}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def make(family):
        if family not in made:
            made[family] = BUILDERS[family](tmp_path_factory.mktemp(family), "oracle",
                                            vocab_size=256, window=8)
        return made[family]

    return make


def mlx_lm_greedy(path, n=N_TOKENS):
    model = fc.mlx_lm_model(path)  # run at the released window
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(PROMPT), model, max_tokens=n)]


def run(model, k=MAX_DRAFT_TOKENS):
    sources = DraftSources("both", LookupSettings(max_draft=MAX_DRAFTER_TOKENS), adaptive=False)
    dec = MTPDecoder(model, k, adaptive=False, drafter=sources.drafter())
    return [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=N_TOKENS)], dec


def test_margin_is_the_longest_verifiable_draft():
    assert ROLLBACK_MARGIN == MAX_DRAFTER_TOKENS + MAX_DRAFT_TOKENS
    assert WindowKVCache(8).margin == ROLLBACK_MARGIN


@pytest.mark.parametrize("family", list(BUILDERS))
def test_longest_drafts_rejected_on_a_wrapped_window_equal_plain_decoding(ckpt, family):
    path = ckpt(family)
    model = load_model(path)[0]
    got, dec = run(model)
    assert got == mlx_lm_greedy(path)
    s = dec.stats
    assert len(s.drafted_per_pos) >= MAX_DRAFTER_TOKENS  # a full-length lookup draft was verified
    assert s.lookup_accepted_tokens < s.lookup_draft_tokens  # and some were rolled back
    rejected_deep = [d - a for d, a in zip(s.drafted_per_pos, s.accepted_per_pos)]
    assert sum(rejected_deep[8:]) > 0  # rollbacks much longer than the window (8)


def test_a_margin_shorter_than_the_drafts_is_refused(ckpt, monkeypatch):
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)
    model = load_model(ckpt("mimo_v2_flash"))[0]
    with pytest.raises(ValueError, match="margin of 4"):
        run(model)
