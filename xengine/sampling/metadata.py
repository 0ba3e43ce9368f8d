"""Per-step sampling metadata: the batch's ``SamplingParams`` turned into tensors.

Built once per engine step by the runner from the sequences that need a token. Stages that no
row uses are ``None`` so the sampler skips them entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xengine.api.messages import SamplingParams
from xengine.sampling.constraints import LogitBias

# Temperatures below this are treated as greedy: dividing by them overflows, and the limit of
# sampling at temperature -> 0 is argmax anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step; row ``i`` of every tensor is the ``i``-th logits row."""

    temperature: torch.Tensor  # float32 [B]; 0.0 means greedy for that row
    top_k: torch.Tensor | None  # int64 [B], 0 = disabled for that row; None = disabled for all rows
    top_p: torch.Tensor | None  # float32 [B], 1.0 = disabled; None = disabled for all
    min_p: torch.Tensor | None  # float32 [B], 0.0 = disabled; None = disabled for all
    generators: dict[int, torch.Generator]  # row -> per-request generator; other rows use the global RNG
    all_greedy: bool
    all_random: bool
    repetition_penalty: torch.Tensor | None  # float32 [B], 1.0 = off
    presence_penalty: torch.Tensor | None  # float32 [B], 0.0 = off
    frequency_penalty: torch.Tensor | None  # float32 [B], 0.0 = off
    prompt_token_ids: list[list[int]] | None  # per row, for the repetition penalty
    output_token_ids: list[list[int]]  # per row, tokens generated so far by that sequence
    banned_token_ids: list[list[int]] | None  # per row, ids that must not be sampled this step
    max_num_logprobs: int | None  # None: no logprobs this step; k >= 0: chosen logprob + top-k
    # Host copy of ``top_k.max()`` so top-k needs no device sync; None = read it from the tensor.
    max_top_k: int | None = None
    # token-level constraints (``constraints.py``); None = no row uses them
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[list[int] | None] | None = None  # per row; None = that row is free
    bad_words: list[list[list[int]]] | None = None  # per row, banned token sequences
    # grammar masks, set by the runner right before sampling: row i of the bitmask is logits row rows[i]
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: list[int] | None = None
    # per row, the ids whose logprobs are reported (``SamplingParams.logprob_token_ids``); None = no row
    logprob_token_ids: list[list[int] | None] | None = None

    @staticmethod
    def uses_history(params: SamplingParams) -> bool:
        """Whether sampling with ``params`` reads the sequence's previous tokens (penalties, bad words
        of more than one token)."""
        if any(len(w) > 1 for w in params.bad_words_token_ids or ()):
            return True
        return (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) != (
            1.0,
            0.0,
            0.0,
        )

    @property
    def needs_history(self) -> bool:
        """Whether ``output_token_ids`` is read this step (async placeholders must be resolved)."""
        return self.has_history_penalties or self.bad_words is not None

    @property
    def has_history_penalties(self) -> bool:
        return not (
            self.repetition_penalty is None
            and self.presence_penalty is None
            and self.frequency_penalty is None
        )

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: list[int],
        device: torch.device,
        num_outputs: list[int] | None = None,
    ) -> SamplingMetadata:
        """Build the step's metadata from one ``SamplingParams`` per row.

        ``num_outputs``: each row's output count before this step's token (default: the length of its
        ``output_token_ids``, which then only need to be complete when a penalty reads them).

        ``top_k`` of -1 or 0 disables top-k. Truncation settings of greedy rows are ignored.
        While a row has fewer than ``min_tokens`` outputs, its eos ids and ``stop_token_ids`` are banned.
        """
        temps = [p.temperature for p in params]
        greedy = [t < GREEDY_TEMPERATURE for t in temps]
        top_k = [0 if g else max(p.top_k, 0) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        rep = [p.repetition_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        use_rep = any(r != 1.0 for r in rep)
        return cls(
            temperature=torch.tensor(
                [0.0 if g else t for t, g in zip(temps, greedy)], dtype=torch.float32, device=device
            ),
            top_k=_tensor_or_none(top_k, 0, torch.int64, device),
            top_p=_tensor_or_none(top_p, 1.0, torch.float32, device),
            min_p=_tensor_or_none(min_p, 0.0, torch.float32, device),
            generators=generators,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            repetition_penalty=_tensor_or_none(rep, 1.0, torch.float32, device),
            presence_penalty=_tensor_or_none(pres, 0.0, torch.float32, device),
            frequency_penalty=_tensor_or_none(freq, 0.0, torch.float32, device),
            prompt_token_ids=prompt_token_ids if use_rep else None,
            output_token_ids=output_token_ids,
            banned_token_ids=_banned_ids(
                params,
                num_outputs if num_outputs is not None else [len(o) for o in output_token_ids],
                eos_token_ids,
            ),
            max_num_logprobs=max(asked) if asked else None,
            max_top_k=max(top_k, default=0),
            logit_bias=LogitBias.from_params(params, device),
            allowed_token_ids=_or_none([p.allowed_token_ids for p in params]),
            bad_words=_or_none([p.bad_words_token_ids or [] for p in params]),
            logprob_token_ids=_or_none([p.logprob_token_ids for p in params]),
        )


def _or_none(values: list) -> list | None:
    """``values`` (one per row), or None when no row has one."""
    return values if any(values) else None


def _tensor_or_none(
    values: list, off: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A [B] tensor of ``values``, or None when every row has the "off" value."""
    if all(v == off for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _banned_ids(
    params: list[SamplingParams], num_outputs: list[int], eos_token_ids: list[int]
) -> list[list[int]] | None:
    """Per row: eos and stop token ids while the row is still under its ``min_tokens``."""
    banned: list[list[int]] = []
    for p, num in zip(params, num_outputs):
        if num < p.min_tokens:
            banned.append(sorted(set(eos_token_ids) | set(p.stop_token_ids)))
        else:
            banned.append([])
    return banned if any(banned) else None
