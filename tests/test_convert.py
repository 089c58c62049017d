"""`mlx-mtp convert` / `mlx-mtp add-mtp` on tiny Hugging Face-layout checkpoints."""

import argparse
import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_mtp.convert.add_mtp as add_mtp_module  # the module (add_mtp below is the function)
from mlx_mtp.convert import checkpoint_io
from mlx_mtp.convert import add_mtp as am
from mlx_mtp.convert import main as cv
from mlx_mtp.convert.add_mtp import add_mtp
from mlx_mtp.convert.main import ConversionError, convert
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.io.layout import MissingMTPWeightsError
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.testing.tiny import build_model, make_tiny, save_hf_checkpoint, tiny_text_config

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]
N_TOKENS = 20

# Tiny HF checkpoints: every expert layout, Qwen3-Next, sharded inputs.
SOURCES = {
    "dense": dict(family="qwen3_5"),
    "moe_per_expert": dict(family="qwen3_5_moe", expert_layout="per_expert"),
    "moe_fused": dict(family="qwen3_5_moe", expert_layout="fused", mtp_expert_layout="fused"),
    "next": dict(family="qwen3_next"),
    "dense_sharded_tied": dict(family="qwen3_5", shards=3, tie=True),
    "moe_sharded": dict(family="qwen3_5_moe", shards=3),
}
# (quantize, mtp_bits): float, then 4-bit trunks with the head at 4 / 8 / 16 bits.
VARIANTS = {"float": (False, None), "q4_mtp4": (True, 4), "q4_mtp8": (True, 8),
            "q4_mtp16": (True, 16)}


def _make(path, family, **kw):
    return make_tiny(path, family, "noisy", tokenizer_dir=path.parent / "no-tokenizer", **kw)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: _make(root / name, **kw) for name, kw in SOURCES.items()}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx")
    out = {}
    for name, src in sources.items():
        for variant, (q, bits) in VARIANTS.items():
            dst = root / f"{name}-{variant}"
            convert(src, dst, quantize=q, mtp_bits=bits, verbose=False)
            out[name, variant] = dst
    return out


def greedy(model, k, n=N_TOKENS):
    dec = MTPDecoder(model, k, adaptive=False)
    tokens = [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)]
    return tokens, dec


def mlx_lm_greedy(path, n=N_TOKENS):
    from mlx_lm.generate import generate_step as lm_generate_step
    from mlx_lm.utils import load_model as lm_load_model

    model, _ = lm_load_model(Path(path))
    return [int(t) for t, _ in lm_generate_step(mx.array(PROMPT), model, max_tokens=n)]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def module_at(model, path):
    m = model
    for part in path.split("."):
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


# --------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SOURCES))
def test_float_conversion_equals_hf_load(name, sources, converted):
    ref, _ = load_model(Path(sources[name]))
    out, _ = load_model(converted[name, "float"])
    a, b = params(ref), params(out)
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    x = mx.array([PROMPT])
    assert mx.array_equal(ref(x), out(x)).item()
    h = ref.trunk(x)[1]
    nxt = mx.array([PROMPT[1:] + [1]])
    assert mx.array_equal(ref.logits(ref.mtp_forward(h, nxt, ref.make_mtp_cache())),
                          out.logits(out.mtp_forward(h, nxt, out.make_mtp_cache()))).item()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(SOURCES))
def test_converted_model_generates(name, variant, converted):
    path = converted[name, variant]
    model, _ = load_model(path)
    plain, _ = greedy(model, 0)
    accepted = 0
    for k in (1, 2, 3):
        tokens, dec = greedy(model, k)
        assert tokens == plain, f"K={k}"
        accepted += dec.stats.num_accepted_tokens
    assert accepted > 0  # the head is really used
    # Plain mlx-lm loads the same files (it never opens mtp.safetensors).
    assert mlx_lm_greedy(path) == plain
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert "mtp.safetensors" in files
    for f in files:
        keys = mx.load(str(path / f)).keys()
        assert all(("mtp." in k) == (f == "mtp.safetensors") for k in keys)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {v for k, v in index.items() if "mtp." in k} == {"mtp.safetensors"}
    assert set(index.values()) == set(files)


