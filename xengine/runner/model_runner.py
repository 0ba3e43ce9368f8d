"""Runs one engine step on the device: inputs -> model -> logits -> sampler -> ``StepOutput``."""

from __future__ import annotations

import time

import torch

from graph.base import create_graph_runner
from memory.kv_layout import BaseKVLayout
from ops.platforms import Platform
from xengine.api.messages import TokenLogprob
from xengine.request import Request
from xengine.runner.input_batch import build_inputs
from xengine.sampling.beam_search import BeamRows, beam_candidates
from xengine.sampling.metadata import SamplingMetadata
from xengine.sampling.sampler import Sampler, SamplerOutput
from xengine.scheduler.plan import SampledToken, SchedulePlan, StepOutput

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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layout = layout
        self.attn_caches = layout.attention_caches(kv_caches)  # what attention reads (xTensor: slots)
        self.platform = platform
        self.device = platform.torch_device()
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len  # positions the model's tables cover (None: unchecked)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.graph = create_graph_runner(platform.name, self._forward)
        torch.manual_seed(default_seed)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        return self.model(input_ids, positions, self.attn_caches, meta)

    @torch.inference_mode()
    def execute(self, plan: SchedulePlan) -> StepOutput:
        self._check_positions(plan)
        self.layout.copy_blocks(self.kv_caches, plan.block_copies)
        kv_slots = self.layout.prepare(
            [
                (s.req.seq_id, plan.block_tables[s.req.seq_id], s.req.num_computed_tokens + s.num_new_tokens)
                for s in plan.seqs
            ]
        )
        inputs = build_inputs(plan, self.block_size, self.device, kv_slots)
        t0 = time.perf_counter()
        hidden = self.graph.run(
            inputs.num_tokens, inputs.meta.is_all_decode, inputs.input_ids, inputs.positions, inputs.meta
        )
        logits = (
            self.model.compute_logits(hidden[inputs.logits_indices]) if len(inputs.logits_indices) else None
        )
        self.platform.synchronize()
        forward_s = time.perf_counter() - t0
        out = StepOutput(forward_s=forward_s)
        if logits is not None:
            self._sample(plan, logits, out)
        return out

    def _check_positions(self, plan: SchedulePlan) -> None:
        """Refuse a plan that reaches past ``max_model_len``: on a device, an out-of-range index
        into the RoPE table is not an error but garbage (or a dead context)."""
        if self.max_model_len is None:
            return
        for s in plan.seqs:
            end = s.req.num_computed_tokens + s.num_new_tokens
            if end > self.max_model_len:
                raise IndexError(
                    f"sequence {s.req.seq_id!r} reaches position {end - 1}, past the "
                    f"{self.max_model_len} positions the model was set up for (max_model_len)"
                )

    def _sample(self, plan: SchedulePlan, logits: torch.Tensor, out: StepOutput) -> None:
        rows: list[tuple[Request, int]] = []  # (sequence, sample index within it)
        row_of_logit: list[int] = []
        beams = BeamRows()
        beam_seq_ids: list[str] = []
        for i, s in enumerate(x for x in plan.seqs if x.sample):
            if s.num_beam_candidates:
                beams.rows.append(i)
                beams.num_candidates.append(s.num_beam_candidates)
                beams.banned_token_ids.append(s.banned_token_ids)
                beams.allowed_token_ids.append(s.allowed_token_ids)
                beam_seq_ids.append(s.req.seq_id)
                continue
            for k in range(s.num_samples):
                rows.append((s.req, k))
                row_of_logit.append(i)
        if beam_seq_ids:
            cand_lps, cand_ids = beam_candidates(logits, beams)
            out.beam_candidates.update(zip(beam_seq_ids, zip(cand_lps, cand_ids)))
        if not rows:
            return
        if beam_seq_ids or len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(row_of_logit, device=logits.device)]
        params = [r.params for r, _ in rows]
        generators = {}
        for row, (req, k) in enumerate(rows):
            if req.params.seed is not None and not req.params.is_greedy:
                generators[row] = self._generator(req, k)
        meta = SamplingMetadata.from_params(
            params,
            [r.output_token_ids for r, _ in rows],
            [r.prompt_token_ids for r, _ in rows],
            generators,
            self.eos_token_ids,
            self.device,
        )
        result = self.sampler(logits, meta)
        self._collect(rows, result, out)

    def _generator(self, req: Request, k: int) -> torch.Generator:
        index = req.index + k
        seq_id = req.seq_id if k == 0 else f"{req.req_id}#{index}"
        gen = self.generators.get(seq_id)
        if gen is None:
            seed = req.params.seed if index == 0 else (req.params.seed * 1000003 + index) & _SEED_MASK
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self.generators[seq_id] = gen
        return gen

    def _collect(self, rows: list[tuple[Request, int]], result: SamplerOutput, out: StepOutput) -> None:
        token_ids = result.sampled_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_logprob_token_ids.tolist() if result.top_logprob_token_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for row, (req, _) in enumerate(rows):
            sample = SampledToken(token_ids[row])
            k = req.params.logprobs
            if k is not None and logprobs is not None:
                sample.logprob = logprobs[row]
                pairs = zip(top_ids[row][:k], top_lps[row][:k]) if top_ids is not None else []
                sample.top_logprobs = [TokenLogprob(t, lp) for t, lp in pairs]
            out.sampled.setdefault(req.seq_id, []).append(sample)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
