"""Image inputs: decoding with bounds, the checkpoint's image processor, and what a
prompt with images carries into prefill (``PromptImages``).

Every refusal is an ``ImageError`` with a one-line message (the CLI exits 2 with it, the
server answers 400 in the API's shape). Images are decoded by Pillow and preprocessed by
transformers' PIL/numpy image processor (``Qwen2VLImageProcessorPil``: no torch), both
imported only when an image arrives.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .positions import prompt_positions


class ImageError(ValueError):
    """An image input that cannot be used (the message says why)."""


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 16  # per request
    max_bytes: int = 20 << 20  # per encoded image
    max_pixels: int = 40_000_000  # per decoded image (width x height), before resizing


IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp")


def check_count(n: int, limits: ImageLimits):
    if n > limits.max_images:
        raise ImageError(f"too many images: {n} (at most {limits.max_images} per request)")


def check_mime(mime: str):
    if mime.lower() not in IMAGE_MIME_TYPES:
        raise ImageError(f"unsupported image type {mime!r} (use one of "
                         f"{', '.join(IMAGE_MIME_TYPES)})")


def _pillow():
    try:
        import PIL.Image
    except ImportError as e:
        raise ImageError("images need Pillow: pip install 'mlx-mtp[vision]'") from e
    return PIL.Image


def decode_image(data: bytes, limits: ImageLimits, where: str = "image"):
    """An RGB ``PIL.Image`` from encoded bytes, within ``limits``."""
    Image = _pillow()
    UnidentifiedImageError = Image.UnidentifiedImageError

    if len(data) == 0:
        raise ImageError(f"{where} is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where} is {len(data)} bytes (at most {limits.max_bytes})")
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size  # from the header: no pixels decoded yet
            if w == 0 or h == 0:
                raise ImageError(f"{where} is {w}x{h} pixels: it has no pixels")
            if w * h > limits.max_pixels:
                raise ImageError(f"{where} is {w}x{h} pixels (at most {limits.max_pixels} "
                                 "pixels)")
            return im.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own bound, above ours by default
        raise ImageError(f"{where} has too many pixels (at most {limits.max_pixels} "
                         "pixels)") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where} cannot be decoded as an image ({type(e).__name__})") from e


def read_image_file(path, limits: ImageLimits):
    p = Path(path)
    if not p.is_file():
        raise ImageError(f"image file {path} does not exist")
    if p.stat().st_size > limits.max_bytes:
        raise ImageError(f"image file {path} is {p.stat().st_size} bytes (at most "
                         f"{limits.max_bytes})")
    return decode_image(p.read_bytes(), limits, f"image file {path}")


def content_hash(image) -> str:
    """A hash of the decoded pixels: the same picture in another encoding hashes alike."""
    h = hashlib.sha256(f"{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


@dataclass
class ImageBatch:
    """A request's images, preprocessed: patches for the tower and per image its grid."""

    pixels: np.ndarray  # (patches, patch_dim) float32, every image's patches in turn
    grids: List[Tuple[int, int, int]]  # (t, h, w) in patches, per image
    token_counts: List[int]  # image-pad tokens per image (merged patches)
    hashes: List[str]  # content_hash per image
    merge: int  # patches merged per side into one image token

    def prefix_key(self, ids: Sequence[int], pad_id: int) -> tuple:
        """The prompt-prefix cache key of the prompt ``ids`` (pads expanded) with these
        images: its ids, the i-th pad of each image named by (the image's content hash, i),
        and its first element by the shift of the prompt's positions (``positions``), which
        every row's position depends on. Prompts share a prefix state only when both match.
        Names are 32-bit integers no token id can equal (``_name``), so the key is stored on
        disk like any token key (``server/session_store.py`` keeps uint32)."""
        shift = sum(max(h, w) // self.merge - n
                    for (_, h, w), n in zip(self.grids, self.token_counts))
        names = iter(_name(d, i) for d, n in zip(self.hashes, self.token_counts)
                     for i in range(n))
        key = [next(names) if t == pad_id else int(t) for t in ids]
        key[0] = _name("images", shift, key[0])
        return tuple(key)


def _name(*parts) -> int:
    """A key element for ``parts``: 2**31 plus 31 bits of their hash. Token ids stay below
    2**31, so a name never equals one; two images' pads collide only if every one of their
    (hash, index) names does."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return (1 << 31) | (int.from_bytes(digest, "little") & 0x7FFFFFFF)


class ImageProcessor:
    """The checkpoint's image processor (preprocessor_config.json), numpy path."""

    def __init__(self, config: dict, merge_size: int):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        config = {k: v for k, v in config.items() if not k.endswith("_type")}
        self.processor = Qwen2VLImageProcessorPil(**config)
        self.merge = merge_size

    def __call__(self, images: Sequence) -> ImageBatch:
        out = self.processor(images=list(images), return_tensors="np")
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]]
        return ImageBatch(pixels=np.asarray(out["pixel_values"], np.float32), grids=grids,
                          token_counts=[t * h * w // self.merge ** 2 for t, h, w in grids],
                          hashes=[content_hash(im) for im in images], merge=self.merge)


def expand_image_pads(ids: Sequence[int], counts: Sequence[int], pad_id: int) -> List[int]:
    """``ids`` with its i-th image pad token repeated ``counts[i]`` times (chat templates
    write one pad per image; the model reads one per merged patch)."""
    found = sum(1 for t in ids if t == pad_id)
    if found != len(counts):
        raise ImageError(f"the prompt has {found} image placeholders for {len(counts)} images")
    out, it = [], iter(counts)
    for t in ids:
        out.extend([t] * next(it) if t == pad_id else [t])
    return out


@dataclass
class PromptImages:
    """What prefill needs beside a prompt's token ids: the tower's embeddings placed at the
    image-pad tokens, and every prompt row's multimodal position."""

    embeddings: mx.array  # (image tokens, hidden): the tower's output, in prompt order
    index: mx.array  # (L,) int32: row of ``embeddings`` per prompt position, -1 for text
    positions: mx.array  # (3, L) int32 (see ``positions.prompt_positions``)
    hashes: Tuple[str, ...]  # content hash per image (prefix-cache key)

    @classmethod
    def build(cls, ids: Sequence[int], batch: ImageBatch, embeddings: mx.array,
              pad_id: int, merge: int) -> "PromptImages":
        ids_np = np.asarray(ids)
        is_pad = ids_np == pad_id
        if int(is_pad.sum()) != embeddings.shape[0]:
            raise ImageError(f"the prompt has {int(is_pad.sum())} image tokens for "
                             f"{embeddings.shape[0]} image embeddings")
        index = np.where(is_pad, np.cumsum(is_pad) - 1, -1).astype(np.int32)
        positions = prompt_positions(ids_np, batch.grids, pad_id, merge)
        return cls(embeddings, mx.array(index), mx.array(positions), tuple(batch.hashes))

    def embed(self, text_embeddings: mx.array, start: int) -> mx.array:
        """(1, S, H) embeddings of prompt rows ``start..start+S`` with the images placed."""
        idx = self.index[start:start + text_embeddings.shape[1]]
        rows = self.embeddings[mx.maximum(idx, 0)].astype(text_embeddings.dtype)
        return mx.where((idx >= 0)[None, :, None], rows[None], text_embeddings)

    def chunk_positions(self, start: int, length: int) -> mx.array:
        return self.positions[:, start:start + length]

