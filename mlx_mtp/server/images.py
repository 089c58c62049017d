"""Image inputs of chat requests. Each API's image part becomes one OpenAI-style URL
(``image_url`` parts as sent; Anthropic ``image`` blocks and Responses ``input_image`` parts
translated by their modules): data URLs always, local files (``file://`` or a path) and
remote ``http(s)`` URLs only when the server allows them. Images are read, bounded and
preprocessed on a prompt worker; the tower runs on the engine thread when the request is
admitted. Anything unusable is a 400 in the API's own shape (``bad_request``).

The prefix cache keys a prompt with images by its ids with each image's pads named by
the image's content hash and the shift of its positions (``ImageBatch.prefix_key``): a
repeated image prompt, or the next turn of a conversation about an image, reuses the state
computed before, in memory and in disk sessions (``--prompt-cache-dir``) alike.
"""

from __future__ import annotations

import base64
import binascii
import urllib.request
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..decode.block_context import NO_IMAGES
from ..models.vision.images import (ImageBatch, ImageError, ImageLimits, check_count,
                                    check_mime, decode_image, read_image_file)
from .protocol import bad_request


@dataclass
class ImageInputs:
    """The server's image settings, beside the model's encoder (``ServerState.images``)."""

    encoder: object  # models.vision.encoder.ImageEncoder
    allow_files: bool = False
    allow_urls: bool = False
    url_timeout: float = 10.0

    @property
    def limits(self) -> ImageLimits:
        return self.encoder.limits

    def read(self, url: str, where: str):
        """A decoded image from one URL (ImageError when it cannot be used)."""
        if not isinstance(url, str) or not url:
            raise ImageError(f"{where}: the image URL must be a non-empty string")
        if url.startswith("data:"):
            return decode_image(_data_url_bytes(url, self.limits.max_bytes, where),
                                self.limits, where)
        if url.startswith(("http://", "https://")):
            if not self.allow_urls:
                raise ImageError(f"{where}: remote image URLs are off on this server (send a "
                                 "data URL, or start it with --allow-image-urls)")
            return decode_image(self._fetch(url, where), self.limits, where)
        if not self.allow_files:
            raise ImageError(f"{where}: local image files are off on this server (send a data "
                             "URL, or start it with --allow-image-files)")
        return read_image_file(url[len("file://"):] if url.startswith("file://") else url,
                               self.limits)

    def _fetch(self, url: str, where: str) -> bytes:
        try:
            with urllib.request.urlopen(url, timeout=self.url_timeout) as r:
                check_mime((r.headers.get_content_type() or ""))
                return r.read(self.limits.max_bytes + 1)
        except ImageError:
            raise
        except (OSError, ValueError) as e:
            raise ImageError(f"{where}: the image could not be fetched ({type(e).__name__})"
                             ) from e

    def prepare(self, ids: List[int], urls: Sequence[Tuple[str, str]]
                ) -> Tuple[List[int], ImageBatch]:
        """(the prompt ids with every image's placeholder expanded, the preprocessed
        images); ``urls``: (URL, where it was in the request) per image, in order."""
        try:
            check_count(len(urls), self.limits)
            batch = self.encoder.preprocess([self.read(u, where) for u, where in urls])
            return self.encoder.expand(ids, batch), batch
        except ImageError as e:
            raise bad_request(str(e), param="messages", code="invalid_image")


def _data_url_bytes(url: str, max_bytes: int, where: str) -> bytes:
    header, sep, data = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError(f"{where}: a data URL must look like data:image/png;base64,...")
    check_mime(header[len("data:"):-len(";base64")])
    if len(data) * 3 // 4 > max_bytes + 2:
        raise ImageError(f"{where}: the image is over {max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data URL is not valid base64") from e


def image_url(part: dict, where: str) -> Optional[str]:
    """The URL of an OpenAI chat ``image_url`` part (its ``url`` or the string itself)."""
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise bad_request(f"{where}: an image_url part needs image_url.url, a string",
                          param="messages", code="invalid_image")
    return url


def no_images(where: str):
    return bad_request(f"{where}: this model takes no images (its checkpoint has no vision "
                       "tower)", param="messages", code="invalid_image")


def no_images_with_block_drafter(where: str):
    return bad_request(f"{where}: {NO_IMAGES}", param="messages", code="invalid_image")


def engine_kwargs(state, prepared) -> dict:
    """What a prepared chat with images adds to its ``EngineRequest``."""
    if prepared.images is None:
        return {}
    pad = state.images.encoder.pad_id
    return {"images": prepared.images,
            "cache_tokens": prepared.images.prefix_key(prepared.ids, pad)}
