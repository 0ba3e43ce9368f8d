"""EPD disaggregation, engine side: move image embeddings between instances' image-embedding caches.

Mirrors PD's KV transfer (``kv_transfer.py``) with a registered staging buffer in place of the KV
pool (a cache entry is a plain tensor that may be evicted any time): ``export`` copies cached
embeddings into the staging buffer and pins them; ``import_`` pulls the images its own cache lacks
with one batched one-sided read and puts them into its image cache, so its prefill encodes nothing.
The buffer is registered on first use, on the transfer engine PD already runs. See
``docs/multimodal.md`` (EPD).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memory.transfer import KVTransferAgent
from xengine.api.embed_messages import EmbedEntry, EmbedExportInfo, EmbedImportResult

logger = logging.getLogger("xengine.disagg.embed_transfer")

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024
DEFAULT_PIN_TIMEOUT_S = 60.0
ALIGN = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StagingAllocator:
    """First-fit byte ranges of one buffer; freed neighbours merge."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset

    def allocate(self, num_bytes: int) -> int | None:
        need = max(ALIGN, -(-num_bytes // ALIGN) * ALIGN)
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                self._free[i : i + 1] = [(off + need, length - need)] if length > need else []
                return off
        return None

    def free(self, offset: int, num_bytes: int) -> None:
        need = max(ALIGN, -(-num_bytes // ALIGN) * ALIGN)
        spans = sorted([*self._free, (offset, need)])
        merged: list[tuple[int, int]] = []
        for off, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free = merged

    @property
    def num_free_bytes(self) -> int:
        return sum(length for _, length in self._free)


@dataclass
class _Pin:
    ranges: list[tuple[int, int]]  # (offset, bytes) in the staging buffer
    deadline: float


class EmbedTransferManager:
    def __init__(
        self,
        images: object,  # xengine.multimodal.image_cache.ImageEmbeddingCache
        agent: Callable[[], KVTransferAgent],  # the instance's transfer agent (created on first use)
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        pin_timeout_s: float = DEFAULT_PIN_TIMEOUT_S,
    ) -> None:
        self.images = images
        self._agent_fn = agent
        self.staging_bytes = staging_bytes
        self.pin_timeout_s = pin_timeout_s
        self._staging: torch.Tensor | None = None
        self._base = 0
        self._alloc = StagingAllocator(staging_bytes)
        self._pins: dict[str, _Pin] = {}
        self.num_images_exported = 0
        self.num_images_imported = 0
        self.num_bytes_imported = 0

    def _start(self) -> KVTransferAgent:
        agent = self._agent_fn()
        if self._staging is None:
            staging = torch.empty(self.staging_bytes, dtype=torch.uint8)
            self._base = agent.register_buffer(staging)
            self._staging = staging
        return agent

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    # ------------------------------------------------------------------ encode side

    def export(self, export_id: str, content_hashes: list[str]) -> EmbedExportInfo:
        """Pin copies of the cached embeddings of ``content_hashes`` and describe them for a peer."""
        agent = self._start()
        self.expire()
        if export_id in self._pins:
            raise ValueError(f"invalid value for 'export_id': {export_id!r} is already pinned")
        entries, missing, ranges = [], [], []
        try:
            for h in dict.fromkeys(content_hashes):
                emb = self.images.get(h)
                if emb is None:
                    missing.append(h)
                    continue
                flat = emb.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1)
                off = self._reserve(flat.numel())
                ranges.append((off, flat.numel()))
                self._view(off, flat.numel()).copy_(flat)
                dtype = str(emb.dtype).replace("torch.", "")
                entries.append(
                    EmbedEntry(
                        content_hash=h,
                        addr=self._base + off,
                        rows=emb.shape[0],
                        hidden=emb.shape[1],
                        dtype=dtype,
                        num_bytes=flat.numel(),
                    )  # fmt: skip
                )
        except BaseException:
            self._free(ranges)
            raise
        self._pins[export_id] = _Pin(ranges, time.monotonic() + self.pin_timeout_s)
        self.num_images_exported += len(entries)
        return EmbedExportInfo(session=agent.region.session, entries=entries, missing=missing)

    # ------------------------------------------------------------------ prefill side

    def import_(self, source: EmbedExportInfo) -> EmbedImportResult:
        """Pull the images this instance's cache lacks (one batched read) and cache them."""
        t0 = time.perf_counter()
        agent = self._start()
        self.expire()
        wanted = [e for e in source.entries if not self.images.contains(e.content_hash)]
        for e in wanted:
            if e.dtype not in _DTYPES or e.num_bytes != e.rows * e.hidden * _DTYPES[e.dtype].itemsize:
                raise ValueError(f"invalid value for 'source': entry {e.content_hash[:12]} is malformed")
        ranges: list[tuple[int, int]] = []
        try:
            for e in wanted:
                ranges.append((self._reserve(e.num_bytes), e.num_bytes))
            agent.read_ranges(
                source.session,
                [e.addr for e in wanted],
                [self._base + off for off, _ in ranges],
                [e.num_bytes for e in wanted],
            )
            for e, (off, n) in zip(wanted, ranges):
                emb = self._view(off, n).clone().view(_DTYPES[e.dtype]).view(e.rows, e.hidden)
                self.images.put(e.content_hash, emb)
        finally:
            self._free(ranges)
        num_bytes = sum(e.num_bytes for e in wanted)
        self.num_images_imported += len(wanted)
        self.num_bytes_imported += num_bytes
        return EmbedImportResult(
            num_images=len(source.entries),
            num_hit_images=len(source.entries) - len(wanted),
            num_bytes=num_bytes,
            transfer_s=time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ pins and staging

    def release(self, export_id: str) -> bool:
        """Drop the pin ``export_id``; False when there was none."""
        pin = self._pins.pop(export_id, None)
        if pin is None:
            return False
        self._free(pin.ranges)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        for export_id in [p for p, pin in self._pins.items() if pin.deadline < now]:
            self.release(export_id)

    def _reserve(self, num_bytes: int) -> int:
        off = self._alloc.allocate(num_bytes)
        if off is None:
            raise RuntimeError(
                f"embedding staging buffer full ({self._alloc.num_free_bytes} of {self.staging_bytes} bytes "
                f"free, {num_bytes} needed)"
            )
        return off

    def _free(self, ranges: list[tuple[int, int]]) -> None:
        for off, n in ranges:
            self._alloc.free(off, n)

    def _view(self, offset: int, num_bytes: int) -> torch.Tensor:
        assert self._staging is not None
        return self._staging[offset : offset + num_bytes]


def embed_call(
    manager: EmbedTransferManager | None, msg: object, on_import: Callable | None = None
) -> object:
    """Answer one ``EmbedExport`` / ``EmbedImport`` / ``EmbedRelease`` with a ``UtilityResult``; a
    failure is reported, not fatal (``on_import(hashes)`` sees what an import brought in)."""
    from xengine.api.messages import EmbedExport, EmbedImport, UtilityResult

    call_id = msg.call_id  # type: ignore[attr-defined]
    try:
        if manager is None:
            raise ValueError("this instance has no image-embedding cache (not a vision-language model)")
        if isinstance(msg, EmbedExport):
            info = manager.export(msg.export_id, list(msg.content_hashes))
            return UtilityResult(call_id=call_id, embed_export=info)
        if isinstance(msg, EmbedImport):
            result = manager.import_(msg.source)
            if on_import is not None:
                on_import([e.content_hash for e in msg.source.entries])
            return UtilityResult(call_id=call_id, embed_import=result)
        return UtilityResult(call_id=call_id, ok=manager.release(msg.export_id))  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001
        logger.error("%s failed:\n%s", type(msg).__name__, traceback.format_exc())
        return UtilityResult(call_id=call_id, ok=False, error=f"{type(e).__name__}: {e}")
