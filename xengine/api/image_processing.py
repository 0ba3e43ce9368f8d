"""Qwen2-VL image preprocessing in numpy + Pillow (torch-free: the service runs it, not the engine loop).

Matches ``transformers``' ``Qwen2VLImageProcessorPil``: RGB (transparency composited onto white),
bicubic resize so both sides are multiples of ``patch_size * merge_size`` with the pixel count kept
within ``[min_pixels, max_pixels]``, rescale, normalise, then cut into patches laid out merge-block by
merge-block (the order the encoder's patch merger expects), each patch repeated over the temporal
patch (a still image is a one-frame video).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xengine.api.multimodal import ImageInput, num_image_tokens, pixel_hash

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The fields of ``preprocessor_config.json`` the Qwen2-VL processor uses."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3  # PIL.Image.BICUBIC

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ImageProcessorConfig:
        size = cfg.get("size") or {}
        return cls(
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
            patch_size=int(cfg.get("patch_size", cls.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", cls.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", cls.merge_size)),
            image_mean=tuple(float(x) for x in cfg.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(float(x) for x in cfg.get("image_std", _CLIP_STD)),
            rescale_factor=float(cfg.get("rescale_factor", cls.rescale_factor)),
            do_resize=bool(cfg.get("do_resize", True)),
            do_rescale=bool(cfg.get("do_rescale", True)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            resample=int(cfg.get("resample", 3)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessorConfig | None:
        """The folder's ``preprocessor_config.json``; None when it has none (a text-only model)."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return None
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` rounded to multiples of ``factor``, scaled (aspect kept) into the pixel range."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} is over {MAX_ASPECT_RATIO}"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def to_rgb(image: Any) -> Any:
    """A PIL image in RGB; transparent pixels composited onto white (as HF does)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


class ImageProcessor:
    """PIL image -> (patches [N, C * T * P * P] float32, grid (t, h, w)) for one Qwen2-VL model."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessor | None:
        config = ImageProcessorConfig.from_dir(model_dir)
        return None if config is None else cls(config)

    def __call__(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        c = self.config
        image = to_rgb(image)
        if c.do_resize:
            factor = c.patch_size * c.merge_size
            h, w = smart_resize(image.height, image.width, factor, c.min_pixels, c.max_pixels)
            image = image.resize((w, h), resample=c.resample)
        pixels = np.asarray(image)  # [H, W, 3] uint8
        if c.do_rescale:
            pixels = (pixels.astype(np.float64) * c.rescale_factor).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if c.do_normalize:
            mean = np.asarray(c.image_mean, dtype=np.float32)
            std = np.asarray(c.image_std, dtype=np.float32)
            pixels = (pixels - mean) / std
        return self.patchify(np.ascontiguousarray(pixels.transpose(2, 0, 1)))

    def patchify(self, chw: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[C, H, W] -> rows of patches in merge-block order, each patch repeated over time."""
        c = self.config
        channels, height, width = chw.shape
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        gh, gw = height // p, width // p
        x = chw.reshape(channels, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, row in block, col in block, C, py, px)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
        return np.ascontiguousarray(x.reshape(gh * gw, channels * tp * p * p), dtype=np.float32), (1, gh, gw)

    def image_input(self, image: Any, offset: int = 0) -> ImageInput:
        """The ``ImageInput`` of ``image`` (placeholder ``offset`` set later by the prompt builder)."""
        patches, grid = self(image)
        data = patches.tobytes()
        return ImageInput(
            content_hash=pixel_hash(data, patches.shape, "float32", grid),
            pixel_values=data,
            shape=(int(patches.shape[0]), int(patches.shape[1])),
            dtype="float32",
            grid_thw=grid,
            offset=offset,
            length=num_image_tokens(grid, self.config.merge_size),
        )
