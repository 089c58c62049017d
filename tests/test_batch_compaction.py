"""A long row leaving a batch gives back the columns its padding took (``cache/slots.py``).

A short row beside a long one is left-padded to the long one's length; once the long row
leaves, ``filter`` (which ``BatchDecoder.remove`` runs on every cache) drops the leading
columns no remaining row uses, for every cache kind alike. Checked against
references computed here: the caches of a batch that never had the long row (merged from
the same solo prefills), each row's own single-row decode, and each row's greedy output
decoded alone, for the Qwen3.5 hybrid, an MLA family (DeepSeek-V3), a windowed family with
chained MTP layers (MiMo-V2-Flash), 4-bit quantized KV and a DSA family (DeepSeek-V3.2),
plus hand-written block-drafter context caches; and the rows' first columns, which the
caches follow on the host, through holes, growth, window drops and a state read back.
"""

import mlx.core as mx
import numpy as np
import pytest

from cache_checks import assert_rows_are, merged_solos, same
from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.models.cache.context import ContextCache
from mlx_mtp.models.cache.kv import BatchKVCache, KVCache, cache_state_arrays
from mlx_mtp.models.cache.quantized import KVQuantization
from mlx_mtp.models.cache.slots import stack_left_padded
from mlx_mtp.models.cache.window import BatchWindowKVCache
from mlx_mtp.testing import tiny, tiny_attention, tiny_special

RNG = np.random.default_rng(4)
SHORT = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 9)]
LONG = [int(x) for x in RNG.integers(0, 128, 70)]
N = 12  # tokens each short row decodes
LONG_TOKENS = 3  # the long row leaves after these


def hybrid(head_dim=None):
    text = tiny.tiny_text_config("qwen3_5", vocab_size=128)
    text = text if head_dim is None else dict(text, head_dim=head_dim)
    return tiny.make_oracle(tiny.build_model("qwen3_5", text, seed=0), trunk_scale=0.5,
                            fc_noise=1.5)


def quantized_hybrid():
    model = hybrid(head_dim=32)  # mx.quantize's smallest group is 32
    model.use_kv_quantization(KVQuantization(bits=4, group_size=32))
    return model


def attention(config):
    return tiny_attention.make_oracle(tiny_attention.build_model(config, seed=0), 0.5, 2.5, 0)


def windowed():
    model = tiny_attention.build_model(tiny_special.mimo_v2_flash_config(), seed=0)
    tiny_special.chain_oracle(model, 2.5, 0)
    return model


MODELS = {"qwen3_5": hybrid, "qwen3_5_kv4": quantized_hybrid,
          "deepseek_v3": lambda: attention(tiny_attention.tiny_config("deepseek_v3")),
          "mimo_v2_flash": windowed,
          "deepseek_v32": lambda: attention(tiny_special.dsa_config("deepseek_v32"))}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def attention_nbytes(caches) -> int:
    return sum(c.nbytes for c in caches if c.is_trimmable())


def unused(caches) -> list:
    """Each cache's count of leading columns no row uses, read from the row mask its
    ``state`` holds (None: a kind without one)."""
    counts = []
    for c in caches:
        masks = [a for a in c.state if a is not None and a.dtype == mx.bool_]
        used = np.array(masks[0]).any(axis=0) if masks else None
        counts.append(None if used is None else int(np.argmax(used)) if used.any() else used.size)
    return counts


def test_filter_leaves_the_caches_of_a_batch_that_never_had_the_long_row(model):
    prompts = [SHORT[0], LONG, SHORT[1]]
    solos, merged = merged_solos(model, prompts)
    held = attention_nbytes(merged)
    for c in merged:
        c.filter([0, 2])
    _, never = merged_solos(model, SHORT)
    same(cache_state_arrays(merged), cache_state_arrays(never))
    # positions per row (a batch's recurrent caches keep no per-row count, only its longest)
    assert [c.meta_state for c in merged if c.is_trimmable()] == [
        c.meta_state for c in never if c.is_trimmable()]
    assert_rows_are(merged, solos, [0, 2])
    # the long row's 70 columns of each row go: what is held is what the short rows need
    assert attention_nbytes(merged) == attention_nbytes(never) < held * (len(SHORT[1]) + 1) / 70


def solo_greedy(model, prompt, n):
    dec = MTPDecoder(model, 0, SamplingParams(), adaptive=False)
    dec.prefill(prompt)
    out = []
    while len(out) < n:
        out += dec.step().tokens
    return out[:n]


