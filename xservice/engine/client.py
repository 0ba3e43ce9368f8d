"""``EngineClient``: the service's socket client of one engine (asyncio; torch-free).

It sends requests and RPC calls over one ZMQ socket and routes the engine's outputs from another to
per-request queues (one background task), and watches health: when the engine dies, hangs or drops
a request (``stream_ledger.py``), the requests concerned fail with ``EngineDeadError`` and new ones
are refused. ``EngineClient.start(config)`` runs a local engine process (``process.py``); the
cluster's ``RemoteEngineClient`` connects to a registered one instead. See ``docs/operations.md``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from xengine.api.config import EngineConfig
from xengine.api.messages import (
    AbortRequests,
    AddRequest,
    CatalogInfo,
    CompletionDelta,
    EngineDead,
    EngineInfo,
    EngineInput,
    EngineStats,
    KVExport,
    KVExportInfo,
    KVImport,
    KVImportResult,
    KVRelease,
    LoadLoRA,
    RegisterCatalog,
    Shutdown,
    StepOutputs,
    UnloadLoRA,
    UtilityCall,
    UtilityResult,
    make_encoder,
    make_output_decoder,
)
from xengine.api.security import ClusterKey, secure_client
from xservice.engine.errors import EngineDeadError, EngineRequestLostError
from xservice.engine.process import EngineProcess
from xservice.engine.stream_ledger import LOST, StreamLedger

WATCH_INTERVAL_S = 0.2
AUDIT_INTERVAL_S = 1.0  # how often the engine lists its requests while some are in flight
HANG_TIMEOUT_S = 120.0  # an engine that answers no audit for this long is hung: the client marks it dead


class EngineClient:
    """Async client of one engine. Create it with ``await EngineClient.start(config)`` (a local engine
    process it owns) or, for an engine that runs elsewhere, through ``RemoteEngineClient.connect``."""

    info: EngineInfo

    def __init__(
        self,
        input_addr: str,
        output_addr: str,
        *,
        bind: bool,
        key: ClusterKey | None = None,
        process: EngineProcess | None = None,
    ) -> None:
        self.input_addr, self.output_addr = input_addr, output_addr
        self.process = process  # the local engine process this client owns (None: a remote engine)
        self._ctx = zmq.asyncio.Context()
        self._push, self._pull = self._open_sockets(bind, key)
        self._encoder = make_encoder()
        self._decoder = make_output_decoder()
        self._queues: dict[str, asyncio.Queue[CompletionDelta | EngineDeadError]] = {}
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count(1)
        self._ledger = StreamLedger()  # requests whose deltas are still due (see stream_ledger.py)
        self._audit: tuple[float, asyncio.Future[UtilityResult]] | None = None  # (sent at, answer)
        self._last_audit = 0.0
        self.hang_timeout_s = HANG_TIMEOUT_S
        self._dead_reason: str | None = None
        self._closed = False
        self._pump_task: asyncio.Task[None] | None = None

    def _open_sockets(
        self, bind: bool, key: ClusterKey | None
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """PUSH to the engine's input address, PULL from its output address (bound or connected; with
        ``key``, as CURVE clients of a remote engine)."""
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.setsockopt(zmq.LINGER, 0)
        pull = self._ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        for sock, addr in ((push, self.input_addr), (pull, self.output_addr)):
            if key is not None:
                secure_client(sock, key)
            sock.bind(addr) if bind else sock.connect(addr)
        return push, pull

    @classmethod
    async def start(cls, engine_config: EngineConfig, startup_timeout_s: float = 900.0) -> EngineClient:
        """Spawn a local engine process and wait until it is ready to serve.

        Raises ``EngineStartupError`` (with the engine's stderr tail) if it exits or is not
        ready within ``startup_timeout_s``.
        """
        engine_config.validate()
        process = EngineProcess()
        client = cls(process.input_addr, process.output_addr, bind=True, process=process)
        try:
            process.spawn(engine_config)
            client.info = await process.wait_ready(client._pull, client._decoder, startup_timeout_s)
        except BaseException:
            process.kill()
            client._closed = True
            client._mark_dead("the engine failed to start")
            client._release()
            raise
        client._pump_task = asyncio.create_task(client._pump(), name="engine-client-pump")
        return client

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Ask the engine to drain and exit; terminate, then kill it if it does not."""
        if self._closed:
            return
        self._closed = True
        self._ledger.aborting_all()  # we asked for the drain: its aborts are ours
        if self.process is not None and self.process.exit_code is None:
            try:
                self._send(Shutdown(drain_timeout_s))
            except EngineDeadError:
                pass
            await self.process.stop(drain_timeout_s + 5.0)
        if self._pump_task is not None:
            try:
                await asyncio.wait_for(self._pump_task, 2.0)  # delivers the last deltas
            except (TimeoutError, asyncio.TimeoutError):
                pass
        self._mark_dead("the engine was shut down")
        self._release()

    def _release(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        if self.process is not None:
            self.process.remove_dir()

    # ------------------------------------------------------------------ requests

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        """Send ``req`` and yield its deltas until all its ``n`` sequences finished.

        A delta with ``finish_reason == "error"`` ends the whole request. Stopping early (break,
        cancellation, ``aclose()``) aborts the request in the engine.
        """
        self._raise_if_dead()
        if req.req_id in self._queues:
            raise ValueError(f"request id {req.req_id!r} is already in flight")
        queue: asyncio.Queue[CompletionDelta | EngineDeadError] = asyncio.Queue()
        self._queues[req.req_id] = queue
        finished: set[int] = set()
        complete = False
        try:
            self._ledger.opened(req.req_id, req.params.n)
            self._send(req)
            while not complete:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                if item.finish_reason is not None:
                    finished.add(item.index)
                    complete = item.finish_reason == "error" or len(finished) >= req.params.n
                yield item
        finally:
            self._queues.pop(req.req_id, None)
            if not complete and self.is_alive:
                self._ledger.aborting(req.req_id)
                try:
                    self._send(AbortRequests([req.req_id]))
                except EngineDeadError:
                    pass  # nothing left to abort

    async def abort(self, req_ids: list[str]) -> None:
        """Abort requests by id; unknown ids are ignored. Their streams end with an abort delta."""
        if req_ids and self.is_alive:
            for req_id in req_ids:
                self._ledger.aborting(req_id)
            self._send(AbortRequests(list(req_ids)))

    async def stats(self, timeout_s: float = 5.0) -> EngineStats:
        """The engine's current counters (raises ``TimeoutError`` / ``EngineDeadError``)."""
        result = await self._call("stats", timeout_s)
        if result.stats is None:
            raise RuntimeError(f"engine stats failed: {result.error}")
        return result.stats

    async def ping(self, timeout_s: float = 2.0) -> bool:
        """True when the engine loop answers within ``timeout_s``."""
        try:
            return (await self._call("ping", timeout_s)).ok
        except (TimeoutError, EngineDeadError):
            return False

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        """Drop every cached prefix block; False when blocks are still in use."""
        return (await self._call("reset_prefix_cache", timeout_s)).ok

    async def register_catalog(
        self, name: str, items: list[list[int]], timeout_s: float = 60.0
    ) -> CatalogInfo:
        """Register an item catalog in the engine; ``ValueError`` (naming the field) if it is invalid."""
        result = await self._call_msg(
            lambda call_id: RegisterCatalog(call_id=call_id, name=name, items=items), timeout_s
        )
        if not result.ok or not result.catalogs:
            raise ValueError(result.error or "catalog registration failed")
        return result.catalogs[0]

    async def load_lora(self, name: str, path: str, replace: bool = False, timeout_s: float = 120.0) -> None:
        """Register a LoRA adapter in the engine; ``ValueError`` with its reason if it cannot."""
        make = lambda call_id: LoadLoRA(call_id=call_id, name=name, path=path, replace=replace)  # noqa: E731
        result = await self._call_msg(make, timeout_s)
        if not result.ok:
            raise ValueError(result.error or "loading the LoRA adapter failed")

    async def unload_lora(self, name: str, timeout_s: float = 10.0) -> None:
        """Forget a LoRA adapter in the engine; ``KeyError`` if it has none of that name."""
        result = await self._call_msg(lambda call_id: UnloadLoRA(call_id=call_id, name=name), timeout_s)
        if not result.ok:
            raise KeyError(name)

    async def list_catalogs(self, timeout_s: float = 5.0) -> list[CatalogInfo]:
        """The engine's registered item catalogs."""
        result = await self._call("list_catalogs", timeout_s)
        if not result.ok:
            raise RuntimeError(f"listing catalogs failed: {result.error}")
        return list(result.catalogs or [])

    async def kv_export(
        self, export_id: str, token_ids: list[int], timeout_s: float = 30.0, next_token_id: int | None = None
    ) -> KVExportInfo:
        """PD, prefill side: pin the prompt's cached whole blocks under ``export_id`` and describe them
        (``next_token_id``: the token the prefill sampled; it keys a draft head's blocks of the prompt)."""
        result = await self._call_msg(
            lambda call_id: KVExport(
                call_id=call_id, export_id=export_id, token_ids=token_ids, next_token_id=next_token_id
            ),
            timeout_s,
        )
        if not result.ok or result.kv_export is None:
            raise RuntimeError(f"KV export failed: {result.error}")
        return result.kv_export

    async def kv_import(
        self,
        source: KVExportInfo,
        token_ids: list[int],
        pin_id: str,
        timeout_s: float = 60.0,
        next_token_id: int | None = None,
    ) -> KVImportResult:
        """PD, decode side: pull the prompt blocks it lacks from ``source`` and pin them for ``pin_id``."""
        result = await self._call_msg(
            lambda call_id: KVImport(
                call_id=call_id,
                source=source,
                token_ids=token_ids,
                pin_id=pin_id,
                next_token_id=next_token_id,
            ),
            timeout_s,
        )
        if not result.ok or result.kv_import is None:
            raise RuntimeError(f"KV import failed: {result.error}")
        return result.kv_import

    async def kv_release(self, export_id: str, timeout_s: float = 5.0) -> bool:
        """Drop a KV export (or import) pin; False when the engine had none under that id."""
        return (
            await self._call_msg(lambda call_id: KVRelease(call_id=call_id, export_id=export_id), timeout_s)
        ).ok

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving (None while it serves)."""
        code = self.process.exit_code if self.process is not None else None
        if self._dead_reason is None and code is not None:
            return f"engine process exited with code {code}"
        return self._dead_reason

    @property
    def health(self) -> str:
        """ "ok" while the engine serves, else "failed" (nothing restarts a bare client)."""
        return "ok" if self.is_alive else "failed"

    def restart_counts(self) -> dict[str, int]:
        """Restarts per instance (a bare client is never restarted)."""
        return {}

    def given_up(self) -> list[str]:
        """Instances whose supervisor gave up restarting them."""
        return []

    @property
    def num_inflight(self) -> int:
        return len(self._queues)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    # ------------------------------------------------------------------ internals

    def _raise_if_dead(self) -> None:
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)

    def _send(self, msg: EngineInput) -> None:
        try:
            sent = self._push.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine: {e}") from e
        if isinstance(sent, asyncio.Future):  # an asyncio socket reports a failed send on its future
            sent.add_done_callback(lambda fut, kind=type(msg).__name__: _log_send_failure(kind, fut))

    async def _call(self, method: str, timeout_s: float) -> UtilityResult:
        return await self._call_msg(lambda call_id: UtilityCall(call_id, method), timeout_s)

    async def _call_msg(self, make: Callable[[int], EngineInput], timeout_s: float) -> UtilityResult:
        """Send the message ``make(call_id)`` and wait for its ``UtilityResult``."""
        self._raise_if_dead()
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(make(call_id))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    async def _pump(self) -> None:
        """Route engine outputs and audit in-flight requests until the engine is gone, then fail
        whatever is still waiting."""
        try:
            while not await self._gone():
                if await self._pull.poll(int(WATCH_INTERVAL_S * 1000)):
                    await self._recv_pending()
                self._audit_tick()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken pump must not leave requests hanging
            self._mark_dead(f"engine client failed: {type(e).__name__}: {e}")

    async def _gone(self) -> bool:
        """True once the engine process exited (after routing the frames it sent just before); for
        a remote engine, once it was marked dead."""
        if self.process is None:
            return self._dead_reason is not None
        code = self.process.exit_code
        if code is None:
            return False
        while await self._pull.poll(50):
            await self._recv_pending()
        reason = "the engine was shut down" if self._closed else "engine process died"
        self._mark_dead(f"{reason} (exit code {code})")
        return True

    def _audit_tick(self) -> None:
        """While requests are in flight, ask the engine now and then which it still runs; fail those
        it dropped, and mark the engine dead when it stops answering altogether."""
        now = time.monotonic()
        if self._audit is not None:
            if not self._audit[1].done() and now - self._audit[0] > self.hang_timeout_s:
                self._mark_dead(f"the engine has not answered for {self.hang_timeout_s:.0f}s (hung)")
            return
        if not self._ledger or now - self._last_audit < AUDIT_INTERVAL_S or self._dead_reason is not None:
            return
        mark = self._ledger.mark()
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._audit = (now, fut)
        fut.add_done_callback(lambda f: self._audited(call_id, mark, f))
        self._send(UtilityCall(call_id, "list_requests"))

    def _audited(self, call_id: int, mark: int, fut: asyncio.Future[UtilityResult]) -> None:
        self._calls.pop(call_id, None)
        self._audit, self._last_audit = None, time.monotonic()
        if fut.cancelled() or fut.exception() is not None or fut.result().req_ids is None:
            return
        for req_id in self._ledger.lost(mark, fut.result().req_ids or []):
            queue = self._queues.get(req_id)
            if queue is not None:
                queue.put_nowait(EngineRequestLostError(LOST))

    async def _recv_pending(self) -> None:
        while True:
            try:
                frame = await self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._route(self._decoder.decode(frame))

    def _route(self, msg: object) -> None:
        if isinstance(msg, StepOutputs):
            for delta in msg.deltas:
                failure = self._ledger.on_delta(delta)
                queue = self._queues.get(delta.req_id)
                if queue is not None:
                    queue.put_nowait(delta if failure is None else EngineRequestLostError(failure))
        elif isinstance(msg, UtilityResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineDead):
            self._mark_dead(f"engine failed: {msg.message}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._ledger.clear()
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))


def _log_send_failure(kind: str, fut: asyncio.Future) -> None:
    """A frame that never left: logged (not left as "Future exception was never retrieved"). A lost
    request is then caught by the stream ledger's audit, which fails or migrates it."""
    if fut.cancelled() or fut.exception() is None:
        return
    level = logging.DEBUG if kind == "Shutdown" else logging.WARNING  # the engine may be gone already
    logging.getLogger(__name__).log(level, "a %s frame did not reach the engine: %s", kind, fut.exception())
