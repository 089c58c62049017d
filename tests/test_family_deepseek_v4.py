"""DeepSeek-V4 (``deepseek_v4``): our MLX trunk against transformers 5.24's
``DeepseekV4ForCausalLM`` on a tiny checkpoint in the released layout, written and recorded by
``fixtures/deepseek_v4_reference.py`` (CI has no torch: checkpoint and reference are
committed). Four layers: sliding-only, CSA (compress 4, indexer top-2), HCA (compress 8) and a
hash-MoE layer; an 8-token window, so the 68 tokens cross many compression boundaries.
Greedy output with the MTP head (K = 1..3) is plain decoding's, across rollbacks over
compression boundaries; an oracle head is accepted at every depth, and sampled drafts follow
the trunk's distribution."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from distribution_check import assert_follows, sample_outcomes, two_token_joint
from mlx_mtp.decode.sampling import SamplingParams
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny_streams import deepseek_v4_oracle as oracle_head

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v4"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE)[0]


@pytest.fixture(scope="module")
def ref():
    return np.load(FIXTURE / "reference.npz")


def test_trunk_logits_equal_transformers(model, ref):
    """One forward over prompt and continuation, and cached one-token decoding after the
    prompt, both give transformers' logits."""
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    logits = model(mx.array([prompt + tokens]))[0]
    np.testing.assert_allclose(np.array(logits), ref["forward_logits"], atol=2e-4)
    stepped = fc.one_by_one_logits(model, prompt, tokens[:-1])[0]
    np.testing.assert_allclose(np.array(stepped), ref["step_logits"][1:], atol=2e-4)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_greedy_equals_transformers_at_every_k(model, ref, k):
    """K = 0 is plain decoding; K = 1..3 verify drafts and roll the compressed caches back
    (the random head accepts some drafts, so rollbacks keep partial prefixes)."""
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    got, dec = fc.mtp_tokens(model, prompt, k, n=len(tokens))
    assert got == tokens
    if k:
        assert dec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("start", range(16, 24))
def test_partial_acceptance_equals_plain_decoding(model, ref, start):
    """Verify four tokens after ``start`` tokens (every phase of the 4- and 8-token windows),
    keep 1..4: each layer's window, pending rows and entries are those of decoding the kept
    tokens one by one, and so are the logits that follow."""
    seq = ref["prompt"].tolist() + ref["tokens"].tolist()
    prefix, rows, after = seq[:start], seq[start:start + 4], seq[start + 4]
    for keep in range(1, 5):
        spec, plain = fc.verified_and_plain(model, prefix, rows, keep)
        for a, b in zip(spec, plain):
            assert a.lengths() == b.lengths() == [start + keep]
            for x, y in zip(a.state, b.state):
                assert (x is None) == (y is None)
                if x is not None:
                    np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
        nxt = rows[keep] if keep < 4 else after
        want = model.logits(model.trunk(mx.array([[nxt]]), plain)[0])
        got = model.logits(model.trunk(mx.array([[nxt]]), spec)[0])
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_inspect_finds_the_head_and_sizes_the_caches(model, ref):
    """The head under ``mtp.0.`` (DeepSeek's name); per token, what the compressed entries
    of a float32 model's caches grow by over 64 tokens, halved for 16 bits."""
    from mlx_mtp.tools.inspect_model import inspect_model

    report = inspect_model(str(FIXTURE))
    assert report["mtp"]["present_layers"] == 1 and report["head_stripped"] is False
    assert report["mtp"]["key_prefix"] == "mtp.0."
    cache = fc.prefilled_cache(model, (ref["prompt"].tolist() * 4)[:64])
    entries = sum(a.nbytes for c in cache for name, a in zip(c.state_names, c.state)
                  if name.endswith(".entries"))
    assert report["memory"]["kv_bytes_per_1k_tokens"] == 1024 * entries // 64 // 2


@pytest.mark.parametrize("k", [0, 2])
def test_batched_rows_equal_single_rows(model, ref, k):
    """Rows join one per step, at different window phases, and keep different numbers of
    drafts: each row's tokens are its greedy decoding alone."""
    seq = ref["prompt"].tolist() + ref["tokens"].tolist()
    prompts = [seq[:20], seq[3:8], seq[10:23], seq[30:31]]
    want = [fc.mtp_tokens(model, p, 0, n=16)[0] for p in prompts]
    assert want[0] == ref["tokens"].tolist()[:16]
    rows, bd = fc.run_batch(model, k, prompts, 16)
    assert rows == want


