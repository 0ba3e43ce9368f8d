"""EPD's part of cluster serving (``xservice/cluster/serve.py``): the dispatcher over a global image
index, and ``epd.strategy: auto``'s start-up profile. See ``docs/multimodal.md``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

from xservice.cluster.config import ClusterConfig
from xservice.cluster.epd.auto import EPDAuto, resolve_epd_auto
from xservice.cluster.epd.dispatcher import EPDDispatcher
from xservice.cluster.epd.image_index import ImageIndex
from xservice.config import XllmConfig
from xservice.policies import PDPolicy

if TYPE_CHECKING:
    from xservice.cluster.pool import InstancePool
    from xservice.cluster.registry import InstanceRegistry


async def resolve_auto(cfg: XllmConfig) -> EPDAuto:
    """``epd.strategy: auto``: profile (or reuse the cached profile) in a thread; cancelling the
    service stops the profile at its next step."""
    stop = threading.Event()
    try:
        return await asyncio.to_thread(resolve_epd_auto, cfg, stop)
    except asyncio.CancelledError:
        stop.set()
        raise


def make_epd(cl: ClusterConfig, pool: InstancePool, registry: InstanceRegistry) -> ImageIndex | None:
    """EPD (``cluster.epd.strategy``): the pool's dispatcher becomes ``EPDDispatcher`` over a global
    image index watching the store (None: no EPD)."""
    if cl.epd.strategy == "none":
        return None

    def incarnation_of(name: str) -> str | None:
        state = registry.instances.get(name)
        return state.record.incarnation if state is not None else None

    index = ImageIndex(registry.store, cl.registry.key_prefix, incarnation_of)
    registry.subscribe(lambda event, state, _: index.drop(state.record.name) if event == "down" else None)
    index.start()
    policy = PDPolicy(cl.routing.cache_match_weight)
    pool.pd = EPDDispatcher(pool, policy, cl.epd.strategy, index, cl.routing.cache_match_weight)
    return index
