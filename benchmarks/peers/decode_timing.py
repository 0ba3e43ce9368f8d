"""Decode throughput of one engine, timed the same way for xllm and its peers (plain Python: the peer
scripts import it from their own venvs).

``decode tok/s = B * (N - 1) / (t(generate N tokens) - t(generate 1 token))`` over fresh prompts each
call: the prefill's time is taken out, what is left is the decode steps'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], tuple[float, int]]  # (prompts, max_tokens) -> (seconds, tokens)


def time_decode_runs(
    generate: Generate, runs: list[dict[str, Any]], output_len: int
) -> list[dict[str, float]]:
    """One timing per run (``{"prefill": prompts, "full": prompts}``)."""
    out = []
    for run in runs:
        t_prefill, _ = generate(run["prefill"], 1)
        t_full, num_out = generate(run["full"], output_len)
        decode_tokens = len(run["full"]) * (output_len - 1)
        out.append(
            {
                "prefill_s": t_prefill,
                "full_s": t_full,
                "num_output_tokens": num_out,
                "output_tok_s": num_out / t_full,
                "decode_tok_s": decode_tokens / max(t_full - t_prefill, 1e-9),
            }
        )
    return out
