"""Image embeddings for prefill steps: encode each image once, keep it while its prompt is computed,
and keep recent ones instance-wide (LRU by content hash, bounded in bytes) so a repeated image skips
the encoder.

A request holds its images' embeddings from the step that first needs them until its prefill has
passed the last image (chunked prefill reads one image across several steps; a preempted request
keeps them for its recomputation). Everything here runs on the thread that runs the forward, except
``release`` (the engine thread), hence the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from xengine.api.multimodal import ImageInput

Encoder = Callable[[torch.Tensor, Sequence[tuple[int, int, int]]], torch.Tensor]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ImagePiece:
    """Rows ``[row_start, row_end)`` of one image's embeddings go to the step's tokens from ``dest``."""

    seq_id: str
    image: ImageInput
    row_start: int
    row_end: int
    dest: int


class ImageEmbeddingCache:
    def __init__(self, encode: Encoder, device: torch.device, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.encode = encode
        self.device = device
        self.max_bytes = max_bytes
        self._lru: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._held: dict[str, dict[str, torch.Tensor]] = {}  # seq_id -> its images' embeddings
        self._lock = threading.Lock()
        self.num_encodes = 0  # images run through the encoder
        self.num_hits = 0  # a request's image found in the instance cache (no encode for it)
        self.num_encoded_tokens = 0  # image tokens (pads) of the images encoded

    def gather(self, pieces: list[ImagePiece]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeddings [N, hidden], token indexes [N])`` of the step's image pieces."""
        with self._lock:
            missing: dict[str, ImagePiece] = {}  # content hash -> the first piece that needs it
            for p in pieces:
                held = self._held.setdefault(p.seq_id, {})
                h = p.image.content_hash
                if h in held:
                    continue
                cached = self._lru.get(h)
                if cached is not None:
                    self._lru.move_to_end(h)
                    held[h] = cached
                    self.num_hits += 1
                elif h not in missing:
                    missing[h] = p
            if missing:
                fresh = self._encode([m.image for m in missing.values()])
                for p in pieces:  # requests of this step sharing a fresh image: one encode
                    held = self._held[p.seq_id]
                    if p.image.content_hash not in held:
                        held[p.image.content_hash] = fresh[p.image.content_hash]
                        self.num_hits += missing[p.image.content_hash].seq_id != p.seq_id
            rows = [self._held[p.seq_id][p.image.content_hash][p.row_start : p.row_end] for p in pieces]
        at = torch.cat([torch.arange(p.dest, p.dest + p.row_end - p.row_start) for p in pieces])
        return torch.cat(rows), at.to(self.device)

    def encode_for(self, jobs: list[tuple[str, list[ImageInput]]]) -> None:
        """The encode stage: give each ``(seq_id, images)`` its images' embeddings (held until its
        prefill is past them), encoding those the instance cache lacks in one batch."""
        with self._lock:
            found: dict[str, torch.Tensor] = {}
            missing: dict[str, tuple[str, ImageInput]] = {}  # hash -> (the sequence encoding it, image)
            for seq_id, images in jobs:
                for im in images:
                    h = im.content_hash
                    if h in found or (h in missing and missing[h][0] != seq_id):
                        self.num_hits += 1
                    elif h in self._lru:
                        self._lru.move_to_end(h)
                        found[h] = self._lru[h]
                        self.num_hits += 1
                    else:
                        missing.setdefault(h, (seq_id, im))
            if missing:
                found.update(self._encode([im for _, im in missing.values()]))
            for seq_id, images in jobs:
                held = self._held.setdefault(seq_id, {})
                for im in images:
                    held[im.content_hash] = found[im.content_hash]

    def _encode(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Run the encoder once over ``images``; their embeddings by content hash (also cached)."""
        patches = torch.cat([_pixels(im) for im in images]).to(self.device)
        out = self.encode(patches, [tuple(im.grid_thw) for im in images])
        fresh = dict(zip((im.content_hash for im in images), out.split([im.length for im in images])))
        for content_hash, emb in fresh.items():
            self._put(content_hash, emb)
        self.num_encodes += len(images)
        self.num_encoded_tokens += sum(im.length for im in images)
        return fresh

    def _put(self, content_hash: str, emb: torch.Tensor) -> None:
        """Into the LRU (held requests keep their own reference if it is evicted later)."""
        size = emb.numel() * emb.element_size()
        self._lru[content_hash] = emb
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._lru) > 1:
            _, old = self._lru.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def get(self, content_hash: str) -> torch.Tensor | None:
        """The cached embeddings ``[length, hidden]`` of an image, None when not cached."""
        with self._lock:
            emb = self._lru.get(content_hash)
            if emb is not None:
                self._lru.move_to_end(content_hash)
            return emb

    def hashes(self) -> list[str]:
        """Content hashes of the cached images (what an instance publishes for EPD routing)."""
        with self._lock:
            return list(self._lru)

    def contains(self, content_hash: str) -> bool:
        with self._lock:
            return content_hash in self._lru

    def put(self, content_hash: str, emb: torch.Tensor) -> None:
        """Cache embeddings computed elsewhere (EPD: pulled from an encode instance)."""
        with self._lock:
            if content_hash not in self._lru:
                self._put(content_hash, emb.to(self.device))

    def clear(self) -> None:
        """Forget every cached image (held embeddings stay with their requests)."""
        with self._lock:
            self._lru.clear()
            self._bytes = 0

    def done(self, seq_ids: list[str]) -> None:
        """These sequences' prefill is past their images: drop what they hold."""
        self.release(seq_ids)

    def release(self, seq_ids: list[str]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._held.pop(seq_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)


def _pixels(im: ImageInput) -> torch.Tensor:
    data = torch.frombuffer(bytearray(im.pixel_values), dtype=_DTYPES[im.dtype])
    return data.view(*im.shape)
