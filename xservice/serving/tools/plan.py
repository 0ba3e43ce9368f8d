"""One request's tool plan: validate ``tools`` / ``tool_choice``, decide what the chat template gets,
how the output is parsed and whether decoding is constrained.

- no tools, or ``tool_choice`` "none": tools are not rendered and the output is plain content
  (OpenAI: "none" means the model will not call a tool; not offering them makes that certain);
- "auto" (the default with tools): tools rendered, the model's family parser finds calls in the
  output; ``strict`` tools add a structural tag so an opened call follows its schema;
- "required" / a named tool: tools rendered, decoding constrained to a JSON array of calls
  (``constraint.forced_calls_schema``; a named tool: exactly one call of it).
``parallel_tool_calls: false`` keeps at most one call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import msgspec

from xengine.api.grammar import GrammarSpec, check_spec, grammar_spec
from xengine.api.messages import SamplingParams, StructuredOutputsParams
from xservice.http.errors import InvalidRequestError
from xservice.protocol.tools import FunctionDefinition, NamedToolChoice, ToolChoice
from xservice.serving.tools.base import BaseToolParser
from xservice.serving.tools.constraint import forced_calls_constraint
from xservice.serving.tools.json_array import JsonArrayToolParser
from xservice.serving.tools.registry import ToolParserFamily

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MAX_TOOLS = 128

# ``param(i, field)``: how a 400 names field ``field`` of tool ``i`` (the two APIs nest differently)
ParamOf = Callable[[int, str], str]


def chat_param(i: int, field: str) -> str:
    return f"tools.{i}" if field == "type" else f"tools.{i}.function.{field}"


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["none", "auto", "forced"]
    tools: list[dict[str, Any]] | None = None  # for the chat template (OpenAI-shaped dicts)
    max_calls: int | None = None
    structured: StructuredOutputsParams | None = None  # the decoding constraint, if any
    family: ToolParserFamily | None = None

    def new_parser(self) -> BaseToolParser | None:
        """A parser for one choice's output; None when the output is plain content."""
        if self.mode == "forced":
            return JsonArrayToolParser(self.max_calls)
        if self.mode == "auto" and self.family is not None:
            return self.family.make_parser(self.max_calls)
        return None


NO_TOOLS = ToolPlan(mode="none")


def check_functions(functions: list[FunctionDefinition], param: ParamOf) -> None:
    """400 naming the field for a bad name, a duplicate name or parameters that are no object schema."""
    if len(functions) > MAX_TOOLS:
        raise InvalidRequestError(
            f"At most {MAX_TOOLS} tools per request, got {len(functions)}.", param="tools"
        )
    seen: set[str] = set()
    for i, fn in enumerate(functions):
        if not _NAME.fullmatch(fn.name):
            raise InvalidRequestError(
                f"Invalid function name {fn.name!r}: use 1 to 64 of a-z, A-Z, 0-9, '_' and '-'.",
                param=param(i, "name"),
            )
        if fn.name in seen:
            raise InvalidRequestError(f"Duplicate function name {fn.name!r}.", param=param(i, "name"))
        seen.add(fn.name)
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(
                '\'parameters\' must be a JSON schema of an object ("type": "object").',
                param=param(i, "parameters"),
            )


def rendered_tools(functions: list[FunctionDefinition]) -> list[dict[str, Any]]:
    """Tools as chat templates expect them: ``{"type": "function", "function": {name, description, parameters}}``."""
    out = []
    for fn in functions:
        body = fn.model_dump(exclude_none=True, exclude={"strict"})
        out.append({"type": "function", "function": body})
    return out


def plan_tools(
    functions: list[FunctionDefinition] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    family: ToolParserFamily | None,
    template_vars: frozenset[str],
    param: ParamOf = chat_param,
) -> ToolPlan:
    """Validate and decide; every refusal is a 400 naming the field."""
    functions = functions or []
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if not functions:
        if choice not in ("none", "auto"):
            raise InvalidRequestError("'tool_choice' needs 'tools'.", param="tool_choice")
        return NO_TOOLS
    check_functions(functions, param)
    if choice == "none":
        return NO_TOOLS
    if "tools" not in template_vars:
        raise InvalidRequestError(
            "This model's chat template does not render tools; send a 'chat_template' that does.",
            param="tools",
        )
    tools = rendered_tools(functions)
    max_calls = None if parallel_tool_calls else 1
    if isinstance(choice, NamedToolChoice):
        named = [t for t, fn in zip(tools, functions) if fn.name == choice.function.name]
        if not named:
            raise InvalidRequestError(
                f"'tool_choice' names the function {choice.function.name!r}, which is not among 'tools'.",
                param="tool_choice",
            )
        return ToolPlan("forced", tools, 1, checked(forced_calls_constraint(named, 1), "tools"))
    if choice == "required":
        return ToolPlan(
            "forced", tools, max_calls, checked(forced_calls_constraint(tools, max_calls), "tools")
        )
    if family is None:
        raise InvalidRequestError(
            "This server has no tool-call parser for this model, so 'tool_choice' \"auto\" cannot find calls "
            "(set service.tool_call_parser); 'required' or a named tool work without one.",
            param="tool_choice",
        )
    structured = None
    if any(fn.strict for fn in functions):
        if family.strict_constraint is None:
            raise InvalidRequestError(
                f"'strict' tools with 'tool_choice' \"auto\" are not supported by the {family.name} parser; "
                "use 'required' or a named tool.",
                param=param(next(i for i, fn in enumerate(functions) if fn.strict), "strict"),
            )
        structured = family.strict_constraint(tools_with_strict(tools, functions))
        try:
            structured.validate()
        except ValueError as exc:  # e.g. the engine's backend does not take structural tags (yet)
            raise InvalidRequestError(
                f"'strict' tools with 'tool_choice' \"auto\" need a structural tag constraint: {exc}. "
                "Use 'required' or a named tool, or drop 'strict'.",
                param=param(next(i for i, fn in enumerate(functions) if fn.strict), "strict"),
            ) from None
    return ToolPlan("auto", tools, max_calls, structured, family)


def tools_with_strict(
    tools: list[dict[str, Any]], functions: list[FunctionDefinition]
) -> list[dict[str, Any]]:
    return [
        {**t, "function": {**t["function"], "strict": bool(fn.strict)}} for t, fn in zip(tools, functions)
    ]


def checked(structured: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """``structured`` if the engine's grammar backend can compile it, else a 400 naming ``param``."""
    try:
        structured.validate()
        _check_spec(grammar_spec(structured))
    except ValueError as exc:
        raise InvalidRequestError(
            f"The tools' parameter schemas cannot constrain the calls: {exc}", param=param
        ) from None
    return structured


@lru_cache(maxsize=256)
def _check_spec(spec: GrammarSpec) -> None:
    """``check_spec``, remembered for valid specs (clients send the same tools again and again)."""
    check_spec(spec)


def constrain(params: SamplingParams, structured: StructuredOutputsParams | None) -> SamplingParams:
    """``params`` with the tool plan's decoding constraint; 400 when the request has another one."""
    if structured is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError(
            "Tool calls with 'tool_choice' \"required\", a named tool or 'strict' tools constrain the output "
            "themselves; they cannot be combined with 'response_format' or other structured outputs.",
            param="tool_choice",
        )
    return msgspec.structs.replace(params, structured_outputs=structured)
