"""A chat choice's output text → its message: the echoed prefix, the reasoning split out (with a
reasoning parser), then tool calls parsed out of the content that is left.

Non-streaming messages are the streamed events added up (one parser per choice either way), so a
stream's deltas reassemble into exactly the non-streamed message (call ids aside).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from xservice.http.errors import InvalidRequestError
from xservice.protocol import ChatCompletionRequest, ChatResponseMessage
from xservice.protocol.tools import DeltaFunction, DeltaToolCall, ToolCall, ToolCallFunction
from xservice.serving.chat_render import ChatRender, chat_render_of
from xservice.serving.prompts import message_dicts
from xservice.serving.reasoning.registry import ReasoningPlan, plan_reasoning
from xservice.serving.reasoning.splitter import ThinkSplitter
from xservice.serving.text_workers import INLINE_MAX_COST
from xservice.serving.tools.base import BaseToolParser, CallStart, ParsedOutput, TextDelta, ToolEvent
from xservice.serving.tools.plan import ToolPlan, plan_tools

if TYPE_CHECKING:
    from xservice.serving.context import ServingContext


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the model stopped after calling tools; a cut-off keeps ``length``."""
    return "tool_calls" if has_calls and reason == "stop" else reason


@dataclass(frozen=True)
class ChatOutput:
    """The per-request rules: ``echo`` (the continued message's text, prefixed), the tool plan and the
    reasoning plan (None: the output is not split)."""

    plan: ToolPlan
    echo: str = ""
    reasoning: ReasoningPlan | None = None

    def message(self, text: str, reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """The whole message of a choice whose output is ``text`` and its finish reason."""
        text = self.echo + text
        if self.reasoning is None:
            return self._content_message(text, reason)
        thinking, content = self.reasoning.split(text)
        message, reason = self._content_message(content or "", reason)
        if content is None and not message.tool_calls:
            message.content = None  # as vLLM: the output stopped right after (or inside) the reasoning
        message.reasoning = message.reasoning_content = thinking
        return message, reason

    def _content_message(self, text: str, reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        parser = self.plan.new_parser()
        if parser is None:
            return ChatResponseMessage(content=text), reason
        out = ParsedOutput()
        out.add(parser.feed(text))
        out.add(parser.finish())
        calls = [
            ToolCall(id=c.call_id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            for c in out.calls
        ]
        content = out.content if out.content is not None or calls else ""
        return ChatResponseMessage(content=content, tool_calls=calls or None), finish_reason(
            reason, bool(calls)
        )

    def choice_stream(self) -> ChoiceStream:
        splitter = self.reasoning.new_splitter() if self.reasoning is not None else None
        include = self.reasoning is None or self.reasoning.include
        return ChoiceStream(self.plan.new_parser(), splitter, include)


class ChoiceStream:
    """One streamed choice: text deltas in, (content, tool-call deltas, finish reason) out; with a
    reasoning splitter, the reasoning text of the step is in ``reasoning`` after each ``step``."""

    def __init__(
        self, parser: BaseToolParser | None, splitter: ThinkSplitter | None = None, include: bool = True
    ) -> None:
        self.parser = parser
        self.splitter = splitter
        self.include = include  # include_reasoning
        self.has_calls = False
        self.reasoning: str | None = None

    def step(
        self, text: str, reason: str | None = None
    ) -> tuple[str | None, list[DeltaToolCall] | None, str | None]:
        if self.splitter is not None:
            pieces = self.splitter.feed(text) + (self.splitter.finish() if reason is not None else [])
            thinking = "".join(t for part, t in pieces if part == "reasoning")
            self.reasoning = (thinking or None) if self.include else None
            text = "".join(t for part, t in pieces if part == "content")
        if self.parser is None:
            return text or None, None, reason
        events = self.parser.feed(text)
        if reason is not None:
            events += self.parser.finish()
        content, calls = chat_deltas(events)
        self.has_calls = self.has_calls or bool(calls)
        return content, calls, finish_reason(reason, self.has_calls)


def chat_deltas(events: list[ToolEvent]) -> tuple[str | None, list[DeltaToolCall] | None]:
    """Parser events as one chat delta: the content and the tool-call deltas (a call's pieces merged)."""
    texts: list[str] = []
    calls: list[DeltaToolCall] = []
    for event in events:
        if isinstance(event, TextDelta):
            texts.append(event.text)
        elif isinstance(event, CallStart):
            fn = DeltaFunction(name=event.name, arguments="")
            calls.append(DeltaToolCall(index=event.index, id=event.call_id, type="function", function=fn))
        elif calls and calls[-1].index == event.index and calls[-1].function is not None:
            calls[-1].function.arguments = (calls[-1].function.arguments or "") + event.text
        else:
            calls.append(DeltaToolCall(index=event.index, function=DeltaFunction(arguments=event.text)))
    return "".join(texts) or None, calls or None


async def chat_options(ctx: ServingContext, body: ChatCompletionRequest) -> tuple[ChatRender, ChatOutput]:
    """The request's template options (tools included) and output rules; 400s name the field."""
    render = await chat_render_of(ctx, body)
    functions = [tool.function for tool in body.tools or []]
    plan = await ctx.text.run(  # on a worker with tools: their schemas are copied and may be compiled
        INLINE_MAX_COST + 1 if functions else 0,
        plan_tools,
        functions,
        body.tool_choice,
        body.parallel_tool_calls,
        ctx.tool_family,
        render.template_vars,
    )
    echo = ""
    if body.echo:
        if not body.continue_final_message:
            raise InvalidRequestError(
                "'echo' returns the continued final message with the completion; it needs "
                '"continue_final_message": true.',
                param="echo",
            )
        echo = _echo_text(ctx, body)
    reasoning = plan_reasoning(ctx.reasoning_family, body.chat_template_kwargs, body.include_reasoning)
    if reasoning is not None and (plan.structured is not None or _json_or_choice_constraint(body)):
        # The constraint covers the whole output from its first token, leaving no room to think, and
        # splitting would file the constrained text (which opens no <think>) as reasoning. A regex or
        # grammar may spell the tags out: its output is split as usual.
        reasoning = replace(reasoning, thinking=False)
    return render.with_tools(plan.tools), ChatOutput(plan, echo, reasoning)


def _echo_text(ctx: ServingContext, body: ChatCompletionRequest) -> str:
    """The continued final message's text; with a vision-language model its parts reach the template as
    a list (images as placeholders), rendered one after the other, so its text parts are joined as is."""
    if not body.messages:
        return ""
    last = len(body.messages) - 1  # only the last message is converted (a long conversation stays cheap)
    images = [] if ctx.images is not None else None
    content = message_dicts(body.messages[last:], images, start=last)[0]["content"]
    if isinstance(content, list):
        return "".join(p["text"] for p in content if p["type"] == "text")
    return content


def _json_or_choice_constraint(body: ChatCompletionRequest) -> bool:
    """Whether the request constrains its output to JSON or to one of a list of choices."""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text":
        return True
    if so is not None and (so.json_ is not None or so.json_object or so.choice is not None):
        return True
    return body.guided_json is not None or body.guided_choice is not None
