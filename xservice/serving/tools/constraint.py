"""Structured-output constraints that make tool calls valid by construction.

``tool_choice`` "required" or a named tool: the whole output is constrained to a JSON array of
call objects ``{"name": <one of the tools>, "arguments": <that tool's parameters schema>}`` (at
least one; at most one without ``parallel_tool_calls`` or for a named tool), compact (no free
whitespace), parsed back by ``JsonArrayToolParser``. A JSON schema is the constraint every structured-output backend accepts,
and one format serves every model family; the model still sees its tools through its own template.

``strict`` tools with ``tool_choice`` "auto": the model may write text, but once it opens a call
in its family's syntax, the call must follow the schema: a structural tag (begin / schema / end
per tool, triggered by the family's call tag), as xgrammar and vLLM define it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from xengine.api.messages import StructuredOutputsParams

_DEFS_KEYS = ("$defs", "definitions")


def arguments_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The schema a call's arguments must follow: the tool's parameters (an object schema)."""
    if not parameters:
        return {"type": "object"}
    return parameters if "type" in parameters else {"type": "object", **parameters}


def _hoist_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its local definitions moved into ``defs`` (names prefixed) and its references
    rewritten, so several tools' schemas can sit inside one document whose root is elsewhere."""
    root_name = f"{prefix}__root"
    body = {k: v for k, v in schema.items() if k not in _DEFS_KEYS}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str):
                if ref == "#":
                    defs.setdefault(root_name, None)
                    out["$ref"] = f"#/$defs/{root_name}"
                for key in _DEFS_KEYS:
                    if ref.startswith(f"#/{key}/"):
                        out["$ref"] = f"#/$defs/{prefix}_{ref.removeprefix(f'#/{key}/')}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for key in _DEFS_KEYS:
        for name, sub in (schema.get(key) or {}).items():
            defs[f"{prefix}_{name}"] = rewrite(sub)
    body = rewrite(body)
    if root_name in defs:
        defs[root_name] = body
    return body


def forced_calls_schema(tools: list[dict[str, Any]], max_calls: int | None) -> dict[str, Any]:
    """JSON schema of the array of calls of ``tools`` (OpenAI-shaped function tool dicts)."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        args = _hoist_defs(arguments_schema(fn.get("parameters")), f"tool{i}", defs)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "arguments": args},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
        "minItems": 1,
    }
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def forced_calls_constraint(tools: list[dict[str, Any]], max_calls: int | None) -> StructuredOutputsParams:
    # Compact JSON: no whitespace for a model to spend its tokens on between the tokens of a call.
    schema = json.dumps(forced_calls_schema(tools, max_calls), ensure_ascii=False)
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def tagged_calls_constraint(
    tools: list[dict[str, Any]], begin: Callable[[str], str], end: str, trigger: str
) -> StructuredOutputsParams:
    """A structural tag: after ``trigger`` the text must be ``begin(name)`` + arguments following the
    tool's schema (any object for a tool that is not strict) + ``end``."""
    structures = []
    for tool in tools:
        fn = tool["function"]
        schema = arguments_schema(fn.get("parameters")) if fn.get("strict") else {"type": "object"}
        structures.append({"begin": begin(fn["name"]), "schema": schema, "end": end})
    tag = {"type": "structural_tag", "structures": structures, "triggers": [trigger]}
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))
