"""``SamplingRows``: how one step's logits rows map to sampled tokens, built on the engine thread by
``ModelRunner._sampling_rows`` and read by its sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

from xengine.request import Request
from xengine.sampling.beam_search import BeamRows
from xengine.sampling.metadata import SamplingMetadata
from xengine.spec.verify import DraftGroup
from xengine.structured.matcher import GrammarRows


@dataclass
class SamplingRows:
    """How one step's logits rows map to sampled tokens (built on the engine thread)."""

    rows: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, sample index within it)
    row_of_logit: list[int] = field(default_factory=list)
    beams: BeamRows = field(default_factory=BeamRows)
    beam_seq_ids: list[str] = field(default_factory=list)
    num_outputs: list[int] = field(default_factory=list)  # per row: outputs before this step's token
    # speculative decoding: per row the drafts it follows (its history's tail), and each sampled
    # sequence's rows with its drafts; None in a step without drafts
    row_drafts: list[list[int]] = field(default_factory=list)
    groups: list[DraftGroup] | None = None
    meta: SamplingMetadata | None = None
    grammar: GrammarRows = field(default_factory=GrammarRows)  # structured-output rows and matchers
    # per row its sequence's id, when every row is its sequence's only sample (no forks, no drafts)
    seq_ids: list[str] | None = None