def test_quantization_recorded_per_layer(converted):
    cfg = json.loads((converted["moe_fused", "q4_mtp8"] / "config.json").read_text())
    q = cfg["quantization"]
    assert cfg["quantization_config"] == q
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    assert q["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert q["language_model.mtp.fc"] == {"group_size": 64, "bits": 8}
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1  # structure kept
    model, _ = load_model(converted["moe_fused", "q4_mtp8"])
    lm = model.language_model
    assert lm.model.layers[0].linear_attn.in_proj_qkv.bits == 4
    assert lm.model.layers[0].mlp.gate.bits == 8
    assert lm.mtp.fc.bits == 8 and lm.mtp.layers[0].mlp.switch_mlp.up_proj.bits == 8
    assert lm.mtp.layers[0].mlp.gate.bits == 8

    model, _ = load_model(converted["moe_fused", "q4_mtp4"])
    q = json.loads((converted["moe_fused", "q4_mtp4"] / "config.json").read_text())["quantization"]
    assert "language_model.mtp.fc" not in q  # same as the default
    assert model.language_model.mtp.fc.bits == 4
    assert model.language_model.mtp.layers[0].mlp.gate.bits == 8  # routers stay at 8

    model, _ = load_model(converted["next", "q4_mtp16"])
    q = json.loads((converted["next", "q4_mtp16"] / "config.json").read_text())["quantization"]
    assert q["mtp.fc"] is False
    assert type(model.mtp.fc) is nn.Linear and model.mtp.fc.weight.dtype == mx.float32
    assert model.model.layers[0].linear_attn.in_proj_qkvz.bits == 4

    assert "quantization" not in json.loads((converted["next", "float"] / "config.json").read_text())


def test_group_size_and_bits(sources, tmp_path):
    dst = tmp_path / "q8"
    convert(sources["dense"], dst, quantize=True, q_bits=8, q_group_size=32, mtp_bits=4,
            verbose=False)
    model, _ = load_model(dst)
    lm = model.language_model
    assert (lm.model.layers[0].mlp.up_proj.bits, lm.model.layers[0].mlp.up_proj.group_size) == (8, 32)
    assert (lm.mtp.fc.bits, lm.mtp.fc.group_size) == (4, 32)
    plain, _ = greedy(model, 0)
    assert greedy(model, 2)[0] == plain


def test_dtype_bfloat16_keeps_A_log(sources, tmp_path):
    dst = tmp_path / "bf16"
    convert(sources["moe_per_expert"], dst, dtype="bfloat16", verbose=False)
    w = {}
    for f in dst.glob("*.safetensors"):
        w.update(mx.load(str(f)))
    assert all(v.dtype == (mx.float32 if k.endswith("A_log") else mx.bfloat16)
               for k, v in w.items())
    model, _ = load_model(dst)  # CPU: float experts upcast by the loader
    plain, _ = greedy(model, 0)
    assert greedy(model, 2)[0] == plain


def test_sharded_output(sources, tmp_path):
    dst = tmp_path / "sharded"
    convert(sources["moe_sharded"], dst, max_shard_size_gb=200e3 / (1 << 30), verbose=False)
    names = sorted(p.name for p in dst.glob("model*.safetensors"))
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    ref, _ = load_model(Path(sources["moe_sharded"]))
    out, _ = load_model(dst)
    x = mx.array([PROMPT])
    assert mx.array_equal(ref(x), out(x)).item()
    assert mlx_lm_greedy(dst) == greedy(out, 0)[0]


def test_dequantize_round_trip(converted, tmp_path):
    q4 = converted["next", "q4_mtp8"]
    dst = tmp_path / "deq"
    convert(q4, dst, dequantize=True, verbose=False)
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization" not in cfg and "quantization_config" not in cfg
    assert not any(k.endswith(".scales") for k in mx.load(str(dst / "mtp.safetensors")))
    qm, _ = load_model(q4)
    fm, _ = load_model(dst)
    x = mx.array([PROMPT])
    assert mx.allclose(qm(x), fm(x), atol=1e-3).item()
    plain, _ = greedy(fm, 0)
    assert greedy(fm, 3)[0] == plain


def test_quantized_source_passes_through(converted, tmp_path):
    dst = tmp_path / "copy"
    convert(converted["dense", "q4_mtp8"], dst, verbose=False)
    a, _ = load_model(converted["dense", "q4_mtp8"])
    b, _ = load_model(dst)
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys() and all(mx.array_equal(pa[k], pb[k]).item() for k in pa)


def test_convert_refusals(sources, converted, tmp_path):
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="already exists"):
        convert(sources["dense"], existing, verbose=False)
    assert (existing / "keep.txt").read_text() == "x"
    with pytest.raises(ConversionError, match="either -q/--quantize or --dequantize"):
        convert(sources["dense"], tmp_path / "a", quantize=True, dequantize=True)
    with pytest.raises(ConversionError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "a")
    with pytest.raises(ConversionError, match="already quantized"):
        convert(converted["dense", "q4_mtp8"], tmp_path / "a", quantize=True, verbose=False)
    with pytest.raises(ConversionError, match="not quantized"):
        convert(sources["dense"], tmp_path / "a", dequantize=True, verbose=False)
    with pytest.raises(ConversionError, match="--mtp-bits must be one of"):
        convert(sources["dense"], tmp_path / "a", quantize=True, mtp_bits=6)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_convert_leaves_nothing(sources, tmp_path, monkeypatch, exc):
    src = Path(sources["moe_sharded"])
    before = snapshot(src)
    real, calls = checkpoint_io._save_shard, []

    def failing(path, tensors, *rest):
        calls.append(path.name)
        if len(calls) == 2:
            raise exc
        real(path, tensors, *rest)

    monkeypatch.setattr(checkpoint_io, "_save_shard", failing)
    out = tmp_path / "out"
    with pytest.raises(type(exc)):
        convert(src, out, quantize=True, max_shard_size_gb=100e3 / (1 << 30), verbose=False)
    assert len(calls) == 2
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind
    assert snapshot(src) == before


