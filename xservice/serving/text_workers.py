"""Tokenizer work off the event loop: a bounded thread pool for large encodes, chat templates and decodes.

Encoding megabytes of text takes seconds and would stall every stream on the loop. Batch encoding and
decoding release the GIL (``Tokenizer.encode`` uses ``encode_batch_fast``) and jinja runs bytecode that
yields it, so threads suffice; a process pool would only add copying megabytes between processes.
Measurements: ``docs/operations.md``, "Request limits".
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer

T = TypeVar("T")

# Inputs up to this many characters (or token ids) are processed inline. A hop to a worker and back
# costs ~50-70 us here; 2048 characters encode in ~0.3 ms, so below that the hop is a large share of
# the work and the loop is held only briefly, above it the hop is cheap next to the work it frees.
INLINE_MAX_COST = 2048
MAX_WORKERS = 4


def default_num_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class TextWorkers:
    """Runs tokenizer calls on a bounded thread pool, or inline when they are small.

    Owned by the app (``ServingContext.text``) and closed with it.
    """

    def __init__(self, tokenizer: Tokenizer | None, num_workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(
            max_workers=num_workers or default_num_workers(), thread_name_prefix="xllm-text"
        )
        # Computed now (it reads the whole vocabulary) rather than inside the first request.
        self.max_token_chars = tokenizer.max_token_chars if tokenizer is not None else None

    async def run(self, cost: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: inline when ``cost`` (characters or ids to process) is small, else on the pool."""
        if cost <= INLINE_MAX_COST:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self.run(len(ids), self.tokenizer.decode, ids, skip_special_tokens)

    def close(self) -> None:
        """Stop the workers; calls still queued are cancelled, running ones finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
