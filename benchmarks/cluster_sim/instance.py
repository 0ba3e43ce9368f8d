"""One simulated instance: the engine's continuous batching over a device profile.

Each step runs every decoding sequence's next token and, in the token budget left, prefill chunks from
the head of its prefill queue (the engine's one-token-budget scheduler: decodes first, then prompts,
chunked). The step takes ``DeviceProfile.step_seconds`` of its shape, computed from running sums, so a
step costs O(1) plus the sequences that start or end in it: a decoding sequence's last step is known
when it joins (a heap of end steps), its context grows with the step count.

KV: a request reserves its prompt and output on the instance that will decode it (what the service's
placement counts); it waits in the instance's queue while the pool cannot hold it.

Prefix cache: after a prompt of a shared-prefix group prefills here, the group's full prefix blocks stay
cached (least recently used groups evicted first, within the pool's free blocks); a later prompt of
the group computes only what follows the blocks held (``matched_tokens``) -- the engine's prefix cache,
per group rather than per block.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
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
    moved: list[SimRequest] = field(default_factory=list)  # evicted decodes: what is left of each


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
        block_size: int = 16,
    ) -> None:
        self.index, self.name = index, f"i{index}"
        self.profile, self.role, self.origin = profile, role, role
        self.budget, self.max_seqs = budget, max_seqs
        self.host_s = host_ms / 1000  # host work of each step, beside the device's
        self.capacity = capacity_tokens or profile.kv_capacity_tokens
        self.queue: deque[_Prefill] = deque()  # admitted prompts, FCFS
        self.waiting: deque[_Prefill] = deque()  # not admitted yet (KV)
        self.ends: list[tuple[int, int]] = []  # (last step, request id) of decoding sequences
        self.decoding: dict[int, tuple[int, SimRequest]] = {}  # request id -> (last step, request)
        self.leaving: list[int] = []  # decodes to move off when the step in flight ends
        self.num_offline_decoding = 0
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
        self.block_size = block_size
        self.cached: OrderedDict[int, int] = OrderedDict()  # group -> its leading blocks held, LRU first
        self.cached_blocks = 0
        self.prompt_tokens = 0  # prompt tokens prefilled here ...
        self.hit_tokens = 0  # ... of which the prefix cache held

    # ------------------------------------------------------------------ work in
    def matched_tokens(self, req: SimRequest) -> int:
        """Leading prompt tokens of ``req`` its prefix cache holds (at least one token left to compute)."""
        if req.group < 0:
            return 0
        held = min(self.cached.get(req.group, 0), req.prefix // self.block_size) * self.block_size
        return min(held, req.prompt - 1)

    def remember(self, req: SimRequest) -> list[int]:
        """Cache ``req``'s group prefix after its prefill; the groups evicted for room."""
        if req.group < 0 or req.prefix < self.block_size:
            return []
        blocks = req.prefix // self.block_size
        self.cached_blocks += max(0, blocks - self.cached.get(req.group, 0))
        self.cached[req.group] = max(blocks, self.cached.get(req.group, 0))
        self.cached.move_to_end(req.group)
        room = max(0, (self.capacity - self.reserved) // self.block_size)
        evicted = []
        while self.cached_blocks > room and len(self.cached) > 1:
            group, held = self.cached.popitem(last=False)
            self.cached_blocks -= held
            evicted.append(group)
        return evicted

    def add_prefill(self, req: SimRequest, decode_here: bool, reserve: int) -> None:
        hit = self.matched_tokens(req)
        if hit:
            self.cached.move_to_end(req.group)
        p = _Prefill(req, done=hit, decode_here=decode_here, reserve=reserve)
        self.prompt_tokens += req.prompt
        self.hit_tokens += hit
        self.queued_tokens += req.prompt - hit
        if self.waiting or self.reserved + reserve > self.capacity:
            self.waiting.append(p)
        else:
            self.reserved += reserve
            self._enqueue(p)

    def _enqueue(self, p: _Prefill) -> None:
        """FCFS, except that an online prompt goes ahead of offline ones (the engine stops an offline
        prefill between layers when an online request arrives)."""
        if not p.req.offline:
            for k, q in enumerate(self.queue):
                if q.req.offline:
                    self.queue.insert(k, p)
                    return
        self.queue.append(p)

    def add_decode(self, req: SimRequest) -> None:
        """A prefilled request (its KV here) decodes its ``output - 1`` remaining tokens."""
        self.reserved += req.prompt + req.output
        self._join(req)

    def _join(self, req: SimRequest) -> None:
        if req.output <= 1:
            return
        # its first decode is the next step to start: after the one in flight, if any
        last = self.steps + req.output - 1 + self.busy
        heapq.heappush(self.ends, (last, req.rid))
        self.decoding[req.rid] = (last, req)
        self.num_decoding += 1
        self.num_offline_decoding += req.offline
        self.ctx_sum += req.prompt + 1

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
        while self.waiting and self.reserved + self.waiting[0].reserve <= self.capacity:
            p = self.waiting.popleft()
            self.reserved += p.reserve
            self._enqueue(p)

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

    def start_step(self, now: float, slowdown: float = 1.0) -> float:
        """Plan the next step (starting ``now``); its duration, ``slowdown`` times the profile's (cores
        shared with other instances)."""
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
        duration = (ms / 1000 + prof.attention_ns * pairs * 1e-9 + self.host_s) * slowdown
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
        ending: set[int] = set()
        while self.ends and self.ends[0][0] <= self.steps:
            last, rid = heapq.heappop(self.ends)
            # (not moved away meanwhile; once, if it came back to the same last step)
            if self.decoding.get(rid, (None,))[0] == last and rid not in ending:
                out.decoded.append(rid)
                ending.add(rid)
        out.moved = [self._detach(rid) for rid in self.leaving if rid in self.decoding and rid not in ending]
        self.leaving.clear()
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

    def context_of(self, rid: int) -> int:
        """Context tokens decoding sequence ``rid`` attends in its next step: it joined with its prompt
        and first token, and each step since added one."""
        last, req = self.decoding[rid]
        return req.prompt + req.output + self.steps - last

    def forget_decoded(self, rid: int) -> None:
        """A decoding sequence ended: its context leaves the batch, its KV the pool."""
        self._drop(rid)

    def evict(self, rid: int) -> None:
        """Move decoding sequence ``rid`` off this instance when its step in flight ends."""
        self.leaving.append(rid)

    def _detach(self, rid: int) -> SimRequest:
        """What is left of ``rid``, taken off this instance: a request whose prompt is its context so far
        less its last token, and whose output is that token and those still to make (``add_decode``)."""
        last, req, context = self._drop(rid)
        return SimRequest(rid, req.arrival, context - 1, last - self.steps + 1, offline=req.offline)

    def _drop(self, rid: int) -> tuple[int, SimRequest, int]:
        """Take decoding sequence ``rid`` out of the batch and its KV out of the pool; its last step,
        request and context."""
        context = self.context_of(rid)
        last, req = self.decoding.pop(rid)
        self.num_decoding -= 1
        self.num_offline_decoding -= req.offline
        self.ctx_sum -= context
        self.release(req.prompt + req.output)
        return last, req, context

    def offline_decodes(self) -> list[tuple[int, int]]:
        """(request id, context tokens) of its offline decoding sequences."""
        return [(rid, self.context_of(rid)) for rid, (_, req) in self.decoding.items() if req.offline]
