"""``--dtype auto`` from this machine's measured costs (models/io/dtype_timing.py): the
choice is a function of the stored figures, measured once and reused, an explicit dtype
wins, split loads and a forbidden measurement fall back to the static rule, bad files are
ignored, and ``doctor`` shows the choice and its figures.

The conftest forbids measuring (``MLX_MTP_MEASURE_DTYPE=0``); tests that measure opt in,
at the tiny checkpoint's shape (a few milliseconds)."""

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.cli import main
from mlx_mtp.models.io import dtype_timing, loader
from mlx_mtp.models.io.dtype_timing import DtypeTiming, ShapeClass
from mlx_mtp.models.io.layout import hf_config
from mlx_mtp.models.split_plan import open_lazily
from mlx_mtp.testing.tiny import make_tiny, tiny_text_config

STATIC = "float32 (auto: bfloat16 upcast, float32 copy "  # the static rule's reason


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return Path(make_tiny(tmp_path_factory.mktemp("bf16"), "qwen3_5", "random",
                          dtype=mx.bfloat16))


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def measurements(monkeypatch):
    """Measuring allowed; the shapes measured, in order."""
    monkeypatch.setenv(dtype_timing.ENV_MEASURE, "1")
    done, real = [], dtype_timing.measure

    def counted(shape, *a, **kw):
        done.append(shape)
        return real(shape, *a, **kw)

    monkeypatch.setattr(dtype_timing, "measure", counted)
    return done


@pytest.fixture
def no_measuring(monkeypatch):
    """Measuring allowed by the environment, but any measurement fails the test."""
    monkeypatch.setenv(dtype_timing.ENV_MEASURE, "1")

    def refuse(shape, *a, **kw):
        raise AssertionError(f"measured {shape} although figures are stored")

    monkeypatch.setattr(dtype_timing, "measure", refuse)


def shape_of(path: Path) -> ShapeClass:
    config = loader.model_config(path)
    model = loader.build_model(config)
    return loader.auto_shape(loader.loadable_weights(model, path, config), model)


def store(path: Path, f32_ms, half_ms) -> ShapeClass:
    shape = shape_of(path)
    seconds = {"float32": dict(zip(dtype_timing.ROWS, (1e-3 * t for t in f32_ms))),
               "bfloat16": dict(zip(dtype_timing.ROWS, (1e-3 * t for t in half_ms)))}
    assert dtype_timing.save(DtypeTiming(shape, seconds))
    return shape


def weights_dtype(model):
    return model.language_model.model.embed_tokens.weight.dtype


