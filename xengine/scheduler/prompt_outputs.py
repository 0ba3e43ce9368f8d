"""Scheduler side of prompt-side outputs (prompt logprobs, embeddings) and prefill-only requests.

A request asking for prompt logprobs takes no prefix-cache hit over positions whose logprobs are still
to come: a cached block has KV but no hidden states, and recomputing the logits needs them, so
recomputing those positions costs what the hit would save (vLLM makes the same choice). It still
inserts its own blocks into the prefix cache for later requests, and once its prompt logprobs are all
reported (e.g. preempted while decoding) it takes hits again. Embedding requests keep their hits: they
need the last position only, which a hit always leaves to compute.

A prefill-only request (``max_tokens == 0``: echo-only scoring, embeddings) never samples; it
finishes with "length" when the step that completes its prompt is applied.
"""

from __future__ import annotations

from memory.kv_cache_manager import ComputedPrefix
from xengine.api.messages import PromptLogprobs
from xengine.request import Request
from xengine.scheduler.plan import StepOutput


def limit_prefix(req: Request, prefix: ComputedPrefix, block_size: int) -> ComputedPrefix:
    """``prefix`` cut to the whole blocks whose positions need no more prompt logprobs."""
    if not req.wants_prompt_logprobs:
        return prefix
    # position end - 1 gives the logprob at ``end``: every position before it may come from the cache
    num_blocks = min(len(prefix.block_ids), (req.prompt_logprobs_end - 1) // block_size)
    if num_blocks == len(prefix.block_ids):
        return prefix
    return ComputedPrefix(prefix.block_ids[:num_blocks], num_blocks * block_size)


def apply_prompt_outputs(req: Request, out: StepOutput) -> bool:
    """Take this step's prompt logprobs / embedding for ``req``; True when there is news to report."""
    news = False
    chunk = out.prompt_logprobs.get(req.seq_id)
    if chunk is not None:
        news = _append_prompt_logprobs(req, chunk)
    embedding = out.embeddings.get(req.seq_id)
    if embedding is not None:
        req.embedding = embedding
        news = True
    return news


def _append_prompt_logprobs(req: Request, chunk: PromptLogprobs) -> bool:
    """Append the part of ``chunk`` past what is already reported (a recomputed prefix repeats)."""
    end = req.prompt_logprobs_end
    assert chunk.start <= end, f"{req.seq_id}: prompt logprobs from {chunk.start}, reported up to {end}"
    skip = end - chunk.start
    if skip >= len(chunk.logprobs):
        return False
    if skip:
        chunk = PromptLogprobs(
            start=end, logprobs=chunk.logprobs[skip:], ranks=chunk.ranks[skip:], top=chunk.top[skip:]
        )
    pending = req.new_prompt_logprobs
    if pending is None:
        req.new_prompt_logprobs = chunk
    else:
        pending.logprobs += chunk.logprobs
        pending.ranks += chunk.ranks
        pending.top += chunk.top
    req.prompt_logprobs_end = chunk.start + len(chunk.logprobs)
    return True


def prefill_done(req: Request, num_computed: int) -> bool:
    """A prefill-only request whose prompt is computed up to ``num_computed``: it ends now."""
    return req.params.is_prefill_only and num_computed >= req.num_prompt_tokens
