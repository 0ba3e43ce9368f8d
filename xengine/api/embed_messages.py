"""EPD disaggregation: the engine calls that move image embeddings between instances (msgspec structs).

Mirrors PD's KV messages (``KVExport`` / ``KVImport`` / ``KVRelease`` in ``messages.py``): an encode
instance pins the embeddings of some images (by content hash) in its Mooncake-registered staging
buffer and describes them (``EmbedExportInfo``); a prefill instance pulls them with one-sided reads
into its image-embedding cache (``EmbedImportResult``); the exporter's pin is then released.
Engine side: ``xengine/disagg/embed_transfer.py``. Torch-free: the service imports it.
"""

from __future__ import annotations

import msgspec


class EmbedEntry(msgspec.Struct, kw_only=True, frozen=True):
    """One image's embeddings ``[rows, hidden]`` of ``dtype`` at ``addr`` in the exporter's staging buffer."""

    content_hash: str
    addr: int
    rows: int
    hidden: int
    dtype: str
    num_bytes: int


class EmbedExportInfo(msgspec.Struct, kw_only=True):
    """An encode instance's pinned embeddings and where a peer reads them."""

    session: str  # "host:rpc_port" of the exporter's Mooncake transfer engine
    entries: list[EmbedEntry]
    missing: list[str] = []  # content hashes asked for that the exporter does not hold (evicted)


class EmbedImportResult(msgspec.Struct, kw_only=True):
    num_images: int  # images now in the importer's cache
    num_hit_images: int  # of those, already there (not transferred)
    num_bytes: int  # bytes transferred
    transfer_s: float


class EmbedExport(msgspec.Struct, tag="embed_export", kw_only=True):
    """Pin the cached embeddings of ``content_hashes`` under ``export_id``; answered with
    ``EmbedExportInfo`` (hashes not cached are listed in ``missing``)."""

    call_id: int
    export_id: str
    content_hashes: list[str]


class EmbedImport(msgspec.Struct, tag="embed_import", kw_only=True):
    """Pull ``source``'s embeddings this instance's image cache lacks into it; answered with
    ``EmbedImportResult``."""

    call_id: int
    source: EmbedExportInfo


class EmbedRelease(msgspec.Struct, tag="embed_release", kw_only=True):
    """Drop the export pin ``export_id`` (unknown ids are ignored)."""

    call_id: int
    export_id: str


EMBED_CALLS = (EmbedExport, EmbedImport, EmbedRelease)
