"""Checkpoints of MTP model types mlx-mtp cannot run yet (``models.NOT_YET``) are refused by
every verb with one line naming the ``model_type`` and what is missing, exit code 2, no
traceback, before any weight is read."""

import json

import mlx.core as mx
import pytest

from mlx_mtp import cli
from mlx_mtp.models import MODEL_TYPES, NOT_YET, UnsupportedModelError, get_model_module

VERBS = {
    "generate": lambda d, tmp: ["generate", "--model", str(d), "-p", "hi", "-m", "2"],
    "generate --no-mtp": lambda d, tmp: ["generate", "--model", str(d), "-p", "hi", "--no-mtp"],
    "inspect": lambda d, tmp: ["inspect", str(d)],
    "convert": lambda d, tmp: ["convert", "--hf-path", str(d), "--mlx-path", str(tmp / "out")],
    "serve": lambda d, tmp: ["serve", "--model", str(d), "--port", "1"],
}


def checkpoint(path, model_type: str, text: bool = False):
    """A config of ``model_type`` (or a VLM wrapper of its ``*_text`` config) and one tensor."""
    config = {"model_type": model_type, "hidden_size": 8, "num_hidden_layers": 1,
              "num_nextn_predict_layers": 1}
    if text:
        config = {"model_type": model_type, "text_config": dict(config,
                                                                model_type=model_type + "_text")}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"),
                        {"model.embed_tokens.weight": mx.zeros((4, 8))})
    return path


@pytest.mark.parametrize("verb", sorted(VERBS))
@pytest.mark.parametrize("model_type", ["inkling", "mistral_large4"])
def test_every_verb_refuses_in_one_line(capsys, tmp_path, model_type, verb):
    ckpt = checkpoint(tmp_path / "ckpt", model_type)
    code = cli.main(VERBS[verb](ckpt, tmp_path))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"model_type {model_type!r} is not supported by mlx-mtp yet" in err
    assert NOT_YET[model_type] in err
    assert not (tmp_path / "out").exists()


def test_refusal_names_a_missing_trunk():
    with pytest.raises(UnsupportedModelError, match="needs a trunk mlx-lm 0.32 lacks"):
        get_model_module("inkling")


def test_text_config_of_a_wrapper_is_refused_too(capsys, tmp_path):
    ckpt = checkpoint(tmp_path / "ckpt", "inkling", text=True)
    assert cli.main(["generate", "--model", str(ckpt), "-p", "hi"]) == 2
    assert "'inkling'" in capsys.readouterr().err
    with pytest.raises(UnsupportedModelError, match="'inkling_text' is not supported"):
        get_model_module("inkling_text")


def test_no_type_is_both_supported_and_refused():
    assert not set(NOT_YET) & set(MODEL_TYPES)
