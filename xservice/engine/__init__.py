"""The seam between the service and an engine: ``EngineBackend`` (``protocol.py``) and its single-node
implementations, the socket client of one engine process (``client.py``, its process in ``process.py``)
and the supervised engine that restarts it (``supervised.py``); the cluster's ``InstancePool``
(``xservice/cluster/pool.py``) is the third. See ``docs/architecture.md`` and ``docs/operations.md``.
"""
