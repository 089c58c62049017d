"""Split MTP drafters (mlx-vlm's layout): ``convert --split-mtp`` writes them, ``--mtp-model``
loads them onto a trunk without a head; a drafter made for another model is refused."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.convert.main import ConversionError, convert
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io.layout import CheckpointError
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.io.split_drafter import DRAFTER_MODEL_TYPE
from mlx_mtp.testing.tiny import make_tiny

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]
SOURCES = {
    "dense": dict(family="qwen3_5"),
    "moe": dict(family="qwen3_5_moe", expert_layout="per_expert"),
    "next": dict(family="qwen3_next"),
}
VARIANTS = {"float": dict(), "q4": dict(quantize=True, mtp_bits=8)}


def greedy(model, k, n=16):
    dec = MTPDecoder(model, k, adaptive=False)
    tokens = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]
    return tokens, dec.stats.num_accepted_tokens


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    out = {}
    for name, kw in SOURCES.items():
        src = make_tiny(root / name, head="noisy", **kw)
        for variant, opts in VARIANTS.items():
            merged = root / f"{name}-{variant}-merged"
            trunk, drafter = root / f"{name}-{variant}", root / f"{name}-{variant}-MTP"
            convert(src, merged, verbose=False, **opts)
            convert(src, trunk, split_mtp=drafter, verbose=False, **opts)
            out[name, variant] = (src, merged, trunk, drafter)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(SOURCES))
def test_round_trip_decodes_as_the_merged_checkpoint(name, variant, built):
    src, merged, trunk, drafter = built[name, variant]
    whole, _ = load_model(merged)
    pair, _ = load_model(trunk, mtp_model=str(drafter))
    a, b = dict(tree_flatten(whole.parameters())), dict(tree_flatten(pair.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    plain, _ = greedy(whole, 0)
    for k in (1, 3):
        tokens, accepted = greedy(pair, k)
        assert tokens == plain and accepted > 0
        assert greedy(whole, k) == (tokens, accepted)


def test_drafter_files_follow_the_split_layout(built):
    src, merged, trunk, drafter = built["moe", "q4"]
    cfg = json.loads((drafter / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == DRAFTER_MODEL_TYPE and cfg["block_size"] == 3
    assert cfg["tie_word_embeddings"] is False
    assert cfg["text_config"]["hidden_size"] == src_cfg["text_config"]["hidden_size"]
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    q = cfg["quantization"]
    assert q == cfg["quantization_config"] and q["bits"] == 8 and q["fc"]["bits"] == 8
    assert not any(k.startswith("mtp.") for k in q)
    tensors, meta = mx.load(str(drafter / "model.safetensors"), return_metadata=True)
    assert meta.get("format") == "mlx"
    assert "fc.weight" in tensors and "fc.scales" in tensors
    assert "layers.0.mlp.switch_mlp.gate_proj.weight" in tensors
    assert not any(k.startswith(("mtp.", "model.", "embed_tokens", "lm_head")) for k in tensors)
    # Norms stored applied (1 + w): equal to the loaded head's.
    whole, _ = load_model(merged)
    head = dict(tree_flatten(whole.language_model.mtp.parameters()))
    for k in ("norm.weight", "pre_fc_norm_hidden.weight", "layers.0.input_layernorm.weight"):
        assert mx.array_equal(tensors[k], head[k]).item()
    assert (drafter / "tokenizer.json").exists()
    # The trunk: no head anywhere, and its config keeps no quantization entry for one.
    assert not any("mtp." in k for f in trunk.glob("*.safetensors") for k in mx.load(str(f)))
    tq = json.loads((trunk / "config.json").read_text())["quantization"]
    assert not any("mtp" in k for k in tq)


def test_trunk_is_what_mlx_lm_convert_writes(built, tmp_path):
    from mlx_lm.convert import convert as lm_convert

    src, merged, trunk, drafter = built["dense", "float"]
    lm_out = tmp_path / "mlx-lm"
    lm_convert(str(src), str(lm_out))
    ours = {k: v for f in trunk.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    theirs = {k: v for f in lm_out.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def test_hf_layout_keys_in_a_drafter_are_read_as_mlx_vlm_reads_them(built, tmp_path):
    """Keys still prefixed ``mtp.`` are the raw layout: norms zero-centred."""
    src, merged, trunk, drafter = built["dense", "float"]
    raw = tmp_path / "raw-MTP"
    shutil.copytree(drafter, raw)
    tensors = mx.load(str(drafter / "model.safetensors"))
    norms = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
    hf = {"mtp." + k: (v - 1.0 if k.endswith(norms) else v) for k, v in tensors.items()}
    mx.save_safetensors(str(raw / "model.safetensors"), hf)
    a, _ = load_model(trunk, mtp_model=str(drafter))
    b, _ = load_model(trunk, mtp_model=str(raw))
    assert greedy(a, 2) == greedy(b, 2)
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert all(mx.allclose(pa[k], pb[k], atol=1e-6).item() for k in pa)


def test_a_drafter_for_another_model_is_refused(built, tmp_path):
    src, merged, trunk, drafter = built["dense", "float"]
    other_src = make_tiny(tmp_path / "other", "qwen3_5", "noisy", num_layers=8)
    convert(other_src, tmp_path / "other-trunk", split_mtp=tmp_path / "other-MTP", verbose=False)
    with pytest.raises(CheckpointError, match="num_hidden_layers: trunk 4 vs drafter 8"):
        load_model(trunk, mtp_model=str(tmp_path / "other-MTP"))
    with pytest.raises(CheckpointError, match="'qwen3_next' model"):
        load_model(trunk, mtp_model=str(built["next", "float"][3]))
    with pytest.raises(CheckpointError, match="not a split MTP drafter"):
        load_model(trunk, mtp_model=str(merged))
    # Same shapes, other vocabulary: the tokenizers say so.
    swapped = tmp_path / "swapped-MTP"
    shutil.copytree(drafter, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match="tokenizers differ"):
        load_model(trunk, mtp_model=str(swapped))


def test_split_refusals(built, tmp_path):
    src, merged, trunk, drafter = built["dense", "float"]
    with pytest.raises(ConversionError, match="already exists"):
        convert(src, tmp_path / "t", split_mtp=drafter, verbose=False)
    with pytest.raises(ConversionError, match="another directory"):
        convert(src, tmp_path / "t", split_mtp=tmp_path / "t", verbose=False)
    headless = make_tiny(tmp_path / "headless", "qwen3_5", drop_mtp=True)
    with pytest.raises(ConversionError, match="nothing for --split-mtp"):
        convert(headless, tmp_path / "t", split_mtp=tmp_path / "d", verbose=False)
    assert not (tmp_path / "t").exists() and not (tmp_path / "d").exists()


def test_cli_pair_and_mlx_vlm_spelling(tiny_ckpt, tmp_path, cli):
    src = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    trunk, drafter = tmp_path / "trunk", tmp_path / "trunk-MTP"
    code, _, err = cli("convert", "--hf-path", str(src), "--mlx-path", str(trunk),
                       "--split-mtp", str(drafter))
    assert code == 0, err
    gen = ["generate", "--prompt", "def f():", "-m", "10", "--temp", "0"]
    code, plain, err = cli(*gen, "--model", str(src), "--verbose", "False", "--no-mtp")
    assert code == 0, err
    # --fixed-k: the pair must draft in these 10 tokens whatever step costs earlier tests
    # stored for these shapes (an adaptive policy may rightly pause on them).
    code, pair, err = cli(*gen, "--model", str(trunk), "--mtp-model", str(drafter), "--fixed-k")
    assert code == 0 and "MTP: accepted" in pair, err
    code, vlm, err = cli(*gen, "--model", str(trunk), "--draft-model", str(drafter),
                         "--draft-kind", "mtp", "--verbose", "False")
    assert code == 0 and vlm == plain, err
    code, _, err = cli(*gen, "--model", str(trunk), "--draft-model", str(drafter),
                       "--draft-kind", "dflash")
    assert code == 2 and "is a split MTP drafter, not a dflash one" in err, err
    # The trunk alone: the drafter beside it (trunk-MTP) is found and said so.
    code, found, err = cli(*gen, "--model", str(trunk), "--verbose", "False")
    assert code == 0 and found == plain and "drafting with the one in" in err, err
    drafter.rename(tmp_path / "elsewhere")
    code, _, err = cli(*gen, "--model", str(trunk))  # no head anywhere
    assert code == 2 and "--no-mtp" in err and "Traceback" not in err


FIXTURES = Path(__file__).parent / "fixtures" / "mlx_vlm_split"


@pytest.mark.parametrize("case,drafter_dir,opts", [
    ("dense", "drafter", {}),
    ("dense", "drafter-q4", dict(quantize=True, mtp_bits=4)),
    ("moe", "drafter", {}),
])
def test_drafters_written_by_mlx_vlm_load_and_decode(case, drafter_dir, opts, tmp_path):
    """mlx-vlm 0.7.10's split_mtp output (recorded) drafts for our trunk conversion exactly
    as the merged checkpoint's head; in floating point it equals our --split-mtp output."""
    src, vlm_drafter = FIXTURES / case / "source", FIXTURES / case / drafter_dir
    trunk, ours = tmp_path / "trunk", tmp_path / "trunk-MTP"
    convert(src, trunk, split_mtp=ours, verbose=False, **opts)
    convert(src, tmp_path / "merged", verbose=False, **opts)
    whole, _ = load_model(tmp_path / "merged")
    pair, _ = load_model(trunk, mtp_model=str(vlm_drafter))
    plain, _ = greedy(whole, 0)
    for k in (1, 3):
        tokens, accepted = greedy(pair, k)
        assert tokens == plain and accepted > 0
    if not opts:
        a = mx.load(str(vlm_drafter / "model.safetensors"))
        b = mx.load(str(ours / "model.safetensors"))
        assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_a_drafter_beside_its_trunk_is_found(built, tmp_path):
    """mlx-community's naming: Name-4bit next to Name-MTP-4bit."""
    src, merged, trunk, drafter = built["dense", "q4"]
    shutil.copytree(trunk, tmp_path / "Tiny-4bit")
    shutil.copytree(drafter, tmp_path / "Tiny-MTP-4bit")
    shutil.copytree(trunk, tmp_path / "lonely")
    with pytest.raises(CheckpointError, match="lack the MTP head"):
        load_model(tmp_path / "lonely")  # no drafter beside this one
    model, _ = load_model(tmp_path / "Tiny-4bit")
    whole, _ = load_model(merged)
    assert greedy(model, 2) == greedy(whole, 2)
