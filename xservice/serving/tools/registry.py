"""Tool-call parser families, and which one a served model uses.

A family knows its models' call syntax: the parser for ``tool_choice`` "auto" and the structural
tag that constrains a call once opened (for ``strict`` tools). The served model's family comes from
``service.tool_call_parser``: a family name, "none", or "auto" (default): the family whose call tag
the chat template writes, else the one registered for the model's architecture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xengine.api.messages import StructuredOutputsParams
from xservice.serving.tools.base import BaseToolParser
from xservice.serving.tools.constraint import tagged_calls_constraint
from xservice.serving.tools.hermes import END, START, HermesToolParser

AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class ToolParserFamily:
    name: str
    make_parser: Callable[[int | None], BaseToolParser]  # (max_calls) -> a parser for one choice
    template_markers: tuple[str, ...]  # text a chat template of this family contains
    architectures: tuple[str, ...]  # HF architecture names of models of this family
    strict_constraint: Callable[[list[dict[str, Any]]], StructuredOutputsParams] | None = None


_FAMILIES: dict[str, ToolParserFamily] = {}


def register(family: ToolParserFamily) -> None:
    _FAMILIES[family.name] = family


def setting_names() -> list[str]:
    """Valid values of ``service.tool_call_parser``."""
    return [AUTO, NONE, *sorted(_FAMILIES)]


def _architectures(model_dir: str) -> list[str]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    archs = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def resolve_family(setting: str, chat_template: str | None, model_dir: str) -> ToolParserFamily | None:
    """The family ``setting`` names, or (``auto``) the one detected for the model; None: no parser."""
    if setting == NONE:
        return None
    if setting != AUTO:
        if setting not in _FAMILIES:
            raise ValueError(f"unknown tool-call parser {setting!r}; valid: {', '.join(setting_names())}")
        return _FAMILIES[setting]
    template = chat_template or ""
    for family in _FAMILIES.values():
        if any(marker in template for marker in family.template_markers):
            return family
    archs = set(_architectures(model_dir))
    for family in _FAMILIES.values():
        if archs & set(family.architectures):
            return family
    return None


def _hermes_strict(tools: list[dict[str, Any]]) -> StructuredOutputsParams:
    def begin(name: str) -> str:  # what Qwen's templates write before a call's arguments
        return f'{START}\n{{"name": "{name}", "arguments": '

    return tagged_calls_constraint(tools, begin, "}\n" + END, START)


register(
    ToolParserFamily(
        name="hermes",
        make_parser=HermesToolParser,
        template_markers=(START,),
        architectures=(
            "Qwen2ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen3MoeForCausalLM",
        ),
        strict_constraint=_hermes_strict,
    )
)
