"""PD disaggregation, service side: run a request's prefill on a prefill instance and its decode on a
decode instance, moving the prompt's KV between them with the Mooncake transfer engine.

Per request (``n == 1``, no beam search), with ``PDPolicy`` choosing the instances:

1. **prefill**: send the request to a prefill instance P with ``max_tokens = 1``. Its one token is
   streamed to the client at once (TTFT). If it ends the request (EOS, stop, ``max_tokens == 1``)
   we are done.
2. **export**: ``kv_export`` on P pins the prompt's whole blocks (from P's prefix cache) and returns
   their ids and P's Mooncake session. Prompts are named as the prefix caches key them (an image's
   pads by its content hash: ``xengine/api/image_keys.py``), so image prompts transfer too.
3. **import**: ``kv_import`` on a decode instance D pulls the blocks D does not already hold into
   D's prefix cache (batched one-sided reads) and pins them for the decode request.
4. **decode**: ``kv_release`` on P, then D gets prompt + first token as its prompt with
   ``max_tokens - 1``; the prompt's whole blocks are prefix-cache hits there, so D recomputes only
   the partial last block and the first token. Its deltas are streamed under the original id.

With dynamic PD (``cluster.pd.mode: dynamic``, ``xservice/cluster/dynamic_pd.py``) the instances are
chosen by predicted TTFT / TPOT against the SLOs (a prefill may first flip a decode instance to
prefill), and the prefill instance may keep the decode itself (no export / import at all) when it
can hold the TPOT SLO. With co-location (``cluster.colocation.enabled``, ``xservice/cluster/colocation.py``)
an offline request prefills on the relaxed (prefill) instance with the least prefill in flight and
decodes on a strict (decode) instance only when the roofline model says that batch keeps the TPOT
SLO with it; otherwise it decodes where it prefilled.

Failures: P dies before its token → the prefill is re-dispatched to another prefill instance
(none left: the whole request runs on a decode instance, plain). P dies (or the transfer fails)
after the token but before D imported → the prefill is redone on another prefill instance for its
KV (none left: D recomputes the prompt). D dies during the import → another decode instance imports.
D dies while decoding → the pool's migration (prompt + streamed tokens, recompute). Every path
yields each token exactly once.

EPD (``xservice/cluster/epd/dispatcher.py``) subclasses this dispatcher: its hooks ``_before_prefill`` (bring the
images' embeddings to P) and ``_after_kv_import`` (and to D when it recomputes image pads) are no-ops here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from xengine.api.image_keys import cache_token_ids
from xengine.api.messages import AddRequest, CompletionDelta, KVExportInfo, KVImportResult, PromptLogprobs
from xservice.cluster.pd_metrics import PDCounters
from xservice.cluster.prfaas.link import transfer
from xservice.cluster.prfaas.prefix import bring_prefix
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.engine.errors import EngineDeadError
from xservice.policies import DECODE_ROLES, InstanceSnapshot, PDPolicy, RouteRequest

if TYPE_CHECKING:
    from xservice.cluster.colocation import Colocation
    from xservice.cluster.dynamic_pd import DynamicPD
    from xservice.cluster.monitor import RuntimeMonitor
    from xservice.cluster.prfaas.router import PrfaasRouter

logger = logging.getLogger(__name__)

KV_CALL_TIMEOUT_S = 60.0
MAX_KV_ATTEMPTS = 3  # exports / imports tried before the decode side recomputes the prompt instead
_KV_ERRORS = (EngineDeadError, RuntimeError, TimeoutError, asyncio.TimeoutError)


def empty_import_counts() -> dict[str, int]:
    return {"blocks": 0, "hit_blocks": 0, "bytes": 0, "head_blocks": 0}


@dataclass
class _Export:
    client: RemoteEngineClient
    export_id: str
    info: KVExportInfo
    next_token_id: int | None  # the prefill's token: keys a draft head's blocks of the prompt


class PDPool(Protocol):
    """What PD dispatching needs of the instance pool (``xservice/cluster/pool.py``) that owns it."""

    clients: dict[str, RemoteEngineClient]
    migrate: bool
    dynamic: DynamicPD | None
    colocation: Colocation | None
    monitor: RuntimeMonitor | None
    prfaas: PrfaasRouter | None
    info: Any

    def snapshots(self) -> list[InstanceSnapshot]: ...

    def role_of(self, name: str, client: RemoteEngineClient) -> str: ...

    def route_request(self, prompt_token_ids: list[int]) -> RouteRequest: ...

    def track(
        self, req_id: str, client: RemoteEngineClient, sub_id: str, routed: bool = True
    ) -> AbstractContextManager[None]: ...

    def stream(
        self,
        req: AddRequest,
        sub: AddRequest,
        generated: list[int],
        prefer: Sequence[Sequence[str]] = ...,
        client: RemoteEngineClient | None = None,
        num_cached_tokens: int | None = None,
        observe: Callable[[str, CompletionDelta], None] | None = None,
    ) -> AsyncIterator[CompletionDelta]: ...

    def continuation(self, req: AddRequest, generated: list[int], tag: str) -> AddRequest | None: ...


class PDDispatcher:
    def __init__(self, pool: PDPool, policy: PDPolicy) -> None:
        self.pool = pool
        self.policy = policy
        self.counters = PDCounters()
        self.imported: dict[str, dict[str, int]] = {}  # decode instance -> KV import counters
        # PrfaaS, bandwidth abundant: the instance holding a request's longest cached prefix, brought to
        # its prefill instance before the prefill (``xservice/cluster/prfaas/prefix.py``)
        self._prefix_from: dict[str, RemoteEngineClient] = {}

    def applies(self, req: AddRequest) -> bool:
        """PD needs a healthy prefill and decode instance; ``n > 1``, beam search and prefill-only
        requests (``max_tokens == 0``: embeddings, prompt scoring; nothing to decode) run plain."""
        if req.params.n != 1 or req.params.use_beam_search or req.params.is_prefill_only:
            return False
        roles = {s.role for s in self.pool.snapshots()}
        return "prefill" in roles and "decode" in roles

    # ------------------------------------------------------------------ the request

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        pool, generated = self.pool, []
        self.counters.num_requests += 1
        prefill = await self._first_token(req)
        if prefill is None:  # no prefill instance left: the whole request on a decode instance
            self.counters.num_fallbacks += 1
            async for delta in pool.stream(req, req, generated, DECODE_ROLES):
                yield delta
            return
        delta, client = prefill
        generated.extend(delta.new_token_ids)
        done = delta.finish_reason is not None
        cached = delta.num_cached_tokens
        yield delta
        if done:
            return
        context = len(req.prompt_token_ids) + len(generated)
        try:
            target = self._decode_target(req, client, context)
            if target == client.name:
                # the prefill instance keeps decoding it: no KV transfer (its prompt blocks are cached there)
                self.counters.num_kept_on_prefill += 1
                sub = pool.continuation(req, generated, "d0")
                assert sub is not None
                async for delta in self._decode(req, sub, generated, client, cached):
                    yield delta
                return
            export = await self._export(req, client, generated[0])
            decode, sub_id = await self._import(req, export, target)
            sub = pool.continuation(req, generated, sub_id)
            assert sub is not None  # the first token did not finish the request
            async for delta in self._decode(req, sub, generated, decode, cached):
                yield delta
        finally:
            if pool.monitor is not None:  # dynamic PD's placement holds KV until the request ends
                pool.monitor.release_decode(req.req_id)
            if pool.prfaas is not None:  # the output lengths its long-term planning uses
                pool.prfaas.finished(len(generated))
            self._prefix_from.pop(req.req_id, None)  # (a retried prefill's pick may have left one)

    def _decode_target(self, req: AddRequest, prefill: RemoteEngineClient, context: int) -> str | None:
        """Where the decode half goes when a policy decides it (None: the PD policy's pick)."""
        colocation = self.pool.colocation
        if colocation is not None and req.priority == "offline":
            return colocation.pick_offline_decode(prefill.name, context, req.req_id).name
        if self.pool.dynamic is not None:
            return self.pool.dynamic.pick_decode(req, prefill.name, context).name
        return None

    async def _decode(
        self,
        req: AddRequest,
        sub: AddRequest,
        generated: list[int],
        client: RemoteEngineClient | None,
        cached: int,
    ) -> AsyncIterator[CompletionDelta]:
        """Stream the decode half; with dynamic PD or co-location, the monitor sees its instance and
        token gaps."""
        mon, tpot_slo = self.pool.monitor, self._tpot_slo_s(req)
        if mon is None:
            async for delta in self.pool.stream(req, sub, generated, DECODE_ROLES, client, cached):
                yield delta
            return
        offline = req.priority == "offline"
        slo = getattr(req, "slo", None)
        own_slo = slo.tpot_ms / 1000 if slo is not None and slo.tpot_ms is not None else None
        on: list[str] = []

        def observe(name: str, delta: CompletionDelta) -> None:
            if not on or on[-1] != name:
                if on:
                    mon.decode_done(on[-1], req.req_id)
                on.append(name)
                mon.decode_started(name, req.req_id, len(sub.prompt_token_ids), offline, own_slo)
            mon.decode_tokens(name, req.req_id, len(delta.new_token_ids), tpot_slo, time.monotonic())

        try:
            async for delta in self.pool.stream(req, sub, generated, DECODE_ROLES, client, cached, observe):
                yield delta
        finally:
            if on:
                mon.decode_done(on[-1], req.req_id)

    def _tpot_slo_s(self, req: AddRequest) -> float:
        if self.pool.dynamic is not None:
            return self.pool.dynamic.slo_for(req).tpot_s
        if self.pool.colocation is not None:
            return self.pool.colocation.policy.tpot_slo_s
        return float("inf")

    async def _first_token(self, req: AddRequest) -> tuple[CompletionDelta, RemoteEngineClient] | None:
        """Prefill ``req`` on a prefill instance for its first token; None when none is left.

        The returned delta carries the token, and a finish reason only if the request ends there.
        """
        p = req.params
        params = msgspec.structs.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1))
        for attempt in itertools.count(1):
            client = self._pick_prefill(req=req)
            if client is None:
                self._prefix_from.pop(req.req_id, None)
                return None
            sub = msgspec.structs.replace(req, req_id=f"{req.req_id}~p{attempt}", params=params)
            source = self._prefix_from.pop(req.req_id, None)
            if source is not None and source is not client:
                await bring_prefix(
                    self.pool.prfaas, _kv_ids(req), source, client, sub.req_id, KV_CALL_TIMEOUT_S
                )
            try:
                await self._before_prefill(req, client)
                deltas = await self._run_prefill(req, client, sub)
            except EngineDeadError:
                if not self.pool.migrate:
                    raise
                self.counters.num_prefill_retries += 1
                logger.info("prefill of %s lost with %s; re-dispatching", req.req_id, client.name)
                continue
            tokens = [t for d in deltas for t in d.new_token_ids]
            last = deltas[-1]
            reason = last.finish_reason
            room = len(req.prompt_token_ids) + 1 < client.info.max_model_len
            if reason == "length" and (p.max_tokens is None or p.max_tokens > 1) and tokens and room:
                reason = None  # only our max_tokens=1 ended it: the decode instance continues
            delta = msgspec.structs.replace(
                last, req_id=req.req_id, new_token_ids=tokens, finish_reason=reason,
                stop_reason=last.stop_reason if reason else None,
                new_logprobs=_joined(deltas, "new_logprobs"), new_top_logprobs=_joined(deltas, "new_top_logprobs"),
                prompt_logprobs=_joined_prompt_logprobs(deltas),
            )  # fmt: skip
            return delta, client
        raise AssertionError("unreachable")

    async def _before_prefill(self, req: AddRequest, client: RemoteEngineClient) -> None:
        """Hook before ``req``'s prefill is sent to ``client`` (EPD: bring its image embeddings there)."""

    async def _after_kv_import(
        self, req: AddRequest, prefill: RemoteEngineClient, decode: RemoteEngineClient, result: KVImportResult
    ) -> None:
        """Hook after ``decode`` imported ``req``'s prompt KV from ``prefill`` (EPD: the embeddings of
        images the decode instance still computes past the imported blocks)."""

    async def _run_prefill(
        self, req: AddRequest, client: RemoteEngineClient, sub: AddRequest
    ) -> list[CompletionDelta]:
        """``_run``, with the monitor (dynamic PD, co-location) counting it in the instance's queue
        until its token."""
        monitor = self.pool.monitor
        if monitor is None or self._on_prfaas(client):  # (the monitor sees the local cluster only)
            return await self._run(req, client, sub)
        uncached = self._uncached(req).get(client.name, len(req.prompt_token_ids))
        monitor.prefill_sent(client.name, sub.req_id, uncached)
        got = False
        try:
            deltas = await self._run(req, client, sub)
            got = any(d.new_token_ids for d in deltas)
            return deltas
        finally:
            monitor.prefill_done(client.name, sub.req_id, got)

    def _uncached(self, req: AddRequest) -> dict[str, int]:
        """Per healthy instance, the prompt tokens its prefix cache does not hold."""
        request = self.pool.route_request(_kv_ids(req))
        matched = request.matched_blocks or {}
        block = self.pool.info.block_size
        n = len(req.prompt_token_ids)
        return {s.name: n - min(n - 1, matched.get(s.name, 0) * block) for s in self.pool.snapshots()}

    async def _run(
        self, req: AddRequest, client: RemoteEngineClient, sub: AddRequest
    ) -> list[CompletionDelta]:
        remote = (
            self.pool.prfaas.pool.track(req.req_id, client, sub.req_id) if self._on_prfaas(client) else None
        )
        with self.pool.track(req.req_id, client, sub.req_id), remote or contextlib.nullcontext():
            return [d async for d in client.generate(sub)]

    def _on_prfaas(self, client: RemoteEngineClient | None) -> bool:
        """Whether ``client`` is an instance of the PrfaaS cluster."""
        return self.pool.prfaas is not None and self.pool.prfaas.owns(client)

    # ------------------------------------------------------------------ KV handoff

    async def _export(
        self, req: AddRequest, client: RemoteEngineClient | None, first: int | None
    ) -> _Export | None:
        """Pin the prompt's KV on ``client`` (or, after a failure, on a prefill instance that redoes the
        prefill for it); None when no prefill instance can provide it (the decode side recomputes)."""
        kv_only = msgspec.structs.replace(
            req.params, max_tokens=1, min_tokens=0, logprobs=None, prompt_logprobs=None
        )
        for attempt in range(1, MAX_KV_ATTEMPTS + 1):
            if client is None:
                client = self._pick_prefill(req=req)
                if client is None:
                    return None
                sub = msgspec.structs.replace(req, req_id=f"{req.req_id}~r{attempt}", params=kv_only)
                try:
                    await self._run(req, client, sub)  # recompute the prompt's KV; the token is known
                except EngineDeadError:
                    client = None
                    continue
            export_id = f"{req.req_id}~x{attempt}"
            try:
                info = await client.kv_export(export_id, _kv_ids(req), KV_CALL_TIMEOUT_S, first)
                return _Export(client, export_id, info, first)
            except _KV_ERRORS as e:
                logger.info("KV export of %s from %s failed (%s)", req.req_id, client.name, e)
                if attempt == 1 and first is not None and self._store_decodes():  # it wrote the prompt
                    self.counters.num_store_restores += 1  # through: the decode side loads it from L3
                    return None
                self.counters.num_prefill_retries += 1
                client = None
        return None

    async def _import(
        self, req: AddRequest, export: _Export | None, prefer: str | None = None
    ) -> tuple[RemoteEngineClient | None, str]:
        """Pull the exported KV into a decode instance (first ``prefer``, when given and healthy);
        returns it (None: route later) and the decode request's id (its import pin)."""
        num_failed = 0
        try:
            for attempt in itertools.count(1):
                decode = self.pool.clients.get(prefer) if attempt == 1 and prefer else None
                decode = decode if decode is not None and decode.is_alive else self._pick_decode(req)
                sub_id = f"d{attempt}"
                if export is None or decode is None:
                    self.counters.num_fallbacks += 1
                    return decode, sub_id
                pin_id = f"{req.req_id}~{sub_id}"
                link = self.pool.prfaas if self._on_prfaas(export.client) else None  # across the PrfaaS link
                info, meter, expected = export.info, None, 0.0
                if link is not None:
                    meter = link.meter
                    expected = link.learn_export(
                        len(info.block_ids), info.block_bytes, info.num_layers, info.block_size
                    )
                try:
                    with (
                        self.pool.track(req.req_id, decode, pin_id, routed=False),
                        transfer(meter, expected) as t,
                    ):
                        result = await decode.kv_import(
                            export.info, _kv_ids(req), pin_id, KV_CALL_TIMEOUT_S, export.next_token_id
                        )
                        if t is not None:
                            t["bytes"], t["seconds"] = result.num_bytes, result.transfer_s
                except EngineDeadError:
                    continue  # the decode instance died: another one imports
                except _KV_ERRORS as e:  # the source is gone or broken: redo the prefill elsewhere
                    logger.info("KV import of %s into %s failed (%s)", req.req_id, decode.name, e)
                    self._release(export)
                    if "store" in decode.info.kv_tiers:  # P wrote the prompt through: D loads it from L3
                        export, self.counters.num_store_restores = None, self.counters.num_store_restores + 1
                        return decode, sub_id
                    num_failed += 1
                    self.counters.num_prefill_retries += 1
                    retry = num_failed < MAX_KV_ATTEMPTS and self._pick_prefill(not_=export.client)
                    first = export.next_token_id
                    export = await self._export(req, None, first) if retry else None
                    continue
                await self._after_kv_import(req, export.client, decode, result)
                self._release(export)
                export = None
                self._count_import(decode.name, result)
                return decode, sub_id
        finally:
            if export is not None:  # cancelled (client gone) or failed: P's pin is not needed
                self._release(export)
        raise AssertionError("unreachable")

    def _store_decodes(self) -> bool:
        """Decode instances load prompts from a KV store tier (``docs/kv_tiers.md``)."""
        return any("store" in c.info.kv_tiers for c in self.pool.clients.values())

    def _count_import(self, name: str, result: KVImportResult) -> None:
        """Per decode instance: blocks transferred and hit, bytes moved, a draft head's blocks moved."""
        counts = self.imported.setdefault(name, empty_import_counts())
        counts["blocks"] += result.num_transferred_blocks
        counts["hit_blocks"] += result.num_hit_blocks
        counts["bytes"] += result.num_bytes
        counts["head_blocks"] += result.num_head_blocks

    def _release(self, export: _Export) -> None:
        """Drop P's export pin in the background (it also expires on P by itself)."""

        async def release() -> None:
            try:
                await export.client.kv_release(export.export_id)
            except _KV_ERRORS:
                pass

        if export.client.is_alive:
            asyncio.get_running_loop().create_task(release())

    # ------------------------------------------------------------------ instance choice

    def _pick_prefill(
        self, not_: RemoteEngineClient | None = None, req: AddRequest | None = None
    ) -> RemoteEngineClient | None:
        prfaas = self.pool.prfaas
        if prfaas is not None and req is not None and req.priority != "offline":
            # a long uncached prompt prefills on the PrfaaS cluster (xservice/cluster/prfaas/router.py)
            uncached = [n for name, n in self._uncached(req).items() if self._prefills(name)]
            cached = len(req.prompt_token_ids) - min(uncached, default=len(req.prompt_token_ids))
            choice = prfaas.pick(_kv_ids(req), cached, not_.name if not_ is not None else None)
            if choice.prefix_from is not None:
                self._prefix_from[req.req_id] = choice.prefix_from
            if choice.client is not None:
                return choice.client
        colocation = self.pool.colocation
        if colocation is not None and req is not None and req.priority == "offline":
            name = colocation.pick_offline_prefill(not_.name if not_ is not None else None)
            if name is not None:  # (no relaxed instance left: as any request)
                return self.pool.clients.get(name)
        dynamic = self.pool.dynamic
        if dynamic is not None and req is not None:
            choice = dynamic.pick_prefill(req, self._uncached(req), not_.name if not_ is not None else None)
            return self.pool.clients.get(choice.name) if choice.name is not None else None
        snapshots = [s for s in self.pool.snapshots() if not_ is None or s.name != not_.name]
        name = self.policy.select_prefill(snapshots)
        return self.pool.clients[name] if name is not None else None

    def _prefills(self, name: str) -> bool:
        client = self.pool.clients.get(name)
        return client is not None and self.pool.role_of(name, client) == "prefill"

    def _pick_decode(self, req: AddRequest) -> RemoteEngineClient | None:
        dynamic = self.pool.dynamic
        if dynamic is not None:
            name = dynamic.pick_decode(req, None, len(req.prompt_token_ids) + 1).name
            return self.pool.clients.get(name) if name is not None else None
        request = self.pool.route_request(_kv_ids(req))
        name = self.policy.select_decode(request, self.pool.snapshots())
        return self.pool.clients[name] if name is not None else None


def _kv_ids(req: AddRequest) -> list[int]:
    """The prompt as the prefix caches key it: each image's pads by a key of its content hash."""
    return cache_token_ids(req.prompt_token_ids, req.images, req.params.lora_name, req.params.cache_salt)


def _joined(deltas: list[CompletionDelta], field: str) -> list | None:
    parts = [getattr(d, field) for d in deltas if getattr(d, field) is not None]
    return [x for part in parts for x in part] if parts else None


def _joined_prompt_logprobs(deltas: list[CompletionDelta]) -> PromptLogprobs | None:
    """The prompt logprobs of a prefill's deltas (a chunked prefill sends them chunk by chunk) as one."""
    parts = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    if not parts:
        return None
    return PromptLogprobs(
        start=parts[0].start,
        logprobs=[x for p in parts for x in p.logprobs],
        ranks=[x for p in parts for x in p.ranks],
        top=[x for p in parts for x in p.top],
    )
