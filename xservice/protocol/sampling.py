"""Fields shared by ``/v1/completions`` and ``/v1/chat/completions``: sampling, stopping, streaming.

vLLM-style sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ...) and ``priority`` are
accepted on both endpoints.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import Field, PrivateAttr

from xservice.protocol.base import IGNORED_FIELDS, UNSUPPORTED_FIELDS, APIRequest
from xservice.protocol.structured import ResponseFormat, StructuredOutputsRequest


class StreamOptions(APIRequest):
    ignored_fields: ClassVar[dict[str, str]] = {
        "include_obfuscation": "xllm adds no obfuscation padding to stream events",
    }

    include_usage: bool = False
    # with include_usage: every chunk also carries the usage so far (vLLM's extension)
    continuous_usage_stats: bool = False


class SLORequest(APIRequest):
    """Per-request latency objectives (xllm extension; also the ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``
    headers): dynamic PD routes to meet them and ``xllm_request_slo_total`` counts whether they were."""

    ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class SamplingRequest(APIRequest):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    ignored_fields: ClassVar[dict[str, str]] = IGNORED_FIELDS
    # the server's structured_outputs.disable_additional_properties (``apply_server_options``)
    _closed_objects: bool = PrivateAttr(default=True)
    # the LoRA adapter ``model`` names (``ServingContext.check_model``); None: the base model
    _lora_name: str | None = PrivateAttr(default=None)
    unsupported_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    speculative: bool = True  # xllm's extension: false opts this request out of speculative decoding
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Literal["online", "offline"] = "online"
    slo: SLORequest | None = None  # xllm's extension: this request's TTFT / TPOT objectives
    # vLLM's extension: per prompt token its logprob and the top-k alternatives (not with stream)
    prompt_logprobs: int | None = None
    # vLLM's extension: with logprobs on, each token's alternatives are the chosen token and exactly these
    # ids (not the top-k; ``top_logprobs`` / ``logprobs`` then sets no count)
    logprob_token_ids: list[int] | None = None
    # vLLM's extension: only requests with the same salt share prefix-cache blocks (a tenant's privacy)
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM extensions: token ids in the response, logprob tokens as "token_id:<id>", prompt
    # truncation (keep ``truncate_prompt_tokens`` tokens; -1: the context less one) and detokenization
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool | None = None  # None: the server's (service.return_tokens_as_token_ids)
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    spaces_between_special_tokens: bool = True
    # Token-level constraints (``xservice/serving/structured.py``, ``docs/structured_outputs.md``):
    # OpenAI's response_format, vLLM's structured_outputs and its older guided_* spellings of it;
    # logit_bias {"<token id>": -100..100}, an allow-list, and words never to generate.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Union[dict[str, Any], bool, str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # "auto" or the server's backend ("llguidance")
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` together with ``include_usage`` (as vLLM)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)
