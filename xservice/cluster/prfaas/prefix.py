"""A cached prefix brought to the instance that prefills (PrfaaS with bandwidth to spare, paper section
3.4.3): when the longest cached prefix of a prompt sits in the other cluster (or on another instance),
the prefill instance first pulls those blocks from it -- an export there, an import here (the PD
hand-off's own calls), pinned until the prefill is admitted -- and computes only the rest. Across the
PrfaaS link (a PrfaaS holder, a local prefill) the transfer counts on the link meter.

Best effort: on any failure the prefill computes what its own cache lacks.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from xservice.cluster.prfaas.link import transfer
from xservice.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

_ERRORS = (EngineDeadError, RuntimeError, TimeoutError, asyncio.TimeoutError)


async def bring_prefix(
    router: Any, kv_ids: list[int], source: Any, client: Any, pin_id: str, timeout_s: float
) -> bool:
    """Pull ``kv_ids``' cached prefix from ``source`` into ``client``, pinned for the request ``pin_id``;
    whether any block moved."""
    export_id = f"{pin_id}~h"
    try:
        info = await source.kv_export(export_id, kv_ids, timeout_s)
    except _ERRORS as e:
        logger.info("prefix export for %s from %s failed (%s)", pin_id, source.name, e)
        return False
    meter, expected = None, 0.0
    if router is not None and router.owns(source) and not router.owns(client):  # the PrfaaS egress
        meter = router.meter
        expected = router.learn_export(
            len(info.block_ids), info.block_bytes, info.num_layers, info.block_size
        )
    try:
        with transfer(meter, expected) as t:
            result = await client.kv_import(info, kv_ids, pin_id, timeout_s)
            if t is not None:
                t["bytes"], t["seconds"] = result.num_bytes, result.transfer_s
    except _ERRORS as e:
        logger.info("prefix import for %s into %s failed (%s)", pin_id, client.name, e)
        return False
    finally:
        if source.is_alive:  # the export pin is not needed any more (it also expires by itself)
            asyncio.get_running_loop().create_task(_release(source, export_id))
    if router is not None:
        router.counts["prefix_transfers"] += 1
        router.counts["prefix_tokens"] += result.num_transferred_blocks * info.block_size
    return result.num_transferred_blocks > 0


async def _release(source: Any, export_id: str) -> None:
    try:
        await source.kv_release(export_id)
    except _ERRORS:
        pass
