"""``/v1/completions``: prompts (text or ids, one or many) → choices, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xengine.api.messages import CompletionDelta, SamplingParams
from xengine.api.text.output_processor import RequestOutputState, SeqDelta
from xservice.http.errors import InvalidRequestError, from_value_error
from xservice.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    Usage,
    dump,
)
from xservice.protocol.common import PerRequestMetrics
from xservice.serving.context import ServingContext, new_request_id
from xservice.serving.generation import Generation, collect_all
from xservice.serving.logprobs import CompletionLogprobsBuilder, TokenText
from xservice.serving.params import (
    apply_server_options,
    build_sampling_params,
    check_n,
    check_stream_options,
    num_logprobs,
    resolve_max_tokens,
)
from xservice.serving.prompt_embeds import prompt_embeds_of
from xservice.serving.prompt_logprobs import (
    check_prompt_logprobs,
    concat,
    echo_logprobs,
    engine_prompt_logprobs,
    prompt_logprobs_field,
    prompt_only_max_tokens,
)
from xservice.serving.prompts import completion_prompts
from xservice.serving.request_metrics import request_metrics
from xservice.serving.slo import request_slo
from xservice.serving.sse_chunks import CompletionChunks
from xservice.serving.streaming import (
    ClientDisconnected,
    disconnected_response,
    merge_streams,
    run_until_disconnected,
    sse_response,
)
from xservice.serving.structured import check_structured_outputs, constraint_rename
from xservice.serving.truncation import resolve_truncation

MAX_PROMPTS = 64
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
DEFAULT_BEAM_WIDTH = 4


class _ScoredOutputState(RequestOutputState):
    """Keeps each beam-search sequence's score (the engine sends it with the sequence's tokens)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scores: dict[int, tuple[float | None, float | None]] = {}

    def process(self, delta: CompletionDelta) -> SeqDelta | None:
        if delta.score is not None:
            self.scores[delta.index] = (delta.score, delta.cumulative_logprob)
        return super().process(delta)


BEAM_ONLY_FIELDS = frozenset({"beam_width", "num_return_sequences", "length_penalty", "early_stopping"})


def _resolve_beam_fields(body: CompletionRequest, max_beam_width: int) -> CompletionRequest:
    """Check the beam-search extras; ``num_return_sequences`` becomes ``n``."""
    if not body.use_beam_search:
        defaults = {name: type(body).model_fields[name].default for name in BEAM_ONLY_FIELDS}
        given = sorted(n for n in BEAM_ONLY_FIELDS & body.model_fields_set if getattr(body, n) != defaults[n])
        if given:  # never silently ignored: they mean something only with beam search
            raise InvalidRequestError(
                f"'{given[0]}' applies only to beam search; set \"use_beam_search\": true or drop it.",
                param=given[0],
            )
        return body
    nrs = body.num_return_sequences
    if nrs is not None:
        if "n" in body.model_fields_set and body.n != nrs:
            raise InvalidRequestError(
                "'n' and 'num_return_sequences' differ; set one of them.", param="num_return_sequences"
            )
        body = body.model_copy(update={"n": nrs})
    width = body.beam_width if body.beam_width is not None else max(body.n, DEFAULT_BEAM_WIDTH)
    if not 1 <= width <= max_beam_width:
        raise InvalidRequestError(
            f"invalid value for 'beam_width': must be in [1, {max_beam_width}], got {width}",
            param="beam_width",
        )
    if body.n > width:
        raise InvalidRequestError(
            f"invalid value for 'n': at most beam_width ({width}) sequences can be returned, got {body.n}",
            param="n",
        )
    if body.logprobs is not None:
        raise InvalidRequestError("'logprobs' is not supported with beam search.", param="logprobs")
    return body.model_copy(update={"beam_width": width})


def _beam_params(body: CompletionRequest, params: SamplingParams, vocab_size: int) -> SamplingParams:
    params = msgspec.structs.replace(
        params,
        use_beam_search=True,
        beam_width=body.beam_width,
        length_penalty=body.length_penalty,
        early_stopping=body.early_stopping,
        temperature=0.0,
    )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise from_value_error(exc, constraint_rename(body)) from None
    return params


def _check_fields(ctx: ServingContext, body: CompletionRequest) -> None:
    body.logprobs = num_logprobs(body.logprobs, "logprobs", ctx.config.model.max_logprobs, ctx.vocab_size)
    check_prompt_logprobs(body, ctx)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("'best_of' other than 'n' is not supported.", param="best_of")
    if body.suffix:
        raise InvalidRequestError("'suffix' is not supported by this model.", param="suffix")