def decode_while_long_row_visits(model, k):
    """Two short rows decode; the long one joins after their first step and leaves after
    ``LONG_TOKENS`` of its own; checked as it leaves: no cache (trunk or MTP) keeps a
    leading column no row uses, they hold fewer bytes, and each row's own cache is
    unchanged. Returns the short rows' tokens and the batch."""
    bd = BatchDecoder(model, k > 0, adaptive=False)
    outs = {}
    for key, prompt in [(0, SHORT[0]), (1, SHORT[1]), ("long", LONG)]:
        dec = MTPDecoder(model, k, SamplingParams(), adaptive=False)
        dec.prefill(prompt)
        bd.add(key, dec)
        outs[key] = []
        for key, o in bd.step().items():
            outs[key] += o.tokens
    while len(outs["long"]) < LONG_TOKENS:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    caches = bd.cache + (bd.mtp_cache or [])
    rows = [cache_state_arrays([c.extract(b) for c in caches]) for b in range(2)]
    held = attention_nbytes(caches)
    bd.remove("long")
    caches = bd.cache + (bd.mtp_cache or [])
    counts = unused(caches)
    assert all(n in (None, 0) for n in counts) and 0 in counts
    # two of three rows picked as they were would hold 2/3 of the bytes (every kind's
    # bytes are per row); without the long row's columns they hold less
    assert attention_nbytes(caches) < held * 2 / 3
    for b in range(2):  # each row's own cache is as it was
        same(cache_state_arrays([c.extract(b) for c in caches]), rows[b])
    while min(len(outs[0]), len(outs[1])) < N:
        for key, o in bd.step().items():
            outs[key] += o.tokens
    return [outs[0][:N], outs[1][:N]], bd


@pytest.mark.parametrize("k", [0, 3])
def test_short_rows_decode_as_alone_after_the_long_row_leaves(model, k):
    refs = [solo_greedy(model, p, N) for p in SHORT]
    outs, bd = decode_while_long_row_visits(model, k)
    assert outs == refs
    if k == 0:  # no rejected drafts, so no holes: the rows' own caches, merged afresh
        never = [type(c).merge([c.extract(0), c.extract(1)]) for c in bd.cache]
        same(cache_state_arrays(bd.cache), cache_state_arrays(never))


def context_row(n: int, seed: int) -> ContextCache:
    """A block drafter's context cache of one row holding ``n`` positions."""
    c = ContextCache.empty(1)
    kv = mx.array(np.random.default_rng(seed).standard_normal((1, 2, n, 4)).astype(np.float32))
    c.prepare(n)
    c.update_and_fetch(kv, -kv)
    return c


def test_block_context_caches_give_back_the_columns_of_a_departed_row():
    rows = [context_row(n, seed) for seed, n in enumerate((3, 40, 6))]
    batch = ContextCache.merge(rows)
    held = batch.nbytes
    batch.filter([2, 0])
    never = ContextCache.merge([rows[2], rows[0]])
    same(cache_state_arrays([batch]), cache_state_arrays([never]))
    assert batch.pos == [6, 3] and batch.nbytes == never.nbytes < held / 4
    same(batch.extract(1).state, rows[0].state)  # one row: no padding at all


def single_row(n: int, seed: int) -> KVCache:
    c = KVCache()
    kv = mx.array(np.random.default_rng(seed).standard_normal((1, 2, n, 4)).astype(np.float32))
    c.update_and_fetch(kv, -kv)
    return c


@pytest.mark.parametrize("kind", ["full", "window"])
def test_rows_first_columns_are_followed_through_holes_and_growth(kind, monkeypatch):
    """Rejected drafts (holes), buffers growing (holes squeezed out; a window's old entries
    dropped) and a join: the row left after the long one goes keeps exactly its entries and
    no column before them."""
    cls = BatchKVCache if kind == "full" else BatchWindowKVCache
    monkeypatch.setattr(cls, "step", 8)
    rows = [single_row(2, 0), single_row(30, 1)]
    batch = (BatchKVCache.from_single(rows) if kind == "full"
             else BatchWindowKVCache(4, [2, 30], *stack_left_padded(rows)))
    batch.extend(BatchKVCache.from_single([single_row(50, 2)]) if kind == "full"
                 else BatchWindowKVCache(4, [50], *stack_left_padded([single_row(50, 2)])))
    for i in range(12):
        batch.prepare(3)
        k = mx.full((3, 2, 3, 4), float(i))
        batch.update_and_fetch(k, k)
        batch.accept([1, 3, 2])  # row 0 keeps one of three, row 2 two
    kept = batch.row_state(0)
    batch.filter([0])
    assert unused([batch]) == [0] and batch.pos == [2 + 12]
    same(batch.row_state(0), kept)
    batch.prepare(1)  # and it decodes on: the next write lands after its entries
    batch.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    assert batch.row_state(0)[0].shape[2] == kept[0].shape[2] + 1


def test_a_loaded_batch_gives_columns_back_once_its_buffer_grows():
    """A batch state read back (``from_state``) does not know its rows' first columns: its
    filter keeps every column (still exact), and gives them back after the next growth."""
    batch = BatchKVCache.from_single([single_row(3, 0), single_row(40, 1), single_row(5, 2)])
    loaded = BatchKVCache.from_state(batch.state, batch.meta_state)
    loaded.filter([0, 1, 2])  # nothing known, nothing dropped
    same(loaded.state, batch.state)
    loaded.filter([0, 2])
    assert unused([loaded]) == [35]
    same(loaded.row_state(1), batch.row_state(2))
    loaded.prepare(loaded.step)  # past the buffer: it grows, squeezing and learning
    loaded.update_and_fetch(mx.zeros((2, 2, loaded.step, 4)), mx.zeros((2, 2, loaded.step, 4)))
    loaded.filter([0])  # the shorter row: 2 columns of padding beside the other
    assert unused([loaded]) == [0] and loaded.pos == [3 + loaded.step]
