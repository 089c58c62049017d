"""``convert --draft-model``: a block drafter written beside the converted trunk, copied in its
published layout or quantized (``--draft-q-bits``), loads with ``--draft-model`` and keeps
greedy output identical to plain decoding; its linear layers run as mlx's quantized layers and
compute what a float drafter holding the dequantized weights computes; a copy of the target's
embedding that the packaging ships is not written; ``inspect`` reports the precision; a drafter
that does not fit the trunk is refused before anything is written.

Drafters are random-weight ones in their published layouts (``testing/tiny_block``)."""

import argparse

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from block_checks import decode
from mlx_mtp.convert import main as convert_main
from mlx_mtp.convert.main import convert
from mlx_mtp.drafters.block.load import attach_block_drafter, load_block_drafter
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.testing.tiny import make_tiny
from mlx_mtp.testing.tiny_block import make_tiny_block
from mlx_mtp.tools.inspect_model import inspect_model, render

PROMPT = [5, 60, 11, 7, 9, 3, 41, 17]
GROUP = 32


def _stored(path):
    return mx.load(str(path / "model.safetensors"))


def _drafter(tmp, kind, own=True):
    taps = [0, 1, 3] if kind == "eagle3" else [0, 2]  # EAGLE-3 reads three layers
    path = make_tiny_block(tmp / f"src_{kind}", kind, 64, 512, taps, 4, own_embed_head=own,
                           block_size=4)
    if kind == "eagle3":  # speculators ships the target's (frozen) embedding: not rewritten
        weights = _stored(path)
        weights["embed_tokens.weight"] = mx.random.normal((512, 64))
        mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("trunk"), "qwen3_5", "random")


def test_a_copy_keeps_the_published_tensors_and_config(trunk, tmp_path):
    src = _drafter(tmp_path, "dflash2")
    out = convert(trunk, tmp_path / "out", draft_model=str(src), verbose=False)
    written = tmp_path / "out-drafter"
    assert out["block_drafter"] == {"path": str(written), "kind": "dflash2",
                                    "quantization": None}
    want, got = _stored(src), _stored(written)
    assert "candidate_selector.predecessor_codebook" in got  # DFlash2's published name
    assert set(got) == set(want)
    assert all(mx.array_equal(got[k], want[k]) for k in want)
    assert (written / "config.json").read_text().count("DFlash2DraftModel") == 1


@pytest.mark.parametrize("kind,own", [("dflash", True), ("dspark", True), ("eagle3", True)])
def test_quantized_drafter_runs_quantized_and_decodes_plain_tokens(trunk, tmp_path, kind, own):
    src = _drafter(tmp_path, kind, own)
    convert(trunk, tmp_path / "out", draft_model=str(src), draft_q_bits=8,
            q_group_size=GROUP, verbose=False)
    written = tmp_path / "out-drafter"
    stored, source = _stored(written), _stored(src)
    if kind == "eagle3":
        assert "embed_tokens.weight" in source and "embed_tokens.weight" not in stored
    assert {k for k in stored if not k.endswith((".scales", ".biases"))} <= set(source)

    quantized = load_block_drafter(str(written))
    modules = quantized.named_modules()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in modules)
    # float only where the rows do not split into groups (DSpark's rank-8 Markov head)
    assert all(m.weight.shape[-1] % GROUP for _, m in modules if type(m) is nn.Linear)

    model = load_model(tmp_path / "out")[0]
    plain, _ = decode(model, PROMPT, 0)
    attach_block_drafter(model, str(written))
    for k in (1, 3):
        got, dec = decode(model, PROMPT, k)
        assert got == plain, f"{kind} width {k}"
        assert dec.stats.block_draft_tokens > 0
    got, _ = decode(model, PROMPT, 4, "block+mtp")
    assert got == plain

    report = inspect_model(str(written))
    assert report["block_drafter"]["quantization"]["bits"] == 8
    assert "8-bit affine (group size 32" in render(report)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_quantized_block_equals_float_block_on_dequantized_weights(trunk, tmp_path, kind):
    """The quantized layers sit on the modules the published names say: a float drafter
    given the dequantized weights computes the same block (dequantize is mlx's own)."""
    src = _drafter(tmp_path, kind)
    convert(trunk, tmp_path / "out", draft_model=str(src), draft_q_bits=4,
            q_group_size=GROUP, verbose=False)
    quantized = load_block_drafter(str(tmp_path / "out-drafter"))
    reference = load_block_drafter(str(src))
    flat = dict(tree_flatten(quantized.parameters()))
    for path, m in quantized.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(m.weight, m.scales, m.biases, GROUP, 4)
            flat = {k: v for k, v in flat.items() if not k.startswith(path + ".")}
            flat[path + ".weight"] = w
    reference.load_weights(list(flat.items()))
    model = load_model(tmp_path / "out")[0]
    hidden = []
    for d in (quantized, reference):
        d.bind(model.text.model.embed_tokens, model.text.lm_head)
        cache = d.make_cache()
        mx.random.seed(3)
        d.add_context([mx.random.normal((1, 6, 64)), mx.random.normal((1, 6, 64))], cache)
        hidden.append(d.block_hidden(mx.array([7]), 4, cache))
    assert mx.allclose(hidden[0], hidden[1], atol=1e-4).item()


def _run_cli(*argv):
    parser = convert_main.add_arguments(argparse.ArgumentParser())
    return convert_main.run(parser.parse_args(list(argv)))


def test_a_misfit_or_already_quantized_drafter_is_refused_before_writing(trunk, tmp_path,
                                                                         capsys):
    misfit = make_tiny_block(tmp_path / "misfit", "dflash", 64, 512, [1, 7], 8)
    code = _run_cli("--model", str(trunk), "--mlx-path", str(tmp_path / "a"),
                    "--draft-model", str(misfit))
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the reading progress bar
    assert code == 2 and "Traceback" not in err
    assert last.startswith("mlx-mtp convert: error: --draft-model") and "taps layers [1, 7]" in last
    assert not (tmp_path / "a").exists() and not (tmp_path / "a-drafter").exists()

    src = _drafter(tmp_path, "dflash")
    assert _run_cli("--model", str(trunk), "--mlx-path", str(tmp_path / "b"), "--draft-model",
                    str(src), "--draft-q-bits", "8", "--q-group-size", "32") == 0
    code = _run_cli("--model", str(trunk), "--mlx-path", str(tmp_path / "c"), "--draft-model",
                    str(tmp_path / "b-drafter"), "--draft-q-bits", "4")
    err = capsys.readouterr().err
    assert code == 2 and "already quantized" in err
    assert not (tmp_path / "c").exists()
    code = _run_cli("--model", str(trunk), "--mlx-path", str(tmp_path / "d"), "--draft-q-bits",
                    "4")
    assert code == 2 and "--draft-model" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
