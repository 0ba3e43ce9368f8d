"""Structured-output building blocks on the tiny model's real tokenizer: the llguidance backend, the
compiled-grammar cache and compile worker, bitmasks, and the sampler's token-level constraints.

Engine-level behaviour (n > 1, async scheduling, preemption, aborts) is in ``test_structured_engine.py``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from xengine.api.grammar import FLEXIBLE_WHITESPACE, GrammarSpec, check_spec, grammar_spec
from xengine.api.messages import StructuredOutputsParams
from xengine.api.text.tokenizer import Tokenizer
from xengine.sampling.constraints import (
    LogitBias,
    apply_allowed_token_ids,
    apply_grammar,
    apply_logit_bias,
    bad_words_bans,
)
from xengine.structured.bitmask import allocate_bitmask, allowed_ids, apply_bitmask
from xengine.structured.cache import CompiledGrammarCache
from xengine.structured.compiler import GrammarCompiler
from xengine.structured.factory import create_backend
from xengine.structured.llguidance_backend import LLGuidanceBackend

EOS = [2, 1]  # <|im_end|>, <|endoftext|> of the tiny tokenizer
VOCAB = 2048


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def backend(tiny_qwen3: Path) -> LLGuidanceBackend:
    return create_backend("llguidance", tiny_qwen3 / "tokenizer.json", VOCAB, EOS)


def _spec(**kw) -> GrammarSpec:
    so = StructuredOutputsParams(**kw)
    so.validate()
    return grammar_spec(so)


def _walk(backend, spec: GrammarSpec, tokenizer: Tokenizer, text: str):
    """A matcher fed ``text``'s tokens, each checked against the mask computed before it."""
    matcher = backend.compile(spec).new_matcher()
    bitmask = allocate_bitmask(1, backend.num_ids)
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        assert token in allowed_ids(bitmask[0], backend.num_ids)
        assert matcher.accept_token(token)
    return matcher, bitmask


def test_a_complete_output_allows_only_eos(backend, tokenizer) -> None:
    spec = _spec(choice=["yes", "no way"])
    matcher, bitmask = _walk(backend, spec, tokenizer, "no way")
    assert matcher.is_terminated()
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0], VOCAB) == sorted(EOS)
    assert matcher.accept_token(EOS[0])  # ending is what the mask allowed
    fresh = backend.compile(spec).new_matcher()
    assert not fresh.accept_token(tokenizer.encode("maybe", add_special_tokens=False)[0])


def test_json_whitespace_options(backend, tokenizer) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    compact = _spec(json=schema, disable_any_whitespace=True)
    flexible = _spec(json=schema)
    assert compact.whitespace is None and flexible.whitespace == FLEXIBLE_WHITESPACE
    _walk(backend, compact, tokenizer, '{"a":12}')
    _walk(backend, flexible, tokenizer, '{ "a" :\n  12 }')
    with pytest.raises(AssertionError):  # no whitespace at all when disabled
        _walk(backend, compact, tokenizer, '{"a": 12}')
    with pytest.raises(AssertionError):  # a run longer than MAX_JSON_WHITESPACE is refused
        _walk(backend, flexible, tokenizer, '{"a":' + " " * 65 + "12}")


def test_spec_keeps_property_order_and_closes_objects() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "object", "properties": {"b": {}}}, "a": {}}}
    spec = _spec(json=json.dumps(schema), disable_additional_properties=True)
    closed = json.loads(spec.source)
    assert list(closed["properties"]) == ["z", "a"]  # the order properties are generated in
    assert closed["additionalProperties"] is False
    assert closed["properties"]["z"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["a"]  # not an object schema
    assert _spec(json_object=True) == _spec(json=json.dumps({"type": "object"}))


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(json='{"type": "foo"}'), "Invalid type"),
        (dict(json='{"type": "string", "pattern": "(?=a)"}'), "look-around"),
        (dict(regex="a("), "unclosed group"),
        (dict(grammar="root ::= undefined_rule"), "not found"),
        (dict(grammar="start: undefined_rule"), "unknown name"),
    ],
)
def test_invalid_specs_fail_with_the_reason(backend, kw, reason) -> None:
    spec = _spec(**kw)
    with pytest.raises(ValueError, match=reason):
        check_spec(spec)  # what the service runs (no tokenizer)
    with pytest.raises(ValueError, match=reason):
        backend.compile(spec)  # what the engine runs


@pytest.mark.parametrize(
    "kw, rule",
    [
        (dict(), "exactly one"),
        (dict(json="{}", regex="a"), "exactly one"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(json="[1]"), "must be an object"),
        (dict(choice=[]), "1..1024 strings"),
        (dict(regex="a", disable_any_whitespace=True), "applies only to 'json'"),
        (dict(structural_tag="{}"), "not supported"),
    ],
)
def test_cheap_checks_name_the_field(kw, rule) -> None:
    with pytest.raises(ValueError, match=rf"invalid value for 'structured_outputs': .*{rule}"):
        StructuredOutputsParams(**kw).validate()


