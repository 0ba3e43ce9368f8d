"""One engine request: send it, detokenize its deltas, stop it early, observe its latencies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from xengine.api.messages import AddRequest, PoolingParams, Priority, RequestSLO, SamplingParams
from xengine.api.multimodal import ImageInput
from xengine.api.prompt_embeds import PromptEmbeds
from xengine.api.text.output_processor import RequestOutputState, SeqDelta, SeqOutput
from xservice.engine.errors import EngineDeadError
from xservice.http.errors import APIError, EngineUnavailableError, InternalError, from_value_error
from xservice.http.metrics import RequestTimer
from xservice.serving.context import ServingContext
from xservice.serving.slo import slo_met
from xservice.serving.trace_record import TraceRecord


class Generation:
    """Run one ``AddRequest`` and turn its engine deltas into text deltas.

    Iterate ``stream()`` (or await ``collect()``); errors surface as ``APIError``. Whenever the
    consumer stops before the request finished (client gone, cancellation), the engine request is
    aborted, so its KV blocks are freed within a step.
    """

    def __init__(
        self,
        ctx: ServingContext,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: Priority = "online",
        rename: dict[str, str] | None = None,
        arrival: float | None = None,
        pooling: PoolingParams | None = None,
        slo: RequestSLO | None = None,
    ) -> None:
        self.ctx = ctx
        self.req_id = req_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.priority = priority
        self.rename = rename  # engine field name -> API field name, for engine-side 400s
        self.arrival = time.monotonic() if arrival is None else arrival  # when the HTTP request came in
        self.pooling = pooling  # an embedding request (``state.embedding`` once finished)
        self.slo = slo  # its own TTFT / TPOT objectives (``xservice/serving/slo.py``)
        self.state = RequestOutputState(req_id, ctx.tokenizer, params, prompt_ids)
        self.images: list[ImageInput] | None = None  # a multimodal prompt's images (``serving/images.py``)
        self.prompt_embeds: PromptEmbeds | None = None  # a prompt given as embeddings (its ids: placeholders)
        # timing (time.monotonic()): per-request metrics (``serving/request_metrics.py``)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.queue_time_s: float | None = None

    @property
    def outputs(self) -> list[SeqOutput]:
        return self.state.outputs

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.state.outputs)

    async def stream(self) -> AsyncIterator[SeqDelta]:
        """Yield each sequence's text deltas until all ``n`` sequences finished."""
        ctx = self.ctx
        timer = RequestTimer(ctx.metrics, self.arrival)
        ctx.metrics.prompt_tokens.inc(len(self.prompt_ids))
        if self.images:
            ctx.metrics.prompt_images.inc(len(self.images))
            ctx.metrics.prompt_image_tokens.inc(sum(im.length for im in self.images))
        req = AddRequest(
            req_id=self.req_id,
            prompt_token_ids=self.prompt_ids,
            params=self.params,
            priority=self.priority,
            arrival_time=time.time(),
            pooling=self.pooling,
            slo=self.slo,
            images=self.images,
            prompt_embeds=self.prompt_embeds,
        )
        deltas = ctx.engine_client.generate(req)
        try:
            async for delta in deltas:
                timer.on_tokens(delta.index, len(delta.new_token_ids))
                if delta.new_token_ids:
                    self.last_token_at = time.monotonic()
                    self.first_token_at = self.first_token_at or self.last_token_at
                if delta.queue_time_s is not None:
                    timer.on_scheduled(delta.queue_time_s)
                    self.queue_time_s = delta.queue_time_s
                out = self.state.process(delta)
                if self.state.error is not None:
                    raise self._engine_error(self.state.error)
                if out is not None:
                    yield out
                # only a stop string stops a sequence here before the engine does: without stop
                # strings the per-token scan of the sequences is skipped
                if self.params.stop and self.state.needs_abort:
                    await ctx.engine_client.abort([self.req_id])
                if self.state.finished:
                    break
        except EngineDeadError as exc:
            raise EngineUnavailableError(f"The engine stopped while serving this request: {exc}") from None
        finally:
            await deltas.aclose()  # aborts the engine request if it is still running
        self._record_success(timer)

    async def collect(self) -> list[SeqOutput]:
        """Run to completion and return every sequence's cumulative output."""
        async for _ in self.stream():
            pass
        return self.state.outputs

    def _engine_error(self, message: str) -> APIError:
        if "invalid value for" in message:
            return from_value_error(ValueError(message), self.rename)
        return InternalError(f"The engine failed this request: {message}")

    def _record_success(self, timer: RequestTimer) -> None:
        outputs = self.state.outputs
        ttft, tpot = timer.finish(max((len(o.token_ids) for o in outputs), default=0))
        m = self.ctx.metrics
        if self.slo is not None:
            m.slo.labels(result="met" if slo_met(self.slo, ttft, tpot) else "missed").inc()
        for o in outputs:
            m.success.labels(finished_reason=o.finish_reason or "unknown").inc()
            m.request_generation_tokens.observe(len(o.token_ids))
        m.request_prompt_tokens.observe(len(self.prompt_ids))
        m.prompt_tokens_cached.inc(self.state.num_cached_tokens)
        m.request_params_n.observe(self.params.n)
        if self.params.max_tokens is not None:
            m.request_params_max_tokens.observe(self.params.max_tokens)
        if self.ctx.trace is not None:
            self.ctx.trace.record(
                TraceRecord(
                    arrival=time.time() - (time.monotonic() - self.arrival),
                    prompt_tokens=len(self.prompt_ids),
                    output_tokens=max((len(o.token_ids) for o in outputs), default=0),
                    n=self.params.n,
                    cached_tokens=self.state.num_cached_tokens,
                    ttft_s=ttft,
                    tpot_s=tpot,
                )
            )


async def collect_all(generations: list[Generation]) -> list[list[SeqOutput]]:
    """Run several generations concurrently; the first failure cancels (and aborts) the rest."""
    tasks = [asyncio.ensure_future(g.collect()) for g in generations]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
