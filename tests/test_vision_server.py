"""Images through all three APIs, in-process (the real app and engine on the tiny
Qwen3.5-VL fixture of ``test_vision.py``, recorded with transformers 5.24): an OpenAI
``image_url`` data URL, an Anthropic base64 ``image`` block and a Responses ``input_image``
each answer transformers' greedy text and count the image tokens in the usage; bad images
get a 400 in each API's own error shape and leave the server serving; nothing is fetched.
"""

import base64
import io
import json
import re
import struct
import zlib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mlx_mtp.models.io.loader import load
from mlx_mtp.server.app import create_app
from mlx_mtp.server.engine import Engine
from mlx_mtp.server.images import ImageInputs
from mlx_mtp.server.prefix_cache import PrefixCache
from mlx_mtp.server.state import ServerState

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_5_vl"
CKPT = FIXTURE / "checkpoint"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())["cases"]
N = 16


def data_url(name="image_a.png", mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode((FIXTURE / name).read_bytes()).decode()


def png_claiming(width, height) -> bytes:
    def chunk(kind, body):
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load(str(CKPT))
    engine = Engine(model, tokenizer, num_draft_tokens=2, adaptive=False, calibrate=False,
                    prefix_cache=PrefixCache(8, 1 << 30))
    engine.start()
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name="vl", aliases={"vl"},
                        context_length=4096, vocab_size=263,
                        images=ImageInputs(model.image_encoder))
    text_only = ServerState(engine=engine, tokenizer=tokenizer, model_name="vl",
                            aliases={"vl"}, context_length=4096, vocab_size=263)
    yield TestClient(create_app(state)), TestClient(create_app(text_only)), tokenizer
    engine.shutdown()
    state.prompt_workers.shutdown()
    text_only.prompt_workers.shutdown()


def openai_body(parts, **kw):
    return {"model": "vl", "messages": [{"role": "user", "content": parts}],
            "max_tokens": N, "temperature": 0, **kw}


def openai_parts(case, url=None):
    return [{"type": "image_url", "image_url": {"url": url or data_url(n)}}
            for n in case["images"]] + [{"type": "text", "text": case["user_text"]}]


