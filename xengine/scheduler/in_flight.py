"""Async scheduling bookkeeping: requests advanced at schedule time, as if their step had run.

With async scheduling the engine schedules step ``i + 1`` while step ``i`` still runs. So that the
scheduler sees the state step ``i`` will leave, each request of a (non-sync) plan is *advanced* when
the plan is made: its ``num_computed_tokens`` moves past the step's tokens, and a sequence that samples
gets a placeholder output token. A placeholder is ``-(1 + row)``: the token of sampling row ``row``
of the step that is in flight; the runner resolves it from that step's sampled tokens on the device,
before the next forward (inputs) and the next sampling (penalty histories). When the step's outputs
arrive, ``Scheduler.update`` puts the real token where the placeholder was. ``rewind`` undoes an
advance (a step that failed).

A request whose placeholder already brings it to ``max_tokens`` or the context limit is not scheduled
again before its outputs arrive; one that stops on an eos / stop token computes at most one extra
token, which is dropped.
"""

from __future__ import annotations

from xengine.request import Request, RequestStatus
from xengine.scheduler.plan import SchedulePlan


def is_placeholder(token_id: int) -> bool:
    return token_id < 0


def placeholder(row: int) -> int:
    return -1 - row


def advance(plan: SchedulePlan) -> None:
    """Advance every request of ``plan`` past the step; sampling rows are numbered as the runner does."""
    row = 0
    for s in plan.seqs:
        req = s.req
        s.computed_after = req.num_computed_tokens + s.num_new_tokens
        req.num_computed_tokens = s.computed_after
        if s.sample:
            s.output_index = len(req.output_token_ids)
            req.output_token_ids.append(placeholder(row))
            req.num_placeholders += 1
            row += s.num_samples


def rewind(plan: SchedulePlan) -> None:
    """Undo ``advance(plan)`` for the requests still where it left them (the step did not run)."""
    for s in reversed(plan.seqs):
        req = s.req
        if s.computed_after is None:
            continue
        if req.status == RequestStatus.RUNNING and req.num_computed_tokens == s.computed_after:
            req.num_computed_tokens = s.computed_after - s.num_new_tokens
        if s.output_index is not None and s.output_index == len(req.output_token_ids) - 1:
            if is_placeholder(req.output_token_ids[-1]):
                req.output_token_ids.pop()
                req.num_placeholders -= 1
        s.computed_after = s.output_index = None
    for job in plan.encodes:  # not in flight any more: the next plan may take its images again
        if job.req.mm is not None:
            job.req.mm.encode_plan = None


def done_pending(req: Request, max_model_len: int) -> bool:
    """True when the request's in-flight token already ends it by length: do not schedule it again."""
    if not req.num_placeholders:
        return False
    max_tokens = req.params.max_tokens
    return (
        max_tokens is not None and len(req.output_token_ids) >= max_tokens
    ) or req.num_tokens >= max_model_len


def strip_placeholders(req: Request) -> None:
    """Drop unresolved placeholders (the request ended; their tokens, if any come, are dropped)."""
    if req.num_placeholders:
        req.output_token_ids = [t for t in req.output_token_ids if not is_placeholder(t)]
        req.num_placeholders = 0
