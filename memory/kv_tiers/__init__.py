"""KV tiers behind the prefix cache: L2 host memory, L3 a local disk arena and the Mooncake Store.

The engine's KV pool is L1. Blocks move between the tiers as *records* (every layer's K and V of one
block, as bytes: ``records.py``) keyed by the chained block hash the cluster already names prefixes by
(``xengine/api/block_hash.py``), so a prefix one instance stored is found by another. ``TierStack``
(``stack.py``) applies the write policy over the tiers; ``TierWorker`` (``worker.py``) runs every tier
call on a thread of its own, off the engine loop. See ``docs/kv_tiers.md``.
"""
