"""One model instance: ``step()`` = schedule -> execute -> update -> per-request deltas."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graph.interrupt import StepInterrupted
from ops.platforms import resolve_platform, set_platform
from xengine.api.config import EngineConfig
from xengine.api.messages import (
    AddRequest,
    CatalogInfo,
    CompletionDelta,
    EngineInfo,
    EngineStats,
    GraphStatsMsg,
    KVExportInfo,
    KVImportResult,
)
from xengine.beam.catalog import CatalogRegistry
from xengine.interruption import Interrupter, note_arrival
from xengine.kv_setup import build_kv
from xengine.kv_transfer import KVTransferManager
from xengine.loader import load_model, resolve_dtype
from xengine.models.info import ModelInfo, read_hf_config, read_model_info
from xengine.models.registry import get_model_class
from xengine.multimodal.encode_stage import EncodeStage
from xengine.multimodal.request_images import request_images, vision_spec
from xengine.parallel.group import start_expert_parallel
from xengine.pipeline import StepPipeline
from xengine.request import Request
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.plan import ScheduledSeq, SchedulePlan, StepOutput, StepSample
from xengine.scheduler.scheduler import Scheduler
from xengine.step_resume import PausedStep, StepResumer
from xengine.structured.manager import StructuredOutputs, compile_error_message
from xengine.validation import validate_request

logger = logging.getLogger("xengine.engine")

_MAX_DEFAULT_LEN = 8192
# this many steps in a row whose forward failed for every request: the engine itself is broken
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineBrokenError(RuntimeError):
    """Step after step failed for every request: restart the engine rather than keep failing."""


def check_max_model_len(max_model_len: int | None, model_dir: str, info: ModelInfo) -> None:
    """``ValueError`` with the fix when ``max_model_len`` is past the positions the model supports
    (``max_position_embeddings``, as extended by its ``rope_scaling``)."""
    hf = read_hf_config(model_dir)
    limit = get_model_class(info.architecture).max_context_len(hf)
    if max_model_len is None or limit is None or max_model_len <= limit:
        return
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    source = f"max_position_embeddings={info.max_position_embeddings}"
    source += "" if kind == "default" else f" with {kind} rope_scaling"
    raise ValueError(
        f"max_model_len {max_model_len} is longer than the {limit} positions this model supports "
        f"({source}); lower --max-model-len (model.max_model_len) to {limit} or less, or use a checkpoint "
        f"whose rope_scaling allows {max_model_len} positions (yarn, linear or llama3 with "
        f"factor * original_max_position_embeddings >= {max_model_len}, or dynamic)"
    )


@dataclass
class StepTiming:
    total_s: float  # whole step: schedule + inputs + forward + sample + update
    forward_s: float  # model forward + logits only
    num_seqs: int
    num_tokens: int
    host_s: float | None = None  # async: engine-thread time of the step, waiting excluded
    # of the same plan as ``num_seqs`` (``SchedulePlan.token_counts``): KV tokens attended, prefill tokens
    context_tokens: int = 0
    prefill_tokens: int = 0
    # the non-empty steps whose outputs were applied in this call (sync: this one, ``step_s`` =
    # ``total_s``; async: the step that was in flight, and a sync plan's own, ``step_s`` measured from
    # the previous completion while busy: ``PipelineTiming.completed``)
    completed: list[StepSample] = field(default_factory=list)


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
        check_max_model_len(config.model.max_model_len, model_dir, info)  # before loading weights
        # expert parallel: the workers start and join before the model is built (it holds only its experts)
        self.parallel = start_expert_parallel(config, self.platform)
        try:
            self._load(config, info, model_dir)
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown()
            raise

    def _load(self, config: EngineConfig, info: ModelInfo, model_dir: str) -> None:
        """Weights, KV memory, runner, scheduler: everything of the instance after its processes exist."""
        self.dtype = resolve_dtype(self.platform, config.model.dtype, info.torch_dtype)
        device = self.platform.torch_device()
        self.model = load_model(model_dir, self.dtype, device)
        cache = config.cache
        if self.parallel is not None:
            cache = self.parallel.check_model_and_cache(cache)
        max_len = config.model.max_model_len or min(info.max_position_embeddings, _MAX_DEFAULT_LEN)
        caps, execution = self.platform.capabilities, config.execution
        self.graph_mode = caps.default_graph_mode if execution.graph_mode == "auto" else execution.graph_mode
        self.async_scheduling = execution.async_enabled(caps.default_async_scheduling)
        kv = self.kv_setup = build_kv(
            cache, config.scheduler, info, self.dtype, self.platform, max_len, self.async_scheduling
        )
        spec, kv_caches, num_blocks = kv.spec, kv.kv_caches, kv.manager.pool.num_blocks
        self.max_model_len, self._len_limit = kv.max_model_len, kv.len_limit
        self.model.set_max_model_len(self.max_model_len)
        if self.parallel is not None:  # every worker holds a KV pool of the same geometry
            self.parallel.setup(num_blocks, spec.block_size, self.max_model_len)
        self.kv = kv.manager
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            kv.layout,
            self.platform,
            spec.block_size,
            info.eos_token_ids,
            config.model.seed,
            max_model_len=self.max_model_len,
            graph_mode=self.graph_mode,
            parallel=self.parallel,
            encode_overlap=execution.encode_overlap_enabled(caps.default_encode_overlap),
        )
        self.runner.capture_graphs(config.execution.buckets())
        # online arrivals stop offline prefill steps between layers (not across expert-parallel ranks)
        self.interrupter = Interrupter(
            config.scheduler.offline_preemption if self.parallel is None else "step"
        )
        self.runner.interrupt = self.interrupter.event if self.interrupter.mode == "layer" else None
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.max_model_len,
            info.eos_token_ids,
            async_mode=self.async_scheduling,
            encode_stage=self._encode_stage(config),
        )
        self.pipeline = StepPipeline(self) if self.async_scheduling else None
        self.resumer = StepResumer(self.scheduler)  # interrupted offline steps carry on later
        self.kv_transfer = KVTransferManager(  # PD: Mooncake agent on first use
            self.kv, kv_caches, spec, port_range=config.cache.transfer_ports()
        )
        self.vocab_size = info.vocab_size
        self.vision = vision_spec(self.model)  # None: a text-only model
        self.catalogs = CatalogRegistry(info.vocab_size)
        # structured outputs: grammars compiled off the engine loop, cached (``xengine/structured/``)
        self.structured = StructuredOutputs.for_model(
            model_dir, info.vocab_size, list(info.eos_token_ids), config.structured_outputs
        )
        self.last_step_timing: StepTiming | None = None
        self.num_steps = 0
        self.num_failed_steps = 0  # consecutive steps whose forward failed for every request
        self.info = EngineInfo(
            model_name=config.model.served_model_name or Path(model_dir).resolve().name,
            vocab_size=info.vocab_size,
            max_model_len=self.max_model_len,
            block_size=spec.block_size,
            eos_token_ids=list(info.eos_token_ids),
            num_total_blocks=num_blocks,
            device=self.platform.name,
            pid=os.getpid(),
            hidden_size=info.hidden_size,
            num_params=sum(p.numel() for p in self.model.parameters()),
            kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            num_threads=torch.get_num_threads(),
        )

    # ------------------------------------------------------------------ requests
    def add_request(self, req: AddRequest) -> None:
        """Validate and queue a request. Raises ``ValueError`` naming the bad field."""
        validate_request(self, req)
        catalog = self.catalogs.get(req.params.catalog) if req.params.catalog is not None else None
        request = Request(
            seq_id=req.req_id,
            req_id=req.req_id,
            index=0,
            prompt_token_ids=list(req.prompt_token_ids),
            params=req.params,
            priority=req.priority,
            arrival_time=req.arrival_time or time.monotonic(),
            pooling=req.pooling,
            mm=request_images(req, self.vision, self.info.model_name, self.parallel is not None),
            encode_only=req.encode_only,
        )
        note_arrival(request, self.interrupter)
        if req.params.structured_outputs is not None and not self.structured.admit(request, catalog):
            return  # waits (outside the scheduler) for its grammar to compile: ``_admit_compiled``
        self.scheduler.add(request, catalog)

    def _encode_stage(self, config: EngineConfig) -> EncodeStage | None:
        """Vision-language models with stage scheduling: images encode in steps of their own."""
        images = self.runner.images
        if images is None or config.scheduler.encode_scheduling != "stage":
            return None
        return EncodeStage(config.scheduler, self.kv, images.contains)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar compiled; fail (naming the field) those whose did not."""
        if not len(self.structured.waiting):
            return
        busy = self.pipeline is not None and self.pipeline.busy
        for ready in self.structured.take_ready(idle=not (self.scheduler.has_unfinished() or busy)):
            self.scheduler.add(ready.request, ready.catalog)
            if ready.error is not None:
                self.scheduler.fail_request(ready.request.req_id, compile_error_message(ready.error))

    # ------------------------------------------------------------------ catalogs
    def register_catalog(self, name: str, items: list[list[int]]) -> CatalogInfo:
        """Register (or replace) an item catalog; raises ``ValueError`` naming the bad field."""
        return self.catalogs.register(name, items)

    def list_catalogs(self) -> list[CatalogInfo]:
        return self.catalogs.list()

    def abort_requests(self, req_ids: list[str]) -> None:
        for request in self.structured.waiting.remove(req_ids):  # still compiling: end it through
            self.scheduler.add(request)  # the scheduler, which reports the abort like any other
        self.scheduler.abort(req_ids)

    def has_unfinished_requests(self) -> bool:
        busy = self.pipeline is not None and self.pipeline.busy
        waiting = bool(len(self.structured.waiting))  # requests whose grammar is compiling
        return self.scheduler.has_unfinished() or bool(self.scheduler.updated) or busy or waiting

    # ------------------------------------------------------------------ step
    def step(self) -> list[CompletionDelta]:
        self.check_workers()
        self._admit_compiled()
        if self.pipeline is not None:
            return self._step_async(self.pipeline)
        t0 = time.perf_counter()
        paused = self.resumer.ready(self.interrupter.pending_online)
        plan = paused.plan if paused is not None else self.scheduler.schedule()
        if self.kv_transfer.num_pins:
            self.kv_transfer.release_admitted(self.kv.block_tables)
            if plan.is_empty:
                self._unpin_for_head()
        forward_s = 0.0
        counts = (0, 0)
        if not plan.is_empty:
            self.interrupter.started(plan)
            try:
                plan, out = self._execute(plan) if paused is None else self._resume(paused)
            except StepInterrupted as stop:  # nothing of it applied: paused, or run again later
                self.interrupter.interrupted(plan, resumable=self.resumer.pause(plan, stop))
                self.last_step_timing = StepTiming(time.perf_counter() - t0, 0.0, 0, 0, None)
                return self._collect_deltas()
            forward_s = out.forward_s
            counts = plan.token_counts()  # before update moves num_computed_tokens
            self.scheduler.update(plan, out)
            self.num_steps += 1
        elif self.scheduler.waiting and self.kv.num_free_blocks == self.kv.pool.num_blocks:
            # nothing fits even with the whole pool free (no running request, no pinned import):
            # fail the head instead of spinning
            self.scheduler.fail(self.scheduler.waiting[0], "length")
        deltas = self._collect_deltas()
        total_s = time.perf_counter() - t0
        completed = [StepSample(len(plan.seqs), *counts, total_s)] if plan.seqs else []
        self.last_step_timing = StepTiming(
            total_s, forward_s, len(plan.seqs), plan.num_batched_tokens, None, *counts, completed
        )
        return deltas

    def _step_async(self, pipeline: StepPipeline) -> list[CompletionDelta]:
        t0 = time.perf_counter()
        plan, deltas = pipeline.step()
        if self.kv_transfer.num_pins:
            self.kv_transfer.release_admitted(self.kv.block_tables)
            if plan.is_empty and not pipeline.busy:
                self._unpin_for_head()
        if not plan.is_empty:
            self.num_steps += 1
        elif pipeline.head_stuck and self.scheduler.waiting:
            self.scheduler.fail(self.scheduler.waiting[0], "length")  # as in step(): never fits
            deltas += self._collect_deltas()
        timing = pipeline.last_timing
        self.last_step_timing = StepTiming(
            time.perf_counter() - t0, timing.forward_s, len(plan.seqs), plan.num_batched_tokens, timing.host_s,
            *timing.counts, timing.completed,
        )  # fmt: skip
        return deltas

    def _unpin_for_head(self) -> None:
        """An empty step with requests waiting and none running: if imported prompts pinned for the
        queued requests hold the pool (PD decode under KV pressure), nothing would ever free a block
        for the first of them. Expired pins go first; then, if still stuck, every import pin but the
        head's (its blocks stay cached, so the others usually still hit them)."""
        self.kv_transfer.expire()
        if self.scheduler.running or not self.scheduler.waiting:
            return
        dropped = self.kv_transfer.release_waiting_imports(keep=self.scheduler.waiting[0].seq_id)
        if dropped:
            logger.warning("KV pool held by %d imported prompts of queued requests: unpinned them", dropped)

    def _resume(self, paused: PausedStep) -> tuple[SchedulePlan, StepOutput]:
        """Carry a paused step on from where it stopped; if that fails, run it again from its start."""
        try:
            out = self.interrupter.run(paused.plan, lambda: self.runner.resume(paused.step, paused.point))
        except StepInterrupted:
            raise
        except Exception:  # noqa: BLE001 - the plain path isolates what is wrong with it
            logger.exception("resuming an interrupted step failed; running it again from its start")
            self.resumer.drop()
            return self._execute(paused.plan)
        self.resumer.resumed()
        return paused.plan, out

    def _execute(self, plan: SchedulePlan, failed_once: bool = False) -> tuple[SchedulePlan, StepOutput]:
        """Run ``plan``. If the forward raises, run each request of it alone and fail (finish_reason
        "error") those that raise again, so one bad request does not take its batch or the engine
        down. Returns the part of ``plan`` that ran and its output, for ``scheduler.update``.
        Raises ``EngineBrokenError`` after ``MAX_CONSECUTIVE_FAILED_STEPS`` steps that failed for
        every request."""
        try:
            if failed_once:  # (it already raised as a whole, on the async worker)
                raise RuntimeError("the step failed on the async worker")
            out = self.interrupter.run(plan, lambda: self.runner.execute(plan))
        except StepInterrupted:
            raise
        except Exception as e:  # noqa: BLE001 - isolated below; re-raised if the engine itself is broken
            if self.parallel is not None:  # the workers ran (part of) it: the group is out of step
                if self.parallel.scan(wait_s=1.0) is not None:  # a peer's death shows as a socket error
                    raise EngineBrokenError(self.parallel.failure) from e
                raise EngineBrokenError(f"an expert-parallel step failed: {type(e).__name__}: {e}") from e
            logger.exception("step failed for %d sequence(s); retrying each request alone", len(plan.seqs))
            plan, out, error = self._execute_each_request(plan)
            if plan.is_empty:
                self.num_failed_steps += 1
                if self.num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                    raise EngineBrokenError(
                        f"{self.num_failed_steps} steps in a row failed for every request; last error: {error}"
                    ) from None
                return plan, out
        self.num_failed_steps = 0
        return plan, out

    def _execute_each_request(self, failed: SchedulePlan) -> tuple[SchedulePlan, StepOutput, str]:
        """Re-run ``failed`` one request at a time (all sequences of a request step together).

        Nothing of the failed attempt is kept: ``update`` was not called, so the scheduler still has
        every sequence at its old ``num_computed_tokens``; a re-run rewrites the same KV slots. A
        request that fails alone is ended through the scheduler, which frees its blocks; its KV
        never reaches the prefix cache (only ``update`` inserts blocks). Returns the plan of the
        requests that ran, their output and the last error."""
        by_req: dict[str, list[ScheduledSeq]] = {}
        for s in failed.seqs:
            by_req.setdefault(s.req.req_id, []).append(s)
        ran = SchedulePlan(block_tables=failed.block_tables, preempted_seq_ids=failed.preempted_seq_ids)
        out, error = StepOutput(), ""
        copies = failed.block_copies  # copy-on-write copies run once, with the first request
        for req_id, seqs in by_req.items():
            tables = {s.req.seq_id: failed.block_tables[s.req.seq_id] for s in seqs}
            alone = SchedulePlan(seqs=seqs, block_tables=tables, block_copies=copies)
            alone.num_batched_tokens = sum(s.num_new_tokens for s in seqs)
            copies = []
            try:
                part = self.runner.execute(alone)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                error = f"{type(e).__name__}: {e}"
                logger.error("request %s failed in the model: %s", req_id, error)
                self.scheduler.fail_request(req_id, f"the engine failed while running this request: {error}")
                continue
            ran.seqs.extend(seqs)
            out.sampled.update(part.sampled)
            out.beam_candidates.update(part.beam_candidates)
            out.prompt_logprobs.update(part.prompt_logprobs)
            out.embeddings.update(part.embeddings)
            out.forward_s += part.forward_s
        for job in failed.encodes:  # each request's images alone too
            try:
                self.runner.execute(SchedulePlan(encodes=[job]))
                ran.encodes.append(job)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                error = f"{type(e).__name__}: {e}"
                self.scheduler.fail_request(job.req.req_id, f"the engine failed encoding its images: {error}")
        ran.num_batched_tokens = sum(s.num_new_tokens for s in ran.seqs)
        return ran, out, error

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
                    error=req.error,
                    prompt_logprobs=req.new_prompt_logprobs,
                    embedding=req.embedding if req.is_finished else None,
                    queue_time_s=req.queue_time_s,
                )
            )
            req.queue_time_s = None  # reported once
            req.new_token_ids, req.new_logprobs, req.new_top_logprobs = [], [], []
            req.new_prompt_logprobs = None
            if req.is_finished:
                finished.append(req.seq_id)
        self.runner.release(finished)
        return deltas

    # ------------------------------------------------------------------ processes
    def check_workers(self) -> None:
        """``EngineBrokenError`` when an expert-parallel worker of this instance has exited."""
        if self.parallel is not None and self.parallel.scan() is not None:
            raise EngineBrokenError(self.parallel.failure)

    def shutdown(self) -> None:
        """Stop this instance's worker processes: expert-parallel workers, the grammar sandbox."""
        self.interrupter.close()
        self.structured.close()
        if self.parallel is not None:
            self.parallel.shutdown()

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
            num_kv_peers_refused=self.kv_transfer.num_peers_refused,
            num_computed_prompt_tokens=s.num_computed_prompt_tokens,
            num_kv_blocks_imported=self.kv_transfer.num_blocks_imported,
            num_kv_bytes_imported=self.kv_transfer.num_bytes_imported,
            kv_layout=self.kv_setup.layout_name,
            xtensor=self.kv_setup.xtensor_stats(),
            async_scheduling=self.async_scheduling,
            graph=GraphStatsMsg(**dataclasses.asdict(self.runner.graph.stats)),
            moe=self.parallel.stats() if self.parallel is not None else None,
            colocation=self.interrupter.stats(),
            num_image_encodes=getattr(self.runner.images, "num_encodes", 0),
            num_image_cache_hits=getattr(self.runner.images, "num_hits", 0),
            num_image_tokens_encoded=getattr(self.runner.images, "num_encoded_tokens", 0),
            num_encode_steps=getattr(self.scheduler.encode_stage, "num_encode_steps", 0),
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ PD KV transfer
    def kv_export(self, export_id: str, token_ids: list[int]) -> KVExportInfo:
        return self.kv_transfer.export(export_id, token_ids)

    def kv_import(self, source: KVExportInfo, token_ids: list[int], pin_id: str) -> KVImportResult:
        if self.parallel is not None:
            raise ValueError(
                "KV import into an expert-parallel instance is not supported yet (its workers would not "
                "receive the blocks); run decode instances with expert_parallel_size 1"
            )
        return self.kv_transfer.import_(source, token_ids, pin_id)

    def kv_release(self, pin_id: str) -> bool:
        return self.kv_transfer.release(pin_id)
