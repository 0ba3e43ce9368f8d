"""Offline Python API: ``LLM(model=DIR).generate(prompts, SamplingParams(...))``.

Beam search: ``LLM.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=16))`` (or
``generate`` with ``SamplingParams(use_beam_search=True, beam_width=..., n=...)``) returns, per
prompt, ``num_return_sequences`` outputs best first, each with its ``score`` (sum of logprobs /
generated length ** length_penalty, as HF) and ``cumulative_logprob``. With ``catalog=NAME`` (see
``register_catalog``) the output is one item of that catalog.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from tqdm.auto import tqdm

from xengine.api.chat_images import ChatImageBuilder, image_parts
from xengine.api.config import EngineConfig, from_dict
from xengine.api.lora_request import LoRARequest
from xengine.api.media import MediaLimits
from xengine.api.messages import (
    AddRequest,
    CatalogInfo,
    CompletionDelta,
    PoolingParams,
    Priority,
    SamplingParams,
)
from xengine.api.multimodal import ImageInput
from xengine.api.text.output_processor import RequestOutputState
from xengine.api.text.tokenizer import Tokenizer
from xengine.engine import Engine

PromptType = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # per generated token: {token_id: logprob} for the chosen token and the top alternatives
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    score: float | None = None  # beam search: the length-penalised ranking score


@dataclass
class BeamSearchParams:
    """Beam search settings (HF ``generate(num_beams=beam_width, ...)`` semantics)."""

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    num_return_sequences: int | None = None  # default: beam_width
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    beam_top_k: int = 0  # candidates per beam per step; 0: exact
    catalog: str | None = None

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.num_return_sequences or self.beam_width,
            temperature=0.0,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            use_beam_search=True,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,  # type: ignore[arg-type]
            beam_top_k=self.beam_top_k,
            catalog=self.catalog,
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    # with ``SamplingParams(prompt_logprobs=k)``: per prompt token, {token_id: logprob} for it and the
    # top-k alternatives; None for the first token (nothing precedes it)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # ``LLM.embed``: the prompt's pooled, normalised vector


class LLM:
    """Runs an engine in this process. Keyword arguments map onto the engine config sections."""

    def __init__(
        self,
        model: str,
        *,
        config: EngineConfig | None = None,
        allowed_local_media_path: str | None = None,
        media_limits: MediaLimits | None = None,
        **fields: Any,
    ) -> None:
        """``LLM(model, max_model_len=..., kv_layout=..., num_threads=...)``: every keyword is a field of
        one of the engine config sections (``xengine/api/config.py``: model, cache, scheduler, device),
        named as there; ``config`` gives a whole ``EngineConfig`` instead. Vision-language models:
        ``chat`` reads local image files only under ``allowed_local_media_path`` (data: URLs always),
        within ``media_limits``."""
        if config is None:
            config = engine_config(model, **fields)
        elif fields:
            raise TypeError(f"give either config= or engine fields, not both: {sorted(fields)}")
        self.engine = Engine(config)
        # expert parallel: the worker processes stop with this object (or at interpreter exit)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self.tokenizer = Tokenizer.from_dir(config.model.model)
        self._images = ChatImageBuilder.from_dir(config.model.model, allowed_local_media_path, media_limits)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (``expert_parallel_size > 1``); idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Priority = "online",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.
        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._with_lora(_as_params_list(sampling_params, len(prompt_list)), lora_request)
        items = []
        for prompt, params in zip(prompt_list, params_list):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            items.append((text, ids, params))
        return self._run(items, use_tqdm, priority)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        priority: Priority = "online",
    ) -> list[RequestOutput]:
        """Beam search for each prompt; each output's sequences come best first."""
        return self.generate(prompts, params.to_sampling_params(), use_tqdm, priority)

    def embed(
        self, prompts: PromptType | Sequence[PromptType], dimensions: int | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Embed each prompt: its last token's final hidden state, L2-normalised (``embedding``);
        ``dimensions`` keeps the leading ones (Matryoshka) before normalising."""
        items = [
            (p if isinstance(p, str) else None, self._ids_of(p), SamplingParams(max_tokens=0))
            for p in _as_prompt_list(prompts)
        ]
        return self._run(items, use_tqdm, "online", PoolingParams(dimensions=dimensions))

    def _with_lora(
        self, params: list[SamplingParams], lora: LoRARequest | Sequence[LoRARequest | None] | None
    ) -> list[SamplingParams]:
        """Each prompt's params naming its adapter, registered in the engine on first use."""
        if lora is None:
            return params
        loras = [lora] * len(params) if isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != len(params):
            raise ValueError(f"{len(loras)} lora_request entries for {len(params)} prompts")
        manager = self.engine.lora
        out = []
        for p, req in zip(params, loras):
            if req is None:
                out.append(p)
                continue
            if manager is None:
                raise ValueError("lora_request needs an engine serving adapters: LLM(..., enable_lora=True)")
            if req.lora_path and manager.paths.get(req.lora_name) != req.lora_path:
                manager.register(req.lora_name, req.lora_path, replace=True)
            elif not manager.knows(req.lora_name):
                raise ValueError(f"LoRA adapter {req.lora_name!r} is not registered; give its lora_path")
            out.append(msgspec.structs.replace(p, lora_name=req.lora_name))
        return out

    def _ids_of(self, prompt: PromptType) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def register_catalog(self, name: str, items: list[list[int]]) -> CatalogInfo:
        """Register an item catalog (fixed-length token-id tuples) for constrained beam search."""
        return self.engine.register_catalog(name, items)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate. Messages may hold
        OpenAI-style ``image_url`` content parts (vision-language models; ``ValueError`` for a bad image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params_list = self._with_lora(_as_params_list(sampling_params, len(conversations)), lora_request)
        items, images = [], []
        for conv, params in zip(conversations, params_list):
            if next(image_parts(conv), None) is not None:
                if self._images is None:
                    raise ValueError(
                        "this model does not take images (no vision tower / preprocessor_config.json)"
                    )
                prompt = self._images.build(self.tokenizer, conv, add_generation_prompt)
                items.append((prompt.text, prompt.token_ids, params))
                images.append(prompt.images)
                continue
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False), params))
            images.append(None)
        return self._run(items, use_tqdm, "online", images=images)

    # ------------------------------------------------------------------ loop
    def _run(
        self,
        items: list[tuple[str | None, list[int], SamplingParams]],
        use_tqdm: bool,
        priority: Priority,
        pooling: PoolingParams | None = None,
        images: list[list[ImageInput] | None] | None = None,
    ) -> list[RequestOutput]:
        states: dict[str, RequestOutputState] = {}
        scores: dict[tuple[str, int], CompletionDelta] = {}  # beam search results
        order: list[tuple[str, str | None, list[int]]] = []
        try:
            for i, (text, ids, params) in enumerate(items):
                req_id = f"llm-{next(self._ids)}"
                self.engine.add_request(
                    AddRequest(
                        req_id=req_id,
                        prompt_token_ids=ids,
                        params=params,
                        priority=priority,
                        pooling=pooling,
                        images=images[i] if images else None,
                    )
                )
                states[req_id] = RequestOutputState(req_id, self.tokenizer, params, ids)
                order.append((req_id, text, ids))
        except BaseException:  # refuse the whole batch, leave nothing behind in the engine
            self.engine.abort_requests(list(states))
            self._drain(states)
            raise
        bar = tqdm(total=len(items), desc="Generating", disable=not use_tqdm, unit="req")
        with torch.inference_mode():  # once, not per step (``xengine/runner/inference.py``)
            self._steps(states, scores, bar)
        bar.close()
        outputs = [_to_output(req_id, text, ids, states[req_id]) for req_id, text, ids in order]
        for out in outputs:
            for seq in out.outputs:
                delta = scores.get((out.request_id, seq.index))
                if delta is not None:
                    seq.score, seq.cumulative_logprob = delta.score, delta.cumulative_logprob
        return outputs

    def _steps(
        self, states: dict[str, RequestOutputState], scores: dict[tuple[str, int], CompletionDelta], bar: Any
    ) -> None:
        """Step until every request of ``states`` finished (``scores``: beam search results)."""
        pending = set(states)
        while pending:
            for delta in self.engine.step():
                state = states.get(delta.req_id)
                if state is None or delta.req_id not in pending:
                    continue
                state.process(delta)
                if delta.score is not None:
                    scores[(delta.req_id, delta.index)] = delta
                if state.needs_abort:
                    self.engine.abort_requests([delta.req_id])
                if state.finished:
                    pending.discard(delta.req_id)
                    bar.update(1)

    def _drain(self, states: dict[str, RequestOutputState]) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one token-id prompt
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params


