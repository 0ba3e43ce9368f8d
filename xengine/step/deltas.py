"""Per-request deltas of a step: what each sequence got since the last step, for its client.

A step loop only updates the scheduler; the engine collects here, once per ``step()``, what the
updates (and failures or aborts) produced, and releases the runner's per-sequence state of the
sequences that finished.
"""

from __future__ import annotations

from xengine.api.messages import CompletionDelta
from xengine.runner.model_runner import ModelRunner
from xengine.scheduler.scheduler import Scheduler


def collect_deltas(scheduler: Scheduler, runner: ModelRunner) -> list[CompletionDelta]:
    """One delta per sequence with news (``Scheduler.take_updated``), in the order they came."""
    deltas = []
    finished = []
    for req in scheduler.take_updated():
        want_lp = req.params.logprobs is not None
        deltas.append(
            CompletionDelta(
                req_id=req.req_id,
                index=req.index,
                new_token_ids=req.new_token_ids,
                new_logprobs=req.new_logprobs if want_lp else None,
                new_top_logprobs=req.new_top_logprobs if want_lp else None,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                score=req.beam_score,
                cumulative_logprob=req.cumulative_logprob,
                error=req.error,
                prompt_logprobs=req.new_prompt_logprobs,
                embedding=req.embedding if req.is_finished else None,
                queue_time_s=req.queue_time_s,
            )
        )
        req.queue_time_s = None  # reported once
        req.new_token_ids, req.new_logprobs, req.new_top_logprobs = [], [], []
        req.new_prompt_logprobs = None
        if req.is_finished:
            finished.append(req.seq_id)
    runner.release(finished)
    return deltas
