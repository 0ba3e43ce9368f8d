"""Emulated instances at cluster scale on this box: ``xllm serve`` with ``N`` engine processes on the
emulated accelerator (each step sleeps the profile's time, so they share two cores), real etcd, PD
between them over a real Mooncake transfer engine. Every greedy text equals one offline emulated
engine's, every instance served, and the service stays responsive (its health endpoint answers, within a
5 s timeout, every poll while the instances decode). The default run has 4 instances, the slow one 16."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.xservice.cluster.helpers import ENGINE, ClusterServer, EtcdServer, complete
from xengine.api.messages import SamplingParams
from xengine.llm import LLM

pytest.importorskip("mooncake.engine")

PROFILE = {
    "name": "cluster-test",
    "base_ms": 15.0,
    "tokens_ms": [[1, 0.0], [512, 30.0]],
    "kv_capacity_tokens": 8192,
}
MAX_TOKENS = 24


@pytest.mark.parametrize("n", [4, pytest.param(16, marks=pytest.mark.slow)])
def test_emulated_cluster_serves_every_request_and_stays_responsive(
    model_dir: Path, etcd: EtcdServer, tmp_path: Path, n: int
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    roles = [f"p{i}:prefill" for i in range(n // 2)] + [f"d{i}:decode" for i in range(n - n // 2)]
    device = {"device": "emulated", "device_profile": str(profile)}
    server = ClusterServer(
        model_dir,
        {"instances": ",".join(roles), "metadata_store": "etcd", "etcd_endpoint": etcd.endpoint,
         "key_prefix": f"/emulated-{n}"},
        engine={"device": device, "cache": {"num_blocks": 512}},
    )  # fmt: skip
    try:
        prompts = [
            f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5)
            for i in range(3 * n)
        ]
        offline = LLM(
            str(model_dir), **device, block_size=ENGINE["cache"]["block_size"], num_blocks=512,
            seed=ENGINE["model"]["seed"], max_model_len=ENGINE["model"]["max_model_len"],
        )  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = {
            p: o.outputs[0].text for p, o in zip(prompts, offline.generate(prompts, params, use_tqdm=False))
        }
        client = server.openai()
        results: dict[str, object] = {}

        def run(prompt: str) -> None:
            try:
                results[prompt] = complete(client, prompt, MAX_TOKENS).choices[0].text
            except Exception as e:  # noqa: BLE001 - reported below
                results[prompt] = e

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        [t.start() for t in threads]
        polls = 0
        while any(t.is_alive() for t in threads):  # the service answers throughout (a 5 s timeout each)
            assert server.http.get("/health", timeout=5.0).status_code == 200
            polls += 1
            time.sleep(0.1)
        [t.join() for t in threads]
        assert all(results[p] == expected[p] for p in prompts), [
            p for p in prompts if results[p] != expected[p]
        ]
        routed = {name: i["num_routed"] for name, i in server.instances().items()}
        assert len(routed) == n and all(v > 0 for v in routed.values()), routed
        assert server.admin()["pd"]["num_fallbacks"] == 0
        assert polls > 0
    finally:
        server.stop()
