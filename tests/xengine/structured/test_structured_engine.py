"""Structured outputs and token-level constraints in the engine, on the tiny model.

The oracle for a constrained greedy run is HF ``generate`` on the same weights with llguidance's
own mask applied by a logits processor: tokens must be identical. Every sampled output must parse
and validate; async scheduling, ``n > 1`` forks and preemption (recompute) must not change a token;
grammars compile off the engine loop without holding other requests up; aborts and invalid grammars
end requests cleanly, leaving no matcher behind.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import torch

from tests.xengine.conftest import assert_engine_idle, make_engine, run_to_completion
from xengine.api.messages import AddRequest, SamplingParams, StructuredOutputsParams
from xengine.api.text.tokenizer import Tokenizer
from xengine.llm import LLM
from xengine.structured.compiler import GrammarCompiler
from xengine.structured.manager import StructuredOutputs

SETTINGS: dict[str, Any] = dict(max_model_len=256, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)

# Bounded strings, enums and bounded integers, no free whitespace: a random tiny model then always
# finishes well within max_tokens (an unbounded string or number it could extend forever).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"
ARITH = 'root ::= expr\nexpr ::= num | "(" expr ("+" | "*") expr ")"\nnum ::= [1-9] [0-9]?\n'
COLORS = ["red", "green", "blue", "light grey"]


def _json(**kw: Any) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=json.dumps(PERSON), disable_any_whitespace=True, **kw)


def _closers(tokenizer: Tokenizer) -> dict[int, float]:
    """A bias towards '"' and '}': any JSON object (unlike a schema) has unbounded strings, which a
    random model may never close; with these it does, and the bias composes with the grammar."""
    return {tokenizer.token_to_id('"'): 6.0, tokenizer.token_to_id("}"): 6.0}


def _cases(tokenizer: Tokenizer) -> list[tuple[SamplingParams, Any]]:
    """(params, checker of one output text) pairs covering every kind of constraint."""

    def person(text: str) -> None:
        jsonschema.validate(json.loads(text), PERSON)

    def obj(text: str) -> None:
        assert isinstance(json.loads(text), dict)

    def date(text: str) -> None:
        assert re.fullmatch(DATE, text), text

    def arith(text: str) -> None:
        assert re.fullmatch(r"[0-9()+*]+", text) and eval(text) >= 1, text  # noqa: S307 - digits and + * ( )

    def color(text: str) -> None:
        assert text in COLORS, text

    js = _json()
    return [
        (SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=js), person),
        (SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=96, structured_outputs=js), person),
        (
            SamplingParams(
                temperature=0.9,
                seed=3,
                max_tokens=120,
                structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                logit_bias=_closers(tokenizer),
            ),
            obj,
        ),
        (SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=DATE)), date),
        (
            SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=64, structured_outputs=StructuredOutputsParams(grammar=ARITH)),
            arith,
        ),
        (SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=COLORS)), color),
        (SamplingParams(temperature=1.0, seed=9, max_tokens=12, repetition_penalty=1.3), None),  # unconstrained
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    texts = ["Give me a person:", "Date:", "JSON please", "Compute", "Pick a colour", "x", "Hello there"]
    return [tokenizer.encode(t) for t in texts]


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[tuple[list[int], str | None]]]:
    params = [p for p, _ in _cases(llm.tokenizer)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outs]


def _check_all(results, tokenizer: Tokenizer) -> None:
    for (params, check), seqs in zip(_cases(tokenizer), results):
        assert len(seqs) == params.n
        for ids, finish in seqs:
            if check is not None:
                assert finish == "stop", (finish, tokenizer.decode(ids))  # the grammar ended it
                check(tokenizer.decode(ids))


def test_outputs_follow_their_grammar_and_async_changes_nothing(tiny_qwen3: Path, prompts, tokenizer) -> None:
    results = {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny_qwen3), async_scheduling=mode, **SETTINGS)
        free = llm.engine.kv.num_free_blocks
        results[mode] = _run(llm, prompts)
        results[mode] += _run(llm, prompts[::-1])  # again: cached grammars, reused blocks
        run_to_completion(llm.engine)  # async: a step past an eos may still be in flight
        assert_engine_idle(llm.engine, free)
        assert len(llm.engine.runner.matchers) == 0  # every sequence released its matcher
        assert llm.engine.structured.compiler.num_compiles == 5  # each distinct grammar once
    _check_all(results["off"][:7], tokenizer)
    _check_all(results["off"][7:], tokenizer)
    assert results["on"] == results["off"]


def test_preemption_keeps_parse_state(tiny_qwen3: Path, prompts, tokenizer) -> None:
    """A KV pool too small for the batch forces recompute preemptions; outputs stay identical."""
    roomy = _run(LLM(str(tiny_qwen3), **SETTINGS), prompts)
    for mode in ("off", "on"):
        tight = LLM(str(tiny_qwen3), async_scheduling=mode, **{**SETTINGS, "num_blocks": 10, "block_size": 8})
        assert _run(tight, prompts) == roomy
        assert tight.engine.get_stats().num_preemptions > 0


def test_prefix_cache_hit_changes_nothing(tiny_qwen3: Path, tokenizer) -> None:
    """Constrained requests whose prompt is found in the prefix cache sample exactly what they did on
    a cold cache: the matcher follows output tokens only, whatever part of the prompt was computed."""
    llm = LLM(str(tiny_qwen3), **SETTINGS)
    prompt = tokenizer.encode("You are a careful assistant that writes records. " * 6)  # several blocks
    params = [
        SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=_json()),
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=96, structured_outputs=_json()),
    ]

    def run() -> list[list[list[int]]]:
        outs = llm.generate([prompt, prompt], params, use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]

    cold = run()
    hits = llm.engine.get_stats().prefix_cache_hits
    warm = run()
    assert llm.engine.get_stats().prefix_cache_hits >= hits + len(prompt) // 2
    assert warm == cold
    for seqs in warm:
        for ids in seqs:
            jsonschema.validate(json.loads(tokenizer.decode(ids)), PERSON)


def test_a_resumed_request_continues_its_grammar(tiny_qwen3: Path, prompts, tokenizer) -> None:
    """A request continued on another instance (PD hand-off, migration: ``InstancePool.continuation``)
    arrives with its generated tokens at the end of its prompt and in ``resume_token_ids``; its
    matcher starts past them, so generated + continuation is the uninterrupted output."""
    llm = LLM(str(tiny_qwen3), **SETTINGS)
    prompt, k = prompts[0], 5

    def greedy(prompt_ids: list[int], so: StructuredOutputsParams, max_tokens: int = 96) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
        return list(llm.generate([prompt_ids], params, use_tqdm=False)[0].outputs[0].token_ids)

    whole = greedy(prompt, _json())
    head = whole[:k]
    resumed = greedy(prompt + head, msgspec.structs.replace(_json(), resume_token_ids=head), 96 - k)
    assert head + resumed == whole
    jsonschema.validate(json.loads(tokenizer.decode(head + resumed)), PERSON)
    restarted = greedy(prompt + head, _json(), 96 - k)  # what the grammar did before: a new document
    assert head + restarted != whole
    # tokens the grammar rejects: the sequence may only end (eos at once), never go on unconstrained
    junk = tokenizer.encode("}}", add_special_tokens=False)
    ended = greedy(prompt + junk, msgspec.structs.replace(_json(), resume_token_ids=junk), 20)
    assert len(ended) == 1 and ended[0] in llm.engine.model_info.eos_token_ids
    so = msgspec.structs.replace(_json(), resume_token_ids=[7])
    with pytest.raises(ValueError, match="must be the end of the prompt"):
        llm.engine.add_request(
            AddRequest(req_id="x", prompt_token_ids=[5, 6], params=SamplingParams(structured_outputs=so))
        )
    so = msgspec.structs.replace(_json(), resume_token_ids=[10**6])
    with pytest.raises(ValueError, match="structured_outputs.*not in the vocabulary"):
        llm.engine.add_request(
            AddRequest(req_id="y", prompt_token_ids=[5, 6], params=SamplingParams(structured_outputs=so))
        )


class _MaskedGreedy:
    """HF logits processor: llguidance's mask for the tokens generated so far (the oracle's own matcher)."""

    def __init__(self, tiny_qwen3: Path, schema: str, prompt_len: int, eos_token_ids: list[int]) -> None:
        import llguidance as llg

        tokenizer_json = (tiny_qwen3 / "tokenizer.json").read_text()
        tok = llg.LLTokenizer(tokenizer_json, n_vocab=2048, eos_token=eos_token_ids)
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        self.matcher = llg.LLMatcher(tok, grammar)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import llguidance.torch as llg_torch

        generated = input_ids[0, self.prompt_len :].tolist()
        if generated:
            assert self.matcher.consume_token(generated[-1])
        bitmask = llg_torch.allocate_token_bitmask(1, scores.shape[1])
        llg_torch.fill_next_token_bitmask(self.matcher, bitmask)
        bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(1, -1)
        return scores.masked_fill(bits[:, : scores.shape[1]] == 0, float("-inf"))


def test_constrained_greedy_matches_hf_with_the_same_mask(tiny_qwen3: Path, hf_oracle, prompts) -> None:
    from transformers import LogitsProcessorList

    oracle = hf_oracle("qwen3")
    llm = LLM(str(tiny_qwen3), **SETTINGS)
    schema = json.dumps(PERSON)
    for prompt in prompts[:3]:
        ours = llm.generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=_json()),
            use_tqdm=False,
        )
        processor = _MaskedGreedy(tiny_qwen3, schema, len(prompt), oracle.eos_token_ids)
        theirs = oracle.greedy(
            prompt, 96, ignore_eos=False, logits_processor=LogitsProcessorList([processor])
        )
        assert list(ours[0].outputs[0].token_ids) == theirs  # including the eos that ended it


def test_logit_bias_allowed_ids_and_bad_words(tiny_qwen3: Path, prompts) -> None:
    llm = LLM(str(tiny_qwen3), **SETTINGS)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = llm.generate(prompts[:2], SamplingParams(**greedy), use_tqdm=False)
    base_ids = [list(o.outputs[0].token_ids) for o in base]
    forced = llm.generate(prompts[:2], SamplingParams(**greedy, logit_bias={1234: 100.0}), use_tqdm=False)
    assert all(list(o.outputs[0].token_ids) == [1234] * 12 for o in forced)
    allowed = [500, 600, 700]
    outs = llm.generate(prompts[:2], SamplingParams(**greedy, allowed_token_ids=allowed), use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs)
    # ban the pair the greedy output starts with: its second token can no longer follow its first
    pair = base_ids[0][:2]
    banned = llm.generate(prompts[0], SamplingParams(**greedy, bad_words_token_ids=[pair]), use_tqdm=False)
    ids = list(banned[0].outputs[0].token_ids)
    assert ids[0] == pair[0] and ids[1] != pair[1]
    assert all(ids[i : i + 2] != pair for i in range(len(ids) - 1))
    single = llm.generate(
        prompts[0], SamplingParams(**greedy, bad_words_token_ids=[[pair[0]]]), use_tqdm=False
    )
    assert pair[0] not in single[0].outputs[0].token_ids


def test_min_tokens_cannot_break_the_grammar(tiny_qwen3: Path) -> None:
    """min_tokens bans eos where the grammar allows only eos: the grammar wins, the text stays valid."""
    llm = LLM(str(tiny_qwen3), **SETTINGS)
    so = StructuredOutputsParams(choice=["red"])
    out = llm.generate(
        [[5, 6, 7]],
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, structured_outputs=so),
        use_tqdm=False,
    )
    assert out[0].outputs[0].text == "red"


class _GatedBackend:
    """The real backend, whose creation (hence the first compile) waits for ``gate``: makes "still
    compiling" last as long as the test needs."""

    def __init__(self, engine) -> None:
        self.gate = threading.Event()
        real = StructuredOutputs.for_model(
            str(engine.config.model.model), engine.vocab_size, engine.model_info.eos_token_ids
        )
        factory, sandbox = real.compiler._backend_factory, real.compiler.sandbox
        engine.structured = StructuredOutputs(
            GrammarCompiler(lambda: (self.gate.wait(60), factory())[1], sandbox=sandbox)
        )


