"""``EtcdStore``: the metadata store on etcd v3 (gRPC API) through ``aetcd``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aetcd
import aetcd.exceptions

from xengine.api.cluster.store.base import BaseMetadataStore, StoreUnavailableError, WatchEvent

RPC_TIMEOUT_S = 2


def _wrap(e: Exception) -> StoreUnavailableError:
    return StoreUnavailableError(f"etcd unavailable: {type(e).__name__}: {e}")


class EtcdStore(BaseMetadataStore):
    def __init__(self, host: str = "127.0.0.1", port: int = 2379) -> None:
        self.endpoint = f"{host}:{port}"
        self._client = aetcd.Client(host=host, port=port, timeout=RPC_TIMEOUT_S)

    async def _rpc(self, coro: Any) -> Any:
        try:
            return await coro
        except aetcd.exceptions.ClientError as e:
            raise _wrap(e) from e

    async def put(self, key: str, value: bytes, lease: int | None = None) -> int:
        resp = await self._rpc(self._client.put(key.encode(), bytes(value), lease=lease))
        return resp.header.revision

    async def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        c, k = self._client, key.encode()
        ok, _ = await self._rpc(
            c.transaction(
                compare=[c.transactions.version(k) == 0],
                success=[c.transactions.put(k, bytes(value), lease=lease)],
                failure=[],
            )
        )
        return bool(ok)

    async def get(self, key: str) -> bytes | None:
        resp = await self._rpc(self._client.get(key.encode()))
        return None if resp is None else resp.value

    async def delete(self, key: str) -> bool:
        resp = await self._rpc(self._client.delete(key.encode()))
        return bool(resp is not None and resp.deleted)

    async def get_prefix(self, prefix: str) -> tuple[dict[str, bytes], int]:
        resp = await self._rpc(self._client.get_prefix(prefix.encode()))
        return {kv.key.decode(): kv.value for kv in resp}, resp.header.revision

    async def grant_lease(self, ttl_s: float) -> int:
        lease = await self._rpc(self._client.lease(max(1, round(ttl_s))))
        return lease.id

    async def keepalive(self, lease: int) -> bool:
        reply = await self._rpc(self._client.refresh_lease(lease))
        return reply is not None and reply.TTL > 0

    async def revoke(self, lease: int) -> None:
        await self._rpc(self._client.revoke_lease(lease))

    async def watch_prefix(self, prefix: str, start_revision: int | None = None) -> AsyncIterator[WatchEvent]:
        watch = None
        try:
            watch = await self._client.watch_prefix(prefix.encode(), start_revision=start_revision)
            async for ev in watch:
                kind = "put" if ev.kind == "PUT" else "delete"
                yield WatchEvent(kind, ev.kv.key.decode(), ev.kv.value or b"", ev.kv.mod_revision)
        except aetcd.exceptions.ClientError as e:
            raise _wrap(e) from e
        finally:
            if watch is not None:
                try:
                    await watch.cancel()
                except Exception:  # noqa: BLE001 - the stream may already be gone
                    pass
        raise StoreUnavailableError("etcd watch stream ended")

    async def close(self) -> None:
        try:
            await self._client.close()
        except aetcd.exceptions.ClientError:
            pass
