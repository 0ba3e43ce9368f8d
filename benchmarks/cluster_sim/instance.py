"""One simulated instance: the engine's continuous batching over a device profile.

Each step runs every decoding sequence's next token and, in the token budget left, prefill chunks from
the head of its prefill queue (the engine's one-token-budget scheduler: decodes first, then prompts,
chunked). The step takes ``DeviceProfile.step_seconds`` of its shape, computed from running sums, so a
step costs O(1) plus the sequences that start or end in it: a decoding sequence's last step is known
when it joins (a heap of end steps), its context grows with the step count.

KV: a request reserves its prompt and output on the instance that will decode it (what the service's
placement counts); it waits in the instance's queue while the pool cannot hold it.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from benchmarks.cluster_sim.trace import SimRequest
from ops.platforms.device_profile import DeviceProfile


@dataclass
class _Prefill:
    req: SimRequest
    done: int = 0  # prompt tokens computed
    decode_here: bool = True  # colocated / kept: decodes on this instance after its prefill
    reserve: int = 0  # KV it holds here while queued and prefilling


@dataclass
class Finished:
    """What a step completed: prefills (their first token now) and decodes (their last token now)."""

    prefilled: list[_Prefill] = field(default_factory=list)
    decoded: list[int] = field(default_factory=list)  # request ids


class SimInstance:
    def __init__(
        self,
        index: int,
        profile: DeviceProfile,
        role: str = "mixed",
        budget: int = 2048,
        max_seqs: int = 256,
        capacity_tokens: int | None = None,
        host_ms: float = 0.0,
    ) -> None:
        self.index, self.name = index, f"i{index}"
        self.profile, self.role, self.origin = profile, role, role
        self.budget, self.max_seqs = budget, max_seqs
        self.host_s = host_ms / 1000  # host work of each step, beside the device's
        self.capacity = capacity_tokens or profile.kv_capacity_tokens
        self.queue: deque[_Prefill] = deque()  # admitted prompts, FCFS
        self.waiting: deque[_Prefill] = deque()  # not admitted yet (KV)
        self.ends: list[tuple[int, int]] = []  # (last step, request id) of decoding sequences
        self.num_decoding = 0
        self.ctx_sum = 0  # context tokens of the decoding sequences (before this step's token)
        self.reserved = 0  # KV promised: prompt + output of the requests it holds
        self.steps = 0
        self.busy = False
        self.busy_s = 0.0
        self.prefill_busy_s = 0.0  # steps that carried a prefill
        self.last_decode_step_s: float | None = None
        self.last_flip_at: float | None = None
        self.busy_since: float | None = None  # its decode steps over the TPOT SLO since then
        self._prefill_steps: deque[tuple[float, float]] = deque()  # (end, duration) of prefill steps
        self._prefill_window_s = 0.0  # their durations' sum
        self.num_prefilled = 0
        self.queued_tokens = 0  # prompt tokens still to prefill here (queued and waiting)
        self.num_inflight = 0  # requests routed here and not finished (the service's count)
        self._step: tuple[int, list[tuple[_Prefill, int]]] | None = None  # (decodes, chunks) in flight

    # ------------------------------------------------------------------ work in
    def add_prefill(self, req: SimRequest, decode_here: bool, reserve: int) -> None:
        p = _Prefill(req, decode_here=decode_here, reserve=reserve)
        self.queued_tokens += req.prompt
        if self.waiting or self.reserved + reserve > self.capacity:
            self.waiting.append(p)
        else:
            self.reserved += reserve
            self.queue.append(p)

    def add_decode(self, req: SimRequest) -> None:
        """A prefilled request (its KV here) decodes its ``output - 1`` remaining tokens."""
        self.reserved += req.prompt + req.output
        self._join(req)

    def _join(self, req: SimRequest) -> None:
        if req.output <= 1:
            return
        heapq.heappush(self.ends, (self.steps + req.output - 1, req.rid))
        self.num_decoding += 1
        self.ctx_sum += req.prompt + 1

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
        while self.waiting and self.reserved + self.waiting[0].reserve <= self.capacity:
            p = self.waiting.popleft()
            self.reserved += p.reserve
            self.queue.append(p)

    # ------------------------------------------------------------------ steps
    @property
    def has_work(self) -> bool:
        return bool(self.num_decoding or self.queue)

    def prefill_busy_window(self, now: float, window: float) -> float:
        """Seconds of the last ``window`` it spent in steps that carried a prefill."""
        steps = self._prefill_steps
        while steps and steps[0][0] < now - window:
            self._prefill_window_s -= steps.popleft()[1]
        return self._prefill_window_s

    def start_step(self, now: float) -> float:
        """Plan the next step (starting ``now``); its duration."""
        left = self.budget - self.num_decoding
        chunks: list[tuple[_Prefill, int]] = []
        tokens, pairs = self.num_decoding, self.ctx_sum  # a decode reads its context (s - 1 cached)
        for p in self.queue:
            if left <= 0 or self.num_decoding + len(chunks) >= self.max_seqs:
                break
            q = min(left, p.req.prompt - p.done)
            chunks.append((p, q))
            tokens += q
            pairs += q * p.done
            left -= q
        seqs = self.num_decoding + len(chunks)
        prof = self.profile
        ms = prof.base_ms + prof.tokens_cost_ms(tokens) + prof.seq_us * seqs / 1000
        duration = ms / 1000 + prof.attention_ns * pairs * 1e-9 + self.host_s
        self._step = (self.num_decoding, chunks)
        self.busy = True
        self.busy_s += duration
        if chunks:
            self.prefill_busy_s += duration
            self._prefill_steps.append((now + duration, duration))
            self._prefill_window_s += duration
        elif self.num_decoding:
            self.last_decode_step_s = duration
        return duration

    def finish_step(self) -> Finished:
        assert self._step is not None
        decodes, chunks = self._step
        self._step, self.busy = None, False
        out = Finished()
        self.steps += 1
        self.ctx_sum += decodes
        while self.ends and self.ends[0][0] <= self.steps:
            _, rid = heapq.heappop(self.ends)
            out.decoded.append(rid)
        for p, q in chunks:
            p.done += q
            self.queued_tokens -= q
            if p.done >= p.req.prompt:
                self.queue.remove(p)
                self.num_prefilled += 1
                out.prefilled.append(p)
                if p.decode_here:
                    self._join(p.req)
        return out

    def forget_decoded(self, req: SimRequest) -> None:
        """A decoding sequence ended: its context leaves the batch, its KV the pool."""
        self.num_decoding -= 1
        self.ctx_sum -= req.prompt + req.output - 1
        self.release(req.prompt + req.output)
