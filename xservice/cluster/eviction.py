"""``Evictions``: moving a running decode stream to another instance on the service's initiative.

Co-location (``colocation.py``) uses it to take offline decodes off a latency-strict instance when
its batch no longer holds the TPOT SLO (xLLM report §3.1: online load rises, offline work yields and
goes back to the latency-relaxed pool). The pool's stream loop (``InstancePool.stream``) does the
move: the sub-request on the old instance is aborted, the abort is kept from the client, and the
request continues as prompt + tokens so far on the target instance, where its prompt blocks are
usually still in the prefix cache (it prefilled there), so only the generated tokens are recomputed.
Greedy output is unchanged; nothing is streamed twice or lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xservice.cluster.remote_engine import RemoteEngineClient

logger = logging.getLogger(__name__)


class Evictions:
    def __init__(self, active: Callable[[str], tuple[RemoteEngineClient, str] | None]) -> None:
        self._active = active  # request id -> (instance client, sub-request id) running it now
        self._targets: dict[str, str] = {}  # request id -> instance to continue on, abort pending
        self.num_evicted = 0

    async def evict(self, req_id: str, to: str) -> bool:
        """Abort ``req_id`` where it runs and continue it on instance ``to``; False when it is not
        running (finished meanwhile), already moving, or already on ``to``."""
        active = self._active(req_id)
        if active is None or req_id in self._targets:
            return False
        client, sub_id = active
        if client.name == to:
            return False
        self._targets[req_id] = to
        try:
            await client.abort([sub_id])
        except Exception as e:  # noqa: BLE001 - the instance died: the pool's migration takes over
            self._targets.pop(req_id, None)
            logger.info("evicting %s from %s failed (%s)", req_id, client.name, e)
            return False
        self.num_evicted += 1
        logger.info("evicting %s from %s to %s", req_id, client.name, to)
        return True

    def pending(self, req_id: str) -> bool:
        return req_id in self._targets

    def take(self, req_id: str) -> str | None:
        """The target of ``req_id``'s pending eviction (its abort arrived), cleared."""
        return self._targets.pop(req_id, None)

    def discard(self, req_id: str) -> None:
        """``req_id``'s stream ended another way (finished before the abort took effect, or failed)."""
        self._targets.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._targets
