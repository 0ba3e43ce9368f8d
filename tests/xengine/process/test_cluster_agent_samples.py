"""The raw performance samples an engine reports in cluster mode (``keys.LoadReport.prefills`` / ``steps``).

A real engine on the tiny checkpoint, wrapped the way ``xengine/process/engine_server.py`` wraps it, reports
through a real ``ClusterAgent`` to a service's embedded store over its ZMQ bridge; every
``LoadReport`` the agent puts is read back from a watch on the store. Requests run in three rounds
(one prompt; a short and a long prompt together; a prompt extending the first one, which hits the
prefix cache), so the expected samples are known exactly: one prefill per request with its uncached
prompt tokens, one step per forward with its sequences, the KV tokens they attend and the prompt
tokens computed. Times are only checked for sign.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.xengine.conftest import make_engine, random_prompts
from xengine.api.cluster import keys
from xengine.api.messages import AddRequest, CompletionDelta, SamplingParams
from xengine.process.cluster_agent import ClusterAgent, _take_samples
from xengine.process.observed_engine import ObservedEngine
from xservice.cluster.store.bridge_server import StoreBridgeServer
from xservice.cluster.store.embedded import EmbeddedStore

PREFIX = "/samples"
BLOCK_SIZE = 16
SETTINGS = dict(
    max_model_len=256, num_blocks=64, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=256
)


class _StoreThread:
    """An embedded store and its bridge on an event loop of their own; keeps every ``LoadReport`` put."""

    def __init__(self) -> None:
        self.reports: list[keys.LoadReport] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = self._call(self._start())

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> str:
        self._store = EmbeddedStore()
        self._bridge = StoreBridgeServer(self._store)
        self._watch = asyncio.get_running_loop().create_task(self._collect())
        await asyncio.sleep(0)  # the watch is registered before any engine writes
        return f"embedded+{self._bridge.addr}"

    async def _collect(self) -> None:
        async for event in self._store.watch_prefix(keys.key(PREFIX, "load")):
            if event.kind == "put":
                self.reports.append(keys.decode(event.value, keys.LoadReport))

    def samples(self) -> tuple[list[list[float]], list[list[float]]]:
        reports = list(self.reports)
        return [p for r in reports for p in r.prefills], [s for r in reports for s in r.steps]

    def close(self) -> None:
        async def stop() -> None:
            self._watch.cancel()
            await self._bridge.close()
            await self._store.close()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def store() -> Iterator[_StoreThread]:
    s = _StoreThread()
    yield s
    s.close()


def _run(
    engine: ObservedEngine, prompts: list[list[int]], max_tokens: int, tag: str
) -> list[CompletionDelta]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(req_id=f"{tag}-{i}", prompt_token_ids=prompt, params=params))
    deltas: list[CompletionDelta] = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    return deltas


def _steps_of(round_: list[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """The steps of requests ``(prompt_len, cached_tokens)`` admitted together, ``max_tokens`` each:
    one prefill step, then one decode step per further token."""
    n = len(round_)
    first = [n, sum(p for p, _ in round_), sum(p - c for p, c in round_)]
    return [first] + [[n, sum(p + k for p, _ in round_), 0] for k in range(1, max_tokens)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_load_reports_carry_prefill_and_step_samples(
    tiny_qwen3: Path, store: _StoreThread, async_scheduling: bool
) -> None:
    engine = make_engine(tiny_qwen3, async_scheduling=async_scheduling, **SETTINGS)
    record = keys.InstanceRecord(
        name="e0", role="mixed", incarnation="inc-samples", input_addr="tcp://127.0.0.1:1",
        output_addr="tcp://127.0.0.1:2", pid=1, info={}, started_at=0.0,
    )  # fmt: skip
    agent = ClusterAgent(store.url, PREFIX, record, engine.get_stats, heartbeat_interval_s=0.1)
    observed = ObservedEngine(engine, agent)
    agent.start()
    try:
        a, b, c = random_prompts([40, 5, 70], seed=3)
        d = random_prompts([8], seed=4, prefix=a)[0]  # its first two blocks are cached after round one
        _run(observed, [a], 3, "a")
        _run(observed, [b, c], 4, "bc")
        hit = _run(observed, [d], 3, "d")
        assert hit[0].num_cached_tokens == 2 * BLOCK_SIZE
        expected_steps = _steps_of([(40, 0)], 3) + _steps_of([(5, 0), (70, 0)], 4) + _steps_of([(48, 32)], 3)
        deadline = time.monotonic() + 10
        while len(store.samples()[1]) < len(expected_steps) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # a few more heartbeats: nothing else may come
    finally:
        agent.stop()
        engine.shutdown()
    prefills, steps = store.samples()
    assert all(r.incarnation == "inc-samples" for r in store.reports)
    # one prefill per request, in order of first tokens (b and c share a step): uncached prompt tokens
    uncached = [int(p[0]) for p in prefills]
    assert uncached[0] == 40 and sorted(uncached[1:3]) == [5, 70] and uncached[3:] == [48 - 2 * BLOCK_SIZE]
    assert all(queue_s >= 0 and compute_s >= 0 for _, queue_s, compute_s in prefills)
    # one step per forward: sequences, KV tokens attended, prefill tokens computed
    assert [[int(x) for x in s[:3]] for s in steps] == expected_steps
    assert all(s[3] > 0 for s in steps)


def test_samples_beyond_the_report_limit_are_evenly_subsampled() -> None:
    pending = collections.deque([[i, 0.0, 0.0] for i in range(200)])
    taken = _take_samples(pending, keys.MAX_SAMPLES)
    assert len(taken) == keys.MAX_SAMPLES and not pending
    first = [int(t[0]) for t in taken]
    assert first == sorted(first) and first[0] == 0 and first[-1] >= 200 - 200 // keys.MAX_SAMPLES - 1
    assert _take_samples(collections.deque([[1, 2, 3]]), keys.MAX_SAMPLES) == [[1, 2, 3]]


def test_reports_without_samples_still_decode() -> None:
    """A report of an engine from before the sample fields reads as having none."""
    old = keys.decode(b'{"incarnation": "x", "seq": 3, "num_running": 1}', keys.LoadReport)
    assert old is not None and old.prefills == [] and old.steps == []
