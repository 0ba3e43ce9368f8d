"""Keyed store bridges opened one after another in one process (a benchmark opening two clusters, a
service restarted in-process): each answers its clients.

pyzmq's asyncio ZAP authenticator only cancels its poll task on stop; unless the bridge awaits it, the
task's late clean-up unregisters a descriptor the next bridge's socket may have reused, and that
bridge never answers.
"""

from __future__ import annotations

import asyncio

from xengine.api.cluster.store.bridge import BridgeStoreClient
from xengine.api.security import ClusterKey
from xservice.cluster.store.bridge_server import StoreBridgeServer
from xservice.cluster.store.embedded import EmbeddedStore


def test_keyed_bridges_in_sequence_each_answer() -> None:
    async def main() -> list[bytes | None]:
        key, store, out = ClusterKey.generate(), EmbeddedStore(), []
        bridge = StoreBridgeServer(store, key=key)
        for i in range(3):
            client = BridgeStoreClient(bridge.addr, key)
            await client.put("/k", b"v%d" % i)
            out.append(await client.get("/k"))
            await client.close()
            await bridge.close()
            bridge = StoreBridgeServer(store, key=key)  # at once, as a second cluster would
        await bridge.close()
        await store.close()
        return out

    assert asyncio.run(asyncio.wait_for(main(), 60)) == [b"v0", b"v1", b"v2"]
