"""The per-token events of a streamed completion or chat completion, encoded without response models.

Every token of every stream passes through here, so a stream's constant parts (``id``, ``object``,
``model``) are encoded once per request and a plain token chunk (text and finish only: no logprobs,
token ids, tool calls, reasoning or usage on it) is formatted directly: under a microsecond, where
building the pydantic models, dumping and JSON-encoding them took 11 (completions) to 15 µs (chat).
The result is byte for byte the event ``sse(dump(...))`` gives for the same chunk
(``tests/xservice/serving/test_sse_chunks.py`` holds the two side by side); chunks with anything more
take that general path. ``benchmarks/front_door.py`` measures the service's CPU per streamed token.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) uses for a str

from xservice.protocol.base import now


def _scalar(value: int | str | None) -> str:
    """A JSON scalar as ``json.dumps(value, ensure_ascii=False)`` writes it."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))


class CompletionChunks:
    """Plain token chunks of one streamed ``/v1/completions`` response (``CompletionResponse`` with one
    ``CompletionChoice`` and no usage), as complete SSE events."""

    def __init__(self, req_id: str, model: str) -> None:
        self._head = 'data: {"id":' + encode_basestring(req_id) + ',"object":"text_completion","created":'
        self._model = ',"model":' + encode_basestring(model) + ',"choices":[{"index":'

    def event(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        return (
            f'{self._head}{now()}{self._model}{index},"text":{encode_basestring(text)},"logprobs":null,'
            f'"finish_reason":{_scalar(finish_reason)},"stop_reason":{_scalar(stop_reason)},'
            '"prompt_logprobs":null}],"usage":null}\n\n'
        )


class ChatChunks:
    """Plain token chunks of one streamed ``/v1/chat/completions`` response (``ChatCompletionChunk`` with
    one choice whose delta holds at most ``content``, and no usage), as complete SSE events."""

    def __init__(self, req_id: str, model: str) -> None:
        self._head = (
            'data: {"id":' + encode_basestring(req_id) + ',"object":"chat.completion.chunk","created":'
        )
        self._model = ',"model":' + encode_basestring(model) + ',"choices":[{"index":'

    def event(
        self, index: int, content: str | None, finish_reason: str | None, stop_reason: int | str | None
    ) -> str:
        delta = "{}" if content is None else '{"content":' + encode_basestring(content) + "}"
        return (
            f'{self._head}{now()}{self._model}{index},"delta":{delta},"logprobs":null,'
            f'"finish_reason":{_scalar(finish_reason)},"stop_reason":{_scalar(stop_reason)}}}],"usage":null}}\n\n'
        )
