"""A request resumed on another instance after some of its tokens were generated (migration after an
instance died, an eviction, a PD decode half): prompt + generated tokens, what is left of its budget."""

from __future__ import annotations

import msgspec

from xengine.api.messages import AddRequest


def continue_request(req: AddRequest, generated: list[int], tag: str) -> AddRequest | None:
    """The same request resumed after ``generated`` as ``<req_id>~<tag>`` (None: nothing left).

    A prefill-only request (embedding, prompt scoring) runs again whole; prompt logprobs are
    asked again while no token came (the prompt is the same; positions already streamed are
    dropped by the service's output state)."""
    p = req.params
    if p.is_prefill_only:
        return msgspec.structs.replace(req, req_id=f"{req.req_id}~{tag}")
    max_tokens = None if p.max_tokens is None else p.max_tokens - len(generated)
    if max_tokens is not None and max_tokens <= 0:
        return None
    params = msgspec.structs.replace(
        p,
        max_tokens=max_tokens,
        min_tokens=max(0, p.min_tokens - len(generated)),
        prompt_logprobs=p.prompt_logprobs if not generated else None,
    )
    so = p.structured_outputs
    if so is not None and generated:  # the grammar resumes past what was generated, not at its start
        resumed = [*(so.resume_token_ids or []), *generated]
        params.structured_outputs = msgspec.structs.replace(so, resume_token_ids=resumed)
    # every other field (priority, arrival time, SLO, ...) carries over as it was
    return msgspec.structs.replace(
        req,
        req_id=f"{req.req_id}~{tag}",
        prompt_token_ids=list(req.prompt_token_ids) + generated,
        params=params,
    )
