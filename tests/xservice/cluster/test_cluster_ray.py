"""The Ray launcher: a Ray actor hosts an engine instance that registers and serves a request.

In-process service side (embedded store served over loopback ZMQ, registry, pool); a local Ray
runtime (``ray.init(num_cpus=2, include_dashboard=False)``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from xengine.api.messages import AddRequest, SamplingParams
from xservice.cluster.launchers import InstanceSpec
from xservice.cluster.pool import InstancePool
from xservice.cluster.registry import InstanceRegistry
from xservice.cluster.store.bridge_server import StoreBridgeServer
from xservice.cluster.store.embedded import EmbeddedStore
from xservice.config import load_config
from xservice.policies import make_policy

ENGINE = {
    "model": {"max_model_len": 256, "seed": 0},
    "cache": {"block_size": 16, "num_blocks": 64},
    "device": {"device": "cpu", "num_threads": 1},
}


def test_ray_launcher_brings_up_an_engine_that_serves(model_dir: Path) -> None:
    ray = pytest.importorskip("ray", reason="ray not installed: run ci/install_cluster_deps.sh")
    from xservice.cluster.launchers.ray import RayLauncher

    try:
        launcher = RayLauncher()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"Ray cannot start here: {type(e).__name__}: {e}")
    overrides = {k: dict(v) for k, v in ENGINE.items()}
    overrides["model"]["model"] = str(model_dir)
    engine = load_config(None, overrides).engine

    async def main() -> list[int]:
        store = EmbeddedStore()
        bridge = StoreBridgeServer(store)
        registry = InstanceRegistry(store, "/xllm", lease_ttl_s=3.0, heartbeat_interval_s=0.5)
        pool = InstancePool(registry, make_policy("round_robin"))
        await registry.start()
        try:
            spec = InstanceSpec("ray-0", "mixed", engine, f"embedded+{bridge.addr}")
            handle = await asyncio.to_thread(launcher.launch, spec)
            assert handle.pid > 0
            await pool.wait_for(["ray-0"], 240)
            assert pool.clients["ray-0"].pid == handle.pid  # the registered engine is the actor's child
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            req = AddRequest(req_id="ray-req", prompt_token_ids=list(range(10, 40)), params=params)
            tokens: list[int] = []
            async for delta in pool.generate(req):
                tokens.extend(delta.new_token_ids)
            return tokens
        finally:
            await pool.close()
            await asyncio.to_thread(launcher.stop_all)
            await registry.close()
            await bridge.close()
            await store.close()

    try:
        tokens = asyncio.run(main())
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert len(tokens) == 12
