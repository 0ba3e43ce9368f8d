"""Classification of vLLM's OpenAI-server tests (placeholder, filled in below)."""

from __future__ import annotations

from typing import Any


def classify_all(raw: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"test": k, **v} for k, v in sorted(raw.items())]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from collections import Counter

    return {"outcomes": dict(Counter(r.get("outcome") for r in rows))}


def render_markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {r['test']}: {r.get('outcome')}" for r in rows)
