"""KV memory: block pool, prefix caches, the KV cache manager the scheduler calls, KV layouts."""