@pytest.mark.parametrize("case", [0, 1], ids=["one image", "two images"])
def test_openai_chat_with_images_answers_transformers_text(served, case):
    client, _, tok = served
    ref = REFERENCE[case]
    r = client.post("/v1/chat/completions", json=openai_body(openai_parts(ref)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == tok.decode(ref["output"])
    assert body["usage"]["prompt_tokens"] == len(ref["prompt"])  # image tokens counted


def test_a_repeated_image_request_hits_the_prefix_cache(served):
    """The second identical request reuses the prompt's state (cached tokens in the usage)
    and the tower's output (no second pass); its text is still transformers'."""
    client, _, tok = served
    encoder = client.app.state.server.images.encoder
    ref = REFERENCE[0]
    client.post("/v1/chat/completions", json=openai_body(openai_parts(ref)))
    passes = encoder.tower_passes
    r = client.post("/v1/chat/completions", json=openai_body(openai_parts(ref))).json()
    assert r["choices"][0]["message"]["content"] == tok.decode(ref["output"])
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ref["prompt"]) - 1
    assert encoder.tower_passes == passes


def test_another_image_of_the_same_size_is_not_served_from_the_cache(served):
    """Image pads are the same token for every image: the cache must tell images apart.
    A mirrored image A (same grid, so the same positions) after image A answers what the
    model answers for it alone, and reuses only the text before the image."""
    from PIL import Image

    from mlx_mtp.decode.generation import with_images
    from mlx_mtp.decode.speculative import MTPDecoder

    client, _, tok = served
    ref = REFERENCE[0]
    mirrored = Image.open(FIXTURE / "image_a.png").convert("RGB").transpose(
        Image.Transpose.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    mirrored.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    model = client.app.state.server.engine.model
    ids, images = with_images(model, ref["prompt"], [mirrored])
    dec = MTPDecoder(model, 0, images=images)
    dec.prefill(ids)
    want = []
    while len(want) < N:
        want += dec.step().tokens
    assert want[:N] != ref["output"]  # the image matters
    client.post("/v1/chat/completions", json=openai_body(openai_parts(ref)))
    r = client.post("/v1/chat/completions", json=openai_body(openai_parts(ref, url))).json()
    assert r["choices"][0]["message"]["content"] == tok.decode(want[:N])
    first_pad = ref["prompt"].index(model.image_encoder.pad_id)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] <= first_pad


def test_anthropic_image_block_answers_transformers_text(served):
    client, _, tok = served
    ref = REFERENCE[1]
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": data_url(n).split(",", 1)[1]}}
              for n in ref["images"]] + [{"type": "text", "text": ref["user_text"]}]
    r = client.post("/v1/messages", json={"model": "vl", "max_tokens": N, "temperature": 0,
                                          "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == tok.decode(ref["output"])
    usage = r.json()["usage"]  # Anthropic's input_tokens leave out what the cache read
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ref["prompt"])


def test_count_tokens_and_the_model_card_know_images(served):
    client, text_only, _ = served
    ref = REFERENCE[1]
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": data_url(n).split(",", 1)[1]}}
              for n in ref["images"]] + [{"type": "text", "text": ref["user_text"]}]
    r = client.post("/v1/messages/count_tokens", json={
        "model": "vl", "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 200 and r.json()["input_tokens"] == len(ref["prompt"])
    assert client.get("/v1/models").json()["data"][0]["capabilities"]["images"] is True
    assert text_only.get("/v1/models").json()["data"][0]["capabilities"]["images"] is False


def test_responses_input_image_answers_transformers_text(served):
    client, _, tok = served
    ref = REFERENCE[0]
    content = [{"type": "input_image", "image_url": data_url(n)} for n in ref["images"]]
    content.append({"type": "input_text", "text": ref["user_text"]})
    r = client.post("/v1/responses", json={"model": "vl", "max_output_tokens": N,
                                           "temperature": 0,
                                           "input": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    out = r.json()["output"][-1]["content"][0]["text"]
    assert out == tok.decode(ref["output"]) and r.json()["usage"]["input_tokens"] == len(
        ref["prompt"])


BAD = {
    "corrupt bytes": ("data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode(),
                      "cannot be decoded"),
    "0x0": ("data:image/png;base64," + base64.b64encode(png_claiming(0, 0)).decode(),
            "no pixels|cannot be decoded"),
    "20000x20000": ("data:image/png;base64," + base64.b64encode(png_claiming(20000, 20000))
                    .decode(), "pixels"),
    "wrong MIME": ("data:text/plain;base64," + base64.b64encode(b"hello").decode(),
                   "unsupported image type"),
    "not base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "remote URL": ("http://192.0.2.1/cat.png", "remote image URLs are off"),
    "local file": (str(FIXTURE / "image_a.png"), "local image files are off"),
}


@pytest.mark.parametrize("name", list(BAD) + ["50 images"])
def test_bad_images_are_400_in_each_api_shape(served, name):
    client, _, _ = served
    url, message = BAD.get(name, (data_url(), "too many images"))
    n = 50 if name == "50 images" else 1
    parts = [{"type": "image_url", "image_url": {"url": url}}] * n + [{"type": "text",
                                                                        "text": "hi"}]
    r = client.post("/v1/chat/completions", json=openai_body(parts))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert re.search(message, r.json()["error"]["message"]), r.text
    source = ({"type": "base64", "media_type": url[5:].split(";")[0],
               "data": url.split(",", 1)[1]} if url.startswith("data:")
              else {"type": "url", "url": url})
    r = client.post("/v1/messages", json={"model": "vl", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}] * n
         + [{"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/responses", json={"model": "vl", "max_output_tokens": 4, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": url}] * n}]})
    assert r.status_code == 400 and "error" in r.json(), r.text
    # The server goes on serving.
    ok = client.post("/v1/chat/completions", json=openai_body("hi", max_tokens=2))
    assert ok.status_code == 200


def test_a_model_without_a_tower_refuses_images_with_400(served):
    _, text_only, _ = served
    r = text_only.post("/v1/chat/completions", json=openai_body(openai_parts(REFERENCE[0])))
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]


def test_prefix_keys_name_images_with_integers_no_token_id_equals():
    """Keys tell images apart (the i-th pad of an image is named by its content hash and
    i), carry the prompt's position shift in their first element, and are uint32 integers
    at or above 2**31, so disk sessions store them as they store token ids."""
    from types import SimpleNamespace

    import numpy as np

    from mlx_mtp.models.vision.images import ImageBatch
    from mlx_mtp.server.images import engine_kwargs

    def batch(*hashes, grid=(1, 4, 12)):
        return ImageBatch(np.zeros((0, 1)), [grid] * len(hashes), [12] * len(hashes),
                          list(hashes), merge=2)

    ids = [7, 8] + [99] * 12 + [9]
    a, b = batch("a").prefix_key(ids, 99), batch("b").prefix_key(ids, 99)
    assert a != b and a[1:2] == b[1:2] == (8,) and a[14:] == b[14:] == (9,)
    assert all(isinstance(t, int) and 2 ** 31 <= t < 2 ** 32 for t in a[2:14] + a[:1])
    assert len(set(a[2:14])) == 12 and not set(a[2:14]) & set(b[2:14])
    assert a[0] != batch("a", grid=(1, 6, 8)).prefix_key(ids, 99)[0]  # another shift
    assert a == batch("a").prefix_key(ids, 99)  # a function of the content only
    state = SimpleNamespace(images=SimpleNamespace(encoder=SimpleNamespace(pad_id=99)))
    prepared = SimpleNamespace(images=batch("a"), ids=ids)
    assert engine_kwargs(state, prepared)["cache_tokens"] == a


def test_an_image_turn_restores_from_a_disk_session(served, tmp_path):
    """A prompt with images is written to the disk session store and a fresh engine (empty
    memory) restores it: cached tokens counted, transformers' text still answered."""
    from mlx_mtp.server.session_store import SessionStore, model_fingerprint

    _, _, tok = served
    model = served[0].app.state.server.engine.model
    ref = REFERENCE[1]

    def answer():
        store = SessionStore(tmp_path, model_fingerprint(model), min_tokens=16)
        engine = Engine(model, tok, num_draft_tokens=2, adaptive=False, calibrate=False,
                        prefix_cache=PrefixCache(8, 1 << 30, disk=store))
        engine.start()
        state = ServerState(engine=engine, tokenizer=tok, model_name="vl", aliases={"vl"},
                            context_length=4096, vocab_size=263,
                            images=ImageInputs(model.image_encoder))
        try:
            r = TestClient(create_app(state)).post("/v1/chat/completions",
                                                   json=openai_body(openai_parts(ref)))
            store.flush(timeout=30)
            return r.json(), store
        finally:
            engine.shutdown()
            state.prompt_workers.shutdown()

    cold, _ = answer()
    warm, store = answer()
    for body in (cold, warm):
        assert body["choices"][0]["message"]["content"] == tok.decode(ref["output"])
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ref["prompt"]) - 1
    assert store.hits == 1
