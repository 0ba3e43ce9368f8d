"""Engine configuration: one frozen dataclass per subsystem, composed into ``EngineConfig``.

Each field's ``help`` metadata is the one place it is documented; the CLI and the YAML
reference are generated from it. Torch-free so the service can build and ship it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from xengine.api.config_fields import _f
from xengine.api.kv_tiers_config import KVTiersConfig
from xengine.api.lora_config import LoRAConfig
from xengine.api.parallel_config import ParallelConfig
from xengine.api.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    model: str = _f(
        "", "Path to a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)."
    )
    served_model_name: str | None = _f(None, "Name reported by /v1/models (default: the folder name).")
    dtype: str = _f(
        "auto",
        "Weights/activation dtype: auto (config torch_dtype, float32 on CPU if fp16), float32, bfloat16.",
    )
    max_model_len: int | None = _f(
        None,
        "Maximum prompt + output tokens per request (default: from config.json, capped at 8192); at "
        "most max_position_embeddings, or as far as the checkpoint's rope_scaling extends it.",
    )
    seed: int = _f(0, "Seed for unseeded sampling.")
    quantization: str = _f(
        "none",
        "Quantize the linear layers at load (the LM head keeps --dtype): none; w8a8 (int8 weights per "
        "output channel, int8 activations per token: the CPU's VNNI unit, CUDA's int8 tensor cores); "
        "int8 (weight-only, per output channel; activations stay in --dtype); int4 (weight-only, groups of "
        "128 along the input); fp8 (e4m3 weights per output channel and activations per token: CUDA on "
        "sm89+). A checkpoint quantized already (compressed-tensors, GPTQ, AWQ; `xllm model quantize`) "
        "runs as it is.",
    )

    enable_prompt_embeds: bool = _f(
        False,
        "Accept prompts given as embeddings (vLLM's --enable-prompt-embeds): /v1/completions' prompt_embeds, "
        "base64 of torch.save of a [tokens, hidden] float32 / float16 / bfloat16 tensor, read without running "
        "pickle code.",
    )
    logprobs_mode: str = _f(
        "raw_logprobs",
        "What logprobs report (vLLM's --logprobs-mode): raw_logprobs (the model's own distribution, before "
        "penalties, biases, allowed ids, grammar and temperature), raw_logits, processed_logprobs or "
        "processed_logits (what the token is drawn from, after all of them).",
    )
    max_logprobs: int = _f(
        20,
        "Most alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs); -1: "
        "the whole vocabulary. A request's -1 asks for the whole vocabulary, within this limit.",
    )

    def validate(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"model.logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
            )
        if self.max_logprobs < -1:
            raise ValueError("model.max_logprobs must be >= -1 (-1: the whole vocabulary)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"model.quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("model.max_model_len must be >= 2")


KV_LAYOUTS = ("auto", "paged", "xtensor")
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
QUANTIZATIONS = ("none", "w8a8", "int8", "int4", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None = _f(
        None,
        "Tokens per KV block (the prefix-cache and transfer unit; an xTensor page). Default: 16 with the "
        "paged layout; with xtensor the smallest power of two >= 16 whose page is a multiple of the device "
        "page (the OS page on CPU, the VMM granularity, 2 MiB, on CUDA) and whose mappings fit vm.max_map_count.",
    )
    kv_layout: str = _f(
        "auto",
        "KV memory layout: 'paged' (block tables; attention gathers each sequence's context), 'xtensor' "
        "(each sequence's KV virtually contiguous, physical pages mapped on demand; attention reads it in "
        "place) or 'auto' (the platform's default: xtensor where it supports VMM and measured faster).",
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache element type: auto (the model's dtype), int8 or fp8 (e4m3): 8-bit K and V with one "
        "float32 scale per token and head, stored beside the values in the same blocks; the pool holds "
        "about twice the tokens of bf16 (four times fp32) and long-context decode reads half the bytes.",
    )
    hybrid_kv: str = _f(
        "auto",
        "Sliding-window layers (Gemma 3, MiMo, Mistral...) keep their KV in a pool of their own, bounded by the "
        "window: blocks wholly behind it are released as the sequence moves on, prefix hits are taken only "
        "as far as every window is still held. auto: on for such models without expert parallelism or full "
        "device graphs; on: required (an error where it cannot run); off: every layer keeps full-length KV.",
    )
    window_pool_blocks: int | None = _f(
        None,
        "Blocks of the sliding-window pool (hybrid_kv). Default: twice what max_num_seqs sequences hold at "
        "once (the window plus two blocks each) plus one step's new tokens; the rest of the budget goes to "
        "the full-attention pool. More keeps released windows longer for prefix hits.",
    )
    state_snapshot_interval: int = _f(
        64,
        "Recurrent models (Qwen3-Next, Nemotron-H): prefix caching keeps a copy of every recurrent layer's "
        "state each this many tokens of a sequence (prefill and decode), so a later prompt sharing the "
        "prefix resumes from the last such position it shares. A multiple of block_size; smaller: longer "
        "hits, more copies. With kv_tiers, the tiers keep these snapshots too.",
    )
    state_snapshot_slots: int | None = _f(
        None,
        "Recurrent models: state snapshots kept for prefix hits (least recently used evicted). Default: "
        "four per max_num_seqs, fewer if they would take more than a quarter of kv_cache_memory_gb. "
        "Running sequences get a state slot each (max_num_seqs) besides these.",
    )
    num_blocks: int | None = _f(
        None,
        "KV blocks in the pool (default: derived from kv_cache_memory_gb); with hybrid_kv, of the "
        "full-attention pool.",
    )
    kv_cache_memory_gb: float = _f(1.0, "Memory for the KV pool when num_blocks is not set, in GiB.")
    enable_prefix_caching: bool = _f(True, "Reuse KV blocks of shared prompt prefixes (radix tree).")
    kv_transfer_port_range: str = _f(
        "",
        "MIN-MAX: TCP ports of each PD instance's KV transfer engine (two per instance: handshake and "
        "data, both bound to the instance's host), e.g. 20000-20100; outside 32768-60999 (ephemeral "
        "ports). Empty: Mooncake's default 15000-17000.",
    )

    def validate(self) -> None:
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError("cache.block_size must be a power of two in [1, 128]")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"cache.kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"cache.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.hybrid_kv not in ("auto", "on", "off"):
            raise ValueError(f"cache.hybrid_kv must be one of auto, on, off, got {self.hybrid_kv!r}")
        if self.window_pool_blocks is not None and self.window_pool_blocks < 2:
            raise ValueError("cache.window_pool_blocks must be >= 2 (one is the null block)")
        if self.state_snapshot_interval < 1:
            raise ValueError("cache.state_snapshot_interval must be >= 1")
        if self.state_snapshot_slots is not None and self.state_snapshot_slots < 0:
            raise ValueError("cache.state_snapshot_slots must be >= 0")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("cache.num_blocks must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("cache.kv_cache_memory_gb must be > 0")
        self.transfer_ports()

    def transfer_ports(self) -> tuple[int, int] | None:
        """``kv_transfer_port_range`` as ``(first, last)``; None when empty. The rules are
        ``memory.transfer.check_port_range``'s (what Mooncake accepts; it ignores other ranges)."""
        text = self.kv_transfer_port_range.strip()
        if not text:
            return None
        lo_s, sep, hi_s = text.partition("-")
        if sep and lo_s.strip().isdigit() and hi_s.strip().isdigit():
            lo, hi = int(lo_s), int(hi_s)
            if 1024 <= lo < hi <= 65535 and (hi < 32768 or lo > 60999):
                return lo, hi
        raise ValueError(
            f"cache.kv_transfer_port_range must be MIN-MAX with 1024 <= MIN < MAX <= 65535 (two ports "
            f"per instance), not overlapping the ephemeral ports 32768-60999, e.g. 20000-20100; "
            f"got {self.kv_transfer_port_range!r}"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _f(64, "Most sequences in one step.")
    max_num_batched_tokens: int = _f(2048, "Token budget of one step (prefill chunks + decodes).")
    enable_chunked_prefill: bool = _f(True, "Split long prompts across steps under the token budget.")
    mixed_prefill_tokens: int = _f(
        512,
        "Most prompt tokens in a step that also carries decodes (0: up to max_num_batched_tokens; needs "
        "chunked prefill). Its first prompt chunk may take all of them, further prompts join only "
        "whole: prompts that arrive together get their first tokens in successive short steps instead "
        "of all after one long step, and the running decodes keep a short inter-token time.",
    )
    max_waiting: int = _f(1024, "Bounded waiting queue; the service answers 429 beyond it.")
    max_beam_width: int = _f(
        128, "Largest beam_width a beam-search request may ask for (each beam is one running sequence)."
    )
    offline_preemption: str = _f(
        "layer",
        "layer | step: an online arrival stops a step of only offline prefill work between two layers "
        "(the step is discarded and runs again after the online prefill), or waits for it to end.",
    )
    isolate_online_prefill: bool = _f(
        True, "A step that carries an online prompt chunk carries no offline work (online TTFT first)."
    )
    offline_max_batched_tokens: int = _f(
        0,
        "Token budget of the offline work of one step (0: max_num_batched_tokens). Smaller offline "
        "chunks make an online arrival's wait for the layer in progress shorter (co-location).",
    )
    encode_scheduling: str = _f(
        "stage",
        "stage | inline: vision-language models encode images in steps of their own, only in a step "
        "without a prefill chunk and within max_encode_images / max_encode_tokens (HydraInfer's "
        "stage-level batching: ongoing decodes keep their TPOT), or inline: a prefill step encodes "
        "the images its chunk needs (FCFS).",
    )
    max_encode_images: int = _f(
        4, "Most images one step encodes (stage scheduling; `xllm profile epd` measures a value)."
    )
    max_encode_tokens: int = _f(
        4096,
        "Most image tokens (after the patch merger) one step encodes; an image larger than this "
        "still runs, alone (stage scheduling).",
    )

    def validate(self) -> None:
        if self.encode_scheduling not in ("stage", "inline"):
            raise ValueError("scheduler.encode_scheduling must be 'stage' or 'inline'")
        if self.max_encode_images < 1 or self.max_encode_tokens < 1:
            raise ValueError("scheduler.max_encode_images and scheduler.max_encode_tokens must be >= 1")
        if self.offline_preemption not in ("layer", "step"):
            raise ValueError("scheduler.offline_preemption must be 'layer' or 'step'")
        if self.max_num_seqs < 1:
            raise ValueError("scheduler.max_num_seqs must be >= 1")
        if not 1 <= self.max_beam_width <= 1024:
            raise ValueError("scheduler.max_beam_width must be in [1, 1024]")
        if self.max_num_batched_tokens < 1:
            raise ValueError("scheduler.max_num_batched_tokens must be >= 1")
        if self.mixed_prefill_tokens < 0:
            raise ValueError("scheduler.mixed_prefill_tokens must be >= 0 (0: max_num_batched_tokens)")
        if self.offline_max_batched_tokens < 0:
            raise ValueError("scheduler.offline_max_batched_tokens must be >= 0 (0: max_num_batched_tokens)")


@dataclass(frozen=True)
class DeviceConfig:
    device: str | None = _f(
        None,
        "cpu | cuda | npu | emulated (default: XLLM_DEVICE, then detection). emulated: an accelerator "
        "whose steps take the time device_profile predicts, with a stand-in model emitting pseudo tokens "
        "(docs/emulated.md).",
    )
    device_profile: str | None = _f(
        None,
        "A device profile (JSON: step time against tokens, batch and context) for device emulated; "
        "measure one with `xllm profile engine --model DIR`.",
    )
    num_threads: int | None = _f(
        None,
        "CPU threads of the model forward (torch intra-op / OpenMP) in the engine. The engine's host "
        "work (scheduling, inputs, sampling bookkeeping, sockets) runs between forwards on its main "
        "thread and the service's HTTP work in its own process, so cores busy in all = these threads "
        "+ the service's share. Default: all cores but one in an engine process that serves HTTP (the "
        "service, and a client on the same box, keep a core), torch's choice in the offline API.",
    )


GRAPH_MODES = ("auto", "eager", "partial", "full")


@dataclass(frozen=True)
class ExecutionConfig:
    async_scheduling: str = _f(
        "auto",
        "on | off | auto: schedule step i+1 (and apply step i-1's outputs) while the model runs step i "
        "on a worker thread; tokens not sampled yet enter as placeholders. Output is identical either "
        "way. auto: the platform's default (on where the device runs the forward, off on CPU, where "
        "the forward's Python work contends with the scheduler for the GIL).",
    )
    graph_mode: str = _f(
        "auto",
        "How the forward runs: eager (op by op), partial (everything but attention compiled per "
        "token-count bucket: torch.compile / inductor on CPU), full (whole-step device graphs where "
        "the platform has them) or auto (the platform's default).",
    )
    graph_batch_sizes: str = _f(
        "1,2,4,8,16,32",
        "Token-count buckets captured at start-up (comma-separated); a step with more tokens than "
        "the largest runs eagerly, smaller ones are padded to the next bucket.",
    )
    encode_overlap: str = _f(
        "auto",
        "on | off | auto: a step's image encodes (vision-language models) run on a second thread "
        "beside the language model's forward instead of before it. auto: the platform's default (off "
        "on CPU, where both forwards share the cores; benchmarks/encode_stage.py measures it).",
    )

    def buckets(self) -> list[int]:
        """``graph_batch_sizes`` as a sorted list."""
        try:
            sizes = sorted({int(x) for x in self.graph_batch_sizes.split(",") if x.strip()})
        except ValueError:
            sizes = []
        if not sizes or sizes[0] < 1:
            raise ValueError(
                f"execution.graph_batch_sizes must be positive integers separated by commas, got "
                f"{self.graph_batch_sizes!r} (e.g. 1,2,4,8,16,32)"
            )
        return sizes

    def async_enabled(self, platform_default: bool) -> bool:
        return platform_default if self.async_scheduling == "auto" else self.async_scheduling == "on"

    def encode_overlap_enabled(self, platform_default: bool) -> bool:
        return platform_default if self.encode_overlap == "auto" else self.encode_overlap == "on"

    def validate(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(
                f"execution.async_scheduling must be auto, on or off, got {self.async_scheduling!r}"
            )
        if self.encode_overlap not in ("auto", "on", "off"):
            raise ValueError(f"execution.encode_overlap must be auto, on or off, got {self.encode_overlap!r}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(
                f"execution.graph_mode must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}"
            )
        self.buckets()


@dataclass(frozen=True)
class StructuredOutputsConfig:
    max_compiled_mib: float = _f(
        64.0,
        "Largest compiled grammar (schema, regex, grammar) accepted, as measured in the grammar sandbox after "
        "its first token mask; larger ones are refused with a 400 naming the field.",
    )
    cache_mib: float = _f(
        512.0, "Memory the engine's compiled-grammar cache may hold (sum of measured compiled sizes)."
    )
    compile_timeout_s: float = _f(
        10.0, "Time one schema, regex or grammar may take to validate or compile; slower ones get a 400."
    )
    sandbox_memory_mib: int = _f(
        1024, "Address space a grammar sandbox process may use past its start-up size (a crash guard)."
    )
    disable_additional_properties: bool = _f(
        True,
        "A JSON schema's objects that do not set additionalProperties admit no other keys, as vLLM's default "
        "backend (xgrammar) reads them; false: they admit any (JSON Schema's own reading). A request's "
        "structured_outputs.disable_additional_properties overrides it.",
    )

    def validate(self) -> None:
        if self.max_compiled_mib <= 0 or self.cache_mib <= 0:
            raise ValueError("structured_outputs.max_compiled_mib and cache_mib must be > 0")
        if self.compile_timeout_s <= 0:
            raise ValueError("structured_outputs.compile_timeout_s must be > 0")
        if self.sandbox_memory_mib < 64:
            raise ValueError("structured_outputs.sandbox_memory_mib must be >= 64")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_tiers: KVTiersConfig = field(default_factory=KVTiersConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.execution.validate()
        self.parallel.validate()
        self.structured_outputs.validate()
        self.speculative_config.validate()
        self.kv_tiers.validate()
        self.lora.validate()


def replace_section(cfg: Any, section: str, **changes: Any) -> Any:
    """Return ``cfg`` with ``cfg.<section>`` updated by ``changes``."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build a (nested) config dataclass from a dict; unknown keys are an error."""
    if not isinstance(data, dict):
        raise ValueError(f"config section '{path or cls.__name__}' must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            where = f"{path}." if path else ""
            raise ValueError(f"unknown config key '{where}{key}'; valid keys: {', '.join(sorted(fields))}")
        ftype = fields[key].type
        sub = _dataclass_type(ftype)
        kwargs[key] = from_dict(sub, value or {}, f"{path}.{key}" if path else key) if sub else value
    return cls(**kwargs)


def _dataclass_type(ftype: Any) -> type | None:
    names = {
        "ModelConfig": ModelConfig,
        "CacheConfig": CacheConfig,
        "SchedulerConfig": SchedulerConfig,
        "DeviceConfig": DeviceConfig,
        "ExecutionConfig": ExecutionConfig,
        "ParallelConfig": ParallelConfig,
        "StructuredOutputsConfig": StructuredOutputsConfig,
        "SpeculativeConfig": SpeculativeConfig,
        "KVTiersConfig": KVTiersConfig,
        "LoRAConfig": LoRAConfig,
        "EngineConfig": EngineConfig,
    }
    if isinstance(ftype, str):
        return names.get(ftype)
    return ftype if dataclasses.is_dataclass(ftype) else None
