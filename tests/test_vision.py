"""Images in, MTP on: tiny Qwen3.5-VL checkpoints built with transformers 5.24's own
``Qwen3_5ForConditionalGeneration`` and its MoE form (``tests/fixtures/qwen3_5_vl``,
recorded by its ``make_reference.py``: CI has no torch). Our greedy output with one and
with two images equals transformers' ``generate``; MTP drafting (K = 0..3, context lookup
on) equals it too, alone and in a batch of 4 mixing image and text rows; bad images are
refused with one line.
"""

import io
import json
import struct
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlx_mtp.decode.batch import BatchDecoder
from mlx_mtp.decode.draft_source import DraftSources
from mlx_mtp.decode.generation import with_images
from mlx_mtp.decode.speculative import MTPDecoder
from mlx_mtp.drafters.lookup import LookupSettings
from mlx_mtp.models.io.layout import CheckpointError
from mlx_mtp.models.io.loader import load_model
from mlx_mtp.models.vision import encoder as vision_encoder
from mlx_mtp.models.vision.images import ImageError, ImageLimits, decode_image
from mlx_mtp.models.vision.qwen3_5 import VisionModel

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_5_vl"
CKPT = FIXTURE / "checkpoint"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())["cases"]
N = 16


@pytest.fixture(scope="module")
def vl_model():
    model, config = load_model(CKPT)
    model.use_image_encoder(vision_encoder.encoder_for(CKPT, config))
    return model


def images_of(case):
    return [Image.open(FIXTURE / name).convert("RGB") for name in case["images"]]


def decoder(model, case, k, lookup):
    """A prefilled decoder of ``case``'s image prompt (K drafts, context lookup or not)."""
    ids, images = with_images(model, case["prompt"], images_of(case))
    drafter = DraftSources("both" if k else "lookup", LookupSettings(max_draft=8),
                           adaptive=False).drafter() if lookup else None
    dec = MTPDecoder(model, k, adaptive=False, drafter=drafter, images=images)
    dec.prefill(ids)
    return dec


def decode(dec, n=N):
    out = []
    while len(out) < n:
        out += dec.step().tokens
    return out[:n]


def test_load_with_vision_reads_the_tower_at_start():
    from mlx_mtp.models.io.loader import load

    model, _ = load(str(CKPT), vision=True)
    assert model.capabilities.images and model.image_encoder.loaded
    model, _ = load(str(CKPT))
    assert model.capabilities.images and not model.image_encoder.loaded


def test_the_tower_is_read_at_the_first_image_only():
    model, config = load_model(CKPT)
    encoder = vision_encoder.encoder_for(CKPT, config)
    model.use_image_encoder(encoder)
    assert model.capabilities.images and not encoder.loaded
    dec = MTPDecoder(model, 1, adaptive=False)
    dec.prefill(REFERENCE[0]["text_prompt"])
    assert decode(dec) == REFERENCE[0]["text_output"]  # text as before, tower unread
    assert not encoder.loaded
    with_images(model, REFERENCE[0]["prompt"], images_of(REFERENCE[0]))
    assert encoder.loaded


@pytest.mark.parametrize("case", [0, 1], ids=["one image", "two images"])
def test_greedy_equals_transformers_and_mtp_equals_plain(vl_model, case):
    ref = REFERENCE[case]
    # The prompt as chat templates write it (one pad per image) expands to the recorded one.
    pad = vl_model.image_encoder.pad_id
    collapsed = [t for i, t in enumerate(ref["prompt"])
                 if t != pad or ref["prompt"][i - 1] != pad]
    assert with_images(vl_model, collapsed, images_of(ref))[0] == ref["prompt"]
    for k in range(4):
        for lookup in (False, True):
            got = decode(decoder(vl_model, ref, k, lookup))
            assert got == ref["output"], f"K={k} lookup={lookup}"


