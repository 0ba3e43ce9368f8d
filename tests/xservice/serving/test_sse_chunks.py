"""The pre-encoded token chunks of streamed completions and chat are byte for byte what the response
models give (``sse(dump(...))``), for any text, finish and stop reason, so clients see the same stream."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from xservice.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    dump,
)
from xservice.serving.sse_chunks import ChatChunks, CompletionChunks
from xservice.serving.streaming import sse

CREATED = re.compile(r'"created":\d+,')
TEXTS = [
    "",
    "hello",
    ' "quoted" \\ back/slash',
    "tab\tnew\nline\r\x00\x1f\x7f",
    "é 日本語 😀",
    "\u2028\u2029</script>",
]
FINISH = [None, "stop", "length", "abort", "error", "tool_calls"]
STOP = [None, 0, 151645, "</s>", 'say "x"\n']
REQ_ID, MODEL = "cmpl-0123abcd", 'tiny "model" é'

text = st.text() | st.sampled_from(TEXTS)
finish = st.sampled_from(FINISH)
stop = st.sampled_from(STOP) | st.integers(min_value=0, max_value=2**31) | st.text()


def _same_but_created(fast: str, reference: str) -> None:
    """Equal once each event's ``created`` (the clock's second, read separately by each) is masked."""
    assert CREATED.search(fast) is not None
    assert CREATED.sub('"created":0,', fast, count=1) == CREATED.sub('"created":0,', reference, count=1)


def _completion_reference(index: int, text: str, finish_reason, stop_reason) -> str:
    choice = CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason)
    payload = dump(CompletionResponse(id=REQ_ID, model=MODEL, choices=[choice], usage=None))
    for c in payload["choices"]:  # as the completions stream leaves out the null token-id fields
        for key in ("prompt_token_ids", "token_ids"):
            if c.get(key) is None:
                c.pop(key, None)
    return sse(payload)


def _chat_reference(index: int, content: str | None, finish_reason, stop_reason) -> str:
    delta = ChatDelta(content=content, tool_calls=None, reasoning=None, reasoning_content=None)
    choice = ChatChunkChoice(
        index=index, delta=delta, logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason
    )
    return sse(dump(ChatCompletionChunk(id=REQ_ID, model=MODEL, choices=[choice], usage=None)))


@settings(max_examples=300, deadline=None)
@given(index=st.integers(min_value=0, max_value=1000), text=text, finish_reason=finish, stop_reason=stop)
def test_completion_token_chunk_is_the_models_event(
    index: int, text: str, finish_reason, stop_reason
) -> None:
    fast = CompletionChunks(REQ_ID, MODEL).event(index, text, finish_reason, stop_reason)
    _same_but_created(fast, _completion_reference(index, text, finish_reason, stop_reason))


@settings(max_examples=300, deadline=None)
@given(
    index=st.integers(min_value=0, max_value=1000),
    content=st.none() | text,
    finish_reason=finish,
    stop_reason=stop,
)
def test_chat_token_chunk_is_the_models_event(
    index: int, content: str | None, finish_reason, stop_reason
) -> None:
    fast = ChatChunks(REQ_ID, MODEL).event(index, content, finish_reason, stop_reason)
    _same_but_created(fast, _chat_reference(index, content, finish_reason, stop_reason))
