"""The chained KV block hash: the one name of a block of prompt tokens that every layer agrees on.

``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = 0`` (BLAKE2b-64 keyed by the parent), so one
hash names a whole prefix. The engine's prefix cache publishes these hashes as KV-cache events
(``memory/prefix_cache/radix.py``) and the service's global prefix index matches prompts against them
(``xservice/cluster/kv_index.py``); both import this module, so the two can never disagree.
Stdlib only, as all of the torch-free contract is (``docs/cluster.md``, "Block hash").
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Hash of one block of ``token_ids`` chained onto its parent block's hash (0 for the first)."""
    h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=8, key=parent.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    out, parent = [], 0
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
