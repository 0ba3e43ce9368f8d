"""``GET /v1/admin/instances`` in single-node mode: the one local engine, role mixed."""

from __future__ import annotations

import httpx


def test_admin_instances_lists_the_single_local_engine(http: httpx.Client) -> None:
    body = http.get("/v1/admin/instances").json()
    assert body["mode"] == "single"
    (instance,) = body["instances"]
    assert instance["name"] == "local" and instance["role"] == "mixed" and instance["healthy"]
    assert instance["pid"] == http.get("/v1/admin/stats").json()["engine_pid"]
    assert instance["load"]["num_total_blocks"] > 0