def test_stale_staging_from_a_killed_run_is_removed(sources, tmp_path):
    stale = tmp_path / ".out.mlx-mtp-tmp-999999999-deadbeef"  # pid that cannot exist
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    convert(sources["dense"], tmp_path / "out", verbose=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_add_mtp_recovers_from_a_swap_killed_half_way(sources, tmp_path):
    # Without an atomic exchange, the target is moved aside before the new one takes
    # its place; a run killed in between leaves only the original under a hidden name.
    dst = tmp_path / "dst"
    convert(_make(tmp_path / "trunk", "qwen3_5", drop_mtp=True), dst, verbose=False)
    orphan = tmp_path / ".dst.mlx-mtp-old-999999999-deadbeef"
    dst.rename(orphan)
    add_mtp(dst, sources["dense"], verbose=False)
    assert not orphan.exists()
    model, _ = load_model(dst)
    assert greedy(model, 2)[0] == greedy(model, 0)[0]


def test_source_without_head_converts_trunk_only(tmp_path, capsys):
    src = _make(tmp_path / "hf", "qwen3_5", drop_mtp=True)
    dst = tmp_path / "out"
    convert(src, dst, quantize=True)
    assert "has no MTP weights" in capsys.readouterr().err
    assert not (dst / "mtp.safetensors").exists()
    with pytest.raises(MissingMTPWeightsError, match="add-mtp"):
        load_model(dst)
    model, _ = load_model(dst, mtp=False)
    assert mlx_lm_greedy(dst) == greedy(model, 0)[0]


# --------------------------------------------------------------------------
# add-mtp
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["moe_per_expert", "next", "moe_sharded"])
def test_add_mtp_restores_head(name, sources, converted, tmp_path, monkeypatch):
    kw = SOURCES[name]
    src = Path(sources[name])
    trunk_src = _make(tmp_path / "hf-no-mtp", drop_mtp=True, **kw)
    dst = tmp_path / "q4"
    convert(trunk_src, dst, quantize=True, verbose=False)
    with pytest.raises(MissingMTPWeightsError):
        load_model(dst)

    read, real_load = [], mx.load
    monkeypatch.setattr(mx, "load", lambda f, *a, **k: read.append(Path(f).name) or
                        real_load(f, *a, **k))
    summary = add_mtp(dst, src, mtp_bits=8, verbose=False)
    monkeypatch.undo()
    # Only the source shards holding mtp.* tensors were opened.
    index = src / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        assert read == sorted({f for k, f in wm.items() if k.startswith("mtp.")})
        assert len(read) < len(set(wm.values()))
    assert summary["mtp_layers"] == 1 and not summary["replaced"]
    # Same bytes as converting with the head in the first place.
    model, _ = load_model(dst)
    ref, _ = load_model(converted[name, "q4_mtp8"])
    a, b = params(model), params(ref)
    assert a.keys() == b.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    plain, _ = greedy(model, 0)
    tokens, dec = greedy(model, 2)
    assert tokens == plain and dec.stats.num_accepted_tokens > 0
    assert mlx_lm_greedy(dst) == plain
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert {v for k, v in index.items() if "mtp." in k} == {"mtp.safetensors"}


