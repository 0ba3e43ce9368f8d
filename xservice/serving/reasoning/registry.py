"""Reasoning parser families (``service.reasoning_parser``) and one request's reasoning rules.

Both families follow vLLM 0.33: the output starts inside reasoning (an optional leading ``<think>``
is dropped) until ``</think>``; an output that never closes it is all reasoning.
- ``qwen3``: ``chat_template_kwargs.enable_thinking: false`` makes the whole output content; a
  ``<tool_call>`` opened while thinking ends the reasoning (the call is parsed from the content);
  a repeated ``</think>`` in the content is dropped.
- ``deepseek_r1``: the R1 templates open ``<think>`` in the prompt; ``enable_thinking`` is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xservice.serving.reasoning.splitter import ThinkSplitter, ThinkTags, reasoning_span, split_whole

NONE = "none"


@dataclass(frozen=True)
class ReasoningFamily:
    name: str
    tags: ThinkTags
    reads_enable_thinking: bool  # chat_template_kwargs.enable_thinking=false: no reasoning at all


_FAMILIES: dict[str, ReasoningFamily] = {
    "qwen3": ReasoningFamily(
        "qwen3", ThinkTags(implicit_ends=("<tool_call>",), drop_extra_ends=True), reads_enable_thinking=True
    ),
    "deepseek_r1": ReasoningFamily("deepseek_r1", ThinkTags(), reads_enable_thinking=False),
}


def setting_names() -> list[str]:
    """Valid values of ``service.reasoning_parser``."""
    return [NONE, *sorted(_FAMILIES)]


def resolve_family(setting: str) -> ReasoningFamily | None:
    if setting == NONE:
        return None
    if setting not in _FAMILIES:
        raise ValueError(f"unknown reasoning parser {setting!r}; valid: {', '.join(setting_names())}")
    return _FAMILIES[setting]


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's rules: the family, whether the model thinks, whether reasoning is returned."""

    family: ReasoningFamily
    thinking: bool = True
    include: bool = True

    def new_splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self.family.tags, self.thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; reasoning is None unless ``include``."""
        reasoning, content = split_whole(self.family.tags, self.thinking, text)
        return (reasoning if self.include else None), content

    def span(self, text: str) -> tuple[int, int]:
        return reasoning_span(self.family.tags, self.thinking, text)


def plan_reasoning(
    family: ReasoningFamily | None, chat_template_kwargs: dict[str, Any] | None, include: bool
) -> ReasoningPlan | None:
    """The request's reasoning rules; None: the output is not split (no parser configured)."""
    if family is None:
        return None
    thinking = True
    if family.reads_enable_thinking and chat_template_kwargs is not None:
        thinking = bool(chat_template_kwargs.get("enable_thinking", True))
    return ReasoningPlan(family, thinking, include)
