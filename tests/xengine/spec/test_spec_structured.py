"""Structured outputs under speculative decoding: drafts the grammar rejects are cut before
verification, each verification row is masked by the grammar's state after the drafts before it, and
the matcher advances by the emitted tokens only. 200 constrained generations all validate; greedy ones
equal the engine's without speculation; no matcher is left behind.

A JSON schema whose output repeats itself (an array of the same small objects) gives prompt lookup
something to find in the output, so drafts are proposed, validated and accepted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema

from tests.xengine.conftest import assert_engine_idle
from tests.xengine.structured.test_structured_engine import ARITH, DATE, PERSON
from xengine.api.messages import SamplingParams, StructuredOutputsParams
from xengine.llm import LLM

SETTINGS: dict[str, Any] = dict(
    max_model_len=512, num_blocks=512, max_num_seqs=32, max_num_batched_tokens=256
)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
ROWS = {
    "type": "array",
    "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
              "additionalProperties": False},
    "minItems": 4,
    "maxItems": 8,
}  # fmt: skip


def _cases() -> list[tuple[StructuredOutputsParams, Any, int]]:
    def rows(text: str) -> None:
        jsonschema.validate(json.loads(text), ROWS)

    def person(text: str) -> None:
        jsonschema.validate(json.loads(text), PERSON)

    def date(text: str) -> None:
        assert re.fullmatch(DATE, text), text

    def arith(text: str) -> None:
        assert re.fullmatch(r"[0-9()+*]+", text) and eval(text) >= 1, text  # noqa: S307 - digits and + * ( )

    return [
        (StructuredOutputsParams(json=json.dumps(ROWS), disable_any_whitespace=True), rows, 120),
        (StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True), person, 96),
        (StructuredOutputsParams(regex=DATE), date, 20),
        (StructuredOutputsParams(grammar=ARITH), arith, 64),
    ]


def test_constrained_generations_validate_under_speculation(tiny_qwen3: Path) -> None:
    spec = LLM(str(tiny_qwen3), speculative_config=SPEC, **SETTINGS)
    plain = LLM(str(tiny_qwen3), **SETTINGS)
    free = spec.engine.kv.num_free_blocks
    prompt = spec.tokenizer.encode("Give me rows:")
    cases = _cases()
    params, checks = [], []
    for i in range(200):
        so, check, max_tokens = cases[i % len(cases)]
        temperature = 0.0 if i < len(cases) else 1.0  # the first of each kind greedy, the rest sampled
        params.append(
            SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, structured_outputs=so)
        )
        checks.append(check)
    outputs = spec.generate([prompt] * len(params), params, use_tqdm=False)
    for out, check in zip(outputs, checks):
        got = out.outputs[0]
        assert got.finish_reason == "stop", (got.finish_reason, got.text)
        check(got.text)
    greedy = plain.generate([prompt] * len(cases), params[: len(cases)], use_tqdm=False)
    for g, s in zip(greedy, outputs):
        assert list(s.outputs[0].token_ids) == list(g.outputs[0].token_ids)
    stats = spec.engine.scheduler.drafter.stats
    assert stats.num_accepted_tokens > 100, stats
    assert len(spec.engine.runner.matchers) == 0
    assert_engine_idle(spec.engine, free)


def test_draft_rows_see_the_drafts_and_the_matcher_rolls_back(tiny_qwen3: Path) -> None:
    from xengine.api.grammar import GrammarSpec
    from xengine.structured.bitmask import allocate_bitmask
    from xengine.structured.factory import create_backend
    from xengine.structured.matcher import GrammarRows

    tok = LLM(str(tiny_qwen3), **SETTINGS).tokenizer
    backend = create_backend("llguidance", tiny_qwen3 / "tokenizer.json", 2048, [2, 1])
    grammar = backend.compile(GrammarSpec("regex", "abcabc"))
    text = tok.encode("abcabc")
    matcher = grammar.new_matcher()
    assert matcher.valid_prefix(text + text) == len(text)  # the second copy breaks the regex
    rows = GrammarRows()
    for j in range(len(text) + 1):
        rows.add(j, matcher, grammar.num_ids, text[j] if j < len(text) else None)
    mask = rows.fill_bitmask()
    for j in range(len(text) + 1):  # row j: the mask after the first j tokens, as a fresh matcher sees it
        fresh, want = grammar.new_matcher(), allocate_bitmask(1, grammar.num_ids)
        for t in text[:j]:
            assert fresh.accept_token(t)
        fresh.fill_bitmask(want, 0)
        assert mask[j].tolist() == want[0].tolist(), j
    again = allocate_bitmask(1, grammar.num_ids)
    matcher.fill_bitmask(again, 0)
    assert again[0].tolist() == mask[0].tolist()  # rolled back: the state before the drafts
