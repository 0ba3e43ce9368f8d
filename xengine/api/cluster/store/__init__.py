"""Metadata store clients: one ABC, etcd, and the bridge to a service's embedded store."""

from __future__ import annotations

from xengine.api.cluster.store.base import BaseMetadataStore, StoreUnavailableError, WatchEvent
from xengine.api.security import ClusterKey


def open_store(url: str, key: ClusterKey | None = None) -> BaseMetadataStore:
    """``etcd://HOST:PORT`` (aetcd) or ``embedded+tcp://HOST:PORT`` (a service's embedded store, reached
    with the cluster ``key`` when the service authenticates its bridge)."""
    if url.startswith("etcd://"):
        from xengine.api.cluster.store.etcd import EtcdStore

        host, _, port = url.removeprefix("etcd://").rpartition(":")
        return EtcdStore(host or "127.0.0.1", int(port or 2379))
    if url.startswith("embedded+tcp://"):
        from xengine.api.cluster.store.bridge import BridgeStoreClient

        return BridgeStoreClient(url.removeprefix("embedded+"), key)
    raise ValueError(f"unknown metadata store url {url!r}; use etcd://HOST:PORT or embedded+tcp://HOST:PORT")


__all__ = ["BaseMetadataStore", "StoreUnavailableError", "WatchEvent", "open_store"]
