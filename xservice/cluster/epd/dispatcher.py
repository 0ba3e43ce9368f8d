"""EPD disaggregation, service side: image requests run their encode, prefill and decode stages on
instances chosen per stage (HydraInfer §4.4), by ``cluster.epd.strategy``:

- ``E+P+D``: an ``encode`` instance E encodes the images (``AddRequest.encode_only``: the embeddings
  stay in its image cache), a ``prefill`` instance P pulls them (``embed_export`` on E,
  ``embed_import`` on P: one-sided Mooncake reads into P's image cache, then ``embed_release`` on E)
  and prefills without encoding anything; then PD as usual: KV P→D, decode on a ``decode`` instance.
- ``EP+D``: the ``encode_prefill`` instance encodes and prefills (plain PD with the encode on P).
- ``ED+P``: an ``encode_decode`` instance ED encodes; the embeddings go ED→P, P prefills, its KV
  goes P→ED and ED decodes (it holds the images already, should its decode recompute image pads).

Text requests skip the encode stage: plain PD (``encode_prefill`` instances count as prefill,
``encode_decode`` ones as decode). Placement (``xservice/policies/epd/placement.py``) uses the
global image index (``image_index.py``): a prefill instance that holds every image is preferred (no
encode stage at all), else an encoder that holds them (no encode, only the transfer), else the
least-loaded encoder. When the decode instance recomputes image pads past the imported KV blocks
(an image in the prompt's partial last block), it also gets those embeddings from P.

Failures follow PD's rule (every token exactly once: the encode stage yields none): an encoder that
dies or fails (encode, export or transfer) leaves the request to P, which encodes the images itself;
P dying is PD's re-dispatch (the encode stage runs again for the next P).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import msgspec

from xengine.api.embed_messages import EmbedExportInfo
from xengine.api.image_keys import images_end
from xengine.api.messages import AddRequest, CompletionDelta, KVImportResult
from xservice.cluster.epd.image_index import ImageIndex
from xservice.cluster.pd import KV_CALL_TIMEOUT_S, PDDispatcher, PDPool
from xservice.cluster.remote_engine import RemoteEngineClient
from xservice.engine.errors import EngineDeadError
from xservice.policies import PDPolicy
from xservice.policies.epd.placement import select_by_images

logger = logging.getLogger(__name__)

ENCODER_ROLES = {"E+P+D": "encode", "ED+P": "encode_decode"}  # EP+D: the prefill instance encodes
_ERRORS = (EngineDeadError, RuntimeError, ValueError, TimeoutError, asyncio.TimeoutError)


@dataclass
class EPDCounters:
    num_image_requests: int = 0  # requests with images that ran disaggregated
    num_encodes: int = 0  # encode-only requests sent to an encoder
    num_encoder_hits: int = 0  # the encoder held every image already: no encode, only the transfer
    num_prefill_hits: int = 0  # the prefill instance held every image: no encode stage at all
    num_embed_imports: int = 0  # embedding transfers into a prefill (or decode) instance
    num_embed_bytes: int = 0
    num_encode_fallbacks: int = 0  # encoder failed or none left: the prefill instance encoded
    encode_s: float = 0.0  # summed: encode-only requests sent -> "encoded" (queue + encode + round trip)
    embed_transfer_s: float = 0.0  # summed: embedding imports (one-sided reads + caching, on the importer)
    encode_stage_s: float = 0.0  # summed: the whole stage before a prefill (encode, export, import, release)


class EPDDispatcher(PDDispatcher):
    def __init__(
        self, pool: PDPool, policy: PDPolicy, strategy: str, index: ImageIndex, match_weight: float = 2.0
    ) -> None:
        super().__init__(pool, policy)
        self.strategy = strategy
        self.index = index
        self.match_weight = match_weight
        self.epd = EPDCounters()
        self._encoder_of: dict[str, str] = {}  # req_id -> the encoder that holds its images (ED+P)

    def view(self) -> dict:
        return {"strategy": self.strategy, **asdict(self.epd)}

    async def generate(self, req: AddRequest) -> AsyncIterator[CompletionDelta]:
        if req.images:
            self.epd.num_image_requests += 1
        try:
            async for delta in super().generate(req):
                yield delta
        finally:
            self._encoder_of.pop(req.req_id, None)

    # ------------------------------------------------------------------ placement

    def _pick_prefill(
        self, not_: RemoteEngineClient | None = None, req: AddRequest | None = None
    ) -> RemoteEngineClient | None:
        """A prefill instance holding the request's images first (then no encode stage at all)."""
        if req is None or not req.images:
            return super()._pick_prefill(not_, req)
        hashes = _hashes(req)
        candidates = [
            s for s in self.pool.snapshots() if s.role == "prefill" and (not_ is None or s.name != not_.name)
        ]
        choice = select_by_images(candidates, self.index.held(hashes), len(hashes), self.match_weight)
        return self.pool.clients.get(choice.name) if choice is not None else None

    def _decode_target(self, req: AddRequest, prefill: RemoteEngineClient, context: int) -> str | None:
        """ED+P: the encode_decode instance that encoded the images decodes too (it holds them)."""
        encoder = self._encoder_of.get(req.req_id)
        if self.strategy == "ED+P" and encoder is not None:
            client = self.pool.clients.get(encoder)
            if client is not None and client.is_alive:
                return encoder
        return super()._decode_target(req, prefill, context)

    def _pick_encoder(self, hashes: list[str]) -> tuple[RemoteEngineClient, bool] | None:
        role = ENCODER_ROLES.get(self.strategy)
        if role is None:
            return None
        candidates = [s for s in self.pool.snapshots() if self.pool.clients[s.name].record.role == role]
        choice = select_by_images(candidates, self.index.held(hashes), len(hashes), self.match_weight)
        if choice is None:
            return None
        return self.pool.clients[choice.name], choice.holds_all

    # ------------------------------------------------------------------ the encode stage

    async def _before_prefill(self, req: AddRequest, client: RemoteEngineClient) -> None:
        """Bring the images' embeddings into the prefill instance ``client`` (an encoder encodes them
        when none holds them); on an encoder failure ``client`` encodes them itself."""
        if not req.images:
            return
        hashes = _hashes(req)
        if len(self.index.hashes_of(client.name) & set(hashes)) == len(hashes):
            self.epd.num_prefill_hits += 1
            return
        self.index.note(client.name, hashes)  # after its prefill it holds them, whoever encodes them
        picked = self._pick_encoder(hashes)
        if picked is None:
            if self.strategy in ENCODER_ROLES:
                self.epd.num_encode_fallbacks += 1  # no encoder left: P encodes
            return
        encoder, holds_all = picked
        self._encoder_of[req.req_id] = encoder.name
        t0 = time.perf_counter()
        try:
            await self._encode_and_move(req, encoder, holds_all, hashes, client)
        finally:
            self.epd.encode_stage_s += time.perf_counter() - t0

    async def _encode_and_move(
        self,
        req: AddRequest,
        encoder: RemoteEngineClient,
        holds_all: bool,
        hashes: list[str],
        client: RemoteEngineClient,
    ) -> None:
        try:
            if holds_all:
                self.epd.num_encoder_hits += 1
            else:
                await self._encode(req, encoder)
            info = await encoder.embed_export(f"{req.req_id}~ex", hashes, KV_CALL_TIMEOUT_S)
        except _ERRORS as e:
            logger.info(
                "encode of %s on %s failed (%s); %s encodes it", req.req_id, encoder.name, e, client.name
            )
            self.epd.num_encode_fallbacks += 1
            self._encoder_of.pop(req.req_id, None)
            return
        # (raises only when the prefill instance died: PD re-dispatches, and this stage runs again)
        await self._move_embeddings(req, encoder, f"{req.req_id}~ex", info, client)

    async def _encode(self, req: AddRequest, encoder: RemoteEngineClient) -> None:
        params = msgspec.structs.replace(
            req.params, max_tokens=0, min_tokens=0, logprobs=None, prompt_logprobs=None
        )
        sub = msgspec.structs.replace(req, req_id=f"{req.req_id}~e", params=params, encode_only=True)
        t0 = time.perf_counter()
        with self.pool.track(req.req_id, encoder, sub.req_id):
            deltas = [d async for d in encoder.generate(sub)]
        last = deltas[-1] if deltas else None
        if last is None or last.finish_reason != "encoded":
            raise RuntimeError(
                f"encode-only request ended with {last.finish_reason if last else None!r}: "
                f"{last.error if last else ''}"
            )
        self.epd.num_encodes += 1
        self.epd.encode_s += time.perf_counter() - t0
        self.index.note(encoder.name, _hashes(req))

    async def _move_embeddings(
        self,
        req: AddRequest,
        source: RemoteEngineClient,
        export_id: str,
        info: EmbedExportInfo,
        target: RemoteEngineClient,
    ) -> None:
        """``target`` pulls the exported embeddings (its own failure aside, errors leave it to encode
        what it lacks); ``source``'s pin is released either way."""
        try:
            with self.pool.track(req.req_id, target, f"{req.req_id}~ei", routed=False):
                result = await target.embed_import(info, KV_CALL_TIMEOUT_S)
            self.epd.num_embed_imports += 1
            self.epd.num_embed_bytes += result.num_bytes
            self.epd.embed_transfer_s += result.transfer_s
            self.index.note(target.name, [e.content_hash for e in info.entries])
        except _ERRORS as e:
            if isinstance(e, EngineDeadError) and not target.is_alive:
                raise
            logger.info("embedding import of %s into %s failed (%s)", req.req_id, target.name, e)
            self.epd.num_encode_fallbacks += 1  # the target encodes what it lacks
        finally:
            if source.is_alive:
                asyncio.get_running_loop().create_task(_release(source, export_id))

    async def _after_kv_import(
        self, req: AddRequest, prefill: RemoteEngineClient, decode: RemoteEngineClient, result: KVImportResult
    ) -> None:
        """The decode instance recomputes tokens from the end of the imported blocks: when an image
        ends past there and it lacks that image, it gets the embeddings from the prefill instance."""
        if not req.images or images_end(req.images) <= result.num_blocks * self.pool.info.block_size:
            return
        hashes = _hashes(req)
        if self.index.hashes_of(decode.name) >= set(hashes):
            return
        export_id = f"{req.req_id}~dx"
        try:
            info = await prefill.embed_export(export_id, hashes, KV_CALL_TIMEOUT_S)
            await self._move_embeddings(req, prefill, export_id, info, decode)
        except _ERRORS as e:  # the decode instance then encodes what it lacks
            logger.info("embeddings of %s for decode on %s not moved (%s)", req.req_id, decode.name, e)


def _hashes(req: AddRequest) -> list[str]:
    return list(dict.fromkeys(im.content_hash for im in req.images or ()))


async def _release(client: RemoteEngineClient, export_id: str) -> None:
    try:
        await client.embed_release(export_id)
    except _ERRORS:
        pass  # the pin expires on the instance by itself
