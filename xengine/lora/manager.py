"""Which adapters the engine knows, which are loaded on the host, and which sit in device slots.

Registered adapters (``lora_modules``, or loaded at run time) are read from their folder when first
used and kept in a host cache of ``max_cpu_loras`` (least recently used dropped first; read again when
asked again). A request's adapter is read when the request arrives (``acquire``: a folder that has
become unreadable is that request's 400) and its host copy is never dropped while a request of it is
in the engine (``live``), so a step never reads a folder: the cache may exceed ``max_cpu_loras`` while
more adapters than that have requests.

A step's adapters are put into device slots (``slots.py``): an adapter already in one stays, others
take a free slot or the least recently used one no request of this step (or, with async scheduling,
of the step still running) uses. The scheduler keeps a step's distinct adapters within
``max_loras`` (``lora_gate``), so there is always a slot: ``max_loras`` of them, twice that with async
scheduling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ops.lora import LoRAGroups
from xengine.api.lora_config import LoRAConfig, parse_lora_modules
from xengine.api.lora_messages import LoRAStatsMsg
from xengine.lora.adapter import LoRAAdapter, load_adapter
from xengine.lora.slots import LoRASlots
from xengine.request import Request


class LoRAManager:
    def __init__(
        self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device, async_mode: bool
    ) -> None:
        self.config = config
        self.device = device
        self.async_mode = async_mode
        num_slots = config.max_loras * (2 if async_mode else 1)
        self.slots = LoRASlots(model, num_slots, config.max_lora_rank, dtype, device)
        self.paths: dict[str, str] = {}  # registered adapters
        self._retired: dict[str, str] = {}  # unloaded while requests of them may still run
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self._held: set[int] = set()  # slots the step still running uses (async scheduling)
        self.live: Callable[[], set[str]] = set  # the adapters of the engine's requests (set by the engine)
        self.num_disk_loads = 0
        self.num_slot_loads = 0
        for name, path in parse_lora_modules(config.lora_modules):
            self.register(name, path)

    # ------------------------------------------------------------------ registry
    def register(self, name: str, path: str, replace: bool = False) -> None:
        """Add adapter ``name`` from PEFT folder ``path``, read and checked now; ``ValueError`` if it
        cannot be served or the name is taken (``replace``: its new weights serve the next steps)."""
        if name in self.paths and not replace:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.config.max_lora_rank)
        self.slots.check(adapter)
        self.num_disk_loads += 1
        self._retired.pop(name, None)
        self._drop_copies(name)
        self.paths[name] = path
        self._cache(adapter)

    def unregister(self, name: str) -> None:
        """Forget adapter ``name`` (``KeyError`` if unknown); requests of it already running finish."""
        path = self.paths.pop(name)
        self._retired[name] = path

    def acquire(self, name: str) -> None:
        """A request of ``name`` arrives: its adapter read into the host cache now (``ValueError`` if its
        folder cannot be read any more); kept there while the request is in the engine."""
        if name not in self.host:
            self._adapter(name)

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> LoRAStatsMsg:
        def names(reqs: Iterable[Request]) -> list[str]:
            return sorted({r.params.lora_name for r in reqs if r.params.lora_name is not None})

        return LoRAStatsMsg(
            max_loras=self.config.max_loras,
            num_adapters=len(self.paths),
            running_adapters=names(running),
            waiting_adapters=names(waiting),
            slot_adapters=list(self.slot_of),
            num_slot_loads=self.num_slot_loads,
            num_disk_loads=self.num_disk_loads,
        )

    def names(self) -> list[str]:
        return list(self.paths)

    def knows(self, name: str) -> bool:
        return name in self.paths

    # ------------------------------------------------------------------ per step
    def step_groups(self, seqs: Iterable[tuple[Request, int]]) -> LoRAGroups | None:
        """The step's rows grouped by slot, its ``(request, number of rows)`` in row order; None when
        every row is the base model's. Loads the step's adapters into slots."""
        seqs = list(seqs)
        names = {r.params.lora_name for r, _ in seqs if r.params.lora_name is not None}
        slots = self._place(names)
        if not names:
            return None
        row_slots: list[int] = []
        for req, n in seqs:
            name = req.params.lora_name
            row_slots.extend([slots[name] if name is not None else -1] * n)
        return LoRAGroups.from_row_slots(row_slots, self.device)

    def _place(self, names: set[str]) -> dict[str, int]:
        placed: dict[str, int] = {}
        for name in names:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                placed[name] = self.slot_of[name]
        for name in names - placed.keys():
            slot = self._free_slot(set(placed.values()))
            self.slots.write(slot, self._adapter(name))
            self.slot_of[name] = slot
            placed[name] = slot
            self.num_slot_loads += 1
        self._held = set(placed.values()) if self.async_mode else set()
        return placed

    def _free_slot(self, taken: set[int]) -> int:
        busy = set(self.slot_of.values()) | taken | self._held  # (a replaced adapter's slot may be held)
        for slot in range(self.slots.num_slots):
            if slot not in busy:
                return slot
        for name, slot in self.slot_of.items():  # least recently used first
            if slot not in taken and slot not in self._held:
                del self.slot_of[name]
                return slot
        raise RuntimeError("no LoRA slot free: a step has more distinct adapters than max_loras")

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is not None:
            self.host.move_to_end(name)
            return adapter
        path = self.paths.get(name) or self._retired.get(name)
        if path is None:
            raise ValueError(f"unknown LoRA adapter {name!r}")
        adapter = load_adapter(name, path, self.config.max_lora_rank)
        self.num_disk_loads += 1
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        excess = len(self.host) - self.config.host_capacity
        if excess > 0:
            keep = self.live() | {adapter.name}
            for name in [n for n in self.host if n not in keep][:excess]:  # least recently used first
                del self.host[name]

    def _drop_copies(self, name: str) -> None:
        """A re-registered name: its old weights must not be served from a cache."""
        self.host.pop(name, None)
        self.slot_of.pop(name, None)


def lora_gate(scheduler: Any, max_loras: int) -> Callable[[Request], bool]:
    """A scheduler gate: a waiting request may start unless it would bring a (max_loras + 1)-th
    adapter into the running set (a step runs only running requests)."""

    def gate(req: Request) -> bool:
        name = req.params.lora_name
        if name is None:
            return True
        active = {r.params.lora_name for r in scheduler.running if r.params.lora_name is not None}
        return name in active or len(active) < max_loras

    return gate