def test_the_shape_class_is_the_model_s_width_and_size(bf16_ckpt):
    config = loader.model_config(bf16_ckpt)
    shape = shape_of(bf16_ckpt)
    assert shape.half == "bfloat16" and shape.hidden == config["text_config"]["hidden_size"]
    # A Qwen3.5-0.8B-wide model (lazy, never evaluated) is measured at the cap.
    wide = loader.build_model(hf_config("qwen3_5", tiny_text_config(
        "qwen3_5", hidden=1024, num_layers=2, vocab_size=248320)))
    floats = [v.astype(mx.bfloat16) for _, v in tree_flatten(wide.parameters())]
    big = ShapeClass.of(floats, "bfloat16")
    assert big == ShapeClass("bfloat16", 1024, dtype_timing.MAX_BYTES // (4 * 1024))


def test_stored_figures_decide_and_the_choice_is_deterministic(bf16_ckpt, no_measuring):
    store(bf16_ckpt, f32_ms=(1.0, 1.2), half_ms=(2.0, 4.0))
    choices = [loader.load_model(bf16_ckpt, dtype="auto")[0] for _ in range(2)]
    for model in choices:
        assert model.load_dtype == mx.float32 and weights_dtype(model) == mx.float32
        assert model.dtype_choice.startswith("float32 (auto: bfloat16 upcast, measured here: ")
        assert "1 row 1.00 vs 2.00 ms, 4 rows 1.20 vs 4.00 ms" in model.dtype_choice
    store(bf16_ckpt, f32_ms=(2.0, 4.0), half_ms=(1.0, 4.0))  # float32 not 5 % faster
    for _ in range(2):
        model, _ = loader.load_model(bf16_ckpt, dtype="auto")
        assert model.load_dtype is None and weights_dtype(model) == mx.bfloat16
        assert model.dtype_choice.startswith("bfloat16 as stored (auto: measured here: ")


def test_a_measurement_is_stored_and_reused(bf16_ckpt, measurements):
    first, _ = loader.load_model(bf16_ckpt, dtype="auto")
    assert measurements == [shape_of(bf16_ckpt)]
    assert dtype_timing.timing_file(measurements[0]).exists()
    assert dtype_timing.stored(measurements[0]).load is not None  # for doctor to show
    assert "(auto: " in first.dtype_choice and "measured here: " in first.dtype_choice
    for _ in range(2):
        again, _ = loader.load_model(bf16_ckpt, dtype="auto")
        assert again.dtype_choice == first.dtype_choice and again.load_dtype == first.load_dtype
    assert len(measurements) == 1


def test_an_explicit_dtype_wins(bf16_ckpt, no_measuring):
    store(bf16_ckpt, f32_ms=(2.0, 4.0), half_ms=(1.0, 1.0))  # bf16 faster
    model, _ = loader.load_model(bf16_ckpt, dtype="float32")
    assert model.load_dtype == mx.float32 and model.dtype_choice == "float32 (requested)"
    store(bf16_ckpt, f32_ms=(1.0, 1.0), half_ms=(2.0, 4.0))  # float32 faster
    model, _ = loader.load_model(bf16_ckpt, dtype="bfloat16")
    assert weights_dtype(model) == mx.bfloat16 and model.dtype_choice == "bfloat16 (requested)"


def test_without_figures_or_permission_the_static_rule_decides(bf16_ckpt, cache_home,
                                                                monkeypatch):
    model, _ = loader.load_model(bf16_ckpt, dtype="auto")  # the conftest forbids measuring
    assert model.dtype_choice.startswith(STATIC)
    assert not list(cache_home.rglob("dtype-*.json"))
    monkeypatch.setenv(dtype_timing.ENV_MEASURE, "1")
    blocked = cache_home / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # nowhere to store: no measuring
    assert not dtype_timing.measuring_allowed()
    model, _ = loader.load_model(bf16_ckpt, dtype="auto")
    assert model.dtype_choice.startswith(STATIC)


def test_a_split_load_follows_the_rule_on_every_rank(bf16_ckpt, no_measuring):
    store(bf16_ckpt, f32_ms=(2.0, 4.0), half_ms=(1.0, 1.0))
    model, _ = open_lazily(bf16_ckpt, dtype="auto")
    assert model.dtype_choice.startswith(STATIC)


@pytest.mark.parametrize("content", [
    "{not json", "[]", json.dumps({"format": "mlx-mtp-dtype-timing-0", "shape": {},
                                   "seconds": {}}),
    "bad figures", "another shape"])
def test_corrupt_or_old_files_are_ignored_and_replaced(bf16_ckpt, measurements, monkeypatch,
                                                       content):
    shape = store(bf16_ckpt, f32_ms=(1.0, 1.0), half_ms=(2.0, 2.0))
    path = dtype_timing.timing_file(shape)
    data = json.loads(path.read_text())
    if content == "bad figures":
        data["seconds"]["float32"]["4"] = -1.0
        content = json.dumps(data)
    elif content == "another shape":
        data["shape"]["hidden"] += 1
        content = json.dumps(data)
    path.write_text(content)
    assert dtype_timing.stored(shape) is None
    monkeypatch.setenv(dtype_timing.ENV_MEASURE, "0")
    model, _ = loader.load_model(bf16_ckpt, dtype="auto")
    assert model.dtype_choice.startswith(STATIC) and not measurements
    monkeypatch.setenv(dtype_timing.ENV_MEASURE, "1")
    loader.load_model(bf16_ckpt, dtype="auto")
    assert measurements == [shape] and dtype_timing.stored(shape) is not None


def test_doctor_shows_the_choice_and_its_figures(bf16_ckpt, capsys, no_measuring):
    shape = store(bf16_ckpt, f32_ms=(1.0, 1.5), half_ms=(3.0, 6.0))
    assert main(["doctor", "--no-measure", "--model", str(bf16_ckpt)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("dtype auto"))
    assert str(bf16_ckpt) in line and "float32 (auto: bfloat16 upcast, measured here: " in line
    assert "1 row 1.00 vs 3.00 ms, 4 rows 1.50 vs 6.00 ms" in line
    assert f"{dtype_timing.timing_file(shape)} (measured at load ?; delete it" in out
    assert main(["doctor", "--no-measure", "--json", "--model", str(bf16_ckpt)]) == 0
    report = json.loads(capsys.readouterr().out)["dtype"]
    assert report["dtype"] == "float32" and report["file"] == str(dtype_timing.timing_file(shape))
    assert report["measured_shape"] == {"half": "bfloat16", "hidden": shape.hidden,
                                        "outputs": shape.outputs}
    assert report["seconds"] == {"float32": {"1": 0.001, "4": 0.0015},
                                 "bfloat16": {"1": 0.003, "4": 0.006}}


def test_doctor_without_figures_names_the_static_rule(bf16_ckpt, capsys):
    assert main(["doctor", "--no-measure", "--model", str(bf16_ckpt)]) == 0
    out = capsys.readouterr().out
    assert STATIC in out and "none stored: the static rule decides" in out


def test_doctor_refuses_a_missing_model_in_one_line(tmp_path, capsys):
    assert main(["doctor", "--no-measure", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1 and "Traceback" not in err
