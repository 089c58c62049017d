"""A vision tower with its image processor (``ImageEncoder``), and loading them from a
checkpoint (``load_tower``): the released layout (``model.visual.*``,
Conv3d patch embedding) or an mlx-vlm conversion (``vision_tower.*``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..io.files import load_safetensors, read_json_object, read_safetensors_header
from ..io.layout import CheckpointError
from .images import ImageBatch, ImageError, ImageLimits, ImageProcessor, PromptImages, \
    check_count, expand_image_pads
from .qwen3_5 import VISION_PREFIXES, VisionArgs, VisionModel

VISION_FAMILIES = ("qwen3_5", "qwen3_5_moe")  # families whose trunk takes image embeddings


class ImageEncoder:
    """Images -> the tower's embeddings at a prompt's image-pad tokens. Made at load for
    any checkpoint with a tower (``encoder_for``), reading nothing: the image processor is
    read at the first image (``preprocess``, on any thread: no MLX), the tower's weights at
    the first ``encode`` (on the thread that runs the model), or both by ``load()``
    (``--vision``).

    The tower runs once per image: its output is kept by the image's content hash (least
    recently used out past ``cache_bytes``), so a repeated image is not encoded again."""

    def __init__(self, path: Path, config: dict, dtype: Optional[mx.Dtype] = None,
                 limits: ImageLimits = ImageLimits(), cache_bytes: int = 256 << 20):
        self.path, self.config, self.dtype = path, config, dtype
        self.pad_id: int = config["image_token_id"]
        self.limits = limits
        self.tower: Optional[VisionModel] = None
        self.processor: Optional[ImageProcessor] = None
        self._processor_lock = threading.Lock()  # prompt workers preprocess concurrently
        self.cache_bytes = cache_bytes
        self.cached: "OrderedDict[tuple, mx.array]" = OrderedDict()  # (hash, grid) -> output
        self.tower_passes = 0  # images the tower has encoded

    def load(self) -> "ImageEncoder":
        self._load_processor()
        if self.tower is None:
            self.tower = load_tower(self.path, self.config, self.dtype)
        return self

    def _load_processor(self) -> ImageProcessor:
        with self._processor_lock:
            if self.processor is None:
                self.processor = load_processor(self.path, self.config)
            return self.processor

    @property
    def loaded(self) -> bool:
        return self.tower is not None

    def preprocess(self, images: Sequence) -> ImageBatch:
        check_count(len(images), self.limits)
        return self._load_processor()(images)

    def expand(self, ids: Sequence[int], batch: ImageBatch) -> List[int]:
        """The prompt ids with each image's pad repeated once per image token: ``ids`` hold
        one pad per image (as chat templates write them) or the expanded runs already."""
        if sum(1 for t in ids if t == self.pad_id) != sum(batch.token_counts):
            ids = expand_image_pads(ids, batch.token_counts, self.pad_id)
        if ids and ids[-1] == self.pad_id:
            raise ImageError("the prompt ends inside an image: add text after it")
        return list(ids)

    def encode(self, ids: Sequence[int], batch: ImageBatch) -> Tuple[List[int], PromptImages]:
        """(``expand(ids, batch)``, what prefill needs: the tower's embeddings, positions)."""
        ids = self.expand(ids, batch)
        merge = self.load().tower.args.spatial_merge_size
        embeddings = mx.concatenate(self._embed_each(batch))
        return list(ids), PromptImages.build(ids, batch, embeddings, self.pad_id, merge)

    def _embed_each(self, batch: ImageBatch) -> List[mx.array]:
        """The tower's output per image: kept from before, or computed (and kept)."""
        out, start = [], 0
        for grid, digest in zip(batch.grids, batch.hashes):
            n = grid[0] * grid[1] * grid[2]
            key = (digest, grid)
            e = self.cached.get(key)
            if e is None:
                e = self.tower(mx.array(batch.pixels[start:start + n]), [grid])
                mx.eval(e)
                self.tower_passes += 1
                self.cached[key] = e
                while sum(v.nbytes for v in self.cached.values()) > self.cache_bytes:
                    self.cached.popitem(last=False)
            else:
                self.cached.move_to_end(key)
            out.append(e)
            start += n
        return out


def encoder_for(path: Path, config: dict, dtype: Optional[mx.Dtype] = None
                ) -> Optional[ImageEncoder]:
    """An (unloaded) encoder when the checkpoint has a vision tower: its config describes
    one and its files hold its weights (text-only conversions keep the config alone)."""
    if not (isinstance(config.get("vision_config"), dict)
            and isinstance(config.get("image_token_id"), int)):
        return None
    headers = (read_safetensors_header(f) for f in sorted(path.glob("*.safetensors")))
    if not any(k.startswith(VISION_PREFIXES) for h in headers for k in h):
        return None
    return ImageEncoder(path, config, dtype)


def vision_weights(path: Path) -> dict:
    """The tower's tensors of the checkpoint at ``path`` (only files holding some are read)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        if any(k.startswith(VISION_PREFIXES) for k in read_safetensors_header(f)):
            out.update({k: v for k, v in load_safetensors(f).items()
                        if k.startswith(VISION_PREFIXES)})
    return out


def load_processor(path: Path, config: dict) -> ImageProcessor:
    """The image processor of the checkpoint at ``path`` (``config``: its config.json)."""
    proc_file = path / "preprocessor_config.json"
    if not proc_file.is_file():
        raise CheckpointError(f"{path} has no preprocessor_config.json: the image processor's "
                              "settings are missing")
    merge = VisionArgs.from_dict(config["vision_config"]).spatial_merge_size
    return ImageProcessor(read_json_object(proc_file), merge)


def load_tower(path: Path, config: dict, dtype: Optional[mx.Dtype] = None) -> VisionModel:
    """The vision tower of the checkpoint at ``path`` (``config``: its config.json);
    CheckpointError when it cannot be read."""
    tower = VisionModel(VisionArgs.from_dict(config["vision_config"]))
    weights = tower.sanitize(vision_weights(path))
    if not weights:
        raise CheckpointError(f"{path} has no vision tower weights (model.visual.*): it was "
                              "saved text-only")
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    try:
        tower.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(f"vision tower weights in {path} do not match "
                              f"vision_config: {e}") from e
    mx.eval(tower.parameters())
    return tower
