"""The scheduler's side of speculative decoding (``xengine/spec/drafting.py``, ``stats.py``): which real
``Request``s draft (decoding ones only: no beams, pending forks, grammars, prefill-only requests or
prompts still computing), how long a draft may be (``num_speculative_tokens``, the step's token budget,
``max_tokens``, ``max_model_len``), ``disable_by_batch_size``, methods that cannot build a proposer, and
the proposed / accepted counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from xengine.api.config import SpeculativeConfig
from xengine.api.grammar_spec import GrammarSpec
from xengine.api.sampling_params import SamplingParams
from xengine.request import Request, RequestStatus
from xengine.spec.drafting import Drafter, NgramProposer, build_proposer
from xengine.spec.stats import SpecDecodeStats

# prompt + outputs end in "2 3 4", which occurred at 1 and was followed by 5 1 2 3 4
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
OUTPUTS = [4]
FOLLOWING = [5, 1, 2, 3, 4]
BIG_BUDGET = 1000


def ngram_config(num_tokens: int = 3, **kw: int) -> SpeculativeConfig:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=num_tokens, prompt_lookup_max=3, **kw)
    cfg.validate()
    return cfg


def decoding_request(prompt: list[int] = PROMPT, outputs: list[int] = OUTPUTS, **params: object) -> Request:
    """A running request whose prompt is computed and whose last output token waits to be computed."""
    req = Request("r0", "r0", 0, list(prompt), SamplingParams(**params), output_token_ids=list(outputs))
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_a_decoding_request_drafts_up_to_num_speculative_tokens() -> None:
    drafter = Drafter(ngram_config(3), max_model_len=1024)
    assert drafter.draft(decoding_request(max_tokens=None), BIG_BUDGET, is_beam=False) == FOLLOWING[:3]
    drafter = Drafter(ngram_config(8), max_model_len=1024)
    assert drafter.draft(decoding_request(max_tokens=None), BIG_BUDGET, is_beam=False) == FOLLOWING


@pytest.mark.parametrize(
    ("budget", "max_model_len", "max_tokens", "expected"),
    [
        (4, 1024, None, 3),  # budget 4: the step's own token and 3 drafts
        (3, 1024, None, 2),
        (1, 1024, None, 0),  # room for the step's own token only
        (0, 1024, None, 0),
        (BIG_BUDGET, 9 + 1 + 2, None, 2),  # 9 tokens now; after the step: 9 + drafts + 1 <= 12
        (BIG_BUDGET, 9 + 1, None, 0),
        (BIG_BUDGET, 1024, 1 + 1 + 1, 1),  # 1 output now; after the step: 1 + drafts + 1 <= 3
        (BIG_BUDGET, 1024, 2, 0),
        (BIG_BUDGET, 1024, 100, 3),
    ],
)
def test_draft_length_leaves_room_for_the_steps_own_token(
    budget: int, max_model_len: int, max_tokens: int | None, expected: int
) -> None:
    drafter = Drafter(ngram_config(3), max_model_len=max_model_len)
    draft = drafter.draft(decoding_request(max_tokens=max_tokens), budget, is_beam=False)
    assert draft == FOLLOWING[:expected]


def test_requests_that_need_a_token_at_a_time_do_not_draft() -> None:
    drafter = Drafter(ngram_config(3), max_model_len=1024)
    assert drafter.draft(decoding_request(), BIG_BUDGET, is_beam=True) == []
    forking = decoding_request(n=2)
    forking.num_pending_forks = 1
    assert drafter.draft(forking, BIG_BUDGET, is_beam=False) == []
    # a prefill-only request (max_tokens 0) never drafts, whatever its token counts say
    assert drafter.draft(decoding_request(max_tokens=0), BIG_BUDGET, is_beam=False) == []
    assert drafter.draft(decoding_request(), BIG_BUDGET, is_beam=False) == FOLLOWING[:3]  # the control


def test_a_request_with_a_grammar_drafts_and_its_matcher_cuts_the_draft(tiny_qwen3: Path) -> None:
    """The scheduler drafts as for any request; the runner keeps the prefix the grammar accepts."""
    from xengine.structured.factory import create_backend

    backend = create_backend("llguidance", tiny_qwen3 / "tokenizer.json", 2048, [2, 1])
    req = decoding_request()
    req.grammar = backend.compile(GrammarSpec("regex", "[a-z]+"))
    drafts = Drafter(ngram_config(3), max_model_len=1024).draft(req, BIG_BUDGET, is_beam=False)
    assert drafts == FOLLOWING[:3]
    matcher = req.grammar.new_matcher()
    valid = matcher.valid_prefix(drafts)
    assert 0 <= valid <= len(drafts)
    assert all(matcher.accept_token(t) for t in drafts[:valid])  # the prefix really is acceptable


def test_only_a_request_with_exactly_one_pending_token_drafts() -> None:
    drafter = Drafter(ngram_config(3), max_model_len=1024)
    prefilling = decoding_request(outputs=[])  # its last prompt token is still to compute
    assert prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    assert drafter.draft(prefilling, BIG_BUDGET, is_beam=False) == []
    chunked = decoding_request()
    chunked.num_computed_tokens = 3  # a chunk of the prompt
    assert drafter.draft(chunked, BIG_BUDGET, is_beam=False) == []
    recomputing = decoding_request(outputs=[4, 5])
    recomputing.num_computed_tokens = recomputing.num_tokens - 2  # two tokens to compute
    assert drafter.draft(recomputing, BIG_BUDGET, is_beam=False) == []
    recomputing.num_computed_tokens += 1
    assert drafter.draft(recomputing, BIG_BUDGET, is_beam=False) == [1, 2, 3]  # "3 4 5" at 2


def test_no_draft_without_an_earlier_occurrence() -> None:
    drafter = Drafter(ngram_config(3), max_model_len=1024)
    assert drafter.draft(decoding_request([1, 2, 3, 4], [5]), BIG_BUDGET, is_beam=False) == []


def test_drafts_use_prompt_and_output_tokens() -> None:
    """The suffix and its earlier occurrence may lie in the outputs, the draft may cross into them."""
    drafter = Drafter(ngram_config(4, prompt_lookup_min=2), max_model_len=1024)
    req = decoding_request([9, 8], [7, 6, 9, 8, 7, 5, 9, 8])
    assert drafter.draft(req, BIG_BUDGET, is_beam=False) == [7, 5, 9, 8]
    assert NgramProposer(1, 1).propose(req, 2) == [7, 5]  # "8" last at 4


def test_disable_by_batch_size() -> None:
    always = Drafter(ngram_config(3), max_model_len=1024)
    assert always.enabled_for(0) and always.enabled_for(10_000)
    limited = Drafter(ngram_config(3, disable_by_batch_size=4), max_model_len=1024)
    assert limited.enabled_for(1) and limited.enabled_for(4)
    assert not limited.enabled_for(5)


@pytest.mark.parametrize("method", ["draft_model", "mtp", "eagle", "eagle3"])
def test_methods_whose_proposer_the_engine_builds_are_refused_here(method: str) -> None:
    """Only ngram needs nothing from the engine; a model proposer is built by the engine."""
    cfg = SpeculativeConfig(method=method, num_speculative_tokens=2, model="/some/draft")
    with pytest.raises(ValueError, match=f"speculative_config.method '{method}' needs the engine"):
        build_proposer(cfg)
    with pytest.raises(ValueError, match="needs the engine"):
        Drafter(cfg, max_model_len=1024)


def test_ngram_proposer_from_config() -> None:
    proposer = build_proposer(ngram_config(3, prompt_lookup_min=2))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n) == (2, 3)


def test_stats_count_drafts_tokens_and_acceptance_per_position() -> None:
    stats = SpecDecodeStats()
    assert (stats.acceptance_rate, stats.mean_accepted_length, stats.acceptance_per_pos()) == (0.0, 0.0, [])
    stats.record(0, 0)  # a step without a draft is no draft
    assert stats == SpecDecodeStats()
    stats.record(3, 2)
    stats.record(1, 0)
    stats.record(4, 4)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 6)
    assert stats.proposed_per_pos == [3, 2, 2, 1]
    assert stats.accepted_per_pos == [2, 2, 1, 1]
    assert stats.acceptance_rate == 6 / 8
    assert stats.mean_accepted_length == 1 + 6 / 3  # accepted drafts plus the target's own token
    assert stats.acceptance_per_pos() == [2 / 3, 1.0, 0.5, 1.0]


def test_drafter_starts_with_zero_counters() -> None:
    drafter = Drafter(ngram_config(3), max_model_len=1024)
    assert drafter.stats == SpecDecodeStats()
    drafter.draft(decoding_request(), BIG_BUDGET, is_beam=False)
    assert drafter.stats.num_drafts == 0  # drafting alone counts nothing: the verified step does
