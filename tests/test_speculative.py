"""Speculative decoding: greedy identity with mlx-lm, exact rollback, adaptive K."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from mlx_mtp.models.cache.recurrent import RecurrentCache
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.decode.costs import StepCosts
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step

PROMPT = [1, 5, 9, 22, 7, 3, 100, 200, 42, 17, 18]
N_TOKENS = 24

# head -> (builder kwargs, acceptance expected) ; oracle trunks keep a small
# contribution from every layer so recurrent state matters.
HEADS = {
    "always": ("oracle", {"trunk_scale": 0.1}),
    "never": ("random", {}),
    "sometimes": ("noisy", {"trunk_scale": 0.1}),
}


def mlx_lm_greedy(path, prompt, n):
    return fc.mlx_lm_greedy(fc.mlx_lm_model(path), prompt, n)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("agree", ["always", "never", "sometimes"])
def test_greedy_identical_to_mlx_lm(tiny_ckpt, family, agree):
    head, kw = HEADS[agree]
    path = tiny_ckpt(family, head, **kw)
    fc.assert_greedy_identical(path, PROMPT, agree, n=N_TOKENS)


def test_greedy_identical_with_adaptive_k_and_long_prompt(tiny_ckpt):
    path = tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 512, 150)]  # chunked GDN prefill
    ref = mlx_lm_greedy(path, prompt, N_TOKENS)
    model, _ = load_model(Path(path))
    for k in (1, 3, 8):
        dec = MTPDecoder(model, k, adaptive=True, prefill_step_size=64)
        got = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=N_TOKENS)]
        assert got == ref, f"K={k}"


def _plain_state(model, tokens):
    """Caches after running ``tokens`` through the trunk one by one (plain decode),
    and the MTP cache filled with every pair (h_i, t_{i+1}) among them."""
    cache = model.make_cache()
    hiddens = []
    for t in tokens:
        _, h = model.trunk(mx.array([[t]]), cache)
        hiddens.append(h)
    mtp_cache = model.make_mtp_cache()
    h = mx.concatenate(hiddens, axis=1)
    model.mtp_forward(h[:, :-1], mx.array([tokens[1:]]), mtp_cache)
    return cache, mtp_cache


def _assert_caches_equal(a, b, atol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert type(x) is type(y)
        if isinstance(x, RecurrentCache):
            assert mx.allclose(x.conv, y.conv, atol=atol).item()
            assert mx.allclose(x.ssm, y.ssm, atol=atol).item()
        else:
            assert x.offset == y.offset
            for u, v in zip(x.state, y.state):
                assert mx.allclose(u, v, atol=atol).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("head,kw", [("noisy", {"trunk_scale": 0.1}), ("random", {}),
                                     ("oracle", {"trunk_scale": 0.1})])
@pytest.mark.parametrize("k", [1, 3])
def test_rollback_matches_plain_decode(tiny_ckpt, family, head, kw, k):
    """After any accept/reject pattern every cache equals a plain decode's."""
    model, _ = load_model(Path(tiny_ckpt(family, head, **kw)))
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        dec = MTPDecoder(model, k, sampling, adaptive=False)
        dec.prefill(PROMPT)
        emitted = []
        patterns = set()
        for _ in range(8):
            out = dec.step()
            emitted += out.tokens
            patterns.add(out.num_accepted)
            # The trunk holds prompt + emitted[:-1]; the last token awaits the next step.
            cache, mtp_cache = _plain_state(model, PROMPT + emitted[:-1])
            _assert_caches_equal(dec.cache, cache)
            dec.sync_mtp_cache()  # all pairs but (h_last, emitted[-1]), kept to draft from
            _assert_caches_equal(dec.mtp_cache, mtp_cache)
        if head == "noisy" and sampling.greedy and k == 3:
            assert len(patterns) > 1  # both accepts and rejects happened


# A seeded sampled request takes K from its own SeededSchedule (acceptance and a
# fixed cost model, never wall time), so these two are deterministic.
SEEDED = SamplingParams(temperature=0.05, seed=0)


def test_seeded_schedule_stops_drafting_for_a_useless_head(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "random")))
    dec = MTPDecoder(model, 3, SEEDED, adaptive=True)
    assert dec.row.schedule is not None
    list(generate_step(PROMPT, model, decoder=dec, max_tokens=200))
    # A short exploration, then only sparse probes: few drafting steps of ~200.
    assert dec.stats.num_drafts < 20


def test_seeded_schedule_keeps_drafting_deep_for_a_good_head(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)))
    dec = MTPDecoder(model, 3, SEEDED, adaptive=True)
    toks = list(generate_step(PROMPT, model, decoder=dec, max_tokens=100))
    assert sum(1 for _, _, d in toks if d) > 50
    assert len(dec.stats.drafted_per_pos) == 3  # it went deep


