"""How a chat request's messages become prompt text: the template and its variables beyond the messages.

vLLM's chat-template controls, each checked before anything is rendered:
- ``chat_template`` replaces the model's template; only when the server trusts request templates
  (``service.trust_request_chat_template``), since a template is code run on the server (sandboxed);
- ``chat_template_kwargs`` are extra template variables (e.g. Qwen3's ``enable_thinking``); a name the
  template never reads, or one the server sets itself (``messages``, ``tools``, ...), is a 400 rather
  than a silent no-op;
- ``documents`` is the template's ``documents`` variable (RAG templates), refused when it has none;
- ``continue_final_message`` ends the prompt inside the last message (needs ``add_generation_prompt``
  false, as in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from xservice.http.errors import InvalidRequestError

if TYPE_CHECKING:
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.serving.context import ServingContext

# Variables the server sets; a request cannot override them through chat_template_kwargs.
RESERVED_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


@dataclass(frozen=True)
class ChatRender:
    """Template options of one request (all but ``add_generation_prompt``, passed alongside)."""

    chat_template: str | None = None  # None: the model's
    template_vars: frozenset[str] = frozenset()  # variables the template reads
    kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    continue_final_message: bool = False

    def with_tools(self, tools: list[dict[str, Any]] | None) -> ChatRender:
        return replace(self, tools=tools)

    def render(
        self, tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool
    ) -> str:
        kwargs = dict(self.kwargs)
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=self.tools,
            chat_template=self.chat_template,
            continue_final_message=self.continue_final_message,
            **kwargs,
        )


async def chat_render(
    ctx: ServingContext,
    *,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    add_generation_prompt: bool = True,
) -> ChatRender:
    """Check a request's template options (400s name the field) and bundle them."""
    if chat_template is not None and not ctx.config.service.trust_request_chat_template:
        raise InvalidRequestError(
            "This server does not accept chat templates in requests (a template is code run on the server); "
            "start it with service.trust_request_chat_template (--trust-request-chat-template) to allow them.",
            param="chat_template",
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "'continue_final_message' continues the last message, 'add_generation_prompt' starts a new one; "
            'set "add_generation_prompt": false.',
            param="continue_final_message",
        )
    try:  # a request's template is parsed on a tokenizer worker (it may be large); the model's is cached
        names = await ctx.text.run(len(chat_template or ""), ctx.tokenizer.template_variables, chat_template)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="chat_template" if chat_template else "messages") from None
    kwargs = dict(chat_template_kwargs or {})
    for name in kwargs:
        if name in RESERVED_VARIABLES:
            raise InvalidRequestError(
                f"'{name}' is set by the server; it cannot be a chat template kwarg.",
                param=f"chat_template_kwargs.{name}",
            )
        if name not in names:
            raise InvalidRequestError(
                f"The chat template does not use the variable '{name}', so it would have no effect.",
                param=f"chat_template_kwargs.{name}",
            )
    if documents is not None and "documents" not in names:
        raise InvalidRequestError(
            "The chat template does not render 'documents'; send a 'chat_template' that does.",
            param="documents",
        )
    return ChatRender(
        chat_template=chat_template,
        template_vars=names,
        kwargs=kwargs,
        documents=documents,
        continue_final_message=continue_final_message,
    )


async def chat_render_of(ctx: ServingContext, body: Any) -> ChatRender:
    """``chat_render`` with the template options of a chat body (a chat completion, a chat-style
    ``/tokenize``): the fields of the same names."""
    return await chat_render(
        ctx,
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        documents=body.documents,
        continue_final_message=body.continue_final_message,
        add_generation_prompt=body.add_generation_prompt,
    )
