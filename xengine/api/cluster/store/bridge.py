"""The client side of a service's embedded store over loopback ZMQ (engines register without etcd).

``BridgeStoreClient`` (in an engine's cluster agent) implements the write side of
``BaseMetadataStore`` with ``StoreCall`` frames; the service answers them against its embedded store
(``xservice/cluster/store/bridge_server.py``). Watching stays in the service, next to the store.
Frames are msgspec msgpack (never pickle).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from xengine.api.cluster.store.base import BaseMetadataStore, StoreUnavailableError, WatchEvent
from xengine.api.security import ClusterKey, secure_client

CALL_TIMEOUT_S = 2.0


class StoreCall(msgspec.Struct, kw_only=True):
    op: str
    key: str = ""
    value: bytes = b""
    lease: int | None = None
    ttl_s: float = 0.0


class StoreReply(msgspec.Struct, kw_only=True):
    ok: bool = True
    value: bytes | None = None
    number: int = 0
    error: str | None = None


class BridgeStoreClient(BaseMetadataStore):
    """Client of a ``StoreBridgeServer`` (no watch, no prefix reads: those stay in the service)."""

    def __init__(self, addr: str, key: ClusterKey | None = None) -> None:
        self._addr = addr
        self._key = key
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StoreReply)

    async def _call(self, call: StoreCall) -> StoreReply:
        async with self._lock:
            if self._sock is None:
                self._sock = self._ctx.socket(zmq.REQ)
                self._sock.setsockopt(zmq.LINGER, 0)
                if self._key is not None:
                    secure_client(self._sock, self._key)
                self._sock.connect(self._addr)
            await self._sock.send(self._encoder.encode(call))
            if not await self._sock.poll(int(CALL_TIMEOUT_S * 1000)):
                self._sock.close(linger=0)  # a REQ socket without its reply is stuck: start over
                self._sock = None
                raise StoreUnavailableError(f"embedded store at {self._addr} did not answer")
            reply = self._decoder.decode(await self._sock.recv())
        if reply.error is not None:
            raise ValueError(reply.error)
        return reply

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        return (await self._call(StoreCall(op="put", key=key, value=value, lease=lease))).number

    async def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        return (await self._call(StoreCall(op="create", key=key, value=value, lease=lease))).ok

    async def get(self, key: str) -> bytes | None:
        return (await self._call(StoreCall(op="get", key=key))).value

    async def delete(self, key: str) -> bool:
        return (await self._call(StoreCall(op="delete", key=key))).ok

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        raise NotImplementedError("prefix reads go to the service's embedded store directly")

    async def grant_lease(self, ttl_s: float) -> int:
        return (await self._call(StoreCall(op="grant", ttl_s=ttl_s))).number

    async def keepalive(self, lease: int) -> bool:
        return (await self._call(StoreCall(op="keepalive", lease=lease))).ok

    async def revoke(self, lease: int) -> None:
        await self._call(StoreCall(op="revoke", lease=lease))

    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        raise NotImplementedError("watches go to the service's embedded store directly")

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()
