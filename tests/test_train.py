"""``mlx-mtp train`` and the shipped demo model (small and fast)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_mtp.train import trainer as T
from mlx_mtp.models.io.loader import DEFAULT_MODEL, load, load_model

CODE = '''
def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    f = d / "code.py"
    f.write_text(CODE * 40)
    return f


def _cfg(tmp_path, corpus, **kw):
    base = dict(mode="scratch", corpus=str(corpus), out=str(tmp_path / "run"), size="tiny",
                steps=12, batch_size=4, seq_len=64, lr=3e-3, warmup=2, save_every=0,
                eval_every=0, progress=False, compile=True)
    base.update(kw)
    return T.TrainConfig(**base)


def _fixed_losses(trainer, n=2):
    out = []
    for i in range(n):
        b = mx.array(T.sample_batch(trainer.train_tokens, 4, 65, 123, i))
        ce, mtp = T.scratch_losses(trainer.model, b)
        out.append((ce.item(), mtp.item()))
    return np.mean(out, axis=0)


def _logits(model, tokens):
    text = model.text
    x = mx.array([tokens])
    h, h_mtp = text.trunk(x)
    m = text.mtp_forward(h_mtp[:, :-1], x[:, 1:], None)
    return np.array(text.logits(h)), np.array(text.logits(m))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("scratch")
    tr = T.Trainer(_cfg(tmp, corpus))
    before = _fixed_losses(tr)
    res = tr.run()
    after = _fixed_losses(tr)
    return tr, before, after, res


def test_scratch_steps_lower_both_losses(trained):
    tr, before, after, res = trained
    assert res["step"] == 12
    assert after[0] < before[0] - 0.3, (before, after)  # next-token CE
    assert after[1] < before[1] - 0.3, (before, after)  # MTP (t+2) CE
    assert Path(res["png"]).exists()
    rows = T.read_metrics(tr.metrics_path)
    assert len([r for r in rows if r["kind"] == "train"]) == 12


@pytest.mark.parametrize("layout", ["hf", "mlx"])
def test_saved_checkpoint_loads_with_identical_logits(trained, layout):
    tr, *_ = trained
    path = tr.run_dir / layout
    assert (path / "generation_config.json").exists() and (path / "tokenizer.json").exists()
    weights = mx.load(str(path / "model.safetensors"))
    if layout == "hf":
        assert any(k.startswith("mtp.") for k in weights)
        assert any(k.startswith("model.language_model.") for k in weights)
        # Zero-centred (1 + w) norms and the HF conv1d axis order.
        assert abs(float(weights["mtp.norm.weight"].mean())) < 0.5
        conv = [v for k, v in weights.items() if k.endswith("conv1d.weight")][0]
        assert conv.shape[1] == 1 and conv.shape[2] == 4
        assert json.loads((path / "config.json").read_text())["text_config"][
            "mtp_num_hidden_layers"] == 1
    loaded, _ = load_model(path)
    tr.model.eval()
    tokens = list(range(100, 170))
    a, am = _logits(tr.model, tokens)
    b, bm = _logits(loaded, tokens)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(am, bm)


def test_resume_continues_from_checkpoint(tmp_path, corpus):
    cfg = _cfg(tmp_path, corpus, steps=4, save_every=2)
    T.Trainer(cfg).run()
    tr2 = T.Trainer(_cfg(tmp_path, corpus, steps=6, save_every=2, resume=True))
    assert tr2.step == 4
    assert tr2.optimizer.state["step"].item() == 4
    tr2.run()
    assert tr2.step == 6


def test_head_mode_changes_only_mtp_weights(tmp_path, trained, corpus):
    tr, *_ = trained
    src = tr.run_dir / "hf"
    base, _ = load_model(src)
    before = dict(tree_flatten(base.parameters()))
    head = T.Trainer(T.TrainConfig(mode="head", model=str(src), corpus=str(corpus),
                                   out=str(tmp_path / "head"), steps=4, batch_size=2,
                                   seq_len=64, lr=3e-3, warmup=1, save_every=0,
                                   eval_every=0, progress=False))
    h0 = {k: np.array(v) for k, v in tree_flatten(head.model.parameters())
          if ".mtp." in k}
    head.run()
    out, _ = load_model(tmp_path / "head" / "hf")
    after = dict(tree_flatten(out.parameters()))
    assert before.keys() == after.keys()
    changed = {k for k in before if not np.array_equal(np.array(before[k]), np.array(after[k]))}
    assert changed and all(".mtp." in k for k in changed), sorted(changed)[:5]
    # The new head was trained (moved from its fresh init).
    trained_head = dict(tree_flatten(head.model.parameters()))
    assert any(not np.array_equal(h0[k], np.array(trained_head[k])) for k in h0)


def test_head_mode_requires_model(tmp_path, corpus):
    from mlx_mtp.options import UserError

    with pytest.raises(UserError):
        T.Trainer(T.TrainConfig(mode="head", corpus=str(corpus), out=str(tmp_path / "x")))


def test_cli_train_smoke(tmp_path, corpus):
    from mlx_mtp.cli import main

    rc = main(["train", "--size", "tiny", "--corpus", str(corpus), "--out",
               str(tmp_path / "cli"), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
               "--no-progress", "--save-every", "0", "--eval-every", "0"])
    assert rc == 0
    assert (tmp_path / "cli" / "hf" / "model.safetensors").exists()
    assert (tmp_path / "cli" / "mlx" / "model.safetensors").exists()
    assert main(["train", "--corpus", str(tmp_path / "missing"), "--out",
                 str(tmp_path / "bad")]) == 2


# --- the demo corpus builder ----------------------------------------------------


def _fake_dist(root, name, license_line, files):
    d = root / f"{name}-1.0.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                f"{license_line}\n\nLicense: not a header after the blank line\n")
    rows = []
    for rel in files:
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"# {rel}\nx = 1\n")
        rows.append(f"{rel},sha256=x,10")
    (d / "RECORD").write_text("\n".join(rows) + "\n")
    return d


def test_corpus_builder_licenses_files_and_split(tmp_path):
    from mlx_mtp.train import corpus as C

    sp = tmp_path / "site"
    _fake_dist(sp, "okpkg", "License-Expression: MIT",
               ["okpkg/__init__.py", "okpkg/core.py", "okpkg/tests/test_core.py",
                "okpkg/_vendor/six.py", "okpkg/data.json"])
    _fake_dist(sp, "mplpkg", "License: MPL-2.0", ["mplpkg/__init__.py"])
    _fake_dist(sp, "clspkg", "Classifier: License :: OSI Approved :: BSD License",
               ["clspkg/a.py"])
    entries, record = C.collect(sp)
    keys = {k for k, _ in entries if k.startswith("site-packages/")}
    assert keys == {"site-packages/okpkg/__init__.py", "site-packages/okpkg/core.py",
                    "site-packages/clspkg/a.py"}
    by_name = {r["name"]: r for r in record}
    assert by_name["okpkg"]["included"] and by_name["okpkg"]["license"] == "MIT"
    assert not by_name["mplpkg"]["included"]
    assert by_name["mplpkg"]["reason"] == "license not permissive"
    assert by_name["clspkg"]["included"]
    # Deterministic split by relative path (same rule as the stdlib split).
    from mlx_mtp.train.tokenizer_build import _split_of
    for rel in ("json/decoder.py", "okpkg/core.py", "a/b/c.py"):
        assert C.split_of(rel) == _split_of(rel)


# --- the shipped demo model -----------------------------------------------------


def test_demo_model_loads_generates_and_mtp_is_lossless():
    from mlx_mtp.decode.sampling import SamplingParams
    from mlx_mtp.decode.speculative import generate_step

    size = sum(f.stat().st_size for f in DEFAULT_MODEL.iterdir())
    assert size <= 40 * 1000 * 1000  # the package budget for the demo model (issue 13)
    model, tok = load()
    assert model.num_mtp_layers == 1
    prompt = tok.encode("import os\n\n\ndef read_lines(path):\n    ")
    outs = {}
    for k in (0, 2):
        outs[k] = [t for t, _, _ in generate_step(prompt, model, num_draft_tokens=k,
                                                  sampling=SamplingParams(), max_tokens=24,
                                                  adaptive=False)]
    assert len(outs[0]) == 24
    assert outs[2] == outs[0]
    assert isinstance(tok.decode(outs[0]), str)
