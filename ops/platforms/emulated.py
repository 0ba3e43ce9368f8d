"""The emulated accelerator: an engine whose forward takes the time a device profile predicts
(``device_profile.py``) and, instead of a checkpoint's math, runs a stand-in model of a few thousand
parameters (``xengine/models/emulated.py``) that emits deterministic pseudo tokens from KV it really
writes and reads. Everything around the forward is real: scheduler, KV pools and prefix cache, PD
transfers of the (small) KV blocks, the service. A step sleeps, so many emulated instances share a few
cores, each with "its own" accelerator.

Tensors live in host memory; the step's predicted time is waited out in ``emulate_step`` (called by
the runner after the forward with the step's shape), counted from when the forward started, so the
stand-in's own compute is inside it rather than added to it.
"""

from __future__ import annotations

import time

import torch

from ops.platforms.base import Capabilities
from ops.platforms.cpu import CpuPlatform
from ops.platforms.device_profile import DeviceProfile, load_profile


class EmulatedPlatform(CpuPlatform):
    name = "emulated"

    _CAPS = Capabilities(
        supports_bf16=False,
        supports_fp16=False,
        supports_graphs=False,
        supports_vmm=False,
        dist_backend="gloo",
        emulated=True,
    )

    def __init__(self) -> None:
        self.profile: DeviceProfile | None = None
        self.num_steps = 0
        self.last_predicted_s = 0.0  # the last step's predicted time
        self.busy_s = 0.0  # predicted device time of the steps run
        self.overrun_s = 0.0  # time steps took beyond their prediction (host work, the stand-in)

    @property
    def capabilities(self) -> Capabilities:
        return self._CAPS

    def configure(self, device_profile: str | None) -> None:
        if not device_profile:
            raise ValueError(
                "device emulated needs a device profile: --device-profile PROFILE.json "
                "(measure one with `xllm profile engine --model DIR`, or write one from published numbers)"
            )
        self.profile = load_profile(device_profile)

    def set_num_threads(self, n: int | None) -> None:
        torch.set_num_threads(1)  # the stand-in's math is tiny; the device's time is slept

    def serving_num_threads(self) -> int | None:
        return 1

    def emulate_step(self, query_lens: list[int], seq_lens: list[int], started: float) -> None:
        """Wait until the step that began at ``started`` (``time.perf_counter``) has taken its predicted time."""
        assert self.profile is not None, "configure() the emulated platform with a profile first"
        predicted = self.profile.step_seconds(query_lens, seq_lens)
        self.num_steps += 1
        self.last_predicted_s = predicted
        self.busy_s += predicted
        left = started + predicted - time.perf_counter()
        if left > 0:
            time.sleep(left)
        else:
            self.overrun_s -= left
