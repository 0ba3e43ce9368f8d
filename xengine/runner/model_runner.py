"""Runs one engine step on the device: inputs -> model -> logits -> sampler -> ``StepOutput``.

``prepare`` (host side: KV pages, inputs, sampling rows) and ``run`` (device side) are separate so the
overlapped loop (``xengine/step/overlap.py``) can prepare a step while the previous one runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from graph.base import create_graph_runner
from graph.forward_context import forward_context
from graph.interrupt import ResumePoint, StepInterrupted
from memory.kv_layout import BaseKVLayout
from ops.lora import LoRAGroups
from ops.platforms import Platform
from ops.recurrent_metadata import RecurrentMetadata
from xengine.api.messages import TokenLogprob
from xengine.colocation.layer_checks import LayerChecks
from xengine.lora.manager import LoRAManager
from xengine.multimodal.encode_runner import EncodeRunner
from xengine.multimodal.image_cache import ImageEmbeddingCache
from xengine.multimodal.step_inputs import MultiModalStep, build_multimodal_step, has_images
from xengine.parallel.group import ExpertParallelGroup
from xengine.request import Request
from xengine.runner.decode_inputs import DecodeInputs
from xengine.runner.inference import inference
from xengine.runner.input_batch import ModelInputs, build_inputs, window_metadata
from xengine.runner.placeholders import resolve, resolve_lists
from xengine.runner.prompt_embeds import embed_rows
from xengine.runner.prompt_outputs import (
    PromptOutputRows,
    build_prompt_rows,
    compute_prompt_outputs,
    logit_spans,
)
from xengine.runner.recurrent_inputs import recurrent_metadata
from xengine.runner.sampling_reuse import SamplingReuse
from xengine.runner.sampling_rows import SamplingRows
from xengine.sampling.beam_search import beam_candidates
from xengine.sampling.metadata import SamplingMetadata
from xengine.sampling.sampler import Sampler, SamplerOutput, process_logits, processed_logprobs, raw_logprobs
from xengine.scheduler.plan import SampledToken, SchedulePlan, StepOutput
from xengine.spec.hidden_rows import HiddenRows
from xengine.spec.verify import DraftGroup, verify
from xengine.state_setup import StateSetup
from xengine.structured.matcher import SequenceMatchers

_SEED_MASK = (1 << 63) - 1


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        layout: BaseKVLayout,
        platform: Platform,
        block_size: int,
        eos_token_ids: list[int],
        default_seed: int = 0,
        max_model_len: int | None = None,
        graph_mode: str = "eager",
        parallel: ExpertParallelGroup | None = None,
        encode_overlap: bool = False,
        interrupt: threading.Event | None = None,
        window_layers: frozenset[int] = frozenset(),
        states: StateSetup | None = None,
        window_layout: BaseKVLayout | None = None,
    ) -> None:
        """``interrupt``: set by an online arrival, it stops an offline step between layers
        (``xengine/colocation/``); None: steps are never stopped. ``window_layers``: the layers whose KV
        lives in the sliding-window pool (``memory/sliding_window.py``; plans then carry their tables).
        ``states``: the recurrent layers' state pool (``xengine/state_setup.py``; plans carry slots)."""
        self.model = model
        self.kv_caches = kv_caches
        self.window_layers = window_layers
        self.states = states
        stateful = states.no_kv_layers if states is not None else frozenset()  # placeholders in kv_caches
        self._full_caches = [
            c for i, c in enumerate(kv_caches) if i not in window_layers and i not in stateful
        ]
        self._window_caches = [c for i, c in enumerate(kv_caches) if i in window_layers]
        self.layout = layout
        # what attention reads per layer (xTensor: slots; window layers: their pool's; recurrent: a placeholder)
        self.window_layout = window_layout if window_layout is not None else layout
        plain = layout.attention_caches(
            [c for i, c in enumerate(kv_caches) if i not in stateful and i not in window_layers]
        )
        windowed = self.window_layout.attention_caches(self._window_caches)
        full_it, window_it = iter(plain), iter(windowed)
        self.attn_caches = [
            kv_caches[i] if i in stateful else next(window_it) if i in window_layers else next(full_it)
            for i in range(len(kv_caches))
        ]
        self.platform = platform
        self.device = platform.torch_device()
        self.block_size = block_size
        self.decode_inputs = DecodeInputs(block_size, self.device)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len  # positions the model's tables cover (None: unchecked)
        self.parallel = parallel  # expert parallel: the workers run each forward with this rank
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.matchers = SequenceMatchers()  # structured outputs: one grammar matcher per sequence
        self.sampling_reuse = SamplingReuse()
        self.graph = create_graph_runner(graph_mode, platform.name, self._forward_tokens)
        # vision-language models: image embeddings per request and instance-wide (xengine/multimodal)
        encode = getattr(model, "encode_images", None)
        self.images = ImageEmbeddingCache(encode, self.device) if encode is not None else None
        self.encoder = EncodeRunner(self.images, encode_overlap) if self.images is not None else None
        self.interrupt = interrupt
        # where an eager forward may stop and carry on from (before the graphs are captured)
        self.layer_checks = LayerChecks.install(model) if interrupt is not None else None
        self.hidden_rows: HiddenRows | None = None  # an MTP draft head's input (spec/mtp.py)
        self.lora: LoRAManager | None = None  # LoRA adapters (``xengine/lora/``): set by the engine
        torch.manual_seed(default_seed)

    def _forward_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.forward_tokens(input_ids, positions)

    def capture_graphs(self, sizes: list[int]) -> None:
        """Build the graph runner's graphs (start-up; a no-op in eager mode)."""
        if self.max_model_len:
            self.graph.bind_kv(self.attn_caches, self.block_size, -(-self.max_model_len // self.block_size))
        self.graph.capture(sizes, self.device)

    @inference
    def execute(self, plan: SchedulePlan) -> StepOutput:
        """Run one step now (``prepare``, timed in ``prepare_s``, then ``run``)."""
        t0 = time.perf_counter()
        step = self.prepare(plan)
        prepare_s = time.perf_counter() - t0
        out = self.run(step)
        out.prepare_s = prepare_s
        return out

    @inference  # its tensors are graph inputs: the same kind whichever thread runs it
    def prepare(self, plan: SchedulePlan) -> PreparedStep:
        """The host side of a step (engine thread): KV pages mapped, inputs and sampling rows built.

        Input tokens may be async placeholders (``xengine/scheduler/in_flight.py``): ``run`` resolves
        them from the previous step's sampled tokens."""
        if not plan.seqs:  # only image encodes
            return PreparedStep(plan, None, None)
        self._check_positions(plan)
        kv_slots = self.layout.prepare(  # lazily: the paged layout reads none of it
            (s.req.seq_id, plan.block_tables[s.req.seq_id], s.end) for s in plan.seqs
        )
        if plan.decode_only:
            inputs = self.decode_inputs.build(plan, kv_slots)
        else:
            inputs = build_inputs(plan, self.block_size, self.device, kv_slots)
        if plan.window_block_tables is not None:
            tables = plan.window_block_tables
            window_slots = self.window_layout.prepare(
                (s.req.seq_id, tables[s.req.seq_id], s.end) for s in plan.seqs
            )
            inputs.window_meta = window_metadata(plan, inputs.meta, self.block_size, window_slots)
        mm = None
        if self.images is not None and has_images(plan):
            mm = build_multimodal_step(plan, self.device)
            if not mm.pieces:  # text tokens only: one M-RoPE id each, the text path runs it
                inputs.positions = mm.positions
        recurrent = recurrent_metadata(plan) if plan.state_slots is not None else None
        lora = self.lora.step_groups((s.req, s.num_new_tokens) for s in plan.seqs) if self.lora else None
        sampling = self._sampling_rows(plan)
        if plan.decode_only:  # no prompt position in the step: no prompt outputs, no given embeddings
            return PreparedStep(plan, inputs, sampling, None, mm, recurrent, lora, None)
        embeds, prompt_rows = embed_rows(plan, self.device), build_prompt_rows(plan)
        return PreparedStep(plan, inputs, sampling, prompt_rows, mm, recurrent, lora, embeds)

    @inference
    def run(self, step: PreparedStep, prev_rows: torch.Tensor | None = None) -> StepOutput:
        """The device side of a step (any thread): copy-on-write copies, placeholders resolved from
        ``prev_rows`` (the previous step's sampled tokens), forward, logits, sampling; the step's
        image encodes before the forward or beside it (``EncodeRunner``)."""
        t0 = time.perf_counter()
        encoding = None
        if step.plan.encodes:
            assert self.encoder is not None
            encoding = self.encoder.start(step.plan.encodes, with_forward=step.inputs is not None)
        if step.inputs is None:
            return StepOutput(forward_s=time.perf_counter() - t0)
        try:
            out = self._run_model(step, prev_rows, t0)
        except StepInterrupted as e:  # the engine may resume it: it needs the step, and a forward
            e.step = step  # that can carry on from where it stopped
            if not (self._resumable(step) and prev_rows is None):
                e.resume = None
            raise
        finally:
            EncodeRunner.wait(encoding)
        return out

    @inference
    def resume(self, step: PreparedStep, point: ResumePoint) -> StepOutput:
        """Carry an interrupted step's forward on from ``point``, then its logits and sampling (its
        copies, inputs and the KV of the layers it finished are as it left them)."""
        try:
            return self._run_model(step, None, time.perf_counter(), point)
        except StepInterrupted as e:  # stopped again: resumable from the new point
            e.step = step
            raise

    def _resumable(self, step: PreparedStep) -> bool:
        """Whether an interrupted ``step`` can carry on where it stopped: an eager forward of a model
        with layer checks, in this process alone, text only."""
        return (
            self.graph.mode == "eager"
            and self.parallel is None
            and (step.mm is None or not step.mm.pieces)
            and self.layer_checks is not None
            and self.states is None  # recurrent states are committed at the end of a whole forward
        )

    def _run_model(
        self, step: PreparedStep, prev_rows: torch.Tensor | None, t0: float, resume: ResumePoint | None = None
    ) -> StepOutput:
        inputs = step.inputs
        assert inputs is not None
        if resume is None:  # a resumed step did these when it started
            self.layout.copy_blocks(self._full_caches, step.plan.block_copies)
            self.layout.copy_blocks(self._window_caches, step.plan.window_block_copies)
            if self.states is not None:
                self.states.pool.copy(step.plan.state_copies)
            if prev_rows is not None:
                inputs.input_ids = resolve(inputs.input_ids, prev_rows)
            if self.parallel is not None:
                inputs.prompt_spans = logit_spans(step.prompt_rows)  # tensor parallel: LM-head calls
                self.parallel.publish(inputs, step.plan.block_copies)
        interrupt = self.interrupt if step.plan.interruptible else None
        resumable = interrupt is not None and prev_rows is None and self._resumable(step)
        with forward_context(
            inputs.meta,
            self.attn_caches,
            inputs.num_tokens,
            interrupt,
            resumable,
            inputs.window_meta,
            self.window_layers,
            step.recurrent,
            self.states.pool.per_layer(self.states.num_layers) if self.states is not None else None,
            step.lora,
        ):
            if resume is not None:
                assert self.layer_checks is not None
                hidden = self.layer_checks.resume(resume, inputs.positions)
            elif step.mm is not None and step.mm.pieces:
                hidden = self._forward_images(inputs, step.mm)
            elif step.embeds is not None:  # prompt embeddings (vLLM's ``prompt_embeds``): eager
                hidden = self.model.forward_embeds(inputs.input_ids, inputs.positions, *step.embeds)
            else:
                hidden = self.graph.run(inputs.input_ids, inputs.positions)
        logits = (
            self.model.compute_logits(hidden[inputs.logits_indices]) if len(inputs.logits_indices) else None
        )
        self.platform.emulate_step(inputs.meta.query_lens_cpu, inputs.meta.seq_lens_cpu, t0)
        self.platform.synchronize()
        out = StepOutput(forward_s=time.perf_counter() - t0)
        if step.prompt_rows is not None:  # prompt logprobs / embeddings of the prompt positions computed
            compute_prompt_outputs(self.model, hidden, step.prompt_rows, out)
        if logits is not None and step.sampling is not None:
            self._sample(step.sampling, logits, out, prev_rows)
        if self.hidden_rows is not None:
            self.hidden_rows.put_step(step.plan, hidden, out)
        return out

    def _forward_images(self, inputs: ModelInputs, mm: MultiModalStep) -> torch.Tensor:
        """A step holding image pads (eager): their embeddings from the image cache (encoding the
        images it lacks), M-RoPE positions ``[3, T]``."""
        assert self.images is not None
        embeds, at = self.images.gather(mm.pieces)
        hidden = self.model.forward_multimodal(inputs.input_ids, mm.positions, embeds, at)
        self.images.done(mm.done_seq_ids)
        return hidden

    def _check_positions(self, plan: SchedulePlan) -> None:
        """Refuse a plan that reaches past ``max_model_len``: on a device, an out-of-range index
        into the RoPE table is not an error but garbage (or a dead context)."""
        if self.max_model_len is None:
            return
        for s in plan.seqs:
            end = s.end
            if end > self.max_model_len:
                raise IndexError(
                    f"sequence {s.req.seq_id!r} reaches position {end - 1}, past the "
                    f"{self.max_model_len} positions the model was set up for (max_model_len)"
                )

    def _sampling_rows(self, plan: SchedulePlan) -> SamplingRows | None:
        """Which logits row gives which sequence its token(s), and the sampling metadata (host side);
        the previous step's when it samples the same sequences (``sampling_reuse.py``)."""
        reused = self.sampling_reuse.get(plan)
        if reused is not None:
            return reused
        sampling = self._build_sampling_rows(plan)
        self.sampling_reuse.keep(plan, sampling)
        return sampling

    def _build_sampling_rows(self, plan: SchedulePlan) -> SamplingRows | None:
        sampling = SamplingRows()
        if any(s.draft_token_ids for s in plan.seqs):  # speculative decoding: every row is verified
            sampling.groups = []
        i = 0  # the sequence's first logits row
        for s in (x for x in plan.seqs if x.sample):
            i, drafts = i + 1 + len(s.draft_token_ids), s.draft_token_ids
            if s.num_beam_candidates:
                sampling.beams.rows.append(i - 1)
                sampling.beams.num_candidates.append(s.num_beam_candidates)
                sampling.beams.banned_token_ids.append(s.banned_token_ids)
                sampling.beams.allowed_token_ids.append(s.allowed_token_ids)
                sampling.beam_seq_ids.append(s.req.seq_id)
                continue
            # outputs before this step's token (async: the list already ends with its placeholder)
            num_outputs = len(s.req.output_token_ids) if s.output_index is None else s.output_index
            if drafts:  # one row per position: row j follows the first j drafts
                assert sampling.groups is not None and s.num_samples == 1
                first_logit = i - 1 - len(drafts)
                matcher = None
                if s.req.grammar is not None:  # only the drafts the grammar accepts are verified
                    matcher = self.matchers.get(s.req.seq_id, s.req.grammar)
                    drafts = drafts[: matcher.valid_prefix(drafts)]
                sampling.groups.append(DraftGroup(len(sampling.rows), drafts))
                for j in range(len(drafts) + 1):
                    if matcher is not None:
                        draft = drafts[j] if j < len(drafts) else None
                        sampling.grammar.add(len(sampling.rows), matcher, s.req.grammar.num_ids, draft)
                    sampling.rows.append((s.req, 0))
                    sampling.row_of_logit.append(first_logit + j)
                    sampling.num_outputs.append(num_outputs + j)
                    sampling.row_drafts.append(drafts[:j])
                continue
            for k in range(s.num_samples):
                if s.req.grammar is not None:
                    grammar = s.req.grammar
                    matcher = self.matchers.get(self._seq_id(s.req, k), grammar)
                    sampling.grammar.add(len(sampling.rows), matcher, grammar.num_ids)
                if sampling.groups is not None:
                    sampling.groups.append(DraftGroup(len(sampling.rows), []))
                sampling.rows.append((s.req, k))
                sampling.row_of_logit.append(i - 1)
                sampling.num_outputs.append(num_outputs)
                sampling.row_drafts.append([])
        if not sampling.rows and not sampling.beam_seq_ids:
            return None
        if sampling.rows:
            rows = sampling.rows
            if sampling.groups is None and all(k == 0 for _, k in rows):
                sampling.seq_ids = [r.seq_id for r, _ in rows]
            generators = {}
            for row, (req, k) in enumerate(rows):
                if req.params.seed is not None and not req.params.is_greedy:
                    generators[row] = self._generator(req, k)
            params = [r.params for r, _ in rows]
            penalized = any(SamplingMetadata.uses_history(p) for p in params)
            sampling.meta = SamplingMetadata.from_params(
                params,
                # penalties read the histories on the worker: a snapshot (the engine thread goes on)
                [
                    r.output_token_ids[: n - len(d)] + d if penalized else []
                    for (r, _), n, d in zip(rows, sampling.num_outputs, sampling.row_drafts)
                ],
                [r.prompt_token_ids for r, _ in rows],
                generators,
                self.eos_token_ids,
                self.device,
                sampling.num_outputs,
            )
        return sampling

    def _sample(
        self, sampling: SamplingRows, logits: torch.Tensor, out: StepOutput, prev_rows: torch.Tensor | None
    ) -> None:
        if sampling.beam_seq_ids:
            cand_lps, cand_ids = beam_candidates(logits, sampling.beams)
            out.beam_candidates.update(zip(sampling.beam_seq_ids, zip(cand_lps, cand_ids)))
        if not sampling.rows:
            return
        if sampling.beam_seq_ids or len(sampling.rows) != logits.shape[0]:
            logits = logits[torch.tensor(sampling.row_of_logit, device=logits.device)]
        meta = sampling.meta
        assert meta is not None
        if prev_rows is not None and meta.needs_history:
            meta.output_token_ids = resolve_lists(meta.output_token_ids, prev_rows)
        grammar = sampling.grammar
        if grammar.rows:  # the matchers already saw the previous step's tokens (accepted below)
            meta.grammar_bitmask, meta.grammar_rows = grammar.fill_bitmask(), grammar.rows
        t0 = time.perf_counter()
        if sampling.groups is not None:
            self._verify(sampling, logits, out)
            out.sample_s = time.perf_counter() - t0
            return
        result = self.sampler(logits, meta)
        out.sample_s = time.perf_counter() - t0
        out.sampled_rows = result.sampled_token_ids
        if grammar.rows:
            grammar.accept(result.sampled_token_ids.tolist())
        self._collect(sampling, result, out)

    def _verify(self, sampling: SamplingRows, logits: torch.Tensor, out: StepOutput) -> None:
        """Speculative decoding: each sequence's drafts verified, its emitted tokens (with logprobs
        of the rows they came from, as without speculation) in ``out.sampled``."""
        meta, groups = sampling.meta, sampling.groups
        assert meta is not None and groups is not None
        processed = process_logits(logits.float(), meta)
        emitted = verify(processed, meta, groups)
        if sampling.grammar.rows:  # each matcher advances by its sequence's emitted tokens, in order
            row_tokens = [-1] * len(sampling.rows)
            for pairs in emitted:
                for row, token in pairs:
                    row_tokens[row] = token
            sampling.grammar.accept(row_tokens)
        logprobs = None
        if meta.max_num_logprobs is not None:  # as the sampler reports them (model.logprobs_mode)
            mode = self.sampler.logprobs_mode
            logprobs = raw_logprobs(logits.float(), mode)
            logprobs = processed_logprobs(processed, meta, mode) if logprobs is None else logprobs
        for pairs in emitted:
            for row, token in pairs:
                req = sampling.rows[row][0]
                sample = SampledToken(token)
                k = req.params.logprobs
                if k is not None and logprobs is not None:
                    sample.logprob = float(logprobs[row, token])
                    ids = req.params.logprob_token_ids
                    if ids is not None:
                        pairs_ = zip(ids, logprobs[row, ids].tolist())
                    else:
                        top_lps, top_ids = torch.topk(logprobs[row], min(k, logprobs.shape[1]))
                        pairs_ = zip(top_ids.tolist(), top_lps.tolist())
                    sample.top_logprobs = [TokenLogprob(t, lp) for t, lp in pairs_]
                out.sampled.setdefault(req.seq_id, []).append(sample)  # forks: the scheduler splits

    @staticmethod
    def _seq_id(req: Request, k: int) -> str:
        """The sequence sample ``k`` of ``req``'s row belongs to (k > 0: the forks of an n > 1 request)."""
        return req.seq_id if k == 0 else f"{req.req_id}#{req.index + k}"

    def _generator(self, req: Request, k: int) -> torch.Generator:
        index = req.index + k
        seq_id = self._seq_id(req, k)
        gen = self.generators.get(seq_id)
        if gen is None:
            seed = req.params.seed if index == 0 else (req.params.seed * 1000003 + index) & _SEED_MASK
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq_id] = gen
        return gen

    def _collect(self, sampling: SamplingRows, result: SamplerOutput, out: StepOutput) -> None:
        rows, token_ids = sampling.rows, result.sampled_token_ids.tolist()
        if result.logprobs is None and sampling.seq_ids is not None:  # the common case: a token a row
            out.token_ids = dict(zip(sampling.seq_ids, token_ids))
            return
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_logprob_token_ids.tolist() if result.top_logprob_token_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        picked = result.token_id_logprobs.tolist() if result.token_id_logprobs is not None else None
        sampled = out.sampled
        if logprobs is None:  # forks: a token per row, several rows per sequence
            for (req, _), token_id in zip(rows, token_ids):
                sampled.setdefault(req.seq_id, []).append(SampledToken(token_id))
            return
        for row, (req, _) in enumerate(rows):
            sample = SampledToken(token_ids[row])
            k = req.params.logprobs
            if k is not None and logprobs is not None:
                sample.logprob = logprobs[row]
                pairs = zip(top_ids[row][:k], top_lps[row][:k]) if top_ids is not None else []
                if req.params.logprob_token_ids is not None and picked is not None:
                    pairs = zip(req.params.logprob_token_ids, picked[row])  # the asked ids replace the top-k
                sample.top_logprobs = [TokenLogprob(t, lp) for t, lp in pairs]
            out.sampled.setdefault(req.seq_id, []).append(sample)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        self.matchers.release(seq_ids)
        if self.images is not None:
            self.images.release(seq_ids)


@dataclass
class PreparedStep:
    plan: SchedulePlan
    inputs: ModelInputs | None  # None: a step of image encodes only
    sampling: SamplingRows | None
    prompt_rows: PromptOutputRows | None = None
    mm: MultiModalStep | None = None  # requests with images in the step
    recurrent: RecurrentMetadata | None = None  # recurrent layers: the step's state slots
    lora: LoRAGroups | None = None  # the step's rows by LoRA adapter slot (None: base model only)
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt embeddings and the rows taking them
