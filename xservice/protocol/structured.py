"""Request bodies of structured outputs: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

Both generation endpoints take them, as do vLLM's older ``guided_*`` fields (see
``SamplingRequest``); ``xservice/serving/structured.py`` maps them onto the engine's
``StructuredOutputsParams``. ``docs/structured_outputs.md`` describes the semantics.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import Field

from xservice.protocol.base import APIRequest


class JSONSchemaFormat(APIRequest):
    """``response_format.json_schema``: the output always follows ``schema`` (constrained decoding)."""

    ignored_fields: ClassVar[dict[str, str]] = {
        "name": "a label of the schema; the output follows 'schema' whatever it is called",
        "description": "not added to the prompt; constrained decoding enforces 'schema' itself",
        "strict": "the output always follows 'schema' exactly (constrained decoding), strict or not",
    }

    # "schema" clashes with a pydantic BaseModel attribute, hence the alias
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")


class ResponseFormat(APIRequest):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``.
    ``structural_tag`` is vLLM's; it is refused with a 400 (not supported)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(APIRequest):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``, plus whitespace / additional-properties options."""

    ignored_fields: ClassVar[dict[str, str]] = {
        "disable_fallback": "xllm has one structured-output backend: there is nothing to fall back to",
    }
    unsupported_fields: ClassVar[dict[str, str]] = {
        "structural_tag": "structural tags are not supported; use 'json', 'regex', 'choice' or 'grammar'",
    }

    json_: Union[dict[str, Any], bool, str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None  # None: the server's default (true, as vLLM's)
    whitespace_pattern: str | None = None
