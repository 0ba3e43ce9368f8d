"""Config presets in ``configs/`` and the YAML loader: 1:1 with the dataclasses, unknown keys refused;
``cluster``'s sub-sections, its former flat keys (loaded with a warning) and their CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.xservice.cluster.helpers import ClusterServer, complete
from xengine.api.config import EngineConfig, from_dict
from xservice.cluster.config_legacy import FLAT_KEYS, FLAT_SWITCHES, section_types
from xservice.commands.common import add_config_flags, config_overrides
from xservice.config import XllmConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))


def test_the_expected_presets_exist() -> None:
    names = {p.name for p in PRESETS}
    assert {"cpu-single.yaml", "cpu-tiny-test.yaml", "npu-910b.yaml", "cuda.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_validates_and_round_trips(path: Path) -> None:
    cfg = load_config(path)
    cfg.validate()
    # every key in the file landed on the dataclass field of the same name (cluster: one level deeper)
    for section, values in (yaml.safe_load(path.read_text()) or {}).items():
        for key, value in (values or {}).items():
            got = getattr(getattr(cfg, section), key)
            for sub, item in value.items() if dataclasses.is_dataclass(got) else [(None, value)]:
                field = getattr(got, sub) if sub else got
                field = list(field) if isinstance(field, tuple) else field  # a YAML list is kept as a tuple
                assert field == item, f"{path.name}: {section}.{key}{'.' + sub if sub else ''}"
    # what the engine process receives: EngineConfig as JSON, rebuilt with from_dict
    rebuilt = from_dict(EngineConfig, json.loads(json.dumps(dataclasses.asdict(cfg.engine))))
    assert rebuilt == cfg.engine


def test_cpu_single_spells_out_every_key() -> None:
    data = yaml.safe_load((CONFIGS / "cpu-single.yaml").read_text())
    for section in dataclasses.fields(XllmConfig):
        cls = type(getattr(XllmConfig(), section.name))
        assert set(data[section.name]) == {f.name for f in dataclasses.fields(cls)}, section.name
    for name, cls in section_types().items():  # cluster's sub-sections, every field
        assert set(data["cluster"][name]) == {f.name for f in dataclasses.fields(cls)}, f"cluster.{name}"


def test_device_presets_name_their_device() -> None:
    assert load_config(CONFIGS / "npu-910b.yaml").device.device == "npu"
    assert load_config(CONFIGS / "cuda.yaml").device.device == "cuda"
    tiny = load_config(CONFIGS / "cpu-tiny-test.yaml")
    assert (tiny.device.device, tiny.device.num_threads, tiny.cache.num_blocks) == ("cpu", 1, 64)


@pytest.mark.parametrize(
    "text, key",
    [
        ("cache:\n  blok_size: 16\n", "cache.blok_size"),
        ("service:\n  prot: 80\n", "service.prot"),
        ("caches:\n  block_size: 16\n", "caches"),
    ],
)
def test_unknown_key_is_an_error_naming_it(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"'{key}'"):
        load_config(path)


def test_invalid_value_is_an_error_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("cache:\n  block_size: 3\n")
    with pytest.raises(ValueError, match="cache.block_size"):
        load_config(path)


def test_overrides_beat_the_file() -> None:
    cfg = load_config(CONFIGS / "cpu-tiny-test.yaml", {"cache": {"block_size": 32, "num_blocks": None}})
    assert cfg.cache.block_size == 32 and cfg.cache.num_blocks == 64  # None means "not given"


def test_data_parallel_in_cluster_mode_is_refused_by_name() -> None:
    overrides = {"parallel": {"data_parallel_size": 2}, "cluster": {"launch": {"instances": "2"}}}
    with pytest.raises(ValueError, match="data_parallel_size > 1 is not supported in cluster mode"):
        load_config(CONFIGS / "cpu-tiny-test.yaml", overrides)


# ------------------------------------------------------------------- cluster sub-sections, flat keys

NEW_KEY = {**{old: f"{sec}.{name}" for old, (sec, name) in FLAT_KEYS.items()},
           **{old: f"{sec}.enabled" for old, sec in FLAT_SWITCHES.items()}}  # fmt: skip
BORN_NESTED = {"prfaas"}  # sections added after the flat keys went: they never had flat names
BORN_NESTED_KEYS = {"launch": {"prefill_tensor_parallel_size", "decode_tensor_parallel_size"}}  # likewise


def _flat(nested: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A nested ``cluster`` mapping in the former flat keys."""
    old = {new: key for key, new in NEW_KEY.items()}
    return {old[f"{sec}.{name}"]: v for sec, values in nested.items() for name, v in values.items()}


def _load(tmp_path: Path, cluster: dict[str, Any], name: str) -> XllmConfig:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"cluster": cluster}))
    return load_config(path)


@pytest.mark.parametrize("preset", ["cpu-single.yaml", "cluster-dynamic-pd.yaml", "cluster-epd-auto.yaml"])
def test_flat_cluster_keys_load_with_a_warning_naming_the_new_key(tmp_path: Path, preset: str) -> None:
    nested = yaml.safe_load((CONFIGS / preset).read_text())["cluster"]
    nested = {
        sec: {k: v for k, v in values.items() if k not in BORN_NESTED_KEYS.get(sec, ())}
        for sec, values in nested.items()
        if sec not in BORN_NESTED
    }
    flat = _flat(nested)
    assert len(flat) == sum(len(v) for v in nested.values())
    with pytest.warns(FutureWarning) as caught:
        old = _load(tmp_path, flat, "flat.yaml")
    assert old.cluster == _load(tmp_path, nested, "nested.yaml").cluster
    said = {str(w.message) for w in caught}
    for key in flat:
        assert f"cluster.{key} is now cluster.{NEW_KEY[key]}; the flat key still loads" in said, key


