"""Platform resolution (argument > XLLM_DEVICE > detection) and the op registry's fallback."""

from __future__ import annotations

import sys

import pytest
import torch

from ops import platforms
from ops.platforms import current_platform, resolve_platform, set_platform
from ops.platforms.cpu import CpuPlatform
from ops.registry import REFERENCE, get_op, register_backend, register_op


def test_detection_on_this_machine_is_cpu(monkeypatch) -> None:
    monkeypatch.delenv("XLLM_DEVICE", raising=False)
    p = resolve_platform()
    assert p.name == "cpu" and p.torch_device() == torch.device("cpu")
    assert "torch_npu" not in sys.modules  # detection never imports a missing backend


def test_env_and_argument_precedence(monkeypatch) -> None:
    monkeypatch.setenv("XLLM_DEVICE", "tpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'.*XLLM_DEVICE"):
        resolve_platform()
    assert resolve_platform("cpu").name == "cpu"  # the argument wins over the environment
    monkeypatch.setenv("XLLM_DEVICE", "CPU")
    assert resolve_platform().name == "cpu"


@pytest.mark.parametrize("device", ["cuda", "npu:0"])
def test_unavailable_device_is_a_clear_error(device: str) -> None:
    with pytest.raises(ValueError, match="not available"):
        resolve_platform(device)


def test_cpu_capabilities_and_dtypes() -> None:
    p = CpuPlatform()
    assert p.capabilities.dist_backend == "gloo" and not p.capabilities.supports_graphs
    assert p.default_dtype_for(torch.float16) == torch.float32
    assert p.default_dtype_for(torch.bfloat16) == torch.bfloat16
    stats = p.memory_stats()
    assert 0 < stats["free_bytes"] <= stats["total_bytes"] == p.total_memory_bytes()
    with pytest.raises(ValueError):
        p.set_num_threads(0)


def test_current_platform_is_cached_and_settable() -> None:
    set_platform(None)
    try:
        first = current_platform()
        assert current_platform() is first
        mine = CpuPlatform()
        set_platform(mine)
        assert current_platform() is mine
    finally:
        set_platform(None)
    assert platforms.platform_names() == ["npu", "cuda", "cpu", "emulated"]  # emulated: only when asked for


def test_registry_falls_back_to_reference_and_prefers_platform_ops() -> None:
    x, w = torch.randn(2, 8), torch.ones(8)
    ref = get_op("rms_norm", "fake-accelerator")  # a platform with no backend of its own
    assert ref is get_op("rms_norm", REFERENCE)
    torch.testing.assert_close(ref(x, w, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    register_backend(
        "fake-accelerator-2", lambda: register_op("rms_norm", "fake-accelerator-2", lambda *a: "own")
    )
    assert get_op("rms_norm", "fake-accelerator-2")(x, w, 1e-6) == "own"
    with pytest.raises(KeyError, match="no_such_op"):
        get_op("no_such_op", "cpu")
