"""The engine as a process: ZMQ I/O around an ``Engine`` (``engine_proc``: one service's engine;
``engine_server``: a cluster instance that registers itself), and the cluster agents that publish
its load, KV events and cached images. See
``docs/cluster.md``."""
