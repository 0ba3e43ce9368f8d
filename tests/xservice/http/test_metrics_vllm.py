"""vLLM-named metrics on a running server: each mirrors its ``xllm_*`` twin, and every metric the shipped
Grafana dashboard (``docs/grafana/xllm.json``) queries is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xservice.http.metrics_vllm import VLLM_NAMES

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "xllm.json"
METRIC_NAME = re.compile(r"\b(vllm:[a-z0-9_:]+|xllm_[a-z0-9_]+)")


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _samples(http: httpx.Client) -> dict[str, list]:
    """Sample name -> samples; a declared family without samples yet (a labelled counter nothing
    incremented) is there with an empty list, as Prometheus knows it from its TYPE line."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            out.setdefault(family.name + suffix, [])
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


@pytest.fixture(scope="module")
def samples(http: httpx.Client, server) -> dict[str, list]:
    """/metrics after some traffic: a streamed completion with n=2, a chat, a repeat (prefix-cache hit)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    body = {"prompt": prompt, "max_tokens": 4, "n": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        resp.read()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/completions", json={**body, "stream": False, "n": 1}).status_code == 200
    return _samples(http)


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def test_dashboard_queries_only_exported_metrics(samples: dict[str, list]) -> None:
    names = {m for expr in _dashboard_exprs() for m in METRIC_NAME.findall(expr)}
    assert len(names) >= 15  # the dashboard is not empty
    missing = sorted(n for n in names if n not in samples)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"


def test_vllm_names_carry_vllm_labels(samples: dict[str, list], server) -> None:
    vllm = [s for name, ss in samples.items() if name.startswith("vllm:") for s in ss]
    assert vllm
    assert all(s.labels["model_name"] == server.model_name and s.labels["engine"] == "0" for s in vllm)
    # the selectors the dashboard uses name these labels
    for expr in _dashboard_exprs():
        for label in re.findall(r"\{([a-z_]+)=~?", expr):
            assert label in ("model_name",), expr


def test_vllm_names_mirror_xllm_values(samples: dict[str, list]) -> None:
    exported = {n for n in samples if n.startswith("vllm:")}
    mirrored = set()
    for xllm_family, (vllm_family, typ) in VLLM_NAMES.items():
        names = [xllm_family + suffix for suffix in ("", "_total", "_bucket", "_sum", "_count")]
        xllm = {name: samples[name] for name in names if name in samples}
        assert xllm, f"{xllm_family} is not exported"
        for name, ss in xllm.items():
            suffix = name[len(xllm_family) :]
            if typ == "counter" and not suffix:
                suffix = "_total"  # a gauge holding a running total becomes a counter
            vname = vllm_family + suffix
            drop = {"model_name", "engine"}
            want = sorted((tuple(sorted(s.labels.items())), s.value) for s in ss)
            got = sorted(
                (tuple(sorted((k, v) for k, v in s.labels.items() if k not in drop)), s.value)
                for s in samples[vname]
            )
            assert got == want, vname
            mirrored.add(vname)
    assert exported - {n for n in exported if n.endswith("_created")} == mirrored  # nothing else


def test_counts_reflect_the_traffic(samples: dict[str, list]) -> None:
    def value(name: str) -> float:
        return sum(s.value for s in samples[name])

    assert value("vllm:request_queue_time_seconds_count") >= 3  # one per engine request
    assert value("vllm:request_prompt_tokens_count") >= 3
    assert value("vllm:request_generation_tokens_count") >= 4  # one per sequence (n=2 counts twice)
    assert value("vllm:request_params_n_sum") >= 4
    assert value("vllm:prefix_cache_queries_total") >= value("vllm:prefix_cache_hits_total") > 0
    assert value("vllm:prompt_tokens_cached_total") > 0  # the repeated prompt hit the prefix cache
    assert value("vllm:generation_tokens_total") >= 4 * 2 + 4
