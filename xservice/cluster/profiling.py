"""Start-up profiling: seed an instance's TTFT and TPOT predictors before real traffic refits them.

When an instance joins (and after every restart), the service sends it a short, fixed probe:

- **prefill**: prompts of random token ids of growing lengths (never a prefix-cache hit), one at a
  time with ``max_tokens = 1``; each measured TTFT is a seed sample of the quadratic prefill model;
- **decode**: batches of ``B`` concurrent streams; the mean gap between a stream's tokens is the
  step time of a batch of ``B`` sequences, a seed sample of the step-time model.

The probes are ordinary requests (``priority: offline``, so real online work preempts them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from xengine.api.messages import AddRequest, SamplingParams
from xservice.cluster.monitor import InstanceMonitor
from xservice.cluster.remote_engine import RemoteEngineClient

logger = logging.getLogger(__name__)

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 8)
DECODE_PROMPT = 16
DECODE_TOKENS = 10


@dataclass
class ProfileResult:
    prefill: list[tuple[int, float]]  # (prompt tokens, TTFT s)
    decode: list[tuple[int, int, float]]  # (batch size, context tokens, step s)
    seconds: float


async def profile_instance(client: RemoteEngineClient, mon: InstanceMonitor, seed: int = 0) -> ProfileResult:
    """Probe ``client`` and feed the samples into ``mon``'s predictors as seeds."""
    t0 = time.monotonic()
    info = client.info
    rng = random.Random(seed)
    vocab = max(2, min(info.vocab_size, 32000))
    max_len = max(16, info.max_model_len // 2)
    prefill: list[tuple[int, float]] = []
    for i, length in enumerate(n for n in PREFILL_LENGTHS if n <= max_len):
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        times = await _run(client, f"profile-{seed}-p{i}", ids, 1)
        if times:
            prefill.append((length, times[0]))
            mon.ttft.observe(length, times[0], seed=True)
    decode: list[tuple[int, int, float]] = []
    for b in DECODE_BATCHES:
        prompts = [[rng.randrange(1, vocab) for _ in range(DECODE_PROMPT)] for _ in range(b)]
        runs = await asyncio.gather(
            *(_run(client, f"profile-{seed}-d{b}-{j}", p, DECODE_TOKENS) for j, p in enumerate(prompts))
        )
        gaps = [_mean_gap(t) for t in runs if len(t) > 2]
        if gaps:
            step = sorted(gaps)[len(gaps) // 2]
            context = b * (DECODE_PROMPT + DECODE_TOKENS // 2)
            decode.append((b, context, step))
            mon.tpot.observe(b, context, step, seed=True)
    result = ProfileResult(prefill, decode, time.monotonic() - t0)
    logger.info(
        "profiled %s in %.1fs: prefill %s, decode %s",
        client.name, result.seconds,
        ", ".join(f"{n}t {s * 1000:.0f}ms" for n, s in prefill),
        ", ".join(f"B{b} {s * 1000:.1f}ms/step" for b, _, s in decode),
    )  # fmt: skip
    return result


async def _run(client: RemoteEngineClient, req_id: str, ids: list[int], max_tokens: int) -> list[float]:
    """Seconds from sending to each token's arrival (empty when the instance failed it)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = AddRequest(req_id=req_id, prompt_token_ids=ids, params=params, priority="offline")
    t0 = time.monotonic()
    out: list[float] = []
    async for delta in client.generate(req):
        now = time.monotonic() - t0
        out.extend([now] * len(delta.new_token_ids))
        if delta.error is not None:
            return []
    return out


def _mean_gap(times: list[float]) -> float:
    """Mean time between a stream's tokens after the first (coalesced deltas share a timestamp)."""
    return (times[-1] - times[0]) / (len(times) - 1)
