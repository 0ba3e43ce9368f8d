"""The service's embedded store served over loopback ZMQ, so engine processes register without etcd.

``StoreBridgeServer`` answers the ``StoreCall`` frames of engines' ``BridgeStoreClient``
(``xengine/api/cluster/store/bridge.py``) against an ``EmbeddedStore``. Frames are msgspec msgpack.
"""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from xengine.api.cluster.store.base import BaseMetadataStore
from xengine.api.cluster.store.bridge import StoreCall, StoreReply
from xengine.api.security import ClusterKey, ZapGuard, secure_server


class StoreBridgeServer:
    """Serves ``store`` on a ROUTER socket bound to ``addr`` (``tcp://127.0.0.1:0`` picks a port); with
    ``key``, only clients holding the cluster key get through the CURVE handshake."""

    def __init__(
        self, store: BaseMetadataStore, addr: str = "tcp://127.0.0.1:0", key: ClusterKey | None = None
    ) -> None:
        self._store = store
        self._ctx = zmq.asyncio.Context()
        self._guard = ZapGuard(self._ctx, key) if key is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            secure_server(self._sock, key)
        self._sock.bind(addr)
        self.addr = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._task = asyncio.get_running_loop().create_task(self._serve())
        self._decoder = msgspec.msgpack.Decoder(StoreCall)
        self._encoder = msgspec.msgpack.Encoder()

    async def _serve(self) -> None:
        while True:
            ident, _, frame = await self._sock.recv_multipart()
            try:
                reply = await self._answer(self._decoder.decode(frame))
            except Exception as e:  # noqa: BLE001 - report to the caller
                reply = StoreReply(ok=False, error=f"{type(e).__name__}: {e}")
            await self._sock.send_multipart([ident, b"", self._encoder.encode(reply)])

    async def _answer(self, call: StoreCall) -> StoreReply:
        s = self._store
        if call.op == "put":
            return StoreReply(number=await s.put(call.key, call.value, call.lease))
        if call.op == "create":
            return StoreReply(ok=await s.create(call.key, call.value, call.lease))
        if call.op == "get":
            return StoreReply(value=await s.get(call.key))
        if call.op == "delete":
            return StoreReply(ok=await s.delete(call.key))
        if call.op == "grant":
            return StoreReply(number=await s.grant_lease(call.ttl_s))
        if call.op == "keepalive":
            return StoreReply(ok=await s.keepalive(call.lease or 0))
        if call.op == "revoke":
            await s.revoke(call.lease or 0)
            return StoreReply()
        return StoreReply(ok=False, error=f"unknown op {call.op!r}")

    async def close(self) -> None:
        self._task.cancel()
        self._sock.close(linger=0)
        if self._guard is not None:
            await self._guard.aclose()
        self._ctx.term()
