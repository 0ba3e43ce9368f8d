"""``RemoteEngineClient``: an ``EngineClient`` for an engine that runs elsewhere and registered itself.

It connects to the addresses in the instance's ``InstanceRecord`` instead of spawning a process and
binding sockets; ``info`` comes from the record. It cannot watch a process, so whoever knows the
instance died (the registry on lease expiry or heartbeat gap, a launcher on process exit) calls
``mark_dead``: in-flight requests then fail with ``EngineDeadError`` (and the pool migrates them).
Closing it releases the sockets only; the engine belongs to its launcher (or runs standalone).
With a ``service_id`` its first frame is ``Hello``: the engine then aborts whatever a previous
service left running there.
"""

from __future__ import annotations

import asyncio

import msgspec

from xengine.api.cluster.keys import InstanceRecord
from xengine.api.embed_messages import (
    EmbedExport,
    EmbedExportInfo,
    EmbedImport,
    EmbedImportResult,
    EmbedRelease,
)
from xengine.api.messages import EngineInfo, Hello
from xengine.api.security import ClusterKey
from xservice.engine.client import EngineClient


class RemoteEngineClient(EngineClient):
    def __init__(self, record: InstanceRecord, key: ClusterKey | None = None) -> None:
        self.record = record
        super().__init__(record.input_addr, record.output_addr, bind=False, key=key)
        self.info = msgspec.convert(record.info, EngineInfo)

    @classmethod
    def connect(
        cls, record: InstanceRecord, service_id: str | None = None, key: ClusterKey | None = None
    ) -> RemoteEngineClient:
        """Connect to the instance (non-blocking; ZMQ reconnects by itself) and start routing outputs;
        with ``service_id``, say hello first (queued until the connection is up); with ``key``,
        authenticate with the cluster key (CURVE)."""
        client = cls(record, key)
        if service_id is not None:
            client._send(Hello(service_id=service_id))
        client._pump_task = asyncio.get_running_loop().create_task(
            client._pump(), name=f"remote-{record.name}"
        )
        return client

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def incarnation(self) -> str:
        return self.record.incarnation

    @property
    def pid(self) -> int:
        return self.record.pid

    def mark_dead(self, reason: str) -> None:
        """The instance is gone: fail every in-flight request and call now."""
        self._mark_dead(reason)

    # ------------------------------------------------------------------ EPD: image embeddings

    async def embed_export(
        self, export_id: str, content_hashes: list[str], timeout_s: float = 30.0
    ) -> EmbedExportInfo:
        """Encode side: pin the cached embeddings of ``content_hashes`` under ``export_id``."""
        result = await self._call_msg(
            lambda c: EmbedExport(call_id=c, export_id=export_id, content_hashes=content_hashes), timeout_s
        )
        if not result.ok or result.embed_export is None:
            raise RuntimeError(f"embedding export failed: {result.error}")
        return result.embed_export

    async def embed_import(self, source: EmbedExportInfo, timeout_s: float = 60.0) -> EmbedImportResult:
        """Prefill side: pull the embeddings of ``source`` its image cache lacks into it."""
        result = await self._call_msg(lambda c: EmbedImport(call_id=c, source=source), timeout_s)
        if not result.ok or result.embed_import is None:
            raise RuntimeError(f"embedding import failed: {result.error}")
        return result.embed_import

    async def embed_release(self, export_id: str, timeout_s: float = 5.0) -> bool:
        """Drop an embedding export pin; False when the engine had none under that id."""
        return (await self._call_msg(lambda c: EmbedRelease(call_id=c, export_id=export_id), timeout_s)).ok

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._mark_dead("the client was closed")
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._release()
