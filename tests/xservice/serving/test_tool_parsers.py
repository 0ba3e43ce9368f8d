"""Tool-call parsers, constraints and plans, without a server: whole outputs, and the same outputs
streamed in pieces split at every character boundary (the calls and content must not change)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from xservice.http.errors import InvalidRequestError
from xservice.protocol.tools import FunctionDefinition, NamedToolChoice
from xservice.serving.chat_output import chat_deltas
from xservice.serving.tools.base import ArgsDelta, BaseToolParser, CallStart, ParsedOutput, TextDelta
from xservice.serving.tools.constraint import forced_calls_schema
from xservice.serving.tools.hermes import HermesToolParser
from xservice.serving.tools.json_array import JsonArrayToolParser
from xservice.serving.tools.plan import plan_tools
from xservice.serving.tools.registry import resolve_family

WEATHER_ARGS = '{"city": "Paris", "note": "a } and \\" and </tool_call> inside", "days": [1, {"x": 2}]}'

# (output text, expected content, expected [(name, arguments)])
HERMES_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("Hello world", "Hello world", []),
    ("Hi \n", "Hi \n", []),
    ("a <tools> b <tool", "a <tools> b <tool", []),
    (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    # another key order, and arguments as a JSON string: parsed when the object closes
    (
        '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
        None,
        [("search", '{"q": "x"}')],
    ),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("f", '{"a": 1}')]),
    # not a call: the block is content, nothing is lost
    ("x <tool_call>not json</tool_call> y", "x<tool_call>not json</tool_call> y", []),
    ('<tool_call>{"nam": 1}</tool_call>', '<tool_call>{"nam": 1}</tool_call>', []),
    # cut off by the end of the output
    ('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', None, [("f", '{"a": [1, 2')]),
    ('ok <tool_call>\n{"name": "f"', 'ok<tool_call>\n{"name": "f"', []),
]

ARRAY_CASES: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ('[{"name": "a", "arguments": {"x": [1, 2]}}]', None, [("a", '{"x": [1, 2]}')]),
    (
        f' [ {{"name": "get_weather", "arguments": {WEATHER_ARGS}}} , {{"name": "b", "arguments": {{}}}} ] ',
        None,
        [("get_weather", WEATHER_ARGS), ("b", "{}")],
    ),
    ('[{"arguments": {"q": 1}, "name": "s"}]', None, [("s", '{"q": 1}')]),
    ('[{"name": "a", "arguments": {"x": "tru', None, [("a", '{"x": "tru')]),
    ("plain text", "plain text", []),
]


def summary(out: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return out.content, [(c.name, c.arguments) for c in out.calls]


def run(parser: BaseToolParser, pieces: list[str]) -> ParsedOutput:
    out = ParsedOutput()
    for piece in pieces:
        out.add(parser.feed(piece))
    out.add(parser.finish())
    return out


def check_every_split(make: type[BaseToolParser], text: str, expected: Any) -> None:
    assert summary(run(make(), [text])) == expected
    assert summary(run(make(), list(text))) == expected  # one character at a time
    for i in range(len(text) + 1):
        assert summary(run(make(), [text[:i], text[i:]])) == expected, f"split at {i}"


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_whole_and_split(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    check_every_split(HermesToolParser, text, (content, calls))


@pytest.mark.parametrize("text,content,calls", ARRAY_CASES)
def test_json_array_whole_and_split(text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    check_every_split(JsonArrayToolParser, text, (content, calls))


def test_arguments_stream_as_they_are_written() -> None:
    text = f'Sure.<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
    parser = HermesToolParser()
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    start = next(i for i, e in enumerate(events) if isinstance(e, CallStart))
    assert "".join(e.text for e in events[:start] if isinstance(e, TextDelta)) == "Sure."
    args = [e for e in events if isinstance(e, ArgsDelta)]
    assert len(args) == len(WEATHER_ARGS)  # a fragment per character fed: nothing waits for the end
    assert "".join(a.text for a in args) == WEATHER_ARGS and json.loads(WEATHER_ARGS)
    # chat deltas: the call's first delta has id, type and name; later ones only arguments
    content, deltas = chat_deltas(events[start : start + 2])
    assert content is None and deltas is not None
    first = deltas[0].model_dump()
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": args[0].text}
    later = chat_deltas(events[start + 2 : start + 3])[1]
    assert later is not None and later[0].model_dump() == {
        "index": 0,
        "function": {"arguments": args[1].text},
    }


def test_parallel_calls_off_keeps_the_first() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert summary(run(HermesToolParser(max_calls=1), list(text))) == (None, [("a", "{}")])
    array = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert summary(run(JsonArrayToolParser(max_calls=1), [array])) == (None, [("a", "{}")])


# ---------------------------------------------------------------- constraint


class Address(BaseModel):
    street: str
    zip_code: int


class Person(BaseModel):
    name: str
    home: Address
    friends: list[Address] = []


def fn(name: str, parameters: dict | None = None, **kw: Any) -> FunctionDefinition:
    return FunctionDefinition(name=name, parameters=parameters, **kw)


def test_forced_schema_accepts_calls_and_refuses_others() -> None:
    tools = [
        {"type": "function", "function": {"name": "person", "parameters": Person.model_json_schema()}},
        {"type": "function", "function": {"name": "ping"}},
    ]
    schema = forced_calls_schema(tools, None)
    assert "$defs" in schema and all(k.startswith("tool0_") for k in schema["$defs"])  # hoisted, renamed
    good = [
        {"name": "person", "arguments": {"name": "A", "home": {"street": "s", "zip_code": 1}}},
        {"name": "ping", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],  # at least one call
        [{"name": "other", "arguments": {}}],
        [{"name": "person", "arguments": {"name": "A", "home": {"street": "s", "zip_code": "x"}}}],
        [{"name": "ping"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, forced_calls_schema(tools, 1))  # parallel_tool_calls false: one call


# ---------------------------------------------------------------- plan

HERMES = resolve_family("hermes", None, "")
TEMPLATE_VARS = frozenset({"messages", "tools"})


def plan(functions, choice=None, parallel=True, family=HERMES, names=TEMPLATE_VARS):
    return plan_tools(functions, choice, parallel, family, names)


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_plan_modes() -> None:
    tools = [fn("a", {"type": "object", "properties": {}}), fn("b")]
    assert plan(None).mode == "none" and plan([], "auto").mode == "none"
    assert plan(tools, "none").mode == "none" and plan(tools, "none").tools is None  # not offered
    auto = plan(tools)
    assert auto.mode == "auto" and auto.structured is None and isinstance(auto.new_parser(), HermesToolParser)
    assert [t["function"]["name"] for t in auto.tools] == ["a", "b"]
    required = plan(tools, "required", parallel=False)
    assert required.mode == "forced" and required.max_calls == 1
    assert json.loads(required.structured.json)["maxItems"] == 1
    one = plan(tools, named("b"))
    assert [v["properties"]["name"]["enum"] for v in [json.loads(one.structured.json)["items"]]] == [["b"]]

    # strict tools under "auto": a structural tag in the family's syntax; refused (a 400 naming the
    # field) while the engine's structured outputs take no structural tags
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}, "strict": True}}
    ]
    tag = json.loads(HERMES.strict_constraint(tools).structural_tag)
    assert tag["triggers"] == ["<tool_call>"]
    assert tag["structures"][0] == {
        "begin": '<tool_call>\n{"name": "a", "arguments": ',
        "schema": {"type": "object"},
        "end": "}\n</tool_call>",
    }
    with pytest.raises(InvalidRequestError) as err:
        plan([fn("a", {"type": "object"}), fn("b", {"type": "object"}, strict=True)])
    assert err.value.param == "tools.1.function.strict" and "structural tag" in err.value.message


@pytest.mark.parametrize(
    "functions,choice,kw,param",
    [
        ([fn("bad name")], None, {}, "tools.0.function.name"),
        ([fn("a"), fn("a")], None, {}, "tools.1.function.name"),
        ([fn("a", {"type": "string"})], None, {}, "tools.0.function.parameters"),
        ([fn("a")], named("b"), {}, "tool_choice"),
        (None, "required", {}, "tool_choice"),
        ([fn("a")], None, {"names": frozenset({"messages"})}, "tools"),  # the template renders no tools
        ([fn("a")], "auto", {"family": None}, "tool_choice"),  # no parser for this model
        ([fn("a", {"type": "object", "properties": {"x": {"type": "nonsense"}}})], "required", {}, "tools"),
    ],
)
def test_plan_refusals_name_the_field(functions, choice, kw, param) -> None:
    with pytest.raises(InvalidRequestError) as err:
        plan(functions, choice, **kw)
    assert err.value.param == param


def test_family_detection(tmp_path) -> None:
    assert resolve_family("auto", "... <tool_call> ...", str(tmp_path)).name == "hermes"
    assert resolve_family("auto", "plain", str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert resolve_family("auto", "plain", str(tmp_path)).name == "hermes"
    assert resolve_family("none", "<tool_call>", str(tmp_path)) is None
