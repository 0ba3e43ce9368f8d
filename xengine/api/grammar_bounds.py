"""Cheap bounds on a schema, regex or grammar, checked before any grammar library sees it (torch-free).

The grammar library (llguidance, native code) recurses over a spec's structure: a chain of a few
thousand Lark rules or ``$ref`` links overflows its stack and kills the process. So before a spec
reaches it, in the service or the engine, its nesting and link counts are bounded here in plain
Python (iteratively, so the check itself cannot overflow). Specs within these bounds are still
compiled in a sandbox process first (``grammar_sandbox``); these bounds make the common attacks a
400 without a process hop and keep the sandbox's work small. Real schemas and grammars stay far
below them (``docs/structured_outputs.md``).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from xengine.api.grammar_spec import GrammarSpec

MAX_JSON_DEPTH = 64  # nesting of the schema document (objects and arrays)
MAX_SCHEMA_REFS = 512  # "$ref" keywords in one schema
MAX_SCHEMA_NODES = 50_000  # objects, arrays and scalars in one schema document
MAX_GRAMMAR_RULES = 1000  # rule definitions in a Lark / GBNF grammar
MAX_REGEX_DEPTH = 64  # group nesting of a regex (and of regexes inside a grammar)

# a rule definition at the start of a line: Lark ``name:`` / ``?name.2:`` / ``NAME:``, GBNF ``name ::=``
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)


class SpecTooComplexError(ValueError):
    """A spec over one of the bounds (a ``ValueError``: the service answers 400 naming the field)."""


def parse_json_bounded(text: str, what: str = "the JSON schema") -> Any:
    """``json.loads(text)`` whose nesting is bounded: ``ValueError`` (never ``RecursionError``) when
    it is nested more than ``MAX_JSON_DEPTH`` levels. ``json.decoder.JSONDecodeError`` when malformed."""
    try:
        value = json.loads(text)
    except RecursionError:  # the C decoder stops at Python's recursion limit: a clean exception
        raise SpecTooComplexError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    json_depth(value, what)
    return value


def json_depth(value: Any, what: str = "the JSON schema") -> int:
    """The nesting depth of decoded JSON (iterative); ``SpecTooComplexError`` past ``MAX_JSON_DEPTH``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise SpecTooComplexError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_schema_bounds(schema: Any) -> None:
    """Depth, nodes and ``$ref`` links of a decoded JSON schema (iterative: any depth is safe to walk)."""
    json_depth(schema)
    nodes = refs = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise SpecTooComplexError(f"the JSON schema has more than {MAX_SCHEMA_NODES} nodes")
        if isinstance(node, dict):
            refs += "$ref" in node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    if refs > MAX_SCHEMA_REFS:
        raise SpecTooComplexError(
            f"the JSON schema has {refs} '$ref' links; at most {MAX_SCHEMA_REFS} allowed"
        )


# What cannot nest, blanked before counting. Each pattern consumes an unterminated run to the end of
# its line (or the text), so every character is scanned once: no quadratic rescans on odd inputs.
_ESCAPE = re.compile(r"\\.", re.DOTALL)
_CHAR_CLASS = re.compile(r"\[[^\]]*(?:\]|\Z)")
_STRING = re.compile(r'"[^"\n]*(?:"|$)', re.MULTILINE)


def regex_depth(pattern: str) -> int:
    """The deepest group nesting of a regex (escaped and bracketed parentheses do not count)."""
    return _depth(_CHAR_CLASS.sub("", _ESCAPE.sub("", pattern)), "(", ")")


def grammar_depth(grammar: str) -> int:
    """The deepest nesting of groups, optionals and repetitions in a Lark / GBNF grammar."""
    return _depth(_STRING.sub("", _ESCAPE.sub("", grammar)), "([{", ")]}")


def _depth(text: str, opening: str, closing: str) -> int:
    """Counted up to one past ``MAX_REGEX_DEPTH`` (deeper is refused whatever the exact depth)."""
    depth = deepest = 0
    for ch in re.findall(f"[{re.escape(opening + closing)}]", text):
        if ch in opening:
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_REGEX_DEPTH:
                break
        else:
            depth = max(0, depth - 1)
    return deepest


def check_bounds(spec: GrammarSpec) -> None:
    """``SpecTooComplexError`` when ``spec`` exceeds a bound above; cheap (linear in its size)."""
    if spec.kind == "json":
        check_schema_bounds(parse_json_bounded(spec.source))
    elif spec.kind == "regex":
        _check_regex(spec.source, "the regex")
    elif spec.kind == "grammar":
        rules = len(_RULE.findall(spec.source))
        if rules > MAX_GRAMMAR_RULES:
            raise SpecTooComplexError(f"the grammar has {rules} rules; at most {MAX_GRAMMAR_RULES} allowed")
        depth = grammar_depth(spec.source)
        if depth > MAX_REGEX_DEPTH:
            raise SpecTooComplexError(f"the grammar nests groups more than {MAX_REGEX_DEPTH} deep")
    if spec.whitespace is not None:
        _check_regex(spec.whitespace, "the whitespace pattern")


def _check_regex(pattern: str, what: str) -> None:
    depth = regex_depth(pattern)
    if depth > MAX_REGEX_DEPTH:
        raise SpecTooComplexError(f"{what} nests groups more than {MAX_REGEX_DEPTH} deep")
