"""GLM-5.3-Flash (``glm5_next``: KDA + NoPE MLA with a k-pool indexer, mHC streams): the
trunk's logits and greedy decoding equal transformers 5.24's ``Glm5NextForConditionalGeneration``
on a tiny checkpoint it wrote itself, recorded with its outputs by
``fixtures/glm5_next/make_reference.py`` (CI has no torch); a verify pass computes each row
as one-token decoding does, selections at exact indexer ties included; a partial acceptance
rolls KDA back by replay and trims the latent and indexer caches."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import family_checks as fc
from mlx_mtp.models.cache.kv import cache_state_arrays
from mlx_mtp.models.io.layout import CheckpointError
from mlx_mtp.models.io.loader import load_model

FIXTURE = Path(__file__).parent / "fixtures" / "glm5_next"
CHECKPOINT = FIXTURE / "checkpoint"


@pytest.fixture(scope="module")
def reference():
    return np.load(FIXTURE / "reference.npz")


@pytest.fixture(scope="module")
def model():
    return load_model(CHECKPOINT)[0]


def test_trunk_equals_transformers(model, reference):
    """One forward over prompt + continuation (the indexer selecting: 16 complete pools, 2
    kept) matches transformers' forward; cached one-token decoding through the engine gives
    transformers' greedy continuation, with its per-step logits."""
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    logits = model.logits(model.trunk(mx.array([prompt + tokens]))[0])[0]
    np.testing.assert_allclose(np.array(logits), reference["forward_logits"], atol=2e-4)
    steps = fc.one_by_one_logits(model, prompt, tokens[:-1])[0]
    np.testing.assert_allclose(np.array(steps), reference["step_logits"][1:], atol=2e-4)
    for k in range(4):
        assert fc.mtp_tokens(model, prompt, k, n=len(tokens))[0] == tokens, f"K={k}"


def test_head_equals_mlx_vlm(model):
    """mlx-vlm 0.7.10's ``Glm5NextMTPDraftModel`` on the same layer 5 (recorded by
    ``fixtures/glm5_next/make_mlx_vlm_reference.py``): one pass over 20 rows from position 0
    (the first row's embedding zeroed, the head's indexer selecting) and one chained pass on
    the last (normed) output."""
    ref = np.load(FIXTURE / "mlx_vlm_head.npz")
    cache = model.make_mtp_cache()
    out = model.mtp_forward(mx.array(ref["hidden"]), mx.array(ref["tokens"]), cache)
    np.testing.assert_allclose(np.array(out), ref["out"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits"], atol=1e-5)
    out = model.mtp_forward(out[:, -1:], mx.array(ref["next"]), cache, depth=1)
    np.testing.assert_allclose(np.array(out), ref["out2"], atol=1e-5)
    np.testing.assert_allclose(np.array(model.draft_logits(out)), ref["logits2"], atol=1e-5)


def test_loads_without_its_head(tmp_path, reference):
    """``mtp=False`` decodes the trunk alone; a checkpoint whose head is missing says so."""
    model = load_model(CHECKPOINT, mtp=False)[0]
    assert model.num_mtp_layers == 0
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    assert fc.mtp_tokens(model, prompt, 0, n=8)[0] == tokens[:8]
    path = tmp_path / "headless"
    shutil.copytree(CHECKPOINT, path)
    from safetensors.numpy import load_file, save_file
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".layers.5." not in k},
              path / "model.safetensors", metadata={"format": "pt"})
    fc.assert_missing_head_explained(path)


def test_layers_are_the_released_kinds(model):
    kinds = [(layer.is_linear, layer.shared, "indexer" in layer.self_attn)
             for layer in model.model.layers]
    assert kinds == [(True, False, False), (False, False, True), (False, True, False),
                     (True, False, False), (False, False, True)]
    assert model.model.layers[0].self_attn.A_log.dtype == mx.float32


