"""``python -m benchmarks.prfaas``: the throughput model reproduces the paper's Table 6 from its inputs,
and the simulator, driven by the same policies, ranks the three deployments as the paper does. The
simulator is a seeded discrete-event model: its capacities and latencies are computed, not timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.prfaas import paper
from benchmarks.prfaas.__main__ import NAMES, _plans, _simulate, main

MEASURED = Path(paper.PROFILES) / "qwen3-small-xeon-measured.json"


@pytest.fixture(scope="module")
def points():
    return _plans(
        paper.stages(), paper.LENGTHS, paper.OUTPUT_TOKENS, paper.PRFAAS_INSTANCES, paper.LOCAL_INSTANCES,
        paper.HOMOGENEOUS_INSTANCES,
    )  # fmt: skip


def test_table_6_within_5_percent(points) -> None:
    for name in NAMES:
        devs = paper.deviations(points[name].to_dict(), paper.PAPER[name])
        assert devs and all(abs(v) <= 0.05 for v in devs.values()), (name, devs)
    best = points["prfaas_pd"]
    assert (best.deployment.prfaas, best.deployment.prefill, best.deployment.decode) == (4, 3, 5)
    assert best.p == pytest.approx(0.496, abs=0.01)  # "49.6% of requests are routed to PrfaaS"
    assert 10 < best.egress_gbps < 15  # "approximately 13 Gbps"
    ratio = best.lambda_max / points["homogeneous_pd"].lambda_max
    assert ratio == pytest.approx(1.54, rel=0.05)


def test_the_cli_prints_both_blocks(capsys) -> None:
    assert main(["--paper"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["within_5pct"] is True
    for name in NAMES:
        got, pub = out["model"][name], out["paper"][name]
        assert set(got["instances"]) == {"prfaas", "prefill", "decode"} == set(pub["instances"])
        assert {"threshold_tokens", "throughput", "lambda_max_req_s"} <= set(got)
    assert out["model"]["prfaas_pd"]["threshold_tokens"] == pytest.approx(19400, rel=0.05)
    assert out["model"]["homogeneous_pd"]["threshold_tokens"] is None


def test_the_simulator_ranks_them_as_the_paper(points) -> None:
    res = _simulate(points, paper.stages(), paper.LENGTHS, paper.OUTPUT_TOKENS, 1500, 0, cut_gbps=4.0)
    prfaas, homo, naive = (res[k] for k in NAMES)
    assert prfaas["capacity_vs_homogeneous"] >= 1.4
    assert prfaas["capacity_req_s"] > naive["capacity_req_s"]
    p90 = {k: res[k]["at_common_rate"]["ttft_s"]["p90"] for k in NAMES}
    assert p90["prfaas_pd"] < p90["homogeneous_pd"] and p90["prfaas_pd"] < p90["naive_heterogeneous"]
    cut = res["link_cut"]
    on, off = cut["with_scheduler"], cut["without_scheduler"]
    # the scheduler raised t and kept the link's backlog bounded; without it the backlog piles up
    assert on["threshold_final"] > off["threshold_final"]
    assert on["link_backlog_s_max_after_cut"] < off["link_backlog_s_max_after_cut"] / 2
    assert any(c["reason"] == "raise" for c in on["threshold_changes"])


def test_a_profile_measured_here(capsys) -> None:
    main(["--profile", str(MEASURED), "--requests", "1500"])
    m = json.loads(capsys.readouterr().out)["measured"]
    sim = m["sim"]
    assert sim["prfaas_pd"]["capacity_req_s"] > sim["homogeneous_pd"]["capacity_req_s"]
    assert sim["prfaas_pd"]["capacity_req_s"] > sim["naive_heterogeneous"]["capacity_req_s"]
    cut = sim["link_cut"]
    assert (
        cut["with_scheduler"]["link_backlog_s_max_after_cut"]
        < cut["without_scheduler"]["link_backlog_s_max_after_cut"]
    )
