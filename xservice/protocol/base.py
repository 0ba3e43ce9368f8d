"""Bases of the HTTP API's bodies (pydantic, following OpenAI's schema) and the shared field tables.

Requests are validated strictly (no "5" for 5, no "yes" for true) so type mistakes become 400s, and
follow the field rule of ``xservice/protocol/request_model.py``: implemented, refused with a 400 naming the
field, or on the short documented list of fields without meaning here. Unknown fields are refused.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from xservice.protocol.request_model import RequestModel


class APIRequest(RequestModel):
    """A request body (strict types, unknown fields refused; see ``RequestModel``)."""


class APIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


def now() -> int:
    return int(time.time())


def drop_none(out: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``out`` (a serialized response) without those of ``keys`` whose value is None."""
    for key in keys:
        if out.get(key) is None:
            out.pop(key, None)
    return out


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")


# Accepted and ignored on both generation endpoints: they have no meaning on a self-hosted server.
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring; xllm keeps no per-user state",
    "store": "OpenAI stores completions for its dashboard; xllm stores nothing",
    "metadata": "tags for OpenAI's stored completions (see 'store')",
    "service_tier": "OpenAI's processing tiers; use 'priority' (online/offline) for xllm's",
    "prompt_cache_key": "OpenAI's cache routing hint; xllm's prefix cache and router need none",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
}

# Refused on both generation endpoints (a non-null value is a 400 naming the field).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "logits_processors": "custom logits processors cannot be loaded over the API",
    "vllm_xargs": "vLLM-specific extension arguments have no meaning in xllm",
    "kv_transfer_params": "vLLM's disaggregation hand-off; xllm's prefill/decode split is internal to its cluster",
    "request_id": "the server assigns request ids",
    "structural_tag": "structural tags are not supported; use 'response_format' or 'structured_outputs'",
}
