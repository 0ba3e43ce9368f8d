"""The engine as a cluster instance runs it: timed for the agent's load report and performance samples.

``engine_server`` wraps its engine in ``ObservedEngine`` so that every request's first token and
output tokens are timed, the raw prefill and step samples reach the ``ClusterAgent`` (the service's
TTFT / TPOT predictors learn from them), and refused handshakes show in the engine's stats.
"""

from __future__ import annotations

import time
from typing import Any

from xengine.api.messages import AddRequest, CompletionDelta, EngineStats
from xengine.api.security import ZapGuard
from xengine.process.cluster_agent import ClusterAgent


class ObservedEngine:
    """Wraps the engine to time first tokens and output tokens for the agent's load report, to hand
    it the raw prefill and step samples of the service's performance models, and to report refused
    handshakes in its stats.

    A prefill sample is taken at a request's first token: its uncached prompt tokens, its queue time
    (the engine's ``queue_time_s``, which comes on its first delta) and the rest of its time to
    first token as compute. Requests whose first token comes without a queue time (beam search
    sends none) give no prefill sample."""

    def __init__(self, engine: Any, agent: ClusterAgent, guard: ZapGuard | None = None) -> None:
        self._engine = engine
        self._agent = agent
        self._guard = guard
        self._started: dict[str, float] = {}
        self._first: dict[str, tuple[float, int]] = {}  # req_id -> (first token time, tokens since)
        self._queue_s: dict[str, float] = {}  # req_id -> queue time, until its first token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, req: AddRequest) -> None:
        received = time.monotonic()  # not after: the engine's queue time starts inside add_request
        self._engine.add_request(req)
        self._started[req.req_id] = received

    def get_stats(self) -> EngineStats:
        stats = self._engine.get_stats()
        if self._guard is not None:
            stats.num_auth_denied = self._guard.num_denied
        return stats

    def step(self) -> list[CompletionDelta]:
        deltas = self._engine.step()
        now = time.monotonic()
        self._observe_steps()
        for d in deltas:
            if d.queue_time_s is not None and d.req_id in self._started:
                self._queue_s[d.req_id] = d.queue_time_s
        for d in deltas:
            if d.req_id in self._started and d.new_token_ids:
                ttft_s = now - self._started.pop(d.req_id)
                self._agent.observe_ttft(ttft_s * 1000)
                queue_s = self._queue_s.pop(d.req_id, None)
                if queue_s is not None:
                    uncached = d.num_prompt_tokens - d.num_cached_tokens
                    self._agent.observe_prefill(uncached, queue_s, max(0.0, ttft_s - queue_s))
                self._first[d.req_id] = (now, len(d.new_token_ids) - 1)
            elif d.req_id in self._first:
                t0, n = self._first[d.req_id]
                self._first[d.req_id] = (t0, n + len(d.new_token_ids))
            if d.finish_reason is not None:
                self._started.pop(d.req_id, None)
                self._queue_s.pop(d.req_id, None)
                t0, n = self._first.pop(d.req_id, (now, 0))
                if n > 0:
                    self._agent.observe_tpot((now - t0) * 1000 / n)
        return deltas

    def _observe_steps(self) -> None:
        timing = self._engine.last_step_timing
        for s in timing.completed if timing is not None else ():
            self._agent.observe_step(s.num_seqs, s.context_tokens, s.prefill_tokens, s.step_s)
