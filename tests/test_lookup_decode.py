"""Context drafts fused with the MTP chain (decode/step.py, decode/draft_source.py):
greedy output equals mlx-lm's at up to 32 drafts per step, with and without a head,
alone and batched; sampled output keeps the target distribution, rejected context
drafts included."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

from distribution_check import assert_follows, sample_outcomes, two_token_joint
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.decode.sampling import SamplingParams, filtered_logprobs
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model

# The oracle trunk predicts t+1: after a stretch of the cycle, restarting it makes the
# answer a copy of the context; the stray 7, 8 make some context drafts wrong.
CYCLE = list(range(100, 150))
COPY_PROMPT = CYCLE + [7, 8] + CYCLE[:6]
N_TOKENS = 60


def mlx_lm_greedy(path, prompt, n):
    model, _ = mlx_lm_load_model(Path(path))
    return [int(t) for t, _ in mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n)]


def run(model, prompt, n, k, source, max_draft=32, adaptive=False, sampling=SamplingParams()):
    sources = DraftSources(source, LookupSettings(max_draft=max_draft), adaptive=adaptive)
    dec = MTPDecoder(model, k, sampling, adaptive=adaptive, drafter=sources.drafter())
    return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=n)], dec


@pytest.mark.parametrize("head,kw", [("oracle", {"trunk_scale": 0.1}), ("random", {}),
                                     ("noisy", {"trunk_scale": 0.1})])
def test_greedy_identical_to_mlx_lm_with_context_drafts(tiny_ckpt, head, kw):
    path = tiny_ckpt("qwen3_5", head, **kw)
    ref = mlx_lm_greedy(path, COPY_PROMPT, N_TOKENS)
    model, _ = load_model(Path(path))
    for source, k, max_draft, adaptive in [("lookup", 0, 32, False), ("both", 3, 32, False),
                                           ("both", 2, 5, False), ("both", 3, 32, True),
                                           ("lookup", 0, 16, True)]:
        got, dec = run(model, COPY_PROMPT, N_TOKENS, k, source, max_draft, adaptive)
        assert got == ref, (source, k, max_draft, adaptive)
        s = dec.stats
        assert s.lookup_draft_tokens > 0
        if head == "random":  # a random trunk does not copy: drafts were tried, not taken
            continue
        assert s.lookup_accepted_tokens > 0
        if head == "oracle" and not adaptive:  # the copy runs past the cycle's end: rejected
            assert s.lookup_accepted_tokens < s.lookup_draft_tokens
            assert len(s.drafted_per_pos) >= max_draft


def test_lookup_alone_on_a_checkpoint_without_head(tiny_ckpt):
    path = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, drop_mtp=True)
    ref = mlx_lm_greedy(path, COPY_PROMPT, N_TOKENS)
    model, _ = load_model(Path(path), mtp=False)
    assert model.num_mtp_layers == 0
    got, dec = run(model, COPY_PROMPT, N_TOKENS, 0, "lookup", adaptive=True)
    assert got == ref
    # Most of the answer was copied: far fewer steps than tokens.
    assert dec.stats.lookup_accepted_tokens > N_TOKENS // 2


def test_batched_rows_mix_sources_and_match_mlx_lm(tiny_ckpt):
    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)
    model, _ = load_model(Path(path))
    rng = np.random.default_rng(3)
    prompts = [COPY_PROMPT, [int(x) for x in rng.integers(0, 512, 9)], CYCLE[:20] + CYCLE[:4]]
    sources = DraftSources("both", LookupSettings(max_draft=12), adaptive=False)
    bd = BatchDecoder(model, adaptive=False)
    outs = {}
    for i, pr in enumerate(prompts):
        drafter = None if i == 1 else sources.drafter()  # row 1 drafts from the head only
        dec = MTPDecoder(model, 3, adaptive=False, drafter=drafter)
        dec.prefill(pr)
        bd.add(i, dec)
        outs[i] = []
    while min(len(t) for t in outs.values()) < 30:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    for i, pr in enumerate(prompts):
        assert outs[i][:30] == mlx_lm_greedy(path, pr, 30), f"row {i}"
    assert sum(r.stats.lookup_accepted_tokens for r in bd.rows) > 10
    assert bd.rows[1].stats.lookup_draft_tokens == 0


# -- sampling ------------------------------------------------------------------------------

def _target_fn(ref_model, prompt, params):
    def target(prefix):
        logits = ref_model(mx.array(prompt + prefix)[None])[0, -1:].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return np.exp(np.array(filtered_logprobs(lp, params)[0]))
    return target


def _prompt_drafting(ref_model, params, build):
    """A prompt ``build(f)`` whose context draft f is among the target's likely first
    tokens but not certain (so it is accepted sometimes and rejected sometimes)."""
    for f in range(1, 512):
        prompt = build(f)
        p = _target_fn(ref_model, prompt, params)([])
        if 0.15 < p[f] < 0.85:
            return prompt, f
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("case", ["lookup", "extended"])
def test_sampling_with_context_drafts_keeps_the_target_distribution(tiny_ckpt, case):
    """Two tokens from one 2-draft step: context drafts only (f then its successor), or
    one context draft extended by the head. Unseeded rows (seeded ones keep the head's
    schedule); ``mx.random.seed`` makes each draw repeatable."""
    # (A random trunk for the extension: the oracle's never ranks f high after f, f.)
    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1) if case == "lookup" \
        else tiny_ckpt("qwen3_5", "random")
    model, _ = load_model(Path(path))
    ref_model, _ = mlx_lm_load_model(Path(path))
    params = SamplingParams(temperature=40.0, top_k=3)
    if case == "lookup":  # tail (31, 32, 33) seen before, followed by f, 40
        build = lambda f: [31, 32, 33, f, 40, 50, 60, 70, 31, 32, 33]  # noqa: E731
        k, max_draft = 0, 2
    else:  # tail f seen just before: proposal [f], the context ends, the head extends
        build = lambda f: [31, 32, 33, 50, 60, f, f]  # noqa: E731
        k, max_draft = 1, 16
    prompt, f = _prompt_drafting(ref_model, params, build)
    joint = two_token_joint(_target_fn(ref_model, prompt, params))

    def draw(seed):
        mx.random.seed(seed)
        sources = DraftSources("lookup" if case == "lookup" else "both",
                               LookupSettings(min_match=1 if case == "extended" else 3,
                                              max_draft=max_draft), adaptive=False)
        dec = MTPDecoder(model, k, params, adaptive=False, drafter=sources.drafter())
        dec.prefill(prompt)
        out = dec.step()
        assert out.num_drafted == 2 and out.lookup_drafted == (2 if case == "lookup" else 1)
        return out.tokens[:2] if len(out.tokens) >= 2 else out.tokens + dec.step().tokens[:1], dec

    n_samples = 400
    seen, accepted = sample_outcomes(draw, n_samples)
    first = sum(v for (a, _), v in seen.items() if a == f)
    assert 0 < first < n_samples  # the context draft was accepted and rejected
    assert accepted > 0
    assert_follows(seen, joint, n_samples)


def test_a_row_under_a_grammar_keeps_the_head_beside_copying_rows(tiny_ckpt):
    """A constrained row verifies beside rows drafting 12 context tokens: its output is
    what it is alone, and theirs is mlx-lm's."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_mtp.decode import grammar as G

    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1, vocab_size=4096)
    model, _ = load_model(Path(path))
    tok = load_tokenizer(Path(path))
    gram = G.Grammar(tok, G.json_schema_grammar({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}), 4096, sorted(tok.eos_token_ids))
    sources = DraftSources("both", LookupSettings(max_draft=12), adaptive=False)
    bd = BatchDecoder(model, adaptive=False)
    for i, g in enumerate([gram, None, gram]):
        dec = MTPDecoder(model, 2, adaptive=False, drafter=sources.drafter(),
                         grammar=None if g is None else g.start())
        dec.prefill(COPY_PROMPT)
        bd.add(i, dec)
    outs = {i: [] for i in range(3)}
    for _ in range(12):
        for key, o in bd.step().items():
            outs[key] += o.tokens
    assert outs[1][:30] == mlx_lm_greedy(path, COPY_PROMPT, 30)
    assert bd.rows[1].stats.lookup_accepted_tokens > 0
    solo = MTPDecoder(model, 0, adaptive=False, grammar=gram.start())
    ref = [t for t, _, _ in generate_step(COPY_PROMPT, model, decoder=solo, max_tokens=12)]
    for i in (0, 2):
        assert outs[i][:len(ref)] == ref[:len(outs[i])], i
