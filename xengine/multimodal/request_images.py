"""A request's images as the engine keeps them: validated once, when the request arrives.

Besides the images themselves it holds what every later step reads: the prompt's M-RoPE position
ids (``[3, P]``) and the offset of outputs' positions (``delta``), and the prompt as the prefix cache
keys it: each image's pad tokens replaced by a key derived from the image's content hash (negative,
so never a token id), so blocks of two different images never match while a repeated image does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xengine.api.image_keys import image_cache_key
from xengine.api.messages import AddRequest
from xengine.api.multimodal import PIXEL_DTYPES, ImageInput, num_image_tokens, pixel_hash
from xengine.models.mrope import mrope_positions

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class VisionSpec:
    """What the model's vision tower takes (``image_token_id``, merge size, one patch's values)."""

    image_token_id: int
    merge_size: int
    patch_dim: int


def vision_spec(model: object) -> VisionSpec | None:
    """What ``model``'s vision tower takes; None for a text-only model."""
    visual = getattr(model, "visual", None)
    if visual is None or not hasattr(model, "image_token_id"):
        return None
    c = visual.config
    return VisionSpec(
        model.image_token_id, c.merge_size, c.in_channels * c.temporal_patch_size * c.patch_size**2
    )


@dataclass
class RequestImages:
    images: list[ImageInput]  # by offset
    positions: np.ndarray  # [3, P] int64 M-RoPE ids of the prompt
    delta: int  # output token at index i sits at position i + delta
    cache_prompt_ids: list[int]  # the prompt as the prefix cache keys it
    images_end: int  # index after the last image pad: the prefill past it needs no image
    # the encode stage (``encode_stage.py``): images [0, num_encoded) have embeddings; the plan
    # index of the job in flight
    num_encoded: int = 0
    encode_plan: int | None = None

    @property
    def encoded(self) -> bool:
        """Every image has embeddings (or needs none): the prefill may be scheduled."""
        return self.num_encoded >= len(self.images)

    @classmethod
    def build(cls, prompt_ids: list[int], images: list[ImageInput], spec: VisionSpec) -> RequestImages:
        """Validate ``images`` against the prompt and the vision tower; ``ValueError`` naming the problem."""
        images = sorted(images, key=lambda im: im.offset)
        keyed = list(prompt_ids)
        prev_end = 0
        for i, im in enumerate(images):
            _check_image(i, im, spec)
            if im.offset < prev_end or im.offset + im.length > len(prompt_ids):
                raise ValueError(
                    f"invalid value for 'images': image {i} overlaps another or runs past the prompt"
                )
            span = prompt_ids[im.offset : im.offset + im.length]
            if any(t != spec.image_token_id for t in span):
                raise ValueError(
                    f"invalid value for 'images': image {i}'s tokens {im.offset}..{im.offset + im.length - 1} "
                    "are not all image-pad tokens"
                )
            keyed[im.offset : im.offset + im.length] = [image_cache_key(im.content_hash)] * im.length
            prev_end = im.offset + im.length
        num_pads = sum(1 for t in prompt_ids if t == spec.image_token_id)
        if num_pads != sum(im.length for im in images):
            raise ValueError(
                f"invalid value for 'prompt': {num_pads} image-pad tokens, but the images fill "
                f"{sum(im.length for im in images)}"
            )
        spans = [(im.offset, im.length, im.grid_thw) for im in images]
        positions, delta = mrope_positions(len(prompt_ids), spans, spec.merge_size)
        return cls(images, positions, delta, keyed, prev_end)

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """``[3, end - start]`` position ids of the tokens at indexes ``start .. end - 1``."""
        num_prompt = self.positions.shape[1]
        if end <= num_prompt:
            return self.positions[:, start:end]
        tail = np.arange(max(start, num_prompt), end, dtype=np.int64) + self.delta
        head = self.positions[:, start:num_prompt] if start < num_prompt else self.positions[:, :0]
        return np.concatenate([head, np.broadcast_to(tail, (3, tail.size))], axis=1)


def request_images(
    req: AddRequest, spec: VisionSpec | None, model_name: str, expert_parallel: bool = False
) -> RequestImages | None:
    """The validated images of ``req`` (None: it has none); ``ValueError`` naming the field when they
    cannot be served."""
    if not req.images:
        return None
    if spec is None:
        raise ValueError(f"invalid value for 'images': model {model_name!r} does not take images")
    if expert_parallel:
        raise ValueError(
            "invalid value for 'images': images are not supported with expert or tensor parallelism yet"
        )
    if req.params.use_beam_search:
        raise ValueError("invalid value for 'images': beam search over image prompts is not supported yet")
    return RequestImages.build(list(req.prompt_token_ids), list(req.images or ()), spec)


def _check_image(i: int, im: ImageInput, spec: VisionSpec) -> None:
    where = f"invalid value for 'images': image {i}"
    if im.dtype not in PIXEL_DTYPES:
        raise ValueError(f"{where}: dtype {im.dtype!r} is not one of {list(PIXEL_DTYPES)}")
    t, h, w = im.grid_thw
    m = spec.merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(
            f"{where}: grid_thw {tuple(im.grid_thw)} must be positive with h, w multiples of {m}"
        )
    if tuple(im.shape) != (t * h * w, spec.patch_dim):
        raise ValueError(
            f"{where}: shape {tuple(im.shape)} is not ({t * h * w}, {spec.patch_dim}) for its grid"
        )
    if len(im.pixel_values) != im.shape[0] * im.shape[1] * _ITEMSIZE[im.dtype]:
        raise ValueError(
            f"{where}: pixel_values holds {len(im.pixel_values)} bytes, not {tuple(im.shape)} {im.dtype}"
        )
    if im.length != num_image_tokens(im.grid_thw, m):
        raise ValueError(
            f"{where}: length {im.length} is not {num_image_tokens(im.grid_thw, m)} for its grid"
        )
    # the caches key on it: a wrong hash would serve this image's embeddings (or KV) for another
    if im.content_hash != pixel_hash(im.pixel_values, im.shape, im.dtype, im.grid_thw):
        raise ValueError(
            f"{where}: content_hash is not the sha256 of its pixels (xengine.api.multimodal.pixel_hash)"
        )