def _to_output(req_id: str, text: str | None, ids: list[int], state: RequestOutputState) -> RequestOutput:
    outputs = []
    for seq in sorted(state.outputs, key=lambda s: s.index):
        logprobs = None
        if seq.logprobs is not None:
            logprobs = []
            for i, tok in enumerate(seq.token_ids):
                entry = {t: lp for t, lp in (seq.top_logprobs[i] if seq.top_logprobs else [])}
                entry[tok] = seq.logprobs[i]
                logprobs.append(entry)
        outputs.append(
            CompletionOutput(
                index=seq.index,
                text=seq.text,
                token_ids=list(seq.token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=logprobs,
                cumulative_logprob=sum(seq.logprobs) if seq.logprobs else None,
            )
        )
    prompt_logprobs = None
    if state.prompt_logprobs is not None:
        p = state.prompt_logprobs
        prompt_logprobs = [None] + [
            {**dict(tops), tok: lp} for tok, lp, tops in zip(ids[1:], p.logprobs, p.top_logprobs)
        ]
    return RequestOutput(
        req_id,
        text,
        ids,
        outputs,
        num_cached_tokens=state.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
        embedding=state.embedding,
    )


def engine_config(model: str, **fields: Any) -> EngineConfig:
    """An ``EngineConfig`` for ``model`` with ``fields`` set by name in whichever section has them."""
    sections: dict[str, dict[str, Any]] = {"model": {"model": str(model)}}
    defaults = EngineConfig()
    owners = {
        f.name: sec.name
        for sec in dataclasses.fields(EngineConfig)
        if sec.name != "speculative_config"  # given whole, as speculative_config={...}
        for f in dataclasses.fields(getattr(defaults, sec.name))
    }
    for name, value in fields.items():
        if name == "speculative_config":  # vLLM's dict (or a SpeculativeConfig): a section of its own
            spec = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            sections[name] = dict(spec or {})
            continue
        if name == "async_scheduling" and isinstance(value, bool):
            value = "on" if value else "off"
        if name not in owners or name == "model":
            raise TypeError(f"LLM() got an unknown engine field {name!r}; valid: {', '.join(sorted(owners))}")
        sections.setdefault(owners[name], {})[name] = value
    return from_dict(EngineConfig, sections)
