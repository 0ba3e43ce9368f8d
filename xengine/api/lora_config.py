"""The ``lora`` section: serving LoRA adapters beside the base model (``xengine/lora/``).

Torch-free, like ``config.py``, whose ``EngineConfig`` holds it. Flags and defaults follow vLLM's
(``--enable-lora``, ``--lora-modules``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras``);
``docs/lora.md`` is the guide."""

from __future__ import annotations

from dataclasses import dataclass

from xengine.api.config_fields import _f


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = _f(
        False,
        "Serve LoRA adapters (PEFT folders) beside the base model: a request's model field names one, and one "
        "step batches requests of different adapters and the base model.",
    )
    lora_modules: tuple[str, ...] = _f(
        (),
        "Adapters registered at start, each name=path (a PEFT folder: adapter_config.json and "
        'adapter_model.safetensors) or a JSON object {"name": ..., "path": ...}; needs enable_lora.',
    )
    max_loras: int = _f(1, "Most distinct adapters in one step (their weights held on the device).")
    max_lora_rank: int = _f(16, "Largest adapter rank accepted (the device slots are sized for it).")
    max_cpu_loras: int | None = _f(
        None,
        "Adapters kept loaded in host memory (least recently used dropped first; reloaded from their folder "
        "when asked again). Unset: max_loras.",
    )
    allow_runtime_lora_updating: bool = _f(
        False,
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
    )

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, list):  # from YAML or a flag: kept as the default's type
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))

    def validate(self) -> None:
        if self.max_loras < 1:
            raise ValueError("lora.max_loras must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError("lora.max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("lora.max_cpu_loras must be >= lora.max_loras")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora.lora_modules needs lora.enable_lora (--enable-lora)")
        if not isinstance(self.lora_modules, list | tuple):
            raise ValueError("lora.lora_modules must be a list of name=path entries")
        parse_lora_modules(self.lora_modules)

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(entries: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``[(name, path)]`` of ``lora_modules`` entries (``name=path`` or a JSON object); ``ValueError``
    naming the bad entry."""
    import json

    out: list[tuple[str, str]] = []
    for entry in entries:
        if not isinstance(entry, str):
            raise ValueError(f"lora.lora_modules entry {entry!r} must be a string name=path")
        text = entry.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"lora.lora_modules entry {entry!r}: invalid JSON ({e})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"lora.lora_modules entry {entry!r} must be name=path or a JSON object")
            name, path = obj.get("name"), obj.get("path")
        else:
            name, sep, path = text.partition("=")
            if not sep:
                name = path = None
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora.lora_modules entry {entry!r} must be name=path")
        if name in (n for n, _ in out):
            raise ValueError(f"lora.lora_modules names adapter {name!r} twice")
        out.append((name, path))
    return out