async def _generations(
    ctx: ServingContext, body: CompletionRequest, req_id: str, arrival: float
) -> tuple[list[Generation], list[str]]:
    """One ``Generation`` per prompt (those given as embeddings first), plus each prompt's text (for ``echo``)."""
    embeds = await prompt_embeds_of(ctx, body, MAX_PROMPTS)
    prompts = [(None, [0] * e.num_tokens) for e in embeds]  # placeholder ids for the embeddings' positions
    if body.prompt is not None:
        prompts += await completion_prompts(
            ctx,
            body.prompt,
            max_prompts=MAX_PROMPTS - len(embeds),
            add_special_tokens=body.add_special_tokens,
            truncation=resolve_truncation(body, ctx.max_model_len),
        )
    await check_structured_outputs(body)  # the grammar sandbox, off the event loop
    gens, texts = [], []
    scores_prompt = body.echo or body.prompt_logprobs is not None
    prompt_logprobs = engine_prompt_logprobs(body.prompt_logprobs, body.logprobs if body.echo else None)
    for i, (text, ids) in enumerate(prompts):
        max_tokens = prompt_only_max_tokens(body.max_tokens, scores_prompt, len(ids), ctx.max_model_len)
        if max_tokens is None:
            max_tokens = resolve_max_tokens(
                body.max_tokens,
                len(ids),
                ctx.max_model_len,
                default=DEFAULT_MAX_TOKENS,
                param="max_tokens",
                where="prompt",
            )
        params = build_sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            vocab_size=ctx.vocab_size,
            prompt_logprobs=prompt_logprobs,
            tokenizer=ctx.tokenizer,
        )
        if body.use_beam_search:
            params = _beam_params(body, params, ctx.vocab_size)
        rename = constraint_rename(body)
        gen = Generation(ctx, f"{req_id}-{i}", ids, params, body.priority, rename=rename, arrival=arrival)
        gen.prompt_embeds = embeds[i] if i < len(embeds) else None
        if body.use_beam_search:
            gen.state = _ScoredOutputState(gen.req_id, ctx.tokenizer, params, ids)
        gens.append(gen)
        if body.echo and text is None:
            text = await ctx.text.decode(ids, skip_special_tokens=False)
        texts.append(text or "")
    return gens, texts


def _usage(gens: list[Generation]) -> Usage:
    return Usage.of(
        prompt_tokens=sum(len(g.prompt_ids) for g in gens),
        completion_tokens=sum(g.num_completion_tokens for g in gens),
        cached_tokens=sum(g.state.num_cached_tokens for g in gens),
    )


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    """Validate, admit and run a completions request."""
    arrival = time.monotonic()
    body._lora_name = ctx.check_model(body.model)
    body = _resolve_beam_fields(body, ctx.config.scheduler.max_beam_width)
    check_n(body.n, ctx.config.service.max_n)
    check_stream_options(body)
    apply_server_options(
        body, ctx.config.service, ctx.config.structured_outputs.disable_additional_properties
    )
    _check_fields(ctx, body)
    req_id = new_request_id("cmpl")
    gens, prompt_texts = await _generations(ctx, body, req_id, arrival)
    slo = request_slo(body, request)
    for gen in gens:
        gen.slo = slo
    ticket = ctx.admit()
    if body.stream:
        return sse_response(_stream(ctx, body, req_id, gens, prompt_texts), ticket, ctx.metrics)
    try:
        await run_until_disconnected(request, collect_all(gens))
    except ClientDisconnected:
        return disconnected_response()
    finally:
        ticket.release()
    return JSONResponse(dump(_response(ctx, body, req_id, gens, prompt_texts)))


def _response(
    ctx: ServingContext, body: CompletionRequest, req_id: str, gens: list[Generation], prompt_texts: list[str]
) -> CompletionResponse:
    token_text = TokenText(ctx.tokenizer, body.return_tokens_as_token_ids)
    choices = []
    for i, gen in enumerate(gens):
        prefix = prompt_texts[i] if body.echo else ""
        scores = gen.state.scores if isinstance(gen.state, _ScoredOutputState) else {}
        for out in gen.outputs:
            score, cumulative = scores.get(out.index, (None, None))
            logprobs = None
            if body.logprobs is not None:
                builder = CompletionLogprobsBuilder(token_text)
                echoed = _echo_logprobs(body, builder, gen) if body.echo else None
                logprobs = builder.build(out.token_ids, out.logprobs, out.top_logprobs)
                logprobs = concat(echoed, logprobs) if echoed is not None else logprobs
            choices.append(
                CompletionChoice(
                    index=i * body.n + out.index,
                    text=prefix + out.text,
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    score=score,
                    cumulative_logprob=cumulative,
                    prompt_token_ids=gen.prompt_ids if body.return_token_ids else None,
                    token_ids=out.token_ids if body.return_token_ids else None,
                    prompt_logprobs=_prompt_logprobs(body, token_text, gen),
                )
            )
    return CompletionResponse(
        id=req_id,
        model=body._lora_name or ctx.model_name,
        choices=choices,
        usage=_usage(gens),
        metrics=request_metrics(ctx, gens),
    )


def _echo_logprobs(
    body: CompletionRequest, builder: CompletionLogprobsBuilder, gen: Generation
) -> CompletionLogprobs:
    assert gen.state.prompt_logprobs is not None and body.logprobs is not None
    return echo_logprobs(builder, gen.prompt_ids, gen.state.prompt_logprobs, body.logprobs)


