"""Every checkpoint variant loads or is refused clearly (issue 12, items 14-18).

Tiny checkpoints are written in the real layouts; the configs of the "transformers 5"
cases are made by transformers' own config classes (``layer_types``, no
``full_attention_interval``, ``tie_word_embeddings`` only at the top level).
"""

import argparse
import json
import logging
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.convert import add_mtp as am
from mlx_mtp.convert import main as cv
from mlx_mtp.convert.checkpoint_io import write_checkpoint
from mlx_mtp.convert.main import ConversionError, convert
from mlx_mtp.decode.speculative import MTPDecoder, generate_step
from mlx_mtp.models.io import layout
from mlx_mtp.models.io.layout import CheckpointError, check_acceptance
from mlx_mtp.models.io.loader import ModelLoadError, load_model
from mlx_mtp.testing.tiny import (build_model, make_oracle, make_tiny, save_hf_checkpoint,
                                  tiny_text_config)

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]
X = mx.array([PROMPT])


def _no_tokenizer(path: Path) -> Path:
    return path.parent / "no-tokenizer"


def transformers5_config(family: str, text: dict, tie: bool) -> dict:
    """config.json as transformers 5 writes it for ``text`` (plus the MTP count, which
    released checkpoints carry and transformers keeps as an extra field)."""
    import transformers

    classes = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig",
               "qwen3_next": "Qwen3NextConfig"}
    cls = getattr(transformers, classes[family])
    kw = {k: v for k, v in text.items() if k not in (
        "model_type", "architectures", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings",
        "tie_word_embeddings", "rope_scaling", "layer_types")}
    if text.get("layer_types"):
        kw.pop("full_attention_interval", None)
        kw["layer_types"] = text["layer_types"]
    if family == "qwen3_next":
        return cls(**kw, tie_word_embeddings=tie).to_dict()
    config = cls(text_config=kw, tie_word_embeddings=tie).to_dict()
    config["text_config"]["mtp_num_hidden_layers"] = text.get("mtp_num_hidden_layers", 1)
    return config


def built(family="qwen3_5", tie=False, layer_types=None, head="random", **kw):
    text = tiny_text_config(family, tie=tie, **kw)
    if layer_types:
        text["layer_types"] = layer_types
    model = build_model(family, text)
    if head == "noisy":
        make_oracle(model, 0.0, 1.5)
    return model, text


def greedy(model, k, n=16):
    dec = MTPDecoder(model, k, adaptive=False)
    return [t for t, _, _ in generate_step(PROMPT, model, decoder=dec, max_tokens=n)], dec


def mtp_logits(model):
    h = model.trunk(X)[1]
    return model.logits(model.mtp_forward(h, mx.array([PROMPT[1:] + [1]]), model.make_mtp_cache()))


def same_model(a, b, atol=1e-5) -> bool:
    return (mx.allclose(a(X), b(X), atol=atol).item()
            and mx.allclose(mtp_logits(a), mtp_logits(b), atol=atol).item())


# --------------------------------------------------------------------------
# 14: layer_types
# --------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_transformers5_config_with_layer_types_loads(family, tmp_path):
    # The tiny models alternate linear/full (interval 2); transformers 5 writes that
    # only as layer_types, so the interval default (4) would build the wrong layers.
    model, text = built(family)
    config = transformers5_config(family, text, tie=False)
    assert "full_attention_interval" not in layout.text_config(config)
    path = save_hf_checkpoint(model, family, text, tmp_path / "m", config=config,
                              tokenizer_dir=_no_tokenizer(tmp_path))
    loaded, _ = load_model(path)
    assert [l.is_linear for l in loaded.layers] == [True, False, True, False]
    assert same_model(loaded, model)


