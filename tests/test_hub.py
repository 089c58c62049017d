"""Hub ids (``org/name[@revision]``) against a stand-in Hub (tests/hub_server.py): the
commands run as users run them (subprocesses with ``HF_ENDPOINT`` pointed at the stand-in,
``HF_HOME`` in a temporary directory), nothing mocked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import StandInHub, start  # noqa: E402

PROMPT = ["--prompt", "def f():", "-m", "10", "--temp", "0", "--verbose", "False"]


@pytest.fixture(scope="module")
def stand_in(tiny_ckpt):
    hub = StandInHub()
    server, _ = start(hub)
    model = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096)
    extra = Path(model).parent / "with-extras"
    if not extra.exists():
        extra.mkdir()
        for f in Path(model).iterdir():
            (extra / f.name).symlink_to(f)
        (extra / "README.md").write_text("model card")
        (extra / "pytorch_model.bin").write_bytes(b"\0" * 1000)  # never needed
    hub.add_repo("org/tiny", extra)
    hub.add_repo("org/gated", model, gated=True)
    hub.model = Path(model)
    yield hub
    server.shutdown()


@pytest.fixture(scope="module")
def local_output(stand_in, tmp_path_factory):
    """``generate`` on the tiny model's local path: what every hub route must print."""
    code, out, err = cli(env_for(stand_in, tmp_path_factory.mktemp("hf")), "generate",
                         "--model", str(stand_in.model), *PROMPT)
    assert code == 0 and out.strip(), err
    return out


def env_for(hub, home, **extra):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(home),
               HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    for k in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        env.pop(k, None)
    env.update(extra)
    return env