def test_moe_checkpoint_equals_transformers_too():
    """The MoE form (``Qwen3_5MoeForConditionalGeneration``), same tower and positions."""
    path = FIXTURE / "checkpoint_moe"
    reference = json.loads((FIXTURE / "reference_moe.json").read_text())["cases"]
    model, config = load_model(path)
    model.use_image_encoder(vision_encoder.encoder_for(path, config))
    assert model.model_type == "qwen3_5_moe" and model.capabilities.images
    for ref in reference:
        for k in range(4):
            got = decode(decoder(model, ref, k, lookup=k == 3))
            assert got == ref["output"], (ref["images"], k)


def test_a_repeated_image_is_not_encoded_again():
    """The tower's output is kept by content hash: the second prompt with image A (here
    beside image B) runs the tower on B alone, and its output is still transformers'."""
    model, config = load_model(CKPT)
    encoder = vision_encoder.encoder_for(CKPT, config)
    model.use_image_encoder(encoder)
    assert decode(decoder(model, REFERENCE[0], 2, False)) == REFERENCE[0]["output"]
    assert encoder.tower_passes == 1
    assert decode(decoder(model, REFERENCE[1], 2, False)) == REFERENCE[1]["output"]
    assert encoder.tower_passes == 2  # image B only
    assert decode(decoder(model, REFERENCE[1], 0, False)) == REFERENCE[1]["output"]
    assert encoder.tower_passes == 2
    keep_none = vision_encoder.ImageEncoder(CKPT, config, cache_bytes=0)
    model.use_image_encoder(keep_none)  # nothing kept: every image is encoded each time
    for _ in range(2):
        decoder(model, REFERENCE[0], 0, False)
    assert keep_none.tower_passes == 2 and not keep_none.cached


def test_a_batch_of_image_and_text_rows_equals_each_alone(vl_model):
    rows = [REFERENCE[0], None, REFERENCE[1], None]  # None: the text-only prompt
    for k in range(4):
        bd = BatchDecoder(vl_model, k > 0, adaptive=False)
        outs = {}
        for i, case in enumerate(rows):
            if case is None:
                dec = MTPDecoder(vl_model, k, adaptive=False)
                dec.prefill(REFERENCE[0]["text_prompt"])
            else:
                dec = decoder(vl_model, case, k, lookup=i == 2)
            bd.add(i, dec)
            outs[i] = []
        while min(len(t) for t in outs.values()) < N:
            for key, o in bd.step().items():
                outs[key] += o.tokens
        for i, case in enumerate(rows):
            want = REFERENCE[0]["text_output"] if case is None else case["output"]
            assert outs[i][:N] == want, f"K={k} row {i}"


def test_mlx_vlm_conversion_layout_reads_alike(vl_model):
    """mlx-vlm stores the patch embedding as an MLX Conv3d, (out, T, P, P, C)."""
    tower = vl_model.image_encoder.load().tower
    raw = vision_encoder.vision_weights(CKPT)
    conv = raw["model.visual.patch_embed.proj.weight"]
    converted = {k.replace("model.visual.", "vision_tower."): v for k, v in raw.items()}
    converted["vision_tower.patch_embed.proj.weight"] = conv.transpose(0, 2, 3, 4, 1)
    other = VisionModel(tower.args)
    other.load_weights(list(other.sanitize(converted).items()), strict=True)
    batch = vl_model.image_encoder.preprocess(images_of(REFERENCE[1]))
    a = tower(mx.array(batch.pixels), batch.grids)
    b = other(mx.array(batch.pixels), batch.grids)
    assert a.shape == (sum(batch.token_counts), 64) and mx.array_equal(a, b)


def test_query_blocks_leave_the_tower_output_unchanged(vl_model, monkeypatch):
    """Large images attend in blocks of queries: the same output as all at once."""
    from mlx_mtp.models.vision import qwen3_5

    tower = vl_model.image_encoder.load().tower
    batch = vl_model.image_encoder.preprocess(images_of(REFERENCE[1]))
    whole = tower(mx.array(batch.pixels), batch.grids)
    monkeypatch.setattr(qwen3_5, "QUERY_BLOCK", 5)  # blocks that cut both images
    assert mx.array_equal(tower(mx.array(batch.pixels), batch.grids), whole)


