"""Starting LoRA in an engine: the manager, the runner's hook and the scheduler's adapter gate."""

from __future__ import annotations

from typing import Any

from xengine.api.config import EngineConfig
from xengine.lora.manager import LoRAManager, lora_gate


def lora_blocker(engine: Any, config: EngineConfig) -> str | None:
    """Why this engine cannot serve adapters (None: it can)."""
    if engine.platform.capabilities.emulated:
        return "an emulated device (no real weights)"
    if engine.parallel is not None:
        return "tensor or expert parallelism (adapters are not sharded across ranks yet)"
    if config.speculative_config.enabled:
        return "speculative decoding (drafts would run without the adapter)"
    if engine.graph_mode != "eager" and engine.platform.name != "cpu":
        return f"{engine.graph_mode} device graphs (the adapter rows change every step; use graph_mode eager)"
    return None


def _live_adapters(engine: Any) -> set[str]:
    """The adapters of every request in the engine: scheduled, waiting, or waiting for its grammar."""
    s = engine.scheduler
    reqs = [*s.running, *s.waiting, *engine.structured.waiting.requests()]
    return {r.params.lora_name for r in reqs if r.params.lora_name is not None}


def start_lora(engine: Any, config: EngineConfig) -> LoRAManager | None:
    """The engine's adapters (None without ``lora.enable_lora``); ``ValueError`` if it cannot serve them."""
    if not config.lora.enable_lora:
        return None
    blocker = lora_blocker(engine, config)
    if blocker is not None:
        raise ValueError(f"lora.enable_lora does not run with {blocker} yet")
    device = engine.platform.torch_device()
    manager = LoRAManager(engine.model, config.lora, engine.dtype, device, engine.async_scheduling)
    engine.runner.lora = manager
    manager.live = lambda: _live_adapters(engine)
    engine.scheduler.gates.append(lora_gate(engine.scheduler, config.lora.max_loras))
    return manager
