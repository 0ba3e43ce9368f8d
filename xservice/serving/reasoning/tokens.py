"""``usage.completion_tokens_details.reasoning_tokens``: how many output tokens are reasoning.

Tags are no tokens of reasoning (as in vLLM). The reasoning's character span is mapped to tokens by
decoding prefixes of the output's token ids (a binary search: a few decodes per choice), which works
whether the tags are single added tokens (Qwen3, R1) or spelled out in several.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Decode = Callable[[list[int]], Awaitable[str]]


async def _num_tokens_within(decode: Decode, token_ids: list[int], num_chars: int) -> int:
    """The largest k whose first k tokens decode to at most ``num_chars`` characters."""
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(await decode(token_ids[:mid])) <= num_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


async def count_reasoning_tokens(decode: Decode, token_ids: list[int], span: tuple[int, int]) -> int:
    """Tokens of ``token_ids`` inside the character span ``[start, end)`` of their decoded text."""
    start, end = span
    if end <= start or not token_ids:
        return 0
    upto_end = await _num_tokens_within(decode, token_ids, end)
    upto_start = await _num_tokens_within(decode, token_ids, start)
    # a token straddling ``start`` (the start tag glued to the first word) counts as reasoning
    return max(0, upto_end - upto_start)