def test_batch_runs_in_one_pass(model, ref, monkeypatch):
    """Three rows at different phases of their windows verify three positions in one pass
    (every layer's MoE sees all rows at once); each row's logits and caches are those of
    its own pass alone. The head runs rows of as many positions together."""
    from mlx_mtp.models.blocks.dsv4 import MoE

    seq = ref["prompt"].tolist() + ref["tokens"].tolist()
    prompts, nxt = [seq[:21], seq[3:8], seq[10:23]], [seq[21:24], seq[8:11], seq[23:26]]
    solos = [fc.prefilled_cache(model, p) for p in prompts]
    merged = [type(cs[0]).merge(list(cs)) for cs in zip(*solos)]
    rows, call = [], MoE.__call__
    monkeypatch.setattr(MoE, "__call__", lambda self, x, t: rows.append(x.shape[0]) or
                        call(self, x, t))
    got = model.logits(model.trunk(mx.array(nxt), merged, capture=True)[0])
    assert rows == [3] * len(model.model.layers)
    for b, cache in enumerate(solos):
        want = model.logits(model.trunk(mx.array(nxt[b:b + 1]), cache, capture=True)[0])
        np.testing.assert_allclose(np.array(got[b:b + 1]), np.array(want), atol=1e-5)
        for c, solo in zip(merged, cache):
            for x, y in zip(c.extract(b).state, solo.state):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
    # the head: rows of as many positions (right-aligned) in one pass, the others apart
    streams, tokens, n = model.trunk(mx.array(nxt), merged)[1], mx.array(nxt), [3, 2, 3]
    heads = [model.make_mtp_cache()[0] for _ in n]
    for c, m in zip(heads, (5, 9, 2)):  # different phases of the head's window
        model.mtp_forward(mx.repeat(streams[:1, :1], m, 1), mx.repeat(tokens[:1, :1], m, 1), [c])
    both = type(heads[0]).merge([c.copy() for c in heads])
    both.prepare(3, n)
    del rows[:]
    got = model.mtp_forward(streams, tokens, [both])
    assert rows == [1, 2]  # two positions: row 1; three: rows 0 and 2
    for b, (c, m) in enumerate(zip(heads, n)):
        want = model.mtp_forward(streams[b:b + 1, 3 - m:], tokens[b:b + 1, 3 - m:], [c])
        np.testing.assert_allclose(np.array(got[b:b + 1, 3 - m:]), np.array(want), atol=1e-5)
        assert not np.array(got[b, :3 - m]).any()


def attention_matmuls(monkeypatch, tmp_path) -> list:
    """Each attention call's count of matrix products in its own graph (its inputs and the
    rows' caches evaluated first), appended as the layers run."""
    from mlx_mtp.models.blocks.dsv4 import Attention

    counts, call = [], Attention.__call__

    def counted(self, x, positions, caches, freqs):
        mx.eval(x, [c.arrays() for c in caches or ()])
        out = call(self, x, positions, caches, freqs)
        mx.export_to_dot(str(tmp_path / "attention.dot"), out,
                         *[a for c in caches or () for a in c.arrays()])
        counts.append((tmp_path / "attention.dot").read_text().count('label ="Matmul"'))
        return out

    monkeypatch.setattr(Attention, "__call__", counted)
    return counts


def test_rows_read_together_by_phase(model, ref, monkeypatch, tmp_path):
    """Four rows at different phases verify three positions in one pass. Each row's window,
    raw rows and entries still come from its own cache, but the compressors pool rows
    completing as many windows together (CSA: the three with a window before theirs apart
    from the one completing its first; HCA: the three completing one), and the pass's
    attention runs as many matrix products as one row's (projections, indexer scores and
    attention over all rows at once, where they once ran row by row: 92 for these four
    rows). Each row's logits and caches are those of its own pass alone."""
    from mlx_mtp.models.blocks.dsv4 import Compressor

    seq = ref["prompt"].tolist() + ref["tokens"].tolist()
    prompts = [seq[:21], seq[3:8], seq[10:23], seq[30:32]]
    nxt = [seq[21:24], seq[8:11], seq[23:26], seq[32:35]]
    solos = [fc.prefilled_cache(model, p) for p in prompts]
    merged = [type(cs[0]).merge(list(cs)) for cs in zip(*solos)]
    pooled, pool = [], Compressor.pool
    monkeypatch.setattr(Compressor, "pool", lambda self, kv, gate, prior: pooled.append(
        (self.ratio, kv.shape[0])) or pool(self, kv, gate, prior))
    matmuls = attention_matmuls(monkeypatch, tmp_path)
    got = model.logits(model.trunk(mx.array(nxt), merged, capture=True)[0])
    ratios = [layer.attn.ratio for layer in model.model.layers]
    csa = [(4, 3), (4, 1)] * 2  # compressor and indexer series
    assert pooled == [p for r in ratios if r for p in (csa if r == 4 else [(r, 3)])]
    batched = list(matmuls)
    del matmuls[:]
    for b, cache in enumerate(solos):
        want = model.logits(model.trunk(mx.array(nxt[b:b + 1]), cache, capture=True)[0])
        np.testing.assert_allclose(np.array(got[b:b + 1]), np.array(want), atol=1e-5)
        for c, solo in zip(merged, cache):
            for x, y in zip(c.extract(b).state, solo.state):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
    assert batched == matmuls[: len(batched)]