def test_compiler_caches_and_shares_in_flight_compiles(backend) -> None:
    gate = threading.Event()

    def slow_factory():
        gate.wait(30)  # the first compile builds the backend: hold it until both submits are in
        return backend

    compiler = GrammarCompiler(slow_factory)
    try:
        spec = _spec(regex="[a-c]{3}")
        first, second = compiler.submit(spec), compiler.submit(spec)
        assert first is second and not first.done()  # one compile for concurrent identical requests
        gate.set()
        compiled = first.result(30)
        third = compiler.submit(_spec(regex="[a-c]{3}"))
        assert third.done() and third.result() is compiled  # a cache hit: no wait at all
        assert compiler.num_compiles == 1 and compiler.cache.num_hits == 1
        bad = compiler.submit(_spec(regex="a("))
        assert isinstance(bad.exception(30), ValueError)
        assert len(compiler.cache) == 1  # failures are not cached
    finally:
        gate.set()
        compiler.close()


def test_cache_is_lru_bounded_by_entries_and_measured_bytes() -> None:
    compiled = object()  # the cache never looks inside a compiled grammar
    cache = CompiledGrammarCache(max_entries=3, max_bytes=1000)
    specs = [GrammarSpec("regex", f"[a-z]{{{i}}}") for i in range(4)]  # 8 characters each
    for spec in specs[:3]:
        cache.put(spec, compiled, 92)  # charged 100 bytes each
    assert cache.get(specs[0]) is compiled  # now the most recently used
    cache.put(specs[3], compiled, 92)
    assert len(cache) == 3 and cache.get(specs[1]) is None  # the least recently used went
    tiny_but_big = GrammarSpec("regex", "b{99}")  # a short spec whose compiled state is large
    cache.put(tiny_but_big, compiled, 815)  # 200 + 820 > 1000 bytes: two more go, not just one
    assert cache.get(tiny_but_big) is compiled and cache.get(specs[3]) is compiled
    assert len(cache) == 2 and cache.num_bytes == 920
    cache.put(GrammarSpec("regex", "c"), compiled, 1000)  # larger than the whole budget: not kept
    assert len(cache) == 2 and cache.num_bytes == 920
    cache.put(specs[3], compiled, 92)  # put again: charged once
    assert cache.num_bytes == 920


def test_bitmask_application_matches_unpacked_bits() -> None:
    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32: the tail bits of the last word are ignored
    bitmask = allocate_bitmask(3, vocab)
    bitmask.copy_(torch.from_numpy(rng.integers(-(2**31), 2**31 - 1, bitmask.shape, dtype=np.int32)))
    logits = torch.randn(5, vocab)
    out = apply_bitmask(logits.clone(), bitmask, [4, 0, 2])
    for i, row in enumerate([4, 0, 2]):
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[allowed_ids(bitmask[i], vocab)] = True
        expected = logits[row].masked_fill(~allowed, float("-inf"))
        assert torch.equal(out[row], expected)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched


def test_grammar_wins_over_bans_that_would_leave_nothing() -> None:
    logits = torch.randn(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b1100  # ids 2 and 3 only
    banned = logits.clone()
    banned[0, 2:4] = float("-inf")  # e.g. min_tokens banning the only ids the grammar allows
    out = apply_grammar(banned, logits, bitmask, [0, 1])
    for row in (0, 1):
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert finite == [2, 3]
        assert torch.equal(out[row, 2:4], logits[row, 2:4])
    # nothing applied before the grammar (the sampler passes the same tensor twice): never written
    before = logits.clone()
    for rows, masks in (([1], bitmask[1:]), ([0, 1], bitmask)):  # some rows / every row
        out = apply_grammar(logits, logits, masks, rows)
        assert torch.equal(logits, before)
        for row in rows:
            assert torch.isfinite(out[row]).nonzero().flatten().tolist() == [2, 3]
    assert torch.equal(out[0, 2:4], logits[0, 2:4])


def test_logit_bias_allow_list_and_bad_words() -> None:
    from xengine.api.messages import SamplingParams

    logits = torch.zeros(3, 10)
    params = [
        SamplingParams(logit_bias={3: 5.0, 7: -2.5}),
        SamplingParams(),
        SamplingParams(logit_bias={0: 1}),
    ]
    out = apply_logit_bias(logits, LogitBias.from_params(params, logits.device))
    assert out[0, 3] == 5.0 and out[0, 7] == -2.5 and out[2, 0] == 1.0
    assert out.abs().sum() == 8.5 and logits.abs().sum() == 0  # a new tensor
    allowed = apply_allowed_token_ids(logits, [None, [1, 4], None])
    assert torch.isfinite(allowed[1]).nonzero().flatten().tolist() == [1, 4]
    assert torch.isfinite(allowed[[0, 2]]).all()
    words = [[[5], [1, 2, 3], [9, 9]], [[1, 2, 3]]]
    assert bad_words_bans(words, [[0, 1, 2], [2, 1]]) == [[5, 3], []]
    assert bad_words_bans(words, [[9], [1, 2]]) == [[5, 9], [3]]