def _prompt_logprobs(
    body: CompletionRequest, token_text: TokenText, gen: Generation
) -> PromptLogprobs | None:
    if body.prompt_logprobs is None or gen.state.prompt_logprobs is None:
        return None
    return prompt_logprobs_field(token_text, gen.prompt_ids, gen.state.prompt_logprobs, body.prompt_logprobs)


class _StreamTokenIds:
    """vLLM's per-chunk extras of a streamed completion: with ``return_token_ids`` the prompt's ids
    on each choice's first chunk and every chunk's own ids; with ``continuous_usage_stats`` the usage
    so far on every chunk."""

    def __init__(self, body: CompletionRequest, gens: list[Generation]) -> None:
        self.body = body
        self.gens = gens
        self.num_tokens: dict[int, int] = {}  # choice index -> tokens streamed so far
        self.started: set[int] = set()  # choices whose first chunk went out
        # whether a chunk with tokens but no text still goes out (it has ids or usage to report)
        self.wanted = body.return_token_ids or body.continuous_usage

    def count(self, index: int, token_ids: list[int]) -> None:
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(token_ids)

    def fill(self, choice: CompletionChoice, prompt_index: int, token_ids: list[int]) -> CompletionChoice:
        if self.body.return_token_ids:
            choice.token_ids = list(token_ids)
            if choice.index not in self.started:
                choice.prompt_token_ids = self.gens[prompt_index].prompt_ids
        self.started.add(choice.index)
        return choice

    def usage(self, prompt_index: int, index: int) -> Usage | None:
        """Usage of choice ``index`` (of prompt ``prompt_index``) so far; ``index`` -1: before any token."""
        if not self.body.continuous_usage:
            return None
        gen = self.gens[prompt_index]
        return Usage.of(len(gen.prompt_ids), self.num_tokens.get(index, 0), gen.state.num_cached_tokens)

    @staticmethod
    def strip(chunk: dict[str, Any]) -> dict[str, Any]:
        """Leave the token-id fields out of chunks that do not carry them (they are null otherwise)."""
        for choice in chunk["choices"]:
            for key in ("prompt_token_ids", "token_ids"):
                if choice.get(key) is None:
                    choice.pop(key, None)
        return chunk


async def _stream(
    ctx: ServingContext, body: CompletionRequest, req_id: str, gens: list[Generation], prompt_texts: list[str]
) -> AsyncIterator[dict[str, Any] | str]:
    """Chunk dicts of a streamed completion (the SSE framing is added by ``sse_response``); plain
    token chunks come encoded already (``sse_chunks.py``: the per-token work stays small)."""

    ids = _StreamTokenIds(body, gens)
    plain = (
        None if ids.wanted else CompletionChunks(req_id, body._lora_name or ctx.model_name)
    )  # no ids or usage per chunk

    def chunk(
        choices: list[CompletionChoice], usage: Usage | None = None, metrics: PerRequestMetrics | None = None
    ) -> dict[str, Any]:
        return ids.strip(
            dump(
                CompletionResponse(
                    id=req_id,
                    model=body._lora_name or ctx.model_name,
                    choices=choices,
                    usage=usage,
                    metrics=metrics,
                )
            )
        )

    token_text = TokenText(ctx.tokenizer, body.return_tokens_as_token_ids)
    builders: dict[int, CompletionLogprobsBuilder] = {}
    echo_later: set[int] = set()  # echo + logprobs: each choice's echo waits for the prompt's logprobs
    if body.echo and body.logprobs is not None:
        echo_later = {i * body.n + j for i in range(len(gens)) for j in range(body.n)}
    elif body.echo:
        for i, text in enumerate(prompt_texts):
            choices = [CompletionChoice(index=i * body.n + j, text=text) for j in range(body.n)]
            yield chunk([ids.fill(c, i, []) for c in choices], usage=ids.usage(i, -1))
    async for i, delta in merge_streams([g.stream() for g in gens]):
        index = i * body.n + delta.index
        if index in echo_later:  # a choice's first delta comes once its prompt is computed
            echo_later.discard(index)
            builder = builders.setdefault(index, CompletionLogprobsBuilder(token_text))
            echoed = CompletionChoice(
                index=index, text=prompt_texts[i], logprobs=_echo_logprobs(body, builder, gens[i])
            )
            yield chunk([ids.fill(echoed, i, [])], usage=ids.usage(i, -1))
        logprobs = None
        if body.logprobs is not None:
            builder = builders.setdefault(index, CompletionLogprobsBuilder(token_text))
            logprobs = builder.build(delta.token_ids, delta.logprobs, delta.top_logprobs)
        ids.count(index, delta.token_ids)
        shows_tokens = (logprobs is not None and logprobs.tokens) or (delta.token_ids and ids.wanted)
        if not delta.text and delta.finish_reason is None and not shows_tokens:
            continue
        if plain is not None and logprobs is None:
            yield plain.event(index, delta.text, delta.finish_reason, delta.stop_reason)
            continue
        choice = CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        yield chunk([ids.fill(choice, i, delta.token_ids)], usage=ids.usage(i, index))
    if body.include_usage:
        yield chunk([], usage=_usage(gens), metrics=request_metrics(ctx, gens))
