"""Engine messages of LoRA serving (``xengine/lora/``): runtime load / unload and the adapters' stats."""

from __future__ import annotations

import msgspec


class LoadLoRA(msgspec.Struct, tag="load_lora", kw_only=True):
    """Register LoRA adapter ``name`` from PEFT folder ``path`` (``replace``: a loaded one of that name
    too); answered by a ``UtilityResult`` (``ok=False`` and the error if it cannot be served)."""

    call_id: int
    name: str
    path: str
    replace: bool = False


class UnloadLoRA(msgspec.Struct, tag="unload_lora", kw_only=True):
    call_id: int
    name: str


class LoRAStatsMsg(msgspec.Struct, kw_only=True):
    max_loras: int = 0
    num_adapters: int = 0  # registered
    running_adapters: list[str] = []  # adapters of running requests
    waiting_adapters: list[str] = []  # adapters of waiting requests
    slot_adapters: list[str] = []  # adapters whose weights are in device slots now
    num_slot_loads: int = 0  # adapters written into a device slot
    num_disk_loads: int = 0  # adapters read from their folder
