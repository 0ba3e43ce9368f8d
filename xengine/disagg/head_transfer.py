"""PD transfer of a draft head's KV of the prompt (speculative decoding with ``mtp`` / ``eagle`` /
``eagle3``: ``xengine/spec/head_proposer.py``).

A head reads pairs (the target's hidden state at ``t``, the token at ``t + 1``). The decode instance
receives the prompt's KV but computes no hidden state of the prompt, so on its own its head would start
from the first token it computes and draft without the prompt. The prefill instance's head reads the
prompt's pairs while it is prefilled (and, when the request ends, the pairs it has left:
``HeadProposer.finish``) and caches their blocks under the pairs' keys. An export hands out as many of
those blocks as full-attention blocks it exports; the importer reads the ones its head's cache lacks
into its head's pool and caches them under the same keys, so its head resumes from them as it does
from a local prefix hit. Keying block ``j``'s pairs needs the token after it, which for the prompt's
last whole block is the token the prefill sampled (``next_token_id``).

An importer whose head differs (another method, another head: ``head_id``) ignores the blocks, and its
head starts from the first token it computes, as before: fewer drafts right, none wrong.
"""

from __future__ import annotations

import hashlib

import torch

from memory.kv_cache_manager import KVCacheManager
from memory.transfer import ExtraKV, KVRegion, KVTransferAgent, block_ranges
from xengine.api.messages import HeadExportMsg
from xengine.spec.head_proposer import pair_keys


def head_fingerprint(method: str, head: torch.nn.Module) -> str:
    """Names the head: its method and a digest of its parameters' shapes and first values (two
    instances that loaded the same head agree; two different heads almost surely do not)."""
    digest = hashlib.sha256(method.encode())
    for name, p in sorted(head.state_dict().items()):
        digest.update(f"{name}{tuple(p.shape)}".encode())
        if p.numel():
            digest.update(p.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
    return f"{method}:{digest.hexdigest()[:16]}"


class HeadTransfer(ExtraKV):
    """The draft head's pool's side of an export / import."""

    def __init__(self, kv: KVCacheManager, caches: list[torch.Tensor], head_id: str) -> None:
        super().__init__(caches)  # the head's layers' tensors
        self.kv = kv  # the head's pool (prefix caching on: it keys blocks by ``pair_keys``)
        self.head_id = head_id

    def _keys(self, token_ids: list[int], next_token_id: int | None, num_blocks: int) -> list[int] | None:
        """The keys of the pairs of ``num_blocks`` whole blocks, or None when the tokens do not reach
        (the last block's pairs read the token after it)."""
        tokens = token_ids + ([] if next_token_id is None else [next_token_id])
        n = num_blocks * self.kv.block_size
        return pair_keys(tokens[: n + 1]) if num_blocks and len(tokens) > n else None

    def export(
        self, session: str, token_ids: list[int], next_token_id: int | None, num_blocks: int
    ) -> tuple[HeadExportMsg | None, list[int]]:
        """Describe (and pin) the head's blocks of the prompt's first ``num_blocks`` whole blocks; None
        unless the head's cache holds all of them."""
        keys = self._keys(token_ids, next_token_id, num_blocks)
        cache = self.kv.prefix_cache
        if keys is None or cache is None:
            return None, []
        blocks = cache.match(keys, num_blocks).block_ids
        if len(blocks) < num_blocks:
            return None, []
        self.kv.pool.touch(blocks)
        region = self.region(session)
        msg = HeadExportMsg(
            head_id=self.head_id,
            layer_addrs=list(region.layer_addrs),
            num_blocks=region.num_blocks,
            block_bytes=region.block_bytes,
            block_ids=blocks,
        )
        return msg, blocks

    def import_(
        self,
        agent: KVTransferAgent,
        session: str,
        source: HeadExportMsg,
        token_ids: list[int],
        next_token_id: int | None,
    ) -> tuple[list[int], int, int]:
        """Read the blocks this head's cache lacks and cache them under the pairs' keys; returns the
        blocks to pin, and the blocks and bytes moved. Nothing when the heads differ or the pool is full."""
        mine = self.region(agent.region.session)
        cache = self.kv.prefix_cache
        keys = self._keys(token_ids, next_token_id, len(source.block_ids))
        same = (source.head_id, source.block_bytes, len(source.layer_addrs)) == (
            self.head_id,
            mine.block_bytes,
            len(mine.layer_addrs),
        )
        if keys is None or cache is None or not same:
            return [], 0, 0
        num = len(source.block_ids)
        hits = cache.match(keys, num).block_ids
        if num - len(hits) > self.kv.pool.num_free_blocks:
            return [], 0, 0  # all or nothing: a head resumes from every block or from none
        cache.lock(hits)
        new = self.kv.pool.allocate(num - len(hits))
        peer = KVRegion(session, list(source.layer_addrs), source.num_blocks, source.block_bytes)
        pairs = list(zip(source.block_ids[len(hits) :], new))
        src, dst, lengths = block_ranges(peer, mine, pairs) if pairs else ([], [], [])
        try:
            agent.read_ranges(session, src, dst, lengths)
        except BaseException:
            self.release(new + hits)
            raise
        blocks = hits + new
        cache.insert(keys[: num * self.kv.block_size], blocks, len(hits))
        return blocks, len(new), sum(lengths)

    def release(self, blocks: list[int]) -> None:
        if blocks:
            self.kv.pool.free(list(reversed(blocks)))
