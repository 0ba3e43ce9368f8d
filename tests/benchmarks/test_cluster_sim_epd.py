"""EPD deployments in the cluster simulator (``benchmarks/cluster_sim/epd.py``): stage-level steps over
``StageCosts`` follow the cost model exactly where the answer is known by hand, the service's budgets
and placement are applied, and the simulated deployments agree with the goodput model that chose them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.cluster_sim.epd import ILLUSTRATIVE, WORKLOADS, EPDCluster, simulate
from tests.benchmarks.test_cluster_sim import ROOT
from xservice.policies.epd import EPDSLO, EPDWorkload, choose_strategy

SLO = EPDSLO(ttft_s=2.0, tpot_s=0.05)


def test_a_lone_request_pays_encode_transfer_prefill_transfer_and_decode() -> None:
    """E+P+D, one instance each, one request of 2 images: encode steps, the embeddings'
    transfer, a prefill step, the KV's transfer, then its decode steps."""
    w = EPDWorkload(2, 100, 400, 50, 3)
    c = ILLUSTRATIVE
    cluster = EPDCluster("E+P+D", (1, 1, 1), c, w, SLO, decode_batch=1)
    req = cluster.run([0.0])[0]
    per_step = cluster.instances[0].max_images  # the engine's default: no decodes to protect here
    encode = sum(c.step_s(0, 0, encode_patches=k * 400) for k in [min(per_step, 2)] * -(-2 // per_step))
    embed = c.transfer_time_s(2 * 100 * c.embed_bytes_per_token)
    chunk = min(w.prompt_len, cluster.instances[1].token_budget)
    prefill = c.step_s(0, 0, prefill_tokens=chunk)
    assert w.prompt_len <= chunk and req.first_token == pytest.approx(encode + embed + prefill)
    kv = c.transfer_time_s(w.prompt_len * c.kv_bytes_per_token)
    decode = c.step_s(1, w.prompt_len + 1) + c.step_s(1, w.prompt_len + 2)
    assert req.end - req.first_token == pytest.approx(kv + decode)


def test_budgets_land_on_the_instances_that_decode_as_the_service_plans_them() -> None:
    w = WORKLOADS["image-heavy"]
    on_decode = EPDCluster("E+P+D", (2, 1, 1), ILLUSTRATIVE, w, SLO, decode_batch=8, budgets_on="decode")
    assert [i.max_images for i in on_decode.instances[:2]] == [4, 4]  # encode: the engine's default
    everywhere = EPDCluster("E+P+D", (2, 1, 1), ILLUSTRATIVE, w, SLO, decode_batch=8, budgets_on="all")
    assert [i.max_images for i in everywhere.instances[:2]] == [everywhere.tau_e] * 2
    ed = EPDCluster("ED+P", (3, 1), ILLUSTRATIVE, w, SLO, decode_batch=8, budgets_on="decode")
    assert [i.max_images for i in ed.instances] == [ed.tau_e] * 3 + [4]
    with pytest.raises(ValueError, match="budgets_on"):
        EPDCluster("EPD", (2,), ILLUSTRATIVE, w, SLO, decode_batch=8, budgets_on="some")


@pytest.mark.parametrize("workload", ["image-heavy", "text-heavy"])
def test_the_chosen_deployment_meets_the_slos_in_the_simulator(workload: str) -> None:
    """At 80% of the goodput the model predicts for its choice, the chosen deployment (budgets where the
    service puts them) meets both SLOs for nearly every request; and where the model says a strategy
    cannot, the simulator agrees unless the model is the more cautious (a colocated pool's encode steps
    over the SLO)."""
    w = WORKLOADS[workload]
    choice = choose_strategy(ILLUSTRATIVE, w, 8, SLO)
    rate = 0.8 * choice.best.goodput
    counts = tuple(n for _, n in choice.best.counts)
    result = simulate(choice.best.strategy, counts, ILLUSTRATIVE, w, SLO, rate, 2000, budgets_on="decode")
    assert result["predicted"]["meets_slos"]
    assert result["simulated"]["slo_attainment"] >= 0.95, result


def test_the_cli_reports_every_strategy() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cluster_sim.epd", "--instances", "4", "--requests", "300",
         "--workload", "text-heavy", "--budgets", "decode"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {r["strategy"] for r in out["strategies"]} == {"E+P+D", "EP+D", "ED+P", "EPD"}
    for r in out["strategies"]:
        assert set(r["predicted"]) >= {"meets_slos", "ttft_s", "tpot_s"}
        assert 0 <= r["simulated"]["slo_attainment"] <= 1 and set(r["simulated"]["ttft_s"]) == {"p50", "p90"}
    assert out["chosen"]["strategy"] in {r["strategy"] for r in out["strategies"]} and out["rate"] > 0