def test_compiles_off_the_loop_abort_and_invalid_grammar(tiny_qwen3: Path) -> None:
    engine = make_engine(tiny_qwen3, **SETTINGS)
    free = engine.kv.num_free_blocks
    gated = _GatedBackend(engine)
    so = StructuredOutputsParams(regex="[a-z]{4}")
    engine.add_request(
        AddRequest(
            req_id="slow", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=8, structured_outputs=so)
        )
    )
    engine.add_request(
        AddRequest(
            req_id="aborted",
            prompt_token_ids=[5, 6],
            params=SamplingParams(n=2, structured_outputs=StructuredOutputsParams(regex="x+")),
        )
    )
    engine.add_request(
        AddRequest(
            req_id="free", prompt_token_ids=[7, 8], params=SamplingParams(max_tokens=5, ignore_eos=True)
        )
    )
    deltas = []
    while not any(d.req_id == "free" and d.finish_reason for d in deltas):
        deltas += engine.step()  # the unconstrained request runs to the end while the grammar compiles
    assert not any(d.req_id in ("slow", "aborted") for d in deltas)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(AddRequest(req_id="slow", prompt_token_ids=[1], params=SamplingParams()))
    engine.abort_requests(["aborted"])
    bad = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    engine.add_request(
        AddRequest(req_id="bad", prompt_token_ids=[5], params=SamplingParams(structured_outputs=bad))
    )
    gated.gate.set()
    deltas += run_to_completion(engine)
    finished = {(d.req_id, d.index): d for d in deltas if d.finish_reason}
    assert finished["aborted", 0].finish_reason == finished["aborted", 1].finish_reason == "abort"
    assert finished["bad", 0].finish_reason == "error"
    assert finished["bad", 0].error.startswith("invalid value for 'structured_outputs': ")
    slow = [t for d in deltas if d.req_id == "slow" for t in d.new_token_ids]
    assert finished["slow", 0].finish_reason == "stop"
    assert re.fullmatch("[a-z]{4}", Tokenizer.from_dir(tiny_qwen3).decode(slow))
    assert_engine_idle(engine, free)
    assert len(engine.runner.matchers) == 0 and len(engine.structured.waiting) == 0