def test_text_only_checkpoints_take_no_images(tiny_ckpt):
    model, config = load_model(Path(tiny_ckpt("qwen3_5", "random")))
    assert vision_encoder.encoder_for(CKPT, {"model_type": "qwen3_5"}) is None
    assert not model.capabilities.images and model.image_encoder is None
    with pytest.raises(ValueError, match="takes no images"):
        with_images(model, [1, 2, 3], [Image.new("RGB", (32, 32))])
    vl_config = json.loads((CKPT / "config.json").read_text())
    text_path = Path(tiny_ckpt("qwen3_5", "random"))
    # A text-only conversion that kept the multimodal config: no tower to read.
    assert vision_encoder.encoder_for(text_path, vl_config) is None
    with pytest.raises(CheckpointError, match="no preprocessor_config"):
        vision_encoder.load_processor(text_path, vl_config)
    with pytest.raises(CheckpointError, match="no vision tower weights"):
        vision_encoder.load_tower(text_path, vl_config)


def png_header(width, height) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` (its pixel data is short)."""
    def chunk(kind, body):
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("data,message", [
    (b"", "is empty"),
    (b"not an image at all", "cannot be decoded"),
    (png_header(0, 0), "no pixels|cannot be decoded"),
    (png_header(20000, 20000), "at most 40000000 pixels"),
    (png_header(7000, 7000), "7000x7000 pixels \\(at most 40000000 pixels"),
    (b"x" * (20 << 20 + 1), "bytes"),
])
def test_bad_images_are_refused_with_one_line(data, message):
    with pytest.raises(ImageError, match=message) as e:
        decode_image(data, ImageLimits())
    assert "\n" not in str(e.value)


def test_image_count_and_placeholders_are_checked(vl_model):
    encoder = vl_model.image_encoder
    many = [Image.new("RGB", (32, 32))] * (ImageLimits().max_images + 1)
    with pytest.raises(ImageError, match="too many images"):
        encoder.preprocess(many)
    one = images_of(REFERENCE[0])
    with pytest.raises(ImageError, match="1 images|placeholders"):
        with_images(vl_model, [5, 6, 7], one)  # no placeholder for the image
    with pytest.raises(ImageError, match="ends inside an image"):
        with_images(vl_model, [5, 500, encoder.pad_id], one)


def test_a_truncated_png_with_a_good_header_is_refused():
    pixels = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(out.getvalue()[: len(out.getvalue()) // 2], ImageLimits())


def run_cli(capsys, *argv):
    from mlx_mtp import cli

    code = cli.main(["generate", "--model", str(CKPT), "--max-tokens", str(N), "--temp", "0",
                     "--verbose", "False", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_with_images_prints_transformers_text(capsys):
    """`generate --image` (repeatable): the chat template writes the placeholders, the CLI
    expands and fills them; the text equals transformers' greedy output, decoded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CKPT)
    for case in REFERENCE:
        images = [a for name in case["images"] for a in ("--image", str(FIXTURE / name))]
        for k in ("0", "3"):
            code, out, _ = run_cli(capsys, "--prompt", case["user_text"], "--num-draft-tokens",
                                   k, "--fixed-k", *images)
            assert code == 0 and out.rstrip("\n") == tokenizer.decode(case["output"]), k


@pytest.mark.parametrize("argv,message", [
    (["--image", str(FIXTURE / "missing.png")], "does not exist"),
    (["--image", str(FIXTURE / "reference.json")], "cannot be decoded"),
    (["--image", str(FIXTURE / "image_a.png")] * 17, "too many images"),
    (["--image", str(FIXTURE / "image_a.png"), "--ignore-chat-template"], "placeholders"),
])
def test_generate_refuses_bad_images_with_exit_2(capsys, argv, message):
    code, _, err = run_cli(capsys, "--prompt", "hi", *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_vision_flag_on_a_text_only_checkpoint_exits_2(tiny_ckpt, capsys):
    from mlx_mtp import cli

    path = tiny_ckpt("qwen3_5", "random", vocab_size=4096)
    code = cli.main(["generate", "--model", str(path), "--vision", "--prompt", "hi",
                     "--max-tokens", "2", "--verbose", "False"])
    assert code == 2 and "has no vision tower" in capsys.readouterr().err