def test_non_periodic_layer_types(tmp_path, capsys):
    types = ["linear_attention", "full_attention", "full_attention", "linear_attention"]
    model, text = built("qwen3_5", layer_types=types, head="noisy")
    path = save_hf_checkpoint(model, "qwen3_5", text, tmp_path / "m",
                              tokenizer_dir=_no_tokenizer(tmp_path))
    loaded, _ = load_model(path)
    assert [l.is_linear for l in loaded.layers] == [True, False, False, True]
    assert same_model(loaded, model)
    plain, _ = greedy(loaded, 0)
    tokens, dec = greedy(loaded, 3)
    assert tokens == plain and dec.stats.num_accepted_tokens > 0
    convert(path, tmp_path / "mlx")  # converts, and says plain mlx-lm cannot load it
    assert "not periodic" in capsys.readouterr().err
    assert same_model(load_model(tmp_path / "mlx")[0], model)


@pytest.mark.parametrize("types,match", [
    (["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
     "sliding_attention"),
    (["linear_attention", "full_attention"], "lists 2 layers but num_hidden_layers is 4"),
])
def test_bad_layer_types_refused(types, match, tiny_ckpt, tmp_path):
    src = Path(tiny_ckpt("qwen3_5", "random"))
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["layer_types"] = types
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_model(dst)


@pytest.mark.parametrize("change,match", [
    ({"linear_num_value_heads": 3}, "must be a multiple"),
    ({"full_attention_interval": 0}, "full_attention_interval must be >= 1"),
    ({"mtp_use_dedicated_embeddings": True}, "--no-mtp"),
    (None, "not valid JSON"),
])
def test_unusable_config_refused(change, match, tiny_ckpt, tmp_path):
    src = Path(tiny_ckpt("qwen3_5", "random"))
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    if change is None:
        (dst / "config.json").write_text('{"model_type": "qwen3_5", ')
    else:
        config = json.loads((dst / "config.json").read_text())
        config["text_config"].update(change)
        config["text_config"].pop("layer_types", None)
        (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        load_model(dst)
    if match == "--no-mtp":
        assert load_model(dst, mtp=False)[0].num_mtp_layers == 0


# --------------------------------------------------------------------------
# 15: damaged files, missing shards and tensors, prompts with no tokens
# --------------------------------------------------------------------------

def _damage(path: Path, kind: str) -> str:
    """Damage a sharded checkpoint in place; returns the name the error must mention."""
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    if kind == "truncated":
        shard.write_bytes(data[: len(data) - 100])
    elif kind == "empty":
        shard.write_bytes(b"")
    elif kind == "garbage":
        shard.write_bytes(b"<html>404 Not Found</html>" * 20)
    elif kind == "missing_shard":
        shard.unlink()
    return shard.name


DAMAGE = ["truncated", "empty", "garbage", "missing_shard"]


@pytest.fixture
def sharded(tiny_ckpt, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(Path(tiny_ckpt("qwen3_5", "random", shards=3)), dst)
    return dst


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_is_refused_clearly(kind, sharded, tiny_ckpt, tmp_path, capsys):
    name = _damage(sharded, kind)
    with pytest.raises(ModelLoadError, match=name) as e:
        load_model(sharded)
    assert "download" in str(e.value).lower()
    with pytest.raises(ConversionError, match=name):
        convert(sharded, tmp_path / "out", verbose=False)
    assert not (tmp_path / "out").exists()

    # The CLI verbs: a message and exit 2, no traceback.
    p = cv.add_arguments(argparse.ArgumentParser())
    assert cv.run(p.parse_args(["--hf-path", str(sharded), "--mlx-path",
                                str(tmp_path / "out")])) == 2
    target = tmp_path / "target"
    convert(tiny_ckpt("qwen3_5", "random", drop_mtp=True), target, verbose=False)
    p = am.add_arguments(argparse.ArgumentParser())
    assert am.run(p.parse_args(["--model", str(target), "--source", str(sharded)])) == 2
    err = capsys.readouterr().err
    assert err.count(name) >= 2 and "Traceback" not in err


def test_generate_cli_refuses_damaged_checkpoint(sharded, capsys):
    from mlx_mtp.cli import main

    name = _damage(sharded, "truncated")
    assert main(["generate", "--model", str(sharded), "--prompt", "hi", "--max-tokens", "2",
                 "--blas", "reference"]) == 2
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err


def test_missing_per_expert_tensor_is_named(tmp_path):
    path = make_tiny(tmp_path / "m", "qwen3_5_moe", expert_layout="per_expert",
                     tokenizer_dir=_no_tokenizer(tmp_path))
    weights = mx.load(str(path / "model.safetensors"))
    gone = "model.language_model.layers.2.mlp.experts.3.up_proj.weight"
    del weights[gone]
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match="layers.2.mlp.experts.3.up_proj.weight"):
        load_model(path)
    with pytest.raises(ConversionError, match="experts.3.up_proj"):
        convert(path, tmp_path / "out", verbose=False)


def test_prompt_with_no_tokens_exits_2(tiny_ckpt, monkeypatch, capsys):
    from mlx_mtp.cli import main
    from mlx_mtp.models.io import loader

    class NoTokens:
        """A tokenizer that turns every prompt into nothing (e.g. a WordLevel vocabulary
        that misses every word)."""

        def __init__(self, inner):
            self._inner = inner

        def encode(self, *args, **kwargs):
            return []

        def __getattr__(self, name):
            return getattr(self._inner, name)

    real = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a: NoTokens(real(*a)))
    assert main(["generate", "--model", str(tiny_ckpt("qwen3_5", "random", vocab_size=4096)),
                 "--prompt", "hello", "--max-tokens", "2", "--blas", "reference"]) == 2
    err = capsys.readouterr().err
    assert "empty after tokenization" in err and "Traceback" not in err


# --------------------------------------------------------------------------
# 16: tied heads declared at the top level; flat Qwen3_5ForCausalLM conversions
# --------------------------------------------------------------------------

def test_tie_word_embeddings_only_at_top_level(tmp_path):
    model, text = built("qwen3_5", tie=True)
    config = transformers5_config("qwen3_5", text, tie=True)
    assert config["tie_word_embeddings"] and not config["text_config"]["tie_word_embeddings"]
    path = save_hf_checkpoint(model, "qwen3_5", text, tmp_path / "m", config=config,
                              tokenizer_dir=_no_tokenizer(tmp_path))
    assert "lm_head.weight" not in mx.load(str(path / "model.safetensors"))
    loaded, _ = load_model(path)
    assert "lm_head" not in loaded.language_model
    assert same_model(loaded, model)


@pytest.mark.parametrize("case", ["flat_dense", "flat_moe", "transformers5_tied"])
def test_conversion_loads_in_plain_mlx_lm(case, tmp_path):
    """docs/convert.md: convert's output loads in plain mlx-lm (which has no module for a flat
    `qwen3_5_text` config, reads only full_attention_interval and the text config's tie)."""
    import mlx_lm

    family = "qwen3_5_moe" if case == "flat_moe" else "qwen3_5"
    model, text = built(family, tie=case == "transformers5_tied")
    kw = {"nested": False} if case.startswith("flat") else {
        "config": transformers5_config(family, text, tie=True)}
    src = save_hf_checkpoint(model, family, text, tmp_path / "hf", **kw)
    if case.startswith("flat"):
        config = json.loads((src / "config.json").read_text())
        assert config["model_type"] == f"{family}_text" and "text_config" not in config
        assert not any(k.startswith("model.language_model.")
                       for k in mx.load(str(src / "model.safetensors")))
    dst = tmp_path / "mlx"
    convert(src, dst, verbose=False)
    ours, _ = load_model(dst)
    assert same_model(ours, model)
    theirs, _ = mlx_lm.load(str(dst))
    assert mx.allclose(theirs(X), model(X), atol=1e-5).item()


# --------------------------------------------------------------------------
# 17: MTP layer count aliases, model_type qwen3_5_mtp
# --------------------------------------------------------------------------

@pytest.mark.parametrize("key,where", [
    ("num_nextn_predict_layers", "text"), ("num_mtp_layers", "text"), ("n_predict", "text"),
    ("nextn_predict_layers", "text"), ("num_mtp_modules", "text"),
    ("num_nextn_predict_layers", "top"),
])
def test_mtp_layer_count_aliases(key, where, tiny_ckpt, tmp_path):
    src = Path(tiny_ckpt("qwen3_5", "random"))
    ref, _ = load_model(src)
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["text_config"]["mtp_num_hidden_layers"]
    (config["text_config"] if where == "text" else config)[key] = 1
    (dst / "config.json").write_text(json.dumps(config))
    loaded, _ = load_model(dst)
    assert loaded.num_mtp_layers == 1
    assert mx.array_equal(mtp_logits(loaded), mtp_logits(ref)).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_model_type_qwen3_5_mtp(family, tiny_ckpt, tmp_path):
    src = Path(tiny_ckpt(family, "random"))
    ref, _ = load_model(src)
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["model_type"] = "qwen3_5_mtp"
    (dst / "config.json").write_text(json.dumps(config))
    loaded, _ = load_model(dst)
    assert loaded.num_mtp_layers == 1 and layout.family(config) == family
    assert mx.array_equal(mtp_logits(loaded), mtp_logits(ref)).item()
    convert(dst, tmp_path / "mlx", verbose=False)  # written as the family plain mlx-lm knows
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["model_type"] == family
    assert mx.array_equal(load_model(tmp_path / "mlx")[0](X), ref(X)).item()


# --------------------------------------------------------------------------
# 18: the (1 + w) norm shift is decided per component
# --------------------------------------------------------------------------

def _swap_head(dst: Path, head: dict):
    """Replace ``dst``'s mtp.safetensors with ``head`` (keys ``mtp.*``)."""
    mx.save_safetensors(str(dst / "mtp.safetensors"),
                        {f"language_model.{k}": v for k, v in head.items()})


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_converted_trunk_with_raw_head(family, tiny_ckpt, tmp_path):
    """A re-export pairing an MLX trunk with the raw (zero-centred) head loads the head
    shifted, exactly like a full conversion, and drafts as well."""
    src = Path(tiny_ckpt(family, "noisy"))
    good = tmp_path / "good"
    convert(src, good, verbose=False)
    mixed = tmp_path / "mixed"
    shutil.copytree(good, mixed)
    raw = {k: v for k, v in mx.load(str(src / "model.safetensors")).items()
           if k.startswith("mtp.")}
    assert mx.mean(raw["mtp.pre_fc_norm_hidden.weight"]).item() < 0.5  # really zero-centred
    _swap_head(mixed, raw)
    a, b = load_model(good)[0], load_model(mixed)[0]
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert pa.keys() == pb.keys()
    assert all(mx.allclose(pa[k], pb[k]).item() for k in pa)
    tokens_a, dec_a = greedy(a, 2)
    tokens_b, dec_b = greedy(b, 2)
    assert tokens_a == tokens_b and dec_b.stats.num_accepted_tokens == \
        dec_a.stats.num_accepted_tokens > 0


def test_raw_trunk_with_converted_head(tiny_ckpt, tmp_path):
    """The other mix: a raw checkpoint whose head was replaced by an MLX-converted one is
    not shifted twice."""
    src = Path(tiny_ckpt("qwen3_5", "noisy"))
    conv = tmp_path / "conv"
    convert(src, conv, verbose=False)
    mixed = tmp_path / "mixed"
    shutil.copytree(src, mixed)
    weights = {k: v for k, v in mx.load(str(mixed / "model.safetensors")).items()
               if not k.startswith("mtp.")}
    weights.update({k[len("language_model."):]: v
                    for k, v in mx.load(str(conv / "mtp.safetensors")).items()})
    mx.save_safetensors(str(mixed / "model.safetensors"), weights)
    ref, out = load_model(src)[0], load_model(mixed)[0]
    assert mx.array_equal(mtp_logits(ref), mtp_logits(out)).item()


def test_norm_form_statistic_ignores_final_and_qk_norms():
    """Trained final and q/k norms can sit far from 0 even when zero-centred: the decision
    rests on the layer and pre-fc norms."""
    raw = {"mtp.layers.0.input_layernorm.weight": mx.full((8,), 0.05),
           "mtp.layers.0.post_attention_layernorm.weight": mx.full((8,), -0.1),
           "mtp.pre_fc_norm_hidden.weight": mx.full((8,), 0.2),
           "mtp.pre_fc_norm_embedding.weight": mx.full((8,), 0.0),
           "mtp.norm.weight": mx.full((8,), 4.0),
           "mtp.layers.0.self_attn.q_norm.weight": mx.full((4,), 1.2)}
    applied = {k: v + 1 for k, v in raw.items()}
    assert layout.norms_zero_centred(raw, list(raw)) is True
    assert layout.norms_zero_centred(applied, list(applied)) is False


def test_implausibly_low_acceptance_warns_once(caplog):
    layout._warned.discard("test-model")
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        assert not check_acceptance(layout.WARMUP_DRAFT_TOKENS - 1, 0, "test-model")  # warm-up
        assert not check_acceptance(200, 120, "test-model")  # 60%: fine
        assert check_acceptance(200, 1, "test-model")
        assert check_acceptance(400, 2, "test-model")
    warnings = [r for r in caplog.records if "MTP acceptance is 0.5%" in r.getMessage()]
    assert len(warnings) == 1 and "add-mtp" in warnings[0].getMessage()


# --------------------------------------------------------------------------
# The one writer
# --------------------------------------------------------------------------

def test_writer_shards_index_and_atomic_replace(tmp_path):
    w = {f"model.layers.{i}.w": mx.full((4,), i, mx.float32) for i in range(5)}
    w["mtp.fc.weight"] = mx.ones((2, 2))
    out = tmp_path / "ckpt"
    (out).mkdir()
    (out / "stale.safetensors").write_bytes(b"old")
    write_checkpoint(out, dict(w), {"model_type": "qwen3_5"}, num_shards=2,
                     extra_files={"note.txt": "hi"})
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                     "mtp.safetensors", "note.txt"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["mtp.fc.weight"] == "mtp.safetensors" and len(index) == len(w)
    read = {}
    for f in out.glob("*.safetensors"):
        read.update(mx.load(str(f)))
    assert all(mx.array_equal(read[k], w[k]).item() for k in w)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging left
    # One file: no index.
    write_checkpoint(out, dict(w), {"model_type": "qwen3_5"}, mtp_file=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_generation_warns_when_head_accepts_nothing(tiny_ckpt, caplog):
    """End to end: a head that accepts ~nothing (here a random one, as a head read in the
    wrong norm layout behaves) is reported once the warm-up has passed."""
    from mlx_mtp.decode.generation import stream_generate
    from mlx_mtp.models.io.loader import load_model, load_tokenizer

    # The tiny model embeds 512 ids, fewer than its tokenizer's: load() refuses the pair,
    # so the test takes both parts and feeds ids in range.
    path = Path(tiny_ckpt("qwen3_5", "random"))
    model, config = load_model(path)
    tokenizer = load_tokenizer(path, config)
    layout._warned.discard(model.model_type)
    with caplog.at_level(logging.WARNING, logger="mlx_mtp"):
        # Token ids, not text: the tiny model's vocabulary (512) is smaller than the
        # tokenizer's, and an out-of-range id would read past the embedding table.
        for r in stream_generate(model, tokenizer, [5, 17, 42, 99, 7], max_tokens=40,
                                 num_draft_tokens=3, adaptive=False):
            pass
    assert r.spec.num_draft_tokens >= layout.WARMUP_DRAFT_TOKENS
    assert sum("MTP acceptance is" in rec.getMessage() for rec in caplog.records) == 1


def test_completion_prompt_with_no_tokens_is_a_400():
    from types import SimpleNamespace

    from mlx_mtp.server.prompts import prepare_completion
    from mlx_mtp.server.protocol import APIError, CompletionRequest

    class NoTokens:
        bos_token = None

        def encode(self, *args, **kwargs):
            return []

    state = SimpleNamespace(max_chars_per_token=0, context_length=4096, vocab_size=512)
    with pytest.raises(APIError) as e:
        prepare_completion(state, CompletionRequest(prompt="hello"), NoTokens())
    assert e.value.status == 400 and "empty after tokenization" in str(e.value)
