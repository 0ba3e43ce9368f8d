"""When a sequence stops: eos, stop token ids, max_tokens, the context limit."""

from __future__ import annotations

from xengine.request import Request


def check_stop(
    req: Request, token_id: int, eos_token_ids: set[int], max_model_len: int, num_output: int | None = None
) -> tuple[str, int | str | None] | None:
    """Return ``(finish_reason, stop_reason)`` if ``req`` ends with ``token_id``, its ``num_output``-th
    output token (default: its last), else None.

    Stop-string matching needs text and happens where detokenization happens (the service or
    the offline API), which then aborts the request.
    """
    params = req.params
    if num_output is None:
        num_output = len(req.output_token_ids)
    if num_output >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length", None
    if req.num_prompt_tokens + num_output >= max_model_len:
        return "length", None
    return None
