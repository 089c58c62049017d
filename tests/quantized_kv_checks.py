"""What the quantized-KV tests share (``test_quantized_kv*.py``): 4-bit caches in groups of
32, the prompts, single-sequence and batched greedy decoding, and the checks every family's
quantized caches pass: MTP equal to plain decoding, logits changed by the quantization, a
verify's rollback, a batch's per-row write, a state round trip through safetensors."""

import mlx.core as mx
import numpy as np

from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.kv import CACHE_KINDS
from mlx_mtp.models.cache.quantized import KVQuantization
from test_batch import run_batch as staggered_batch

Q4 = KVQuantization(bits=4, group_size=32)
RNG = np.random.default_rng(0)
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 11, 3, 20, 1, 8)]
N = 14


def decode_on(dec, n=N):
    """The next ``n`` tokens of ``dec``."""
    out = []
    while len(out) < n:
        out += dec.step().tokens
    return out[:n]


def solo(model, k, prompt, n=N, drafter=None):
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False, drafter=drafter)
    dec.prefill(prompt)
    return decode_on(dec, n), dec


def solo_logprobs(model, k, prompt, n=N):
    """Tokens and the target's log-probabilities of each (verify rows: bit for bit a plain
    step's, when the cache is the same)."""
    dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    out, lps = [], []
    while len(out) < n:
        o = dec.step()
        out, lps = out + o.tokens, lps + [o.logprobs]
    return out[:n], mx.concatenate(lps)[:n], dec


def assert_mtp_equals_plain(model, prompt, bitwise=True):
    """Greedy MTP at K = 1..3 gives plain decoding's tokens and, ``bitwise``, its
    log-probabilities bit for bit. Returns plain decoding's tokens and the drafts accepted."""
    ref, ref_lps, _ = solo_logprobs(model, 0, prompt)
    accepted = 0
    for k in (1, 2, 3):
        out, lps, dec = solo_logprobs(model, k, prompt)
        assert out == ref, (prompt, k)
        if bitwise:
            assert mx.array_equal(lps, ref_lps).item(), (prompt, k)
        accepted += dec.stats.num_accepted_tokens
    return ref, accepted


def quantized_and_full_logits(model, cache):
    """The logits of ``PROMPTS[3]`` through ``cache`` (made quantized) and through a
    full-precision cache of the same model."""
    x = mx.array([PROMPTS[3]], mx.uint32)
    quantized = model.logits(model.trunk(x, cache)[0])
    model.use_kv_quantization(None)
    try:
        full = model.logits(model.trunk(x, model.make_cache())[0])
    finally:
        model.use_kv_quantization(Q4)
    return quantized, full


def verify_then_plain(model):
    """A 254-token prompt, then a verify pass of 4 drafts keeping 2 (``spec``) and the same 2
    fed one at a time (``plain``): rows past the buffer's 256-position step and partial
    quantization groups. Returns both caches."""
    prompt = [int(x) for x in RNG.integers(0, 128, 254)]
    x = mx.array([prompt], mx.uint32)
    drafts = [5, 9, 17, 33]
    spec, plain = model.make_cache(), model.make_cache()
    model.trunk(x, spec)
    model.trunk(x, plain)
    model.trunk(mx.array([drafts], mx.uint32), spec, capture=True)
    for c in spec:
        c.accept([2])
    for t in drafts[:2]:
        model.trunk(mx.array([[t]], mx.uint32), plain)
    return spec, plain


def write_three_and_keep(c, keep):
    """A 3-position write into the merged cache ``c`` (zeros of its rows' widths); row b keeps
    ``keep[b]`` positions of it."""
    k, k_scales, _, v, v_scales, _ = c.extract(0).state
    c.prepare(3)
    c.update_and_fetch(mx.zeros((3, k.shape[1], 3, k_scales.shape[-1] * Q4.group_size)),
                       mx.zeros((3, v.shape[1], 3, v_scales.shape[-1] * Q4.group_size)))
    c.accept(list(keep))


def restore_through_safetensors(caches, indices, path):
    """``caches[i]`` for ``i`` in ``indices`` written as ``state`` to a safetensors file and
    read back through ``CACHE_KINDS`` with its ``meta_state``, in place: each keeps its kind
    and quantized form."""
    mx.save_safetensors(str(path), {f"{i}.{n}": a for i in indices
                                    for n, a in zip(caches[i].state_names, caches[i].state)})
    loaded = mx.load(str(path))
    for i in indices:
        cls = CACHE_KINDS[caches[i].kind]
        c = cls.from_state(tuple(loaded[f"{i}.{n}"] for n in cls.state_names),
                           caches[i].meta_state)
        assert type(c) is type(caches[i]) and c.settings() == Q4.meta()
        assert c.state[0].dtype == mx.uint32
        caches[i] = c


def run_batch(model, k, prompts, n=N):
    """Staggered joins (one per step), removal when done (``test_batch.run_batch``): tokens
    per row."""
    outs, _ = staggered_batch(model, k, prompts, n=n)
    return [outs[i] for i in range(len(prompts))]


def assert_engine_rows_and_a_warm_turn_equal_solo(model, tok):
    """The server engine (``model`` with its quantized caches), drafting or not: the six
    prompts at once (rows joining and leaving) give their single-sequence decodes, and a turn
    that extends one of them from the prefix cache gives the longer prompt's."""
    from engine_events import make_engine, run as run_all
    from mlx_mtp.server.prefix_cache import PrefixCache

    refs = [solo(model, 0, p, n=12)[0] for p in PROMPTS]
    for k in (0, 2):
        engine = make_engine((model, tok), num_draft_tokens=k, adaptive=False,
                             prefix_cache=PrefixCache(8, 1 << 30), prefill_step_size=8)
        sinks = run_all(engine, PROMPTS, max_tokens=12)
        assert [s.tokens for s in sinks] == refs, k
        run_all(engine, [PROMPTS[3]], max_tokens=12, boundaries=[16])
        longer = PROMPTS[3] + refs[3] + [7, 8, 9]
        warm = run_all(engine, [longer], max_tokens=12)[0]
        assert warm.done.usage["prompt_tokens_details"]["cached_tokens"] == 16
        assert warm.tokens == solo(model, 0, longer, n=12)[0], k