def test_mtp_head_equals_mlx_vlm_drafter(model):
    """mlx-vlm 0.7.10's ``DeepseekV4MTPDraftModel`` on the same ``mtp.0.*`` weights (recorded
    by ``fixtures/deepseek_v4_head_reference.py``): from the four streams and the next
    tokens, the head's output streams and its post-norm hidden (which the shared output
    layer reads) agree."""
    ref = np.load(FIXTURE / "head_reference.npz")
    out = model.mtp_forward(mx.array(ref["hidden"]), mx.array(ref["tokens"]),
                            model.make_mtp_cache())
    np.testing.assert_allclose(np.array(out), ref["streams"], atol=1e-4)
    head = model.mtp.layers[0]
    np.testing.assert_allclose(np.array(head.norm(head.hc_head(out))), ref["normed"], atol=1e-4)
    np.testing.assert_array_equal(np.array(model.logits(out)),
                                  np.array(model.lm_head(head.norm(head.hc_head(out)))))


def _copy_fixture(dest: Path, rename) -> Path:
    """The fixture with its tensors renamed by ``rename`` (None: dropped)."""
    import shutil

    shutil.copytree(FIXTURE, dest)
    weights = mx.load(str(FIXTURE / "model.safetensors"))
    renamed = {rename(k): v for k, v in weights.items() if rename(k) is not None}
    mx.save_safetensors(str(dest / "model.safetensors"), renamed)
    return dest


def test_head_under_another_index_loads(model, tmp_path):
    """mlx-vlm reads the head under whichever one ``mtp.{i}.`` a checkpoint uses (it names
    ``mtp.1.`` for V4-Flash); we do too."""
    path = _copy_fixture(tmp_path / "ckpt", lambda k: k.replace("mtp.0.", "mtp.1."))
    other = load_model(path)[0]
    ref = np.load(FIXTURE / "head_reference.npz")
    args = mx.array(ref["hidden"]), mx.array(ref["tokens"])
    np.testing.assert_array_equal(np.array(other.mtp_forward(*args, other.make_mtp_cache())),
                                  np.array(model.mtp_forward(*args, model.make_mtp_cache())))