def test_flat_cluster_keys_through_overrides_land_in_their_section() -> None:
    flat = {"pd_mode": "dynamic", "instances": "p:prefill,d:decode", "min_decode_instances": 1, "auth": False}
    with pytest.warns(FutureWarning, match=r"cluster\.pd_mode is now cluster\.pd\.mode"):
        old = load_config(None, {"cluster": flat})
    nested = {
        "pd": {"mode": "dynamic", "min_decode_instances": 1},
        "launch": {"instances": "p:prefill,d:decode"},
    }
    new = load_config(None, {"cluster": {**nested, "auth": {"enabled": False}}})
    assert old.cluster == new.cluster and new.cluster.pd.mode == "dynamic" and not new.cluster.auth.enabled


def test_nested_cluster_keys_load_without_a_warning(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cfg = load_config(CONFIGS / "cluster-colocation.yaml")
    assert (
        cfg.cluster.colocation.enabled and cfg.cluster.launch.instances == "prefill-0:prefill,decode-0:decode"
    )


@pytest.mark.parametrize(
    "cluster, key, valid",
    [
        ({"pd_mod": "dynamic"}, "cluster.pd_mod", "pd (mode, min_decode_instances"),
        ({"pd": {"pd_mode": "dynamic"}}, "cluster.pd.pd_mode", "valid keys: decode_capacity_pressure"),
        ({"launch": "a,b"}, "cluster.launch", "must be a mapping"),
    ],
)
def test_a_wrong_cluster_key_fails_naming_the_valid_ones(
    tmp_path: Path, cluster, key: str, valid: str
) -> None:
    with pytest.raises(ValueError, match=f"'{key}'") as err:
        _load(tmp_path, cluster, "bad.yaml")
    assert valid in str(err.value)


def test_a_key_given_flat_and_nested_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'cluster.pd.mode' given twice"), pytest.warns(FutureWarning):
        _load(tmp_path, {"pd": {"mode": "static"}, "pd_mode": "dynamic"}, "both.yaml")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    return parser


def _value(hint: type, default: Any) -> tuple[list[str], Any]:
    """Command-line words and the value they give, for a field of type ``hint``."""
    if hint is bool:
        return [], not default
    return ([str(7)], 7) if hint is int else ([str(0.25)], 0.25) if hint is float else (["x-y"], "x-y")


@pytest.mark.parametrize("section", list(section_types()))
def test_each_cluster_section_has_its_flags_and_the_former_ones(section: str) -> None:
    import typing

    cls = section_types()[section]
    hints = typing.get_type_hints(cls)
    former = {new: old for old, new in NEW_KEY.items()}
    parser = _parser()
    for f in dataclasses.fields(cls):
        words, value = _value(hints[f.name], f.default)
        spelled = f"{section}_{f.name}" if f.name != "enabled" else section
        names = {spelled, former.get(f"{section}.{f.name}", spelled)}
        for name in names:
            flag = name.replace("_", "-")
            flag = f"--no-{flag}" if hints[f.name] is bool and f.default else f"--{flag}"
            got = config_overrides(parser.parse_args([flag, *words]))
            assert got == {"cluster": {section: {f.name: value}}}, (flag, got)


def test_cluster_flags_reach_the_config_and_help_documents_each_field_once() -> None:
    args = _parser().parse_args(
        ["--instances", "p:prefill,d:decode", "--pd-mode", "dynamic", "--min-decode-instances", "1",
         "--slo-tpot-ms", "50", "--routing-policy", "least_load", "--no-auth", "--registry-key-prefix", "/t"]
    )  # fmt: skip
    cl = load_config(None, config_overrides(args)).cluster
    assert (cl.launch.instances, cl.pd.mode, cl.pd.min_decode_instances) == (
        "p:prefill,d:decode",
        "dynamic",
        1,
    )
    assert (cl.slo.tpot_ms, cl.routing.policy, cl.auth.enabled, cl.registry.key_prefix) == (
        50.0, "least_load", False, "/t"
    )  # fmt: skip
    text = " ".join(_parser().format_help().split())
    for section, cls in section_types().items():
        for f in dataclasses.fields(cls):
            assert text.count(f"[cluster.{section}.{f.name};") == 1, f"cluster.{section}.{f.name}"


def test_a_cluster_serves_from_a_nested_config(model_dir: Path) -> None:
    server = ClusterServer(
        model_dir,
        {
            "launch": {"instances": "engine-0:mixed"},
            "registry": {"store": "embedded", "key_prefix": "/nested"},
            "routing": {"policy": "least_load"},
        },
    )
    try:
        assert server.admin()["routing_policy"] == "least_load"
        assert list(server.instances()) == ["engine-0"]
        assert complete(server.openai(), "Story: once upon a time").choices[0].text
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("prfaas", "said"),
    [
        ({"enabled": True, "key_prefix": "/xllm"}, "must differ from cluster.registry.key_prefix"),
        ({"enabled": True, "netns": "xprfaas"}, "set cluster.prfaas.engine_host"),
        ({"enabled": True, "netns": "xprfaas", "engine_host": "10.77.0.2"}, "set cluster.prfaas.store_host"),
    ],
)
def test_prfaas_settings_that_cannot_work_are_refused(prfaas: dict, said: str) -> None:
    cluster = {"launch": {"instances": "p:prefill,d:decode"}, "prfaas": prfaas}
    with pytest.raises(ValueError, match=said):
        load_config(None, {"cluster": cluster})
