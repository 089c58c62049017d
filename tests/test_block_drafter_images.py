"""Image prompts with a block drafter are refused, clearly: prefill runs them through
``trunk_with_images``, which does not tap, so the drafter's context would miss those rows.
The CLI exits 2 with one line; a server request gets a 400 in the API's error shape (on the
tiny Qwen3.5-VL fixture of ``test_vision.py``, with a tiny DFlash drafter attached)."""

import base64
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mlx_mtp.decode.block_context import NO_IMAGES
from mlx_mtp.drafters.block.load import attach_block_drafter
from mlx_mtp.models.io.loader import load
from mlx_mtp.server.app import create_app
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.images import ImageInputs
from mlx_mtp.server.state import ServerState
from mlx_mtp.testing.tiny_block import make_tiny_dflash

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_5_vl"
CKPT = FIXTURE / "checkpoint"


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    config = json.loads((CKPT / "config.json").read_text())["text_config"]
    return make_tiny_dflash(tmp_path_factory.mktemp("vl_dflash"), config["hidden_size"],
                            config["vocab_size"], [0, 2], config["num_hidden_layers"])


def test_generate_with_images_and_a_block_drafter_exits_2(drafter, capsys):
    from mlx_mtp import cli

    code = cli.main(["generate", "--model", str(CKPT), "--draft-model", str(drafter),
                     "--image", str(FIXTURE / "image_a.png"), "--prompt", "hi",
                     "--max-tokens", "2", "--verbose", "False"])
    err = capsys.readouterr().err
    assert code == 2 and NO_IMAGES in err and "Traceback" not in err


def test_a_request_with_images_gets_a_400_and_text_still_decodes(drafter):
    model, tokenizer = load(str(CKPT))
    attach_block_drafter(model, str(drafter))
    engine = Engine(model, tokenizer, num_draft_tokens=2, adaptive=False, calibrate=False)
    engine.start()
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name="vl", aliases={"vl"},
                        context_length=4096, vocab_size=263, block_drafter=True,
                        images=ImageInputs(model.image_encoder))
    try:
        client = TestClient(create_app(state))
        url = "data:image/png;base64," + base64.b64encode(
            (FIXTURE / "image_a.png").read_bytes()).decode()
        parts = [{"type": "image_url", "image_url": {"url": url}},
                 {"type": "text", "text": "hi"}]
        body = {"model": "vl", "messages": [{"role": "user", "content": parts}],
                "max_tokens": 2, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert NO_IMAGES in error["message"] and error["param"] == "messages"
        body["messages"][0]["content"] = "hi"
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        engine.shutdown()
        state.prompt_workers.shutdown()
