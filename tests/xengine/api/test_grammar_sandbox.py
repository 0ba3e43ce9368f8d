"""The grammar sandbox: specs that crash, stall or bloat the native grammar library are refused, and
neither the caller nor the sandbox pool suffers for it (real worker processes, real llguidance).

The HTTP-level hazards (the payloads that killed the service) are in
``tests/xservice/serving/test_hazard_structured.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xengine.api.grammar import GrammarSpec, grammar_spec
from xengine.api.grammar_bounds import (
    MAX_GRAMMAR_RULES,
    MAX_JSON_DEPTH,
    SpecTooComplexError,
    check_bounds,
    grammar_depth,
    regex_depth,
)
from xengine.api.grammar_sandbox import GrammarSandbox, SandboxCrashError, SandboxLimits
from xengine.api.messages import StructuredOutputsParams
from xengine.structured.compiler import GrammarCompiler
from xengine.structured.factory import create_backend


def rule_chain(n: int) -> str:
    """The issue's payload: ``start: r0``, ``r0: r1``, ... ``rn: "y"`` (one recursion level per rule)."""
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "y"\n'


def ref_chain(n: int) -> str:
    defs: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


@pytest.fixture(scope="module")
def tokenizer_file(tiny_qwen3: Path) -> Path:
    return tiny_qwen3 / "tokenizer.json"


def test_bounds_refuse_the_crashing_payloads_before_any_library_sees_them() -> None:
    for spec, reason in [
        (GrammarSpec("grammar", rule_chain(3000)), "3002 rules"),
        (GrammarSpec("json", ref_chain(3000)), r"3001 '\$ref' links"),
        (GrammarSpec("regex", "(" * 100 + "a" + ")" * 100), "nests groups more than"),
        (GrammarSpec("grammar", "start: " + "(" * 100 + '"a"' + ")" * 100), "nests groups more than"),
    ]:
        with pytest.raises(SpecTooComplexError, match=reason):
            check_bounds(spec)
    check_bounds(GrammarSpec("grammar", rule_chain(MAX_GRAMMAR_RULES - 2)))  # the bound itself passes


def test_deeply_nested_json_schema_text_is_a_value_error_not_a_recursion_error() -> None:
    for text in ("[" * 950 + "]" * 950, '{"a":' * 950 + "1" + "}" * 950, "[" * 100_000):
        with pytest.raises(ValueError, match="nested more than"):
            StructuredOutputsParams(json=text).validate()
    shallow = '{"a":' * (MAX_JSON_DEPTH - 1) + "1" + "}" * (MAX_JSON_DEPTH - 1)
    StructuredOutputsParams(json=shallow).validate()


def test_depth_counters_ignore_escapes_classes_and_strings_and_stay_linear() -> None:
    assert regex_depth(r"((a)\((b[()]))") == 2  # the escaped and the bracketed parentheses do not nest
    assert grammar_depth('start: ("(" x)+ [y]\nx: /[(]+/ "\\"(" ') == 2
    # unterminated strings / classes are consumed once, not rescanned from every quote
    for text in ('"\\"' * 200_000, "[" * 400_000, '"' + "a" * 400_000, '("' * 200_000):
        grammar_depth(text), regex_depth(text)


def test_a_spec_that_crashes_the_library_kills_only_a_worker_which_is_replaced() -> None:
    # 900 chained rules pass the bounds and llguidance on the default 4 MiB stack; on 256 KiB they
    # overflow it: a real SIGSEGV of the worker process, as the 3000-rule chain did to the service
    sandbox = GrammarSandbox(SandboxLimits(stack_bytes=256 << 10))
    try:
        assert sandbox.run(GrammarSpec("regex", "a+b")) == 0
        with pytest.raises(SandboxCrashError, match="crashed the grammar compiler .*SIGSEGV"):
            sandbox.run(GrammarSpec("grammar", rule_chain(900)))
        assert sandbox.num_crashes == 1
        assert sandbox.run(GrammarSpec("regex", "[0-9]+")) == 0  # a fresh worker took over
        with pytest.raises(ValueError, match="unclosed group"):
            sandbox.run(GrammarSpec("regex", "(a"))  # an invalid spec is an answer, not a crash
        assert sandbox.num_crashes == 1
    finally:
        sandbox.close()
    default = GrammarSandbox()
    try:
        assert default.run(GrammarSpec("grammar", rule_chain(900))) == 0
    finally:
        default.close()


def test_compiled_size_is_measured_and_slow_or_bloating_specs_are_refused(tokenizer_file: Path) -> None:
    bloating = GrammarSpec("regex", "(b{1000}){1000}")  # 16 characters, ~100+ MiB of lexer state
    sandbox = GrammarSandbox(SandboxLimits(timeout_s=30), tokenizer_file, 0, [0])
    try:
        small = sandbox.run(GrammarSpec("regex", "[a-z]{1,8}@[a-z]{1,8}"))
        big = sandbox.run(bloating)
        assert big > 50 * small and big > 32 << 20, (small, big)
    finally:
        sandbox.close()
    slow = GrammarSandbox(SandboxLimits(timeout_s=0.05), tokenizer_file, 0, [0])
    try:
        slow.run(GrammarSpec("regex", "a+"))  # starts the worker (not timed)
        with pytest.raises(SandboxCrashError, match="took longer than 0.05 s"):
            slow.run(bloating)
        assert slow.num_timeouts == 1
        assert slow.run(GrammarSpec("regex", "b+")) >= 0  # replaced
    finally:
        slow.close()
    capped = GrammarSandbox(SandboxLimits(timeout_s=30, memory_bytes=64 << 20), tokenizer_file, 0, [0])
    try:
        with pytest.raises(ValueError, match="memory"):
            capped.run(bloating)  # past its address-space cap: refused, the caller untouched
    finally:
        capped.close()


def test_the_engine_compiler_refuses_a_grammar_over_the_measured_size_limit(tokenizer_file: Path) -> None:
    def factory():
        return create_backend("llguidance", tokenizer_file, 0, [0])

    sandbox = GrammarSandbox(SandboxLimits(timeout_s=30), tokenizer_file, 0, [0])
    compiler = GrammarCompiler(factory, sandbox=sandbox, max_compiled_bytes=32 << 20)
    try:
        with pytest.raises(ValueError, match=r"compiles to \d+ MiB, over this server's limit of 32 MiB"):
            compiler.submit(GrammarSpec("regex", "(b{1000}){1000}")).result(60)
        assert compiler.num_refused_too_large == 1 and len(compiler.cache) == 0
        schema = StructuredOutputsParams(json=json.dumps({"type": "object"}))
        compiled = compiler.submit(grammar_spec(schema)).result(60)
        assert compiled is not None and len(compiler.cache) == 1
        assert 0 < compiler.cache.num_bytes < 32 << 20
    finally:
        compiler.close()
