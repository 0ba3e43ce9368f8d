"""``EngineBackend``: everything the HTTP app, the serving code and the batch runner call on an engine.

Three classes play that role: ``EngineClient`` (one engine process, ``client.py``), ``SupervisedEngine``
(that client restarted when its process dies, ``supervised.py``) and the cluster's ``InstancePool``
(every registered instance, ``xservice/cluster/pool.py``). ``build_app`` takes any of them; naming the
seam keeps the three in step (``tests/xservice/engine/test_engine_backend.py`` checks each against it).
Failures raise the errors of ``errors.py``. See ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from xengine.api.messages import AddRequest, CatalogInfo, CompletionDelta, EngineInfo, EngineStats


@runtime_checkable
class EngineBackend(Protocol):
    """An engine (or a set of them) the service serves requests with."""

    @property
    def info(self) -> EngineInfo:
        """The served model's facts (name, context length, vocabulary, block size, ...)."""
        ...

    @property
    def is_alive(self) -> bool:
        """True while a request sent now can be served."""
        ...

    @property
    def health(self) -> str:
        """ "ok" (serving), "restarting" (not now, a restart is under way) or "failed" (given up)."""
        ...

    @property
    def pid(self) -> int:
        """The engine process id (-1 when there is none)."""
        ...

    @property
    def num_inflight(self) -> int:
        """Requests being streamed now."""
        ...

    def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        """Send ``req`` and yield its deltas until every sequence finished; stopping early aborts it.
        Raises ``EngineDeadError`` when the engine stops serving it."""
        ...

    async def abort(self, req_ids: list[str]) -> None:
        """Abort requests by id (unknown ids are ignored)."""
        ...

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        """The engine's counters (summed over instances in a cluster)."""
        ...

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """True when an engine loop answers within ``timeout_s``."""
        ...

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        """Drop every cached prefix block; False when some are still in use."""
        ...

    async def register_catalog(
        self, name: str, items: list[list[int]], timeout_s: float = 60.0
    ) -> CatalogInfo:
        """Register an item catalog (generative recommendation); ``ValueError`` naming the field if
        it is invalid or cannot be served here."""
        ...

    async def list_catalogs(self, timeout_s: float = 5.0) -> list[CatalogInfo]:
        """The registered item catalogs."""
        ...

    async def load_lora(self, name: str, path: str, replace: bool = False, timeout_s: float = 120.0) -> None:
        """Register LoRA adapter ``name`` from folder ``path`` in every engine; ``ValueError`` with the
        engine's reason if it cannot be served."""
        ...

    async def unload_lora(self, name: str, timeout_s: float = 10.0) -> None:
        """Forget LoRA adapter ``name`` in every engine; ``KeyError`` if it is unknown."""
        ...

    def restart_counts(self) -> dict[str, int]:
        """Engine restarts per instance (``/metrics``)."""
        ...

    def given_up(self) -> list[str]:
        """Instances whose supervisor gave up restarting them (``/health/live``, ``/metrics``)."""
        ...

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop serving and release the engine(s) this object owns."""
        ...
