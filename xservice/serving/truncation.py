"""``truncate_prompt_tokens``: keep only the end (or the start) of a prompt that is too long.

vLLM's semantics: ``k`` keeps the last ``k`` prompt tokens (``truncation_side: "right"`` keeps the
first ``k``); ``-1`` keeps as many as the context holds while leaving one token for the output.
Values below -1, 0, and values above the context length are 400s. Truncation applies to the token
ids (after tokenizing a text prompt or rendering the chat template), so it is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xservice.http.errors import InvalidRequestError
from xservice.protocol import SamplingRequest

Side = Literal["left", "right"]


@dataclass(frozen=True)
class Truncation:
    """Keep at most ``max_tokens`` prompt tokens, dropping them from ``side``."""

    max_tokens: int
    side: Side = "left"

    def apply(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.max_tokens:
            return ids
        return ids[-self.max_tokens :] if self.side == "left" else ids[: self.max_tokens]


def resolve_truncation(body: SamplingRequest, max_model_len: int) -> Truncation | None:
    """The request's truncation, or None; 400 for values outside ``{-1} ∪ [1, max_model_len]``."""
    k = body.truncate_prompt_tokens
    if k is None:
        if body.truncation_side is not None:  # never silently ignored
            raise InvalidRequestError(
                "'truncation_side' applies only together with 'truncate_prompt_tokens'.",
                param="truncation_side",
            )
        return None
    if k == -1:
        k = max(1, max_model_len - 1)
    elif not 1 <= k <= max_model_len:
        raise InvalidRequestError(
            f"invalid value for 'truncate_prompt_tokens': must be -1 (the context length less one) or in "
            f"[1, {max_model_len}] (this model's maximum context length), got {k}",
            param="truncate_prompt_tokens",
        )
    return Truncation(k, body.truncation_side or "left")