@pytest.mark.parametrize("offset", [0, 3, 4])
def test_verify_rows_equal_one_token_decoding(model, reference, offset):
    """Five rows in one pass (some completing a pool, so later rows see pools earlier rows
    must not) equal five one-token steps."""
    prompt = reference["prompt"].tolist()[: 30 + offset]
    rows = [5, 77, 140, 9, 201]
    got, _ = fc.verify_logits(model, prompt, rows)
    want = fc.one_by_one_logits(model, prompt, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_partial_acceptance_rolls_back_exactly(model, reference):
    """Verify four tokens, keep two: every cache (KDA by replay; latents and indexer keys
    trimmed) is that of decoding the two one by one, and so are the logits that follow."""
    prompt = reference["prompt"].tolist()
    plain = fc.prefilled_cache(model, prompt)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), plain)
    want = model.logits(model.trunk(mx.array([[5]]), plain)[0])
    _, spec = fc.verify_logits(model, prompt, [4, 77, 2, 9])
    for c in spec:
        c.accept([2])
    before = fc.prefilled_cache(model, prompt)
    for t in (4, 77):
        model.trunk(mx.array([[t]]), before)
    for a, b in zip(cache_state_arrays(spec), cache_state_arrays(before)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
    got = model.logits(model.trunk(mx.array([[5]]), spec)[0])
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_exact_ties_select_as_one_token_decoding(tmp_path, reference):
    """With the indexer's head weights zero every pool scores exactly 0: the selection then
    rests on tie-breaking alone, and a verify pass (which sees pools a one-token step does
    not) must still choose what one-token decoding chooses."""
    path = tmp_path / "ties"
    shutil.copytree(CHECKPOINT, path)
    from safetensors.numpy import load_file, save_file
    weights = load_file(path / "model.safetensors")
    for k in weights:
        if k.endswith("indexer.weights_proj.weight"):
            weights[k] = np.zeros_like(weights[k])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tied = load_model(path, mtp=False)[0]
    prompt = reference["prompt"].tolist()[:31]
    rows = [5, 77, 140, 9, 201, 3]
    got, _ = fc.verify_logits(tied, prompt, rows)
    want = fc.one_by_one_logits(tied, prompt, rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)


def test_shared_layer_after_a_kda_layer_is_refused(tmp_path):
    """transformers passes a selection only from an indexed layer to the next layer."""
    path = tmp_path / "bad"
    shutil.copytree(CHECKPOINT, path)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["layer_types"][1] = "linear_attention"  # layer 2 is "shared"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layer 2 reuses the indexer selection"):
        load_model(path, mtp=False)


@pytest.mark.parametrize("k", [0, 2])
def test_batched_rows_equal_single_rows(model, reference, k):
    """Rows join one per step at different lengths (some past a pool boundary, the indexer
    selecting); at K = 2 rejected drafts leave holes in the batch's latent and indexer caches,
    which each row's pools skip (its own token order)."""
    prompt = reference["prompt"].tolist()
    prompts = [prompt[:9], prompt[:30], prompt[3:7], prompt]
    want = [fc.mtp_tokens(model, p, 0, n=12)[0] for p in prompts]
    assert fc.run_batch(model, k, prompts, n=12)[0] == want


def test_inspect_reports_it(tmp_path, capsys):
    """The head at ``model.language_model.layers.5`` is found; the vision tower is named as
    unused."""
    from mlx_mtp import cli
    from mlx_mtp.testing.tiny import TOKENIZER_DIR

    path = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, path)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, path / f.name)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "glm5_next (model_type 'glm5_next')" in out
    assert "1 layer(s) declared, 1 present" in out
    assert "under model.language_model.layers.5." in out


def test_convert_round_trip(tmp_path, reference):
    """``convert`` writes our layout (conv axes moved, experts stacked, mHC names, the head
    under ``mtp.layers.0``); it loads back and decodes transformers' greedy at K = 2."""
    from mlx_mtp import cli
    from mlx_mtp.testing.tiny import TOKENIZER_DIR

    src, out = tmp_path / "ckpt", tmp_path / "mlx"
    shutil.copytree(CHECKPOINT, src)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, src / f.name)
    assert cli.main(["convert", "--hf-path", str(src), "--mlx-path", str(out)]) == 0
    model = load_model(out)[0]
    prompt, tokens = reference["prompt"].tolist(), reference["tokens"].tolist()
    assert fc.mtp_tokens(model, prompt, 2, n=len(tokens))[0] == tokens


def test_distributed_and_kv_bits_are_refused_in_one_line(model):
    from mlx_mtp.models.cache.quantized import KVQuantization
    from mlx_mtp.models.distributed import DistributedError, load_distributed

    with pytest.raises(DistributedError, match="cannot split glm5_next models yet"):
        load_distributed(str(CHECKPOINT), mtp=False)
    with pytest.raises(ValueError, match="--kv-bits is not available for glm5_next"):
        model.use_kv_quantization(KVQuantization(bits=8))
