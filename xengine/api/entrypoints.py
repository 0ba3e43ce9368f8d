"""The engine's process entry points, as ``python -m`` module names (torch-free).

The service starts engine processes by these names (single node: one engine process connecting to
sockets the service bound; cluster: an engine server that binds its own sockets and registers), so
they are part of the contract between the two layers and named in one place.
"""

ENGINE_PROC_MODULE = "xengine.process.engine_proc"  # single node: the service's own engine process
ENGINE_SERVER_MODULE = "xengine.process.engine_server"  # cluster: an instance that registers in the store
KV_STORE_MODULE = "xengine.process.kv_store_server"  # the cluster KV store: mooncake_master and its memory