def test_policy_state_lives_in_the_decoder_not_on_the_model(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)))
    before = set(vars(model))
    first = MTPDecoder(model, 2)
    list(generate_step(PROMPT, model, decoder=first, max_tokens=20))
    assert set(vars(model)) == before
    second = MTPDecoder(model, 2, policy=first.policy)  # shared on purpose: costs carry over
    assert second.policy is first.policy and second.policy.costs.count(1, 0) > 0


def test_logprobs_come_from_the_target(tiny_ckpt):
    """Reported logprobs equal the plain decode's (target), not the draft head's."""
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    plain = list(generate_step(PROMPT, model, num_draft_tokens=0, max_tokens=12))
    spec = list(generate_step(PROMPT, model, num_draft_tokens=3, adaptive=False, max_tokens=12))
    assert any(d for _, _, d in spec)
    for (t1, lp1, _), (t2, lp2, _) in zip(plain, spec):
        assert t1 == t2
        assert mx.allclose(lp1, lp2, atol=1e-4).item()


def test_prefix_snapshot_restores_identically(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "noisy", trunk_scale=0.1)))
    full = PROMPT + [30, 31, 32, 33]
    ref = [t for t, _, _ in generate_step(full, model, num_draft_tokens=2, adaptive=False,
                                          max_tokens=16)]
    first = MTPDecoder(model, 2, adaptive=False)
    first.prefill(PROMPT, snapshot_at=len(PROMPT) - 1)
    state = first.snapshot_state
    assert state.n_processed == len(PROMPT) - 1
    for _ in range(2):  # the snapshot stays reusable
        dec = MTPDecoder(model, 2, adaptive=False)
        dec.restore(state)
        got = [t for t, _, _ in generate_step(full, model, decoder=dec, max_tokens=16)]
        assert got == ref


def test_bad_arguments_are_refused_with_clear_messages(tiny_ckpt):
    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "random")))
    with pytest.raises(ValueError, match="between 0 and 8"):
        MTPDecoder(model, 9)
    with pytest.raises(ValueError, match="empty"):
        MTPDecoder(model, 1).prefill([])
    plain, _ = load_model(Path(tiny_ckpt("qwen3_5", "random")), mtp=False)
    with pytest.raises(ValueError, match="without an MTP head"):
        MTPDecoder(plain, 2)


class _ScriptedPolicy:
    """K from a script; records what the decoder reports (k, seconds)."""

    def __init__(self, script):
        self.script, self.i, self.recorded = list(script), 0, []
        self.costs = StepCosts()  # the step-cost table the driver hands each step

    def row_ks(self, rows, B, prompts_waiting=False, contexts=None):
        k = self.script[min(self.i, len(self.script) - 1)]
        self.i += 1
        return [k]

    def record_step(self, B, k, seconds, accepted=(), ks=None, **context):
        self.recorded.append((k, seconds))


def test_overlapped_plain_steps_are_timed_together(tiny_ckpt, monkeypatch):
    """A plain step read after its successor was launched reads as about two steps and
    the successor as almost nothing; each must count their mean (the policy's median
    used to swing between the two, pausing drafting for two plain steps per draft)."""
    import mlx_mtp.decode.speculative as spec

    model, _ = load_model(Path(tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1)))
    policy = _ScriptedPolicy([2, 0, 0, 2, 0, 0, 0, 0, 0, 2])
    dec = MTPDecoder(model, 2, SamplingParams(), policy=policy)
    # When each step is read (s): s2 launches s3 before being read; s5..s8 launch their
    # successors; s9 does not (a draft step follows).
    reads = iter([1.000, 1.021, 1.022, 1.042, 1.063, 1.073, 1.083, 1.093, 1.094, 1.114])
    monkeypatch.setattr(spec.time, "perf_counter", lambda: next(reads))
    dec.prefill(PROMPT)
    for _ in range(len(policy.script)):
        dec.step()
    assert sorted(k for k, _ in policy.recorded) == sorted(policy.script)  # each step once
    plain = [round(s * 1e3, 3) for k, s in policy.recorded if k == 0]
    # 21 + 1 ms: 11 each. 21, 10, 10, 10, 1: two at a time while the chain goes on, the
    # newest held back (21 + 10: 15.5 each), then the rest when it ends (10, 10, 1: 7 each).
    assert plain == [11.0, 11.0, 15.5, 15.5, 7.0, 7.0, 7.0]
    drafts = [round(s * 1e3, 3) for k, s in policy.recorded if k == 2 and s is not None]
    assert drafts == [20.0, 20.0]
