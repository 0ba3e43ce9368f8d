"""One model instance: ``step()`` = schedule -> execute -> update -> per-request deltas.

Built once from its parts: the model and its KV memory (``kv_setup.py``), the runner, the scheduler,
and the step loop (``xengine/step/``: normal, or overlapped under async scheduling). Co-location
(``xengine/colocation/``) and PD KV transfer (``xengine/disagg/``) plug into the loop; the process
that serves the engine over sockets is ``xengine/process/``. The map: ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

from ops.platforms import resolve_platform, set_platform
from xengine.api.config import CacheConfig, EngineConfig
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
from xengine.colocation.interrupter import Interrupter, note_arrival
from xengine.colocation.resume import StepResumer
from xengine.disagg.head_transfer import HeadTransfer, head_fingerprint
from xengine.disagg.hybrid_transfer import StateTransfer, WindowTransfer
from xengine.disagg.kv_transfer import KVTransferManager
from xengine.disagg.tp_transfer import GroupTransfer, RankTransfer
from xengine.kv_setup import KVSetup, build_kv
from xengine.lora.setup import start_lora
from xengine.models.emulated import EmulatedLM, emulated_info
from xengine.models.info import ModelInfo, read_hf_config, read_model_info
from xengine.models.loader import load_model, resolve_dtype
from xengine.models.registry import get_model_class
from xengine.multimodal.encode_stage import EncodeStage
from xengine.multimodal.request_images import request_images, vision_spec
from xengine.parallel.data_parallel import start_parallel
from xengine.parallel.tensor import kv_head_range
from xengine.request import Request
from xengine.runner.model_runner import ModelRunner
from xengine.runner.prompt_embeds import attach_embeds
from xengine.scheduler.scheduler import Scheduler
from xengine.spec.build import build_drafter
from xengine.spec.drafting import spec_stats_msg
from xengine.spec.head_proposer import HeadProposer
from xengine.state_setup import StateSetup, build_stateful_kv, kv_free_layers, state_shapes
from xengine.step.deltas import collect_deltas
from xengine.step.execute import EngineBrokenError, StepExecutor
from xengine.step.housekeeping import BetweenSteps
from xengine.step.normal import NormalLoop
from xengine.step.overlap import OverlapLoop
from xengine.step.result import StepTiming
from xengine.structured.manager import StructuredOutputs, compile_error_message
from xengine.tiered_kv_setup import start_tiers
from xengine.validation import validate_request

_MAX_DEFAULT_LEN = 8192


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


class Engine:
    """One model instance in this process: requests in (``add_request``), per-request deltas out of
    each ``step()``; stats, catalogs and PD KV export / import beside them."""

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        model_dir = config.model.model
        if not model_dir or not Path(model_dir).is_dir():
            raise ValueError(f"model folder not found: {model_dir!r}; pass a local Hugging Face model folder")
        self.platform = resolve_platform(config.device.device)
        self.platform.configure(config.device.device_profile)
        set_platform(self.platform)
        self.platform.set_num_threads(config.device.num_threads)
        self.model_info = info = read_model_info(model_dir)
        check_max_model_len(config.model.max_model_len, model_dir, info)  # before loading weights
        # expert parallel: the workers start and join before the model is built (it holds only its experts)
        self.parallel = start_parallel(config, self.platform)
        try:
            self._load(config, info, model_dir)
        except BaseException:
            if self.parallel is not None:
                self.parallel.shutdown()
            raise

    def _load(self, config: EngineConfig, info: ModelInfo, model_dir: str) -> None:
        """Weights, KV memory, runner, scheduler: everything of the instance after its processes exist."""
        cache = config.cache
        if self.platform.capabilities.emulated:  # a timed stand-in of one small KV layer (emulated.py)
            cache, info = self._emulated(config), emulated_info(info)
            self.dtype = torch.float32
            self.model: torch.nn.Module = EmulatedLM(info.vocab_size, config.model.seed)
        else:
            self.dtype = resolve_dtype(self.platform, config.model.dtype, info.torch_dtype)
            self.model = load_model(
                model_dir, self.dtype, self.platform.torch_device(), config.model.quantization
            )
        if self.parallel is not None:
            cache = self.parallel.check_model_and_cache(cache)
            self.parallel.ep.act_dtype = self.dtype
        max_len = config.model.max_model_len or min(info.max_position_embeddings, _MAX_DEFAULT_LEN)
        caps, execution = self.platform.capabilities, config.execution
        self.graph_mode = caps.default_graph_mode if execution.graph_mode == "auto" else execution.graph_mode
        self.async_scheduling = execution.async_enabled(caps.default_async_scheduling)
        shapes = state_shapes(self.model)
        self.state_setup: StateSetup | None = None
        if shapes:  # recurrent layers: a state pool beside the attention KV (``xengine/state_setup.py``)
            self._check_stateful(execution.graph_mode)
            if self.graph_mode == "full":  # the platform's default: no whole-step graphs for these yet
                self.graph_mode = "eager"
            kv, self.state_setup = build_stateful_kv(
                cache,
                config.scheduler,
                info,
                self.dtype,
                self.platform,
                max_len,
                shapes,
                self.async_scheduling,
                kv_free_layers(self.model, info.num_layers, shapes),
                config.speculative_config.num_speculative_tokens if config.speculative_config.enabled else 0,
            )
        else:
            kv = build_kv(
                cache,
                config.scheduler,
                self._rank_kv_info(info),
                self.dtype,
                self.platform,
                max_len,
                self.async_scheduling,
                sliding_windows=tuple(getattr(getattr(self.model, "config", None), "sliding_windows", ())),
                hybrid_blocker=self._hybrid_blocker(),
            )
        self.kv_setup = kv
        self.max_model_len = kv.max_model_len
        self.model.set_max_model_len(self.max_model_len)
        if self.parallel is not None:  # every worker holds a KV pool of the same geometry
            self.parallel.setup(kv.manager.pool.num_blocks, kv.spec.block_size, self.max_model_len)
        self.kv = kv.manager
        # online arrivals stop offline prefill steps between layers (not across expert-parallel ranks)
        self.interrupter = Interrupter(
            config.scheduler.offline_preemption if self.parallel is None else "step"
        )
        self.runner = ModelRunner(
            self.model,
            kv.kv_caches,
            kv.layout,
            self.platform,
            kv.spec.block_size,
            info.eos_token_ids,
            config.model.seed,
            max_model_len=self.max_model_len,
            graph_mode=self.graph_mode,
            parallel=self.parallel,
            encode_overlap=execution.encode_overlap_enabled(caps.default_encode_overlap),
            interrupt=self.interrupter.event if self.interrupter.mode == "layer" else None,
            window_layers=kv.window_layers,
            states=self.state_setup,
            window_layout=kv.window_layout,
        )
        self.runner.sampler.logprobs_mode = config.model.logprobs_mode  # raw or processed (as vLLM)
        self.runner.capture_graphs(execution.buckets())
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.max_model_len,
            info.eos_token_ids,
            async_mode=self.async_scheduling,
            encode_stage=self._encode_stage(config),
            drafter=build_drafter(self, config),
        )
        tiered = (self.platform, self.parallel, self.state_setup, self.scheduler)  # KV tiers (or None)
        self.tiers = start_tiers(config, kv, model_dir, *tiered)
        self.lora = start_lora(self, config)  # LoRA adapters (``xengine/lora/``), or None
        self._build_step(config, kv)
        self.vocab_size = info.vocab_size
        self.vision = vision_spec(self.model)  # None: a text-only model
        self.catalogs = CatalogRegistry(info.vocab_size)
        # structured outputs: grammars compiled off the engine loop, cached (``xengine/structured/``)
        self.structured = StructuredOutputs.for_model(
            model_dir, info.vocab_size, list(info.eos_token_ids), config.structured_outputs
        )
        self.info = self._describe(config, info, model_dir, kv)

    def _rank_kv_info(self, info: ModelInfo) -> ModelInfo:
        """``info`` with this rank's KV heads (tensor parallel: its share: N times the tokens fit)."""
        tp = self.parallel.tp if self.parallel is not None else None
        if tp is None:
            return info
        return dataclasses.replace(info, num_kv_heads=kv_head_range(info.num_kv_heads, tp.rank, tp.size)[1])

    def _emulated(self, config: EngineConfig) -> CacheConfig:
        """The cache settings of an emulated instance (its pool as large as the profile's device holds,
        unless set); refuses what the stand-in model cannot stand in for."""
        spec, cache = config.speculative_config, config.cache
        blocker = None
        if self.parallel is not None:
            blocker = "expert parallelism"
        elif spec.enabled and spec.method != "ngram":
            blocker = f"speculative_config.method {spec.method} (its draft reads the real model; ngram runs)"
        elif cache.kv_cache_dtype != "auto":
            blocker = f"cache.kv_cache_dtype {cache.kv_cache_dtype}"
        if blocker is not None:
            raise ValueError(f"device emulated does not emulate {blocker}; leave it out or run a real device")
        if cache.num_blocks is not None:
            return cache
        profile = getattr(self.platform, "profile", None)
        capacity = profile.kv_capacity_tokens if profile is not None else 65536
        return dataclasses.replace(cache, num_blocks=-(-capacity // cache.block_size))

    def _check_stateful(self, graph_mode: str) -> None:
        """A model with recurrent layers runs on one process, without whole-step graphs, for now: refuse
        what it cannot do."""
        if self.parallel is not None and not self.parallel.own_pools:
            raise ValueError("expert parallelism is not supported for models with recurrent layers yet")
        if graph_mode == "full":
            raise ValueError(
                "execution.graph_mode full: models with recurrent layers run eagerly or with partial graphs "
                "(the recurrent scan stays eager, like attention); use execution.graph_mode eager, partial or auto"
            )

    def _hybrid_blocker(self) -> str | None:
        """Why sliding-window layers cannot keep a KV pool of their own here (None: they can)."""
        if self.parallel is not None and not self.parallel.own_pools:
            return "expert parallelism (the workers hold one pool)"
        if self.graph_mode == "full":
            return "full device graphs (their attention buffers hold one block table)"
        return None

    def _build_step(self, config: EngineConfig, kv: KVSetup) -> None:
        """The step loop, chosen once: the normal one, or the overlap one under async scheduling."""
        self.kv_transfer = self._kv_transfer(config, kv)
        self.resumer = StepResumer(self.scheduler)  # interrupted offline steps carry on later
        self.executor = StepExecutor(self.runner, self.scheduler, self.interrupter, self.parallel)
        between = BetweenSteps(self.scheduler, self.kv, self.kv_transfer)
        self.loop: NormalLoop | OverlapLoop = (
            OverlapLoop(self.scheduler, self.runner, self.executor, between, self.interrupter)
            if self.async_scheduling
            else NormalLoop(self.scheduler, self.executor, between, self.interrupter, self.resumer)
        )
        self.last_step_timing: StepTiming | None = None
        self.num_steps = 0

    def _kv_transfer(self, config: EngineConfig, kv: KVSetup) -> KVTransferManager:
        """PD transfer (the Mooncake agent starts on first use): the full-attention layers' blocks, and a
        hybrid model's window blocks and state snapshot beside them (``xengine/disagg/hybrid_transfer.py``)."""
        states = self.state_setup
        stateful = states.no_kv_layers if states is not None else frozenset()
        layers = range(len(kv.kv_caches))
        full = [kv.kv_caches[i] for i in layers if i not in kv.window_layers and i not in stateful]
        window = state = None
        if kv.manager.window is not None:
            window = WindowTransfer(kv.manager.window, [kv.kv_caches[i] for i in sorted(kv.window_layers)])
        if states is not None:
            state = StateTransfer(states.slots, [t for ts in states.pool.layers.values() for t in ts])
        head = None
        drafter = self.scheduler.drafter
        if (
            drafter is not None
            and isinstance(drafter.proposer, HeadProposer)
            and config.cache.enable_prefix_caching
        ):
            proposer = drafter.proposer  # its KV of the prompt goes with the prompt's (head_transfer.py)
            head_id = head_fingerprint(config.speculative_config.method, proposer.head)
            head = HeadTransfer(proposer.kv, proposer.caches, head_id)
        ranks = None
        if self.parallel is not None and self.parallel.tp is not None:  # each rank moves its KV heads
            tp, total = self.parallel.tp, self.model_info.num_kv_heads
            first, count = kv_head_range(total, tp.rank, tp.size)
            mine = RankTransfer(
                full, first, count, kv.spec.block_size, port_range=config.cache.transfer_ports()
            )
            ranks = GroupTransfer(self.parallel.ep.control_group, tp.channel, mine, total)
        ports = config.cache.transfer_ports()
        parts = dict(window=window, states=state, head=head, ranks=ranks)
        return KVTransferManager(self.kv, full, kv.spec, port_range=ports, **parts)

    def _describe(self, config: EngineConfig, info: ModelInfo, model_dir: str, kv: KVSetup) -> EngineInfo:
        spec = kv.spec
        return EngineInfo(
            model_name=config.model.served_model_name or Path(model_dir).resolve().name,
            vocab_size=info.vocab_size,
            max_model_len=self.max_model_len,
            block_size=spec.block_size,
            eos_token_ids=list(info.eos_token_ids),
            num_total_blocks=kv.manager.pool.num_blocks,
            device=self.platform.name,
            pid=os.getpid(),
            hidden_size=info.hidden_size,
            num_params=sum(p.numel() for p in self.model.parameters()),
            kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            num_threads=torch.get_num_threads(),
            kv_tiers=[t.name for t in self.tiers.stack.tiers] if self.tiers is not None else [],
            lora=self.lora is not None,
            lora_adapters=dict(self.lora.paths) if self.lora is not None else {},
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
        attach_embeds(request, req.prompt_embeds, self.dtype, self.platform.torch_device())  # prompt_embeds
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
        busy = self.scheduler.has_unfinished() or self.loop.busy
        for ready in self.structured.take_ready(idle=not busy):
            self.scheduler.add(ready.request, ready.catalog)
            if ready.error is not None:
                self.scheduler.fail_request(ready.request.req_id, compile_error_message(ready.error))

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
        waiting = bool(len(self.structured.waiting))  # requests whose grammar is compiling
        tiers = self.tiers is not None and self.tiers.busy  # saves pin blocks until they finish
        return (
            self.scheduler.has_unfinished()
            or bool(self.scheduler.updated)
            or self.loop.busy
            or waiting
            or tiers
        )

    # ------------------------------------------------------------------ step
    def step(self) -> list[CompletionDelta]:
        """One step of the loop chosen at construction (``xengine/step/``): schedule -> execute ->
        update. Returns what each request got since the last step."""
        self.check_workers()
        self._admit_compiled()
        if self.tiers is not None:  # finished tier loads and saves (``xengine/tiered_kv.py``)
            self.tiers.poll(bool(self.scheduler.running), self.scheduler.seqs)
        t0 = time.perf_counter()
        forwards = self.parallel.num_forwards if self.parallel is not None else 0
        result = self.loop.step()
        if self.parallel is not None:  # data-parallel ranks: a round if this step ran no forward
            self.parallel.after_step(forwards, self.loop.busy)
        t1 = time.perf_counter()
        deltas = collect_deltas(self.scheduler, self.runner)
        self.num_steps += result.executed
        self.last_step_timing = result.timing(time.perf_counter() - t0, time.perf_counter() - t1)
        return deltas

    def idle(self) -> None:
        """A loop iteration with nothing to step: a data-parallel rank still takes part in the others'
        forwards (``xengine/parallel/data_parallel.py``)."""
        if self.parallel is not None:
            self.parallel.idle()

    def may_exit(self) -> bool:
        """Drained and asked to stop: data-parallel ranks leave together, after a round saying so."""
        return self.parallel is None or self.parallel.may_exit()

    # ------------------------------------------------------------------ processes
    def check_workers(self) -> None:
        """``EngineBrokenError`` when an expert-parallel worker of this instance has exited."""
        if self.parallel is not None and self.parallel.scan() is not None:
            raise EngineBrokenError(self.parallel.failure)

    def shutdown(self) -> None:
        """Stop this instance's worker processes: expert-parallel workers, the grammar sandbox."""
        self.interrupter.close()
        self.structured.close()
        if self.tiers is not None:
            self.tiers.close()
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
            window_pool=self.kv_setup.window_stats(),
            state_pool=self.state_setup.stats() if self.state_setup is not None else None,
            async_scheduling=self.async_scheduling,
            graph=GraphStatsMsg(**dataclasses.asdict(self.runner.graph.stats)),
            moe=self.parallel.stats() if self.parallel is not None else None,
            colocation=self.interrupter.stats(),
            num_image_encodes=getattr(self.runner.images, "num_encodes", 0),
            num_image_cache_hits=getattr(self.runner.images, "num_hits", 0),
            num_image_tokens_encoded=getattr(self.runner.images, "num_encoded_tokens", 0),
            num_encode_steps=getattr(self.scheduler.encode_stage, "num_encode_steps", 0),
            spec_decode=spec_stats_msg(self.scheduler.drafter),
            kv_tiers=self.tiers.stats() if self.tiers is not None else None,
            lora=self.lora.stats(s.running, s.waiting) if self.lora is not None else None,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ PD KV transfer
    def _check_transferable(self) -> None:
        if not self.kv_transfer.kv_caches:
            raise ValueError(
                "PD KV transfer of a model without full-attention layers is not supported yet (every "
                "layer slides or is recurrent); serve it on instances that prefill and decode"
            )

    def kv_export(
        self, export_id: str, token_ids: list[int], next_token_id: int | None = None
    ) -> KVExportInfo:
        """Pin the prompt ``token_ids``'s cached blocks for a decode instance (``next_token_id``: the
        token the prefill sampled; a draft head's blocks of the prompt go along when it is given)."""
        self._check_transferable()
        return self.kv_transfer.export(export_id, token_ids, next_token_id)

    def kv_import(
        self, source: KVExportInfo, token_ids: list[int], pin_id: str, next_token_id: int | None = None
    ) -> KVImportResult:
        self._check_transferable()
        if self.parallel is not None and self.parallel.tensor_parallel_size == 1:
            raise ValueError(
                "KV import into an expert-parallel instance is not supported yet (its workers would not "
                "receive the blocks); run decode instances with expert_parallel_size 1, or tensor "
                "parallel (each rank then reads its own KV heads)"
            )
        return self.kv_transfer.import_(source, token_ids, pin_id, next_token_id)

    def kv_release(self, pin_id: str) -> bool:
        return self.kv_transfer.release(pin_id)
