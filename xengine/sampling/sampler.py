"""The sampler: one token per logits row, plus logprobs when asked.

Order per step: banned ids (min_tokens, bad words) -> allowed_token_ids -> penalties -> logit_bias
-> grammar bitmask -> (logprobs) -> greedy argmax | temperature, top-k, top-p, min-p, random draw.

Reported logprobs follow ``model.logprobs_mode`` (vLLM's ``--logprobs-mode``): ``raw_logprobs`` (the
default) is the log-softmax of the model's own logits, before any of the above, so a score does not
depend on the request's constraints; ``raw_logits`` those logits; ``processed_logprobs`` /
``processed_logits`` what the token is drawn from: after bans, penalties, biases and the grammar
mask, and for sampled rows temperature, top-k / top-p and min-p (a masked id has -inf). Beam search
scores the processed log-softmax whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ops.registry import get_op
from xengine.sampling.constraints import (
    apply_allowed_token_ids,
    apply_grammar,
    apply_logit_bias,
    bad_words_bans,
)
from xengine.sampling.metadata import GREEDY_TEMPERATURE, SamplingMetadata
from xengine.sampling.penalties import apply_banned_tokens, apply_penalties
from xengine.sampling.top_k_top_p import apply_min_p, apply_top_k, apply_top_k_top_p


@dataclass
class SamplerOutput:
    """One sampled token per row; logprob fields are None when no row asked for logprobs."""

    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B], logprob of the sampled token
    top_logprob_token_ids: torch.Tensor | None  # int64 [B, k]
    top_logprobs: torch.Tensor | None  # float32 [B, k], sorted descending
    # float32 [B, m]: row i's logprobs of ``meta.logprob_token_ids[i]`` (padded; None: no row asked)
    token_id_logprobs: torch.Tensor | None = None


class Sampler:
    """Samples the next token of every row of a float32 [B, V] logits batch."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw = logits.float()
        wanted = meta.max_num_logprobs is not None
        logprobs = raw_logprobs(raw, self.logprobs_mode) if wanted else None  # before any processing
        logits = process_logits(raw, meta)
        if wanted and logprobs is None:
            logprobs = processed_logprobs(logits, meta, self.logprobs_mode)
        if meta.all_greedy:
            sampled = row_argmax(logits)
        else:
            sampled = random_sample(logits, meta)
            if not meta.all_random:
                is_greedy = meta.temperature < GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, row_argmax(logits), sampled)
        if logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        out = _with_logprobs(sampled, logprobs, meta.max_num_logprobs)
        if meta.logprob_token_ids is not None:
            out.token_id_logprobs = gather_token_logprobs(logprobs, meta.logprob_token_ids)
        return out


def raw_logprobs(raw: torch.Tensor, mode: str) -> torch.Tensor | None:
    """The reported values of a raw mode (None: a processed mode)."""
    if mode == "raw_logprobs":
        return raw.log_softmax(dim=1)
    if mode == "raw_logits":
        return raw.clone()
    return None


def processed_logprobs(logits: torch.Tensor, meta: SamplingMetadata, mode: str) -> torch.Tensor:
    """The reported values of a processed mode from the processed ``logits``: greedy rows as they are,
    sampled rows after temperature, top-k / top-p and min-p (what their token is drawn from)."""
    out = logits
    if not meta.all_greedy:
        scaled = sampling_logits(logits, meta)
        kept = sampling_probs(logits, meta) > 0  # min-p's cut too
        drawn = scaled.masked_fill(~kept, float("-inf"))
        out = (
            drawn
            if meta.all_random
            else torch.where((meta.temperature < GREEDY_TEMPERATURE)[:, None], logits, drawn)
        )
    return out if mode == "processed_logits" else out.log_softmax(dim=1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value, the first on ties and the first NaN (``torch.max`` rules)."""
    return get_op("row_argmax")(x)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bans, penalties, biases and grammar masks: the logits whose log-softmax is reported (and that
    beam search scores)."""
    unconstrained = logits
    if meta.banned_token_ids is not None:
        logits = apply_banned_tokens(logits, meta.banned_token_ids)
    if meta.bad_words is not None:
        logits = apply_banned_tokens(logits, bad_words_bans(meta.bad_words, meta.output_token_ids))
    if meta.allowed_token_ids is not None:
        logits = apply_allowed_token_ids(logits, meta.allowed_token_ids)
    logits = apply_penalties(
        logits,
        meta.output_token_ids,
        meta.prompt_token_ids,
        meta.repetition_penalty,
        meta.presence_penalty,
        meta.frequency_penalty,
    )
    if meta.logit_bias is not None:
        logits = apply_logit_bias(logits, meta.logit_bias)
    if meta.grammar_bitmask is not None and meta.grammar_rows:
        logits = apply_grammar(logits, unconstrained, meta.grammar_bitmask, meta.grammar_rows)
    return logits


def random_sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k / top-p / min-p, then one draw per row (greedy rows get a dummy draw)."""
    return inverse_cdf_sample(sampling_probs(logits, meta), meta.generators)


def sampling_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then top-k / top-p (cut entries -inf); greedy rows at temperature 1."""
    temperature = meta.temperature
    if not meta.all_random:  # greedy rows divide by 1: finite, and their draw is discarded
        temperature = temperature.masked_fill(temperature < GREEDY_TEMPERATURE, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
    return logits


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The (possibly unnormalised) distribution each row's token is drawn from: temperature, top-k /
    top-p, softmax, min-p (greedy rows: the distribution at temperature 1, never drawn from)."""
    probs = sampling_logits(logits, meta).softmax(dim=1)
    if meta.min_p is not None:
        probs = apply_min_p(probs, meta.min_p)
    return probs


def inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw from each (unnormalised) row by inverting its CDF: ``u`` uniform in ``[0, row sum)``,
    the first token whose running sum passes ``u``. One uniform per row (an exponential race needs one
    per vocabulary entry: 20x slower at 32k tokens on a CPU core).

    Rows in ``generators`` draw their ``u`` from their own generator, so a seeded request gets the
    same tokens whatever else is in the batch and wherever its row is. A token of probability 0 is
    never drawn (its running sum equals its predecessor's).
    """
    rows, vocab = probs.shape
    cdf = probs.cumsum(dim=1)
    u = torch.empty(rows, 1, dtype=cdf.dtype, device=cdf.device)
    if len(generators) < rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    u.mul_(cdf[:, -1:])
    sampled = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # ``u`` rounded up to its row's total: the draw fell past the end; take the row's most likely token
    past_end = sampled >= vocab
    if bool(past_end.any()):
        sampled = torch.where(past_end, row_argmax(probs), sampled)
    return sampled


def _with_logprobs(sampled: torch.Tensor, logprobs: torch.Tensor, num_top: int) -> SamplerOutput:
    chosen = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
    num_top = min(num_top, logprobs.shape[1])
    top_logprobs, top_ids = torch.topk(logprobs, num_top, dim=1)
    return SamplerOutput(sampled, chosen, top_ids, top_logprobs)


def gather_token_logprobs(logprobs: torch.Tensor, token_ids: list[list[int] | None]) -> torch.Tensor:
    """Row i's logprobs of ``token_ids[i]`` as one [B, m] gather (rows are padded with id 0; a row
    without ids reads nothing from its padding)."""
    width = max(len(ids or ()) for ids in token_ids)
    index = [(ids or []) + [0] * (width - len(ids or ())) for ids in token_ids]
    return logprobs.gather(1, torch.tensor(index, dtype=torch.int64, device=logprobs.device))
