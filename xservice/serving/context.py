"""What every handler needs: the engine client, tokenizer, config, metrics and admission control."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from fastapi import Request

from xservice.config import XllmConfig
from xservice.http.errors import EngineUnavailableError, ModelNotFoundError, RateLimitError
from xservice.http.metrics import ServiceMetrics
from xservice.serving.body_parse import BodyParser
from xservice.serving.lora_models import LoRAModels
from xservice.serving.reasoning.registry import ReasoningFamily
from xservice.serving.reasoning.registry import resolve_family as resolve_reasoning_family
from xservice.serving.request_limits import RequestLimits
from xservice.serving.text_workers import TextWorkers
from xservice.serving.tools.registry import ToolParserFamily, resolve_family
from xservice.serving.trace_record import TraceRecorder

if TYPE_CHECKING:
    from xengine.api.chat_images import ChatImageBuilder
    from xengine.api.text.tokenizer import Tokenizer
    from xservice.engine.protocol import EngineBackend

logger = logging.getLogger(__name__)


@dataclass
class Ticket:
    """One admitted request's slot; ``release`` is idempotent."""

    ctx: ServingContext
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.num_inflight -= 1


@dataclass
class ServingContext:
    """Shared state of one app instance (stored on ``app.state.ctx``)."""

    engine_client: EngineBackend
    tokenizer: Tokenizer
    config: XllmConfig
    metrics: ServiceMetrics
    num_inflight: int = 0
    _background: set[asyncio.Task] = field(default_factory=set)
    text: TextWorkers = field(init=False)  # tokenizer work off the event loop; ``close()`` stops it
    bodies: BodyParser = field(init=False)  # request bodies parsed off the event loop; ``close()`` stops it

    def __post_init__(self) -> None:
        self.text = TextWorkers(self.tokenizer)
        service = self.config.service
        self.bodies = BodyParser(RequestLimits(service.max_messages, service.max_content_parts))

    def close(self) -> None:
        """Release what the context owns (tokenizer and body workers, the trace file); the engine client
        is not owned."""
        self.text.close()
        self.bodies.close()
        recorder = self.__dict__.get("trace")  # opened on the first recorded request
        if recorder is not None:
            recorder.close()

    @cached_property
    def trace(self) -> TraceRecorder | None:
        """Where finished requests are recorded (``service.record_trace``); None: not recorded."""
        path = self.config.service.record_trace
        return TraceRecorder(path) if path else None

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name or self.engine_client.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine_client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine_client.info.vocab_size

    @cached_property
    def tool_family(self) -> ToolParserFamily | None:
        """The served model's tool-call parser family (``service.tool_call_parser``); None: no parser."""
        setting = self.config.service.tool_call_parser
        return resolve_family(setting, self.tokenizer.chat_template, self.config.model.model)

    @cached_property
    def images(self) -> ChatImageBuilder | None:
        """Image loading and preprocessing for a vision-language model (its ``preprocessor_config.json``
        and ``image_token_id``), within ``service``'s media settings; None: the model takes no images."""
        from xengine.api.chat_images import ChatImageBuilder

        service = self.config.service
        allowed = service.allowed_local_media_path or None
        return ChatImageBuilder.from_dir(self.config.model.model, allowed, service.media_limits())

    @cached_property
    def reasoning_family(self) -> ReasoningFamily | None:
        """The reasoning parser family (``service.reasoning_parser``); None: outputs are not split."""
        return resolve_reasoning_family(self.config.service.reasoning_parser)

    @cached_property
    def loras(self) -> LoRAModels:
        """The LoRA adapters this server answers to (``lora.lora_modules`` and those loaded since)."""
        return LoRAModels.from_config(self.config.lora)

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter ``name`` names (None: the base model); 404 unless ``name`` is empty, the
        served model's name or an adapter's."""
        if not name or name == self.model_name:
            return None
        adapter = self.loras.adapter_of(name)
        if adapter is None:
            adapters = "".join(f", '{a}'" for a in self.loras.adapters)
            raise ModelNotFoundError(
                f"The model '{name}' does not exist; this server serves '{self.model_name}'{adapters}.",
                param="model",
            )
        return adapter

    def check_engine(self) -> None:
        if not self.engine_client.is_alive:
            raise EngineUnavailableError()

    def admit(self) -> Ticket:
        """Take an in-flight slot, or raise 429 (too many in flight) / 503 (engine dead)."""
        self.check_engine()
        limit = self.config.service.max_pending_requests
        if self.num_inflight >= limit:
            raise RateLimitError(
                f"Too many requests in flight ({self.num_inflight} >= {limit}); retry later."
            )
        self.num_inflight += 1
        return Ticket(self)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, outside any cancelled scope (e.g. an abort on disconnect)."""
        task = asyncio.get_running_loop().create_task(_quietly(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _quietly(coro: Coroutine[Any, Any, Any]) -> None:
    try:
        await coro
    except Exception:  # a background cleanup failing (e.g. engine already dead) is not an API error
        logger.debug("background task failed", exc_info=True)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def get_ctx(request: Request) -> ServingContext:
    """FastAPI dependency: the app's ``ServingContext`` (async: FastAPI would run a plain function on a
    thread of its pool, a hop per request)."""
    return request.app.state.ctx
