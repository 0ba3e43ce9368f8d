"""``/v1/completions``' ``prompt_embeds`` (vLLM's, behind ``model.enable_prompt_embeds``): each item
base64 of ``torch.save`` of a ``[tokens, hidden]`` tensor, decoded without torch and without running
pickle code (``xengine/api/prompt_embeds.py``) on a text worker. Such prompts come first in the
choices, then the ``prompt`` ones (vLLM's order); their token ids are placeholders."""

from __future__ import annotations

from xengine.api.prompt_embeds import PromptEmbeds, decode_prompt_embeds
from xservice.http.errors import InvalidRequestError, from_value_error
from xservice.protocol.completions import CompletionRequest
from xservice.serving.context import ServingContext


async def prompt_embeds_of(
    ctx: ServingContext, body: CompletionRequest, max_prompts: int
) -> list[PromptEmbeds]:
    """The request's prompt embeddings, checked (a 400 naming ``prompt_embeds`` otherwise)."""
    given = body.prompt_embeds
    if given is None or given == []:  # an empty list: no prompt embeddings (as vLLM reads it)
        if body.prompt is None:
            raise InvalidRequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        return []
    if not ctx.config.model.enable_prompt_embeds:
        raise InvalidRequestError(
            "This server takes no prompt embeddings; start it with --enable-prompt-embeds.",
            param="prompt_embeds",
        )
    if ctx.config.cluster.enabled:
        raise InvalidRequestError(
            "prompt_embeds are served by a single-node server, not by a cluster.", param="prompt_embeds"
        )
    items = [given] if isinstance(given, str) else list(given)
    if not items or len(items) > max_prompts:
        raise InvalidRequestError(f"Give 1 to {max_prompts} prompt embeddings.", param="prompt_embeds")
    for field in ("echo", "prompt_logprobs", "suffix"):
        if getattr(body, field) not in (None, False, ""):
            raise InvalidRequestError(f"'{field}' is not compatible with prompt_embeds.", param=field)
    max_bytes = 4 * ctx.config.service.max_body_bytes  # float32 of what the body could carry
    out = []
    for item in items:
        try:
            embeds = await ctx.text.run(len(item), decode_prompt_embeds, item, max_bytes)
        except ValueError as e:
            raise from_value_error(e, {}) from None
        if embeds.hidden_size != ctx.engine_client.info.hidden_size:
            raise InvalidRequestError(
                f"invalid value for 'prompt_embeds': the embeddings' size is {embeds.hidden_size}, the model's "
                f"hidden size {ctx.engine_client.info.hidden_size}",
                param="prompt_embeds",
            )
        out.append(embeds)
    return out
