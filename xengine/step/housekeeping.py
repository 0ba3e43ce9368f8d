"""Between steps, whichever loop runs them: PD import pins let go, and a queue head that can never
run failed instead of spinning.

A decode instance pins the prompt KV it imported until its request is admitted
(``xengine/disagg/kv_transfer.py``); once a request holds its blocks its pin goes. When nothing could
be scheduled, expired pins go and, if the pool is all pinned by imported prompts of queued requests,
every import pin but the head's. When nothing could be scheduled although the whole pool is free,
the head of the queue can never fit: it ends with ``finish_reason`` "length".
"""

from __future__ import annotations

import logging

from memory.kv_cache_manager import KVCacheManager
from xengine.disagg.kv_transfer import KVTransferManager
from xengine.scheduler.plan import SchedulePlan
from xengine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class BetweenSteps:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, kv_transfer: KVTransferManager) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.kv_transfer = kv_transfer

    def pool_free(self) -> bool:
        """Every block of the pool is free (none held by a request or a pin)."""
        return self.kv.num_free_blocks == self.kv.pool.num_blocks

    def after_schedule(self, plan: SchedulePlan, pool_was_free: bool) -> None:
        """Once ``plan`` is scheduled (overlap: and the step before it applied). ``pool_was_free``:
        the whole pool was free, and no step in flight, when ``plan`` was scheduled."""
        if self.kv_transfer.num_pins:
            self.kv_transfer.release_admitted(self.kv.block_tables)
            if plan.is_empty:
                self._unpin_for_head()
        s = self.scheduler
        if plan.is_empty and pool_was_free and s.waiting:
            head = s.next_waiting()  # None: every waiting request held back (its KV still loading)
            if head is not None:
                s.fail(head, "length")  # nothing fits even with the whole pool free: never will

    def _unpin_for_head(self) -> None:
        """An empty step with requests waiting and none running: if imported prompts pinned for the
        queued requests hold the pool (PD decode under KV pressure), nothing would ever free a block
        for the first of them. Expired pins go first; then, if still stuck, every import pin but the
        head's (its blocks stay cached, so the others usually still hit them)."""
        self.kv_transfer.expire()
        if self.scheduler.running or not self.scheduler.waiting:
            return
        dropped = self.kv_transfer.release_waiting_imports(keep=self.scheduler.waiting[0].seq_id)
        if dropped:
            logger.warning("KV pool held by %d imported prompts of queued requests: unpinned them", dropped)
