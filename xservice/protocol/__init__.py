"""Request and response bodies of the HTTP API, one module per route family; re-exported here."""

from xservice.protocol.base import APIRequest, APIResponse, dump
from xservice.protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ContentPart,
    TopLogprob,
)
from xservice.protocol.common import (
    CompletionTokensDetails,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TokenizeResponse,
    Usage,
)
from xservice.protocol.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
)
from xservice.protocol.sampling import SamplingRequest, StreamOptions
from xservice.protocol.tokenize import DetokenizeRequest, TokenizeRequest

__all__ = [
    "APIRequest",
    "APIResponse",
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ModelCard",
    "ModelList",
    "PromptInput",
    "PromptLogprob",
    "PromptLogprobs",
    "CompletionTokensDetails",
    "PromptTokensDetails",
    "SamplingRequest",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "TopLogprob",
    "Usage",
    "dump",
]
