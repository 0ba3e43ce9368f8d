"""Prompt-side outputs of a step: prompt logprobs and pooled embeddings, read off the hidden states of
the prompt positions the step computed.

Prompt logprobs: the hidden state at position ``p`` gives the logprob of prompt token ``p + 1``. A
chunked prefill computes them chunk by chunk, and each chunk's rows go through the LM head
``ROWS_PER_SLICE`` at a time, reduced at once to (token logprob, rank, top-k): a long prompt never
holds a [prompt_len, vocab] tensor. They are the raw distribution (no penalties), as HF's and vLLM's.
Positions already reported (a recomputed request) are skipped; the scheduler drops repeats again
when it applies them, since with async scheduling a step is planned before the previous one's
positions are applied.

Embeddings: the final hidden state (after the model's last norm) of the prompt's last token: the
last-token pooling decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) are trained
with. That position is always computed, also after a prefix-cache hit (a hit leaves at least one
token to compute), so embedding requests keep their prefix-cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from xengine.api.messages import PoolingParams, PromptLogprobs, TokenLogprob
from xengine.scheduler.plan import SchedulePlan, StepOutput

ROWS_PER_SLICE = 256  # prompt positions per LM-head call: bounds the [rows, vocab] logits tensor


@dataclass
class PromptLogprobRows:
    """One sequence's prompt positions whose logprobs this step computes."""

    seq_id: str
    start: int  # the first prompt position (>= 1) whose token's logprob is computed
    first_row: int  # its predecessor's row in the step's flat hidden states
    target_ids: list[int]  # the prompt tokens at ``start``, ``start + 1``, ... (one per row)
    num_top: int


@dataclass
class PoolingRow:
    seq_id: str
    row: int  # the prompt's last position, in the step's flat hidden states
    params: PoolingParams


@dataclass
class PromptOutputRows:
    logprobs: list[PromptLogprobRows] = field(default_factory=list)
    pooling: list[PoolingRow] = field(default_factory=list)


def build_prompt_rows(plan: SchedulePlan) -> PromptOutputRows | None:
    """Which hidden rows of ``plan``'s step feed prompt logprobs and embeddings (host side); None
    when no sequence needs any."""
    rows = PromptOutputRows()
    offset = 0  # the sequence's first row: the step's tokens are laid out sequence after sequence
    for s in plan.seqs:
        req, start, end = s.req, s.start, s.end
        num_prompt = req.num_prompt_tokens
        k = req.params.prompt_logprobs
        if k is not None:
            first, last = max(start, req.prompt_logprobs_end - 1), min(end, num_prompt - 1)
            if first < last:
                targets = req.prompt_token_ids[first + 1 : last + 1]
                rows.logprobs.append(
                    PromptLogprobRows(req.seq_id, first + 1, offset + first - start, targets, k)
                )
        if req.pooling is not None and start < num_prompt <= end:
            rows.pooling.append(PoolingRow(req.seq_id, offset + num_prompt - 1 - start, req.pooling))
        offset += s.num_new_tokens
    return rows if rows.logprobs or rows.pooling else None


def compute_prompt_outputs(
    model: torch.nn.Module, hidden: torch.Tensor, rows: PromptOutputRows, out: StepOutput
) -> None:
    """Fill ``out.prompt_logprobs`` and ``out.embeddings`` from the step's final hidden states."""
    for r in rows.logprobs:
        out.prompt_logprobs[r.seq_id] = _prompt_logprobs(model, hidden, r)
    for p in rows.pooling:
        out.embeddings[p.seq_id] = _pool(hidden[p.row], p.params)


def logit_slices(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The LM-head calls prompt logprobs make, in order, for row spans ``(first row, rows)``: each
    ``(first row, rows)`` of at most ``ROWS_PER_SLICE`` (tensor-parallel workers make the same calls)."""
    return [
        (first + i, min(ROWS_PER_SLICE, n - i)) for first, n in spans for i in range(0, n, ROWS_PER_SLICE)
    ]


def logit_spans(rows: PromptOutputRows | None) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each sequence's prompt logprobs in a step."""
    return [] if rows is None else [(r.first_row, len(r.target_ids)) for r in rows.logprobs]


def _prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, r: PromptLogprobRows) -> PromptLogprobs:
    targets = torch.tensor(r.target_ids, dtype=torch.int64, device=hidden.device)
    chosen, ranks, top_lps, top_ids = [], [], [], []
    for first, n in logit_slices([(r.first_row, len(r.target_ids))]):
        i = first - r.first_row
        logprobs = model.compute_logits(hidden[first : first + n]).log_softmax(dim=-1)
        lp = logprobs.gather(1, targets[i : i + n, None])
        chosen.append(lp[:, 0])
        ranks.append((logprobs > lp).sum(dim=1) + 1)
        if r.num_top:
            values, ids = torch.topk(logprobs, min(r.num_top, logprobs.shape[1]), dim=1)
            top_lps.append(values)
            top_ids.append(ids)
        del logprobs
    top: list[list[TokenLogprob]] = [[] for _ in r.target_ids]
    if r.num_top:
        ids_rows, lps_rows = torch.cat(top_ids).tolist(), torch.cat(top_lps).tolist()
        top = [[TokenLogprob(t, v) for t, v in zip(ids, lps)] for ids, lps in zip(ids_rows, lps_rows)]
    return PromptLogprobs(
        start=r.start, logprobs=torch.cat(chosen).tolist(), ranks=torch.cat(ranks).tolist(), top=top
    )


def _pool(last_hidden: torch.Tensor, params: PoolingParams) -> list[float]:
    vector = last_hidden.float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]  # Matryoshka: the leading dimensions, renormalised below
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
