"""A multi-turn chat trace for prefix-cache hit rates (the hybrid-memory benchmarks share it).

``chats`` conversations of ``turns`` turns, all conversations' turn ``t`` submitted together: each
prompt is the conversation so far (a ``system_len``-token start, then ``user_len``-token messages and
``answer_len``-token greedy answers)."""

from __future__ import annotations

import argparse
from typing import Any

import torch


def trace_max_len(args: argparse.Namespace) -> int:
    """The longest sequence of the trace (its last turn's prompt and answer), plus a margin."""
    return args.system_len + args.turns * (args.user_len + args.answer_len) + 8


def run_chat_trace(llm: Any, args: argparse.Namespace, seed: int = 3) -> dict[str, Any]:
    """Run the trace on ``llm`` (an ``xengine.llm.LLM``); its prefix-cache token hit rate."""
    from xengine.api.messages import SamplingParams

    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 2000, (n,), generator=gen).tolist()

    system = tokens(args.system_len)
    users = [[tokens(args.user_len) for _ in range(args.turns)] for _ in range(args.chats)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    history = [list(system) for _ in range(args.chats)]
    for turn in range(args.turns):
        prompts = [h + users[c][turn] for c, h in enumerate(history)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    stats = llm.engine.get_stats()
    return {
        "queried_tokens": stats.prefix_cache_queries,
        "hit_tokens": stats.prefix_cache_hits,
        "hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
    }
