"""``xllm serve`` with KV tiers (host, disk and the Mooncake Store): a second service, whose KV pool is
empty, serves the first one's prompts from the store with the same tokens (the ``openai`` client);
``/metrics`` and ``/v1/admin/stats`` count it per tier; every listener of the engines and of the store
is on loopback (``ss -ltnp``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import openai

from tests.kv_store import StoreServer
from tests.xservice.conftest import start_server

PROMPTS = [" ".join(f"word{i}-{j}" for j in range(25)) for i in range(3)]


def _listeners(pid: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def _complete(port: int, model: str) -> list[str]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    return [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0.0).choices[0].text
        for p in PROMPTS
    ]


def test_second_service_serves_the_first_ones_prompts_from_the_store(model_dir: Path, tmp_path: Path) -> None:
    store = StoreServer()
    servers = []
    try:
        for name in ("a", "b"):
            tiers = {
                "host_memory_gb": 0.01,
                "disk_path": str(tmp_path / f"arena-{name}"),
                "disk_gb": 0.01,
                "store_master": store.master,
            }
            servers.append(start_server(model_dir, engine={"kv_tiers": tiers}))
        a, b = servers
        first = _complete(a.port, a.model_name)
        with a.client() as http:  # a's write-through saves reach the store before b asks
            for _ in range(200):
                tiers = http.get("/v1/admin/stats").json()["kv_tiers"]
                if next(t for t in tiers["tiers"] if t["name"] == "store")["writes"] > 0:
                    break
        assert _complete(b.port, b.model_name) == first
        with b.client() as http:
            stats = http.get("/v1/admin/stats").json()
            metrics = http.get("/metrics").text
        store_tier = next(t for t in stats["kv_tiers"]["tiers"] if t["name"] == "store")
        assert store_tier["hits"] > 0 and store_tier["available"]
        hits = re.search(r'^xllm_kv_tier_hits_total\{tier="store"\} (\S+)$', metrics, re.M)
        assert hits is not None and float(hits.group(1)) == store_tier["hits"]
        assert 'xllm_kv_tier_available{tier="store"} 1.0' in metrics
        for server in servers:  # the engine's store client listens on loopback only
            with server.client() as http:
                pid = http.get("/v1/admin/stats").json()["engine_pid"]
            addrs = _listeners(pid)
            assert addrs and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addrs), addrs
        addrs = _listeners(store.proc.pid) + _listeners(store.master_pid())
        assert addrs and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addrs), addrs
    finally:
        for server in servers:
            server.stop()
        store.stop()