def cli(env, *args):
    p = subprocess.run([sys.executable, "-m", "mlx_mtp.cli", *args], env=env,
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_hub_id_generates_as_the_local_path_and_fetches_only_what_it_needs(stand_in, tmp_path,
                                                                          local_output):
    env = env_for(stand_in, tmp_path / "hf")
    local = local_output
    code, hub_out, err = cli(env, "generate", "--model", "org/tiny", *PROMPT)
    assert code == 0, err
    assert hub_out == local
    fetched = stand_in.downloads("org/tiny")
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert "README.md" not in fetched and "pytorch_model.bin" not in fetched
    # Pinned to a commit: same files, read from the cache (no download again).
    n = len(stand_in.downloads())
    commit = stand_in.repos["org/tiny"].commit
    code, pinned, err = cli(env, "generate", "--model", f"org/tiny@{commit}", *PROMPT)
    assert code == 0, err
    assert pinned == local and len(stand_in.downloads()) == n


def fill(env, patterns: str):
    """Download org/tiny's files matching ``patterns`` into the cache, as a command would."""
    code = f"from mlx_mtp.models.io import hub; hub.snapshot('org/tiny', {patterns})"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_offline_reads_the_cache_and_says_what_to_do_when_it_cannot(stand_in, tmp_path,
                                                                   local_output):
    home = tmp_path / "hf"
    code, _, err = cli(env_for(stand_in, home, HF_HUB_OFFLINE="1"), "generate", "--model",
                       "org/tiny", *PROMPT)
    assert code == 2 and "Traceback" not in err
    assert "HF_HUB_OFFLINE" in err and "hf download org/tiny" in err
    # A cache holding only what draft-vocab fetches (no weights) is not enough.
    fill(env_for(stand_in, home), "hub.TOKENIZER_FILES")
    code, _, err = cli(env_for(stand_in, home, HF_HUB_OFFLINE="1"), "generate", "--model",
                       "org/tiny", *PROMPT)
    assert code == 2 and "not (completely) in the Hugging Face cache" in err, err
    # Fill the cache online, then go offline: no request reaches the Hub.
    fill(env_for(stand_in, home), "hub.MODEL_FILES")
    n = len(stand_in.requests)
    code, offline, err = cli(env_for(stand_in, home, HF_HUB_OFFLINE="1"), "generate",
                             "--model", "org/tiny", *PROMPT)
    assert code == 0, err
    assert offline == local_output and len(stand_in.requests) == n


@pytest.mark.parametrize("model,words", [
    ("org/missing", ["neither a local directory nor a model on the Hub", "hf auth login"]),
    ("org/gated", ["gated", "accept its licence", "HF_TOKEN"]),
    ("org/tiny@v9", ["has no revision 'v9'"]),
    ("no/such/dir", ["does not exist", "org/name"]),
])
def test_unresolvable_ids_exit_2_with_what_to_do(stand_in, tmp_path, model, words):
    code, _, err = cli(env_for(stand_in, tmp_path / "hf"), "generate", "--model", model,
                       *PROMPT)
    assert code == 2 and "Traceback" not in err, err
    assert all(w in err for w in words), err


@pytest.mark.parametrize("where", ["HF_TOKEN", "token file"])
def test_gated_model_with_a_token_from_the_usual_places(stand_in, tmp_path, where):
    home = tmp_path / "hf"
    home.mkdir()
    if where == "HF_TOKEN":
        env = env_for(stand_in, home, HF_TOKEN="hf_from_env")
    else:  # what `hf auth login` writes
        (home / "token").write_text("hf_from_file")
        env = env_for(stand_in, home)
    first = len(stand_in.requests)
    code, out, err = cli(env, "generate", "--model", "org/gated", *PROMPT)
    assert code == 0, err
    sent = {r.authorization for r in stand_in.requests[first:]}
    assert sent == {"Bearer " + ("hf_from_env" if where == "HF_TOKEN" else "hf_from_file")}


def test_unreachable_hub_says_so(stand_in, tmp_path):
    env = env_for(stand_in, tmp_path / "hf", HF_ENDPOINT="http://127.0.0.1:9")  # nothing there
    code, _, err = cli(env, "generate", "--model", "org/tiny", *PROMPT)
    assert code == 2 and "Traceback" not in err
    assert "Could not download org/tiny" in err and "network" in err


def test_dropped_connection_resumes_with_a_range_request(stand_in, tiny_ckpt, tmp_path):
    # huggingface_hub writes in 10 MiB chunks: a resume point needs a file past one chunk.
    model = tiny_ckpt("qwen3_5", "oracle", trunk_scale=0.1, vocab_size=4096, hidden=256)
    stand_in.add_repo("org/wide", model)
    size = (model / "model.safetensors").stat().st_size
    cut = (10 << 20) + 12345
    assert size > cut
    stand_in.drop_after["model.safetensors"] = cut
    first = len(stand_in.requests)
    env = env_for(stand_in, tmp_path / "hf")
    code, out, err = cli(env, "generate", "--model", "org/wide", *PROMPT)
    assert code == 0, err
    gets = [r for r in stand_in.requests[first:] if r.method == "GET"
            and r.path.endswith("/model.safetensors")]
    assert [r.range for r in gets] == [None, f"bytes={10 << 20}-"]
    assert sum(r.bytes_sent for r in gets) == size + 12345  # only the unwritten chunk again
    code, local, err = cli(env, "generate", "--model", str(model), *PROMPT)
    assert out == local


def test_convert_and_draft_vocab_take_hub_ids(stand_in, tmp_path, local_output):
    env = env_for(stand_in, tmp_path / "hf")
    out = tmp_path / "converted"
    code, _, err = cli(env, "convert", "--hf-path", "org/tiny", "--mlx-path", str(out))
    assert code == 0, err
    assert (out / "mtp.safetensors").exists()
    code, converted, err = cli(env, "generate", "--model", str(out), *PROMPT)
    assert code == 0 and converted == local_output, err
    # draft-vocab reads the tokenizer only, and never writes into the cache.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f():\n    return 1\n" * 20)
    code, _, err = cli(env, "draft-vocab", "--model", "org/tiny", "--corpus", str(corpus))
    assert code == 2 and "--output" in err
    ranking = tmp_path / "ranking.json"
    code, _, err = cli(env, "draft-vocab", "--model", "org/tiny", "--corpus", str(corpus),
                       "--output", str(ranking))
    assert code == 0 and ranking.exists(), err


def test_split_drafter_pair_from_the_hub(stand_in, tmp_path):
    from mlx_mtp.convert.main import convert

    trunk, drafter = tmp_path / "Tiny-4bit", tmp_path / "Tiny-MTP-4bit"
    convert(stand_in.model, trunk, quantize=True, mtp_bits=8, split_mtp=drafter, verbose=False)
    merged = tmp_path / "merged"
    convert(stand_in.model, merged, quantize=True, mtp_bits=8, verbose=False)
    stand_in.add_repo("org/Tiny-4bit", trunk)
    stand_in.add_repo("org/Tiny-MTP-4bit", drafter)
    env = env_for(stand_in, tmp_path / "hf")
    code, local, err = cli(env, "generate", "--model", str(merged), *PROMPT)
    assert code == 0, err
    code, pair, err = cli(env, "generate", "--model", "org/Tiny-4bit", "--mtp-model",
                          "org/Tiny-MTP-4bit", *PROMPT)
    assert code == 0, err
    assert pair == local


QWEN3_8_TEXT = {  # the fields of a Qwen3.8-27B-style text config (qwen3_5, one MTP layer)
    "model_type": "qwen3_5_text", "attn_output_gate": True, "dtype": "bfloat16",
    "hidden_act": "silu", "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"] * 2,
    "full_attention_interval": 4, "eos_token_id": 7, "bos_token_id": None,
}


