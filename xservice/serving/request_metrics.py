"""Per-request metrics on responses (vLLM's ``--enable-per-request-metrics``): one generation's timing,
attached to a non-streamed response and to a stream's final usage chunk. A request of several sequences
(``n`` > 1) or prompts has no single timing: none is attached, as in vLLM."""

from __future__ import annotations

from xservice.protocol.common import PerRequestMetrics
from xservice.serving.context import ServingContext
from xservice.serving.generation import Generation


def request_metrics(ctx: ServingContext, gens: list[Generation]) -> PerRequestMetrics | None:
    """The metrics of the request run by ``gens`` (None: the option is off, or not one sequence)."""
    if not ctx.config.service.enable_per_request_metrics or len(gens) != 1 or gens[0].params.n != 1:
        return None
    gen = gens[0]
    first, last, queued = gen.first_token_at, gen.last_token_at, gen.queue_time_s
    # the engine reports how long it queued the request; it was scheduled that long after it arrived
    scheduled = gen.arrival + queued if queued is not None else None
    n = gen.num_completion_tokens
    out = PerRequestMetrics(queue_time_ms=None if queued is None else queued * 1000)
    if first is not None and last is not None:
        out.generation_time_ms = (last - first) * 1000
        if n > 1:
            out.mean_itl_ms = (last - first) / (n - 1) * 1000
    if scheduled is not None and first is not None:
        out.time_to_first_token_ms = max(0.0, first - scheduled) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out.tokens_per_second = n / (last - scheduled)
    return out