def test_add_mtp_defaults_to_model_precision(sources, tmp_path):
    src = sources["dense"]
    for q, expect in ((True, 4), (False, None)):
        dst = tmp_path / f"dst-{q}"
        convert(_make(tmp_path / f"hf-{q}", "qwen3_5", drop_mtp=True), dst, quantize=q,
                verbose=False)
        add_mtp(dst, src, verbose=False)
        model, _ = load_model(dst)
        fc = model.language_model.mtp.fc
        assert getattr(fc, "bits", None) == expect
        cfg = json.loads((dst / "config.json").read_text())
        assert ("quantization" in cfg) == q
        plain, _ = greedy(model, 0)
        assert greedy(model, 1)[0] == plain


@pytest.mark.parametrize("variant", ["float", "q4_mtp8"])
def test_add_mtp_from_mlx_source(variant, converted, tmp_path):
    """The head can come from an MLX conversion too (float, or quantized: re-quantized)."""
    dst = tmp_path / "dst"
    convert(_make(tmp_path / "trunk", "qwen3_5_moe", drop_mtp=True, **{
        k: v for k, v in SOURCES["moe_fused"].items() if k != "family"}),
        dst, quantize=True, verbose=False)
    add_mtp(dst, converted["moe_fused", variant], mtp_bits=8, verbose=False)
    model, _ = load_model(dst)
    ref, _ = load_model(converted["moe_fused", "q4_mtp8"])
    # Float head: quantized as convert does it; 8-bit head: reused as packed.
    a, b = params(model), params(ref)
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    plain, _ = greedy(model, 0)
    tokens, dec = greedy(model, 2)
    assert tokens == plain and dec.stats.num_accepted_tokens > 0


def test_add_mtp_to_mlx_lm_conversion(sources, tmp_path):
    """The common case: an mlx-lm 4-bit conversion (head stripped) + the original release."""
    from mlx_lm.utils import load_model as lm_load_model
    from mlx_lm.utils import quantize_model, save_config, save_model

    src = sources["moe_fused"]
    model, config = lm_load_model(Path(src), lazy=True)
    model, config = quantize_model(model, config, 64, 4)
    dst = tmp_path / "mlx-lm-4bit"
    save_model(dst, model)
    save_config(config, dst / "config.json")
    plain_mlx_lm = mlx_lm_greedy(dst)

    add_mtp(dst, src, verbose=False)
    ours, _ = load_model(dst)
    assert ours.language_model.mtp.fc.bits == 4
    plain, _ = greedy(ours, 0)
    tokens, dec = greedy(ours, 3)
    assert plain == plain_mlx_lm and tokens == plain
    assert dec.stats.num_accepted_tokens > 0
    assert mlx_lm_greedy(dst) == plain_mlx_lm


