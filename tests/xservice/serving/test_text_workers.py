"""``TextWorkers``: large tokenizer calls run on worker threads and leave the event loop free."""

from __future__ import annotations

import asyncio
import time

from xservice.serving.text_workers import INLINE_MAX_COST, TextWorkers

WORDS = "the quick brown fox jumps over a lazy dog while serving engines stream tokens".split()


def big_text(num_chars: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(num_chars // 6))[:num_chars]


async def _max_loop_gap_while(coro) -> tuple[float, float, object]:
    """(longest gap between loop ticks, time ``coro`` took, its result)."""
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    result = await coro
    took = time.monotonic() - t0
    done.set()
    await task
    inside = [t for t in ticks if t >= t0]
    return max(b - a for a, b in zip(inside, inside[1:])), took, result


def test_large_encode_and_decode_leave_the_loop_free(tokenizer) -> None:
    text = big_text(2_000_000)

    async def run() -> None:
        workers = TextWorkers(tokenizer, num_workers=2)
        try:
            gap, took, ids = await _max_loop_gap_while(workers.encode(text))
            assert ids == tokenizer.encode(text)
            # An encode on the loop (or one holding the GIL) would stall it for the whole call.
            assert gap < took / 4, (gap, took)
            back = await workers.decode(ids, skip_special_tokens=False)
            assert back == text
        finally:
            workers.close()

    asyncio.run(run())


def test_small_inputs_run_inline(tokenizer) -> None:
    async def run() -> None:
        workers = TextWorkers(tokenizer, num_workers=1)
        workers.close()  # a closed pool refuses work: only inline calls can still succeed
        text = "x" * INLINE_MAX_COST
        assert await workers.encode(text) == tokenizer.encode(text)
        assert await workers.decode([5, 6, 7]) == tokenizer.decode([5, 6, 7])

    asyncio.run(run())


def test_without_a_tokenizer_there_is_no_bound() -> None:
    workers = TextWorkers(None)
    assert workers.max_token_chars is None
    workers.close()
