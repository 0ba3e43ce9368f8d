"""The field rule as a table: every request field of every route, with its status.

``python -m xservice.protocol.field_table`` rewrites the generated part of ``docs/openai_compat.md``;
a test checks that the document is current, so a field cannot change status undocumented.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from xservice.protocol.request_model import RequestModel

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai_compat.md"
BEGIN, END = "<!-- field-table:begin -->", "<!-- field-table:end -->"


@dataclass(frozen=True)
class FieldStatus:
    name: str
    status: str  # "implemented" | "ignored" | "refused"
    note: str = ""


def request_models() -> dict[str, type[RequestModel]]:
    """Every request body of the HTTP API, by the route (and part) it belongs to."""
    from xservice.protocol import (
        ChatCompletionRequest,
        ChatMessage,
        CompletionRequest,
        ContentPart,
        DetokenizeRequest,
        ImageURL,
        StreamOptions,
        TokenizeRequest,
    )
    from xservice.protocol.embeddings import EmbeddingRequest
    from xservice.protocol.responses import InputContentPart, MessageItem, ResponsesRequest, TextConfig
    from xservice.protocol.structured import JSONSchemaFormat, ResponseFormat, StructuredOutputsRequest
    from xservice.rec.protocol import CatalogCreateRequest, RecGenerateRequest
    from xservice.routes.batches import CreateBatchRequest

    return {
        "POST /v1/completions": CompletionRequest,
        "POST /v1/chat/completions": ChatCompletionRequest,
        "chat message (messages[])": ChatMessage,
        "chat content part (messages[].content[])": ContentPart,
        "chat image part (messages[].content[].image_url)": ImageURL,
        "stream_options": StreamOptions,
        "response_format": ResponseFormat,
        "response_format.json_schema": JSONSchemaFormat,
        "structured_outputs": StructuredOutputsRequest,
        "POST /v1/responses": ResponsesRequest,
        "responses input message (input[])": MessageItem,
        "responses content part (input[].content[])": InputContentPart,
        "responses text": TextConfig,
        "POST /v1/embeddings": EmbeddingRequest,
        "POST /tokenize": TokenizeRequest,
        "POST /detokenize": DetokenizeRequest,
        "POST /v1/batches": CreateBatchRequest,
        "POST /v1/rec/catalogs": CatalogCreateRequest,
        "POST /v1/rec/generate": RecGenerateRequest,
    }


def field_statuses(model: type[RequestModel]) -> list[FieldStatus]:
    rows = [FieldStatus(f.alias or name, "implemented") for name, f in model.model_fields.items()]
    rows += [FieldStatus(name, "ignored", why) for name, why in model.ignored_fields.items()]
    rows += [FieldStatus(name, "refused", why) for name, why in model.unsupported_fields.items()]
    return sorted(rows, key=lambda r: r.name)


def render() -> str:
    lines = [BEGIN, ""]
    for where, model in request_models().items():
        lines += [f"### {where}", "", "| field | status | note |", "|---|---|---|"]
        lines += [f"| `{r.name}` | {r.status} | {r.note} |" for r in field_statuses(model)]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def updated_doc(text: str) -> str:
    """``text`` with its generated field table replaced by the current one."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + render() + tail


def main() -> int:
    DOC.write_text(updated_doc(DOC.read_text()))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