def test_checkpoint_without_its_head(ref, tmp_path, capsys):
    """A checkpoint whose ``mtp.*`` was dropped: one line naming the released keys and the
    fixes; ``--no-mtp`` decodes as before."""
    from mlx_mtp import cli

    path = _copy_fixture(tmp_path / "ckpt", lambda k: None if k.startswith("mtp.") else k)
    assert cli.main(["generate", "--model", str(path), "-p", "t5 t6", "-m", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "mtp.0.e_proj.weight" in err and "add-mtp" in err and "--no-mtp" in err
    plain = load_model(path, mtp=False)[0]
    prompt = ref["prompt"].tolist()
    assert fc.mtp_tokens(plain, prompt, 0, n=8)[0] == ref["tokens"].tolist()[:8]


def test_bfloat16_drafts_keep_plain_decoding(ref):
    """In bfloat16 (mHC weights, sinks and window biases kept float32), verify passes and
    rollbacks still give plain decoding's tokens, alone and in a batch."""
    model = load_model(FIXTURE, dtype="bfloat16")[0]
    assert model.model.layers[0].hc_attn_fn.dtype == mx.float32
    prompt = ref["prompt"].tolist()
    plain = fc.mtp_tokens(model, prompt, 0, n=24)[0]
    for k in (1, 3):
        assert fc.mtp_tokens(model, prompt, k, n=24)[0] == plain, f"K={k}"
    rows, _ = fc.run_batch(model, 2, [prompt, prompt[3:9]], 16)
    assert rows == [plain[:16], fc.mtp_tokens(model, prompt[3:9], 0, n=16)[0]]


def test_a_saved_session_continues_as_before(model, ref):
    """A prompt's decoder state through the disk-session tensors and back (every layer kind's
    cache, the head's window and its owed four-stream hiddens) decodes the same tokens."""
    from mlx_mtp.server.session_store import _state_from_tensors, _state_tensors

    prompt = ref["prompt"].tolist()
    dec = MTPDecoder(model, 2, adaptive=False)
    dec.prefill(prompt)
    tensors, layout = _state_tensors(dec.snapshot())
    again = MTPDecoder(model, 2, adaptive=False)
    again.restore(_state_from_tensors(tensors, layout))
    got = [t for t, _, _ in generate_step(prompt, model, decoder=again, max_tokens=12)]
    assert got == ref["tokens"].tolist()[:12]


def test_indexer_ties_select_alike_in_every_pass(ref):
    """With the indexer's head weights zeroed every score ties at 0: a query reads every
    entry it may see whatever the pass (prefill, one-token decoding, a verify pass with
    rollbacks), so all three give the same logits and tokens."""
    model = load_model(FIXTURE)[0]
    for layer in model.model.layers:
        if "indexer" in layer.attn:
            w = layer.attn.indexer.weights_proj.weight
            layer.attn.indexer.weights_proj.weight = mx.zeros_like(w)
    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    whole = model(mx.array([prompt + tokens]))[0]
    stepped = fc.one_by_one_logits(model, prompt, tokens)[0]
    np.testing.assert_allclose(np.array(stepped), np.array(whole[len(prompt):]), atol=1e-5)
    plain = fc.mtp_tokens(model, prompt, 0, n=24)[0]
    assert fc.mtp_tokens(model, prompt, 3, n=24)[0] == plain


class _Oracle:
    """A context drafter proposing the reference continuation, wrong at one position in
    four (so verify passes keep 1..4 positions, across every window phase)."""

    name, cost, deterministic, needs_taps, max_draft = "lookup", "none", True, False, 3

    def __init__(self, sequence):
        self.sequence, self.seen, self.steps = sequence, 0, 0

    def sync(self, prompt):
        self.seen = max(self.seen, len(prompt))

    def extend(self, tokens):
        self.seen += len(tokens)

    def propose(self):
        out = list(self.sequence[self.seen:self.seen + self.max_draft])
        wrong = self.steps % 4
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % 256
        return out

    def has_proposal(self):
        return bool(self.propose())

    def observe(self, drafted, accepted):
        self.steps += 1


def test_partial_acceptances_keep_transformers_greedy(model, ref):
    """Drafts right for 0..3 positions, then the head's, end to end through the step."""
    from mlx_mtp.decode.draft_source import DraftSources

    prompt, tokens = ref["prompt"].tolist(), ref["tokens"].tolist()
    k, drafter = DraftSources("both", adaptive=False).for_row(2)
    drafter.drafter = _Oracle(prompt + tokens)
    dec = MTPDecoder(model, k, adaptive=False, drafter=drafter)
    got = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=len(tokens))]
    assert got == tokens
    kept = dec.stats.accepted_per_pos  # steps ended after each depth: partial acceptances
    assert kept[0] > kept[1] > kept[2] > 0


def test_oracle_head_accepts_everything(ref):
    """Every draft of an oracle head is accepted at K = 1..3, so every verify pass keeps all
    its positions (the compressed caches' all-accepted ``accept``), 20 tokens across the
    4- and 8-position windows' boundaries at every phase: the output is plain decoding's, and
    each layer's window, pending rows and entries are those of a plain prefill of the same
    tokens."""
    model = oracle_head(load_model(FIXTURE)[0])
    prompt = ref["prompt"].tolist()
    for got, dec in fc.assert_oracle_accepts_everything(model, prompt).values():
        n = dec.cache[0].lengths()[0]
        assert n > len(prompt) + 16
        for a, b in zip(dec.cache, fc.prefilled_cache(model, (prompt + got)[:n])):
            assert a.lengths() == b.lengths()
            for x, y in zip(a.state, b.state):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)


def test_sampling_follows_the_target(ref):
    """K = 2 at temperature 1 with the oracle head (drafts accepted almost always): the next
    two tokens follow the trunk's exact joint distribution (chi-square). The output layer is
    scaled up so that the joint puts enough mass on few enough pairs to count with 120
    draws; each draw restores one prefilled state (only the sampling seed differs). Checked
    able to fail: a verify that believes the head's q sharper than it is (its logprobs
    doubled before the softmax) gives p < 1e-5 here."""
    model = oracle_head(load_model(FIXTURE)[0])
    model.lm_head.weight = model.lm_head.weight * 3
    prompt, n_samples = ref["prompt"].tolist()[:12], 120
    prefilled = MTPDecoder(model, 2, adaptive=False)
    prefilled.prefill(prompt)
    state = prefilled.snapshot()

    def draw(seed):
        dec = MTPDecoder(model, 2, SamplingParams(temperature=1.0, seed=seed), adaptive=False)
        dec.restore(state)
        return [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=2)], dec

    # the exact next-token distributions after the prompt and after each first token
    V = model.args.vocab_size
    logits = model(mx.array([prompt + [a] for a in range(V)]))[:, -2:].astype(mx.float32)
    probs = np.array(mx.softmax(logits, axis=-1), np.float64)
    seen, accepted = sample_outcomes(draw, n_samples)
    assert accepted > n_samples
    assert_follows(seen, two_token_joint(lambda p: probs[p[0], 1] if p else probs[0, 0]),
                   n_samples)