def test_add_mtp_refusals(sources, converted, tmp_path):
    dst = tmp_path / "dst"
    convert(_make(tmp_path / "trunk", "qwen3_5", drop_mtp=True), dst, quantize=True,
            verbose=False)
    before = snapshot(dst)

    no_head = _make(tmp_path / "no-head", "qwen3_5", drop_mtp=True)
    with pytest.raises(ConversionError, match="has no MTP weights"):
        add_mtp(dst, no_head, verbose=False)

    text = tiny_text_config("qwen3_5", hidden=32)
    small = save_hf_checkpoint(build_model("qwen3_5", text), "qwen3_5", text, tmp_path / "h32",
                               tokenizer_dir=tmp_path / "none")
    with pytest.raises(ConversionError, match="hidden_size: model 64 vs source 32"):
        add_mtp(dst, small, verbose=False)

    # Config claims the right sizes but a tensor has the wrong shape.
    bad = _make(tmp_path / "bad-shape", "qwen3_5")
    w = mx.load(str(bad / "model.safetensors"))
    w["mtp.fc.weight"] = w["mtp.fc.weight"][:, :96]
    mx.save_safetensors(str(bad / "model.safetensors"), w)
    with pytest.raises(ConversionError, match="does not fit this model.*shape"):
        add_mtp(dst, bad, verbose=False)

    with pytest.raises(ConversionError, match="source is a 'qwen3_next' model"):
        add_mtp(dst, sources["next"], verbose=False)
    with pytest.raises(ConversionError, match="--mtp-bits must be one of"):
        add_mtp(dst, sources["dense"], mtp_bits=3, verbose=False)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    has_head = converted["dense", "q4_mtp8"]
    head_before = snapshot(has_head)
    with pytest.raises(ConversionError, match="already has an MTP head.*--force"):
        add_mtp(has_head, sources["dense"], verbose=False)
    assert snapshot(has_head) == head_before


def test_add_mtp_force_replaces_head(sources, tmp_path):
    # A model whose head sits inside a trunk shard (not in mtp.safetensors).
    src = sources["dense"]
    dst = tmp_path / "dst"
    convert(src, dst, quantize=True, mtp_bits=16, verbose=False)
    w = {}
    for f in sorted(dst.glob("*.safetensors")):
        w.update(mx.load(str(f)))
        f.unlink()
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    (dst / "model.safetensors.index.json").unlink()
    add_mtp(dst, src, mtp_bits=8, force=True, verbose=False)
    assert not any("mtp." in k for k in mx.load(str(dst / "model.safetensors")))
    model, _ = load_model(dst)
    assert model.language_model.mtp.fc.bits == 8
    plain, _ = greedy(model, 0)
    assert greedy(model, 2)[0] == plain
    assert mlx_lm_greedy(dst) == plain


@pytest.mark.parametrize("where", ["_save_shard", "_write_index", "_swap_into_place"])
def test_interrupted_add_mtp_leaves_target_unchanged(where, sources, converted, tmp_path,
                                                     monkeypatch):
    dst = tmp_path / "dst"
    convert(sources["moe_fused"], dst, quantize=True, mtp_bits=16, verbose=False)
    before = snapshot(dst)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(add_mtp_module, where, boom)
    with pytest.raises(KeyboardInterrupt):
        add_mtp(dst, sources["moe_fused"], mtp_bits=4, force=True, verbose=False)
    assert snapshot(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


# --------------------------------------------------------------------------
# CLI entry points
# --------------------------------------------------------------------------

def test_cli_entry_points(sources, tmp_path, capsys):
    p = cv.add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--hf-path", str(sources["next"]), "--mlx-path", str(tmp_path / "o"),
                         "-q", "--mtp-bits", "8"])
    assert cv.run(args) == 0
    out = capsys.readouterr().out
    assert "MTP head" in out and "8-bit" in out
    assert cv.run(args) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--mlx-path" in err

    p = am.add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--model", str(tmp_path / "o"), "--source", str(sources["next"])])
    assert am.run(args) == 2
    assert "--force" in capsys.readouterr().err
    args = p.parse_args(["--model", str(tmp_path / "o"), "--source", str(sources["next"]),
                         "--force", "--mtp-bits", "16"])
    assert am.run(args) == 0
    model, _ = load_model(tmp_path / "o")
    assert type(model.mtp.fc) is nn.Linear
