"""Requests with ``n > 1`` sequences: sequence 0 is scheduled alone through its prompt and forks its
``n - 1`` siblings when it samples its first tokens (the KV of the prompt shared, copy on write).

A mixin of ``Scheduler`` (``scheduler.py``), like ``beams.py``: it uses the scheduler's KV manager
and queues.
"""

from __future__ import annotations

from memory.kv_cache_manager import KVCacheManager
from xengine.request import Request, RequestStatus
from xengine.scheduler.plan import SampledToken


class ForkScheduling:
    kv: KVCacheManager
    running: list[Request]
    seqs: dict[str, Request]
    groups: dict[str, list[str]]

    # provided by ``Scheduler``
    def _append_token(self, req: Request, sample: SampledToken, num_output: int | None = None) -> None:
        raise NotImplementedError

    def _push_waiting(self, req: Request) -> None:
        raise NotImplementedError

    def _apply_samples(self, req: Request, samples: list[SampledToken]) -> None:
        if not req.num_pending_forks:  # one sequence, one token
            self._append_token(req, samples[0])
            return
        children = [self._fork(req, i + 1) for i in range(req.num_pending_forks)]
        req.num_pending_forks = 0
        for seq, sample in zip([req, *children], samples):
            self._append_token(seq, sample)

    @staticmethod
    def _sibling(parent: Request, index: int, **state: object) -> Request:
        """Sequence ``index`` of an ``n > 1`` request: the parent's prompt and params, its own id."""
        return Request(
            seq_id=f"{parent.req_id}#{index}",
            req_id=parent.req_id,
            index=index,
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            priority=parent.priority,
            arrival_time=parent.arrival_time,
            num_cached_tokens=parent.num_cached_tokens,
            grammar=parent.grammar,
            mm=parent.mm,
            **state,
        )

    def _fork(self, parent: Request, index: int) -> Request:
        child = self._sibling(
            parent,
            index,
            output_token_ids=list(parent.output_token_ids),
            admitted_once=True,
            prompt_logprobs_end=parent.num_prompt_tokens,  # sequence 0 reports the prompt's logprobs
        )
        self.seqs[child.seq_id] = child
        self.groups[parent.req_id].append(child.seq_id)
        if self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens):
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:  # no block for the copy: recompute it later
            self._push_waiting(child)
        return child
