"""Requests waiting for their grammar: held outside the scheduler until the compile finishes.

They take no KV and no batch slot meanwhile, and nothing else waits for them: each engine step first
hands the scheduler the requests whose grammar is ready (or fails those whose grammar is invalid).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from xengine.request import Request
from xengine.structured.backend import BaseCompiledGrammar
from xengine.structured.matcher import for_request


@dataclass
class _Waiting:
    request: Request
    catalog: Any
    future: Future[BaseCompiledGrammar]


@dataclass
class GrammarReady:
    """A request whose compile finished: ``error`` is None when ``request.grammar`` is set."""

    request: Request
    catalog: Any
    error: BaseException | None = None


class GrammarWaitQueue:
    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}  # req_id -> waiting request, in arrival order

    def add(self, request: Request, catalog: Any, future: Future[BaseCompiledGrammar]) -> None:
        self._waiting[request.req_id] = _Waiting(request, catalog, future)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def requests(self) -> list[Request]:
        return [w.request for w in self._waiting.values()]

    def take_done(self) -> list[GrammarReady]:
        """The requests whose compile finished (grammar attached, or the error), in arrival order."""
        done = [w for w in self._waiting.values() if w.future.done()]
        out = []
        for w in done:
            del self._waiting[w.request.req_id]
            error = w.future.exception()
            if error is None:
                so = w.request.params.structured_outputs
                w.request.grammar = for_request(w.future.result(), so.resume_token_ids if so else None)
            out.append(GrammarReady(w.request, w.catalog, error))
        return out

    def remove(self, req_ids: list[str]) -> list[Request]:
        """Drop these requests (aborted before their grammar was ready); returns the ones found."""
        return [self._waiting.pop(r).request for r in req_ids if r in self._waiting]

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until some compile finishes (the engine has nothing else to do)."""
        if self._waiting:
            wait([w.future for w in self._waiting.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)
