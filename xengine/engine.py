"""One model instance: ``step()`` = schedule -> execute -> update -> per-request deltas."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.kv_layout import KVCacheSpec, PagedKVLayout
from ops.platforms import resolve_platform, set_platform
from xengine.api.config import EngineConfig
from xengine.api.messages import (
    AddRequest,
    CatalogInfo,
    CompletionDelta,
    EngineInfo,
    EngineStats,
    KVExportInfo,
    KVImportResult,
)
from xengine.beam.catalog import CatalogRegistry
from xengine.kv_transfer import KVTransferManager
from xengine.loader import load_model
from xengine.models.info import read_model_info
from xengine.request import PRIORITY_RANK, Request
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.scheduler import Scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_DEFAULT_LEN = 8192


@dataclass
class StepTiming:
    total_s: float  # whole step: schedule + inputs + forward + sample + update
    forward_s: float  # model forward + logits only
    num_seqs: int
    num_tokens: int


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        model_dir = config.model.model
        if not model_dir or not Path(model_dir).is_dir():
            raise ValueError(f"model folder not found: {model_dir!r}; pass a local Hugging Face model folder")
        self.platform = resolve_platform(config.device.device)
        set_platform(self.platform)
        self.platform.set_num_threads(config.device.num_threads)
        self.model_info = info = read_model_info(model_dir)
        self.dtype = self._resolve_dtype(config.model.dtype, info.torch_dtype)
        device = self.platform.torch_device()
        self.model = load_model(model_dir, self.dtype, device)
        spec = KVCacheSpec(
            info.num_layers, info.num_kv_heads, info.head_dim, config.cache.block_size, self.dtype
        )
        max_len = config.model.max_model_len or min(info.max_position_embeddings, _MAX_DEFAULT_LEN)
        num_blocks = self._num_blocks(spec, max_len)
        # one request always fits the pool; without chunked prefill it must also fit one step's
        # budget (a preempted request recomputes prompt + output in one step)
        self.max_model_len = min(max_len, num_blocks * spec.block_size)
        self._len_limit = "the KV pool" if self.max_model_len < max_len else "the model"
        if not config.scheduler.enable_chunked_prefill:
            budget = config.scheduler.max_num_batched_tokens
            if budget < self.max_model_len:
                self.max_model_len, self._len_limit = (
                    budget,
                    "max_num_batched_tokens (chunked prefill is off)",
                )
        self.kv = KVCacheManager(num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        layout = PagedKVLayout()
        kv_caches = layout.allocate(spec, num_blocks, device)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            layout,
            self.platform,
            spec.block_size,
            info.eos_token_ids,
            config.model.seed,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, info.eos_token_ids)
        self.kv_transfer = KVTransferManager(self.kv, kv_caches, spec)  # PD: Mooncake agent on first use
        self.vocab_size = info.vocab_size
        self.catalogs = CatalogRegistry(info.vocab_size)
        self.last_step_timing: StepTiming | None = None
        self.num_steps = 0
        self.info = EngineInfo(
            model_name=config.model.served_model_name or Path(model_dir).resolve().name,
            vocab_size=info.vocab_size,
            max_model_len=self.max_model_len,
            block_size=spec.block_size,
            eos_token_ids=list(info.eos_token_ids),
            num_total_blocks=num_blocks,
            device=self.platform.name,
            pid=os.getpid(),
        )

    def _resolve_dtype(self, requested: str, checkpoint: str | None) -> torch.dtype:
        name = requested if requested != "auto" else (checkpoint or "float32")
        dtype = _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        return self.platform.default_dtype_for(dtype)

    def _num_blocks(self, spec: KVCacheSpec, max_len: int) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        by_memory = int(cache.kv_cache_memory_gb * (1 << 30)) // spec.bytes_per_block
        worst_case = -(-max_len // spec.block_size) * self.config.scheduler.max_num_seqs
        return max(1, min(by_memory, worst_case))

    # ------------------------------------------------------------------ requests
    def add_request(self, req: AddRequest) -> None:
        """Validate and queue a request. Raises ``ValueError`` naming the bad field."""
        self._validate(req)
        catalog = self.catalogs.get(req.params.catalog) if req.params.catalog is not None else None
        self.scheduler.add(
            Request(
                seq_id=req.req_id,
                req_id=req.req_id,
                index=0,
                prompt_token_ids=list(req.prompt_token_ids),
                params=req.params,
                priority=req.priority,
                arrival_time=req.arrival_time or time.monotonic(),
            ),
            catalog,
        )

    def _validate(self, req: AddRequest) -> None:
        if not req.req_id:
            raise ValueError("invalid value for 'req_id': must be a non-empty string")
        if req.req_id in self.scheduler.groups:
            raise ValueError(f"invalid value for 'req_id': {req.req_id!r} is already running")
        if req.priority not in PRIORITY_RANK:
            raise ValueError(f"invalid value for 'priority': must be one of {sorted(PRIORITY_RANK)}")
        ids = req.prompt_token_ids
        if not ids:
            raise ValueError("invalid value for 'prompt': the prompt is empty")
        bad = next((t for t in ids if type(t) is not int or not (0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(
                f"invalid value for 'prompt': token id {bad!r} is not an integer in the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"invalid value for 'prompt': {len(ids)} tokens, the maximum context length is "
                f"{self.max_model_len}, set by {self._len_limit} (prompt must be shorter, leaving room for output)"
            )
        req.params.validate(self.vocab_size)
        if req.params.prompt_logprobs is not None:
            raise ValueError("invalid value for 'prompt_logprobs': not supported by this engine")
        if req.params.use_beam_search:
            self._validate_beam(req)

    def _validate_beam(self, req: AddRequest) -> None:
        params = req.params
        limit = self.config.scheduler.max_beam_width
        if params.beam_width > limit:
            raise ValueError(
                f"invalid value for 'beam_width': must be in [1, {limit}], got {params.beam_width}"
            )
        budget = self.config.scheduler.max_num_batched_tokens
        if params.beam_width > budget:  # all beams step together, one token each
            raise ValueError(
                f"invalid value for 'beam_width': must be <= scheduler.max_num_batched_tokens ({budget})"
            )
        max_new = params.max_tokens or self.max_model_len - len(req.prompt_token_ids)
        if params.catalog is not None:
            catalog = self.catalogs.get(params.catalog)
            if catalog is None:
                raise ValueError(f"invalid value for 'catalog': no catalog named {params.catalog!r}")
            max_new = catalog.item_len
        # worst case: the prompt's blocks shared, each beam with its own blocks for the output
        bs = self.kv.block_size
        need = -(-len(req.prompt_token_ids) // bs) + params.beam_width * (-(-max_new // bs) + 1)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"invalid value for 'beam_width': {params.beam_width} beams of up to {max_new} tokens may "
                f"need {need} KV blocks, the pool has {self.kv.pool.num_blocks}; lower beam_width or max_tokens"
            )

    # ------------------------------------------------------------------ catalogs
    def register_catalog(self, name: str, items: list[list[int]]) -> CatalogInfo:
        """Register (or replace) an item catalog; raises ``ValueError`` naming the bad field."""
        return self.catalogs.register(name, items)

    def list_catalogs(self) -> list[CatalogInfo]:
        return self.catalogs.list()

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.scheduler.updated)

    # ------------------------------------------------------------------ step
    def step(self) -> list[CompletionDelta]:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.kv_transfer.num_pins:
            self.kv_transfer.release_admitted(self.kv.block_tables)
        forward_s = 0.0
        if not plan.is_empty:
            out = self.runner.execute(plan)
            forward_s = out.forward_s
            self.scheduler.update(plan, out)
            self.num_steps += 1
        elif self.scheduler.waiting and self.kv.num_free_blocks == self.kv.pool.num_blocks:
            # nothing fits even with the whole pool free (no running request, no pinned import):
            # fail the head instead of spinning
            self.scheduler.fail(self.scheduler.waiting[0], "length")
        deltas = self._collect_deltas()
        self.last_step_timing = StepTiming(
            time.perf_counter() - t0, forward_s, len(plan.seqs), plan.num_batched_tokens
        )
        return deltas

    def _collect_deltas(self) -> list[CompletionDelta]:
        deltas = []
        finished = []
        for req in self.scheduler.take_updated():
            want_lp = req.params.logprobs is not None
            deltas.append(
                CompletionDelta(
                    req_id=req.req_id,
                    index=req.index,
                    new_token_ids=req.new_token_ids,
                    new_logprobs=req.new_logprobs if want_lp else None,
                    new_top_logprobs=req.new_top_logprobs if want_lp else None,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                    score=req.beam_score,
                    cumulative_logprob=req.cumulative_logprob,
                )
            )
            req.new_token_ids, req.new_logprobs, req.new_top_logprobs = [], [], []
            if req.is_finished:
                finished.append(req.seq_id)
        self.runner.release(finished)
        return deltas

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> EngineStats:
        s = self.scheduler
        pool = self.kv.pool.stats()
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_total_blocks=pool.num_total_blocks,
            num_free_blocks=pool.num_free_blocks,
            kv_usage=pool.usage,
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
            num_preemptions=s.num_preemptions,
            num_steps=self.num_steps,
            num_computed_prompt_tokens=s.num_computed_prompt_tokens,
            num_kv_blocks_imported=self.kv_transfer.num_blocks_imported,
            num_kv_bytes_imported=self.kv_transfer.num_bytes_imported,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ PD KV transfer
    def kv_export(self, export_id: str, token_ids: list[int]) -> KVExportInfo:
        return self.kv_transfer.export(export_id, token_ids)

    def kv_import(self, source: KVExportInfo, token_ids: list[int], pin_id: str) -> KVImportResult:
        return self.kv_transfer.import_(source, token_ids, pin_id)

    def kv_release(self, pin_id: str) -> bool:
        return self.kv_transfer.release(pin_id)
