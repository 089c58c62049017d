"""MiniMax-M3 (``minimax_m3_vl``): the text model unwrapped from the VLM release, vision
weights dropped, decoded plainly with ``--no-mtp`` exactly as mlx-lm's own generation; its
MTP head (``mtp.*``, no published layout) is refused in one line."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import family_checks as fc
from mlx_mtp import cli
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.io.layout import CheckpointError
from mlx_mtp.testing.tiny_minimax import MTP, VISION, make_tiny_minimax_m3_vl

RNG = np.random.default_rng(0)
PROMPT = [int(x) for x in RNG.integers(0, 128, 19)]  # five index blocks of 4: 2 are kept
PROMPTS = [[int(x) for x in RNG.integers(0, 128, n)] for n in (5, 12, 2, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fc.one_family(tmp_path_factory, "minimax", make_tiny_minimax_m3_vl)


def test_mtp_head_is_refused_in_one_line(ckpt):
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt())
    msg = str(e.value)
    assert "'minimax_m3_vl'" in msg and "2 tensors under mtp.*" in msg and "--no-mtp" in msg
    assert "\n" not in msg


def test_generate_refuses_without_no_mtp_and_decodes_with_it(ckpt, capsys):
    path = ckpt(vocab_size=4096)  # the test tokenizer's ids
    assert cli.main(["generate", "--model", str(path), "-p", "hi", "-m", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--no-mtp" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["generate", "--model", str(path), "-p", "hi", "-m", "2", "--no-mtp"]) == 0


def test_a_checkpoint_without_mtp_tensors_is_refused_too(ckpt):
    """Without ``--no-mtp`` the engine would ask a head it lacks for drafts."""
    with pytest.raises(CheckpointError, match="no mtp.\\* tensors.*--no-mtp"):
        load_model(ckpt(mtp_tensors=False))


def test_no_mtp_greedy_equals_mlx_lm(ckpt):
    """mlx-lm's sanitize keeps ``mtp.*``, so it loads the release non-strictly."""
    path = ckpt()
    model = load_model(path, mtp=False)[0]
    assert model.num_mtp_layers == 0
    ref = fc.mlx_lm_model(path, strict=False)
    assert fc.mtp_tokens(model, PROMPT, 0)[0] == fc.mlx_lm_greedy(ref, PROMPT)


def test_trunk_logits_equal_mlx_lm_past_the_block_budget(ckpt):
    path = ckpt()
    fc.assert_trunk_follows_mlx_lm(load_model(path, mtp=False)[0],
                                   fc.mlx_lm_model(path, strict=False),
                                   [PROMPT, [4], [77], [2, 9, 11], [5]])


def test_vision_and_mtp_weights_are_dropped(ckpt):
    names = {k for k, _ in tree_flatten(load_model(ckpt(), mtp=False)[0].parameters())}
    assert "model.layers.1.self_attn.index_q_proj.weight" in names
    assert not any(k.startswith(("vision", "multi_modal", "patch_merge", "mtp", "language_model"))
                   for k in names)
    assert all(k in fc.raw_tensors(ckpt()) for k in VISION + MTP)


def test_verify_rows_equal_one_token_decoding(ckpt):
    """Context drafts still verify several rows at once: each row's block selection is the
    one its own one-token step makes."""
    model = load_model(ckpt(), mtp=False)[0]
    rows = [4, 77, 2, 9, 11, 40, 3]
    got, _ = fc.verify_logits(model, PROMPT, rows)
    want = fc.one_by_one_logits(model, PROMPT, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_batched_rows_equal_mlx_lm(ckpt):
    path = ckpt()
    fc.assert_batched_rows_equal_mlx_lm(load_model(path, mtp=False)[0],
                                        fc.mlx_lm_model(path, strict=False), PROMPTS, ks=(0,))


def test_convert_drops_nothing_it_runs_and_mlx_lm_loads_the_result(ckpt, tmp_path):
    from mlx_mtp.convert.main import convert

    src = ckpt(mtp_tensors=False)
    convert(src, tmp_path / "out", verbose=False)
    ours = load_model(tmp_path / "out", mtp=False)[0]
    x = mx.array([PROMPT])
    assert mx.array_equal(ours(x), load_model(src, mtp=False)[0](x))
    np.testing.assert_allclose(np.array(fc.mlx_lm_model(tmp_path / "out")(x)), np.array(ours(x)),
                               atol=1e-5)


def test_engine_rows_and_a_restored_turn_equal_mlx_lm(ckpt, tmp_path):
    """The server engine without a head: concurrent rows (one with context drafts, verified
    several rows at a time), and a prompt prefix saved to disk and restored, decode as
    mlx-lm does."""
    from engine_events import make_engine, run
    from mlx_mtp.decode.draft_source import DraftSources
    from mlx_mtp.models.io.loader import load
    from mlx_mtp.server.prefix_cache import PrefixCache
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    path = ckpt(vocab_size=4096)
    model_tok = load(str(path), mtp=False)
    ref = fc.mlx_lm_model(path, strict=False)
    prompt = [int(x) for x in RNG.integers(0, 4096, 40)]
    longer = prompt + prompt[:9]  # repeats: the lookup drafter finds them
    prompts = [prompt, longer[5:], prompt[:3], longer]
    sinks = run(make_engine(model_tok, num_draft_tokens=0, prefill_step_size=16,
                            draft_sources=DraftSources("lookup")), prompts)
    assert [s.tokens for s in sinks] == [fc.mlx_lm_greedy(ref, p, 12) for p in prompts]
    assert sum(s.done.usage["draft_tokens_by_source"]["lookup"]["drafted"] for s in sinks) > 0
    fp = model_fingerprint(model_tok[0])
    pc = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    run(make_engine(model_tok, num_draft_tokens=0, prefix_cache=pc, prefill_step_size=16),
        [prompt], boundaries=[24, 39])
    pc.disk.flush()
    pc2 = PrefixCache(8, 1 << 30, disk=SessionStore(tmp_path, fp, min_tokens=16))
    warm = run(make_engine(model_tok, num_draft_tokens=0, prefix_cache=pc2,
                           prefill_step_size=16), [longer])[0]
    assert pc2.disk.hits == 1
    assert warm.tokens == fc.mlx_lm_greedy(ref, longer, 12)


def test_distributed_is_refused_in_one_line(ckpt):
    """No split of MiniMax-M3 is tested yet: --distributed says so before reading weights."""
    from mlx_mtp.models.distributed import DistributedError, load_distributed

    with pytest.raises(DistributedError, match="cannot split minimax_m3_vl models yet"):
        load_distributed(str(ckpt()), mtp=False)
