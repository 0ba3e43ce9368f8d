"""The engine process (``xengine.process.engine_proc``) driven through ``EngineClient``, with the real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from xengine.api.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from xengine.api.messages import AddRequest, CompletionDelta, SamplingParams
from xservice.engine.client import EngineClient
from xservice.engine.errors import EngineDeadError, EngineStartupError
from xservice.engine.protocol import EngineBackend

ROOT = Path(__file__).resolve().parents[3]
GUARD_S = 60.0  # upper bound so a broken test fails instead of hanging; not a timing assertion


def engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
        device=DeviceConfig(device="cpu", num_threads=1),
    )


def greedy(req_id: str, max_tokens: int = 8, prompt: list[int] | None = None, **kw) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return AddRequest(req_id=req_id, prompt_token_ids=prompt or [5, 6, 7, 8, 9], params=params)


async def collect(client: EngineClient, req: AddRequest) -> list[CompletionDelta]:
    return [d async for d in client.generate(req)]


def tokens_by_index(deltas: list[CompletionDelta]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in deltas:
        out.setdefault(d.index, []).extend(d.new_token_ids)
    return out


def run(loop: asyncio.AbstractEventLoop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, GUARD_S))


@pytest.fixture(scope="module")
def model_dir(make_model_dir: Callable[..., Path]) -> Path:
    return make_model_dir("qwen3", "tiny", 0)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def client(loop: asyncio.AbstractEventLoop, model_dir: Path) -> Iterator[EngineClient]:
    """One engine process shared by the non-destructive tests."""
    c = loop.run_until_complete(EngineClient.start(engine_config(model_dir), startup_timeout_s=300))
    yield c
    loop.run_until_complete(c.close())


async def wait_until_idle(client: EngineClient, num_free_blocks: int) -> None:
    while True:
        stats = await client.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == num_free_blocks:
            return
        await asyncio.sleep(0.05)


def test_import_engine_client_does_not_load_torch() -> None:
    code = "import sys, xservice.engine.client; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_ready_info_and_utilities(loop, client: EngineClient) -> None:
    assert client.is_alive and client.pid == client.info.pid != os.getpid()
    assert client.info.num_total_blocks == 64 and client.info.block_size == 16
    assert run(loop, client.ping()) is True
    stats = run(loop, client.stats())
    assert stats.num_total_blocks == 64
    assert isinstance(run(loop, client.reset_prefix_cache()), bool)


def test_a_running_client_is_an_engine_backend(client: EngineClient) -> None:
    assert isinstance(client, EngineBackend)


def test_greedy_is_deterministic(loop, client: EngineClient) -> None:
    first = run(loop, collect(client, greedy("g1", max_tokens=8)))
    second = run(loop, collect(client, greedy("g2", max_tokens=8)))
    toks1, toks2 = tokens_by_index(first)[0], tokens_by_index(second)[0]
    assert len(toks1) == 8 and toks1 == toks2
    assert all(0 <= t < client.info.vocab_size for t in toks1)
    assert first[-1].finish_reason == "length" and first[-1].num_prompt_tokens == 5
    assert client.num_inflight == 0


def test_n2_yields_both_sequences(loop, client: EngineClient) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    deltas = run(loop, collect(client, AddRequest(req_id="n2", prompt_token_ids=[5, 6, 7], params=params)))
    toks = tokens_by_index(deltas)
    assert sorted(toks) == [0, 1]
    assert [len(toks[0]), len(toks[1])] == [6, 6]
    assert sorted(d.index for d in deltas if d.finish_reason == "length") == [0, 1]


def test_early_stop_aborts_and_frees_blocks(loop, client: EngineClient) -> None:
    async def scenario() -> None:
        start = await client.stats()
        gen = client.generate(greedy("long", max_tokens=200))
        async for delta in gen:
            assert delta.req_id == "long"
            break  # the consumer goes away mid-generation
        await gen.aclose()
        assert client.num_inflight == 0
        await wait_until_idle(client, start.num_free_blocks)

    run(loop, scenario())


def test_abort_by_id_ends_every_sequence(loop, client: EngineClient) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=200, ignore_eos=True)
    req = AddRequest(req_id="ab", prompt_token_ids=[5, 6, 7], params=params)

    async def scenario() -> list[CompletionDelta]:
        start = await client.stats()
        deltas: list[CompletionDelta] = []
        async for delta in client.generate(req):
            deltas.append(delta)
            if len(deltas) == 1:
                await client.abort(["ab", "unknown-id"])
        await wait_until_idle(client, start.num_free_blocks)
        return deltas

    deltas = run(loop, scenario())
    assert sorted(d.index for d in deltas if d.finish_reason == "abort") == [0, 1]
    assert all(len(toks) < 200 for toks in tokens_by_index(deltas).values())


def test_bad_request_gets_error_and_engine_keeps_serving(loop, client: EngineClient) -> None:
    bad_prompt = [client.info.vocab_size + 10]
    deltas = run(loop, collect(client, greedy("bad", prompt=bad_prompt)))
    assert len(deltas) == 1
    assert deltas[0].finish_reason == "error" and "prompt" in (deltas[0].error or "")
    bad_params = AddRequest(req_id="bad2", prompt_token_ids=[5], params=SamplingParams(top_p=0.0))
    deltas = run(loop, collect(client, bad_params))
    assert deltas[0].finish_reason == "error" and "top_p" in (deltas[0].error or "")
    good = run(loop, collect(client, greedy("good", max_tokens=3)))
    assert len(tokens_by_index(good)[0]) == 3 and client.is_alive


def test_startup_failure_reports_the_cause(loop, tmp_path: Path) -> None:
    cfg = EngineConfig(model=ModelConfig(model=str(tmp_path / "missing")), device=DeviceConfig(device="cpu"))
    with pytest.raises(EngineStartupError, match="model folder not found"):
        run(loop, EngineClient.start(cfg, startup_timeout_s=300))


def test_kill_9_fails_inflight_requests(model_dir: Path) -> None:
    async def scenario() -> None:
        client = await EngineClient.start(engine_config(model_dir), startup_timeout_s=300)
        try:
            gen = client.generate(greedy("victim", max_tokens=250))
            await gen.__anext__()  # the request is running
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in gen:
                    pass
            assert not client.is_alive and client.num_inflight == 0
            with pytest.raises(EngineDeadError):
                await collect(client, greedy("after"))
            assert await client.ping() is False
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), GUARD_S))


def test_sigterm_drains_running_requests_then_exits_0(model_dir: Path) -> None:
    async def scenario() -> tuple[list[CompletionDelta], int | None]:
        client = await EngineClient.start(engine_config(model_dir), startup_timeout_s=300)
        try:
            deltas: list[CompletionDelta] = []
            async for delta in client.generate(greedy("drain", max_tokens=24)):
                deltas.append(delta)
                if len(deltas) == 1:
                    os.kill(client.pid, signal.SIGTERM)
            while client.is_alive:
                await asyncio.sleep(0.05)
            return deltas, client.process.exit_code
        finally:
            await client.close()

    deltas, returncode = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert len(tokens_by_index(deltas)[0]) == 24 and deltas[-1].finish_reason == "length"
    assert returncode == 0


def test_close_with_zero_drain_aborts_and_exits_0(model_dir: Path) -> None:
    async def scenario() -> tuple[list[CompletionDelta], int | None]:
        client = await EngineClient.start(engine_config(model_dir), startup_timeout_s=300)
        gen = client.generate(greedy("cut", max_tokens=250))
        deltas = [await gen.__anext__()]
        await client.close(drain_timeout_s=0.0)
        deltas += [d async for d in gen]
        return deltas, client.process.exit_code

    deltas, returncode = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert deltas[-1].finish_reason == "abort" and returncode == 0


def test_engine_exits_when_the_service_dies(model_dir: Path, tmp_path: Path) -> None:
    """A service killed with -9 leaves no engine behind."""
    cfg_json = json.dumps(dataclasses.asdict(engine_config(model_dir)))
    script = tmp_path / "service.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, json, sys, time
        from xengine.api.config import EngineConfig, from_dict
        from xservice.engine.client import EngineClient

        async def main():
            client = await EngineClient.start(from_dict(EngineConfig, json.loads({cfg_json!r})), 300)
            print(client.pid, flush=True)
            await asyncio.sleep(3600)

        asyncio.run(main())
        """)
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    service = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    engine_pid = None
    try:
        engine_pid = int(service.stdout.readline())
        service.kill()
        service.wait()
        assert wait_for_exit(engine_pid, GUARD_S)
    finally:
        service.kill()
        service.wait()
        service.stdout.close()
        if engine_pid is not None and not wait_for_exit(engine_pid, 0):
            os.kill(engine_pid, signal.SIGKILL)


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` is gone (or a zombie nobody reaps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


@pytest.mark.parametrize("layout", ["paged", "xtensor"])
def test_async_engine_process_with_aborts_ends_where_it_started(model_dir: Path, layout: str) -> None:
    """An engine process with async scheduling: 2,000 short requests over ZMQ, a random 20% stopped
    early by the client (abort); the pool, the scheduler and the xTensor pages end as they started,
    and the completed ones equal the same requests run with async scheduling off."""
    import random

    def config(async_scheduling: str) -> EngineConfig:
        base = engine_config(model_dir)
        return dataclasses.replace(
            base,
            cache=dataclasses.replace(base.cache, kv_layout=layout, num_blocks=256),
            scheduler=dataclasses.replace(base.scheduler, max_num_seqs=64, max_num_batched_tokens=512),
            execution=dataclasses.replace(base.execution, async_scheduling=async_scheduling),
        )

    rng = random.Random(7)
    reqs = [
        greedy(f"q{i}", rng.randint(1, 6), [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))])
        for i in range(2000)
    ]
    stop_after = {r.req_id: rng.randint(0, 2) for r in reqs if rng.random() < 0.2}

    async def one(client: EngineClient, req: AddRequest) -> list[int] | None:
        got: list[int] = []
        async for d in client.generate(req):
            got.extend(d.new_token_ids)
            if req.req_id in stop_after and len(got) > stop_after[req.req_id]:
                return None  # leaving the stream aborts the request
        return got

    async def scenario(async_scheduling: str):
        client = await EngineClient.start(config(async_scheduling), startup_timeout_s=300)
        try:
            outs = await asyncio.gather(*(one(client, r) for r in reqs))
            deadline = time.monotonic() + GUARD_S
            while (stats := await client.stats()).num_running or stats.num_waiting:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            return outs, stats
        finally:
            await client.close()

    outs_on, stats = asyncio.run(asyncio.wait_for(scenario("on"), 4 * GUARD_S))
    assert stats.async_scheduling and stats.num_free_blocks == stats.num_total_blocks
    if stats.xtensor is not None:
        assert stats.xtensor.num_mapped == 0 and stats.xtensor.num_allocated == 0
    outs_off, _ = asyncio.run(asyncio.wait_for(scenario("off"), 4 * GUARD_S))
    completed = [(a, b) for a, b, r in zip(outs_on, outs_off, reqs) if r.req_id not in stop_after]
    assert all(a == b for a, b in completed) and len(completed) > 1500
