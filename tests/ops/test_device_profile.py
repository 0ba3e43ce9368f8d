"""Device profiles (``ops/platforms/device_profile.py``): the step-time model, its file format and its
checks; only the emulated platform takes one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.platforms import platform_names, resolve_platform
from ops.platforms.device_profile import DeviceProfile, load_profile

PROFILE = {
    "name": "t",
    "base_ms": 2.0,
    "tokens_ms": [[1, 0.0], [100, 10.0], [1000, 190.0]],
    "attention_ns": 100.0,
    "seq_us": 50.0,
}


def test_step_time_is_base_plus_curve_plus_attention_plus_sequences() -> None:
    p = DeviceProfile(**PROFILE)
    assert p.step_seconds([], []) == 0.0
    # one decode on a 1001-token context: 1000 cached pairs
    assert p.step_seconds([1], [1001]) == pytest.approx((2.0 + 0.0 + 0.05) / 1000 + 100e-9 * 1000)
    # 50 + 50 tokens: the curve at 100; a fresh prompt (q == s) adds no cached pairs
    assert p.step_seconds([50, 50], [50, 50]) == pytest.approx((2.0 + 10.0 + 0.1) / 1000)
    # between points, and past the last one along its segment
    assert p.tokens_cost_ms(550) == pytest.approx(100.0)
    assert p.tokens_cost_ms(2000) == pytest.approx(390.0)


def test_bad_profiles_are_refused_with_the_file_and_the_problem(tmp_path: Path) -> None:
    cases = {
        "unknown": ({**PROFILE, "speed": 1}, "unknown field"),
        "order": ({**PROFILE, "tokens_ms": [[10, 1.0], [5, 2.0]]}, "increasing"),
        "negative": ({**PROFILE, "base_ms": -1.0}, ">= 0"),
        "missing": ({"name": "x"}, "base_ms"),
        "capacity": ({**PROFILE, "kv_capacity_tokens": 0}, "kv_capacity_tokens"),
    }
    for name, (data, match) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            load_profile(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "absent.json")
    good = tmp_path / "good.json"
    good.write_text(DeviceProfile(**PROFILE).to_json())
    assert load_profile(good) == DeviceProfile(**PROFILE)


def test_only_the_emulated_platform_takes_a_profile(tmp_path: Path) -> None:
    assert "emulated" in platform_names()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(PROFILE))
    with pytest.raises(ValueError, match="for --device emulated"):
        resolve_platform("cpu").configure(str(path))
    emulated = resolve_platform("emulated")
    with pytest.raises(ValueError, match="needs a device profile"):
        emulated.configure(None)
    emulated.configure(str(path))
    assert emulated.capabilities.emulated and emulated.profile == DeviceProfile(**PROFILE)
    assert resolve_platform(None).name != "emulated"  # never detected