def qwen3_8_style(path: Path) -> Path:
    """A tiny checkpoint laid out as the Qwen3.8 release: multimodal config with a vision
    tower, explicit layer_types, bf16 weights, one MTP layer (oracle head)."""
    import mlx.core as mx

    from mlx_mtp.models.io.layout import hf_config
    from mlx_mtp.testing.tiny import (build_model, make_oracle, save_hf_checkpoint,
                                      tiny_text_config)

    text = tiny_text_config("qwen3_5", vocab_size=4096, num_layers=8)
    text.update(QWEN3_8_TEXT)
    text["rope_parameters"].update(rope_theta=10_000_000.0)
    model = build_model("qwen3_5", text)
    make_oracle(model, 0.1, 0.0)
    config = hf_config("qwen3_5", text)
    config.update(image_token_id=4090, video_token_id=4091, vision_start_token_id=4092,
                  vision_end_token_id=4093, transformers_version="5.24.0",
                  vision_config={"model_type": "qwen3_5", "depth": 2, "hidden_size": 32,
                                 "out_hidden_size": 64, "num_heads": 2, "patch_size": 16})
    return save_hf_checkpoint(model, "qwen3_5", text, path, config=config, dtype=mx.bfloat16)


def test_qwen3_8_style_config_loads_and_decodes_as_mlx_lm(stand_in, tmp_path):
    import mlx.core as mx
    from mlx_lm.generate import generate_step as lm_generate_step
    from mlx_lm.utils import load_model as lm_load_model

    from mlx_mtp.decode.speculative import MTPDecoder, generate_step
    from mlx_mtp.models.io.loader import load_model

    path = qwen3_8_style(tmp_path / "Qwen3.8-tiny")
    prompt = [3, 17, 42, 99, 7, 250, 11, 5]
    lm_model, _ = lm_load_model(path)
    reference = [int(t) for t, _ in lm_generate_step(mx.array(prompt), lm_model, max_tokens=12)]
    model, _ = load_model(path, dtype=None)
    assert model.num_mtp_layers == 1
    for k in (0, 1, 3):
        dec = MTPDecoder(model, k, adaptive=False)
        tokens = [t for t, _, _ in generate_step(prompt, model, decoder=dec, max_tokens=12)]
        assert tokens == reference, f"K={k}"
        assert k == 0 or dec.stats.num_accepted_tokens > 0
    stand_in.add_repo("Qwen/Qwen3.8-tiny", path)
    env = env_for(stand_in, tmp_path / "hf")
    code, hub_out, err = cli(env, "generate", "--model", "Qwen/Qwen3.8-tiny", *PROMPT)
    assert code == 0, err
    code, local, err = cli(env, "generate", "--model", str(path), *PROMPT)
    assert code == 0 and hub_out == local, err
