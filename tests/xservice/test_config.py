"""Config presets in ``configs/`` and the YAML loader: 1:1 with the dataclasses, unknown keys refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from xengine.api.config import EngineConfig, from_dict
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
    # every key in the file landed on the dataclass field of the same name
    for section, values in (yaml.safe_load(path.read_text()) or {}).items():
        for key, value in (values or {}).items():
            assert getattr(getattr(cfg, section), key) == value, f"{path.name}: {section}.{key}"
    # what the engine process receives: EngineConfig as JSON, rebuilt with from_dict
    rebuilt = from_dict(EngineConfig, json.loads(json.dumps(dataclasses.asdict(cfg.engine))))
    assert rebuilt == cfg.engine


def test_cpu_single_spells_out_every_key() -> None:
    data = yaml.safe_load((CONFIGS / "cpu-single.yaml").read_text())
    for section in dataclasses.fields(XllmConfig):
        cls = type(getattr(XllmConfig(), section.name))
        assert set(data[section.name]) == {f.name for f in dataclasses.fields(cls)}, section.name


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
