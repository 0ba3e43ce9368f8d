"""``cluster.epd.strategy: auto``: the EPD profiler at ``xllm serve`` start-up chooses the strategy, the
roles and Algorithm 1's budgets, cached on disk for the next start.

Unit: config validation errors name the field and the fix; ``plan_deployment`` (pure) turns a given
profiler report into roles and engine overrides; the cache key follows the model's files and the
SLOs. End to end: ``xllm serve`` of a tiny Qwen2-VL over three real engine processes (Mooncake over
TCP) profiles (quick effort), runs the roles it chose (``/v1/admin/instances``), answers an image chat
with HF's greedy tokens, and a second start reuses the cached profile without profiling.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.xservice.cluster.helpers import ROOT, ClusterServer
from xengine.api.config import EngineConfig
from xservice.cluster.config_legacy import cluster_from_dict
from xservice.config import XllmConfig
from xservice.policies.epd.assign import engine_for, goodput_by_strategy, plan_deployment

NAMES = ["a", "b", "c", "d"]
AUTO: dict[str, Any] = {"instances": "a,b,c", "epd_strategy": "auto", "epd_workload": "image-heavy"}


# ---------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"instances": "a:encode,b,c"}, "list the instances without one (or with role 'auto'); got a:encode"),
        ({"epd_strategy": "none", "instances": "a:auto,b:mixed"}, "role 'auto' needs cluster.epd.strategy: auto"),
        ({"epd_workload": ""}, "needs cluster.epd.workload: 'image-heavy', 'text-heavy' or a description"),
        ({"epd_workload": "video-heavy"}, "expected one of image-heavy, text-heavy, or key=value items"),
        ({"epd_workload": "images_per_request=2,image_size=448x448"}, "missing prompt_tokens, output_tokens"),
        ({"epd_workload": "images_per_request=1,image_size=big,prompt_tokens=8,output_tokens=8"}, "image_size must be WxH"),
        ({"epd_workload": "images_per_request=1,image_size=8x8,prompt_tokens=8,output_tokens=0"}, "output_tokens must be an integer >= 1"),
        ({"epd_workload": "images_per_request=1,image_size=8x8,prompt_tokens=8,output_tokens=8,request_rate=-1"}, "request_rate must be a number > 0 or 'max'"),
        ({"epd_workload": "images_per_request=1,image_size=8x8,prompt_tokens=8,output_tokens=8,rate=1"}, "got 'rate=1'"),
        ({"instances": ""}, "list their names in cluster.launch.instances"),
        ({"launcher": "external", "metadata_store": "etcd"}, "with launcher local or ray"),
        ({"pd_mode": "dynamic"}, "'auto' needs cluster.pd.mode: static and colocation off"),
        ({"tpot_slo_ms": 0.0}, "cluster.slo.ttft_ms and cluster.slo.tpot_ms must be > 0"),
        ({"epd_profile_effort": "fast"}, "cluster.epd.profile_effort must be one of full, quick"),
        ({"epd_auto_strategies": "EP+D,E+D"}, "must list distinct strategies from none, E+P+D, EP+D, ED+P"),
        ({"instances": "a,b", "epd_auto_strategies": "E+P+D"}, "none fits 2 instance(s)"),
        ({"epd_strategy": "E+D"}, "cluster.epd.strategy must be one of none, E+P+D, EP+D, ED+P, auto"),
    ],
)  # fmt: skip
def test_bad_auto_config_names_the_field_and_the_fix(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="cluster") as err:
        cluster_from_dict({**AUTO, **changes}).validate()
    assert message in str(err.value)


def test_auto_instances_take_role_auto_and_a_workload_mapping_its_flag_form() -> None:
    workload = {"images_per_request": 2, "image_size": [448, 224], "prompt_tokens": 64, "output_tokens": 16}
    cl = cluster_from_dict({**AUTO, "instances": "a, b:auto ,c", "epd_workload": workload})
    cl.validate()
    assert cl.instance_specs() == [("a", "auto"), ("b", "auto"), ("c", "auto")]
    assert cl.epd.workload == "images_per_request=2,image_size=448x224,prompt_tokens=64,output_tokens=16"
    assert cl.epd.auto_strategies_list() == ("none", "E+P+D", "EP+D", "ED+P")
    assert cluster_from_dict({"launch": {"instances": "a,b"}}).instance_specs() == [
        ("a", "mixed"),
        ("b", "mixed"),
    ]


def test_a_bad_auto_config_fails_xllm_serve_in_one_line(make_model_dir) -> None:
    cmd = [sys.executable, "-m", "xservice", "serve", "--config", str(ROOT / "configs/cluster-epd-auto.yaml")]
    cmd += ["--model", str(make_model_dir("qwen2_vl")), "--instances", "e:encode,p,d"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "got e:encode" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------- plan


def report(strategy: str, counts: dict[str, int], tau_e: int = 3, tau_t: int = 200) -> dict[str, Any]:
    """A profiler report with the fields ``plan_deployment`` reads (as ``run_profile`` returns them)."""
    rows = [
        {"strategy": strategy, "counts": counts, "goodput": 5.0},
        {"strategy": "EPD", "counts": {"EPD": 4}, "goodput": 4.0},
        {"strategy": "EP+D", "counts": {"EP": 3, "D": 1}, "goodput": 3.5},
        {"strategy": "EP+D", "counts": {"EP": 1, "D": 3}, "goodput": 1.0},
    ]
    config = {
        "scheduler.max_encode_images": max(1, tau_e),
        "scheduler.max_encode_tokens": max(1, tau_e) * 64,
        "scheduler.max_num_batched_tokens": max(1, tau_t),
    }
    measured = {"tau_e": tau_e, "tau_t": tau_t, "feasible": True, "config": config}
    return {"choice": rows[0], "strategies": rows, "budgets": {"decode_batch": 8, "measured": measured}}


ENCODE = {"max_encode_images": 3, "max_encode_tokens": 192}
PREFILL = {"max_num_batched_tokens": 200}


@pytest.mark.parametrize(
    ("strategy", "counts", "roles", "overrides"),
    [
        # the budgets only where steps carry decodes: the others keep their configured batch limits
        ("E+P+D", {"E": 2, "P": 1, "D": 1}, ["encode", "encode", "prefill", "decode"], [{}, {}, {}, {}]),
        ("EP+D", {"EP": 1, "D": 3}, ["encode_prefill", "decode", "decode", "decode"], [{}, {}, {}, {}]),
        ("ED+P", {"ED": 3, "P": 1}, ["encode_decode"] * 3 + ["prefill"], [ENCODE] * 3 + [{}]),
        ("EPD", {"EPD": 4}, ["mixed"] * 4, [{**ENCODE, **PREFILL}] * 4),
    ],
)  # fmt: skip
def test_plan_gives_roles_in_pool_order_and_budgets_to_encoders_and_prefillers_that_decode(
    strategy: str, counts: dict[str, int], roles: list[str], overrides: list[dict[str, int]]
) -> None:
    plan = plan_deployment(report(strategy, counts), NAMES)
    assert plan.strategy == ("none" if strategy == "EPD" else strategy)
    assert plan.roles == dict(zip(NAMES, roles, strict=True))
    assert plan.overrides == dict(zip(NAMES, overrides, strict=True)) and plan.notes == []
    assert plan.instances() == ",".join(f"{n}:{r}" for n, r in zip(NAMES, roles, strict=True))
    cl = cluster_from_dict({"launch": {"instances": plan.instances()}, "epd": {"strategy": plan.strategy}})
    cl.validate()  # a valid fixed-strategy cluster


def test_plan_keeps_the_token_budget_when_it_is_zero_or_chunked_prefill_is_off() -> None:
    zero = plan_deployment(report("EPD", {"EPD": 4}, tau_e=0, tau_t=0), NAMES)
    assert zero.overrides["a"] == {"max_encode_images": 1, "max_encode_tokens": 64}  # τ_e 0: one image a step
    assert "τ_t is 0" in zero.notes[0]
    unchunked = plan_deployment(report("EPD", {"EPD": 4}), NAMES, chunked_prefill=False)
    assert unchunked.overrides == dict.fromkeys(NAMES, ENCODE)
    assert "needs chunked prefill" in unchunked.notes[0]
    # no instance prefills and decodes: τ_t applies nowhere, and nothing is noted
    assert plan_deployment(report("ED+P", {"ED": 2, "P": 2}, tau_t=0), NAMES).notes == []
    with pytest.raises(ValueError, match="chose 4 instance"):
        plan_deployment(report("EPD", {"EPD": 4}), NAMES[:3])


def test_budgets_land_on_the_engine_config_and_goodput_is_per_strategy() -> None:
    engine = EngineConfig()
    tuned = engine_for(engine, {**ENCODE, **PREFILL})
    assert (tuned.scheduler.max_encode_images, tuned.scheduler.max_encode_tokens) == (3, 192)
    assert tuned.scheduler.max_num_batched_tokens == 200 and tuned.model == engine.model
    assert engine_for(engine, {}) is engine
    assert goodput_by_strategy(report("ED+P", {"ED": 2, "P": 2})) == {"ED+P": 5.0, "none": 4.0, "EP+D": 3.5}


def test_the_cache_key_follows_the_model_files_and_the_slos(tmp_path: Path) -> None:
    from xservice.cluster.epd.auto import cache_file, cache_key, profile_request

    model = tmp_path / "vl"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cl = cluster_from_dict(
        {**AUTO, "epd_profile_cache_dir": str(tmp_path / "cache"), "epd_profile_effort": "quick"}
    )
    cfg = dataclasses.replace(
        XllmConfig(cluster=cl), model=dataclasses.replace(XllmConfig().model, model=str(model))
    )
    req = profile_request(cfg)
    assert (req.num_instances, req.repeats, req.images_per_request, req.image_size) == (3, 1, 4, (448, 448))
    first = cache_file(cfg, cache_key(cfg, req))
    assert first.parent == tmp_path / "cache" and first == cache_file(cfg, cache_key(cfg, req))
    slower = dataclasses.replace(
        cfg, cluster=dataclasses.replace(cl, slo=dataclasses.replace(cl.slo, tpot_ms=50.0))
    )
    assert cache_file(slower, cache_key(slower, profile_request(slower))) != first
    os.utime(model / "config.json", ns=(1, 1))
    assert cache_file(cfg, cache_key(cfg, req)) != first


# ---------------------------------------------------------------------------------------- serve


def test_serve_auto_runs_the_chosen_roles_and_reuses_the_cached_profile(
    make_model_dir, tmp_path: Path
) -> None:
    pytest.importorskip("mooncake.engine")
    pytest.importorskip("openai")
    from tests.xengine.vl_oracle import VLOracle, random_image, user_turn

    vl_dir = make_model_dir("qwen2_vl")
    image = random_image(84, 112, seed=2)  # 12 image tokens
    messages = [user_turn(image, "What is in this picture?")]
    expected = VLOracle(vl_dir).greedy(messages, [image], 8)
    cluster = {
        "instances": "engine-0,engine-1,engine-2",
        "epd_strategy": "auto",
        "epd_workload": {
            "images_per_request": 1,
            "image_size": "112x112",
            "prompt_tokens": 32,
            "output_tokens": 8,
        },
        "epd_auto_strategies": "E+P+D,EP+D,ED+P",  # a disaggregated one, so roles and transfers are exercised
        "epd_profile_effort": "quick",
        "epd_profile_cache_dir": str(tmp_path / "profiles"),
        "ttft_slo_ms": 2000.0,
        "tpot_slo_ms": 200.0,
    }
    views = []
    for start, first_port in enumerate((24700, 24750)):
        engine = {
            "model": {"max_model_len": 512, "served_model_name": "xllm-tiny-vl"},
            "cache": {"num_blocks": 512, "kv_transfer_port_range": f"{first_port}-{first_port + 49}"},
        }
        server = ClusterServer(
            vl_dir, cluster, {"engine_max_restarts": 0, "max_body_bytes": 16 << 20}, engine
        )
        try:
            view = server.admin()
            auto = view["epd_auto"]
            roles = {name: i["role"] for name, i in server.instances().items()}
            assert roles == auto["roles"] and view["epd"]["strategy"] == auto["strategy"]
            assert auto["strategy"] in ("E+P+D", "EP+D", "ED+P") and set(auto["goodput"]) == {
                "E+P+D",
                "EP+D",
                "ED+P",
            }
            out = server.openai().chat.completions.create(
                model="xllm-tiny-vl", messages=messages, temperature=0, max_tokens=8,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            assert out.choices[0].model_extra["token_ids"] == expected
            log = server.log_path.read_text()
            print(next(line for line in log.splitlines() if "EPD auto: strategy" in line))
        finally:
            server.stop()
        assert auto["source"] == ("profile", "cache")[start]
        assert ("xllm: EPD profiler: " in log) == (start == 0)  # the second start ran no profile
        views.append(auto)
    first, second = views
    assert Path(first["cache_file"]).is_file() and second["cache_file"] == first["cache_file"]
    assert (second["roles"], second["overrides"]) == (first["roles"], first["overrides"])
