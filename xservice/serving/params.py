"""Turn an API request into validated engine ``SamplingParams`` (every failure is a 400)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xengine.api.messages import SamplingParams
from xservice.http.errors import InvalidRequestError, from_value_error
from xservice.protocol import SamplingRequest
from xservice.protocol.sampling import StreamOptions
from xservice.serving.structured import constraints

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.config import ServiceConfig


def check_n(n: int, max_n: int) -> None:
    if not 1 <= n <= max_n:
        raise InvalidRequestError(
            f"invalid value for 'n': must be an integer in [1, {max_n}], got {n}", param="n"
        )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, *, default: int | None, param: str, where: str
) -> int:
    """The number of tokens to generate; 400 when prompt + completion exceed the context.

    ``default`` None means "the rest of the context" (chat); ``where`` names the prompt part
    ("prompt" or "messages") in the error message.
    """
    if requested is not None and requested < 1:
        raise InvalidRequestError(
            f"invalid value for '{param}': must be a positive integer, got {requested}", param=param
        )
    max_tokens = requested if requested is not None else default
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len or max_tokens < 1:
        asked = prompt_len + max(max_tokens, 0)
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {asked} tokens "
            f"({prompt_len} in the {where}, {max(max_tokens, 0)} in the completion). Please reduce the length of the "
            f"{where} or completion.",
            param=param if requested is not None else where,
            code="context_length_exceeded",
        )
    return max_tokens


def check_stream_options(body: SamplingRequest) -> None:
    """400 for ``stream_options`` without ``stream`` (as OpenAI and vLLM): they would have no effect."""
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )


def apply_server_options(body: SamplingRequest, service: ServiceConfig, closed_objects: bool = True) -> None:
    """vLLM's server-wide options of a generation request: ``--return-tokens-as-token-ids`` and
    ``structured_outputs.disable_additional_properties`` (``closed_objects``) where the request does not
    say, and ``--enable-force-include-usage`` (usage on every chunk of a stream and a final usage chunk,
    whatever its ``stream_options``)."""
    if body.return_tokens_as_token_ids is None:
        body.return_tokens_as_token_ids = service.return_tokens_as_token_ids
    body._closed_objects = closed_objects
    if service.enable_force_include_usage and body.stream:
        body.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)


def num_logprobs(value: int | None, name: str, max_logprobs: int, vocab_size: int) -> int | None:
    """A request's count of alternatives per token (``-1``: the whole vocabulary, as vLLM), checked
    against ``model.max_logprobs`` (``--max-logprobs``; -1: the vocabulary's size); a 400 naming ``name``."""
    if value is None:
        return None
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    n = vocab_size if value == -1 else value
    if not 0 <= n <= cap:
        whole = "" if value != -1 else f" (-1: the whole vocabulary, {vocab_size} tokens)"
        raise InvalidRequestError(
            f"invalid value for '{name}': must be in [0, {cap}] or -1 for the whole vocabulary, got {value}"
            f"{whole}; the server's --max-logprobs sets the limit",
            param=name,
        )
    return n


def _or(value, default):
    return default if value is None else value


def build_sampling_params(
    body: SamplingRequest,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    rename: dict[str, str] | None = None,
    prompt_logprobs: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """Engine sampling params from ``body``; ``rename`` maps engine field names to API names for errors.
    ``tokenizer`` tokenizes ``bad_words`` (token-level constraints: ``xservice/serving/structured.py``)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    limits = constraints(body, tokenizer)
    params = SamplingParams(
        n=body.n,
        temperature=_or(body.temperature, 1.0),
        top_p=_or(body.top_p, 1.0),
        top_k=_or(body.top_k, 0),
        min_p=_or(body.min_p, 0.0),
        seed=body.seed,
        repetition_penalty=_or(body.repetition_penalty, 1.0),
        presence_penalty=_or(body.presence_penalty, 0.0),
        frequency_penalty=_or(body.frequency_penalty, 0.0),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        speculative=body.speculative,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured_outputs=limits.structured_outputs,
        logit_bias=limits.logit_bias,
        allowed_token_ids=limits.allowed_token_ids,
        bad_words_token_ids=limits.bad_words_token_ids,
        logprob_token_ids=body.logprob_token_ids,
        lora_name=body._lora_name,
        cache_salt=body.cache_salt,
    )
    try:
        params.validate(vocab_size, max_logprobs=-1)  # the counts were checked against the server's limit
    except ValueError as exc:
        raise from_value_error(exc, {**limits.rename, **(rename or {})}) from None
    return params
