"""``xllm plan prfaas``: the PrfaaS throughput model's search from profile files, JSON out; bad input
is one line naming the flag (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xservice.cli import main

PROFILES = Path(__file__).resolve().parents[2] / "benchmarks/cluster_sim/profiles/prfaas"
PAPER = [
    "plan", "prfaas", "--prfaas-profile", str(PROFILES / "h200x8-paper-table5.json"),
    "--local-profile", str(PROFILES / "h20x8-paper-derived.json"), "--prfaas-instances", "4",
    "--local-instances", "8", "--bandwidth-gbps", "100", "--lengths", "lognormal:mu=9.9,sigma=1,lo=128,hi=131072",
    "--output-tokens", "1024", "--slo-tokens-per-s", "40",
]  # fmt: skip


def test_the_paper_case_study(capsys) -> None:
    assert main(PAPER + ["--search"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["prfaas_pd"]
    assert best["instances"] == {"prfaas": 4, "prefill": 3, "decode": 5}
    assert best["threshold_tokens"] == pytest.approx(19400, rel=0.05)
    assert best["lambda_max_req_s"] == pytest.approx(3.24, rel=0.05)
    assert out["homogeneous_pd"]["instances"] == {"prfaas": None, "prefill": 9, "decode": 3}
    assert out["ratio_vs_homogeneous"]["prfaas_pd"] == pytest.approx(1.54, rel=0.05)
    assert len(best["search"]["by_split_at_threshold"]) == 7  # figure 5 (a)


def test_measured_lengths_and_device_profiles(tmp_path: Path, capsys) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(100 + 7 * i) for i in range(300)))
    args = [
        "plan", "prfaas", "--prfaas-profile", str(PROFILES / "emulated-prfaas.json"),
        "--local-profile", str(PROFILES / "emulated-local.json"), "--prfaas-instances", "1",
        "--local-instances", "3", "--bandwidth-gbps", "0.002", "--lengths", f"file:{lengths}",
        "--output-tokens", "16", "--slo-tokens-per-s", "10", "--service", "mean",
    ]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert 100 <= out["prfaas_pd"]["threshold_tokens"] <= 2200 and out["inputs"]["service"] == "mean"
    assert "search" not in out["prfaas_pd"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("--lengths", "lognormal:mu=9.9"), "mu, sigma and hi"),
        (("--lengths", "lognormal:mu=9.9,sigma=1"), "hi (the longest prompt)"),
        (("--lengths", "zipf:1"), "--lengths"),
        (("--local-instances", "1"), "at least 1 PrfaaS instance and 2 local"),
        (("--prfaas-profile", "/nonexistent.json"), "cannot read profile"),
        (("--slo-tokens-per-s", "400"), "misses the SLO"),
    ],
)
def test_bad_input_is_one_line(change: tuple[str, str], said: str, capsys) -> None:
    args = list(PAPER)
    args[args.index(change[0]) + 1] = change[1]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
