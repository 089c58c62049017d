"""The families with special caches in the server engine: concurrent requests batch
(window caches per row, Mamba-2 replay per row, chained MTP layers, LongCat's two caches
per layer, DSA's latent and indexer caches past index_topk, Ling's KDA replay per row), prompt-prefix states
go to memory and disk and a restored turn decodes as a cold one and as plain decoding."""

import numpy as np
import pytest

import family_checks as fc
from engine_events import make_engine, run
from mlx_mtp.models.cache import window as window_cache
from mlx_mtp.models.io.loader import load
from mlx_mtp.models.cache.window import WindowKVCache
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.session_store import SessionStore, model_fingerprint
from mlx_mtp.testing.tiny_bailing import make_tiny_bailing_hybrid
from mlx_mtp.testing.tiny_special import (make_tiny_dsa, make_tiny_longcat_flash,
                                          make_tiny_mimo_v2_flash, make_tiny_nemotron_h,
                                          make_tiny_step3p5)

BUILDERS = {"step3p5": make_tiny_step3p5, "mimo_v2_flash": make_tiny_mimo_v2_flash,
            "nemotron_h": make_tiny_nemotron_h, "longcat_flash": make_tiny_longcat_flash,
            "glm_moe_dsa": lambda path, head, **kw: make_tiny_dsa(path, "glm_moe_dsa", head,
                                                                  **kw),
            "bailing_hybrid": make_tiny_bailing_hybrid}
RNG = np.random.default_rng(7)
PROMPT = [int(x) for x in RNG.integers(0, 128, 40)]  # five windows of 8
LONGER = PROMPT + [int(x) for x in RNG.integers(0, 128, 9)]


@pytest.fixture(autouse=True)
def small_window_buffers(monkeypatch):
    """Window caches drop old entries every 8 positions, keeping 4 beyond the window."""
    monkeypatch.setattr(WindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache.BatchWindowKVCache, "step", 8)
    monkeypatch.setattr(window_cache, "ROLLBACK_MARGIN", 4)


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tmp_path_factory):
    # The test tokenizer has 4096 ids: the embedding table must cover them.
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), "noisy",
                                  vocab_size=4096)
    return request.param, path, load(str(path))


def engine(model_tok, k=3, prefix_cache=None):
    return make_engine(model_tok, num_draft_tokens=k, adaptive=False, prefix_cache=prefix_cache,
                       prefill_step_size=16)


def mlx_lm_greedy(path, prompt, n=12):
    return fc.mlx_lm_greedy(fc.mlx_lm_model(path), prompt, n)


def test_concurrent_requests_equal_mlx_lm(family):
    name, path, model_tok = family
    prompts = [PROMPT, LONGER[5:], PROMPT[:3], LONGER[20:]]
    sinks = run(engine(model_tok), prompts)
    assert [s.tokens for s in sinks] == [mlx_lm_greedy(path, p) for p in prompts]


def test_restored_turn_decodes_as_a_cold_one(family, tmp_path):
    name, path, model_tok = family
    fp = model_fingerprint(model_tok[0])
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    run(engine(model_tok, prefix_cache=pc), [PROMPT], boundaries=[24, 39])
    pc.disk.flush()
    state = pc.entries[tuple(PROMPT)].state
    windows = [c for c in state.cache if isinstance(c, WindowKVCache)]
    windowed = name in ("step3p5", "mimo_v2_flash")
    assert all(c.start > 0 for c in windows) and windowed == bool(windows)
    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    warm = run(engine(model_tok, prefix_cache=pc2), [LONGER])[0]
    assert warm.done.usage["prompt_tokens_details"]["cached_tokens"] == 39
    assert pc2.disk.hits == 1
    cold = run(engine(model_tok), [LONGER])[0]
    plain = run(engine(model_tok, k=0), [LONGER])[0]
    assert warm.tokens == cold.tokens == plain.tokens == mlx_lm_greedy(path, LONGER)
