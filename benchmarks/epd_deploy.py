"""EPD deployments side by side for ``epd_goodput``: launch ``xllm serve`` clusters of profiler rows, and
drive one seeded Poisson open-loop load of a workload's image requests at one of them.

Every deployment under comparison is started first and stays up (idle ones cost little), so that the
rate sweep can interleave them (``epd_goodput``): load from other processes on the shared cores then
falls on every deployment alike instead of on whichever ran while it lasted.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.server_process import free_port, run_server
from benchmarks.serving.client import RequestSpec
from benchmarks.serving.dataset import random_prompts
from benchmarks.serving.load import LoadShape, run_load
from benchmarks.serving.metrics import compute_metrics
from xservice.policies.epd import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
# pool of the profiler's strategy -> (instance name prefix, cluster role)
ROLES = {
    "E": ("encode", "encode"),
    "P": ("prefill", "prefill"),
    "D": ("decode", "decode"),
    "EP": ("ep", "encode_prefill"),
    "ED": ("ed", "encode_decode"),
    "EPD": ("engine", "mixed"),
}
PORTS_PER_CLUSTER = 25  # Mooncake ports (two per instance) of one cluster, from 20100 on


def instances_flag(strategy: str, counts: dict[str, int]) -> tuple[str, str]:
    """(``cluster.epd.strategy``, ``cluster.launch.instances``) of a profiler row (``EPD``: plain instances)."""
    items = []
    for pool in STRATEGIES[strategy]:
        prefix, role = ROLES[pool]
        items += [f"{prefix}-{i}:{role}" for i in range(counts[pool])]
    return ("none" if strategy == "EPD" else strategy), ",".join(items)


@dataclass
class Deployment:
    row: dict[str, Any]  # the profiler's row: strategy, counts, predicted goodput, limit; + chosen
    epd_strategy: str
    instances: str
    base_url: str = ""
    model_name: str = ""


def image_url(px: tuple[int, int], rng: np.random.Generator) -> str:
    from PIL import Image

    pixels = rng.integers(0, 256, (px[1], px[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_specs(
    dep: Deployment, tokenizer: str, spec: dict[str, Any], num: int, seed: int
) -> list[RequestSpec]:
    """``num`` chat requests of the workload: fresh random images (no image-cache hits), random text."""
    rng = np.random.default_rng(seed)
    prompts = random_prompts(tokenizer, num, spec["prompt_tokens"], seed)
    return [
        RequestSpec(
            dep.base_url,
            "chat",
            dep.model_name,
            text,
            n,
            spec["output_tokens"],
            image_urls=tuple(image_url(spec["image_size"], rng) for _ in range(spec["images_per_request"])),
        )
        for text, n in prompts
    ]


def start(
    stack: contextlib.ExitStack, row: dict[str, Any], index: int, model: str, engine_flags: list[str]
) -> Deployment:
    """Launch the cluster of ``row`` (kept up until ``stack`` closes) and warm it with two requests."""
    epd, instances = instances_flag(row["strategy"], row["counts"])
    dep = Deployment(row, epd, instances)
    port = free_port()
    lo = 20100 + index * PORTS_PER_CLUSTER
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(ROOT / "configs/cluster-epd.yaml")]
    cmd += ["--model", model, "--port", str(port), "--epd-strategy", epd, "--instances", instances]
    cmd += ["--num-threads", "1", "--log-level", "warning", "--kv-cache-memory-gb", "0.1"]
    cmd += ["--kv-transfer-port-range", f"{lo}-{lo + PORTS_PER_CLUSTER - 1}", *engine_flags]
    dep.base_url = stack.enter_context(run_server(cmd, port, name=f"epd-goodput-{row['strategy']}"))
    dep.model_name = httpx.get(f"{dep.base_url}/models").json()["data"][0]["id"]
    return dep


def warm_up(dep: Deployment, tokenizer: str, spec: dict[str, Any]) -> None:
    """Two requests: the first transfers open their connections, the first steps run."""
    asyncio.run(run_load(make_specs(dep, tokenizer, spec, 2, seed=999), LoadShape(request_rate=1.0), seed=0))


def measure(
    dep: Deployment, tokenizer: str, spec: dict[str, Any], rate: float, seconds: float, seed: int,
    slos_ms: tuple[float, float],
) -> dict[str, Any]:  # fmt: skip
    """One Poisson load of ``rate x seconds`` requests (seeded: every deployment gets the same ones)."""
    num = max(4, round(rate * seconds))
    specs = make_specs(dep, tokenizer, spec, num, seed)
    t0 = time.perf_counter()
    records, duration = asyncio.run(run_load(specs, LoadShape(request_rate=rate), seed=seed))
    m = compute_metrics(records, duration, {"ttft": slos_ms[0], "tpot": slos_ms[1]})
    good = round(m["goodput"] * duration)
    return {
        "rate": rate, "requests": num, "failed": m["failed"], "duration_s": round(duration, 2),
        "goodput": round(m["goodput"], 3), "attainment": round(good / num, 3),
        "throughput": round(m["request_throughput"], 3),
        "ttft_ms_p50": round(m["median_ttft_ms"], 1), "ttft_ms_p90": round(m["p90_ttft_ms"], 1),
        "tpot_ms_p50": round(m["median_tpot_ms"], 2), "tpot_ms_p90": round(m["p90_tpot_ms"], 2),
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip


def epd_stages(dep: Deployment) -> dict[str, Any]:
    """The cluster's EPD counters as means per encode / embedding import (empty when colocated)."""
    epd = httpx.get(dep.base_url.removesuffix("/v1") + "/v1/admin/instances").json()["epd"]
    if "num_encodes" not in epd:
        return {}
    return {
        "num_encodes": epd["num_encodes"],
        "encode_stage_ms_mean": round(1000 * epd["encode_stage_s"] / max(1, epd["num_encodes"]), 2),
        "embed_import_ms_mean": round(1000 * epd["embed_transfer_s"] / max(1, epd["num_embed_imports"]), 2),
    }
