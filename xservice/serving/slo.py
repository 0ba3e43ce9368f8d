"""A request's own latency objectives: the ``slo`` body field or the ``x-slo-*`` headers.

``{"slo": {"ttft_ms": 500, "tpot_ms": 50}}`` (with the ``openai`` client: ``extra_body``) or the
headers ``x-slo-ttft-ms: 500`` / ``x-slo-tpot-ms: 50``; the body wins where both are given. In a
dynamic PD cluster the service routes by them (``xservice/policies/dynamic_pd.py``); everywhere,
``xllm_request_slo_total{result}`` counts whether a request that set one met it.
"""

from __future__ import annotations

import math
from typing import Any

from xengine.api.messages import RequestSLO
from xservice.http.errors import InvalidRequestError

HEADERS = {"ttft_ms": "x-slo-ttft-ms", "tpot_ms": "x-slo-tpot-ms"}


def request_slo(body: Any, request: Any) -> RequestSLO | None:
    """The objectives ``body`` (its ``slo`` field) and ``request`` (its headers) set; None: none."""
    values: dict[str, float] = {}
    headers = getattr(request, "headers", None) or {}
    for field, header in HEADERS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise InvalidRequestError(
                f"Header '{header}' must be a positive number of milliseconds.", param=header
            )
        values[field] = value
    slo = getattr(body, "slo", None)
    if slo is not None:
        values.update(
            {k: v for k, v in (("ttft_ms", slo.ttft_ms), ("tpot_ms", slo.tpot_ms)) if v is not None}
        )
    return RequestSLO(**values) if values else None


def slo_met(slo: RequestSLO, ttft_s: float | None, tpot_s: float | None) -> bool:
    """Whether a finished request met every objective it set (a TPOT with one token is met)."""
    if slo.ttft_ms is not None and (ttft_s is None or ttft_s * 1000 > slo.ttft_ms):
        return False
    return not (slo.tpot_ms is not None and tpot_s is not None and tpot_s * 1000 > slo.tpot_ms)
