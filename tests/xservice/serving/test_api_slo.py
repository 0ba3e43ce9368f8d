"""Per-request SLOs (``slo`` body field, ``x-slo-*`` headers) on the single-node service: accepted on
both generation endpoints, counted in ``xllm_request_slo_total``, bad values refused with a 400."""

from __future__ import annotations

import re

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _slo_counts(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        m[0]: float(m[1]) for m in re.findall(r'xllm_request_slo_total\{result="(\w+)"\} ([0-9.e+]+)', text)
    }


def test_slo_is_counted_met_or_missed(client: openai.OpenAI, server, http: httpx.Client) -> None:
    before = _slo_counts(http)
    # a generous SLO in the body (chat) is met; an impossible one in a header (completions) is missed
    client.chat.completions.create(
        model=server.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"slo": {"ttft_ms": 600000, "tpot_ms": 600000}},
    )  # fmt: skip
    client.completions.create(
        model=server.model_name, prompt="Once upon a time", max_tokens=4, extra_body={"ignore_eos": True},
        extra_headers={"x-slo-ttft-ms": "0.000001"},
    )  # fmt: skip
    client.completions.create(model=server.model_name, prompt="no slo", max_tokens=2)
    after = _slo_counts(http)
    assert after.get("met", 0) - before.get("met", 0) == 1
    assert after.get("missed", 0) - before.get("missed", 0) == 1


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"slo": {"ttft_ms": -1}}, {}, "slo.ttft_ms"),
        ({"slo": {"tpot_ms": "fast"}}, {}, "slo.tpot_ms"),
        ({"slo": {"ttft_ms": 10, "deadline": 3}}, {}, "slo.deadline"),
        ({}, {"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"),
        ({}, {"x-slo-tpot-ms": "0"}, "x-slo-tpot-ms"),
        ({}, {"x-slo-tpot-ms": "nan"}, "x-slo-tpot-ms"),
    ],
)
def test_bad_slo_is_a_400_naming_it(
    server, http: httpx.Client, body: dict, headers: dict, param: str
) -> None:
    payload = {"model": server.model_name, "prompt": "hi", "max_tokens": 2, **body}
    resp = http.post("/v1/completions", json=payload, headers=headers)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param or param in err["message"], err
